-- Pause (drive manual: nothing enqueued) or resume (drive auto, owed a step when one can run).
-- Resuming a failed session makes it active again. ARGV[4] = "manual" or "auto",
-- ARGV[5] = steps to add to the step limit when resuming a session stopped by it.
local m = redis.call('HMGET', K.meta, 'status', 'version')
if not m[1] then return {'missing'} end
if m[1] == 'cancelled' or m[1] == 'completed' then return {'ended', m[1]} end
redis.call('HSET', K.meta, 'drive', ARGV[4])
if ARGV[4] == 'manual' then
  unowe()
  emit('paused', '{}')
  touch()
  return {'ok', tonumber(m[2]), 0}
end
local st
if m[1] == 'failed' then
  st = reactivate(ARGV[5])
else
  st = state_from_head()
  set_state(st)
end
emit('resumed', '{}')
local owed = 0
if OWES_STEP[st] then
  owe()
  owed = 1
end
return {'ok', tonumber(m[2]), owed}
