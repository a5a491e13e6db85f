-- Journal work done by the step in flight; the first writer wins and every writer gets its value.
-- KEYS[1] = journal hash. ARGV[1] = field, ARGV[2] = value.
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then return ARGV[2] end
return redis.call('HGET', KEYS[1], ARGV[1])
