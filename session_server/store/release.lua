-- Drop an owner's pending Idempotency-Key claim (session_server/store/redis.py).
-- KEYS: index.  ARGV: key, owner.  Reply: 1 if dropped, else 0.
local pending = redis.call('HGET', KEYS[1], 'idp:' .. ARGV[1])
if pending and string.find(pending, '|' .. ARGV[2] .. '|', 1, true) then
  return redis.call('HDEL', KEYS[1], 'idp:' .. ARGV[1])
end
return 0
