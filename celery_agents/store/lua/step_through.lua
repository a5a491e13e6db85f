-- Prepare one explicit step: make a failed session active again, and record the step as owed so
-- that the sweeper publishes it again if its worker dies before committing.
-- Returns the version the step must run at. ARGV[4] = steps to add when stopped by the step limit.
local m = redis.call('HMGET', K.meta, 'status', 'version')
if not m[1] then return {'missing'} end
if m[1] == 'cancelled' or m[1] == 'completed' then return {'ended', m[1]} end
if m[1] == 'failed' then reactivate(ARGV[4]) end
owe()
return {'ok', tonumber(m[2])}
