-- tollgate: the token bucket, mirroring src/algorithm/token_bucket.rs.
--
-- Stored value: minus the time the bucket is full again, one integer (`-tat`; the sign tells it
-- from a GCRA value). The model's state (tokens, updated) is recovered as the equivalent
-- (0, tat - burst * interval): refilled at any `now` not before the last commit it gives the
-- same tokens and the same `updated` as the model's state would. Loaded, the state is that
-- `updated` alone (its tokens are 0), one number rather than a table.
local TokenBucket = {}

function TokenBucket.capacity(l)
  return l.burst
end

function TokenBucket.load(key, l, now)
  local v = number_at(key)
  if v == nil or v >= 0 then
    return nil
  end
  return -v - l.burst * l.interval
end

-- The bucket as it is at `now`: its whole tokens and the time they were counted at (two numbers,
-- not a table: this runs on every check).
local function tb_refill(l, updated, now)
  if updated == nil then
    return l.burst, now
  end
  local added = 0
  if now - updated >= l.interval then
    added = idiv(now - updated, l.interval)
  end
  if added >= l.burst then
    return l.burst, now
  end
  return added, updated + added * l.interval
end

-- The time from `now` until a bucket of `tokens` counted at `updated` holds `wanted`.
local function tb_time_until(l, tokens, updated, now, wanted)
  if tokens >= wanted then
    return 0
  end
  return max(updated + (wanted - tokens) * l.interval - now, 0)
end

function TokenBucket.check(l, s, now, cost)
  local tokens, updated = tb_refill(l, s, now)
  -- The time until the next token: `updated` is never a whole interval behind `now`.
  local window = max(updated + l.interval - now, 1)
  if tokens >= cost then
    local left = tokens - cost
    return true, left, tb_time_until(l, left, updated, now, l.burst), 0, window
  end
  return false, tokens, tb_time_until(l, tokens, updated, now, l.burst),
    tb_time_until(l, tokens, updated, now, cost), window
end

-- Charges the check that admitted `cost` at `now`: its `reset` is the time until the bucket is
-- full again, so the new value is `-(now + reset)` (no refill computed twice).
function TokenBucket.commit(key, l, s, now, cost, reset)
  if reset > 0 then
    set_number(key, -(now + reset), expiry_ms(reset))
  else
    set_number(key, nil)
  end
end

-- Gives back `cost` tokens taken by a commit (cross-slot compensation).
function TokenBucket.refund(key, l, now, cost, at)
  local v = number_at(key)
  if v == nil or v >= 0 then
    return
  end
  local tat = -v - cost * l.interval
  if tat > now then
    set_number(key, -tat, expiry_ms(tat - now))
  else
    set_number(key, nil)
  end
end

-- Charges `cost` whatever the budget (a settled cost above its estimate): the bucket is full
-- again `cost` refills later, beyond its burst if need be (a debt the next requests wait for).
function TokenBucket.force(key, l, s, now, cost)
  local full_at = now
  if s ~= nil then
    full_at = max(s + l.burst * l.interval, now)
  end
  local tat = later(l, full_at, now, cost)
  if tat > now then
    set_number(key, -tat, expiry_ms(tat - now))
  end
end
