-- Make a session as a fork of another: header, the origin's turns up to the version forked at, the
-- newest batch's calls as the fork takes them (unfinished deferred ones under new tokens), the
-- fork's own version 1 (none of the origin's), the reuse table of a rerun, indexes, event.
-- Everything of the origin was read before: nothing here touches it.
-- KEYS[NKEYS+1] = agent spec key, KEYS[NKEYS+2] = the lexicographic id index, KEYS[NKEYS+3] = the
-- spec's signature key, KEYS[NKEYS+4] = the `expiring` sorted set, KEYS[NKEYS+5..] = one key per token,
-- then the header of each of the `n_above` sessions above the fork (its origin's ancestors).
-- ARGV[4] = header (JSON object of strings), ARGV[5] = agent spec JSON, ARGV[6] = the spec's
-- signature ("" when specs are not signed), ARGV[7] = the fork record (store/history.py
-- `ForkRecord.to_args`): {origin, at, summary, n_turns, batch, batch_size, calls = [field], pending = [[field,
-- created_ms]], dispatched = [field], tokens = [[field, expires_ms, call_id, tool, digest, reason,
-- child, gate]], replay = [[digest, outcome JSON]], n_above};
-- ARGV[8..] = n_turns turn JSONs, then one call JSON per field of calls.
if redis.call('EXISTS', K.meta) == 1 then return {'exists'} end
store_spec(ARGV[5], ARGV[6])
local c = cjson.decode(ARGV[7])
local header = cjson.decode(ARGV[4])
for k, v in pairs(header) do redis.call('HSET', K.meta, k, v) end
redis.call('HSET', K.meta, 'created_at', NOW)
if c.batch >= 0 then redis.call('HSET', K.meta, 'batch', c.batch, 'batch_size', c.batch_size) end
write_turns_and_calls(c, 7)
for _, p in ipairs(c.pending) do
  redis.call('HSET', K.pending, p[1], '')
  redis.call('ZADD', K.pending_all, p[2], SID .. ' ' .. p[1])
end
for _, field in ipairs(c.dispatched) do redis.call('ZADD', K.dispatched, NOW_MS, SID .. ' ' .. field) end
-- The copied calls the fork runs again are tool calls it spends, and so do the sessions above it.
if #c.dispatched > 0 then
  redis.call('HINCRBY', K.meta, 'spent_tool_calls', #c.dispatched)
  for j = 1, c.n_above or 0 do add_spend(KEYS[NKEYS + 4 + #c.tokens + j], {0, 0, 0, #c.dispatched}) end
end
for j, t in ipairs(c.tokens) do
  create_token(KEYS[NKEYS + 4 + j], t)
  redis.call('ZADD', K.deadlines, t[2], SID .. ' ' .. t[1])
  redis.call('ZADD', KEYS[NKEYS + 4], warn_at(t[2]), SID .. ' ' .. t[1])
end
record_version(header['version'], c.n_turns, header['head'], header['state'], 'forked', c.summary)
local replay = {}
for _, r in ipairs(c.replay) do
  replay[#replay + 1] = r[1]
  replay[#replay + 1] = r[2]
end
in_slices('HSET', K.replay, replay)
redis.call('ZADD', KEYS[NKEYS + 2], 0, SID)
set_state(header['state'])
emit('forked', cjson.encode({session_id = c.origin, version = c.at}))
return {'ok', tonumber(header['version'])}
