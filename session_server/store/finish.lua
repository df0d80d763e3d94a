-- Mark a session finished unless it is already (session_server/store/redis.py).
-- KEYS: meta.  ARGV: packed Finish.
-- Reply: 'ok' | 'gone' | 'done' (finished before; nothing changed).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 'gone'
end
if redis.call('HSETNX', KEYS[1], 'fin', ARGV[1]) == 0 then
  return 'done'
end
return 'ok'
