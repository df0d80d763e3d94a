-- Atomic append of the sibling turns of one request (session_server/store/redis.py).
-- KEYS: meta, turns, index, parents.
-- ARGV: token (16 hex digits, random per append), incarnation ('' = any: the append is
--       refused as 'gone' unless the session is that incarnation), n_turns, segments,
--       tokens, n_breaks,
--       break_reason x n_breaks,
--       then per turn: parent_id (0 = root), record, n_keys, key x n_keys,
--       then optionally unless_key: store nothing if that index key is stored already.
-- Reply: {'ok', first_id} | {'gone'} | {'finished'} | {'parent', parent_id} |
--        {'taken', turn_id}. A finished session ('fin' set by finish.lua) takes no turn.
-- Keys 'idem:<k>' (an Idempotency-Key's reply) replace the pending claim 'idp:<k>'.
-- The meta field 'acks' remembers the last 32 appends as token + first id (8 hex digits):
-- a client that lost the reply and sends the same append again (same token) gets the ids
-- already stored, and nothing is stored twice.
local meta, turns, index, parents = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local token = ARGV[1]
local acks = redis.call('HGET', meta, 'acks')
if acks then
  local at = string.find(acks, token, 1, true)
  if at and (at - 1) % 24 == 0 then
    return {'ok', tonumber(string.sub(acks, at + 16, at + 23), 16)}
  end
end
local state = redis.call('HMGET', meta, 'inc', 'turns')
if not state[2] or (ARGV[2] ~= '' and state[1] ~= ARGV[2]) then
  return {'gone'}
end
if redis.call('HEXISTS', meta, 'fin') == 1 then
  return {'finished'}
end
local n = tonumber(ARGV[3])
local n_breaks = tonumber(ARGV[6])
local first_turn_arg = 7 + n_breaks

-- Every check comes before the first write: Redis does not roll back a failed script.
local pos = first_turn_arg
for _ = 1, n do
  local parent = ARGV[pos]
  if parent ~= '0' and redis.call('HEXISTS', turns, parent) == 0 then
    return {'parent', parent}
  end
  pos = pos + 3 + tonumber(ARGV[pos + 2])
end
if ARGV[pos] then
  local taken = redis.call('HGET', index, ARGV[pos])
  if taken then
    return {'taken', tonumber(taken)}
  end
end

-- The turn count doubles as the id allocator: turns are never removed one by one.
local last = redis.call('HINCRBY', meta, 'turns', n)
local id = last - n
pos = first_turn_arg
for _ = 1, n do
  id = id + 1
  redis.call('HSET', turns, id, ARGV[pos + 1])
  redis.call('HSET', parents, id, ARGV[pos])
  if ARGV[pos] ~= '0' then
    -- Children per turn, under 'c<id>' in the same hash (turn ids are plain integers).
    redis.call('HINCRBY', parents, 'c' .. ARGV[pos], 1)
  end
  local n_keys = tonumber(ARGV[pos + 2])
  for k = 1, n_keys do
    local key = ARGV[pos + 2 + k]
    if string.sub(key, 1, 5) == 'idem:' then
      redis.call('HDEL', index, 'idp:' .. string.sub(key, 6))
    end
    redis.call('HSETNX', index, key, id)
  end
  pos = pos + 3 + n_keys
end
redis.call('HINCRBY', meta, 'segments', ARGV[4])
redis.call('HINCRBY', meta, 'tokens', ARGV[5])
for b = 1, n_breaks do
  redis.call('HINCRBY', meta, 'b:' .. ARGV[6 + b], 1)
end

local ttl_ms = redis.call('HGET', meta, 'ttl_ms')
if ttl_ms then
  for _, key in ipairs(KEYS) do
    redis.call('PEXPIRE', key, ttl_ms)
  end
end
redis.call('HSET', meta, 'acks',
  token .. string.format('%08x', last - n + 1) .. string.sub(acks or '', 1, 24 * 31))
return {'ok', last - n + 1}
