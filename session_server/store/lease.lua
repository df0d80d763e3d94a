-- Take or extend a lease: KEYS[1] the lease, ARGV[1] the owner, ARGV[2] its time to live (ms).
-- 1 if the owner holds it now, 0 while another owner does.
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[2]))
return 1
