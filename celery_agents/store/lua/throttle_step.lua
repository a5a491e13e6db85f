-- Put back a step whose model call a fleet limit (or a model's pause) made wait, or whose call a
-- budget above, shared with sub-agents at once, made wait: release the lease, keep the step owed
-- from the time it may start, and show that time in the header.
-- ARGV[4] = lease owner, ARGV[5] = request, ARGV[6] = when the call may start (ms, Redis's clock),
-- ARGV[7] = the limit's KEY (the paused model; the session whose budget), ARGV[8] = why (rate,
-- concurrency, paused, budget),
-- ARGV[9] = what the step counted (JSON, `add_counts`).
-- The outbox entry is scored by that time: the sweeper judges it only once it has passed (and its
-- grace with it), and, `picked` cleared, as a step whose message may be waiting in its queue; so a
-- step whose worker died while it waited is published again then, and one waiting is left alone.
if redis.call('GET', K.lease) == ARGV[4] then redis.call('DEL', K.lease) end
local until_ms = tonumber(ARGV[6])
emit('step_throttled', cjson.encode({request = ARGV[5], ['until'] = until_ms / 1000, key = ARGV[7],
  reason = ARGV[8]}))
local m = redis.call('HMGET', K.meta, 'status', 'owed_version', 'version')
if m[1] == 'active' and m[2] and m[2] == m[3] then
  redis.call('ZADD', K.owed, math.floor(until_ms), SID)
  redis.call('HDEL', K.meta, 'picked')
end
redis.call('HSET', K.meta, 'throttled_until', string.format('%.3f', until_ms / 1000))
add_counts(cjson.decode(ARGV[9]), {count_of(1, 'steps', 'throttled')})
return {'ok'}
