"""Per-key limits, enforced atomically in Redis by ONE script per submit (the admit() part of AUTH_ADMIT_SUBMIT
in shared/lua.py: the key, its limits and the job in one round trip): requests and tokens per
`rate_limit_period_s` (GCRA, a leaky bucket that allows a full period's worth at once) and concurrent jobs.

    settle:  every job of the key in keys.inflight_jobs that has finished (or vanished) leaves it; its token
             reservation is corrected to what it used (prompt_tokens + completion_tokens of its hash)
    check:   requests: max(tat, now) + 1 * period/limit - now <= period      (tat: theoretical arrival time)
             tokens:   max(tat, now) + cost * period/limit - now <= period   (cost: prompt estimate + max_tokens)
             concurrency: jobs still in flight < max_concurrent_jobs
    admit:   both tats advance, the job joins the in-flight hash with its reservation

A refusal says which limit and when to retry (Retry-After: whole seconds until the request would pass). A job
that is never created after admission (queue full, idempotent replay, 413) is released at once.
The correction happens at the key's next submit, the only moment a limit is checked, so no worker hook is
needed and a job finished by any path (done, cancelled, expired, dead-lettered) is settled the same way.
"""

import math
from dataclasses import dataclass

from shared.api_keys import ApiKey
from shared.settings import ServiceSettings

CHARS_PER_TOKEN = (
    4  # the prompt estimate reserved at submit (OpenAI's rule of thumb), corrected on completion
)

@dataclass
class Decision:
    admitted: bool
    refused_by: str  # '' | 'requests' | 'tokens' | 'concurrency'
    retry_after_s: int  # whole seconds; 0 when admitted
    headers: dict[str, str]  # x-ratelimit-* (and Retry-After when refused)


def _duration(ms: int) -> str:
    """OpenAI's reset format: `1s`, `6m0s`, `350ms`."""
    if ms < 1000:
        return f"{ms}ms"
    seconds = math.ceil(ms / 1000)
    return f"{seconds // 60}m{seconds % 60}s" if seconds >= 60 else f"{seconds}s"


def estimate_tokens(text_chars: int, max_tokens: int) -> int:
    """Tokens reserved at submit: the prompt estimated from its length, plus every token it may generate."""
    return math.ceil(text_chars / CHARS_PER_TOKEN) + max_tokens


class RateLimiter:
    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings

    def decision(self, key: ApiKey, raw: list[object]) -> Decision:
        """admit()'s answer (AUTH_ADMIT_SUBMIT in shared/lua.py) -> the decision and its x-ratelimit-* headers."""
        admitted, refused_by, wait_ms, left_req, left_tok, reset_req_ms, reset_tok_ms = (str(v) for v in raw)
        headers: dict[str, str] = {}
        if key.requests_per_min:
            headers["x-ratelimit-limit-requests"] = str(key.requests_per_min)
            headers["x-ratelimit-remaining-requests"] = str(max(int(left_req), 0))
            headers["x-ratelimit-reset-requests"] = _duration(int(reset_req_ms))
        if key.tokens_per_min:
            headers["x-ratelimit-limit-tokens"] = str(key.tokens_per_min)
            headers["x-ratelimit-remaining-tokens"] = str(max(int(left_tok), 0))
            headers["x-ratelimit-reset-tokens"] = _duration(int(reset_tok_ms))
        if key.max_concurrent_jobs:
            headers["x-ratelimit-limit-concurrent-jobs"] = str(key.max_concurrent_jobs)
        retry_after_s = 0
        if admitted != "1":
            retry_after_s = (
                self.settings.retry_after_s
                if refused_by == "concurrency"
                else max(1, math.ceil(int(wait_ms) / 1000))
            )
            headers["Retry-After"] = str(retry_after_s)
        return Decision(admitted == "1", refused_by, retry_after_s, headers)
