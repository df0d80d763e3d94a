-- Lineage lookup in one round trip (session_server/store/redis.py).
-- KEYS: meta, turns, index, parents.
-- ARGV: the caller's incarnation ('' = none), the ids of the records the caller holds as a
--       little-endian bitmap (bit id % 8 of byte id // 8), the reply keys as the uint32
--       little-endian end offsets of each in the next argument and their concatenation
--       (one argument, not one per key: packing arguments costs the client per argument),
--       [input_key].
-- Reply: false when the session does not exist, else the flat array
--   turn_count, incarnation ('' = none), finished (1 or 0), matched (1-based, 0 = none),
--   children of the match,
--   n, path ids root-first (n of them),
--   retry_id (0 = none), m, ids of retry_id's path root-first ending with retry_id (m),
--   then id, record, id, record ... once for every record on either path that the caller
--   does not hold (every record when the caller's incarnation is not the session's).
local meta, turns, index, parents = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
if redis.call('EXISTS', meta) == 0 then
  return false
end
local fields = redis.call('HMGET', meta, 'turns', 'inc')
local turn_count = tonumber(fields[1])
-- Sessions created before incarnations existed have none: no cache can vouch for them.
local incarnation = fields[2] or ''
local held = ''
if ARGV[1] ~= '' and ARGV[1] == incarnation then
  held = ARGV[2]
end
local key_ends, key_blob = ARGV[3], ARGV[4]
local n = #key_ends / 4
local records = {}
local listed = {}
local blobs = {}

local function reply_key(i)
  local first = 1
  if i > 1 then
    first = struct.unpack('<I4', key_ends, 4 * i - 7) + 1
  end
  return string.sub(key_blob, first, (struct.unpack('<I4', key_ends, 4 * i - 3)))
end

local function is_held(id)
  local byte = string.byte(held, math.floor(id / 8) + 1)
  return byte ~= nil and bit.band(byte, bit.lshift(1, id % 8)) ~= 0
end

local function record_of(id)
  local record = blobs[id]
  if not record then
    record = redis.call('HGET', turns, id)
    if not record then
      error('turn ' .. id .. ' of ' .. meta .. ' is missing')
    end
    blobs[id] = record
  end
  return record
end

-- Appends #path and the root-first ids of the path ending at `id` to `out`. The walk reads
-- the small parents hash, so a record the caller holds is never copied, even in here.
local function add_path(id, out)
  local chain = {}
  while id ~= 0 do
    if #chain >= turn_count then
      error('parent pointers of ' .. meta .. ' form a cycle')
    end
    chain[#chain + 1] = id
    if not listed[id] and not is_held(id) then
      listed[id] = true
      records[#records + 1] = id
      records[#records + 1] = record_of(id)
    end
    local parent = redis.call('HGET', parents, id)
    if parent then
      id = tonumber(parent)
    else
      -- Sessions stored before the parents hash: the parent id is also the little-endian
      -- uint32 at byte 2 of the record (codec.py); 0 = root.
      id = struct.unpack('<I4', record_of(id), 2)
    end
  end
  out[#out + 1] = #chain
  for i = #chain, 1, -1 do
    out[#out + 1] = chain[i]
  end
end

-- Deepest key first: the usual hit is one of the last keys, so this stops early.
local reply = {turn_count, incarnation, redis.call('HEXISTS', meta, 'fin'), 0, 0}
local hit = 0
for i = n, 1, -1 do
  local id = redis.call('HGET', index, reply_key(i))
  if id then
    hit = tonumber(id)
    reply[4] = i
    reply[5] = tonumber(redis.call('HGET', parents, 'c' .. id) or '0')
    break
  end
end
add_path(hit, reply)

local retry = 0
if ARGV[5] then
  retry = tonumber(redis.call('HGET', index, ARGV[5]) or '0')
end
reply[#reply + 1] = retry
add_path(retry, reply)

for i = 1, #records do
  reply[#reply + 1] = records[i]
end
return reply
