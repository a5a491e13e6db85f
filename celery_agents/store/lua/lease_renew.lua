-- Extend a lease if its owner still holds it. A lease that lapsed with nobody else taking it (Redis
-- was away longer than the lease, or restarted, and its holder could not renew it) is taken again,
-- for a step's lease only while its session is still active at the step's version: a commit, a
-- cancel or another step in between has moved it on, and then the lease stays lost.
-- KEYS[1] = lease; KEYS[2] (a step's lease) = its session header.
-- ARGV[1] = owner, ARGV[2] = ms, ARGV[3] = the step's version (with KEYS[2]).
-- Returns 1 (renewed), 2 (taken again) or 0 (lost: another owner holds it, or the session moved on).
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if holder then return 0 end
if KEYS[2] then
  local m = redis.call('HMGET', KEYS[2], 'version', 'status')
  if m[1] ~= ARGV[3] or m[2] ~= 'active' then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 2
