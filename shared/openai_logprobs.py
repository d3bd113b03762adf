"""The job API's logprobs (shared/logprobs.py) in OpenAI's shapes: `/v1/completions` (`logprobs: N`, `echo`)
and `/v1/chat/completions` (`logprobs: true`, `top_logprobs: N`), whole answers and stream chunks alike."""

from pydantic import BaseModel

from shared.logprobs import TokenLogprob

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions `logprobs`
MAX_CHAT_TOP_LOGPROBS = 20  # ... and for chat `top_logprobs`


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]  # token text -> logprob, the N most likely
    text_offset: list[int]  # where each token starts: the sum of the token texts before it


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


def completion_logprobs(tokens: list[TokenLogprob], first_offset: int = 0) -> CompletionLogprobs:
    """`tokens` (an echoed prompt's, then the output's) in the completions shape; offsets from `first_offset`."""
    offsets, offset = [], first_offset
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return CompletionLogprobs(
        tokens=[t.token for t in tokens],
        token_logprobs=[t.logprob for t in tokens],
        top_logprobs=[_by_text(t) if t.logprob is not None else None for t in tokens],
        text_offset=offsets,
    )


def _by_text(t: TokenLogprob) -> dict[str, float]:
    """token text -> logprob of the alternatives; tokens that read the same keep the most likely one's."""
    by_text: dict[str, float] = {}
    for top in t.top_logprobs:
        by_text.setdefault(top.token, top.logprob)
    return by_text


def chat_logprobs(tokens: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=t.token,
                logprob=t.logprob or 0.0,  # output tokens always have one
                bytes=t.bytes,
                top_logprobs=[ChatTopLogprob(token=x.token, logprob=x.logprob, bytes=x.bytes) for x in t.top_logprobs],
            )
            for t in tokens
        ]
    )
