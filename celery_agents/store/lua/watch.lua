-- Someone follows the session's events: its model calls stream until `watch_until` (a header
-- field, Redis's clock in ms; begin_step.lua reads it with the header it reads anyway).
-- KEYS[1] = the session header. ARGV[1] = how long the watch lasts (ms).
-- Nothing is written for a session that does not exist (deleted meanwhile).
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'watch_until', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1]))
return 1
