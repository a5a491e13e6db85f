-- Journal work done by the step in flight; the first writer wins and every writer gets its value.
-- Fenced: a step whose session moved past its version, or whose lease another worker holds, writes
-- nothing (it was frozen or partitioned and someone else took over); the journal expires, so a
-- journal no commit deletes does not stay forever.
-- KEYS[1] = journal hash, KEYS[2] = session lease, KEYS[3] = session header.
-- ARGV[1] = field, ARGV[2] = value, ARGV[3] = lease owner, ARGV[4] = the step's version,
-- ARGV[5] = journal time to live (seconds). Returns {'ok', value} or {'lost', why}.
if redis.call('HGET', KEYS[3], 'version') ~= ARGV[4] then return {'lost', 'stale'} end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[3] then return {'lost', 'lease'} end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('EXPIRE', KEYS[1], ARGV[5])
  return {'ok', ARGV[2]}
end
return {'ok', redis.call('HGET', KEYS[1], ARGV[1])}
