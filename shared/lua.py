"""The atomic steps of the job protocol, as Lua scripts run inside Redis (one round trip each).

Every status change goes through these scripts, and each checks it against `shared.job_state.TRANSITIONS`
(rendered into the Lua prelude as the `*_FROM` sets), so a job is started, finished, cancelled or expired
exactly once however gateways and workers race. Key names come from `shared.keys`: as KEYS, or as the
prefixes in `ctx` where a script derives a job's keys from a job id it read from a stream.

Job hash fields: id status priority created_at expires_at started_at completed_at request metadata
entry (its current queue entry id) attempt (starts so far; an emit or finish must quote the current one)
deliveries (starts not handed back; past max_deliveries -> dead letter) worker text token_ids (csv: the output
when the job last ended; a started job's new tokens go to the strings keys.job_output_text / _ids, folded in
when it ends: READ_JOB reads the whole)
prompt_tokens completion_tokens finish_reason metrics (json) error (json) retried_at (`specfleet dlq retry`)
model_version (of the worker that started it: settings.model_version).
"""

import json
from dataclasses import dataclass
from typing import cast

from shared import keys
from shared.job_state import TERMINAL, JobStatus, sources_of


def _lua_set(name: str, statuses: list[JobStatus]) -> str:
    return "local {} = {{{}}}\n".format(name, ", ".join(f"['{s.value}']=true" for s in statuses))


_OUTPUT_OF = """
-- A job's output so far (text, token ids csv): the hash's (what it had when it last ended: a retried job's
-- earlier output) followed by what it emitted since (the strings text_key and ids_key, keys.job_output_text and
-- _ids, which each step APPENDs to: a step writes its new tokens only, not the whole output again)
local function output_of(job, text_key, ids_key)
  local text, ids = unpack(redis.call('HMGET', job, 'text', 'token_ids'))
  local new_text, new_ids = redis.call('GET', text_key), redis.call('GET', ids_key)
  text, ids = text or '', ids or ''
  if new_ids and new_ids ~= '' then
    if ids ~= '' then ids = ids .. ',' .. new_ids else ids = new_ids end
  end
  return text .. (new_text or ''), ids
end
"""

