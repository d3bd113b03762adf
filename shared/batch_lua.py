"""The atomic steps of a batch, as Lua scripts (one round trip each); key names come from shared.keys.

Batch hash fields: id status created_at expires_at <status>_at total completed failed num_expired expanded
(lines submitted so far) expansion (running|done|stopped) webhook metadata compute_s cost input_tokens
output_tokens (sums over the finished lines' jobs: workers/worker/cost.py, the jobs' usage) model (the served
model's name: set when the batch is made, else by its first finished line).

A batch is ready to finalize when it is in_progress or cancelling, its expansion has ended (done, or
stopped by a cancel) and every submitted line has a result: whoever makes that true (the last line's
result, the end of expansion, a cancel) gets 'finalize' back and starts the finalize task, which is
idempotent (its first step is the in_progress -> finalizing transition, or the batch is cancelling).
"""

from shared.batch_state import BatchStatus, sources_of
from shared.lua import PRELUDE as JOB_PRELUDE

BATCH_PRELUDE = (
    "".join(f"local B_{s.name} = '{s.value}'\n" for s in BatchStatus)
    + "local FROM = {}\n"
    + "".join(
        f"FROM[B_{s.name}] = {{{', '.join(f'[B_{f.name}]=true' for f in sources_of(s))}}}\n"
        for s in BatchStatus
    )
    + """
local function now()
  local t = redis.call('TIME')
  return string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1e6)
end

-- status -> `to` if legal: stamps `<to>_at` (ts_field). -> 'ok' | 'missing' | the current status
local function transition(batch, to, ts_field)
  local st = redis.call('HGET', batch, 'status')
  if not st then return 'missing' end
  if not FROM[to][st] then return st end
  redis.call('HSET', batch, 'status', to, ts_field, now())
  return 'ok'
end

local function ready(batch)
  local st, exp, expanded, done, failed = unpack(redis.call('HMGET', batch, 'status', 'expansion', 'expanded',
    'completed', 'failed'))
  if (st == B_IN_PROGRESS or st == B_CANCELLING) and exp ~= 'running'
      and tonumber(done) + tonumber(failed) >= tonumber(expanded) then
    return 'finalize'
  end
  return 'wait'
end
"""
)

# KEYS: batch hash. ARGV: to ts_field -> 'ok' | 'missing' | the current status
TRANSITION = BATCH_PRELUDE + "return transition(KEYS[1], ARGV[1], ARGV[2])\n"

# The final transition with the batch's output and error files (workers/tasks/batch_files.py): when it is made,
# their sizes (`<kind>_bytes`) and their ids in the owner's file listing, scored by the end it stamps; so whoever
# sees the batch ended finds its files listed. KEYS: batch hash, the owner's file listing (the batch hash again
# when it has no owner: no ids then). ARGV: to ts_field num_kinds [kind bytes]... [file_id]...
# -> 'ok' | 'missing' | the current status
END_WITH_FILES = (
    BATCH_PRELUDE
    + """
local res = transition(KEYS[1], ARGV[1], ARGV[2])
if res ~= 'ok' then return res end
local num_kinds = tonumber(ARGV[3])
for i = 0, num_kinds - 1 do redis.call('HSET', KEYS[1], ARGV[4 + 2 * i] .. '_bytes', ARGV[5 + 2 * i]) end
local ended = redis.call('HGET', KEYS[1], ARGV[2])
for i = 4 + 2 * num_kinds, #ARGV do redis.call('ZADD', KEYS[2], ended, ARGV[i]) end
return res
"""
)

# Cancel: validating|in_progress -> cancelling, and a `cancel` notice for the Celery side.
# KEYS: batch hash, outbox stream. ARGV: batch_id outbox_maxlen -> 'ok' | 'missing' | the current status
CANCEL = (
    BATCH_PRELUDE
    + """
local res = transition(KEYS[1], B_CANCELLING, 'cancelling_at')
if res == 'ok' then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'kind', 'batch', 'id', ARGV[1], 'event', 'cancel')
end
return res
"""
)

