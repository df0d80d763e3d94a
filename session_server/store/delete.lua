-- Delete a session and all its keys (session_server/store/redis.py).
-- KEYS: meta, turns, index, parents, images.  Reply: 1 if the session existed, else 0.
local existed = redis.call('EXISTS', KEYS[1])
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
return existed
