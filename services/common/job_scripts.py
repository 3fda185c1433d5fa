"""The Lua scripts of the job store (services/common/job_store.py, whose docstring gives the
key schema): each runs atomically in Redis, so that a job is enqueued whole or not at all, each
item's result is written and counted once, and a job gone (expired) is never brought back."""

# KEYS: job hash, items list, idempotency key, queue, the tenant's job list, the store's
# reserved bytes; ARGV: job id, created time (the list's score), '1' to claim the idempotency
# key, the bytes its results are expected to take (reserved until it ends: the job's
# `reserved` field, counted in the store's; none where Redis's ACL, not yet loaded after an
# upgrade, refuses INCRBY), the share of `maxmemory` the store's jobs may fill (0: no limit),
# then where each chunk ends (item indices, ascending; job_policy.chunk_ends). Admits and
# reserves in one step: what Redis holds (the job's items, written before, among it), the
# reservations of the jobs not ended and the job's own must stay within the share, or the
# job is refused (its items are the caller's to delete), so that jobs submitted together on
# several gateways cannot pass it together (each had looked at the room before any
# reserved). Returns the job id the key names (another's, if it named one first), or, when
# refused, {bytes held, bytes reserved, the room}; or 0, writing nothing, when the job's hash
# written a moment before is gone (evicted, or lost with a restart): Redis undoes no write of a
# script that fails, and one failing half-way had claimed the idempotency key for a job that
# never was, and reserved its bytes for good (review finding).
ENQUEUE = """
if ARGV[3] == '1' then
  local existing = redis.call('GET', KEYS[3])
  if existing then return existing end
end
if not redis.call('HMGET', KEYS[1], 'num_items')[1] then return 0 end
local reserved = tonumber(ARGV[4])
local share = tonumber(ARGV[5])
local memory = share > 0 and redis.pcall('INFO', 'memory')
if type(memory) == 'string' then  -- else no limit, or an ACL of before INFO
  local limit = tonumber(string.match(memory, 'maxmemory:(%d+)')) or 0
  local used = tonumber(string.match(memory, 'used_memory:(%d+)')) or 0
  local held = math.max(0, tonumber(redis.call('GET', KEYS[6]) or '0') or 0)
  if limit > 0 and used + held + reserved > math.floor(share * limit) then
    return {used, held, math.floor(share * limit)}
  end
end
if ARGV[3] == '1' then redis.call('SET', KEYS[3], ARGV[1]) end
redis.call('PERSIST', KEYS[1])
redis.call('PERSIST', KEYS[2])
if reserved > 0 and type(redis.pcall('INCRBY', KEYS[6], reserved)) == 'number' then
  local each = math.floor(reserved / tonumber(redis.call('HMGET', KEYS[1], 'num_items')[1]))
  redis.call('HSET', KEYS[1], 'reserved', reserved, 'reserve_each', each)
end
local start = 0
for i = 6, #ARGV do
  redis.call('XADD', KEYS[4], '*', 'job', ARGV[1], 'start', start, 'end', ARGV[i])
  start = tonumber(ARGV[i])
end
redis.call('ZADD', KEYS[5], ARGV[2], ARGV[1])
return ARGV[1]
"""
# KEYS: job hash, results hash, queue, dead letters, items list, the tenant's job list, the
# store's reserved bytes[, idempotency key]; ARGV: group, entry id, job id, dead-letter cap,
# retention seconds (0: forever), job key prefix, then (index, result, counter, code,
# message)* (code "": not a dead letter). A job gone (expired) records nothing: its entry is
# only acknowledged. Each result written gives its share of the job's reservation back (the
# rest once every item has its result: results larger than expected are in Redis's memory by
# then), and a job whose every item has its result expires, with its items, results and
# idempotency key (if it still names this job), after the retention; and the oldest 64 jobs
# of its tenant's list are looked at, those gone taken out (each job's end clears up to 64
# ended before it, so the list holds about the jobs kept). Returns the positions (from 0) of the
# results it wrote, among those given: not those already written.
RECORD = """
if not redis.call('HMGET', KEYS[1], 'num_items')[1] then
  if ARGV[2] ~= '' then
    redis.call('XACK', KEYS[3], ARGV[1], ARGV[2])
    redis.call('XDEL', KEYS[3], ARGV[2])
  end
  return {}
end
local added = {}
for i = 7, #ARGV, 5 do
  if redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1]) == 1 then
    redis.call('HINCRBY', KEYS[1], ARGV[i + 2], 1)
    added[#added + 1] = (i - 7) / 5
    if ARGV[i + 3] ~= '' then
      redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[4], '*', 'job', ARGV[3],
                 'index', ARGV[i], 'code', ARGV[i + 3], 'message', ARGV[i + 4])
    end
  end
end
if ARGV[2] ~= '' then
  redis.call('XACK', KEYS[3], ARGV[1], ARGV[2])
  redis.call('XDEL', KEYS[3], ARGV[2])
end
local ttl = tonumber(ARGV[5])
if #added > 0 then
  local c = redis.call('HMGET', KEYS[1], 'num_items', 'num_ok', 'num_failed', 'num_cancelled',
                      'reserved', 'reserve_each')
  local done = (tonumber(c[2]) or 0) + (tonumber(c[3]) or 0) + (tonumber(c[4]) or 0)
  local ended = c[1] and tonumber(c[1]) <= done
  local reserved = tonumber(c[5]) or 0
  if reserved > 0 then  -- the room of the results written is theirs now; all of it once ended
    local back = reserved
    if not ended then back = math.min(reserved, (tonumber(c[6]) or 0) * #added) end
    if back > 0 then
      redis.call('HSET', KEYS[1], 'reserved', reserved - back)
      if redis.call('DECRBY', KEYS[7], back) < 0 then redis.call('SET', KEYS[7], 0) end
    end
  end
  if ended then
    if ttl > 0 then
      redis.call('EXPIRE', KEYS[1], ttl)
      redis.call('EXPIRE', KEYS[2], ttl)
      redis.call('EXPIRE', KEYS[5], ttl)
      if KEYS[8] and redis.call('GET', KEYS[8]) == ARGV[3] then
        redis.call('EXPIRE', KEYS[8], ttl)
      end
      for _, id in ipairs(redis.call('ZRANGE', KEYS[6], 0, 63)) do
        if redis.call('EXISTS', ARGV[6] .. id) == 0 then
          redis.call('ZREM', KEYS[6], id)
        end
      end
    end
  end
end
return added
"""
# KEYS: job hash; ARGV: field. Counts one more in the field of a job that still exists (one
# gone is not brought back as a hash of that field alone, which would never expire): -1 if
# gone.
COUNT_ROUND = """
if not redis.call('HMGET', KEYS[1], 'num_items')[1] then return -1 end
return redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
"""
# KEYS: job hash; ARGV: now (seconds). Sets the job's `started_s` once, while it exists: a
# job ended and expired before its first runner marked it is not brought back as a hash of
# that field alone, which would never expire (jobs review). Returns 1 if set, 0 if it was
# set already, -1 if gone.
MARK_STARTED = """
if not redis.call('HMGET', KEYS[1], 'num_items')[1] then return -1 end
return redis.call('HSETNX', KEYS[1], 'started_s', ARGV[1])
"""
# KEYS: job hash. Marks a job cancelled only while it exists and has items not finished: a
# job whose last result was recorded meanwhile keeps its final state, and one gone (expired)
# is not brought back as a hash of that field alone, which would never expire. Returns 1 if
# marked, 0 if finished, -1 if gone.
CANCEL = """
local c = redis.call('HMGET', KEYS[1], 'num_items', 'num_ok', 'num_failed', 'num_cancelled')
if not c[1] then return -1 end
local done = (tonumber(c[2]) or 0) + (tonumber(c[3]) or 0) + (tonumber(c[4]) or 0)
if tonumber(c[1]) <= done then return 0 end
redis.call('HSET', KEYS[1], 'cancelled', 1)
return 1
"""
# KEYS: job hash; ARGV: the rounds field, the field of the first round's time, now (seconds,
# the counting runner's clock). Counts one more round the fleet could not serve a chunk in, the
# time of its first kept: returns {rounds, seconds since the first}; {-1, 0} if the job is gone
# (not brought back). Times are Redis's own (TIME): runners' clocks differing by minutes
# shifted the chunk's patience by as much. Under an ACL without TIME (not reloaded since an
# upgrade), the runner's clock, as before.
FLEET_ROUND = """
if not redis.call('HMGET', KEYS[1], 'num_items')[1] then return {-1, '0'} end
local now = tonumber(ARGV[3])
local ok, t = pcall(redis.call, 'TIME')
if ok then now = tonumber(t[1]) + tonumber(t[2]) / 1e6 end
redis.call('HSETNX', KEYS[1], ARGV[2], tostring(now))
local since = tonumber(redis.call('HMGET', KEYS[1], ARGV[2])[1]) or now
return {redis.call('HINCRBY', KEYS[1], ARGV[1], 1), tostring(math.max(0, now - since))}
"""
# KEYS: the queue; ARGV: group, a consumer to keep (the caller), idle milliseconds. Deletes the
# group's consumers idle at least that long that hold no pending entry (runners that exited:
# each process is a consumer of its own name, and the group kept every one for good), in one
# step, so that none takes an entry between the look and the delete (a consumer deleted with
# pending entries would leave them unclaimable). A live runner deleted while idle is made
# again by its next read. Returns how many it deleted.
FORGET_CONSUMERS = """
local forgotten = 0
for _, consumer in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local fields = {}
  for i = 1, #consumer, 2 do fields[consumer[i]] = consumer[i + 1] end
  if fields['pending'] == 0 and fields['idle'] >= tonumber(ARGV[3])
      and fields['name'] ~= ARGV[2] then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], fields['name'])
    forgotten = forgotten + 1
  end
end
return forgotten
"""
# KEYS: the queue; ARGV: group, consumer, entry id, idle milliseconds. Restarts the entry's idle
# time (an XCLAIM that does not count a delivery) only while it is pending with this consumer,
# in one step: an entry another runner took over stays theirs. A pcall: where Redis still runs
# an ACL of before this script (until ACL LOAD), which refuses XPENDING, it claims the entry if
# it has been idle the milliseconds given (since this consumer last kept it: one taken over
# since is idle less), as the release before did. Returns 1 if kept, else 0.
KEEP = """
local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if pending['err'] then
  return #redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[4], ARGV[3], 'JUSTID')
end
if #pending == 0 or pending[1][2] ~= ARGV[2] then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
return 1
"""
