-- tollgate: the token bucket, mirroring src/algorithm/token_bucket.rs.
--
-- Stored value: minus the time the bucket is full again, one integer (`-tat`; the sign tells it
-- from a GCRA value). The model's state (tokens, updated) is recovered as the equivalent
-- (0, tat - burst * interval): refilled at any `now` not before the last commit it gives the
-- same tokens and the same `updated` as the model's state would.
local TokenBucket = {}

function TokenBucket.capacity(l)
  return l.burst
end

function TokenBucket.load(key, l, now)
  local v = tonumber(get_string(key))
  if v == nil or v >= 0 then
    return nil
  end
  return { tokens = 0, updated = -v - l.burst * l.interval }
end

function TokenBucket.refill(l, s, now)
  if s == nil then
    return { tokens = l.burst, updated = now }
  end
  local added = idiv(math.max(now - s.updated, 0), l.interval)
  local tokens = s.tokens + added
  if tokens >= l.burst then
    return { tokens = l.burst, updated = now }
  end
  return { tokens = tokens, updated = s.updated + added * l.interval }
end

function TokenBucket.time_until(l, b, now, wanted)
  if b.tokens >= wanted then
    return 0
  end
  return math.max(b.updated + (wanted - b.tokens) * l.interval - now, 0)
end

-- The time until the next token: `updated` is never a whole interval behind `now`.
function TokenBucket.next_token(l, b, now)
  return math.max(b.updated + l.interval - now, 1)
end

function TokenBucket.check(l, s, now, cost)
  local b = TokenBucket.refill(l, s, now)
  local window = TokenBucket.next_token(l, b, now)
  if b.tokens >= cost then
    local after = { tokens = b.tokens - cost, updated = b.updated }
    return true, after.tokens, TokenBucket.time_until(l, after, now, l.burst), 0, window
  end
  return false, b.tokens, TokenBucket.time_until(l, b, now, l.burst),
    TokenBucket.time_until(l, b, now, cost), window
end

function TokenBucket.commit(key, l, s, now, cost, reset)
  local b = TokenBucket.refill(l, s, now)
  local tokens = math.max(b.tokens - cost, 0)
  if tokens < l.burst then
    local tat = b.updated + (l.burst - tokens) * l.interval
    redis.call('SET', key, int(-tat), 'PX', expiry_ms(reset))
  else
    redis.call('DEL', key)
  end
end

-- Gives back `cost` tokens taken by a commit (cross-slot compensation).
function TokenBucket.refund(key, l, now, cost, at)
  local v = tonumber(get_string(key))
  if v == nil or v >= 0 then
    return
  end
  local tat = -v - cost * l.interval
  if tat > now then
    redis.call('SET', key, int(-tat), 'PX', expiry_ms(tat - now))
  else
    redis.call('DEL', key)
  end
end
