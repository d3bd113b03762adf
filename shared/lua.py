"""The atomic steps of the job protocol, as Lua scripts run inside Redis (one round trip each).

Every status change goes through these scripts, and each checks it against `shared.job_state.TRANSITIONS`
(rendered into the Lua prelude as the `*_FROM` sets), so a job is started, finished, cancelled or expired
exactly once however gateways and workers race. Key names come from `shared.keys`: as KEYS, or as the
prefixes in `ctx` where a script derives a job's keys from a job id it read from a stream.

Job hash fields: id status priority created_at expires_at started_at completed_at request metadata
entry (its current queue entry id) attempt (starts so far; an emit or finish must quote the current one)
deliveries (starts not handed back; past max_deliveries -> dead letter) worker text token_ids (csv)
prompt_tokens completion_tokens finish_reason metrics (json) error (json) retried_at (`specfleet dlq retry`)
model_version (of the worker that started it: settings.model_version).
"""

import json

from shared import keys
from shared.job_state import JobStatus, sources_of


def _lua_set(name: str, statuses: list[JobStatus]) -> str:
    return "local {} = {{{}}}\n".format(name, ", ".join(f"['{s.value}']=true" for s in statuses))


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

local function event(ctx, events, job_id, ev_type, ev_data)
  local id = redis.call('XADD', events, 'MAXLEN', '~', ctx.maxlen, '*', 'type', ev_type, 'data', ev_data)
  redis.call('PUBLISH', ctx.chprefix .. job_id, '1')
  return id
end

local function drop_entry(ctx, queue, entry)
  redis.call('XACK', queue, ctx.group, entry)
  redis.call('XDEL', queue, entry)
end

-- Move job `job_id` to terminal status `to` if its status allows it and (when given) `attempt` is current:
-- ack + delete its queue entry, append the final event, start the result TTL, wake the streamers.
local function finish(ctx, job_id, to, attempt, fields, ev_type, ev_data)
  local job = ctx.jprefix .. job_id
  local st, at, entry, prio = unpack(redis.call('HMGET', job, 'status', 'attempt', 'entry', 'priority'))
  if not st then return 'missing' end
  if not FINISH_FROM[to][st] then return st end
  if attempt and at ~= attempt then return 'lost' end
  redis.call('HSET', job, 'status', to, 'completed_at', now(), unpack(fields))
  if entry then drop_entry(ctx, ctx.qprefix .. prio, entry) end
  local events = job .. ctx.evsuffix
  event(ctx, events, job_id, ev_type, ev_data)
  -- outbox notice for the Celery side (webhooks, batches), atomic with the transition
  redis.call('XADD', ctx.outbox, 'MAXLEN', '~', ctx.outbox_maxlen, '*', 'kind', 'job', 'id', job_id,
    'event', 'completed', 'status', to)
  redis.call('EXPIRE', job, ctx.ttl)
  redis.call('EXPIRE', events, ctx.ttl)
  return 'ok'
end

-- ARGV[1] of every script below is the json context: group, jprefix, evsuffix, chprefix, qprefix, maxlen, ttl,
-- outbox, outbox_maxlen
local ctx = cjson.decode(ARGV[1])
"""
)


def context(maxlen: int, ttl_s: int) -> str:
    """ARGV[1] of every script: the key prefixes from shared.keys, the event cap and the result TTL."""
    return json.dumps(
        {
            "group": keys.CONSUMER_GROUP,
            "jprefix": keys.JOB_PREFIX,
            "evsuffix": keys.EVENTS_SUFFIX,
            "chprefix": keys.CHANNEL_PREFIX,
            "qprefix": keys.queue_stream(""),
            "cancel_channel": keys.CANCEL_CHANNEL,
            "outbox": keys.OUTBOX_STREAM,
            "outbox_maxlen": str(keys.OUTBOX_MAXLEN),
            "maxlen": str(maxlen),
            "ttl": str(ttl_s),
        }
    )


# KEYS: job hash, queue stream, idempotency key.  ARGV: ctx job_id priority ttl_s request_json metadata_json
# max_depth idem_ttl_s use_idem(0/1) owner(the API key id that owns the job; '': none) request_hash.
# -> {'dup', job_id, request_hash of the job's request ('' from older entries)} | {'full', depth} | {'ok', job_id, created_at}
SUBMIT = (
    PRELUDE
    + """
