-- Releases a claim: deletes the in-flight record, if it still carries the claim's token.
-- KEYS[1] the record; ARGV[1] the token (16 bytes).
local record = redis.call('GET', KEYS[1])
if not record or string.byte(record, 2) ~= 1 or string.sub(record, 3, 18) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
