-- End a step's claims that its commit will not end: the model answered the step's call and the
-- step then ended without sending its commit (an error after the answer; a step that lost its
-- lease sends its commit anyway, whose refusal spends the call's usage). The call is spent at its
-- bound (_claims.lua `spend_claim`, as claim_budget.lua
-- spends a claim that lapsed). A claim already gone (lapsed and spent by another claim, or never
-- made) spends nothing here.
-- KEYS: for each session with a budget (the step's own, those above): its header (the spent_*
-- fields), its claims (hash: member -> "expires_ms model_calls tool_calls tokens cost").
-- ARGV[1] = the step's member. Returns how many claims it spent.
local n = 0
for i = 1, #KEYS / 2 do
  local meta, claims = KEYS[2 * i - 1], KEYS[2 * i]
  local record = redis.call('HGET', claims, ARGV[1])
  if record then
    redis.call('HDEL', claims, ARGV[1])
    local _, mc, _, tok, cost = string.match(record, '^(%S+) (%S+) (%S+) (%S+) (%S+)$')
    local budget = redis.call('HGET', meta, 'budget')
    if tonumber(mc) > 0 and budget then
      n = n + 1
      spend_claim(meta, cjson.decode(budget), tonumber(mc), tonumber(tok), tonumber(cost))
    end
  end
end
return n
