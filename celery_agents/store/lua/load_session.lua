-- Read what a step needs in one round trip: header, turns from index ARGV[4], newest batch's calls
-- and outcomes. Returns {meta (flat), turns, calls, results, lease holder}.
local meta = redis.call('HGETALL', K.meta)
if #meta == 0 then return false end
local turns = redis.call('LRANGE', K.turns, tonumber(ARGV[4]), -1)
local batch = redis.call('HMGET', K.meta, 'batch', 'batch_size')
local calls, results = {}, {}
if batch[1] and batch[2] then
  local fields = {}
  for p = 0, tonumber(batch[2]) - 1 do fields[#fields + 1] = batch[1] .. ':' .. p end
  if #fields > 0 then
    calls = redis.call('HMGET', K.calls, unpack(fields))
    results = redis.call('HMGET', K.results, unpack(fields))
  end
end
return {meta, turns, calls, results, redis.call('GET', K.lease) or ''}
