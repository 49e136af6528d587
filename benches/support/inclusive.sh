#!/bin/sh
# The inclusive instructions per request of one function (and all it calls) in one case of
# benches/instructions.rs: callgrind counts only inside functions matching PATTERN
# (--toggle-collect), in a run of 2,500 requests and one of 500; per request is the difference
# over 2,000, as the probe's own figures are.
#
#   sh benches/support/inclusive.sh redis:new-key 'tower_idempotency::store::redis::RedisStore::redis_key'
#   sh benches/support/inclusive.sh memory:new-key 'tower_idempotency::fingerprint::Fingerprint::of'
#
# PATTERN is callgrind's: a demangled symbol name, `*` and `?` as wildcards (list the names with
# callgrind_annotate on a full profile of the case). Counting restarts at each entry of a
# matching function, so a pattern must not match a function and one that it calls.
set -eu
[ $# -eq 2 ] || { echo "usage: $0 CASE PATTERN" >&2; exit 2; }
cd "$(dirname "$0")/../.."
exe=$(cargo bench -p benches --bench instructions --no-run --message-format=json 2>/dev/null \
    | sed -n 's/.*"executable":"\([^"]*instructions[^"]*\)".*/\1/p' | tail -n 1)
[ -n "$exe" ] || { echo "$0: cannot build benches/instructions.rs" >&2; exit 1; }
count() {
    PROBE="$1:$2" valgrind --tool=callgrind --collect-atstart=no --toggle-collect="$3" \
        --callgrind-out-file=/dev/null "$exe" 2>&1 >/dev/null \
        | sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
}
few=$(count "$1" 500 "$2")
many=$(count "$1" 2500 "$2")
echo "$1 | $2 | $(( (many - few) / 2000 )) Ir per request"
