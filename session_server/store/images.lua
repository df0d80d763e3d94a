-- Keep a session's images (session_server/store/redis.py), once per content hash.
-- KEYS: meta, images.  ARGV: sha256, bytes, sha256, bytes...  Reply: 0 if no such session.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
for i = 1, #ARGV, 2 do
  redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1])
end
-- The images expire with the session: its remaining time, refreshed on every write.
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return 1
