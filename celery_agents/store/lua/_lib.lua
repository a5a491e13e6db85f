-- Shared by every session script (prepended when scripts are loaded, after the key table).
-- KEYS: the keys this script touches, named in `K` (and `STATE_KEYS`, the index of each stored
-- state) in the order of store/keys.py; extra keys after them, from KEYS[NKEYS + 1]. store/scripts.py
-- writes `K`, `STATE_KEYS` and `NKEYS` for each script from the keys its source (and the functions
-- of this file it calls) names, and the store passes exactly those.
-- ARGV[1] = now in seconds (empty: Redis's clock; given by the sweeper, which read Redis's
-- clock once for all it does, and by tests), ARGV[2] = events cap,
-- ARGV[3] = session id; the rest per script.
-- Durable times (deadlines compared, owed and index scores, updated times) come from Redis's clock,
-- the one clock every worker shares; a worker's own clock may be off by any amount. ARGV[1] =
-- 'event': the script's first event is written before it needs the time, and the time is that
-- event's stream id (Redis's clock in ms, as TIME would give, one command fewer).
-- An event carries no `at` field: its readers take its time from its id (store/codec.py
-- `event_from_entry`), which is Redis's clock when it was written, a time given by the caller
-- included (it serves the script's comparisons and stored times). So every entry of a stream has
-- the same fields (`type`, `version`, `data`, as the live output's deltas have), those of its
-- first: Redis then stores them once per stream node, not once per entry, and a waiting
-- session's events can be packed (`pack_events` packs only such entries).
local NOW_MS, NOW
local GIVEN_NOW = ARGV[1] ~= 'event' and ARGV[1] ~= ''
if ARGV[1] == 'event' then
  NOW_MS = nil
elseif GIVEN_NOW then
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

-- A waiting session's events are packed (`pack_events`): one string (`K.packed`) instead of a
-- stream, which costs ~600 bytes of Redis memory before its first entry. Its lines: the format and
-- the stream's last id (`1 <id>`), then four per entry: its id as `<ms>-<seq>` with `<ms>` less
-- the previous entry's (the first's whole), type, version, data (no value holds a newline: each is
-- a word, a number or JSON text), each of `PACK_WORDS` in that text written as one control
-- character (1 to 31 but the newline; JSON text holds none): the usual events take a third of
-- their text (store/codec.py `packed_entries` reads it; tests hold the two lists equal). The next
-- event puts them back into the stream, under their ids, before it is added: XADD with NOMKSTREAM
-- finds no stream (one command more then, and when a session's first event makes its stream), so
-- a stream that is there costs nothing more.
local PACKED_MAX = 128
-- and at most so many bytes of text, so that packing and putting back stay well under a
-- millisecond of Redis's time (~60 us of words for the paused booking's 650 bytes); a session
-- with more text keeps its stream, whose cost is then a small part of what it holds
local PACKED_MAX_BYTES = 4096
-- longest first: a word inside a longer one is replaced after it
local PACK_WORDS = {
  ',"usage":{"prompt_tokens":', '{"request":"","owner":"', ',"completion_tokens":', '","disposition":"',
  '{"from_version":', 'session_started\n', 'token_completed\n', 'tool_dispatched\n',
  '","duration_ms":', ',"total_tokens":', 'step_committed\n', '","tool_calls":',
  'PartialUserTurn', 'token_created\n', 'tool_finished\n', '","request":"',
  'step_started\n', '{"call_id":"', '","reason":"', '","state":"',
  '","agent":"', 'llm_called\n', '{"model":"', '{"drive":"',
  '","kind":"', '","tool":"', ',"head":"', ',"cost":',
  'UserTurn', 'LlmTurn',
}
local function pack_code(i)
  return string.char(i < 10 and i or i + 1)
end
-- Each word of `text` as its code: split at it and joined again (a plain search, no pattern; a
-- gsub per word took three times as long).
local function pack_words(text)
  for i, word in ipairs(PACK_WORDS) do
    local at = string.find(text, word, 1, true)
    if at then
      local parts, from = {}, 1
      while at do
        parts[#parts + 1] = string.sub(text, from, at - 1)
        from = at + #word
        at = string.find(text, word, from, true)
      end
      parts[#parts + 1] = string.sub(text, from)
      text = table.concat(parts, pack_code(i))
    end
  end
  return text
end
-- Each code back as its word, in one pass (a pattern of every code, a table of their words).
local function unpack_words(packed)
  local words, class = {}, {}
  for i, word in ipairs(PACK_WORDS) do
    words[pack_code(i)] = word
    class[i] = pack_code(i)
  end
  return (string.gsub(packed, '[' .. table.concat(class) .. ']', words))
end
local function unpack_events()
  local packed = redis.call('GET', K.packed)
  if not packed then return end
  -- longer than packing writes: not its value (another client's), left out as unreadable
  if #packed > PACKED_MAX_BYTES + 64 * PACKED_MAX then packed = '' end
  packed = unpack_words(packed)
  local lines, n = {}, 0
  for line in string.gmatch(packed, '([^\n]*)\n') do
    n = n + 1
    lines[n] = line
  end
  -- What does not read as it was written (a value some other Redis client wrote) is left out:
  -- the session's next event is written whatever became of its earlier ones.
  local ms = 0
  for i = 2, n - 3, 4 do
    local step, seq = string.match(lines[i], '^(%d+)-(%d+)$')
    if not step then break end
    ms = ms + tonumber(step)
    redis.pcall('XADD', K.events, string.format('%d-%s', ms, seq), 'type', lines[i + 1], 'version', lines[i + 2],
      'data', lines[i + 3])
  end
  local last = string.match(lines[1] or '', '^1 (%d+-%d+)$')
  if last then redis.pcall('XSETID', K.events, last) end
  redis.call('DEL', K.packed)
end
-- Pack the events of a session left waiting (a short stream of little text, every entry `type`,
-- `version`, `data` with no control character in them: else it stays a stream).
local function pack_events()
  local n = redis.call('XLEN', K.events)
  if n == 0 or n > PACKED_MAX then return end
  local entries = redis.call('XRANGE', K.events, '-', '+')
  local out, before, bytes = {}, 0, 0
  for _, e in ipairs(entries) do
    local f = e[2]
    if #f ~= 6 or f[1] ~= 'type' or f[3] ~= 'version' or f[5] ~= 'data' then return end
    bytes = bytes + #f[2] + #f[4] + #f[6]
    if bytes > PACKED_MAX_BYTES then return end
    for j = 2, 6, 2 do
      if string.find(f[j], '%c') then return end
    end
    local ms, seq = string.match(e[1], '^(%d+)-(%d+)$')
    ms = tonumber(ms)
    out[#out + 1] = string.format('%d-%s\n', ms - before, seq) .. f[2] .. '\n' .. f[4] .. '\n' .. f[6] .. '\n'
    before = ms
  end
  local info = redis.call('XINFO', 'STREAM', K.events)
  local last
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then last = info[i + 1] end
  end
  redis.call('SET', K.packed, pack_words('1 ' .. last .. '\n' .. table.concat(out)))
  redis.call('DEL', K.events)
end

local function xadd_event(...)
  local id = redis.call('XADD', K.events, 'NOMKSTREAM', 'MAXLEN', '~', MAXLEN, '*', ...)
  if id then return id end
  unpack_events()
  return redis.call('XADD', K.events, 'MAXLEN', '~', MAXLEN, '*', ...)
end

local function emit(kind, data)
  local id = xadd_event('type', kind, 'version', version(), 'data', data or '{}')
  if not NOW_MS then
    NOW_MS = tonumber(string.match(id, '^(%d+)'))
    NOW = string.format('%.3f', NOW_MS / 1000)
  end
  return id
end

-- What the session is at the version just made (`keys.versions`, store/history.py `VersionEntry`):
-- its turn count, head and state, the kind of write that made it (field `<v>`), and a one-line
-- summary of what it did, built by the caller (field `<v>s`); fields per version, so a write's
-- commands do not grow with them. Each value stays within 64 bytes (`hash-max-listpack-value`),
-- so the hash stays a listpack: the summary is cut there (at a whole UTF-8 character).
local function record_version(v, turns, head, st, kind, summary)
  local line = summary or ''
  if #line > 64 then
    line = string.sub(line, 1, 61)
    while #line > 0 and string.byte(line, #line) >= 128 and string.byte(line, #line) < 192 do
      line = string.sub(line, 1, #line - 1)
    end
    if #line > 0 and string.byte(line, #line) >= 192 then line = string.sub(line, 1, #line - 1) end
    line = line .. '\226\128\166'
  end
  redis.call('HSET', K.versions, v, cjson.encode({tonumber(turns), head or '', st, kind, tonumber(NOW)}),
    v .. 's', line)
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
  if head == 'PartialUserTurn' and redis.call('HLEN', K.pending) > 0 then return 'waiting' end
  return 'ready'
end

-- Make a failed session active again (resume, step), in the state its head gives. One stopped by
-- its step limit gets `grant` more steps counted from the steps it has taken, so that it can always
-- take them. Returns the state.
local function reactivate(grant)
  local m = redis.call('HMGET', K.meta, 'error_code', 'steps')
  if m[1] == 'max_steps' then
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
-- Returns nil if the call was not unfinished, else {remaining, woken, version, priority} (the
-- session's priority: a wake is published with it).
local function finish_call(field, outcome, event_kind, event_data)
  if redis.call('HDEL', K.pending, field) == 0 then return nil end
  redis.call('HSET', K.results, field, outcome)
  unindex_call(field)
  emit(event_kind, event_data)
  local remaining = redis.call('HLEN', K.pending)
  local woken = 0
  local m = redis.call('HMGET', K.meta, 'status', 'head', 'drive', 'version', 'priority')
  if remaining == 0 and m[1] == 'active' and m[2] == 'PartialUserTurn' then
    set_state('ready')
    if m[3] == 'auto' then
      owe()
      woken = 1
    end
  else
    touch()
  end
  return {remaining, woken, tonumber(m[4]), tonumber(m[5] or '5')}
end

-- When a deferred call whose deadline is `expires_ms` gets its `call_expiring` event: once a tenth
-- of its wait from now remains, but at most an hour before the deadline.
local function warn_at(expires_ms)
  local wait = tonumber(expires_ms) - NOW_MS
  return tonumber(expires_ms) - math.min(math.floor(wait / 10), 3600000)
end

-- A deferred call's token (its hash, at `key`) from its record (store/commit.py `token_record`:
-- field, deadline ms, call id, tool, digest, reason, child, gate); the sub-agent child and the
-- gate only when the call has them (absent reads as none). What the key and the call say (the
-- session, when it was made) is not written again.
local function create_token(key, t)
  local fields = {'field', t[1], 'state', 'pending', 'expires_ms', t[2], 'call_id', t[3], 'tool', t[4],
    'digest', t[5], 'reason', t[6]}
  if (t[7] or '') ~= '' then fields[#fields + 1] = 'child'; fields[#fields + 1] = t[7] end
  if (t[8] or '') ~= '' then fields[#fields + 1] = 'gate'; fields[#fields + 1] = t[8] end
  redis.call('HSET', key, unpack(fields))
end

-- The fleet's counters (store/counters.py): one hash, a field per series and label values
-- (`<series>\31<label>...`), added to by the script that records the work counted, in its write.
local function count(...)
  redis.call('HINCRBY', K.counters, table.concat({...}, '\31'), 1)
end

-- `n` of a series and label values, as `add_counts` takes it with others.
local function count_of(n, ...)
  return {table.concat({...}, '\31'), n}
end

-- A pair of the `tally` list that counts: a field and a whole number (store/counters.py
-- `_tally_entry` keeps the same ones).
local function whole_pair(c)
  return type(c) == 'table' and type(c[1]) == 'string' and type(c[2]) == 'number' and c[2] == math.floor(c[2])
end
-- Add the `tally` list's entries to the counters hash, then empty it (store/counters.py reads
-- both). Nothing here can stop the script: an entry that is not a JSON array, or a pair that is not
-- a field and a whole number, counts nothing (no script writes one); a field the hash holds as
-- something other than a whole number keeps it, with a line in Redis's log.
local function fold_tally()
  local sums, order = {}, {}
  for _, entry in ipairs(redis.call('LRANGE', K.tally, 0, -1)) do
    local ok, pairs_ = pcall(cjson.decode, entry)
    if ok and type(pairs_) == 'table' then
      for _, c in ipairs(pairs_) do
        if whole_pair(c) then
          if not sums[c[1]] then order[#order + 1] = c[1]; sums[c[1]] = 0 end
          sums[c[1]] = sums[c[1]] + c[2]
        end
      end
    end
  end
  for _, f in ipairs(order) do
    if sums[f] ~= 0 then
      local added = redis.pcall('HINCRBY', K.counters, f, string.format('%.0f', sums[f]))
      if type(added) == 'table' and added.err then
        redis.log(redis.LOG_WARNING, 'celery-agents: counter ' .. f .. ' not added to: ' .. added.err)
      end
    end
  end
  redis.call('DEL', K.tally)
end
-- The entries `tally` holds before they are folded into the hash.
local TALLY_FOLD = 64
-- What the caller counted while doing the work this script records, {{field, n}, ...} with n
-- whole, and `more` pairs of the same kind, in one command whatever their number: one HINCRBY, or
-- one RPUSH to the `tally` list, folded into the hash by the write that fills it. (The spend in USD,
-- not a whole number, is added to the hash itself: `add_cost`.)
local function add_counts(counts, more)
  local all = {}
  for _, list in ipairs({counts or {}, more or {}}) do
    for _, c in ipairs(list) do
      local n = tonumber(c[2])
      if n and n ~= 0 and n == math.floor(n) then all[#all + 1] = {c[1], n} end
    end
  end
  if #all == 1 then
    redis.call('HINCRBY', K.counters, all[1][1], string.format('%.0f', all[1][2]))
  elseif #all > 0 then
    if redis.call('RPUSH', K.tally, cjson.encode(all)) >= TALLY_FOLD then fold_tally() end
  end
end
-- The fleet's spend in USD (`agents_spend_total{kind="cost"}`), added to the hash at once: a sum
-- of floats folded later could read lower than the sum read before the fold (a counter that goes
-- down), and cjson keeps 14 digits of each.
local function add_cost(cost)
  local n = tonumber(cost) or 0
  if n ~= 0 then redis.call('HINCRBYFLOAT', K.counters, 'spend\31cost', cost) end
end

-- A session's spend: flat fields of its header (model/budget.py SPENT_FIELDS), in the order of
-- store/commit.py `CommitRecord.spend`: {tokens, cost in USD, model calls, tool calls}.
local SPENT = {'spent_tokens', 'spent_cost', 'spent_model_calls', 'spent_tool_calls'}
-- Add `spend` to the header hash `meta` (a session above the one spending, passed in KEYS: a
-- sub-agent's spend counts against every ancestor); a header that is gone is not made again.
local function add_spend(meta, spend)
  if redis.call('EXISTS', meta) == 0 then return end
  for i, f in ipairs(SPENT) do
    local n = tonumber(spend[i]) or 0
    if n ~= 0 then
      if i == 2 then redis.call('HINCRBYFLOAT', meta, f, n) else redis.call('HINCRBY', meta, f, n) end
    end
  end
end

-- A deferred call's wait ended `how` (completed, failed, expired): `agents_tool_calls_total`
-- under `defer`. Its tool is one the agent file names (the step that deferred it checked).
local function count_deferred(token_key, how)
  count('tool_calls', string.sub(redis.call('HGET', token_key, 'tool') or '_other', 1, 64), 'defer', how)
end

-- A step refused by its script, as the step outcome it counts as (runtime/step.py `_STEP_OUTCOMES`).
local STEP_OUTCOMES = {stale = 'stale', busy = 'busy', ended = 'ended', missing = 'missing', lost_lease = 'lost'}

-- Store an agent spec under its content hash (KEYS[NKEYS+1]) for a new session. Signed (`sig` not
-- ''), the spec is written again with its signature (KEYS[NKEYS+3]), so that whatever another writer
-- left under this hash is replaced by the content the signature covers; unsigned, it is kept.
local function store_spec(spec, sig)
  if sig ~= '' then
    redis.call('SET', KEYS[NKEYS + 1], spec)
    redis.call('SET', KEYS[NKEYS + 3], sig)
  else
    redis.call('SET', KEYS[NKEYS + 1], spec, 'NX')
  end
end

-- Variadic writes in slices: Lua's unpack takes a few thousand values at most.
local function in_slices(cmd, key, values)
  for first = 1, #values, 1000 do
    redis.call(cmd, key, unpack(values, first, math.min(first + 999, #values)))
  end
end

-- Append a record's `n_turns` turns (ARGV[base + 1 ..]) and write its calls (`calls` fields, their
-- JSON right after the turns): what a commit and a fork both store.
local function write_turns_and_calls(c, base)
  local turns = {}
  for i = 1, c.n_turns do turns[i] = ARGV[base + i] end
  in_slices('RPUSH', K.turns, turns)
  local call_fields = {}
  for j, field in ipairs(c.calls) do
    call_fields[#call_fields + 1] = field
    call_fields[#call_fields + 1] = ARGV[base + c.n_turns + j]
  end
  in_slices('HSET', K.calls, call_fields)
end

-- The session header as read by HGETALL (`flat`) and as a table by field.
local function read_meta()
  local flat = redis.call('HGETALL', K.meta)
  local meta = {}
  for i = 1, #flat, 2 do meta[flat[i]] = flat[i + 1] end
  return flat, meta
end

-- Whether the journal of the step in flight may hold something, from the session's head and its
-- count of queued messages (`inbox_waiting`, none when absent): inline tool results (the step at
-- head `LlmTurn` runs the tools), or how many queued messages the step took (only while some are
-- queued). A model step of a session with nothing queued journals nothing: its answer travels in
-- its commit. begin_step reads the journal, and commit_step deletes it, only then.
local function journal_may_hold(head, queued)
  return head == 'LlmTurn' or (tonumber(queued) or 0) ~= 0
end

-- What a step reads: {meta (flat), turns from index `from`, newest batch's calls and outcomes
-- (at head `PartialUserTurn`), lease holder, journal (flat), queued user messages}. A caller that
-- has just read the header (`read_meta`) and the lease passes them, so that they are not read again.
-- The queued messages are read only when the header counts some (`inbox_waiting`, kept by every
-- script that changes the inbox); the journal only when it may hold something (`journal_may_hold`); the turns only when the caller
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
  local queued = tonumber(meta.inbox_waiting) or 0
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
  applied = true, not_an_approval = true, digest_mismatch = true,
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
