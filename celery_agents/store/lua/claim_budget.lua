-- Claim a model call or tool calls of a sub-agent's session on the budgets of the sessions above
-- it, or say why not (runtime/budget.py). Steps of sibling sub-agents run at once: each claims
-- what it is about to spend, so that the calls in flight count against the room a limit leaves.
-- KEYS: for each session above with a budget, parent first: its header (hash: `budget`, the
-- spent_* fields), its claims (hash: member -> "expires_ms model_calls tool_calls tokens cost",
-- tokens and cost -1 when the call has no bound; a claim of tool calls spends none).
-- ARGV[1] = this step's member ("<session> <version> <owner>"), ARGV[2] = how long a claim lasts
-- unrenewed (ms), ARGV[3] = model calls (0 or 1), ARGV[4] = tool calls, ARGV[5] = the most tokens
-- the model call may spend (-1: no bound), ARGV[6] = the most it may cost (-1: no bound).
-- The rule, for each limit of each scope, the spend committed counted with the claims of other
-- steps still in flight (a claim lapsed unrenewed is dropped; one of a model call is spent on the
-- scope here, by _claims.lua `spend_claim`; the step that made it, if it was only frozen and
-- commits late, adds no model spend to that scope):
--   * the spend reached the limit: refused (the session fails `budget_exceeded`);
--   * what is asked fits beside the claims in flight (spent + theirs + this <= limit; for tokens
--     and cost every call in flight and this one must have a bound): claimed;
--   * no other call of its kind is in flight (model calls for tokens, cost and model calls; tool
--     calls for tool calls): claimed, as many tool calls as the limit leaves (a token or cost
--     limit may then be crossed by this one call, alone);
--   * else: wait until the calls in flight end (what they spend decides).
-- Returns {'ok', granted, [i, kind, spent, limit]} (claimed under every scope; `granted` calls
-- may start, and when fewer than asked the limit that stopped the rest, scope i),
-- {'wait', now (ms, Redis's clock), i, kind} or {'refuse', i, kind, spent, limit}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local member = ARGV[1]
local step = string.match(member, '^%S+ %S+ ') or member
local want = {modelCalls = tonumber(ARGV[3]), toolCalls = tonumber(ARGV[4]), tokens = -2, costUsd = -2}
if want.modelCalls > 0 then want.tokens, want.costUsd = tonumber(ARGV[5]), tonumber(ARGV[6]) end
local FIELDS = {tokens = 1, costUsd = 2, modelCalls = 3, toolCalls = 4}
local KINDS = {'modelCalls', 'tokens', 'costUsd', 'toolCalls'}
local granted = want.modelCalls > 0 and want.modelCalls or want.toolCalls
local wait, short = nil, nil
for i = 1, #KEYS / 2 do
  local meta, claims = KEYS[2 * i - 1], KEYS[2 * i]
  local m = redis.call('HMGET', meta, 'budget', 'spent_tokens', 'spent_cost', 'spent_model_calls', 'spent_tool_calls')
  if m[1] then
    local budget = cjson.decode(m[1])
    -- The others' claims in flight: {tokens, cost, model calls, tool calls}; a bound of -1 spoils the sum.
    local others, models, tools = {0, 0, 0, 0}, 0, 0
    local charged = false
    local all = redis.call('HGETALL', claims)
    for j = 1, #all, 2 do
      if all[j] ~= member then
        local e, mc, tc, tok, cost = string.match(all[j + 1], '^(%S+) (%S+) (%S+) (%S+) (%S+)$')
        -- An earlier attempt of this very step (same session and version, another worker): this
        -- one holds the step's lease now, so that one died or was frozen past it: lapsed.
        if tonumber(e) < now or string.sub(all[j], 1, #step) == step then
          redis.call('HDEL', claims, all[j])
          -- Its step died after claiming a model call: the call was made, or may have been, and
          -- its answer is lost (the step is redone). It is spent (_claims.lua `spend_claim`).
          if tonumber(mc) > 0 then
            spend_claim(meta, budget, tonumber(mc), tonumber(tok), tonumber(cost))
            charged = true
          end
        else
          models, tools = models + tonumber(mc), tools + tonumber(tc)
          for k, v in ipairs({tonumber(tok), tonumber(cost), tonumber(mc), tonumber(tc)}) do
            if others[k] >= 0 then others[k] = (v < 0) and -1 or others[k] + v end
          end
        end
      end
    end
    if charged then
      m = redis.call('HMGET', meta, 'budget', 'spent_tokens', 'spent_cost', 'spent_model_calls', 'spent_tool_calls')
    end
    for _, kind in ipairs(KINDS) do
      local limit = budget[kind]
      local w = want[kind]
      if limit ~= nil and limit ~= cjson.null and w ~= -2 and (w ~= 0 or kind == 'tokens' or kind == 'costUsd') then
        local f = FIELDS[kind]
        local spent = tonumber(m[f + 1] or '0') or 0
        if spent >= limit then
          return {'refuse', i, kind, tostring(spent), tostring(limit)}
        end
        local theirs = others[f]
        local fits = w >= 0 and theirs >= 0 and spent + theirs + w <= limit
        if not fits then
          if (kind == 'toolCalls' and tools or models) > 0 then
            wait = wait or {'wait', i, kind}
          elseif kind == 'toolCalls' then
            local room = math.floor(limit - spent)
            if room < granted then granted, short = room, {i, kind, tostring(spent + room), tostring(limit)} end
          end
        end
      end
    end
  end
end
if wait then return {'wait', string.format('%.0f', now), wait[2], wait[3]} end
local record = string.format('%.0f %d %d %s %s', now + tonumber(ARGV[2]), want.modelCalls, granted, ARGV[5], ARGV[6])
for i = 1, #KEYS / 2 do redis.call('HSET', KEYS[2 * i], member, record) end
if short then return {'ok', granted, short[1], short[2], short[3], short[4]} end
return {'ok', granted}
