-- Shared by every session script (prepended when scripts are loaded).
-- KEYS: the session keys, then the shared keys, in the order of store/keys.py, then the call's
-- request key; extra keys after.
-- ARGV[1] = now in seconds (empty: Redis's clock; set only by tests), ARGV[2] = events cap,
-- ARGV[3] = session id; the rest per script.
local K = {
  meta = KEYS[1], turns = KEYS[2], calls = KEYS[3], results = KEYS[4], pending = KEYS[5],
  journal = KEYS[6], events = KEYS[7], lease = KEYS[8], inbox = KEYS[9], children = KEYS[10],
  sessions = KEYS[11], pending_all = KEYS[12], deadlines = KEYS[13], owed = KEYS[14], dispatched = KEYS[15],
  request = KEYS[22],
}
local STATE_KEYS = {
  ready = KEYS[16], tools = KEYS[17], waiting = KEYS[18],
  completed = KEYS[19], failed = KEYS[20], cancelled = KEYS[21],
}
local NKEYS = 22
-- Durable times (deadlines compared, owed and index scores, updated times) come from Redis's clock,
-- the one clock every worker shares; a worker's own clock may be off by any amount. ARGV[1] =
-- 'event': the script's first event is written before it needs the time, and the time is that
-- event's stream id (Redis's clock in ms, as TIME would give, one command fewer); the event itself
-- then carries no `at` field, its readers take it from its id (store/codec.py `event_from_entry`).
local NOW_MS, NOW
if ARGV[1] == 'event' then
  NOW_MS = nil
elseif ARGV[1] ~= '' then
  NOW_MS = math.floor(tonumber(ARGV[1]) * 1000)
else
  local t = redis.call('TIME')
  NOW_MS = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
if NOW_MS then NOW = string.format('%.3f', NOW_MS / 1000) end
local MAXLEN = ARGV[2]
local SID = ARGV[3]

-- The session's version, read once per script (scripts that bump it call set_version).
local VERSION = nil
local function version()
  if VERSION == nil then VERSION = redis.call('HGET', K.meta, 'version') or '0' end
  return VERSION
end
local function set_version(v)
  VERSION = tostring(v)
end

local function emit(kind, data)
  if NOW then
    return redis.call('XADD', K.events, 'MAXLEN', '~', MAXLEN, '*',
      'type', kind, 'at', NOW, 'version', version(), 'data', data or '{}')
  end
  local id = redis.call('XADD', K.events, 'MAXLEN', '~', MAXLEN, '*',
    'type', kind, 'version', version(), 'data', data or '{}')
  NOW_MS = tonumber(string.match(id, '^(%d+)'))
  NOW = string.format('%.3f', NOW_MS / 1000)
  return id
end

