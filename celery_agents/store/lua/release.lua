-- A model call admitted by admit.lua has ended (answered, failed, or refused by its provider):
-- give its slots back, correct its token estimate by its usage, and wake one waiter per slot freed.
-- KEYS[1] = limits, KEYS[2] = paused (as admit.lua); then three keys per limit KEY, in the order of
-- ARGV[5..]: its state, its slots in flight, its waiters.
-- ARGV[1] = the call's slot id, ARGV[2] = tokens to add to what admit.lua counted (the usage
-- minus the estimate; negative gives some back), ARGV[3] = a model to pause for the whole fleet
-- ('' none: a provider's 429 with Retry-After), ARGV[4] = for how long (ms), ARGV[5..] = the KEYs.
-- Returns {until (ms; '' when nothing was paused), now (ms), waiter, ...}: the steps woken, each
-- "<session> <version> <priority>", for the caller to publish.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local function ms(x) return string.format('%.3f', x) end
local reply = {'', ms(now)}
if ARGV[3] ~= '' then
  local until_ms = now + tonumber(ARGV[4])
  local old = tonumber(redis.call('HGET', KEYS[2], ARGV[3]) or '0')
  if old > until_ms then until_ms = old end
  redis.call('HSET', KEYS[2], ARGV[3], ms(until_ms))
  reply[1] = ms(until_ms)
end
local nkeys = #ARGV - 4
if nkeys == 0 then return reply end
local pause_until = nil
if reply[1] ~= '' then pause_until = tonumber(reply[1]) end
local names = {}
for i = 1, nkeys do names[i] = ARGV[4 + i] end
local configs = redis.call('HMGET', KEYS[1], unpack(names))
local delta = tonumber(ARGV[2])
local minute = math.floor(now / 60000)
for i = 1, nkeys do
  if configs[i] then
    local c = cjson.decode(configs[i])
    local base = 2 + (i - 1) * 3
    if delta ~= 0 then
      local s = redis.call('HMGET', KEYS[base + 1], 'tok_tat', 'minute', 'tok', 'corr')
      local fields = {}
      -- A TAT moved below now counts as now: a call's refund cannot lend the next ones time.
      if c.tpm and s[1] then
        fields = {'tok_tat', ms(math.max(tonumber(s[1]) + delta * 60000 / c.tpm, now))}
        -- Used above its estimate: the calls booked before this came in start that much later
        -- (admit.lua); a refund moves no booked start.
        if delta > 0 then
          fields[3], fields[4] = 'corr', ms((tonumber(s[4]) or 0) + delta * 60000 / c.tpm)
        end
      end
      if tonumber(s[2]) == minute then
        fields[#fields + 1], fields[#fields + 2] = 'tok', tonumber(s[3] or '0') + delta
      end
      if #fields > 0 then redis.call('HSET', KEYS[base + 1], unpack(fields)) end
    end
    if pause_until then
      -- Nothing starts under this KEY's rates before the pause ends: later calls book after it.
      local s = redis.call('HMGET', KEYS[base + 1], 'req_tat', 'tok_tat')
      for j, name in ipairs({'req_tat', 'tok_tat'}) do
        if (j == 1 and c.rpm or j == 2 and c.tpm) and tonumber(s[j] or '0') < pause_until then
          redis.call('HSET', KEYS[base + 1], name, ms(pause_until))
        end
      end
    end
    if c.concurrency and redis.call('ZREM', KEYS[base + 2], ARGV[1]) == 1 then
      local woken = redis.call('ZPOPMIN', KEYS[base + 3])
      if woken[1] then reply[#reply + 1] = woken[1] end
    end
  end
end
return reply
