"""The engine's logprobs (token ids and floats) -> the job API's (shared/logprobs.py: tokens named), per job.

A job that asked for logprobs keeps them for its whole attempt: each step's go out with its token event (SSE
and OpenAI streams), and all of them are written into the job hash when it succeeds (`output.logprobs`,
`output.prompt_logprobs`). A job resumed by another worker after a crash has no logprobs for the tokens
the earlier attempt wrote, so its record then carries none (its token events still do).
"""

import json
from functools import lru_cache
from typing import Any

from shared.logprobs import TokenLogprob, TopLogprob
from workers.engine import outputs as engine_outputs

TOKEN_CACHE_SIZE = 65_536


class TokenTexts:
    """Token id -> its text and UTF-8 bytes, through the model's tokenizer (cached)."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = lru_cache(maxsize=TOKEN_CACHE_SIZE)(
            lambda token_id: str(tokenizer.decode([token_id], skip_special_tokens=False))
        )

    def text(self, token_id: int) -> str:
        return str(self._decode(token_id))

    def named(self, lp: engine_outputs.TokenLogprob) -> TokenLogprob:
        """One engine logprob, its token and alternatives named."""
        text = self.text(lp.token_id)
        tops = []
        for top_id, top_logprob in lp.top:
            top_text = self.text(top_id)
            tops.append(TopLogprob(token=top_text, token_id=top_id, logprob=top_logprob, bytes=list(top_text.encode())))
        return TokenLogprob(
            token=text, token_id=lp.token_id, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=tops
        )


class JobLogprobs:
    """One job's logprobs in this attempt."""

    def __init__(self, texts: TokenTexts, num_prompt_tokens: int, is_resumed: bool) -> None:
        self.texts = texts
        self.num_prompt_tokens = num_prompt_tokens  # of the job's prompt (a resumed attempt's is longer)
        self.is_complete = not is_resumed  # False: earlier tokens' logprobs are not here
        self.tokens: list[TokenLogprob] = []
        self.prompt: list[TokenLogprob] | None = None

    def add(self, out: engine_outputs.StepOutput) -> tuple[list[TokenLogprob] | None, list[TokenLogprob] | None]:
        """This step's output -> (its tokens' logprobs, the prompt's when this step carries them)."""
        new = [self.texts.named(lp) for lp in out.new_logprobs] if out.new_logprobs is not None else None
        self.tokens += new or []
        prompt = None
        if out.prompt_logprobs is not None:
            prompt = [self.texts.named(lp) for lp in out.prompt_logprobs[: self.num_prompt_tokens]]
            self.prompt = prompt
        return new, prompt

    def record_fields(self, wants_tokens: bool) -> list[str]:
        """The job hash fields written when it succeeds: logprobs (when complete), prompt_logprobs."""
        fields = []
        if wants_tokens and self.is_complete:
            fields += ["logprobs", _json(self.tokens)]
        if self.prompt is not None:
            fields += ["prompt_logprobs", _json(self.prompt)]
        return fields


def _json(values: list[TokenLogprob]) -> str:
    return json.dumps([v.model_dump(mode="json") for v in values], separators=(",", ":"))
