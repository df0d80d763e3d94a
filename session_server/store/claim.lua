-- Claim an Idempotency-Key of a session (session_server/store/redis.py).
-- KEYS: meta, index.  ARGV: key, fingerprint, owner, now (unix seconds), stale_after_s.
-- Reply: false when the session does not exist, else {'done', turn_id} |
--   {'pending', fingerprint} | {'owned'}. The claim 'idp:<key>' = 'since|owner|fingerprint'
-- lives in the session's index hash: same TTL, deleted with the session.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return false
end
local key, fingerprint, owner, now = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local done = redis.call('HGET', KEYS[2], 'idem:' .. key)
if done then
  return {'done', tonumber(done)}
end
local pending = redis.call('HGET', KEYS[2], 'idp:' .. key)
if pending then
  local since, holder, held_fingerprint = string.match(pending, '^([^|]*)|([^|]*)|(.*)$')
  if holder ~= owner and now - tonumber(since) < tonumber(ARGV[5]) then
    return {'pending', held_fingerprint}
  end
end
redis.call('HSET', KEYS[2], 'idp:' .. key, ARGV[4] .. '|' .. owner .. '|' .. fingerprint)
return {'owned'}
