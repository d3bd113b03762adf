"""The target model's log-probabilities as the job API carries them (workers/engine/logprobs.py computes them;
the worker names the tokens; shared/openai_logprobs.py turns them into OpenAI's shapes).

A job asks with `logprobs: N` (each generated token's logprob and its N most likely alternatives, 0..20) and
`prompt_logprobs: N` (the same for every prompt token but the first, which has none). Values are the target's
raw log-softmax (before temperature, top-k, top-p), the same with speculation on or off.
"""

from pydantic import BaseModel, Field

MAX_TOP_LOGPROBS = 20


class TopLogprob(BaseModel):
    token: str  # the token's text alone (a part of a UTF-8 character reads as U+FFFD; see bytes)
    token_id: int
    logprob: float
    bytes: list[int] = Field(default_factory=list)  # the token's bytes (workers/worker/logprobs.py)


class TokenLogprob(TopLogprob):
    logprob: float | None = None  # type: ignore[assignment]  # None: a prompt's first token (nothing scores it)
    top_logprobs: list[TopLogprob] = Field(default_factory=list)  # most likely first
