-- tollgate: checks the charges of a request all or nothing: every rule is checked, then all of
-- them are charged only when all of them admit it. A batch holds several requests, decided one
-- after the other, in order, as if each had been a call of its own.
--
-- KEYS: one key per charge, request after request.
-- ARGV[1], for one request: "c" check and charge, "p" check only (peek), "r<time>" refund
--          charges made at <time> (cross-slot compensation), "a<time>" adjust charges made at
--          <time> (the lease field says how: 1 charge more, 0 give back), or "x" reset (delete
--          the keys); with an injected clock, followed by "@<time>". Then one argument per
--          charge (below).
-- ARGV[1], for a batch: "B". Then per request its number of charges (with an injected clock,
--          "<n>@<time>"), then one argument per charge. A batch of requests of one charge each,
--          with the server's time, is "b", then one argument per charge: no counts; or a single
--          argument, the charge of every key. A batch of requests of one charge, all alike, of
--          an algorithm of one number (token bucket, GCRA), with no lease, is "R": the charge,
--          then per key the number of requests of that key, one after the other (a run).
-- A charge: "<algorithm>:<limit>:<period>:<burst>:<interval>:<cost>:<lease>" (lease 0: charge
-- `cost`; n > 0: take every unit there is up to n, at least `cost`), optionally followed by
-- ":<units>@<time>": units of a lease that expired unspent, charged at <time>, given back
-- (refunded into the window of <time>, if it still counts) before the charge is checked.
--
-- Returns an array of integers: the time of the call, then per charge: remaining, reset,
-- retry_after (0 when admitted; -1: never), window, and for a lease the units taken (0 unless
-- admitted). For "R", per run: the number admitted, the first admitted request's remaining,
-- reset and window (if one was), the first denied request's four numbers (if one was); each
-- later request admitted has `cost` less remaining and a reset `cost` intervals later, and each
-- later one denied the same numbers (see `charge_run`). A request that is not charged (denied,
-- or a peek) reports every rule's budget as it stands: a rule that would admit it is checked
-- again at cost 0 for its numbers. A refund returns only the time.
--
-- A server spends more on each argument, table, call and number written as text here than on
-- anything else: hence one argument per charge (one per batch when they are all the same),
-- parsed once, a request of one charge decided without tables, integers answered as integers
-- (Redis writes them itself; Lua would format each one as a double), in a batch each key of
-- one number (token bucket, GCRA) read and written once (`hold`, `release`), and a hot key's
-- requests of one batch decided and answered as a run.
local ALGORITHMS = {
  tb = TokenBucket,
  gcra = Gcra,
  fw = FixedWindow,
  sl = SlidingLog,
  sc = SlidingCounter,
  cc = Concurrency,
}

-- Charges by their text, parsed once: a function library keeps this table between calls (the
-- script form starts each call without it). Bounded: emptied when it holds too many.
local CHARGES, CHARGES_LEN = {}, 0
local function charge_of(text)
  local c = CHARGES[text]
  if c == nil then
    local algorithm, limit, period, burst, interval, cost, lease, give, given =
      string.match(text, '^(%a+):(%d+):(%d+):(%d+):(%d+):(%d+):(%d+):?(%d*)@?(%d*)$')
    c = {
      algorithm = ALGORITHMS[algorithm],
      cost = tonumber(cost),
      limits = {
        limit = tonumber(limit),
        period = tonumber(period),
        burst = tonumber(burst),
        interval = tonumber(interval),
      },
      lease = tonumber(lease),
      capacity = 0,
    }
    c.capacity = c.algorithm.capacity(c.limits)
    if give ~= nil and give ~= '' then
      -- A give-back is of one call: not kept.
      c.give, c.given = tonumber(give), tonumber(given)
      return c
    end
    if CHARGES_LEN >= 1024 then
      CHARGES, CHARGES_LEN = {}, 0
    end
    CHARGES[text] = c
    CHARGES_LEN = CHARGES_LEN + 1
  end
  return c
end

-- Checks one charge against its key's state: the state (and whether the key holds another
-- algorithm's value), the units to take, then remaining, reset, retry_after, window.
local function check_charge(key, c, now)
  local A, l = c.algorithm, c.limits
  local state, other = A.load(key, l, now)
  if c.cost > c.capacity then
    -- Algorithm::check: a cost above the capacity is never admitted.
    local _, remaining, reset, _, window = A.check(l, state, now, 0)
    return state, other, c.cost, remaining, reset, -1, window
  end
  local take = c.cost
  if c.lease > 0 then
    -- Algorithm::lease_take: the units there are, at most the lease, at least the cost (at
    -- cost 0, a refill ahead of need: possibly none).
    local _, available = A.check(l, state, now, 0)
    take = max(min(c.lease, available), take)
  end
  local _, remaining, reset, retry, window = A.check(l, state, now, take)
  return state, other, take, remaining, reset, retry, window
