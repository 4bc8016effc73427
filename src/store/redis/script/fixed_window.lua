-- tollgate: the fixed window, mirroring src/algorithm/fixed_window.rs.
--
-- Stored value: "start:count" (the window start in microseconds and the cost admitted in it).
local FixedWindow = {}

function FixedWindow.capacity(l)
  return l.limit
end

function FixedWindow.load(key, l, now)
  local v = get_integers(key, 2)
  if v == nil then
    return nil
  end
  return { start = v[1], count = v[2] }
end

function FixedWindow.count(l, s, now)
  local start = now - imod(now, l.period)
  local count = 0
  if s ~= nil and s.start == start then
    count = s.count
  end
  return start, count
end

function FixedWindow.check(l, s, now, cost)
  local start, count = FixedWindow.count(l, s, now)
  local until_next = start + l.period - now
  local allowed = count + cost <= l.limit
  local used = count
  if allowed then
    used = count + cost
  end
  local reset = until_next
  if used == 0 then
    reset = 0
  end
  local retry = until_next
  if allowed then
    retry = 0
  end
  return allowed, max(l.limit - used, 0), reset, retry, until_next
end

function FixedWindow.commit(key, l, s, now, cost, reset)
  local start, count = FixedWindow.count(l, s, now)
  count = count + cost
  if count > 0 then
    call('SET', key, int(start) .. ':' .. int(count), 'PX', expiry_ms(reset))
  else
    call('DEL', key)
  end
end

function FixedWindow.refund(key, l, now, cost, at)
  local s = FixedWindow.load(key, l, now)
  if s == nil or s.start ~= at - imod(at, l.period) then
    return
  end
  local count = s.count - cost
  if count > 0 then
    call('SET', key, int(s.start) .. ':' .. int(count), 'KEEPTTL')
  else
    call('DEL', key)
  end
end

-- Charges `cost` whatever the budget: the window's count may pass the quota (a debt the window's
-- end forgives).
function FixedWindow.force(key, l, s, now, cost)
  local start, count = FixedWindow.count(l, s, now)
  count = min(count + cost, MAX_WINDOW_COUNT)
  if count > 0 then
    call('SET', key, int(start) .. ':' .. int(count), 'PX', expiry_ms(start + l.period - now))
  end
end
