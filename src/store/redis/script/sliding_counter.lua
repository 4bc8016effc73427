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
  return floor(weighted) + c.current
end

function SlidingCounter.admits(l, s, at, cost)
  local c = SlidingCounter.counters(l, s, at)
  return SlidingCounter.estimate(l, c, at) + cost <= l.limit
end

-- The first `t` in [low, high] that admits `cost` (it admits at `high`), by binary search.
function SlidingCounter.search(l, s, low, high, cost)
  while low < high do
    local mid = low + idiv(high - low, 2)
    if SlidingCounter.admits(l, s, mid, cost) then
      high = mid
    else
      low = mid + 1
    end
  end
  return low
end

-- The first `t` in [from, to] that admits `cost`, stepping from `guess`, as the model does.
function SlidingCounter.first_fit(l, s, from, to, guess, cost)
  local t = min(max(guess, from), to)
  if SlidingCounter.admits(l, s, t, cost) then
    for _ = 1, 8 do
      if t == from or not SlidingCounter.admits(l, s, t - 1, cost) then
        return t
      end
      t = t - 1
    end
    return SlidingCounter.search(l, s, from, t, cost)
  end
  for _ = 1, 8 do
    t = t + 1
    if SlidingCounter.admits(l, s, t, cost) then
      return t
    end
  end
  return SlidingCounter.search(l, s, t, to, cost)
end

-- The time from `now` until a request of `cost` fits (time_until_fits of the model). The guess
-- is computed in doubles here and exactly in the model; both then step to the same microsecond.
function SlidingCounter.time_until_fits(l, s, now, cost)
  local c = SlidingCounter.counters(l, s, now)
  local period = l.period
  local finish = c.start + period
  local guess
  if c.current + cost <= l.limit then
    if c.previous == 0 then
      guess = now
    else
      local x = ceil((l.limit - c.current - cost + 1) * period / c.previous) - 1
      guess = max(finish - x, now)
    end
  else
    local x = ceil((l.limit - cost + 1) * period / c.current) - 1
    guess = finish + period - min(x, period)
  end
  return SlidingCounter.first_fit(l, s, now, c.start + 2 * period, guess, cost) - now
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
    retry = SlidingCounter.time_until_fits(l, s, now, cost)
  end
  local spent = estimate
  if allowed then
    spent = estimate + cost
  end
  local remaining = max(l.limit - spent, 0)
  local window
  if remaining >= l.limit then
    window = c.start + l.period - now
  else
    local after = { start = c.start, previous = c.previous, current = current }
    window = max(SlidingCounter.time_until_fits(l, after, now, remaining + 1), 1)
  end
  return allowed, remaining, reset, retry, window
end

function SlidingCounter.commit(key, l, s, now, cost, reset)
  local c = SlidingCounter.counters(l, s, now)
  local current = c.current + cost
  if current > 0 or c.previous > 0 then
    call('SET', key, int(c.start) .. ':' .. int(c.previous) .. ':' .. int(current),
      'PX', expiry_ms(reset))
  else
    call('DEL', key)
  end
end

function SlidingCounter.refund(key, l, now, cost, at)
  local s = SlidingCounter.load(key, l, now)
  if s == nil then
    return
  end
  local charged = at - imod(at, l.period)
  if s.start == charged then
    s.current = max(s.current - cost, 0)
  elseif s.start == charged + l.period then
    s.previous = max(s.previous - cost, 0)
  else
    return
  end
  if s.current > 0 or s.previous > 0 then
    call('SET', key, int(s.start) .. ':' .. int(s.previous) .. ':' .. int(s.current),
      'KEEPTTL')
  else
    call('DEL', key)
  end
end

-- Charges `cost` whatever the budget: the current window's count may pass the quota (a debt that
-- weighs on the next window too).
function SlidingCounter.force(key, l, s, now, cost)
  local c = SlidingCounter.counters(l, s, now)
  local current = min(c.current + cost, MAX_COUNT)
  if current > 0 or c.previous > 0 then
    call('SET', key, int(c.start) .. ':' .. int(c.previous) .. ':' .. int(current),
      'PX', expiry_ms(c.start + 2 * l.period - now))
  end
end
