-- Cancel a session for good: unfinished calls cancelled, tokens dead, no step owed, version bumped
-- so that queued steps are stale. ARGV[4] = JSON {field: outcome JSON} for the unfinished calls
-- seen by the caller. KEYS[NKEYS+1..] = token keys of those calls.
local m = redis.call('HMGET', K.meta, 'status', 'version', 'turn_count', 'head')
if not m[1] then return {'missing'} end
if m[1] == 'cancelled' or m[1] == 'completed' then return {'ended', m[1]} end
local outcomes = cjson.decode(ARGV[4])
for field, outcome in pairs(outcomes) do
  if redis.call('HDEL', K.pending, field) == 1 then
    redis.call('HSET', K.results, field, outcome)
    unindex_call(field)
  end
end
for j = NKEYS + 1, #KEYS do
  if redis.call('HGET', KEYS[j], 'state') == 'pending' then redis.call('HSET', KEYS[j], 'state', 'cancelled') end
end
-- Calls that became unfinished after the caller looked (none in practice) are dropped from the index too.
for _, field in ipairs(redis.call('HKEYS', K.pending)) do unindex_call(field) end
redis.call('DEL', K.pending, K.inbox)
redis.call('HSET', K.meta, 'status', 'cancelled', 'drive', 'manual', 'inbox_waiting', 0)
local version = redis.call('HINCRBY', K.meta, 'version', 1)
set_version(version)
set_state('cancelled')
record_version(version, m[3] or 0, m[4], 'cancelled', 'cancelled', 'cancelled')
unowe()
emit('cancelled', '{}')
return {'ok', version}
