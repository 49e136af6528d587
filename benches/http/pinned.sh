#!/bin/sh
# benches/http/main.rs with the server pinned to one core, and wrk and the stores to the other:
#
#   sh benches/http/pinned.sh                      # server on CPU 0, wrk and the stores on CPU 1
#   SERVER_CPU=1 CLIENT_CPU=0 sh benches/http/pinned.sh
#
# The bench's own knobs (BENCH_SECONDS, BENCH_ROUNDS, ...) pass through; BENCH_SERVER_THREADS
# defaults to 1, the one core the server has. On two shared cores the load generator takes CPU
# from the server it measures; pinned, each side has a core of its own, so a ratio compares the
# servers' CPU alone (wrk and the stores still share theirs).
#
# How: the bench finds wrk, redis-server and PostgreSQL's binaries on PATH (then, for PostgreSQL,
# under /usr/lib/postgresql), so this script puts first on PATH small wrappers that start each
# on CLIENT_CPU (`taskset`; children inherit it: PostgreSQL's backends too), and runs the bench
# itself on SERVER_CPU. The bench is built first, unpinned.
set -eu

SERVER_CPU=${SERVER_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-1}
cd "$(dirname "$0")/../.."

cargo bench -p benches --bench http --no-run

wrappers=$(mktemp -d)
trap 'rm -rf "$wrappers"' EXIT
# PostgreSQL runs as the `postgres` user when the bench runs as root: it must read the wrappers.
chmod 755 "$wrappers"

wrap() { # wrap NAME REAL_PATH
    printf '#!/bin/sh\nexec taskset -c %s %s "$@"\n' "$CLIENT_CPU" "$2" > "$wrappers/$1"
    chmod 755 "$wrappers/$1"
}
for tool in wrk redis-server; do
    real=$(command -v "$tool") || { echo "pinned.sh: $tool is not on PATH" >&2; exit 1; }
    wrap "$tool" "$real"
done
# The fixture wants initdb and postgres side by side; the newest installed version, as it picks.
pg_bin=$(dirname "$(command -v initdb 2>/dev/null || ls -d /usr/lib/postgresql/*/bin/initdb | sort -V | tail -n 1)")
for tool in initdb postgres; do
    wrap "$tool" "$pg_bin/$tool"
done

echo "server on CPU $SERVER_CPU; wrk, redis-server and postgres on CPU $CLIENT_CPU"
PATH="$wrappers:$PATH" BENCH_SERVER_THREADS=${BENCH_SERVER_THREADS:-1} \
    taskset -c "$SERVER_CPU" cargo bench -p benches --bench http
