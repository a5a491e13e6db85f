-- End a step's claims that its commit will not end: the step made its model call (it was asked,
-- and may have answered) and then ended without a commit (its lease was lost: the session was
-- cancelled or moved on meanwhile). The call is spent: the model call, and the tokens and cost of
-- its bound where it has one (as claim_budget.lua spends a claim that lapsed). A claim already
-- gone (lapsed and spent by another claim, or never made) spends nothing here.
-- KEYS: for each session with a budget (the step's own, those above): its header (the spent_*
-- fields), its claims (hash: member -> "expires_ms model_calls tool_calls tokens cost").
-- ARGV[1] = the step's member. Returns how many claims it spent.
local SPENT = {'spent_tokens', 'spent_cost', 'spent_model_calls'}
local n = 0
for i = 1, #KEYS / 2 do
  local meta, claims = KEYS[2 * i - 1], KEYS[2 * i]
  local record = redis.call('HGET', claims, ARGV[1])
  if record then
    redis.call('HDEL', claims, ARGV[1])
    local _, mc, _, tok, cost = string.match(record, '^(%S+) (%S+) (%S+) (%S+) (%S+)$')
    if tonumber(mc) > 0 and redis.call('EXISTS', meta) == 1 then
      n = n + 1
      for k, v in ipairs({tonumber(tok), tonumber(cost), tonumber(mc)}) do
        if v > 0 then
          if k == 2 then redis.call('HINCRBYFLOAT', meta, SPENT[k], v) else redis.call('HINCRBY', meta, SPENT[k], v) end
        end
      end
    end
  end
end
return n
