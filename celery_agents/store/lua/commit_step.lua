-- Commit one step atomically: version check, new turns, calls, tokens, header, indexes, events,
-- and the outbox entry when another step is owed.
-- ARGV[4] = the commit record (store/commit.py `CommitRecord.to_args`):
--   {version (the version the step read), owner (lease owner), attempt (this call's id: its retries
--    resend it), lease_ms, kind, request, n_turns, calls = [field], meta = {header field: text} to set,
--    state, steps_inc, owe (a step is owed next if the session is auto-driven at commit time),
--    batch, batch_size, pending = [[field, created_ms]], dispatched = [field],
--    tokens = [[field, expires_ms, call_id, tool, digest, reason, child, gate]], events = [[kind, data]],
--    inbox_taken (queued user messages the step delivered: the oldest ones), summary (one line: what
--    the step did, for `session history`),
--    spend = {tokens, cost, model_calls, tool_calls}: what the step spent, n_above,
--    deltas = [event id]: the live output its model call streamed (store/live.py), deleted here,
--    claim = the step's member in the claims of the budgets (store/budget.py), n_claims,
--    claim_at = for each claim, whose header: 0 this session's, j the j-th session above}
-- ARGV[5..] = n_turns turn JSONs, then one call JSON per field of c.calls.
-- KEYS[NKEYS+1..] = one key per token, in the order of c.tokens, then (with tokens) the `expiring`
-- sorted set: each token's `call_expiring` is due when a tenth of its wait (at most an hour) remains;
-- then the header of each of the `n_above` sessions above this one, its parent first: the step's
-- spend is added to theirs in the commit (a sub-agent's spend counts against every ancestor);
-- then, with a claim, the claims of each of the `n_claims` sessions with a budget (this one, those
-- above): the claim ends in the write that adds what it was for, committed or refused. A claim of a
-- model call already gone lapsed while the step was frozen, and claim_budget.lua spent its bound on
-- that budget: the step's model spend is not added there again.
-- Not wrapped in `once`: the header keeps the last commit's reply (`last_commit`, "<attempt>
-- <version> <owed>") in the write the commit does anyway, so a retry of this very call (its reply
-- was lost) gets that reply back instead of 'stale'.
-- Its time is that of its first event (ARGV[1] = 'event', see _lib.lua): the events are written
-- before anything that needs the time. The record's `counts` ([[field, n]]: what the step counted,
-- its model calls, tokens and inline tool calls) are added whether it commits or not (its model
-- calls were made), with its outcome (`agents_steps_total`); a retry's reply adds nothing.
local c = cjson.decode(ARGV[4])
-- What the step spent, added to each session above this one (their headers follow the token
-- keys); this session's own with `own` (the fleet's: `add_step_counts`).
-- The step's claims end with its commit (the keys after the headers above): which headers' budgets
-- already spent its model call (its claim lapsed there), computed once.
local charged
local function drop_claims()
  if charged then return charged end
  charged = {}
  if not c.claim then return charged end
  local at = NKEYS + #c.tokens + ((#c.tokens > 0) and 1 or 0) + (c.spend and c.n_above or 0)
  local model = c.spend and tonumber(c.spend[3]) > 0
  for j = 1, c.n_claims do
    if redis.call('HDEL', KEYS[at + j], c.claim) == 0 and model then charged[c.claim_at[j]] = true end
  end
  return charged
end
-- `spend` without its model part for a header whose budget spent the model call already.
local function spend_for(spend, j)
  if drop_claims()[j] then return {0, 0, 0, spend[4]} end
  return spend
end
local function spend_above(spend, own)
  local above = NKEYS + #c.tokens
  if #c.tokens > 0 then above = above + 1 end
  if own then add_spend(K.meta, spend_for(spend, 0)) end
  for j = 1, c.n_above do add_spend(KEYS[above + j], spend_for(spend, j)) end
end
-- The step's counts with its outcome and, tokens and cost, its spend (`agents_spend_total{kind}`:
-- each step's own, counted once), added to the fleet's counters: the counts in one command, the
-- cost (when there is one) in another.
local function add_step_counts(outcome, spend)
  local more = {count_of(1, 'steps', outcome)}
  if spend then
    more[2] = count_of(tonumber(spend[1]) or 0, 'spend', 'tokens')
    add_cost(spend[2])
  end
  add_counts(c.counts, more)
end
-- A refused step made its model call all the same: that is spent (its inline tool results are
-- journaled, and the step that commits in its place reuses and counts them).
local function refused(reply, detail)
  drop_claims()
  local spent = c.spend and reply ~= 'missing' and tonumber(c.spend[3]) > 0
  if spent then spend_above({c.spend[1], c.spend[2], c.spend[3], 0}, true) end
  add_step_counts(STEP_OUTCOMES[reply], spent and c.spend)
  return {reply, detail}
end
-- One read of the header and one write of it: a step's commands do not grow with what it adds.
local m = redis.call('HMGET', K.meta, 'version', 'status', 'turn_count', 'steps', 'state', 'drive', 'owed_version',
  'inbox_waiting', 'head', 'last_commit', unpack(SPENT))
