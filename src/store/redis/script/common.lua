-- tollgate: helpers shared by the algorithms. Every number is an integer below 2^53, where Lua's
-- doubles are exact.

-- The library functions the code calls on every check, as locals (a global is a table lookup),
-- bound by the first call: a function library cannot reach them while it is loaded.
local max, min, floor, ceil, tonumber, type, format, call, pcall_redis
local function bind()
  max, min, floor, ceil = math.max, math.min, math.floor, math.ceil
  tonumber, type, format = _G.tonumber, _G.type, string.format
  call, pcall_redis = redis.call, redis.pcall
end

-- floor(a / b) for integers 0 <= a < 2^53 and b > 0: the double quotient is corrected by one
-- step either way, so the result equals Rust's integer division.
local function idiv(a, b)
  local q = floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

-- a % b for integers 0 <= a < 2^53 and b > 0, as Rust computes it.
local function imod(a, b)
  return a - idiv(a, b) * b
end

-- Microseconds to whole milliseconds for PEXPIRE, rounded up: a key never expires before its
-- state is equivalent to no state at all.
local function expiry_ms(micros)
  return max(1, idiv(micros + 999, 1000)) + EXPIRY_SLACK_MS
end

-- An integer as Redis should store it (`tostring` would switch to exponents; a number given to
-- redis.call is written with "%.17g", which costs the server more).
local function int(n)
  return format('%d', n)
end

-- Appends `n` copies of `value` to the list at `key`, in pushes of at most 1,000 (Lua's unpack
-- has a limit of its own).
local function push_copies(key, value, n)
  local left = n
  while left > 0 do
    local batch = {}
    for i = 1, min(left, 1000) do
      batch[i] = value
    end
    call('RPUSH', key, unpack(batch))
    left = left - #batch
  end
end

-- The string value of a key; nil when the key is missing or holds another type (a sliding log).
local function get_string(key)
  local v = pcall_redis('GET', key)
  if type(v) ~= 'string' then
    return nil
  end
  return v
end

-- The values of the keys that hold one number (token bucket, GCRA) while a batch is decided:
-- each key is read from Redis once and written once, at the end of the call, however many
-- requests of the batch it decides (a hot key's batch costs two commands, not two per request).
-- `false`: no value. Outside a batch (nil), reads and writes go to Redis at once.
local HELD, HELD_EXPIRY = nil, nil

-- The number a key holds, or nil.
local function number_at(key)
  if HELD == nil then
    return tonumber(get_string(key))
  end
  local v = HELD[key]
  if v == nil then
    v = tonumber(get_string(key)) or false
    HELD[key] = v
  end
  return v or nil
end

-- Sets a key to the integer `n`, expiring in `ms` milliseconds; with `n` nil, deletes it.
local function set_number(key, n, ms)
  if HELD == nil then
    if n == nil then
      call('DEL', key)
    else
      call('SET', key, int(n), 'PX', ms)
    end
    return
  end
  HELD[key] = n or false
  HELD_EXPIRY[key] = ms or 0
end

-- Starts holding the values of number keys (a batch), the values of `keys` read at once (one
-- MGET for the batch in place of a GET per key; a key of another type reads as no value, as
-- `get_string` does). An ACL user that may not MGET reads them one by one, as before.
local function hold(keys)
  HELD, HELD_EXPIRY = {}, {}
  if keys ~= nil and #keys > 1 then
    local values = pcall_redis('MGET', unpack(keys))
    if type(values) == 'table' and values.err == nil then
      for i = 1, #keys do
        HELD[keys[i]] = tonumber(values[i]) or false
      end
    end
  end
end

-- Writes every value changed while held, once, and stops holding.
local function release()
  if HELD == nil then
    return
  end
  for key, ms in pairs(HELD_EXPIRY) do
    local n = HELD[key]
    if n then
      call('SET', key, int(n), 'PX', ms)
    else
      call('DEL', key)
    end
  end
  HELD, HELD_EXPIRY = nil, nil
end

-- The `n` integers of a value written as "a:b[:c]"; nil when the key is missing or holds anything
-- else (another algorithm's state counts as no state).
local function get_integers(key, n)
  local v = get_string(key)
  if v == nil then
    return nil
  end
  -- Lua 5.1's string.rep has no separator argument.
  local pattern = '^(%d+)' .. string.rep(':(%d+)', n - 1) .. '$'
  local parts = { string.match(v, pattern) }
  if parts[1] == nil then
    return nil
  end
  for i = 1, n do
    parts[i] = tonumber(parts[i])
  end
  return parts
end

-- Debts are bounded as the model bounds them: a bucket full again at most this long from now
-- (MAX_DEBT_MICROS), a fixed window counting at most 2^53 (MAX_MICROS; its quota is far
-- below), a sliding counter's window at most 2^32 - 1 (its quota is at most that).
local MAX_DEBT_MICROS = 632448000000000
local MAX_WINDOW_COUNT = 9007199254740992
local MAX_COUNT = 4294967295

-- The time a bucket full again at `tat` is full again after `cost` more units, bounded.
local function later(l, tat, now, cost)
  return min(max(tat, now) + cost * l.interval, now + MAX_DEBT_MICROS)
end
