-- tollgate: the sliding window log, mirroring src/algorithm/sliding_log.rs.
--
-- Stored value: a list of the admitted units' times, oldest first, one entry per cost unit, never
-- more than the quota. Only the entries a decision needs are read (LLEN, LINDEX).
local SlidingLog = {}

function SlidingLog.capacity(l)
  return l.limit
end

local function entry(key, i)
  return tonumber(call('LINDEX', key, i))
end

-- The state: the list's length, the index of its first live entry, and its newest entry.
-- `other` is true when the key holds a value of another algorithm.
function SlidingLog.load(key, l, now)
  local len = pcall_redis('LLEN', key)
  if type(len) ~= 'number' then
    return nil, true
  end
  if len == 0 then
    return nil
  end
  -- partition_point(|t| t + period <= now), by binary search.
  local lo, hi = 0, len
  if entry(key, 0) + l.period > now then
    hi = 0
  end
  while lo < hi do
    local mid = lo + idiv(hi - lo, 2)
    if entry(key, mid) + l.period <= now then
      lo = mid + 1
    else
      hi = mid
    end
  end
  return { key = key, len = len, first = lo, back = entry(key, len - 1) }
end

function SlidingLog.check(l, s, now, cost)
  local count = 0
  if s ~= nil then
    count = s.len - s.first
  end
  -- The oldest unit leaves first; an empty log fills from now.
  local oldest = now
  if count > 0 then
    oldest = entry(s.key, s.first)
  end
  local window = max(oldest + l.period - now, 1)
  if count + cost <= l.limit then
    local newest = nil
    if s ~= nil then
      newest = s.back
      if cost > 0 then
        newest = max(s.back, now)
      end
    elseif cost > 0 then
      newest = now
    end
    local reset = 0
    if newest ~= nil then
      reset = max(newest + l.period - now, 0)
    end
    return true, l.limit - count - cost, reset, 0, window
  end
  local must_leave = count + cost - l.limit
  local reset = 0
  if s ~= nil then
    reset = max(s.back + l.period - now, 0)
  end
  local retry = -1
  if must_leave >= 1 and must_leave <= count then
    retry = entry(s.key, s.first + must_leave - 1) + l.period - now
  end
  return false, max(l.limit - count, 0), reset, retry, window
end

function SlidingLog.commit(key, l, s, now, cost, reset, other)
  if other then
    call('DEL', key)
  end
  local kept = 0
  local at = now
  if s ~= nil then
    kept = s.len - s.first
    if kept == 0 then
      call('DEL', key)
    else
      if s.first > 0 then
        call('LTRIM', key, s.first, -1)
      end
      at = max(s.back, now)
    end
  end
  push_copies(key, int(at), cost)
  if kept + cost > 0 then
    call('PEXPIRE', key, expiry_ms(reset))
  end
end

function SlidingLog.refund(key, l, now, cost, at)
  local len = pcall_redis('LLEN', key)
  if type(len) ~= 'number' or len == 0 or cost <= 0 then
    return
  end
  -- Algorithm::refund: the newest `cost` entries charged at or before `at` (oldest first in
  -- the list); the entries after `at` are another request's, and stay. They are at the tail:
  -- read from there, a chunk at a time (a refund is of a recent charge).
  local after = 0
  local chunk = 16
  while true do
    local stop = len - after - 1
    local from = max(stop - chunk + 1, 0)
    local part = call('LRANGE', key, from, stop)
    local i = #part
    while i > 0 and tonumber(part[i]) > at do
      i = i - 1
    end
    after = after + (#part - i)
    if i > 0 or from == 0 then
      break
    end
    chunk = chunk * 2
  end
  local last = len - after
  local first = max(last - cost + 1, 1)
  if last < first then
    return
  end
  local entries = {}
  if after > 0 then
    entries = call('LRANGE', key, last, -1)
  end
  if first == 1 and after == 0 then
    call('DEL', key)
    return
  end
  -- Keep the entries before `first`, then put the `after` ones back behind them.
  local ttl = -1
  if first > 1 then
    call('LTRIM', key, 0, first - 2)
  else
    ttl = call('PTTL', key)
    call('DEL', key)
  end
  local i = 1
  while i <= #entries do
    local batch = {}
    for j = i, min(i + 999, #entries) do
      batch[#batch + 1] = entries[j]
    end
    call('RPUSH', key, unpack(batch))
    i = i + #batch
  end
  if ttl > 0 then
    call('PEXPIRE', key, ttl)
  end
end

-- Charges `cost` whatever the budget, as entries at `now`, at most 10,000 in all (a debt the
-- entries hold until they leave the window).
function SlidingLog.force(key, l, s, now, cost, other)
  local live = 0
  if s ~= nil then
    live = s.len - s.first
  end
  SlidingLog.commit(key, l, s, now, min(cost, max(10000 - live, 0)), l.period, other)
end