PRELUDE = (
    "".join(f"local S_{s.name} = '{s.value}'\n" for s in JobStatus)
    + _lua_set("RUNNING_FROM", sources_of(JobStatus.RUNNING))
    + _lua_set("QUEUED_FROM", sources_of(JobStatus.QUEUED))
    + _lua_set("SUCCEEDED_FROM", sources_of(JobStatus.SUCCEEDED))
    + _lua_set("FAILED_FROM", sources_of(JobStatus.FAILED))
    + _lua_set("CANCELLED_FROM", sources_of(JobStatus.CANCELLED))
    + _lua_set("EXPIRED_FROM", sources_of(JobStatus.EXPIRED))
    + """
local FINISH_FROM = {[S_SUCCEEDED]=SUCCEEDED_FROM, [S_FAILED]=FAILED_FROM, [S_CANCELLED]=CANCELLED_FROM,
  [S_EXPIRED]=EXPIRED_FROM}

local function now()
  local t = redis.call('TIME')
  return string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1e6)
end

-- Append an event to the job's stream and announce it on the job's channel. The announcement carries the event
-- and the id of the entry before it (`prev`, `id`, `type`, `data`, joined by newlines), so a gateway that has
-- read up to `prev` appends it without reading the stream; an event over ctx.wake_max_bytes is announced as a
-- bare '1' (read the stream).
local function event(ctx, events, job_id, ev_type, ev_data)
  local last = redis.call('XREVRANGE', events, '+', '-', 'COUNT', 1)
  local id = redis.call('XADD', events, 'MAXLEN', '~', ctx.maxlen, '*', 'type', ev_type, 'data', ev_data)
  local wake = '1'
  if #ev_data <= (tonumber(ctx.wake_max_bytes) or -1) then
    local prev = ''
    if last[1] then prev = last[1][1] end
    wake = prev .. '\\n' .. id .. '\\n' .. ev_type .. '\\n' .. ev_data
  end
  redis.call('PUBLISH', ctx.chprefix .. job_id, wake)
  return id
end

local function drop_entry(ctx, queue, entry)
  redis.call('XACK', queue, ctx.group, entry)
  redis.call('XDEL', queue, entry)
end

""" + _OUTPUT_OF + """
-- At a job's end its output moves into the hash (one copy, once), and the strings go
local function fold_output(ctx, job)
  local text_key, ids_key = job .. ctx.textsuffix, job .. ctx.idssuffix
  if redis.call('EXISTS', text_key, ids_key) == 0 then return end
  local text, ids = output_of(job, text_key, ids_key)
  redis.call('HSET', job, 'text', text, 'token_ids', ids)
  redis.call('DEL', text_key, ids_key)
end

-- Move job `job_id` to terminal status `to` if its status allows it and (when given) `attempt` is current:
-- ack + delete its queue entry, fold its output into the hash, append the final event, start the result TTL,
-- wake the streamers.
local function finish(ctx, job_id, to, attempt, fields, ev_type, ev_data)
  local job = ctx.jprefix .. job_id
  local st, at, entry, prio, notice = unpack(redis.call('HMGET', job, 'status', 'attempt', 'entry', 'priority',
    'completed_notice'))
  if not st then return 'missing' end
  if not FINISH_FROM[to][st] then return st end
  if attempt and at ~= attempt then return 'lost' end
  fold_output(ctx, job)
  redis.call('HSET', job, 'status', to, 'completed_at', now(), unpack(fields))
  if entry then drop_entry(ctx, ctx.qprefix .. prio, entry) end
  local events = job .. ctx.evsuffix
  event(ctx, events, job_id, ev_type, ev_data)
  -- outbox notice for the Celery side (webhooks, batches), atomic with the transition; none for a job nothing
  -- there acts on (submit()'s completed_notice '0')
  if notice ~= '0' then
    redis.call('XADD', ctx.outbox, 'MAXLEN', '~', ctx.outbox_maxlen, '*', 'kind', 'job', 'id', job_id,
      'event', 'completed', 'status', to)
  end
  redis.call('EXPIRE', job, ctx.ttl)
  redis.call('EXPIRE', events, ctx.ttl)
  return 'ok'
end

-- ARGV[1] of every script below is the json context: group, jprefix, evsuffix, chprefix, qprefix, maxlen, ttl,
-- outbox, outbox_maxlen, and the prefixes of a key's Idempotency-Keys and limit state (idemprefix, rlprefix,
-- inflightprefix: + the key id)
local ctx = cjson.decode(ARGV[1])
"""
)


WAKE_MAX_BYTES = 4096  # an event whose data is longer is announced as a bare wake-up (the follower reads it)


@dataclass(frozen=True)
class EventWake:
    """What a job channel's message says (PRELUDE's `event`): the event appended, and the id of the entry before
    it in the job's stream ('' when it is the first)."""

    prev_id: str
    id: str
    type: str
    data: str


def entry_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id `<ms>-<seq>` as a sortable key (ValueError when it is not one)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def parse_event_wake(payload: str) -> EventWake | None:
    """A job channel message -> the event it carries; None for a bare wake-up ('1': read the stream)."""
    parts = payload.split("\n", 3)
    if len(parts) != 4:
        return None
    return EventWake(*parts)


def context(maxlen: int, ttl_s: int, partition: int = 0, jobs_listed: int = keys.JOBS_LISTED_PER_KEY) -> str:
    """ARGV[1] of every script run on one partition's keys (shared/keys.py): its key prefixes, the global
    channels, the event cap, the result TTL and how many jobs a key's listing keeps. A script touches one
    partition only: one hash tag, one slot."""
    return json.dumps(
        {
            "group": keys.CONSUMER_GROUP,
            "jprefix": keys.job_prefix(partition),
            "evsuffix": keys.EVENTS_SUFFIX,
            "textsuffix": keys.OUTPUT_TEXT_SUFFIX,
            "idssuffix": keys.OUTPUT_IDS_SUFFIX,
            "chprefix": keys.CHANNEL_PREFIX,
            "qprefix": keys.queue_stream("", partition),
            "cancel_channel": keys.CANCEL_CHANNEL,
            "queued_channel": keys.QUEUED_CHANNEL,
            "outbox": keys.outbox_stream(partition),
            "outbox_maxlen": str(keys.OUTBOX_MAXLEN),
            "idemprefix": keys.idempotency("", partition),
            "rlprefix": keys.rate_limit_prefix(partition),
            "inflightprefix": keys.inflight_prefix(partition),
            "jobsofprefix": keys.jobs_of_prefix(partition),
            "jobs_listed": str(jobs_listed),
            "jobs_listed_ttl": str(keys.INFLIGHT_TTL_S + ttl_s),  # outlives the newest job's record
            "maxlen": str(maxlen),
            "wake_max_bytes": WAKE_MAX_BYTES,
            "ttl": str(ttl_s),
        }
    )


