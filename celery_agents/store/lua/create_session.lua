-- Create a session: header, first turn, agent spec (once per hash), indexes, first event.
-- KEYS[NKEYS+1] = agent spec key, KEYS[NKEYS+2] = the lexicographic id index.
-- ARGV[4] = header (JSON object of strings), ARGV[5] = first turn,
-- ARGV[6] = agent spec JSON, ARGV[7] = "1" when a step is owed at once.
if redis.call('EXISTS', K.meta) == 1 then return {'exists'} end
redis.call('SET', KEYS[NKEYS + 1], ARGV[6], 'NX')
local header = cjson.decode(ARGV[4])
for k, v in pairs(header) do redis.call('HSET', K.meta, k, v) end
redis.call('RPUSH', K.turns, ARGV[5])
redis.call('ZADD', KEYS[NKEYS + 2], 0, SID)
set_state(header['state'])
emit('session_started', cjson.encode({agent = header['agent_slug'], drive = header['drive']}))
if ARGV[7] == '1' then owe() end
return {'ok', tonumber(header['version'])}
