-- tollgate: the time source of production scripts. TIME is read once, before any write (Redis 7
-- advances the time within a script, and Redis before 5 needs effects replication for it).
if redis.replicate_commands then redis.replicate_commands() end
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
-- Slack added to every expiry, in milliseconds: none, the keys live exactly their `reset`.
local EXPIRY_SLACK_MS = 0