def contexts(maxlen: int, ttl_s: int, num_partitions: int, jobs_listed: int = keys.JOBS_LISTED_PER_KEY) -> list[str]:
    """context() of every partition, by partition."""
    return [context(maxlen, ttl_s, p, jobs_listed) for p in range(num_partitions)]


# Queue a job (and tell the busy workers on ctx.queued_channel: they pull only when told or due).
# submit(job hash, queue stream, idempotency key, job_id, priority, ttl_s, request_json, metadata_json, max_depth,
#        idem_ttl_s, use_idem(0/1), owner(the API key id that owns the job; '': none), request_hash,
#        completed_notice(1: finish() tells the Celery side through the outbox; 0: nothing there acts on its end))
# -> {'dup', job_id, request_hash of the job's request ('' from older entries)} | {'full', depth} | {'ok', job_id, created_at}
_SUBMIT_FN = """
local function submit(job, queue, idem, job_id, priority, ttl_s, request, metadata, max_depth, idem_ttl, use_idem,
                      owner, request_hash, completed_notice)
  if use_idem == '1' then
    local existing = redis.call('GET', idem)  -- '<job id>:<request hash>'
    if existing then
      local sep = string.find(existing, ':', 1, true)
      if sep then return {'dup', string.sub(existing, 1, sep - 1), string.sub(existing, sep + 1)} end
      return {'dup', existing, ''}
    end
  end
  local depth = redis.call('XLEN', queue)
  if depth > 0 then
    local ok, pending = pcall(redis.call, 'XPENDING', queue, ctx.group)
    if ok then depth = depth - pending[1] end
  end
  if depth >= tonumber(max_depth) then return {'full', tostring(depth)} end
  local created = now()
  local entry = redis.call('XADD', queue, '*', 'id', job_id)
  redis.call('HSET', job, 'id', job_id, 'status', S_QUEUED, 'priority', priority, 'created_at', created,
    'expires_at', string.format('%.6f', tonumber(created) + tonumber(ttl_s)), 'request', request,
    'metadata', metadata, 'entry', entry, 'attempt', '0', 'deliveries', '0', 'completion_tokens', '0')
  -- only '0' is written: a job stored without the field (by an older gateway) gets its notice, as it did then
  if completed_notice == '0' then redis.call('HSET', job, 'completed_notice', '0') end
  if owner and owner ~= '' then
    redis.call('HSET', job, 'owner', owner)
    local listed = tonumber(ctx.jobs_listed or '0')
    if ctx.jobsofprefix and listed > 0 then  -- the owner's listing (GET /v1/jobs): its newest `listed` jobs
      local index = ctx.jobsofprefix .. owner
      redis.call('ZADD', index, created, job_id)
      redis.call('ZREMRANGEBYRANK', index, 0, -listed - 1)
      redis.call('EXPIRE', index, ctx.jobs_listed_ttl)
    end
  end
  if use_idem == '1' then redis.call('SET', idem, job_id .. ':' .. request_hash, 'EX', idem_ttl) end
  if ctx.queued_channel then redis.call('PUBLISH', ctx.queued_channel, priority .. ' ' .. entry) end
  return {'ok', job_id, created}
end
"""

# KEYS: job hash, queue stream, idempotency key.  ARGV: ctx job_id priority ttl_s request_json metadata_json
# max_depth idem_ttl_s use_idem(0/1) owner request_hash completed_notice(1/0) -> submit()'s answer (above)
SUBMIT = (
    PRELUDE
    + _SUBMIT_FN
    + """
return submit(KEYS[1], KEYS[2], KEYS[3], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9],
  ARGV[10], ARGV[11], ARGV[12])
"""
)

# Terminal transition. ARGV: ctx job_id to_status attempt('' = any) event_type event_data field value ...
# -> 'ok' | 'missing' | 'lost' | the current status (not allowed from there).
# A cancel of a running job also tells the workers on the control channel (ctx.cancel_channel).
FINISH = (
    PRELUDE
    + """
local attempt = ARGV[4] ~= '' and ARGV[4] or nil
local fields = {}
for i = 7, #ARGV do fields[#fields + 1] = ARGV[i] end
local before = redis.call('HGET', ctx.jprefix .. ARGV[2], 'status')
local res = finish(ctx, ARGV[2], ARGV[3], attempt, fields, ARGV[5], ARGV[6])
if res == 'ok' and before == S_RUNNING and ARGV[3] == S_CANCELLED then
  redis.call('PUBLISH', ctx.cancel_channel, ARGV[2])
end
return res
"""
)

