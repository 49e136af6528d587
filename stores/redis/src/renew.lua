-- Renews a claim's lease, if the record still carries the claim's token.
-- KEYS[1] the record; ARGV[1] the token (16 bytes), ARGV[2] the lease in ms.
-- The new lease end (unix ms, little-endian, the record's last 8 bytes) comes from Redis's clock,
-- as the key's expiry does (see claim.lua).
local record = redis.call('GET', KEYS[1])
if not record or string.byte(record, 2) ~= 1 or string.sub(record, 3, 18) ~= ARGV[1] then
  return 0
end
local now = redis.call('TIME')
local ends = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) + tonumber(ARGV[2])
local lease_end = ''
for _ = 1, 8 do
  lease_end = lease_end .. string.char(ends % 256)
  ends = math.floor(ends / 256)
end
redis.call('SET', KEYS[1], string.sub(record, 1, 50) .. lease_end, 'PX', ARGV[2])
return 1