end

-- Gives back the units of a charge's expired lease (none for most charges).
local function give_back(key, c, now)
  if c.give ~= nil then
    c.algorithm.refund(key, c.limits, now, c.give, c.given)
  end
end

-- Appends a charge's numbers to `out` after position `len`; the new length.
local function answer(out, len, c, remaining, reset, retry, window)
  out[len + 1] = remaining
  out[len + 2] = reset
  out[len + 3] = retry
  out[len + 4] = window
  if c.lease > 0 then
    out[len + 5] = 0
    return len + 5
  end
  return len + 4
end

-- The working values of each charge of a request of several, one table per position, reused
-- from request to request and (in a function library) from call to call: a call never runs
-- while another does.
local RULES = {}

-- Checks and charges one request of one charge `c` on `key`: appends its numbers to `out` after
-- position `len`; the new length.
local function charge_one(key, c, now, out, len)
  give_back(key, c, now)
  local state, other, take, remaining, reset, retry, window = check_charge(key, c, now)
  local at = len
  len = answer(out, len, c, remaining, reset, retry, window)
  if retry == 0 then
    c.algorithm.commit(key, c.limits, state, now, take, reset, other)
    if c.lease > 0 then
      out[at + 5] = take
    end
  end
  return len
end

-- Checks and charges `count` requests in a row of the one charge `c` on `key` (a hot key's
-- batch), for an algorithm whose state is one number (`after`): the state is carried from one
-- check to the next instead of stored and read again, and written once, by the commit of the
-- last check admitted (a commit of these algorithms writes `now + reset` alone). The answers
-- are alike, and told once: at one time, each check admitted takes `cost` more (`remaining`
-- goes down by `cost`, `reset` up by `cost` intervals, the window stays), and once one is
-- denied every later one is denied alike (nothing changed). Appends to `out` after position
-- `len` the number admitted, then the first admitted check's remaining, reset and window if
-- any was, then the first denied check's remaining, reset, retry_after and window if any was;
-- the new length.
local function charge_run(key, c, now, count, out, len)
  local A, l, cost = c.algorithm, c.limits, c.cost
  local state, other = A.load(key, l, now)
  local at = len + 1
  local admitted, last_reset = 0, nil
  len = at
  while admitted < count do
    local allowed, remaining, reset, retry, window = A.check(l, state, now, cost)
    if not allowed then
      out[len + 1] = remaining
      out[len + 2] = reset
      out[len + 3] = retry
      out[len + 4] = window
      len = len + 4
      break
    end
    if admitted == 0 then
      out[len + 1] = remaining
      out[len + 2] = reset
      out[len + 3] = window
      len = len + 3
    end
    admitted = admitted + 1
    state = A.after(l, now, reset)
    last_reset = reset
  end
  out[at] = admitted
  if last_reset ~= nil then
    A.commit(key, l, nil, now, cost, last_reset, other)
  end
  return len
end

-- Decides one request of `n` charges: KEYS after `k`, charge arguments after ARGV[a]. Appends
-- its numbers to `out` after position `len`; the new length.
local function request(KEYS, ARGV, mode, now, k, a, n, out, len)
  if n == 1 then
    -- One charge: no tables.
    local key, c = KEYS[k + 1], charge_of(ARGV[a + 1])
    if mode == 'c' then
      return charge_one(key, c, now, out, len)
    end
    local state, _, take, remaining, reset, retry, window = check_charge(key, c, now)
    local at = len
    len = answer(out, len, c, remaining, reset, retry, window)
    if retry == 0 and take > 0 then
      -- A peek (Algorithm::uncharged): the budget as it stands.
      local _, remaining, reset, _, window = c.algorithm.check(c.limits, state, now, 0)
      answer(out, at, c, remaining, reset, 0, window)
    end
    return len
  end

  local admitted = true
  for i = 1, n do
    local key, c = KEYS[k + i], charge_of(ARGV[a + i])
    if mode == 'c' then
      give_back(key, c, now)
    end
    local state, other, take, remaining, reset, retry, window = check_charge(key, c, now)
    local r = RULES[i]
    if r == nil then
      r = {}
      RULES[i] = r
    end
    r.key, r.c, r.state, r.other, r.take, r.reset, r.allowed, r.at =
      key, c, state, other, take, reset, retry == 0, len
    admitted = admitted and retry == 0
    len = answer(out, len, c, remaining, reset, retry, window)
  end
  if not admitted or mode == 'p' then
    -- Nothing is charged (Algorithm::uncharged): the rules that would admit report their budget
    -- as it stands.
    for i = 1, n do
      local r = RULES[i]
      if r.allowed and r.take > 0 then
        local _, remaining, reset, _, window = r.c.algorithm.check(r.c.limits, r.state, now, 0)
        answer(out, r.at, r.c, remaining, reset, 0, window)
      end
    end
    return len
  end
  local written = {}
  for i = 1, n do
    local r = RULES[i]
    local A, l = r.c.algorithm, r.c.limits
    local state, other, reset = r.state, r.other, r.reset
    if written[r.key] then
      -- An earlier charge of this request already changed this key: read it again (commit
      -- takes the reset of a check of the state it charges).
      state, other = A.load(r.key, l, now)
      local _
      _, _, reset = A.check(l, state, now, r.take)
    end
    written[r.key] = true
    A.commit(r.key, l, state, now, r.take, reset, other)
    if r.c.lease > 0 then
      out[r.at + 5] = r.take
    end
  end
  return len
