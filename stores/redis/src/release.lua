-- Releases a claim: deletes the in-flight record, if it still carries the claim's token.
-- KEYS[1] the record; ARGV[1] the token (16 bytes). Matched by the token's unique half (bytes
-- 9..16; the record's 11..18), so that a claim whose answer was lost, and with it the fence
-- Redis gave it, is released all the same.
local record = redis.call('GET', KEYS[1])
if not record or string.byte(record, 2) ~= 1 or string.sub(record, 11, 18) ~= string.sub(ARGV[1], 9, 16) then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
