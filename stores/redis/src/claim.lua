-- Claims a key: writes the in-flight record for the lease if the key has none, numbering the
-- claim with a fence from Redis's own clock (microseconds since the Unix epoch). Returns the record
-- now under the key: this claim's, or the one that was already there, unchanged.
-- KEYS[1] the record; ARGV[1] the in-flight record with a zero fence (its token's bytes 1..8, the
-- record's 3..10) and a lease end Redis stamps again (its last 8 bytes), ARGV[2] the lease in ms.
-- An in-flight key expires with its lease, so no earlier claim is there to count on: the clock
-- alone numbers claims. It survives Redis forgetting a key (a restart) while the server's clock
-- does not go back, and a failover while the new primary's clock is not behind the old one's.
local record = redis.call('GET', KEYS[1])
if record then
  return record
end
local now = redis.call('TIME')
local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
-- Big-endian; exact, since it stays below 2^53.
local fence = ''
for _ = 1, 8 do
  fence = string.char(micros % 256) .. fence
  micros = math.floor(micros / 256)
end
-- The lease end (unix ms, little-endian, last), from the same clock as the key's expiry: stamped
-- by the client before it sent the claim, it would be early by the claim's way to Redis, and a
-- record read then would report less of its lease left than it has.
local ends = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) + tonumber(ARGV[2])
local lease_end = ''
for _ = 1, 8 do
  lease_end = lease_end .. string.char(ends % 256)
  ends = math.floor(ends / 256)
end
record = string.sub(ARGV[1], 1, 2) .. fence .. string.sub(ARGV[1], 11, 50) .. lease_end
redis.call('SET', KEYS[1], record, 'PX', ARGV[2])
return record
