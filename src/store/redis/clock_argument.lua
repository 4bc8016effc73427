-- tollgate: the time source of stores built with an injected clock (tests and simulations only).
-- `now` comes from ARGV[2]; keys still expire on the server's clock, so they get an hour of slack
-- to outlive any simulated time that does not move with the wall clock.
local function clock()
  return tonumber(ARGV[2])
end
local EXPIRY_SLACK_MS = 3600000
