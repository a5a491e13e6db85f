-- Queue a user message (`session send`): it is delivered by the next step that calls the model,
-- after the pending tool results, and removed in that step's commit (commit_step.lua). A completed
-- session becomes active and ready again (not driven: `--run` resumes it); a cancelled one refuses.
-- ARGV[4] = the message (UserQuery JSON), ARGV[5] = how many messages may wait at most,
-- ARGV[6] = the interrupts channel when the message interrupts (`send --interrupt`), else ''.
-- Returns {'ok', version, messages waiting, continued (1: it reopened a completed session)},
-- {'missing'}, {'ended', status} or {'full', waiting}.
-- An interrupting message is announced on the channel as `<session> <version> <waiting>`: a step
-- of the session whose model call is in flight and did not read this message cancels that call
-- (store/live.py). Published in this script, so no step reads the queue between the two.
-- The header's `inbox_waiting` is set to the inbox's length in the header write the script does
-- anyway: a step reads the inbox only when it counts some.
local m = redis.call('HMGET', K.meta, 'status', 'version')
if not m[1] then return {'missing'} end
if m[1] == 'cancelled' then return {'ended', m[1]} end
local waiting = redis.call('LLEN', K.inbox)
if waiting >= tonumber(ARGV[5]) then return {'full', waiting} end
waiting = redis.call('RPUSH', K.inbox, ARGV[4])
emit('message_queued', cjson.encode({waiting = waiting}))
local continued = 0
if m[1] == 'completed' then
  redis.call('HSET', K.meta, 'status', 'active', 'drive', 'manual', 'response', 'null', 'inbox_waiting', waiting)
  set_state('ready')
  emit('continued', '{}')
  continued = 1
else
  touch(nil, {'inbox_waiting', waiting})
  -- pcall: a user the ACL denies the channel still queues its message (it then only waits its turn).
  if ARGV[6] ~= '' then redis.pcall('PUBLISH', ARGV[6], SID .. ' ' .. m[2] .. ' ' .. waiting) end
end
return {'ok', tonumber(m[2]), waiting, continued}
