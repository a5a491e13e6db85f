-- Create a session: header, first turn, agent spec (once per hash), indexes, first event.
-- KEYS[NKEYS+1] = agent spec key, KEYS[NKEYS+2] = the lexicographic id index, KEYS[NKEYS+3] = the
-- spec's signature key. ARGV[4] = header (JSON object of strings), ARGV[5] = first turn,
-- ARGV[6] = agent spec JSON, ARGV[7] = "1" when a step is owed at once, ARGV[8] = the spec's
-- signature ("" when specs are not signed), ARGV[9] = the summary of its first version.
if redis.call('EXISTS', K.meta) == 1 then return {'exists'} end
store_spec(ARGV[6], ARGV[8])
local header = cjson.decode(ARGV[4])
for k, v in pairs(header) do redis.call('HSET', K.meta, k, v) end
redis.call('HSET', K.meta, 'created_at', NOW)
redis.call('RPUSH', K.turns, ARGV[5])
redis.call('ZADD', KEYS[NKEYS + 2], 0, SID)
set_state(header['state'])
record_version(header['version'], 1, header['head'], header['state'], 'started', ARGV[9])
emit('session_started', cjson.encode({agent = header['agent_slug'], drive = header['drive']}))
if ARGV[7] == '1' then owe() end
return {'ok', tonumber(header['version'])}
