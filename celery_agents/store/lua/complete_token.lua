-- Complete a deferred call through its token: exactly once; unknown, completed, expired and
-- cancelled tokens change nothing but a `token_rejected` event. A token past its deadline that the
-- sweeper has not reached yet is expired here, atomically.
-- KEYS[NKEYS+1] = token key. ARGV[4] = outcome JSON, ARGV[5] = completed by, ARGV[6] = event JSON,
-- ARGV[7] = the outcome recorded if the call turns out to be expired, ARGV[8] = "1" when the
-- completion records a result (not an error). A deferred sub-agent call (its token names the child)
-- is a gate: approved, it becomes a running call, dispatched, which starts the child; the reply
-- {'approved', call id, remaining, 0, version, field} asks the caller to publish it.
-- ARGV[9] = the completions stream entry being applied ('' from the CLI and the API): kept in the
-- token, so that the same entry applied again (a consumer that hung after applying it, taken over)
-- is answered 'applied', not rejected as a completion of an already completed token.
-- A decision (the token's call is an approval gate: its `gate` names the disposition it runs under
-- once approved, or it names a child): ARGV[10] = '' (a completion: the result is recorded, the
-- tool never runs — "respond"), 'approve' or 'reject' ('not_an_approval' for a plain deferred
-- call); ARGV[11] = what an approval records for the call until it has run (JSON: state running,
-- the decision, the approved arguments); ARGV[12] = the digest the decision was made on ('' for
-- none): another than the token's is refused ('digest_mismatch'), nothing changes; ARGV[13] /
-- ARGV[14] = a tool name and its schema digest to grant for the rest of the session ('' for none).
-- An approved gate becomes a running call, dispatched: {'approved', ...} as for a child.
-- ARGV[15] = the decision's seal (AGENTS_SPEC_KEY, '' without): an approval keeps it in the token
-- with ARGV[11] ('decision', 'approved', 'seal'): the record a worker checks before it runs the call.
local tk = KEYS[NKEYS + 1]
local t = redis.call('HMGET', tk, 'state', 'field', 'expires_ms', 'call_id', 'gate', 'child', 'digest')
local decision = ARGV[10] or ''
local gate = (t[5] and t[5] ~= '') or (t[6] and t[6] ~= '')
local function reject(reason)
  if redis.call('EXISTS', K.meta) == 1 then
    emit('token_rejected', cjson.encode({reason = reason, call_id = t[4] or '', by = ARGV[5]}))
  end
end
if not t[1] then
  reject('unknown')
  return {'unknown'}
end
if t[1] ~= 'pending' then
  if t[1] == 'completed' and ARGV[9] ~= '' and redis.call('HGET', tk, 'entry') == ARGV[9] then
    return {'applied', t[4]}
  end
  reject(t[1])
  return {t[1], t[4]}
end
if NOW_MS >= tonumber(t[3]) then
  redis.call('HSET', tk, 'state', 'expired', 'expired_at', NOW)
  local r = finish_call(t[2], ARGV[7], 'token_expired', cjson.encode({call_id = t[4]}))
  reject('expired')
  if r then
    count_deferred(tk, 'expired')
    return {'expired_now', t[4], r[1], r[2], r[3], r[4]}
  end
  return {'expired', t[4]}
end
if decision ~= '' and not gate then
  return {'not_an_approval', t[4]}
end
if (ARGV[12] or '') ~= '' and ARGV[12] ~= t[7] then
  reject('digest_mismatch')
  return {'digest_mismatch', t[4]}
end
local function grant()
  if (ARGV[13] or '') == '' then return end
  local raw = redis.call('HGET', K.meta, 'grants')
  local grants = {}
  if raw and raw ~= '' then grants = cjson.decode(raw) end
  grants[ARGV[13]] = ARGV[14]
  redis.call('HSET', K.meta, 'grants', cjson.encode(grants))
end
if decision == 'approve' and t[5] and t[5] ~= '' and (not t[6] or t[6] == '')
    and redis.call('HEXISTS', K.pending, t[2]) == 1 then
  redis.call('HSET', tk, 'state', 'completed', 'completed_at', NOW, 'completed_by', ARGV[5], 'entry', ARGV[9],
    'decision', 'approved', 'approved', ARGV[11], 'seal', ARGV[15] or '')
  redis.call('ZREM', K.deadlines, SID .. ' ' .. t[2])
  redis.call('HSET', K.results, t[2], ARGV[11])
  redis.call('ZADD', K.dispatched, NOW_MS, SID .. ' ' .. t[2])
  grant()
  emit('call_approved', cjson.encode({call_id = t[4], by = ARGV[5], ['then'] = t[5]}))
  touch()
  count('completions', 'applied')
  return {'approved', t[4], redis.call('HLEN', K.pending), 0, tonumber(version()), t[2]}
end
local child = t[6]
if child and child ~= '' and decision == 'approve' and redis.call('HEXISTS', K.pending, t[2]) == 1 then
  redis.call('HSET', tk, 'state', 'completed', 'completed_at', NOW, 'completed_by', ARGV[5], 'entry', ARGV[9],
    'decision', 'approved', 'approved', ARGV[11] or '', 'seal', ARGV[15] or '')
  redis.call('ZREM', K.deadlines, SID .. ' ' .. t[2])
  redis.call('HSET', K.results, t[2], ARGV[11])
  redis.call('ZADD', K.dispatched, NOW_MS, SID .. ' ' .. t[2])
  emit('delegation_approved', cjson.encode({call_id = t[4], child = child, by = ARGV[5]}))
  touch()
  count('completions', 'applied')
  return {'approved', t[4], redis.call('HLEN', K.pending), 0, tonumber(version()), t[2]}
end
local r = finish_call(t[2], ARGV[4], 'token_completed', ARGV[6])
if not r then
  -- The call ended another way (the session was cancelled); the token dies with it.
  redis.call('HSET', tk, 'state', 'cancelled')
  reject('cancelled')
  return {'cancelled', t[4]}
end
redis.call('HSET', tk, 'state', 'completed', 'completed_at', NOW, 'completed_by', ARGV[5], 'entry', ARGV[9])
count('completions', 'applied')
count_deferred(tk, ARGV[8] == '1' and 'completed' or 'failed')
return {'ok', t[4], r[1], r[2], r[3], r[4]}
