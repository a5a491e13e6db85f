-- Read a session as a step would, without starting one. ARGV[4] = index of the first turn wanted.
if redis.call('EXISTS', K.meta) == 0 then return false end
return load_payload(tonumber(ARGV[4]))
