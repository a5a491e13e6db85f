-- A deferred call's `call_expiring` warning is due: the session's events say so while its token
-- still waits. Its entry leaves the `expiring` set either way.
-- KEYS[NKEYS+1] = token key, KEYS[NKEYS+2] = the `expiring` sorted set. ARGV[4] = call field.
local tk = KEYS[NKEYS + 1]
redis.call('ZREM', KEYS[NKEYS + 2], SID .. ' ' .. ARGV[4])
local t = redis.call('HMGET', tk, 'state', 'expires_ms', 'call_id', 'tool')
if t[1] ~= 'pending' or redis.call('EXISTS', K.meta) == 0 then return {'gone'} end
emit('call_expiring', cjson.encode({call_id = t[3], tool = t[4], expires_at = tonumber(t[2]) / 1000}))
return {'ok'}
