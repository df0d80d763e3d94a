-- Record an abort (session_server/store/redis.py): the session's generations that started at
-- or before ARGV[2] are cut on every server. KEYS: aborts (sorted set: session id -> time).
-- ARGV: session id, abort time (unix seconds), horizon (aborts older than this are dropped).
local held = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not held or tonumber(held) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[3])
return 1
