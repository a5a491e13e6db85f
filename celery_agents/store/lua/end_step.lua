-- End a step that commits nothing (nothing to do yet): release the lease, drop the owed entry
-- unless something is owed again, and tell waiters. ARGV[4] = lease owner, ARGV[5] = request,
-- ARGV[6] = reason, ARGV[7] = "1" when the step must stay owed (it failed and will be retried),
-- ARGV[8] = the step's outcome to count ('' none: waiting, noop, error), ARGV[9] = what the step
-- counted (JSON, `add_counts`; '' none).
if redis.call('GET', K.lease) == ARGV[4] then redis.call('DEL', K.lease) end
if ARGV[7] ~= '1' then
  if not OWES_STEP[redis.call('HGET', K.meta, 'state')] then unowe() end
end
emit('step_noop', cjson.encode({request = ARGV[5], reason = ARGV[6]}))
add_counts((ARGV[9] or '') ~= '' and cjson.decode(ARGV[9]) or {},
  (ARGV[8] or '') ~= '' and {count_of(1, 'steps', ARGV[8])} or {})
return {'ok'}
