-- Lineage lookup in one round trip (session_server/store/redis.py).
-- KEYS: meta, turns, index.  ARGV: n, reply_key_1 .. reply_key_n, [input_key]
-- Reply: false when the session does not exist, else the flat array
--   turn_count, matched (1-based, 0 = none), n, path ids root-first (n of them),
--   retry_id (0 = none), m, ids of retry_id's path root-first ending with retry_id (m),
--   then id, record, id, record ... once for every record on either path.
local meta, turns, index = KEYS[1], KEYS[2], KEYS[3]
if redis.call('EXISTS', meta) == 0 then
  return false
end
local turn_count = tonumber(redis.call('HGET', meta, 'turns'))
local n = tonumber(ARGV[1])
local records = {}
local fetched = {}

-- Appends #path and the root-first ids of the path ending at `id` to `out`.
local function add_path(id, out)
  local chain = {}
  while id ~= 0 do
    if #chain >= turn_count then
      error('parent pointers of ' .. meta .. ' form a cycle')
    end
    chain[#chain + 1] = id
    local record = fetched[id]
    if not record then
      record = redis.call('HGET', turns, id)
      if not record then
        error('turn ' .. id .. ' of ' .. meta .. ' is missing')
      end
      fetched[id] = record
      records[#records + 1] = id
      records[#records + 1] = record
    end
    -- A record's parent id is the little-endian uint32 at byte 2 (codec.py); 0 = root.
    id = struct.unpack('<I4', record, 2)
  end
  out[#out + 1] = #chain
  for i = #chain, 1, -1 do
    out[#out + 1] = chain[i]
  end
end

-- Deepest key first: the usual hit is one of the last keys, so this stops early.
local reply = {turn_count, 0}
local hit = 0
for i = n, 1, -1 do
  local id = redis.call('HGET', index, ARGV[i + 1])
  if id then
    hit = tonumber(id)
    reply[2] = i
    break
  end
end
add_path(hit, reply)

local retry = 0
if ARGV[n + 2] then
  retry = tonumber(redis.call('HGET', index, ARGV[n + 2]) or '0')
end
reply[#reply + 1] = retry
add_path(retry, reply)

for i = 1, #records do
  reply[#reply + 1] = records[i]
end
return reply