# Take up to n jobs for consumer ARGV[2]: first entries idle past ARGV[4] ms (0: skip) whose worker died,
# then new entries, reading KEYS (queue streams) one at a time in the given order. Each entry's job is
# started atomically: queued|running -> running (attempt+1), unless cancelled/unknown (entry dropped),
# past its TTL while queued (-> expired) or past max_deliveries (-> dead letter, failed).
# ARGV: ctx consumer n reclaim_min_idle_ms max_deliveries expired_error expired_event dead_error dead_event
#       dead_stream dead_maxlen model_version (the worker's: a job pinned to another one goes back to the tail
#       of its queue, untouched; a started job records the version)
# -> {{job_id, entry_id, stream_index, attempt, request, text, token_ids, created_at, started_at, retried_at}...},
#    {waiting count per stream}, {newest entry id per stream} (where a blocking XREAD for new work starts)
PULL = (
    PRELUDE
    + """
local consumer, n, max_deliveries = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[5])
local started = {}
local num_foreign = 0  -- entries requeued this call for another model version

local function start(i, queue, entry_id, job_id)
  local job = ctx.jprefix .. job_id
  local st, cur_entry, expires_at = unpack(redis.call('HMGET', job, 'status', 'entry', 'expires_at'))
  if (not st) or (not RUNNING_FROM[st]) or cur_entry ~= entry_id then
    drop_entry(ctx, queue, entry_id)  -- cancelled, finished, unknown, or requeued under a newer entry
    return
  end
  if st == S_QUEUED and tonumber(expires_at) < tonumber(now()) then
    finish(ctx, job_id, S_EXPIRED, nil, {'error', ARGV[6]}, 'error', ARGV[7])
    return
  end
  -- a request that is not a JSON object (changed in Redis) is started all the same, and the worker fails it
  -- naming why (shared.schemas.stored_request): an error here would fail every pull that meets this entry
  local is_json, stored = pcall(cjson.decode, redis.call('HGET', job, 'request') or '')
  local pinned = is_json and type(stored) == 'table' and stored.model_version or nil
  if type(pinned) == 'string' and pinned ~= ARGV[12] then  -- model versions: not ours, back to the tail
    drop_entry(ctx, queue, entry_id)
    redis.call('HSET', job, 'entry', redis.call('XADD', queue, '*', 'id', job_id))
    num_foreign = num_foreign + 1
    return
  end
  if redis.call('HINCRBY', job, 'deliveries', 1) > max_deliveries then
    redis.call('XADD', ARGV[10], 'MAXLEN', '~', ARGV[11], '*', 'id', job_id, 'queue', queue, 'entry', entry_id)
    finish(ctx, job_id, S_FAILED, nil, {'error', ARGV[8]}, 'error', ARGV[9])
    return
  end
  local attempt = redis.call('HINCRBY', job, 'attempt', 1)
  redis.call('HSET', job, 'status', S_RUNNING, 'worker', consumer, 'model_version', ARGV[12])
  redis.call('HSETNX', job, 'started_at', now())
  event(ctx, job .. ctx.evsuffix, job_id, 'status', cjson.encode({status=S_RUNNING, attempt=attempt}))
  local req, created, first, retried = unpack(redis.call('HMGET', job, 'request', 'created_at', 'started_at',
    'retried_at'))
  local text, ids = output_of(job, job .. ctx.textsuffix, job .. ctx.idssuffix)
  started[#started + 1] = {job_id, entry_id, i, attempt, req, text, ids, created, first, retried or ''}
end

local function take(i, queue, entries)
  for _, e in ipairs(entries) do
    if e and e[2] then start(i, queue, e[1], e[2][2]) end
  end
end

if ARGV[4] ~= '0' then
  for i, queue in ipairs(KEYS) do
    if #started >= n then break end
    local res = redis.call('XAUTOCLAIM', queue, ctx.group, consumer, ARGV[4], '0-0', 'COUNT', n - #started)
    take(i, queue, res[2])
  end
end
local read_out = {}  -- queues whose read came back empty: nothing undelivered waits there
for i, queue in ipairs(KEYS) do
  local foreign_before = num_foreign
  while #started < n do
    local res = redis.call('XREADGROUP', 'GROUP', ctx.group, consumer, 'COUNT', n - #started, 'STREAMS', queue, '>')
    if not res then
      read_out[i] = true
      break
    end
    take(i, queue, res[1][2])
    if num_foreign > foreign_before then break end  -- what went back to the tail would be read again
  end
end
local waiting, last_ids = {}, {}
for i, queue in ipairs(KEYS) do
  local newest = redis.call('XREVRANGE', queue, '+', '-', 'COUNT', 1)
  last_ids[i] = newest[1] and newest[1][1] or '0-0'
  if read_out[i] then
    waiting[i] = 0
  else  -- not read to its end (the room was taken first, or an entry went back to its tail): look
    local last = '0-0'
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', queue)) do
      if g[2] == ctx.group then last = g[8] end
    end
    waiting[i] = #redis.call('XRANGE', queue, '(' .. last, '+', 'COUNT', 1)
  end
end
return {started, waiting, last_ids}
"""
)

