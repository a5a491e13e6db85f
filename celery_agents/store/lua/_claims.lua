-- What a model call's claim that no commit ends spends on a budget (claim_budget.lua, a claim that
-- lapsed: its worker died; settle_claim.lua, a call the model answered to a step that then lost its
-- lease): the model call, and its bound's tokens and cost. Without a bound (no `max_tokens`) what
-- it spent is unknown: under a token or cost limit it spent all that was left of that limit, so
-- that the limit is crossed by one call at most, never by two (`resume --grant` goes on).
-- meta: the budget's header; budget: its limits (decoded); mc, tok, cost: the claim's numbers.
local CLAIM_SPENT = {'spent_tokens', 'spent_cost', 'spent_model_calls'}
local CLAIM_LIMITS = {'tokens', 'costUsd'}
local function spend_claim(meta, budget, mc, tok, cost)
  if mc <= 0 then return end
  local spent = redis.call('HMGET', meta, 'spent_tokens', 'spent_cost')
  for k, v in ipairs({tok, cost, mc}) do
    if v < 0 then
      local limit, now = budget[CLAIM_LIMITS[k]], tonumber(spent[k] or '0') or 0
      if limit ~= nil and limit ~= cjson.null and limit > now then
        -- set, not added: the spend equals the limit exactly, whatever floating point would make of a sum
        local at = k == 1 and string.format('%d', math.ceil(limit)) or string.format('%.17g', limit)
        redis.call('HSET', meta, CLAIM_SPENT[k], at)
      end
    elseif v > 0 then
      if k == 2 then
        redis.call('HINCRBYFLOAT', meta, CLAIM_SPENT[k], v)
      else
        redis.call('HINCRBY', meta, CLAIM_SPENT[k], math.ceil(v))
      end
    end
  end
end
