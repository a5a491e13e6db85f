-- Keep a model call's slot under a concurrency limit while the call lasts (the lease renewer,
-- runtime/lease.py): a slot whose holder died lapses one lease after its last renewal.
-- KEYS[1] = a KEY's slots in flight; ARGV[1] = the slot's id, ARGV[2] = how long it lasts (ms).
-- Returns 1 (renewed) or 0 (gone: released, or lapsed and swept).
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], 'XX', tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000 + tonumber(ARGV[2]), ARGV[1])
return 1
