-- Keep a step's claim on a budget above it while the step lasts (the lease renewer,
-- runtime/lease.py): a claim whose step died lapses one lease after its last renewal.
-- KEYS[1] = the claims of a session above; ARGV[1] = the claim's member, ARGV[2] = how long it
-- lasts (ms). Returns 1 (renewed) or 0 (gone: released with the step's commit, or lapsed).
local claim = redis.call('HGET', KEYS[1], ARGV[1])
if not claim then return 0 end
local t = redis.call('TIME')
local expires = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], string.format('%.0f', expires) .. string.match(claim, '^%S+(.*)$'))
return 1