end

local function refund(KEYS, ARGV, at, now)
  for i = 1, #KEYS do
    local c = charge_of(ARGV[i + 1])
    c.algorithm.refund(KEYS[i], c.limits, now, c.cost, at)
  end
end

-- Adjusts charges already made, each on its own: a lease field of 1 charges `cost` more
-- whatever the budget (Algorithm::force), 0 gives `cost` back (Algorithm::refund, of units
-- charged at `at`).
local function adjust(KEYS, ARGV, at, now)
  if at == 0 then
    at = now
  end
  for i = 1, #KEYS do
    local c = charge_of(ARGV[i + 1])
    if c.lease == 1 then
      local state, other = c.algorithm.load(KEYS[i], c.limits, now)
      c.algorithm.force(KEYS[i], c.limits, state, now, c.cost, other)
    else
      c.algorithm.refund(KEYS[i], c.limits, now, c.cost, at)
    end
  end
end

local function check(KEYS, ARGV)
  if call == nil then
    bind()
  end
  -- A call that failed midway (a function library keeps its locals) left nothing held.
  HELD, HELD_EXPIRY = nil, nil
  local mode = ARGV[1]
  local now = nil
  if SERVER_CLOCK then
    now = clock()
  end
  if mode == 'c' or mode == 'p' then
    -- The common call, one request with the server's time: sized for one charge.
    local out = { now, 0, 0, 0, 0 }
    local len = request(KEYS, ARGV, mode, now, 0, 1, #KEYS, out, 1)
    for i = len + 1, 5 do
      out[i] = nil
    end
    return out
  end
  if mode == 'b' then
    -- A batch of requests of one charge each, with the server's time: no counts, and one
    -- charge for every key when they share it.
    local out = { now }
    local len = 1
    local shared = #ARGV == 2 and charge_of(ARGV[2])
    hold(KEYS)
    for i = 1, #KEYS do
      len = charge_one(KEYS[i], shared or charge_of(ARGV[i + 1]), now, out, len)
    end
    release()
    return out
  end
  if mode == 'R' then
    -- Runs of requests of one charge, with the server's time: ARGV[2] the charge, then each
    -- key's number of requests in a row.
    local c = charge_of(ARGV[2])
    if c.algorithm.after == nil or c.lease > 0 or c.give ~= nil or c.cost > c.capacity then
      return redis.error_reply('ERR tollgate: runs of this charge are not supported')
    end
    local out = { now }
    local len = 1
    hold(KEYS)
    for i = 1, #KEYS do
      len = charge_run(KEYS[i], c, now, tonumber(ARGV[i + 2]), out, len)
    end
    release()
    return out
  end
  if mode ~= 'B' then
    local letter, at, given = string.match(mode, '^(%a)(%d*)@?(%d*)$')
    now = now or tonumber(given)
    if letter == 'r' then
      refund(KEYS, ARGV, tonumber(at), now)
      return now
    end
    if letter == 'a' then
      adjust(KEYS, ARGV, tonumber(at), now)
      return now
    end
    if letter == 'x' then
      -- Reset: every key of the call, as if never charged.
      for i = 1, #KEYS do
        call('DEL', KEYS[i])
      end
      return now
    end
    local out = { now }
    request(KEYS, ARGV, letter, now, 0, 1, #KEYS, out, 1)
    return out
  end
  local out = { now or 0 }
  local len, a, k = 1, 1, 0
  hold()
  while a < #ARGV do
    local n = tonumber(ARGV[a + 1])
    if n == nil then
      -- "<n>@<time>": a request that brings its time (an injected clock).
      local count, given = string.match(ARGV[a + 1], '^(%d+)@(%d+)$')
      n, now = tonumber(count), tonumber(given)
      out[1] = now
    end
    len = request(KEYS, ARGV, 'c', now, k, a + 1, n, out, len)
    a, k = a + 1 + n, k + n
  end
  release()
  return out
end
