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


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character -> the byte it stands for (GPT-2's scheme: printable
    Latin-1 bytes stand for themselves, the other bytes for the characters from U+0100 on, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            alphabet[chr(256 + extra)] = b
            extra += 1
    return alphabet


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        return backend is not None and json.loads(backend.to_str())["decoder"]["type"] == "ByteLevel"
    except (KeyError, TypeError, ValueError):
        return False


class TokenTexts:
    """Token id -> its text and bytes, through the model's tokenizer (cached). A byte-level BPE token's bytes
    are its own (a part of a UTF-8 character too, whose text reads U+FFFD); otherwise its text's UTF-8."""

    def __init__(self, tokenizer: Any) -> None:
        alphabet = _byte_level_alphabet() if _is_byte_level(tokenizer) else None

        def name(token_id: int) -> tuple[str, tuple[int, ...]]:
            text = str(tokenizer.decode([token_id], skip_special_tokens=False))
            piece = tokenizer.convert_ids_to_tokens(token_id) if alphabet is not None else None
            if isinstance(piece, str) and piece and all(c in alphabet for c in piece):  # type: ignore[operator]
                return text, tuple(alphabet[c] for c in piece)  # type: ignore[index]
            return text, tuple(text.encode())

        self._name = lru_cache(maxsize=TOKEN_CACHE_SIZE)(name)

    def text(self, token_id: int) -> str:
        return self._name(token_id)[0]

    def bytes_of(self, token_id: int) -> list[int]:
        return list(self._name(token_id)[1])

    def named(self, lp: engine_outputs.TokenLogprob) -> TokenLogprob:
        """One engine logprob, its token and alternatives named."""
        tops = [
            TopLogprob(token=self.text(top_id), token_id=top_id, logprob=top_logprob, bytes=self.bytes_of(top_id))
            for top_id, top_logprob in lp.top
        ]
        return TokenLogprob(
            token=self.text(lp.token_id),
            token_id=lp.token_id,
            logprob=lp.logprob,
            bytes=self.bytes_of(lp.token_id),
            top_logprobs=tops,
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
