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

-- The check, with the bucket as it is at `now` (TokenBucket::refill: whole tokens counted at
-- `updated`) and the times until it holds what is wanted (time_until) written out: this runs on
-- every check, and a call costs the server more than the arithmetic.
function TokenBucket.check(l, s, now, cost)
  local interval, burst = l.interval, l.burst
  local tokens, updated = burst, now
  if s ~= nil then
    local added = 0
    if now - s >= interval then
      added = idiv(now - s, interval)
    end
    if added < burst then
      tokens, updated = added, s + added * interval
    end
  end
  -- The time until the next token: `updated` is never a whole interval behind `now`.
  local window = max(updated + interval - now, 1)
  if tokens >= cost then
    local left = tokens - cost
    local reset = 0
    if left < burst then
      reset = max(updated + (burst - left) * interval - now, 0)
    end
    return true, left, reset, 0, window
  end
  local reset = 0
  if tokens < burst then
    reset = max(updated + (burst - tokens) * interval - now, 0)
  end
  return false, tokens, reset, max(updated + (cost - tokens) * interval - now, 0), window
end

-- The state a commit of a check answered `reset` at `now` leaves, as `load` would read it: the
-- next check of a run of checks on one key starts from it without a read.
function TokenBucket.after(l, now, reset)
  if reset > 0 then
    return now + reset - l.burst * l.interval
  end
  return nil
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