# Append one batch of tokens of a running job. KEYS: job hash, event stream.
# ARGV: ctx job_id attempt text token_ids_csv num_tokens prompt_tokens token_event_json
# -> 'ok' | 'gone' (no longer running: cancelled, finished, unknown) | 'lost' (another attempt holds it)
_EMIT_TOKENS = """
-- tokens_before (optional): the job's completion_tokens this write follows. A write already in (a retried
-- pipeline) is not applied twice ('ok'); a write that does not follow the last one written (an earlier write of
-- the job failed) is refused ('lost': the worker drops the job, which resumes from what is written).
local function emit_tokens(job, events, job_id, attempt, new_text, new_ids, num_new, prompt_tokens, token_event,
                           tokens_before)
  local st, at, done = unpack(redis.call('HMGET', job, 'status', 'attempt', 'completion_tokens'))
  if st ~= S_RUNNING then return 'gone' end
  if at ~= attempt then return 'lost' end
  if tokens_before then
    done, tokens_before = tonumber(done or '0'), tonumber(tokens_before)
    if done >= tokens_before + tonumber(num_new) then return 'ok' end
    if done ~= tokens_before then return 'lost' end
  end
  local ids_key = job .. ctx.idssuffix
  if new_ids ~= '' and redis.call('STRLEN', ids_key) > 0 then new_ids = ',' .. new_ids end
  redis.call('APPEND', job .. ctx.textsuffix, new_text)  -- the new tokens only (each write is an AOF entry too)
  redis.call('APPEND', ids_key, new_ids)
  redis.call('HSET', job, 'prompt_tokens', prompt_tokens,
    'completion_tokens', tonumber(done or '0') + tonumber(num_new))
  event(ctx, events, job_id, 'token', token_event)
  return 'ok'
end
"""

EMIT = (
    PRELUDE
    + _EMIT_TOKENS
    + """
return emit_tokens(KEYS[1], KEYS[2], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8])
"""
)

# KEYS[1] a job's hash; ARGV[1] a field, ARGV[2] its value: set only while the hash exists, so a field written
# beside a job (a stored response's record) never outlives it (a hash created here would have no TTL). -> 1 | 0
HSET_IF_EXISTS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# A job's record with its whole output, read at one instant (a running job's new tokens are in the output strings,
# and its end folds them into the hash: two separate reads could see neither or both).
# KEYS: job hash, output text, output ids (shared/keys.py) -> the hash as HGETALL's flat list (empty: no such job),
# its text and token_ids the whole output
READ_JOB = (
    _OUTPUT_OF
    + """
local fields = redis.call('HGETALL', KEYS[1])
if #fields == 0 or redis.call('EXISTS', KEYS[2], KEYS[3]) == 0 then return fields end
local text, ids = output_of(KEYS[1], KEYS[2], KEYS[3])
local whole = {text=text, token_ids=ids}
for i = 1, #fields, 2 do
  if whole[fields[i]] then
    fields[i + 1] = whole[fields[i]]
    whole[fields[i]] = nil
  end
end
for name, value in pairs(whole) do
  fields[#fields + 1] = name
  fields[#fields + 1] = value
end
return fields
"""
)


