-- Fail a session whose step cannot go on (the agent or the session data is unusable).
-- ARGV[4] = expected version, ARGV[5] = error JSON, ARGV[6] = lease owner, ARGV[7] = error code.
local m = redis.call('HMGET', K.meta, 'version', 'status')
if m[1] ~= ARGV[4] or m[2] ~= 'active' then return {'stale'} end
redis.call('HSET', K.meta, 'status', 'failed', 'error', ARGV[5], 'error_code', ARGV[7])
set_version(redis.call('HINCRBY', K.meta, 'version', 1))
set_state('failed')
unowe()
if redis.call('GET', K.lease) == ARGV[6] then redis.call('DEL', K.lease) end
emit('failed', ARGV[5])
return {'ok'}
