-- Commit one step atomically: version check, new turns, calls, tokens, header, indexes, events,
-- and the outbox entry when another step is owed.
-- ARGV[4] = expected version, ARGV[5] = lease owner, ARGV[6] = control JSON:
--   {n_turns, n_calls, head, state, status, response, error, usage, steps_inc, batch, batch_size,
--    owe (a step is owed next if the session is auto-driven at commit time),
--    pending = [[field, created_ms]], dispatched = [field], tokens = [[field, expires_ms, call_id, tool, digest, reason, child]],
--    events = [[kind, data]], request, turns_digest (after the new turns; empty: none kept),
--    inbox_taken (queued messages this step delivered: the oldest ones)}
-- ARGV[7..] = n_turns turn JSONs, then n_calls pairs (field, call JSON).
-- KEYS[NKEYS+1..] = one key per token, in the order of control.tokens.
local m = redis.call('HMGET', K.meta, 'version', 'status')
if not m[1] then return {'missing'} end
if m[1] ~= ARGV[4] then return {'stale', m[1]} end
if m[2] ~= 'active' then return {'ended', m[2]} end
local holder = redis.call('GET', K.lease)
if holder and holder ~= ARGV[5] then return {'lost_lease', holder} end
local c = cjson.decode(ARGV[6])
-- Messages are only ever added at the tail (send_message.lua): the ones this step read are the
-- oldest. One that came after the step read the queue stays, and a session that would complete
-- with it unread goes on instead (ready; owed a step when driven), so it is never left behind.
if c.inbox_taken > 0 then redis.call('LTRIM', K.inbox, c.inbox_taken, -1) end
if c.status == 'completed' and redis.call('LLEN', K.inbox) > 0 then
  c.status, c.state, c.owe = 'active', 'ready', true
  local kept = {}
  for _, e in ipairs(c.events) do
    if e[1] ~= 'completed' then kept[#kept + 1] = e end
  end
  c.events = kept
end
local i = 7
for _ = 1, c.n_turns do
  redis.call('RPUSH', K.turns, ARGV[i])
  i = i + 1
end
for _ = 1, c.n_calls do
  redis.call('HSET', K.calls, ARGV[i], ARGV[i + 1])
  i = i + 2
end
for _, p in ipairs(c.pending) do
  redis.call('SADD', K.pending, p[1])
  redis.call('ZADD', K.pending_all, p[2], SID .. ' ' .. p[1])
end
for _, field in ipairs(c.dispatched) do
  redis.call('ZADD', K.dispatched, NOW_MS, SID .. ' ' .. field)
end
for j, t in ipairs(c.tokens) do
  redis.call('HSET', KEYS[NKEYS + j], 'session_id', SID, 'field', t[1], 'state', 'pending',
    'expires_ms', t[2], 'call_id', t[3], 'tool', t[4], 'digest', t[5], 'reason', t[6], 'created_at', NOW,
    'child', t[7])
  redis.call('ZADD', K.deadlines, t[2], SID .. ' ' .. t[1])
end
local version = redis.call('HINCRBY', K.meta, 'version', 1)
set_version(version)
redis.call('HINCRBY', K.meta, 'turn_count', c.n_turns)
redis.call('HINCRBY', K.meta, 'steps', c.steps_inc)
redis.call('HSET', K.meta, 'head', c.head, 'status', c.status, 'usage', c.usage,
  'response', c.response, 'error', c.error)
if c.turns_digest ~= '' then redis.call('HSET', K.meta, 'turns_digest', c.turns_digest) end
if c.batch >= 0 then redis.call('HSET', K.meta, 'batch', c.batch, 'batch_size', c.batch_size) end
set_state(c.state)
for _, e in ipairs(c.events) do emit(e[1], e[2]) end
emit('step_committed', cjson.encode({from_version = tonumber(ARGV[4]), request = c.request,
  kind = c.kind, head = c.head, state = c.state}))
redis.call('DEL', K.journal)
redis.call('DEL', K.lease)
-- The drive is read now, not when the step began: a pause during the step must hold.
local owed = 0
if c.owe and redis.call('HGET', K.meta, 'drive') == 'auto' then
  owe()
  owed = 1
else
  unowe()
end
return {'ok', version, owed}