def read_job_keys(job_id: str) -> list[str]:
    """READ_JOB's KEYS for a job."""
    return [keys.job_hash(job_id), keys.job_output_text(job_id), keys.job_output_ids(job_id)]


def fields_of(reply: object) -> dict[str, str]:
    """READ_JOB's reply as a dict (HGETALL's)."""
    flat = [item.decode() if isinstance(item, bytes) else str(item) for item in cast(list[object], reply)]
    return dict(zip(flat[::2], flat[1::2], strict=True))


# One engine step of one worker: every job's tokens and finishes, in order, as ONE script call (so a step is
# one round trip, and a NOSCRIPT after a Redis restart refuses the whole step: nothing half-written to retry).
# KEYS: job hash, event stream, per write. ARGV: ctx, then per write: kind job_id attempt, and
#   kind 'emit':   text token_ids_csv num_tokens prompt_tokens token_event_json completion_tokens_before
#   kind 'finish': to_status event_type event_data num_fields field value ...             (FINISH's arguments)
# -> one reply per write: EMIT's or FINISH's ('ok' | 'gone' | 'lost' | 'missing' | a status)
STEP = (
    PRELUDE
    + _EMIT_TOKENS
    + """
local replies = {}
local i, k = 2, 1
while i <= #ARGV do
  local kind, job_id, attempt = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if kind == 'emit' then
    replies[#replies + 1] = emit_tokens(KEYS[k], KEYS[k + 1], job_id, attempt, ARGV[i + 3], ARGV[i + 4],
      ARGV[i + 5], ARGV[i + 6], ARGV[i + 7], ARGV[i + 8])
    i = i + 9
  else
    local num_fields = tonumber(ARGV[i + 6])
    local fields = {}
    for j = 1, num_fields do fields[j] = ARGV[i + 6 + j] end
    replies[#replies + 1] = finish(ctx, job_id, ARGV[i + 3], attempt, fields, ARGV[i + 4], ARGV[i + 5])
    i = i + 7 + num_fields
  end
  k = k + 2
end
return replies
"""
)

# Hand a running job back to its queue (graceful shutdown): a new entry at the tail, the old one acked,
# status queued, this start not counted as a delivery. KEYS: job hash, event stream, queue stream.
# ARGV: ctx job_id attempt -> 'ok' | 'gone' | 'lost'
REQUEUE = (
    PRELUDE
    + """
local st, at, entry = unpack(redis.call('HMGET', KEYS[1], 'status', 'attempt', 'entry'))
if not (st and QUEUED_FROM[st]) then return 'gone' end
if at ~= ARGV[3] then return 'lost' end
drop_entry(ctx, KEYS[3], entry)
local new_entry = redis.call('XADD', KEYS[3], '*', 'id', ARGV[2])
redis.call('HSET', KEYS[1], 'status', S_QUEUED, 'entry', new_entry, 'worker', '')
redis.call('HINCRBY', KEYS[1], 'deliveries', -1)
event(ctx, KEYS[2], ARGV[2], 'status', cjson.encode({status=S_QUEUED}))
if ctx.queued_channel then
  redis.call('PUBLISH', ctx.queued_channel, redis.call('HGET', KEYS[1], 'priority') .. ' ' .. new_entry)
end
return 'ok'
"""
)

# Reset the idle time of a held job's queue entry (so no one reclaims it) if this worker's attempt is still
# the current one. KEYS: job hash, queue stream. ARGV: ctx consumer attempt -> 'ok' | 'gone' | 'lost'
HEARTBEAT = (
    PRELUDE
    + """
local st, at, entry = unpack(redis.call('HMGET', KEYS[1], 'status', 'attempt', 'entry'))
if st ~= S_RUNNING then return 'gone' end
if at ~= ARGV[3] then return 'lost' end
redis.call('XCLAIM', KEYS[2], ctx.group, ARGV[2], 0, entry, 'JUSTID')
return 'ok'
"""
)


