-- Create a session unless its id is taken (session_server/store/redis.py).
-- KEYS: meta, turns, index, parents.
-- ARGV: packed SessionMeta, ttl in ms ('' = no expiry), incarnation token.
-- Reply: 1 created (by this call, or by an earlier run of it: same incarnation token, so a
-- creation retried after a lost reply or a failover is recognised), 0 taken.
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HGET', KEYS[1], 'inc') == ARGV[3] then
    return 1
  end
  return 0
end
-- The other keys of an expired session can outlive its meta key by a moment.
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
redis.call('HSET', KEYS[1], 'meta', ARGV[1], 'inc', ARGV[3], 'turns', 0, 'segments', 0, 'tokens', 0)
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], 'ttl_ms', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 1
