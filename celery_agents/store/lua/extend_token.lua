-- Move a pending deferred call's deadline to now + ARGV[4] ms (`session extend`): its token, the
-- deadlines index, its `call_expiring` warning and, for listings, an `expires_at` kept in its
-- results entry (a call still pending has none; the decision that finishes it overwrites it).
-- KEYS[NKEYS+1] = token key, KEYS[NKEYS+2] = the `expiring` sorted set.
-- Reply {'ok', expires_ms}, or the token's state ('unknown', 'completed', 'expired', 'cancelled').
local tk = KEYS[NKEYS + 1]
local t = redis.call('HMGET', tk, 'state', 'field', 'expires_ms', 'call_id')
if not t[1] then return {'unknown'} end
if t[1] ~= 'pending' then return {t[1]} end
if NOW_MS >= tonumber(t[3]) or redis.call('HEXISTS', K.pending, t[2]) == 0 then return {'expired'} end
local until_ms = NOW_MS + tonumber(ARGV[4])
local member = SID .. ' ' .. t[2]
redis.call('HSET', tk, 'expires_ms', until_ms)
redis.call('ZADD', K.deadlines, until_ms, member)
redis.call('ZADD', KEYS[NKEYS + 2], warn_at(until_ms), member)
redis.call('HSET', K.results, t[2], cjson.encode({state = 'deferred', expires_at = until_ms / 1000}))
emit('call_extended', cjson.encode({call_id = t[4], expires_at = until_ms / 1000}))
touch()
return {'ok', tostring(until_ms)}
