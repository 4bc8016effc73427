-- tollgate: GCRA, mirroring src/algorithm/gcra.rs.
--
-- Stored value: the theoretical arrival time, one positive integer.
local Gcra = {}

function Gcra.capacity(l)
  return l.burst
end

function Gcra.load(key, l, now)
  local v = tonumber(get_string(key))
  if v == nil or v <= 0 then
    return nil
  end
  return { tat = v }
end

function Gcra.start(s, now)
  if s == nil then
    return now
  end
  return math.max(s.tat, now)
end

function Gcra.check(l, s, now, cost)
  local tat = Gcra.start(s, now)
  local capacity_end = now + l.burst * l.interval
  local new_tat = tat + cost * l.interval
  -- The time until `remaining + 1` tokens fit after a theoretical arrival time `after`.
  local function window(after, remaining)
    return math.max(after + (remaining + 1) * l.interval - capacity_end, 0)
  end
  if new_tat <= capacity_end then
    local remaining = idiv(capacity_end - new_tat, l.interval)
    return true, remaining, new_tat - now, 0, window(new_tat, remaining)
  end
  local remaining = idiv(math.max(capacity_end - tat, 0), l.interval)
  return false, remaining, tat - now, new_tat - capacity_end, window(tat, remaining)
end

function Gcra.commit(key, l, s, now, cost, reset)
  local tat = Gcra.start(s, now) + cost * l.interval
  if tat > now then
    redis.call('SET', key, int(tat), 'PX', expiry_ms(reset))
  else
    redis.call('DEL', key)
  end
end

function Gcra.refund(key, l, now, cost, at)
  local v = tonumber(get_string(key))
  if v == nil or v <= 0 then
    return
  end
  local tat = v - cost * l.interval
  if tat > now then
    redis.call('SET', key, int(tat), 'PX', expiry_ms(tat - now))
  else
    redis.call('DEL', key)
  end
end
