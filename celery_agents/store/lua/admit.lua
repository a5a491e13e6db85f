-- Admit one model call under the fleet's limits, or say when it may start.
-- KEYS[1] = limits (hash: KEY -> JSON {rpm, tpm, concurrency}), KEYS[2] = paused (hash: model ->
-- until ms), KEYS[3] = this step's booking (string); then three keys per limit KEY, in the order
-- of ARGV[7..]: its state (hash), its slots in flight and its waiters (sorted sets).
-- ARGV[1] = the model (its pause), ARGV[2] = the call's estimated tokens, ARGV[3] = the call's slot
-- id, ARGV[4] = how long a slot lasts unrenewed (ms), ARGV[5] = the step as a waiter
-- ("<session> <version> <priority>"), ARGV[6] = its priority (0-9: waiters are woken highest
-- priority first, then oldest first), ARGV[7] = the burst tolerance B (ms, AGENTS_LIMITS_BURST),
-- ARGV[8] = '1' when the step was put back before (only then may it hold a booking),
-- ARGV[9..] = the limit KEYs that apply to the call.
-- Returns {'ok', now, release} (admitted: counted, a slot taken under each concurrency limit, the
-- booking used up; `release` 1 when release.lua has something to do after the call: a slot to
-- give back, tokens to correct) or {'wait', until, reason, key, now}, times in ms of Redis's
-- clock: reason 'paused' (a
-- provider's 429 with Retry-After: come back at `until`), 'rate' (booked: the call starts at
-- `until`, its place kept for it), 'concurrency' (queued as a waiter: a released slot wakes it;
-- `until` is when to look again if nothing does: the nearest slot's lapse).
--
-- Rates follow the generic cell rate algorithm (GCRA). A KEY keeps one theoretical arrival time
-- (TAT) per rate (requests, tokens). A call of cost c (1 request; its tokens), at a rate of one
-- unit per T ms, conforms at time t when max(TAT, t) + c*T - t <= max(B, c*T), B the burst
-- tolerance (1000 ms unless AGENTS_LIMITS_BURST says otherwise: a second's worth). Calls are spaced
-- evenly and never more than a second's worth start at once, which is what providers that enforce
-- a per-minute limit over shorter spans take; a call costing more than B's worth (many tokens)
-- starts when the bucket is empty.
-- One number per rate, read and written in O(1), where a sliding window would keep an entry per
-- call of the last minute and still let a whole minute's calls start in one burst.
-- A call that does not conform now books the earliest time it does (t* = TAT + c*T - max(B, c*T)):
-- its cost is added from then (TAT = max(TAT, t*) + c*T), its booking kept under KEYS[3], and it
-- is told to come back at t*: waiting calls each get a start time of their own instead of all
-- retrying at once. Only the rates that bind the start are booked: booking another from a later
-- start would hold back calls that could run before it; they are checked again on the way back.
local BURST_MS = tonumber(ARGV[7])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local function ms(x) return string.format('%.3f', x) end
local nkeys = #ARGV - 8
local names = {}
for i = 1, nkeys do names[i] = ARGV[8 + i] end
local cost = tonumber(ARGV[2])

local paused = redis.call('HGET', KEYS[2], ARGV[1])
if paused then
  if tonumber(paused) > now then
    -- A start booked before the pause is given up: kept, every call booked within the pause would
    -- start together at its end. The call books again then, after the pause (release.lua moved the
    -- rates of the call that met the 429 past it).
    redis.call('DEL', KEYS[3])
    return {'wait', paused, 'paused', ARGV[1], ms(now)}
  end
  redis.call('HDEL', KEYS[2], ARGV[1])
end
if nkeys == 0 then return {'ok', ms(now), 0} end

-- The booking of an earlier attempt of this very call: its rates are counted already.
local booking = ARGV[8] == '1' and redis.call('GET', KEYS[3])
local booked = {}
if booking then
  booking = cjson.decode(booking)
  -- A message due at `at` may be handed over a little early (timers, clocks): 2 ms is let pass.
  if booking.at - 2 > now then return {'wait', ms(booking.at), 'rate', booking.key, ms(now)} end
  for _, name in ipairs(booking.rates) do booked[name] = true end
end

local function earliest(tat, units, per)
  local need = units * per
  return tat + need - math.max(BURST_MS, need)
end

local configs = redis.call('HMGET', KEYS[1], unpack(names))
local limits, states, rates = {}, {}, {}
local start, binding = now, nil
local full = {}
for i = 1, nkeys do
  if configs[i] then
    local c = cjson.decode(configs[i])
    local base = 3 + (i - 1) * 3
    local s = redis.call('HMGET', KEYS[base + 1], 'req_tat', 'tok_tat', 'minute', 'req', 'tok', 'corr')
    limits[i] = c
    states[i] = {tonumber(s[1]) or 0, tonumber(s[2]) or 0, tonumber(s[3]) or -1, tonumber(s[4]) or 0,
      tonumber(s[5]) or 0, tonumber(s[6]) or 0}
    -- {rate name, index into the state, units, ms per unit}
    if c.rpm then rates[#rates + 1] = {names[i] .. '\31req', i, 1, 1, 60000 / c.rpm} end
    if c.tpm then rates[#rates + 1] = {names[i] .. '\31tok', i, 2, cost, 60000 / c.tpm} end
    if c.concurrency then
      redis.call('ZREMRANGEBYSCORE', KEYS[base + 2], '-inf', now)
      if redis.call('ZCARD', KEYS[base + 2]) >= c.concurrency then full[#full + 1] = i end
    end
  end
end

-- A booked call starts later by what the calls before it used above their estimates since it was
-- booked (release.lua adds that to the KEY's `corr`, in ms of its token rate): its cost was
-- counted at its estimate's place, and their usage, reported after, went onto the rate's end.
-- Without this, calls booked at the estimates' pace would all start on time however much more the
-- first ones used. Its place is kept (nothing is counted again); told to come back then.
if booking and booking.corr then
  local shift = 0
  for i = 1, nkeys do
    local seen = booking.corr[names[i]]
    if limits[i] and limits[i].tpm and seen then shift = math.max(shift, states[i][6] - seen) end
  end
  if shift >= 1 then
    for i = 1, nkeys do
      if limits[i] and limits[i].tpm then booking.corr[names[i]] = states[i][6] end
    end
    booking.at = now + shift
    redis.call('SET', KEYS[3], cjson.encode(booking), 'PX', math.ceil(shift) + 600000)
    return {'wait', ms(booking.at), 'rate', booking.key, ms(now)}
  end
end

-- No slot free under a concurrency limit: wait for one (a rate booked now would go to waste).
if #full > 0 then
  local soonest = nil
  for _, i in ipairs(full) do
    local base = 3 + (i - 1) * 3
    local order = string.format('%.0f', (9 - tonumber(ARGV[6])) * 1e13 + math.floor(now))
    redis.call('ZADD', KEYS[base + 3], 'NX', order, ARGV[5])
    local first = redis.call('ZRANGE', KEYS[base + 2], 0, 0, 'WITHSCORES')
    local lapse = tonumber(first[2] or now + tonumber(ARGV[4]))
    if soonest == nil or lapse < soonest then soonest = lapse end
  end
  return {'wait', ms(soonest), 'concurrency', names[full[1]], ms(now)}
end

for _, r in ipairs(rates) do
  if not booked[r[1]] then
    r[6] = earliest(states[r[2]][r[3]], r[4], r[5])
    if r[6] > start then start, binding = r[6], r end
  end
end

if binding then
  local list = booking and booking.rates or {}
  for _, r in ipairs(rates) do
    -- The rates that bind the start (within a microsecond): their cost counts from then.
    if not booked[r[1]] and r[6] >= start - 0.001 then
      local s = states[r[2]]
      s[r[3]] = math.max(s[r[3]], start) + r[4] * r[5]
      redis.call('HSET', KEYS[3 + (r[2] - 1) * 3 + 1], r[3] == 1 and 'req_tat' or 'tok_tat', ms(s[r[3]]))
      list[#list + 1] = r[1]
    end
  end
  local key = names[binding[2]]
  -- What the calls before it have used above their estimates so far, per KEY (see above).
  local corr = (booking and booking.corr) or {}
  for i = 1, nkeys do
    if limits[i] and limits[i].tpm then corr[names[i]] = states[i][6] end
  end
  -- Kept ten minutes past its time: a step that never comes back (cancelled) leaves nothing.
  redis.call('SET', KEYS[3], cjson.encode({at = start, key = key, rates = list, corr = corr}), 'PX',
    math.ceil(start - now) + 600000)
  return {'wait', ms(start), 'rate', key, ms(now)}
end

-- Admitted: each rate not booked before counts the call from now; the minute's counts; the slots.
local minute = math.floor(now / 60000)
local release = 0
for i = 1, nkeys do
  local c = limits[i]
  if c then
    if c.tpm or c.concurrency then release = 1 end
    local base = 3 + (i - 1) * 3
    local s = states[i]
    local fields = {}
    if c.rpm and not booked[names[i] .. '\31req'] then
      fields[#fields + 1], fields[#fields + 2] = 'req_tat', ms(math.max(s[1], now) + 60000 / c.rpm)
    end
    if c.tpm and not booked[names[i] .. '\31tok'] then
      fields[#fields + 1], fields[#fields + 2] = 'tok_tat', ms(math.max(s[2], now) + cost * 60000 / c.tpm)
    end
    if s[3] ~= minute then
      local prev_req, prev_tok = 0, 0
      if s[3] == minute - 1 then prev_req, prev_tok = s[4], s[5] end
      for _, v in ipairs({'minute', minute, 'req_prev', prev_req, 'tok_prev', prev_tok}) do fields[#fields + 1] = v end
      s[4], s[5] = 0, 0
    end
    for _, v in ipairs({'req', s[4] + 1, 'tok', s[5] + cost}) do fields[#fields + 1] = v end
    redis.call('HSET', KEYS[base + 1], unpack(fields))
    if c.concurrency then
      redis.call('ZADD', KEYS[base + 2], ms(now + tonumber(ARGV[4])), ARGV[3])
      redis.call('ZREM', KEYS[base + 3], ARGV[5])
    end
  end
end
if booking then redis.call('DEL', KEYS[3]) end
return {'ok', ms(now), release}