-- Mark the session updated now, in the index of its state (`st` when the caller knows it), and
-- set the header fields `extra` ({name, value, ...}) in the same write.
local function touch(st, extra)
  local fields = {'updated_at', NOW}
  if st then
    fields[3], fields[4] = 'state', st
  end
  for _, v in ipairs(extra or {}) do fields[#fields + 1] = v end
  redis.call('HSET', K.meta, unpack(fields))
  if not st then st = redis.call('HGET', K.meta, 'state') end
  redis.call('ZADD', K.sessions, NOW_MS, SID)
  if st and STATE_KEYS[st] then redis.call('ZADD', STATE_KEYS[st], NOW_MS, SID) end
end

local function set_state(new)
  local old = redis.call('HGET', K.meta, 'state')
  if old and old ~= new and STATE_KEYS[old] then redis.call('ZREM', STATE_KEYS[old], SID) end
  touch(new)
end

-- The states in which an active session is owed a step (model/session.py STEP_OWING_STATES; a
-- test holds them equal).
local OWES_STEP = {ready = true, tools = true}

-- A step is owed at the current version; no worker has picked this one up yet (`picked` is the
-- version of the last step picked up, which may be this very version when that step only waited).
local function owe()
  redis.call('ZADD', K.owed, NOW_MS, SID)
  redis.call('HSET', K.meta, 'owed_version', version())
  redis.call('HDEL', K.meta, 'picked')
end

local function unowe()
  redis.call('ZREM', K.owed, SID)
  redis.call('HDEL', K.meta, 'owed_version')
end

-- The state a session has when nothing runs, from its head.
local function state_from_head()
  local head = redis.call('HGET', K.meta, 'head')
  if head == 'LlmTurn' then return 'tools' end
  if head == 'PartialUserTurn' and redis.call('SCARD', K.pending) > 0 then return 'waiting' end
  return 'ready'
end

-- Make a failed session active again (resume, step), in the state its head gives. One stopped by
-- its step limit gets `grant` more steps counted from the steps it has taken, so that it can always
-- take them. Returns the state. (A session failed before `error_code` was stored has its code only
-- in `error`.)
local function reactivate(grant)
  local m = redis.call('HMGET', K.meta, 'error_code', 'steps', 'error')
  local code = m[1]
  if not code and string.find(m[3] or '', '"code":"max_steps"', 1, true) then code = 'max_steps' end
  if code == 'max_steps' then
    redis.call('HSET', K.meta, 'step_limit', tonumber(m[2] or '0') + tonumber(grant))
  end
  redis.call('HSET', K.meta, 'status', 'active', 'error', '', 'error_code', '')
  local st = state_from_head()
  set_state(st)
  return st
end

-- Take a call out of the shared indexes of unfinished calls (it is final, or its session goes).
local function unindex_call(field)
  local member = SID .. ' ' .. field
  redis.call('ZREM', K.pending_all, member)
  redis.call('ZREM', K.deadlines, member)
  redis.call('ZREM', K.dispatched, member)
end

-- Record the final outcome of an unfinished call; the first writer wins.
-- Returns nil if the call was not unfinished, else {remaining, woken, version}.
local function finish_call(field, outcome, event_kind, event_data)
  if redis.call('SREM', K.pending, field) == 0 then return nil end
  redis.call('HSET', K.results, field, outcome)
  unindex_call(field)
  emit(event_kind, event_data)
  local remaining = redis.call('SCARD', K.pending)
  local woken = 0
  local m = redis.call('HMGET', K.meta, 'status', 'head', 'drive', 'version')
  if remaining == 0 and m[1] == 'active' and m[2] == 'PartialUserTurn' then
    set_state('ready')
    if m[3] == 'auto' then
      owe()
      woken = 1
    end
  else
    touch()
  end
  return {remaining, woken, tonumber(m[4])}
end

-- The session header as read by HGETALL (`flat`) and as a table by field.
local function read_meta()
  local flat = redis.call('HGETALL', K.meta)
  local meta = {}
  for i = 1, #flat, 2 do meta[flat[i]] = flat[i + 1] end
  return flat, meta
end

-- Whether the journal of the step in flight may hold something, from the session's head and its
-- count of queued messages (`inbox_waiting`): inline tool results (the step at head `LlmTurn`
-- runs the tools), how many queued messages the step took (only while some are queued), or
-- whatever an older release journaled (its model answers) into a session whose header has no
-- count. A model step of a session with nothing queued journals nothing: its answer travels in its
-- commit. begin_step reads the journal, and commit_step deletes it, only then.
local function journal_may_hold(head, queued)
  return head == 'LlmTurn' or tonumber(queued) ~= 0
end

-- What a step reads: {meta (flat), turns from index `from`, newest batch's calls and outcomes
-- (at head `PartialUserTurn`), lease holder, journal (flat), queued user messages}. A caller that
-- has just read the header (`read_meta`) and the lease passes them, so that they are not read again.
-- The queued messages are read only when the header counts some (`inbox_waiting`, kept by every
-- script that changes the inbox), or has no count (a session an older release last wrote); the
-- journal only when it may hold something (`journal_may_hold`); the turns only when the caller
-- lacks some (`turn_count` is the list's length: every commit writes both).
local function load_payload(from, flat, meta, lease)
  if not flat then flat, meta = read_meta() end
  local turns = {}
  if not (meta.turn_count and from >= tonumber(meta.turn_count)) then
    turns = redis.call('LRANGE', K.turns, from, -1)
  end
  local calls, results = {}, {}
  -- The newest batch's calls only at head `PartialUserTurn`: the step that folds their outcomes
  -- into a `UserTurn` is the only one that reads them (scheduler/machine.py `advance`).
  if meta.head == 'PartialUserTurn' and meta.batch and meta.batch_size and tonumber(meta.batch_size) > 0 then
    -- In slices: Lua's unpack takes a few thousand values at most, and a model may ask for more
    -- calls than that in one response.
    local size = tonumber(meta.batch_size)
    for first = 0, size - 1, 1000 do
      local fields = {}
      for p = first, math.min(first + 999, size - 1) do fields[#fields + 1] = meta.batch .. ':' .. p end
      for _, v in ipairs(redis.call('HMGET', K.calls, unpack(fields))) do calls[#calls + 1] = v end
      for _, v in ipairs(redis.call('HMGET', K.results, unpack(fields))) do results[#results + 1] = v end
    end
  end
  if lease == nil then lease = redis.call('GET', K.lease) or '' end
  local queued = tonumber(meta.inbox_waiting)
  local journal, inbox = {}, {}
  if journal_may_hold(meta.head, queued) then journal = redis.call('HGETALL', K.journal) end
  if queued ~= 0 then inbox = redis.call('LRANGE', K.inbox, 0, -1) end
  return {flat, turns, calls, results, lease, journal, inbox}
end

-- Run a writing script once per request id: a call retried after its reply was lost (the client
-- retries on connection errors) gets the first call's reply back instead of running again, so
-- the outcome a caller reports is the true one. Kept long enough for any retry to arrive.
-- A refusal changed nothing (or only added an event), so running it again answers the same: it is
-- not kept, and a refused command leaves no key behind. So are the sweeper's verdicts other than
-- `republish` (sweep_*.lua): it looks at up to hundreds of entries a second while a queue is busy.
local REQUEST_TTL_S = 600
local REFUSALS = {
  missing = true, unknown = true, exists = true, stale = true, ended = true, lost_lease = true,
  already = true, early = true, completed = true, expired = true, cancelled = true,
  active = true, changed = true, busy = true, full = true,
  settled = true, running = true, waiting = true,
}
local function once(body)
  local seen = redis.call('GET', K.request)
  if seen then return cjson.decode(seen) end
  local reply = body()
  if not REFUSALS[reply[1]] then
    redis.call('SET', K.request, cjson.encode(reply), 'EX', REQUEST_TTL_S)
  end
  return reply
end
