-- tollgate: the time source of stores built with an injected clock (tests and simulations only):
-- each request brings its time. Keys still expire on the server's clock, so they get an hour of
-- slack to outlive any simulated time that does not move with the wall clock.
local SERVER_CLOCK = false
local function clock()
  return nil
end
local EXPIRY_SLACK_MS = 3600000
