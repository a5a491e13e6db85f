-- Complete a deferred call through its token: exactly once; unknown, completed, expired and
-- cancelled tokens change nothing. KEYS[NKEYS+1] = token key.
-- ARGV[4] = outcome JSON, ARGV[5] = completed by, ARGV[6] = event data JSON.
local tk = KEYS[NKEYS + 1]
local t = redis.call('HMGET', tk, 'state', 'field', 'expires_ms', 'call_id')
if not t[1] then return {'unknown'} end
if t[1] ~= 'pending' then return {t[1], t[4]} end
if NOW_MS >= tonumber(t[3]) then return {'due', t[4], t[2]} end
local r = finish_call(t[2], ARGV[4], 'token_completed', ARGV[6])
if not r then
  -- The call ended another way (the session was cancelled); the token dies with it.
  redis.call('HSET', tk, 'state', 'cancelled')
  return {'cancelled', t[4]}
end
redis.call('HSET', tk, 'state', 'completed', 'completed_at', NOW, 'completed_by', ARGV[5])
return {'ok', t[4], r[1], r[2], r[3]}
