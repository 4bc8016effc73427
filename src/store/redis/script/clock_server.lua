-- tollgate: the time source of production code: the server's TIME, read once per call before
-- any write.
local SERVER_CLOCK = true
local function clock()
  local t = redis.call('TIME')
  return _G.tonumber(t[1]) * 1000000 + _G.tonumber(t[2])
end
-- Slack added to every expiry, in milliseconds: none, the keys live exactly their `reset`.
local EXPIRY_SLACK_MS = 0
