-- What the sweeper does with one dispatched call (runAsync/runIsolated, `dispatched`), decided
-- atomically. KEYS[NKEYS+1] = the call's lease, KEYS[NKEYS+2] = its "started" marker.
-- ARGV[4] = call field, ARGV[5] = "1" when a call no worker started counts as lost (its queue
-- cannot hold its message, or it waited past the lost grace). Returns {'settled'} (the call is
-- final: the entry is removed), {'running'}, {'waiting'}, or {'republish', call JSON}: publish it
-- again; its time is reset and the started marker removed, so the new copy is judged by its queue.
local field = ARGV[4]
local member = SID .. ' ' .. field
local call = redis.call('HGET', K.calls, field)
if not call or redis.call('HEXISTS', K.pending, field) == 0 then
  redis.call('ZREM', K.dispatched, member)
  return {'settled'}
end
if redis.call('EXISTS', KEYS[NKEYS + 1]) == 1 then return {'running'} end
if redis.call('EXISTS', KEYS[NKEYS + 2]) == 0 and ARGV[5] ~= '1' then return {'waiting'} end
redis.call('DEL', KEYS[NKEYS + 2])
redis.call('ZADD', K.dispatched, 'XX', NOW_MS, member)
count('republished', 'call')
-- Not judged lost: a worker had started it and its lease lapsed.
if ARGV[5] ~= '1' then count('lease_takeovers', 'call') end
return {'republish', call}
