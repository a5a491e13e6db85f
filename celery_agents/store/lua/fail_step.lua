-- Fail a session whose step cannot go on (the agent or the session data is unusable).
-- ARGV[4] = expected version, ARGV[5] = error JSON, ARGV[6] = lease owner, ARGV[7] = error code,
-- ARGV[8] = what the step counted (JSON, `add_counts`; '' none).
local m = redis.call('HMGET', K.meta, 'version', 'status', 'turn_count', 'head')
if m[1] ~= ARGV[4] or m[2] ~= 'active' then return {'stale'} end
redis.call('HSET', K.meta, 'status', 'failed', 'error', ARGV[5], 'error_code', ARGV[7])
set_version(redis.call('HINCRBY', K.meta, 'version', 1))
set_state('failed')
record_version(version(), m[3] or 0, m[4], 'failed', 'failed', 'failed: ' .. ARGV[7])
unowe()
if redis.call('GET', K.lease) == ARGV[6] then redis.call('DEL', K.lease) end
emit('failed', ARGV[5])
add_counts((ARGV[8] or '') ~= '' and cjson.decode(ARGV[8]) or {}, {count_of(1, 'steps', 'failed')})
return {'ok'}