if not m[1] then return refused('missing') end
local first = {string.match(m[10] or '', '^(%S+) (%d+) (%d)$')}
if first[1] == c.attempt then return {'ok', tonumber(first[2]), tonumber(first[3])} end
if m[1] ~= c.version then return refused('stale', m[1]) end
if m[2] ~= 'active' then return refused('ended', m[2]) end
-- The lease is released as it is checked. Another worker's (this step was frozen past its own and
-- someone took over) is put back, with a whole lease: it is renewed while its holder lives.
local holder = redis.call('GETDEL', K.lease)
if holder and holder ~= c.owner then
  redis.call('SET', K.lease, holder, 'PX', c.lease_ms)
  return refused('lost_lease', holder)
end
-- Messages are only ever added at the tail (send_message.lua): the ones this step read are the
-- oldest. One that came after the step read the queue stays, and a session that would complete
-- with it unread goes on instead (ready; owed a step when driven), so it is never left behind.
-- The header counts the queued messages (`inbox_waiting`): when it counts exactly the ones this
-- step took (none, mostly), none is left and the list is not read; otherwise (one came meanwhile)
-- the list's length is read.
if c.inbox_taken > 0 then redis.call('LTRIM', K.inbox, c.inbox_taken, -1) end
local waiting = 0
if (tonumber(m[8]) or 0) ~= c.inbox_taken then waiting = redis.call('LLEN', K.inbox) end
if c.meta.status == 'completed' and waiting > 0 then
  c.meta.status, c.state, c.owe = 'active', 'ready', true
  local kept = {}
  for _, e in ipairs(c.events) do
    if e[1] ~= 'completed' then kept[#kept + 1] = e end
  end
  c.events = kept
end
local version = tonumber(m[1]) + 1
set_version(version)
for _, e in ipairs(c.events) do emit(e[1], e[2]) end
-- The answer is committed: what streamed of it goes (one XDEL, whatever the length of the answer).
if c.deltas then in_slices('XDEL', K.events, c.deltas) end
emit('step_committed', cjson.encode({from_version = tonumber(c.version), request = c.request,
  kind = c.kind, head = c.meta.head, state = c.state}))
write_turns_and_calls(c, 4)
local members, scored = {}, {}
for _, p in ipairs(c.pending) do
  members[#members + 1] = p[1]
  members[#members + 1] = ''
  scored[#scored + 1] = p[2]
  scored[#scored + 1] = SID .. ' ' .. p[1]
end
in_slices('HSET', K.pending, members)
in_slices('ZADD', K.pending_all, scored)
local dispatched = {}
for _, field in ipairs(c.dispatched) do
  dispatched[#dispatched + 1] = NOW_MS
  dispatched[#dispatched + 1] = SID .. ' ' .. field
end
in_slices('ZADD', K.dispatched, dispatched)
for j, t in ipairs(c.tokens) do
  create_token(KEYS[NKEYS + j], t)
  redis.call('ZADD', K.deadlines, t[2], SID .. ' ' .. t[1])
  redis.call('ZADD', KEYS[NKEYS + #c.tokens + 1], warn_at(t[2]), SID .. ' ' .. t[1])
end
local fields = {
  'version', version,
  'turn_count', tonumber(m[3] or '0') + c.n_turns,
  'steps', tonumber(m[4] or '0') + c.steps_inc,
}
-- A header field absent reads as its default (store/header.py `SPARSE`): a count or spend that is
-- none and was none is not written.
if (tonumber(m[8]) or 0) ~= waiting then
  fields[#fields + 1] = 'inbox_waiting'
  fields[#fields + 1] = waiting
end
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
-- What the step spent, added to the session's own spend in this same write (read above).
if c.spend then
  local own = spend_for(c.spend, 0)
  for i, f in ipairs(SPENT) do
    local total = tonumber(m[10 + i] or '0') + tonumber(own[i])
    if total ~= 0 or m[10 + i] then
      fields[#fields + 1] = f
      fields[#fields + 1] = i == 2 and string.format('%.17g', total) or string.format('%d', total)
    end
  end
end
fields[#fields + 1] = 'last_commit'
fields[#fields + 1] = c.attempt .. ' ' .. version .. ' ' .. owed
redis.call('HSET', K.meta, unpack(fields))
record_version(version, tonumber(m[3] or '0') + c.n_turns, c.meta.head, c.state, c.kind, c.summary)
local old = m[5]
if old and old ~= c.state and STATE_KEYS[old] then redis.call('ZREM', STATE_KEYS[old], SID) end
if STATE_KEYS[c.state] then redis.call('ZADD', STATE_KEYS[c.state], NOW_MS, SID) end
-- The journal of the step (the lease went above), if the step may have written one.
if journal_may_hold(m[9], m[8]) then redis.call('DEL', K.journal) end
if owed == 1 then
  redis.call('ZADD', K.owed, NOW_MS, SID)
elseif m[7] then
  -- `owe` sets `owed_version` with the index entry, `unowe` removes both: without it, nothing to undo.
  unowe()
end
if c.spend then spend_above(c.spend, false) end
add_step_counts('committed', c.spend)
drop_claims()
return {'ok', version, owed}
