-- Expire a deferred call whose deadline passed: the model is told no result came; the token dies.
-- KEYS[NKEYS+1] = token key. ARGV[4] = call field, ARGV[5] = outcome JSON, ARGV[6] = event JSON.
local tk = KEYS[NKEYS + 1]
local t = redis.call('HMGET', tk, 'state', 'expires_ms')
if t[1] ~= 'pending' then
  redis.call('ZREM', K.deadlines, SID .. ' ' .. ARGV[4])
  return {'gone', t[1] or 'unknown'}
end
if NOW_MS < tonumber(t[2]) then return {'early'} end
redis.call('HSET', tk, 'state', 'expired', 'expired_at', NOW)
local r = finish_call(ARGV[4], ARGV[5], 'token_expired', ARGV[6])
if not r then
  redis.call('ZREM', K.deadlines, SID .. ' ' .. ARGV[4])
  return {'gone', 'final'}
end
count_deferred(tk, 'expired')
return {'ok', r[1], r[2], r[3], r[4]}
