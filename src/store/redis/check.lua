-- tollgate: checks every rule of one request, then charges them all or none.
--
-- KEYS: one key per charge.
-- ARGV[1]: the mode: "c" check and charge, "p" check only (peek), "r" refund a charge made at
--          ARGV[3] (cross-slot compensation).
-- ARGV[2]: the time, read only by stores built with an injected clock.
-- ARGV[3]: for "r", the time of the charge to refund.
-- Then six arguments per charge: algorithm, cost, limit, period, burst, interval.
--
-- Returns { now, then per charge: allowed (1/0), remaining, reset, retry_after (-1: never),
-- window }. A request that is not charged (denied, or a peek) reports every rule's budget as it
-- stands: a rule that would admit it is checked again at cost 0 for its numbers.
local ALGORITHMS = {
  tb = TokenBucket,
  gcra = Gcra,
  fw = FixedWindow,
  sl = SlidingLog,
  sc = SlidingCounter,
}

local now = clock()
local mode = ARGV[1]
local n = #KEYS
local rules = {}
for i = 1, n do
  local a = 3 + (i - 1) * 6
  rules[i] = {
    algorithm = ALGORITHMS[ARGV[a + 1]],
    cost = tonumber(ARGV[a + 2]),
    limits = {
      limit = tonumber(ARGV[a + 3]),
      period = tonumber(ARGV[a + 4]),
      burst = tonumber(ARGV[a + 5]),
      interval = tonumber(ARGV[a + 6]),
    },
  }
end

if mode == 'r' then
  local at = tonumber(ARGV[3])
  for i = 1, n do
    local r = rules[i]
    r.algorithm.refund(KEYS[i], r.limits, now, r.cost, at)
  end
  return { now }
end

local out = { now }
local admitted = true
for i = 1, n do
  local r = rules[i]
  local A, l = r.algorithm, r.limits
  local state, other = A.load(KEYS[i], l, now)
  r.state, r.other = state, other
  local allowed, remaining, reset, retry, window
  if r.cost > A.capacity(l) then
    -- Algorithm::check: a cost above the capacity is never admitted.
    allowed, remaining, reset, retry, window = A.check(l, state, now, 0)
    allowed, retry = false, -1
  else
    allowed, remaining, reset, retry, window = A.check(l, state, now, r.cost)
  end
  r.reset = reset
  r.allowed = allowed
  admitted = admitted and allowed
  local o = 5 * (i - 1) + 1
  out[o + 1] = allowed and 1 or 0
  out[o + 2] = remaining
  out[o + 3] = reset
  out[o + 4] = retry
  out[o + 5] = window
end

if not admitted or mode == 'p' then
  -- Nothing is charged (Algorithm::uncharged): the rules that would admit report their budget
  -- as it stands.
  for i = 1, n do
    local r = rules[i]
    if r.allowed and r.cost > 0 then
      local _, remaining, reset, _, window = r.algorithm.check(r.limits, r.state, now, 0)
      local o = 5 * (i - 1) + 1
      out[o + 2] = remaining
      out[o + 3] = reset
      out[o + 5] = window
    end
  end
end

if admitted and mode == 'c' then
  local written = {}
  for i = 1, n do
    local r = rules[i]
    local key = KEYS[i]
    local state, other = r.state, r.other
    if written[key] then
      -- An earlier charge of this request already changed this key: read it again.
      state, other = r.algorithm.load(key, r.limits, now)
    end
    r.algorithm.commit(key, r.limits, state, now, r.cost, r.reset, other)
    written[key] = true
  end
end
return out
