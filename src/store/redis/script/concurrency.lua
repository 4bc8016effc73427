-- tollgate: the concurrency limit, mirroring src/algorithm/concurrency.rs.
--
-- Stored value: a list of the times held units were taken, oldest first (as the sliding log
-- keeps its entries); a unit is held until it is given back or its hold (the period) expires.
local Concurrency = {}

-- CONCURRENCY_RETRY_MICROS: the longest retry_after and window of a concurrency limit.
local CONCURRENCY_RETRY = 1000000

function Concurrency.capacity(l)
  return l.limit
end

Concurrency.load = SlidingLog.load

function Concurrency.check(l, s, now, cost)
  local count = 0
  if s ~= nil then
    count = s.len - s.first
  end
  local function expires(i)
    return entry(s.key, s.first + i) + l.period - now
  end
  local window = l.period
  if count > 0 then
    window = expires(0)
  end
  window = min(max(window, 1), CONCURRENCY_RETRY)
  local newest = nil
  if count > 0 then
    newest = s.back
  end
  if count + cost <= l.limit then
    if cost > 0 then
      if newest ~= nil then
        newest = max(newest, now)
      else
        newest = now
      end
    end
    local reset = 0
    if newest ~= nil then
      reset = newest + l.period - now
    end
    return true, l.limit - count - cost, reset, 0, window
  end
  local must_leave = count + cost - l.limit
  local reset = 0
  if newest ~= nil then
    reset = newest + l.period - now
  end
  local retry = -1
  if must_leave <= count then
    retry = min(expires(must_leave - 1), CONCURRENCY_RETRY)
  end
  return false, max(l.limit - count, 0), reset, retry, window
end

-- Inserts `n` units taken at `now` after every unit taken no later (the list stays in order
-- should the clock step back).
local function insert_taken(key, s, now, n)
  if n == 0 then
    return
  end
  local value = int(now)
  if s == nil or s.len == s.first or s.back <= now then
    push_copies(key, value, n)
    return
  end
  -- The first unit taken after `now`, by binary search: the units go before it.
  local lo, hi = 0, s.len - s.first
  while lo < hi do
    local mid = lo + idiv(hi - lo, 2)
    if entry(key, mid) <= now then
      lo = mid + 1
    else
      hi = mid
    end
  end
  local pivot = call('LINDEX', key, lo)
  for _ = 1, n do
    call('LINSERT', key, 'BEFORE', pivot, value)
  end
end

function Concurrency.commit(key, l, s, now, cost, reset, other)
  if other then
    call('DEL', key)
    s = nil
  end
  if s ~= nil then
    if s.len == s.first then
      call('DEL', key)
      s = nil
    elseif s.first > 0 then
      call('LTRIM', key, s.first, -1)
    end
  end
  insert_taken(key, s, now, cost)
  if reset > 0 then
    call('PEXPIRE', key, expiry_ms(reset))
  end
end

-- Gives back up to `cost` units taken at `at`, if they are still there. Nothing else is
-- touched: a give-back may come from a request decided under an older policy, whose longest
-- hold was not this one. A list left empty is deleted by Redis.
function Concurrency.refund(key, l, now, cost, at)
  if cost > 0 and call('TYPE', key).ok == 'list' then
    call('LREM', key, cost, int(at))
  end
end

-- Takes `cost` units whatever the limit, at most 10,000 held in all.
function Concurrency.force(key, l, s, now, cost, other)
  local live = 0
  if s ~= nil and not other then
    live = s.len - s.first
  end
  local n = min(cost, max(10000 - live, 0))
  local newest = now
  if live > 0 then
    newest = max(s.back, now)
  end
  Concurrency.commit(key, l, s, now, n, newest + l.period - now, other)
end
