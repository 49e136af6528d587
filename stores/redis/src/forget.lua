-- Forgets a record for an operator: deletes it, unless it is in flight (kind byte 1) and
-- ARGV[1] is not '1' (forced). Returns whether it deleted it, then what inspect.lua returns of
-- the record as it was. KEYS[1] the record. Nil when the key has no record.
-- The next claim takes its fence from the clock, as after the record's expiry (claim.lua): the
-- fence of a claim never counted on the record before it.
local record = redis.call('GET', KEYS[1])
if not record then
  return false
end
local now = redis.call('TIME')
local ttl = redis.call('PTTL', KEYS[1])
local forgotten = 0
if string.byte(record, 2) ~= 1 or ARGV[1] == '1' then
  redis.call('DEL', KEYS[1])
  forgotten = 1
end
return {forgotten, record, ttl, now[1], now[2]}