# One line's job finished. KEYS: batch hash, results hash. ARGV: line outcome(completed|failed) result_json
# expired(1|0) [compute_s cost [input_tokens output_tokens [model]]: the job's, added to the batch's totals; the
# model its result names, the batch's `model` if it has none yet] -> 'missing' | 'dup' (already counted:
# at-least-once notices) | 'wait' | 'finalize'
LINE_DONE = (
    BATCH_PRELUDE
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 'missing' end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[3]) == 0 then return 'dup' end
redis.call('HINCRBY', KEYS[1], ARGV[2], 1)
if ARGV[4] == '1' then redis.call('HINCRBY', KEYS[1], 'num_expired', 1) end
if ARGV[5] then
  redis.call('HINCRBYFLOAT', KEYS[1], 'compute_s', ARGV[5])
  redis.call('HINCRBYFLOAT', KEYS[1], 'cost', ARGV[6])
end
if ARGV[7] then
  redis.call('HINCRBY', KEYS[1], 'input_tokens', ARGV[7])
  redis.call('HINCRBY', KEYS[1], 'output_tokens', ARGV[8])
end
if ARGV[9] then redis.call('HSETNX', KEYS[1], 'model', ARGV[9]) end
return ready(KEYS[1])
"""
)

# A dead-lettered line's job was retried (`specfleet dlq retry`): forget the line's failed result, so the
# retried job's own result counts when it ends. Only while the batch runs: a finalizing or finished batch
# has written its files. KEYS: batch hash, results hash. ARGV: line
# -> 'reopened' | 'uncounted' (no result recorded yet) | 'missing' | the batch's status
REOPEN_LINE = (
    BATCH_PRELUDE
    + """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return 'missing' end
if st ~= B_IN_PROGRESS then return st end
if redis.call('HDEL', KEYS[2], ARGV[1]) == 0 then return 'uncounted' end
redis.call('HINCRBY', KEYS[1], 'failed', -1)
return 'reopened'
"""
)

# Lines [from, to) were submitted as jobs. KEYS: batch hash, jobs hash.
# ARGV: from to total line job_id line job_id ...
# -> 'stale' (another task recorded them) | 'cancelling' (recorded; the caller cancels them) | 'more'
#    | 'wait' | 'finalize'
ADVANCE = (
    BATCH_PRELUDE
    + """
local st, expanded = unpack(redis.call('HMGET', KEYS[1], 'status', 'expanded'))
if tonumber(expanded) ~= tonumber(ARGV[1]) then return 'stale' end
if #ARGV > 3 then redis.call('HSET', KEYS[2], unpack(ARGV, 4)) end
redis.call('HSET', KEYS[1], 'expanded', ARGV[2])
if st == B_CANCELLING then
  redis.call('HSET', KEYS[1], 'expansion', 'stopped')
  return 'cancelling'
end
if tonumber(ARGV[2]) < tonumber(ARGV[3]) then return 'more' end
redis.call('HSET', KEYS[1], 'expansion', 'done')
return ready(KEYS[1])
"""
)

# Stop expanding (the batch is cancelling). KEYS: batch hash -> 'wait' | 'finalize'
STOP_EXPANSION = (
    BATCH_PRELUDE
    + """
if redis.call('HGET', KEYS[1], 'expansion') == 'running' then redis.call('HSET', KEYS[1], 'expansion', 'stopped') end
return ready(KEYS[1])
"""
)

# Is the batch ready to finalize? KEYS: batch hash -> 'wait' | 'finalize'
READY = BATCH_PRELUDE + "return ready(KEYS[1])\n"

# Result lines for lines that never became jobs (finalize of a cancelled batch), counted as failed.
# KEYS: batch hash, results hash. ARGV: line json line json ... -> number written
FILL = """
local n = 0
for i = 1, #ARGV, 2 do
  n = n + redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1])
end
if n > 0 then redis.call('HINCRBY', KEYS[1], 'failed', n) end
return n
"""

# Cancel one job only while it is still queued (a batch cancel lets running lines finish), through the job
# protocol's finish(). KEYS: job hash, event stream. ARGV: ctx job_id error_json event_json
# -> 'ok' | 'missing' | its status
CANCEL_QUEUED_JOB = (
    JOB_PRELUDE
    + """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return 'missing' end
if st ~= S_QUEUED then return st end
return finish(ctx, ARGV[2], S_CANCELLED, nil, {'error', ARGV[3]}, 'error', ARGV[4])
"""
)

# Record a webhook delivery's outcome on its job or batch, unless that has expired meanwhile.
# KEYS: the hash. ARGV: field json
RECORD_IF_EXISTS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""
