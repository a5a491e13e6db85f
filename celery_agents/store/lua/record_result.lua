-- Record the outcome of an asynchronous or isolated call; the first writer wins.
-- ARGV[4] = call field, ARGV[5] = outcome JSON, ARGV[6] = event data JSON, ARGV[7] = '1' when the
-- worker refused to run the call (its stored record disagrees with the signed spec): the event
-- says so (`call_refused`) instead of `tool_finished`. ARGV[8] = what running (or refusing) the
-- call counted (JSON, `add_counts`; '' none): added by the writer that records the outcome.
-- ARGV[9] = the worker that ran the call under its lease (KEYS[NKEYS + 1]; '' for an outcome that no
-- lease covers, a child session's answer): while another worker holds that lease (this one was
-- frozen past it and the call was handed on), this outcome is refused: the holder's run counts.
if redis.call('EXISTS', K.meta) == 0 then return {'missing'} end
if (ARGV[9] or '') ~= '' then
  local holder = redis.call('GET', KEYS[NKEYS + 1])
  if holder and holder ~= ARGV[9] then return {'lost', holder} end
end
if redis.call('HEXISTS', K.calls, ARGV[4]) == 0 then return {'unknown'} end
local kind = 'tool_finished'
if ARGV[7] == '1' then kind = 'call_refused' end
local r = finish_call(ARGV[4], ARGV[5], kind, ARGV[6])
if not r then return {'already'} end
if (ARGV[8] or '') ~= '' then add_counts(cjson.decode(ARGV[8])) end
return {'ok', r[1], r[2], r[3], r[4]}
