-- Renews a claim's lease, if the record still carries the claim's token.
-- KEYS[1] the record; ARGV[1] the token (16 bytes), ARGV[2] the new lease end (8 bytes, unix ms
-- little-endian), ARGV[3] the lease in ms.
local record = redis.call('GET', KEYS[1])
if not record or string.byte(record, 2) ~= 1 or string.sub(record, 3, 18) ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], string.sub(record, 1, 50) .. ARGV[2], 'PX', ARGV[3])
return 1
