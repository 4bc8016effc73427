-- tollgate: GCRA, mirroring src/algorithm/gcra.rs.
--
-- Stored value: the theoretical arrival time, one positive integer. Loaded, the state is that
-- number.
local Gcra = {}

function Gcra.capacity(l)
  return l.burst
end

function Gcra.load(key, l, now)
  local v = number_at(key)
  if v == nil or v <= 0 then
    return nil
  end
  return v
end

function Gcra.start(s, now)
  if s == nil then
    return now
  end
  return max(s, now)
end

function Gcra.check(l, s, now, cost)
  local interval = l.interval
  local tat = now
  if s ~= nil and s > now then
    tat = s
  end
  local capacity_end = now + l.burst * interval
  local new_tat = tat + cost * interval
  -- The window is the time until `remaining + 1` tokens fit after the theoretical arrival time
  -- that stands.
  if new_tat <= capacity_end then
    local remaining = idiv(capacity_end - new_tat, interval)
    return true, remaining, new_tat - now, 0,
      max(new_tat + (remaining + 1) * interval - capacity_end, 0)
  end
  local remaining = idiv(max(capacity_end - tat, 0), interval)
  return false, remaining, tat - now, new_tat - capacity_end,
    max(tat + (remaining + 1) * interval - capacity_end, 0)
end

-- The state a commit of a check answered `reset` at `now` leaves, as `load` would read it.
function Gcra.after(l, now, reset)
  if reset > 0 then
    return now + reset
  end
  return nil
end

-- Charges the check that admitted `cost` at `now`: its `reset` is the new theoretical arrival
-- time minus `now`.
function Gcra.commit(key, l, s, now, cost, reset)
  if reset > 0 then
    set_number(key, now + reset, expiry_ms(reset))
  else
    set_number(key, nil)
  end
end

function Gcra.refund(key, l, now, cost, at)
  local v = number_at(key)
  if v == nil or v <= 0 then
    return
  end
  local tat = v - cost * l.interval
  if tat > now then
    set_number(key, tat, expiry_ms(tat - now))
  else
    set_number(key, nil)
  end
end

-- Charges `cost` whatever the budget: the theoretical arrival time moves on, past the burst if
-- need be (a debt).
function Gcra.force(key, l, s, now, cost)
  local tat = later(l, Gcra.start(s, now), now, cost)
  if tat > now then
    set_number(key, tat, expiry_ms(tat - now))
  end
end