if ARGV[9] == '1' then
  local existing = redis.call('GET', KEYS[3])  -- '<job id>:<request hash>'
  if existing then
    local sep = string.find(existing, ':', 1, true)
    if sep then return {'dup', string.sub(existing, 1, sep - 1), string.sub(existing, sep + 1)} end
    return {'dup', existing, ''}
  end
end
local depth = redis.call('XLEN', KEYS[2])
if depth > 0 then
  local ok, pending = pcall(redis.call, 'XPENDING', KEYS[2], ctx.group)
  if ok then depth = depth - pending[1] end
end
if depth >= tonumber(ARGV[7]) then return {'full', tostring(depth)} end
local created = now()
local entry = redis.call('XADD', KEYS[2], '*', 'id', ARGV[2])
redis.call('HSET', KEYS[1], 'id', ARGV[2], 'status', S_QUEUED, 'priority', ARGV[3], 'created_at', created,
  'expires_at', string.format('%.6f', tonumber(created) + tonumber(ARGV[4])), 'request', ARGV[5],
  'metadata', ARGV[6], 'entry', entry, 'attempt', '0', 'deliveries', '0', 'completion_tokens', '0')
if ARGV[10] and ARGV[10] ~= '' then redis.call('HSET', KEYS[1], 'owner', ARGV[10]) end
if ARGV[9] == '1' then redis.call('SET', KEYS[3], ARGV[2] .. ':' .. ARGV[11], 'EX', ARGV[8]) end
return {'ok', ARGV[2], created}
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
  local pinned = cjson.decode(redis.call('HGET', job, 'request')).model_version
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
  local req, text, ids, created, first, retried = unpack(redis.call('HMGET', job, 'request', 'text', 'token_ids',
    'created_at', 'started_at', 'retried_at'))
  started[#started + 1] = {job_id, entry_id, i, attempt, req, text or '', ids or '', created, first, retried or ''}
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
for i, queue in ipairs(KEYS) do
  local foreign_before = num_foreign
  while #started < n do
    local res = redis.call('XREADGROUP', 'GROUP', ctx.group, consumer, 'COUNT', n - #started, 'STREAMS', queue, '>')
    if not res then break end
    take(i, queue, res[1][2])
    if num_foreign > foreign_before then break end  -- what went back to the tail would be read again
  end
end
local waiting, last_ids = {}, {}
for i, queue in ipairs(KEYS) do
  local newest = redis.call('XREVRANGE', queue, '+', '-', 'COUNT', 1)
  last_ids[i] = newest[1] and newest[1][1] or '0-0'
  local last = '0-0'
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', queue)) do
    if g[2] == ctx.group then last = g[8] end
  end
  waiting[i] = #redis.call('XRANGE', queue, '(' .. last, '+', 'COUNT', 1)
end
return {started, waiting, last_ids}
"""
)

# Append one batch of tokens of a running job. KEYS: job hash, event stream.
# ARGV: ctx job_id attempt text token_ids_csv num_tokens prompt_tokens token_event_json
# -> 'ok' | 'gone' (no longer running: cancelled, finished, unknown) | 'lost' (another attempt holds it)
EMIT = (
    PRELUDE
    + """
local st, at, text, ids = unpack(redis.call('HMGET', KEYS[1], 'status', 'attempt', 'text', 'token_ids'))
if st ~= S_RUNNING then return 'gone' end
if at ~= ARGV[3] then return 'lost' end
if ids and ids ~= '' then ids = ids .. ',' .. ARGV[5] else ids = ARGV[5] end
redis.call('HSET', KEYS[1], 'text', (text or '') .. ARGV[4], 'token_ids', ids, 'prompt_tokens', ARGV[7])
redis.call('HINCRBY', KEYS[1], 'completion_tokens', ARGV[6])
event(ctx, KEYS[2], ARGV[2], 'token', ARGV[8])
return 'ok'
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
