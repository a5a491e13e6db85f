-- What the sweeper does with one session of the outbox (`owed`), decided atomically: a commit or
-- a wake landing between the sweeper's read and its write can then never be dropped.
-- ARGV[4] = "1" when a step no worker picked up counts as lost (its queue cannot hold its message,
-- or it waited past the lost grace). Returns {'settled'} (nothing is owed: the entry is removed),
-- {'running'} (a step holds the lease), {'waiting'} (its message may still be queued), or
-- {'republish', version, priority}: publish it again. Then the entry's time is reset and `picked` cleared,
-- so the new copy is judged by its queue, not published again at every sweep while it waits.
local m = redis.call('HMGET', K.meta, 'version', 'status', 'owed_version', 'picked', 'priority')
if not m[1] or m[2] ~= 'active' or m[3] ~= m[1] then
  redis.call('ZREM', K.owed, SID)
  return {'settled'}
end
if redis.call('EXISTS', K.lease) == 1 then return {'running'} end
if m[4] ~= m[1] and ARGV[4] ~= '1' then return {'waiting'} end
redis.call('HDEL', K.meta, 'picked')
redis.call('ZADD', K.owed, 'XX', NOW_MS, SID)
count('republished', 'step')
-- Not judged lost: a worker had picked it up and its lease lapsed.
if ARGV[4] ~= '1' then count('lease_takeovers', 'step') end
return {'republish', tonumber(m[1]), tonumber(m[5] or '5')}
