-- Pause (drive manual: nothing enqueued) or resume (drive auto, owed a step when one can run).
-- Resuming a failed session makes it active again. ARGV[4] = "manual" or "auto",
-- ARGV[5] = steps to add to the step limit when resuming a session stopped by it, ARGV[6] = the
-- limits to add to the session's budget when resuming (JSON, `resume --grant`; '' for none): a
-- limit the budget does not set stays unset (no limit).
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
local grant = ARGV[6] or ''
if grant ~= '' then
  local raw = redis.call('HGET', K.meta, 'budget')
  if raw and raw ~= '' then
    local budget = cjson.decode(raw)
    for kind, more in pairs(cjson.decode(grant)) do
      -- within what the budget's model reads back exactly (budget.py MAX_COUNT_LIMIT, MAX_COST_LIMIT)
      if budget[kind] ~= nil then budget[kind] = math.min(budget[kind] + more, kind == 'costUsd' and 1e9 or 1e13) end
    end
    redis.call('HSET', K.meta, 'budget', cjson.encode(budget))
  end
end
local st
if m[1] == 'failed' then
  st = reactivate(ARGV[5])
else
  st = state_from_head()
  set_state(st)
end
if grant ~= '' then emit('resumed', cjson.encode({grant = cjson.decode(grant)})) else emit('resumed', '{}') end
local owed = 0
if OWES_STEP[st] then
  owe()
  owed = 1
end
return {'ok', tonumber(m[2]), owed}
