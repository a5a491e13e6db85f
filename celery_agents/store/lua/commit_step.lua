-- Commit one step atomically: version check, new turns, calls, tokens, header, indexes, events,
-- and the outbox entry when another step is owed.
-- ARGV[4] = the commit record (store/commit.py `CommitRecord.to_args`):
--   {version (the version the step read), owner (lease owner), attempt (this call's id: its retries
--    resend it), lease_ms, kind, request, n_turns, calls = [field], meta = {header field: text} to set,
--    state, steps_inc, owe (a step is owed next if the session is auto-driven at commit time),
--    batch, batch_size, pending = [[field, created_ms]], dispatched = [field],
--    tokens = [[field, expires_ms, call_id, tool, digest, reason, child]], events = [[kind, data]],
--    inbox_taken (queued user messages the step delivered: the oldest ones)}
-- ARGV[5..] = n_turns turn JSONs, then one call JSON per field of c.calls.
-- KEYS[NKEYS+1..] = one key per token, in the order of c.tokens.
-- Not wrapped in `once`: the header keeps the last commit's reply (`last_commit`, "<attempt>
-- <version> <owed>") in the write the commit does anyway, so a retry of this very call (its reply
-- was lost) gets that reply back instead of 'stale'.
local c = cjson.decode(ARGV[4])
-- One read of the header and one write of it: a step's commands do not grow with what it adds.
local m = redis.call('HMGET', K.meta, 'version', 'status', 'turn_count', 'steps', 'state', 'drive', 'owed_version',
  'inbox_waiting', 'head', 'last_commit')
if not m[1] then return {'missing'} end
local first = {string.match(m[10] or '', '^(%S+) (%d+) (%d)$')}
if first[1] == c.attempt then return {'ok', tonumber(first[2]), tonumber(first[3])} end
if m[1] ~= c.version then return {'stale', m[1]} end
if m[2] ~= 'active' then return {'ended', m[2]} end
-- The lease is released as it is checked. Another worker's (this step was frozen past its own and
-- someone took over) is put back, with a whole lease: it is renewed while its holder lives.
local holder = redis.call('GETDEL', K.lease)
if holder and holder ~= c.owner then
  redis.call('SET', K.lease, holder, 'PX', c.lease_ms)
  return {'lost_lease', holder}
end
-- Messages are only ever added at the tail (send_message.lua): the ones this step read are the
-- oldest. One that came after the step read the queue stays, and a session that would complete
-- with it unread goes on instead (ready; owed a step when driven), so it is never left behind.
-- The header counts the queued messages (`inbox_waiting`): when it counts exactly the ones this
-- step took (none, mostly), none is left and the list is not read; otherwise (one came meanwhile,
-- or the header has no count: a session an older release wrote) the list's length is read.
if c.inbox_taken > 0 then redis.call('LTRIM', K.inbox, c.inbox_taken, -1) end
local waiting = 0
if tonumber(m[8]) ~= c.inbox_taken then waiting = redis.call('LLEN', K.inbox) end
if c.meta.status == 'completed' and waiting > 0 then
  c.meta.status, c.state, c.owe = 'active', 'ready', true
  local kept = {}
  for _, e in ipairs(c.events) do
    if e[1] ~= 'completed' then kept[#kept + 1] = e end
  end
  c.events = kept
end
-- Variadic writes in slices: Lua's unpack takes a few thousand values at most.
local function in_slices(cmd, key, values)
  for first = 1, #values, 1000 do
    redis.call(cmd, key, unpack(values, first, math.min(first + 999, #values)))
  end
end
local turns = {}
for i = 1, c.n_turns do turns[i] = ARGV[4 + i] end
in_slices('RPUSH', K.turns, turns)
local call_fields = {}
for j, field in ipairs(c.calls) do
  call_fields[#call_fields + 1] = field
  call_fields[#call_fields + 1] = ARGV[4 + c.n_turns + j]
end
in_slices('HSET', K.calls, call_fields)
local members, scored = {}, {}
for _, p in ipairs(c.pending) do
  members[#members + 1] = p[1]
  scored[#scored + 1] = p[2]
  scored[#scored + 1] = SID .. ' ' .. p[1]
end
in_slices('SADD', K.pending, members)
in_slices('ZADD', K.pending_all, scored)
local dispatched = {}
for _, field in ipairs(c.dispatched) do
  dispatched[#dispatched + 1] = NOW_MS
  dispatched[#dispatched + 1] = SID .. ' ' .. field
end
in_slices('ZADD', K.dispatched, dispatched)
for j, t in ipairs(c.tokens) do
  redis.call('HSET', KEYS[NKEYS + j], 'session_id', SID, 'field', t[1], 'state', 'pending',
    'expires_ms', t[2], 'call_id', t[3], 'tool', t[4], 'digest', t[5], 'reason', t[6], 'created_at', NOW,
    'child', t[7])
  redis.call('ZADD', K.deadlines, t[2], SID .. ' ' .. t[1])
end
local version = tonumber(m[1]) + 1
set_version(version)
local fields = {
  'version', version,
  'turn_count', tonumber(m[3] or '0') + c.n_turns,
  'steps', tonumber(m[4] or '0') + c.steps_inc,
  'inbox_waiting', waiting,
}
for name, text in pairs(c.meta) do
  fields[#fields + 1] = name
  fields[#fields + 1] = text
end
if c.batch >= 0 then
  for _, v in ipairs({'batch', c.batch, 'batch_size', c.batch_size}) do fields[#fields + 1] = v end
end
-- The new state, its index and the updated time (`set_state`, with the old state read above).
for _, v in ipairs({'updated_at', NOW, 'state', c.state}) do fields[#fields + 1] = v end
-- The drive is read now, not when the step began: a pause during the step must hold.
local owed = 0
if c.owe and m[6] == 'auto' then
  -- `owe` in this same write: `picked` (the old version) already differs from the new one.
  owed = 1
  fields[#fields + 1] = 'owed_version'
  fields[#fields + 1] = version
end
fields[#fields + 1] = 'last_commit'
fields[#fields + 1] = c.attempt .. ' ' .. version .. ' ' .. owed
redis.call('HSET', K.meta, unpack(fields))
local old = m[5]
if old and old ~= c.state and STATE_KEYS[old] then redis.call('ZREM', STATE_KEYS[old], SID) end
redis.call('ZADD', K.sessions, NOW_MS, SID)
if STATE_KEYS[c.state] then redis.call('ZADD', STATE_KEYS[c.state], NOW_MS, SID) end
for _, e in ipairs(c.events) do emit(e[1], e[2]) end
emit('step_committed', cjson.encode({from_version = tonumber(c.version), request = c.request,
  kind = c.kind, head = c.meta.head, state = c.state}))
-- The journal of the step (the lease went above), if the step may have written one.
if journal_may_hold(m[9], m[8]) then redis.call('DEL', K.journal) end
if owed == 1 then
  redis.call('ZADD', K.owed, NOW_MS, SID)
elseif m[7] then
  -- `owe` sets `owed_version` with the index entry, `unowe` removes both: without it, nothing to undo.
  unowe()
end
return {'ok', version, owed}
