-- Start a step at an expected version: refuse stale copies and copies racing a live one.
-- ARGV[4] = expected version, ARGV[5] = lease owner, ARGV[6] = lease ms, ARGV[7] = request id,
-- ARGV[8] = index of the first turn the caller does not have. On success returns {'ok', payload,
-- Redis's time in ms} (the step stamps its times from that clock, not its host's).
-- The header is read once (HGETALL) and serves the checks, the events and the payload. Its time
-- is that of the event it writes (ARGV[1] = 'event', see _lib.lua): every path emits one first.
-- A refusal is counted as the step's outcome (`agents_steps_total`).
local function refused(reply, detail)
  count('steps', STEP_OUTCOMES[reply])
  return {reply, detail}
end
local flat, meta = read_meta()
if not meta.version then return refused('missing') end
set_version(meta.version)
local req = ARGV[7]
local status = meta.status or false
if status ~= 'active' then
  emit('step_skipped', cjson.encode({reason = status, request = req, at_version = tonumber(ARGV[4])}))
  return refused('ended', status)
end
if meta.version ~= ARGV[4] then
  emit('step_skipped', cjson.encode({reason = 'stale', request = req, at_version = tonumber(ARGV[4])}))
  return refused('stale', meta.version)
end
-- The lease in one command when it is free; read only when it is not: its holder retrying the
-- same step (its reply lost) takes it again, anyone else is refused.
if not redis.call('SET', K.lease, ARGV[5], 'NX', 'PX', ARGV[6]) then
  local holder = redis.call('GET', K.lease)
  if holder ~= ARGV[5] then
    emit('step_skipped', cjson.encode({reason = 'busy', request = req, at_version = tonumber(ARGV[4])}))
    return refused('busy', holder)
  end
  redis.call('SET', K.lease, ARGV[5], 'PX', ARGV[6])
end
-- Picked up: if this lease lapses without a commit, the step's worker died. Only a step owed at
-- this version is ever judged by it (sweep_owed.lua and `agents doctor` read it with `owed_version`),
-- and `owe` clears it when the step becomes owed later: a step not owed now leaves it as it is.
if meta.owed_version == meta.version then
  redis.call('HSET', K.meta, 'picked', meta.version)
  if meta.picked == nil then
    flat[#flat + 1] = 'picked'
    flat[#flat + 1] = meta.version
  else
    for i = 1, #flat, 2 do
      if flat[i] == 'picked' then flat[i + 1] = meta.version end
    end
  end
end
-- A step put back by a fleet limit (throttle_step.lua) has come back: it waits no more.
if meta.throttled_until and meta.throttled_until ~= '' then redis.call('HDEL', K.meta, 'throttled_until') end
emit('step_started', cjson.encode({request = req, owner = ARGV[5]}))
-- Watched (watch.lua): someone follows the session's events, and its model call streams.
local watched = (tonumber(meta.watch_until) or 0) > NOW_MS and 1 or 0
return {'ok', load_payload(tonumber(ARGV[8]), flat, meta, ARGV[5]), NOW_MS, watched}
