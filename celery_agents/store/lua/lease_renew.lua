-- Extend a step's lease if this owner still holds it. KEYS[1] = lease, ARGV[1] = owner, ARGV[2] = ms.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
