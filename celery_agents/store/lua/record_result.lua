-- Record the outcome of an asynchronous or isolated call; the first writer wins.
-- ARGV[4] = call field, ARGV[5] = outcome JSON, ARGV[6] = event data JSON.
if redis.call('EXISTS', K.meta) == 0 then return {'missing'} end
if redis.call('HEXISTS', K.calls, ARGV[4]) == 0 then return {'unknown'} end
local r = finish_call(ARGV[4], ARGV[5], 'tool_finished', ARGV[6])
if not r then return {'already'} end
return {'ok', r[1], r[2], r[3]}
