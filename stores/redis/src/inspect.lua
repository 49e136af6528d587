-- Reads a record for an operator, writing nothing: its bytes, the milliseconds its key has left,
-- and Redis's clock (seconds, microseconds), so that the expiry is told on the store's clock.
-- KEYS[1] the record. Nil when the key has no record.
local record = redis.call('GET', KEYS[1])
if not record then
  return false
end
local now = redis.call('TIME')
return {record, redis.call('PTTL', KEYS[1]), now[1], now[2]}
