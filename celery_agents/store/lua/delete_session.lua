-- Delete a finished session: every key it owns and its entries in every shared index, at once.
-- KEYS[NKEYS+1] = the lexicographic id index, KEYS[NKEYS+2] = the `rewound` hash (doctor),
-- KEYS[NKEYS+3] = the `expiring` sorted set (deferred calls' warnings),
-- KEYS[NKEYS+4..] = the session's per-call and token keys (store/keys.py `every_session_key`),
-- computed from the calls the caller read.
-- ARGV[4] = how many calls the caller saw (a session that changed since is not deleted),
-- ARGV[5] = "1" to delete an active session too (after it was cancelled, a worker may lag).
local m = redis.call('HMGET', K.meta, 'status', 'state')
if not m[1] then
  redis.call('ZREM', KEYS[NKEYS + 1], SID)
  return {'missing'}
end
if m[1] == 'active' and ARGV[5] ~= '1' then return {'active', m[2]} end
if redis.call('HLEN', K.calls) ~= tonumber(ARGV[4]) then return {'changed'} end
if redis.call('EXISTS', K.lease) == 1 then return {'busy'} end
for i = NKEYS + 2, #KEYS do
  if string.find(KEYS[i], ':call-lease:', 1, true) and redis.call('EXISTS', KEYS[i]) == 1 then return {'busy'} end
end
for _, field in ipairs(redis.call('HKEYS', K.calls)) do
  unindex_call(field)
  redis.call('ZREM', KEYS[NKEYS + 3], SID .. ' ' .. field)
end
redis.call('ZREM', K.owed, SID)
for _, key in pairs(STATE_KEYS) do redis.call('ZREM', key, SID) end
redis.call('ZREM', KEYS[NKEYS + 1], SID)
redis.call('HDEL', KEYS[NKEYS + 2], SID)
-- Every key passed that carries this session's hash tag is the session's own.
local tag = '{' .. SID .. '}'
local n = 0
for i = 1, #KEYS do
  if string.find(KEYS[i], tag, 1, true) then n = n + redis.call('DEL', KEYS[i]) end
end
return {'ok', n}
