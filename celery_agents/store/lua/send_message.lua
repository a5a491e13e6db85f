-- Queue a user message (`session send`): it is delivered by the next step that calls the model,
-- after the pending tool results, and removed in that step's commit (commit_step.lua). A completed
-- session becomes active and ready again (not driven: `--run` resumes it); a cancelled one refuses.
-- ARGV[4] = the message (UserQuery JSON), ARGV[5] = how many messages may wait at most.
-- Returns {'ok', version, messages waiting}, {'missing'}, {'ended', status} or {'full', waiting}.
-- The header's `inbox_waiting` is set to the inbox's length in the header write the script does
-- anyway: a step reads the inbox only when it counts some.
local m = redis.call('HMGET', K.meta, 'status', 'version')
if not m[1] then return {'missing'} end
if m[1] == 'cancelled' then return {'ended', m[1]} end
local waiting = redis.call('LLEN', K.inbox)
if waiting >= tonumber(ARGV[5]) then return {'full', waiting} end
waiting = redis.call('RPUSH', K.inbox, ARGV[4])
emit('message_queued', cjson.encode({waiting = waiting}))
if m[1] == 'completed' then
  redis.call('HSET', K.meta, 'status', 'active', 'drive', 'manual', 'response', 'null', 'inbox_waiting', waiting)
  set_state('ready')
  emit('continued', '{}')
else
  touch(nil, {'inbox_waiting', waiting})
end
return {'ok', tonumber(m[2]), waiting}
