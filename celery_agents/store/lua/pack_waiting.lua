-- Pack the events of a session a commit has just left waiting (`_lib.lua` `pack_events`), if it
-- still waits. A call of its own after the commit, not part of it: Redis hands a blocked XREAD the
-- entries a command added once the command has run, and only if the stream is still there; a
-- commit that added its events and deleted the stream would leave its followers blocked (the
-- session's `run`, `logs --follow`, the page) until their block ran out. Harmless to repeat.
if redis.call('HGET', K.meta, 'state') ~= 'waiting' then return 0 end
pack_events()
return 1
