"""Per-key limits, enforced atomically in Redis by ONE script per submit: requests and tokens per
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

from redis.asyncio import Redis

from shared import keys
from shared.api_keys import ApiKey
from shared.job_state import TERMINAL
from shared.settings import ServiceSettings

CHARS_PER_TOKEN = (
    4  # the prompt estimate reserved at submit (OpenAI's rule of thumb), corrected on completion
)

_TERMINAL = "{" + ", ".join(f"['{s.value}']=true" for s in TERMINAL) + "}"

# KEYS: rate-limit state hash, in-flight hash.
# ARGV: job_prefix period_s requests_limit tokens_limit concurrency_limit job_id cost inflight_ttl_s
# -> {admitted 0|1, refused_by ('' | requests | tokens | concurrency), retry_after_ms,
#     remaining_requests, remaining_tokens, reset_requests_ms, reset_tokens_ms}   (numbers as strings)
ADMIT = (
    f"local TERMINAL = {_TERMINAL}\n"
    + """
local state, inflight = KEYS[1], KEYS[2]
local jprefix, period = ARGV[1], tonumber(ARGV[2])
local rpm, tpm, maxc = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local job_id, cost = ARGV[6], tonumber(ARGV[7])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rtat = tonumber(redis.call('HGET', state, 'requests_tat') or '0')
local ttat = tonumber(redis.call('HGET', state, 'tokens_tat') or '0')
local rT = rpm > 0 and period / rpm or 0
local tT = tpm > 0 and period / tpm or 0

-- settle: finished jobs leave; their reservation becomes what they used. Only a key with a token or
-- concurrency limit tracks in-flight jobs: an unlimited key's submits stay O(1) however much it has queued
local tracks = tT > 0 or maxc > 0
local held = tracks and redis.call('HGETALL', inflight) or {}
local running = 0
for i = 1, #held, 2 do
  local jid, reserved = held[i], tonumber(held[i + 1])
  local st, pt, ct = unpack(redis.call('HMGET', jprefix .. jid, 'status', 'prompt_tokens', 'completion_tokens'))
  if (not st) or TERMINAL[st] then
    redis.call('HDEL', inflight, jid)
    if st and tT > 0 then
      local delta = ((tonumber(pt) or 0) + (tonumber(ct) or 0) - reserved) * tT
      if delta < 0 then ttat = math.max(now, ttat + delta) else ttat = math.max(now, ttat) + delta end
    end
  else
    running = running + 1
  end
end

local rnew = math.max(rtat, now) + rT
local tnew = math.max(ttat, now) + cost * tT
local refused, wait = '', 0
if rT > 0 and rnew - now > period then refused, wait = 'requests', rnew - now - period end
if tT > 0 and tnew - now > period and tnew - now - period > wait then refused, wait = 'tokens', tnew - now - period end
if refused == '' and maxc > 0 and running >= maxc then refused = 'concurrency' end

local admitted = 0
if refused == '' then
  admitted = 1
  rtat, ttat = rnew, tnew
  if tracks then redis.call('HSET', inflight, job_id, cost) end
end
redis.call('HSET', state, 'requests_tat', tostring(rtat), 'tokens_tat', tostring(ttat))
redis.call('PEXPIRE', state, math.ceil((math.max(rtat, ttat, now) - now + period) * 1000))
redis.call('EXPIRE', inflight, ARGV[8])

local function remaining(tat, T)
  if T == 0 then return -1 end
  return math.floor((period - math.max(tat - now, 0)) / T + 1e-9)
end
return {tostring(admitted), refused, tostring(math.ceil(wait * 1000)),
  tostring(remaining(rtat, rT)), tostring(remaining(ttat, tT)),
  tostring(math.ceil(math.max(rtat - now, 0) * 1000)), tostring(math.ceil(math.max(ttat - now, 0) * 1000))}
"""
)

# Release an admitted job that was never created. KEYS: state hash, in-flight hash. ARGV: job_id period tpm
RELEASE = """
local reserved = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
redis.call('HDEL', KEYS[2], ARGV[1])
local tpm = tonumber(ARGV[3])
if tpm > 0 and reserved > 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
  local tat = tonumber(redis.call('HGET', KEYS[1], 'tokens_tat') or '0')
  redis.call('HSET', KEYS[1], 'tokens_tat', tostring(math.max(now, tat - reserved * tonumber(ARGV[2]) / tpm)))
end
return 'ok'
"""


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
    def __init__(self, redis: Redis, settings: ServiceSettings) -> None:
        self.settings = settings
        self._admit = redis.register_script(ADMIT)
        self._release = redis.register_script(RELEASE)

    async def admit(self, key: ApiKey, job_id: str, cost: int) -> Decision:
        period_s = self.settings.rate_limit_period_s
        raw = await self._admit(
            keys=[keys.rate_limit_state(key.id), keys.inflight_jobs(key.id)],
            args=[
                keys.JOB_PREFIX,
                repr(period_s),
                key.requests_per_min,
                key.tokens_per_min,
                key.max_concurrent_jobs,
                job_id,
                cost,
                keys.INFLIGHT_TTL_S,
            ],
        )
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

    async def release(self, key: ApiKey, job_id: str) -> None:
        await self._release(
            keys=[keys.rate_limit_state(key.id), keys.inflight_jobs(key.id)],
            args=[job_id, repr(self.settings.rate_limit_period_s), key.tokens_per_min],
        )
