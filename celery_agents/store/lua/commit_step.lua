-- Commit one step atomically: version check, new turns, calls, tokens, header, indexes, events,
-- and the outbox entry when another step is owed.
-- ARGV[4] = the commit record (store/commit.py `CommitRecord.to_args`):
--   {version (the version the step read), owner (lease owner), kind, request,
--    n_turns, calls = [field], meta = {header field: text} to set,
--    state, steps_inc, owe (a step is owed next if the session is auto-driven at commit time),
--    batch, batch_size, pending = [[field, created_ms]], dispatched = [field],
--    tokens = [[field, expires_ms, call_id, tool, digest, reason, child]], events = [[kind, data]],
--    inbox_taken (queued user messages the step delivered: the oldest ones)}
-- ARGV[5..] = n_turns turn JSONs, then one call JSON per field of c.calls.
-- KEYS[NKEYS+1..] = one key per token, in the order of c.tokens.
local c = cjson.decode(ARGV[4])
local m = redis.call('HMGET', K.meta, 'version', 'status')
if not m[1] then return {'missing'} end
if m[1] ~= c.version then return {'stale', m[1]} end
if m[2] ~= 'active' then return {'ended', m[2]} end
local holder = redis.call('GET', K.lease)
if holder and holder ~= c.owner then return {'lost_lease', holder} end
-- Messages are only ever added at the tail (send_message.lua): the ones this step read are the
-- oldest. One that came after the step read the queue stays, and a session that would complete
-- with it unread goes on instead (ready; owed a step when driven), so it is never left behind.
if c.inbox_taken > 0 then redis.call('LTRIM', K.inbox, c.inbox_taken, -1) end
if c.meta.status == 'completed' and redis.call('LLEN', K.inbox) > 0 then
  c.meta.status, c.state, c.owe = 'active', 'ready', true
  local kept = {}
  for _, e in ipairs(c.events) do
    if e[1] ~= 'completed' then kept[#kept + 1] = e end
  end
  c.events = kept
end
for i = 1, c.n_turns do
  redis.call('RPUSH', K.turns, ARGV[4 + i])
end
for j, field in ipairs(c.calls) do
  redis.call('HSET', K.calls, field, ARGV[4 + c.n_turns + j])
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
local fields = {}
for name, text in pairs(c.meta) do
  fields[#fields + 1] = name
  fields[#fields + 1] = text
end
redis.call('HSET', K.meta, unpack(fields))
if c.batch >= 0 then redis.call('HSET', K.meta, 'batch', c.batch, 'batch_size', c.batch_size) end
set_state(c.state)
for _, e in ipairs(c.events) do emit(e[1], e[2]) end
emit('step_committed', cjson.encode({from_version = tonumber(c.version), request = c.request,
  kind = c.kind, head = c.meta.head, state = c.state}))
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
