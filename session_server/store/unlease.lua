-- Give a lease back: KEYS[1] the lease, ARGV[1] the owner (only the holder deletes it).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
end
return 1
