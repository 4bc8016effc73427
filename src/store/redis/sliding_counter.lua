-- tollgate: the sliding window counter, mirroring src/algorithm/sliding_counter.rs.
--
-- Stored value: "start:previous:current".
local SlidingCounter = {}

function SlidingCounter.capacity(l)
  return l.limit
end

function SlidingCounter.load(key, l, now)
  local v = get_integers(key, 3)
  if v == nil then
    return nil
  end
  return { start = v[1], previous = v[2], current = v[3] }
end

function SlidingCounter.counters(l, s, now)
  local start = now - imod(now, l.period)
  local previous, current = 0, 0
  if s ~= nil and s.start == start then
    previous, current = s.previous, s.current
  elseif s ~= nil and s.start + l.period == start then
    previous, current = s.current, 0
  end
  return { start = start, previous = previous, current = current }
end

-- The same floating-point operations, in the same order, as the Rust model.
function SlidingCounter.estimate(l, c, now)
  local elapsed = now - c.start
  local weighted = c.previous * (l.period - elapsed) / l.period
  return math.floor(weighted) + c.current
end

function SlidingCounter.admits(l, s, at, cost)
  local c = SlidingCounter.counters(l, s, at)
  return SlidingCounter.estimate(l, c, at) + cost <= l.limit
end

function SlidingCounter.check(l, s, now, cost)
  local c = SlidingCounter.counters(l, s, now)
  local estimate = SlidingCounter.estimate(l, c, now)
  local allowed = estimate + cost <= l.limit
  local current = c.current
  if allowed then
    current = c.current + cost
  end
  local reset = 0
  if current > 0 then
    reset = c.start + 2 * l.period - now
  elseif c.previous > 0 then
    reset = c.start + l.period - now
  end
  local retry = 0
  if allowed then
    retry = 0
  elseif cost > l.limit then
    retry = -1
  else
    local low, high = now, c.start + 2 * l.period
    while low < high do
      local mid = low + idiv(high - low, 2)
      if SlidingCounter.admits(l, s, mid, cost) then
        high = mid
      else
        low = mid + 1
      end
    end
    retry = low - now
  end
  local spent = estimate
  if allowed then
    spent = estimate + cost
  end
  return allowed, math.max(l.limit - spent, 0), reset, retry
end

function SlidingCounter.commit(key, l, s, now, cost, reset)
  local c = SlidingCounter.counters(l, s, now)
  local current = c.current + cost
  if current > 0 or c.previous > 0 then
    redis.call('SET', key, int(c.start) .. ':' .. int(c.previous) .. ':' .. int(current),
      'PX', expiry_ms(reset))
  else
    redis.call('DEL', key)
  end
end

function SlidingCounter.refund(key, l, now, cost, at)
  local s = SlidingCounter.load(key, l, now)
  if s == nil then
    return
  end
  local charged = at - imod(at, l.period)
  if s.start == charged then
    s.current = math.max(s.current - cost, 0)
  elseif s.start == charged + l.period then
    s.previous = math.max(s.previous - cost, 0)
  else
    return
  end
  if s.current > 0 or s.previous > 0 then
    redis.call('SET', key, int(s.start) .. ':' .. int(s.previous) .. ':' .. int(s.current),
      'KEEPTTL')
  else
    redis.call('DEL', key)
  end
end
