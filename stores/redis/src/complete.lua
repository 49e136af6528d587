-- Completes a claim: replaces the in-flight record with the completed one, kept for the dedup
-- window, if the record still carries the claim's token, or writes it where the key has no record
-- (the claim's lease ran out and nobody claimed the key since: the work did run).
-- KEYS[1] the record; ARGV[1] the token (16 bytes), ARGV[2] the completed record, ARGV[3] ttl ms.
-- A completion sent again finds its own record and succeeds.
-- An in-flight record is: version (1) kind (1 = in flight) token (16) fingerprint (32) lease end (8).
local record = redis.call('GET', KEYS[1])
-- This completion, sent again (a connection dropped before its answer): already done.
if record == ARGV[2] then
  return 1
end
if record and (string.byte(record, 2) ~= 1 or string.sub(record, 3, 18) ~= ARGV[1]) then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
