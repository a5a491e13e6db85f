-- Complete a deferred call through its token: exactly once; unknown, completed, expired and
-- cancelled tokens change nothing but a `token_rejected` event. A token past its deadline that the
-- sweeper has not reached yet is expired here, atomically.
-- KEYS[NKEYS+1] = token key. ARGV[4] = outcome JSON, ARGV[5] = completed by, ARGV[6] = event JSON,
-- ARGV[7] = the outcome recorded if the call turns out to be expired, ARGV[8] = "1" when the
-- completion approves (not an error). A deferred sub-agent call (its token names the child) is not
-- finished by an approval: it becomes a running call, dispatched, which starts the child; the
-- reply {'approved', call id, remaining, 0, version, field} asks the caller to publish it.
local tk = KEYS[NKEYS + 1]
local t = redis.call('HMGET', tk, 'state', 'field', 'expires_ms', 'call_id')
local function reject(reason)
  if redis.call('EXISTS', K.meta) == 1 then
    emit('token_rejected', cjson.encode({reason = reason, call_id = t[4] or '', by = ARGV[5]}))
  end
end
if not t[1] then
  reject('unknown')
  return {'unknown'}
end
if t[1] ~= 'pending' then
  reject(t[1])
  return {t[1], t[4]}
end
if NOW_MS >= tonumber(t[3]) then
  redis.call('HSET', tk, 'state', 'expired', 'expired_at', NOW)
  local r = finish_call(t[2], ARGV[7], 'token_expired', cjson.encode({call_id = t[4]}))
  reject('expired')
  if r then return {'expired_now', t[4], r[1], r[2], r[3]} end
  return {'expired', t[4]}
end
local child = redis.call('HGET', tk, 'child')
if child and child ~= '' and ARGV[8] == '1' and redis.call('SISMEMBER', K.pending, t[2]) == 1 then
  redis.call('HSET', tk, 'state', 'completed', 'completed_at', NOW, 'completed_by', ARGV[5])
  redis.call('ZREM', K.deadlines, SID .. ' ' .. t[2])
  redis.call('HSET', K.results, t[2], '{"state":"running"}')
  redis.call('ZADD', K.dispatched, NOW_MS, SID .. ' ' .. t[2])
  emit('delegation_approved', cjson.encode({call_id = t[4], child = child, by = ARGV[5]}))
  touch()
  return {'approved', t[4], redis.call('SCARD', K.pending), 0, tonumber(version()), t[2]}
end
local r = finish_call(t[2], ARGV[4], 'token_completed', ARGV[6])
if not r then
  -- The call ended another way (the session was cancelled); the token dies with it.
  redis.call('HSET', tk, 'state', 'cancelled')
  reject('cancelled')
  return {'cancelled', t[4]}
end
redis.call('HSET', tk, 'state', 'completed', 'completed_at', NOW, 'completed_by', ARGV[5])
return {'ok', t[4], r[1], r[2], r[3]}