# -- per-key limits (gateway/rate_limit.py says what they mean) ------------------------------------------------
# admit(state hash, in-flight hash, job_prefix, period_s, requests_limit, tokens_limit, concurrency_limit, job_id,
#       cost, inflight_ttl_s, requests (1; 0 for a call's further jobs: an OpenAI call of n choices is one request))
# -> {admitted 0|1, refused_by ('' | requests | tokens | concurrency), retry_after_ms,
#     remaining_requests, remaining_tokens, reset_requests_ms, reset_tokens_ms}   (numbers as strings)
_ADMIT_FN = (
    _lua_set("TERMINAL", sorted(TERMINAL, key=lambda s: s.value))
    + """
local function admit(state, inflight, jprefix, period, rpm, tpm, maxc, job_id, cost, inflight_ttl, requests)
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

  local rnew = math.max(rtat, now) + requests * rT
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
  redis.call('EXPIRE', inflight, inflight_ttl)

  local function remaining(tat, T)
    if T == 0 then return -1 end
    return math.floor((period - math.max(tat - now, 0)) / T + 1e-9)
  end
  return {tostring(admitted), refused, tostring(math.ceil(wait * 1000)),
    tostring(remaining(rtat, rT)), tostring(remaining(ttat, tT)),
    tostring(math.ceil(math.max(rtat - now, 0) * 1000)), tostring(math.ceil(math.max(ttat - now, 0) * 1000))}
end
"""
)

# release(state hash, in-flight hash, job_id, period_s, tokens_limit): give back an admitted job never created
_RELEASE_FN = """
local function release(state, inflight, job_id, period, tpm)
  local reserved = tonumber(redis.call('HGET', inflight, job_id) or '0')
  redis.call('HDEL', inflight, job_id)
  tpm = tonumber(tpm)
  if tpm > 0 and reserved > 0 then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
    local tat = tonumber(redis.call('HGET', state, 'tokens_tat') or '0')
    redis.call('HSET', state, 'tokens_tat', tostring(math.max(now, tat - reserved * tonumber(period) / tpm)))
  end
  return 'ok'
end
"""

# A submit in ONE round trip: who is calling (the key record found by the SHA-256 of its secret: unknown or
# revoked -> refused, nothing written), the key's own limits (a request dearer than its token limit -> refused),
# then the job (a job admitted but not created, an idempotent replay or a full queue, gives its reservation back
# at once). No key is cached anywhere: a revoked key is refused on its very next request. The key's Idempotency-Key
# and limit state are named from its id (ctx.idemprefix, ctx.rlprefix, ctx.inflightprefix) in ctx's partition,
# the tenant's: the key record, its limit state and its jobs share that partition's hash tag, so they live in the
# same slot as KEYS on Redis Cluster too.
# KEYS: key record, job hash, queue stream.
# ARGV: SUBMIT's 12 (ctx ... owner (ignored: the key's id) request_hash completed_notice), then idempotency_key
#       ('' = none), cost (tokens reserved), period_s, inflight_ttl_s, requests counted (1, or 0: another job of the
#       same call)
# -> {verdict, the key record (HGETALL's flat list; {} when unknown), submit()'s answer ({} unless submitted),
#     admit()'s answer ({} unless the limits were checked)}
#    verdict: 'unknown' | 'revoked' | 'too_large' | 'refused' (the limits) | 'submitted' (submit()'s answer says how)
AUTH_ADMIT_SUBMIT = (
    PRELUDE
    + _SUBMIT_FN
    + _ADMIT_FN
    + _RELEASE_FN
    + """
local record = redis.call('HGETALL', KEYS[1])
if #record == 0 then return {'unknown', {}, {}, {}} end
local key = {}
for i = 1, #record, 2 do key[record[i]] = record[i + 1] end
if key.revoked_at and key.revoked_at ~= '' then return {'revoked', record, {}, {}} end
local tpm = tonumber(key.tokens_per_min or '0') or 0
local cost = tonumber(ARGV[14])
if tpm > 0 and cost > tpm then return {'too_large', record, {}, {}} end
local state, inflight = ctx.rlprefix .. key.id, ctx.inflightprefix .. key.id
local decision = admit(state, inflight, ctx.jprefix, tonumber(ARGV[15]), tonumber(key.requests_per_min or '0') or 0,
  tpm, tonumber(key.max_concurrent_jobs or '0') or 0, ARGV[2], cost, ARGV[16], tonumber(ARGV[17]))
if decision[1] ~= '1' then return {'refused', record, {}, decision} end
local idem = ARGV[13] ~= '' and (ctx.idemprefix .. key.id .. ':' .. ARGV[13]) or ''
local result = submit(KEYS[2], KEYS[3], idem, ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8],
  ARGV[9], key.id, ARGV[11], ARGV[12])
if result[1] ~= 'ok' then release(state, inflight, ARGV[2], ARGV[15], tostring(tpm)) end
return {'submitted', record, result, decision}
"""
)
