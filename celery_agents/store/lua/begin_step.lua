-- Start a step at an expected version: refuse stale copies and copies racing a live one.
-- ARGV[4] = expected version, ARGV[5] = lease owner, ARGV[6] = lease ms, ARGV[7] = request id,
-- ARGV[8] = index of the first turn the caller does not have. On success returns {'ok', payload,
-- Redis's time in ms} (the step stamps its times from that clock, not its host's).
local m = redis.call('HMGET', K.meta, 'version', 'status')
if not m[1] then return {'missing'} end
local req = ARGV[7]
if m[2] ~= 'active' then
  emit('step_skipped', cjson.encode({reason = m[2], request = req, at_version = tonumber(ARGV[4])}))
  return {'ended', m[2]}
end
if m[1] ~= ARGV[4] then
  emit('step_skipped', cjson.encode({reason = 'stale', request = req, at_version = tonumber(ARGV[4])}))
  return {'stale', m[1]}
end
local holder = redis.call('GET', K.lease)
if holder and holder ~= ARGV[5] then
  emit('step_skipped', cjson.encode({reason = 'busy', request = req, at_version = tonumber(ARGV[4])}))
  return {'busy', holder}
end
redis.call('SET', K.lease, ARGV[5], 'PX', ARGV[6])
-- Picked up: if this lease lapses without a commit, the step's worker died.
redis.call('HSET', K.meta, 'picked', m[1])
emit('step_started', cjson.encode({request = req, owner = ARGV[5]}))
return {'ok', load_payload(tonumber(ARGV[8])), NOW_MS}
