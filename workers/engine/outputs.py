"""What Engine.step() hands back for each request it advanced."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the target (workers/engine/logprobs.py)."""

    token_id: int
    logprob: float | None  # the target's log-softmax of its raw logits here; None: a prompt's first token
    top: tuple[tuple[int, float], ...] = ()  # the N most likely (token id, logprob), most likely first


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]  # tokens appended this step (more than one when speculation accepts a run)
    new_text: str  # text that became final this step (never half a UTF-8 character, never part of a stop string)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)  # filled when finished: ttft_ms, tokens_per_s, ...
    new_logprobs: list[TokenLogprob] | None = None  # with params.logprobs: [len(new_token_ids)]; else None
    # with params.prompt_logprobs, on the step of the first new token: [num_prompt_tokens] (the first: logprob None)
    prompt_logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0  # prompt tokens its first admission took from the prefix cache (prefix_cache.py)
