-- One read on a session key, with the existence check (session_server/store/redis.py).
-- KEYS: meta, the key to read.  ARGV: the command, its arguments after the key.
-- Reply: false when the session does not exist, else {1, the command's reply}.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return false
end
return {1, redis.call(ARGV[1], KEYS[2], unpack(ARGV, 2))}
