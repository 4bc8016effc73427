-- tollgate: the script form (EVALSHA), for servers without functions. Redis 7 advances the time
-- within a script, and Redis before 5 needs effects replication to read it.
if redis.replicate_commands then redis.replicate_commands() end
