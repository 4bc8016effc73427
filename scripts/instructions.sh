#!/usr/bin/env bash
# Instructions per memory-store decision (tollgate against governor's keyed limiter) and per
# in-process axum request (bare, tollgate, tower_governor), counted by callgrind: repeatable on a
# busy machine, unlike time. See benches/instructions.rs.
#
#   ./scripts/instructions.sh                  # 1,000,000 decisions and 20,000 requests per case
#   N=200000 REQUESTS=5000 STACKED=100000 ./scripts/instructions.sh
#   REDIS=1 ./scripts/instructions.sh          # also requests through the Redis store (below)
#   ONLY=redis REDIS=1 ./scripts/instructions.sh   # only those
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v valgrind >/dev/null; then
    echo "error: valgrind is not installed (Debian: apt-get install valgrind)" >&2
    exit 1
fi
n=${N:-1000000}
requests=${REQUESTS:-20000}
# The bench binary's path carries a hash: ask cargo for it.
bin=$(cargo bench --quiet --bench instructions --no-run --message-format=json 2>/dev/null |
    sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
    echo "error: cargo bench --bench instructions --no-run did not build the driver" >&2
    exit 1
fi

refs() { # arguments of the example -> instructions of the whole run
    local out
    if ! out=$(valgrind --tool=callgrind --callgrind-out-file=/dev/null "$bin" "$@" 2>&1); then
        echo "error: instructions $* failed under valgrind:" >&2
        echo "$out" >&2
        exit 1
    fi
    awk '/Collected/ { print $NF }' <<<"$out"
}

per() { # count, then the example's arguments without the count -> instructions per unit
    # Only the counted calls (`counted`, `counted_block_on` in benches/instructions.rs), after
    # their warm-up: the setup's own variation (the clock's calibration) stays out.
    local count=$1
    shift
    local out total
    if ! out=$(valgrind --tool=callgrind --callgrind-out-file=/dev/null \
        --toggle-collect=instructions::counted --toggle-collect=instructions::counted_block_on \
        "$bin" "$@" "$count" 2>&1); then
        echo "error: instructions $* $count failed under valgrind:" >&2
        echo "$out" >&2
        exit 1
    fi
    total=$(awk '/Collected/ { print $NF }' <<<"$out")
    # Nothing counted: the counted functions were renamed or inlined away, not made free.
    if [ -z "$total" ] || [ "$total" -eq 0 ]; then
        echo "error: instructions $* $count: callgrind counted nothing in instructions::counted or counted_block_on" >&2
        exit 1
    fi
    awk -v t="$total" -v n="$count" 'BEGIN { printf "%.1f", t / n }'
}

only=${ONLY:-all}
if [ "$only" = all ]; then
printf '%-18s %-22s %14s %12s\n' case limiter instr/decision vs-governor
for case in hot_key_allowed hot_key_denied 100k_keys_allowed; do
    governor=""
    for limiter in governor tollgate_token_bucket tollgate_gcra; do
        cost=$(per "$n" store "$limiter" "$case")
        [ -z "$governor" ] && governor=$cost
        ratio=$(awk -v p="$cost" -v g="$governor" 'BEGIN { printf "%.2fx", p / g }')
        printf '%-18s %-22s %14s %12s\n' "$case" "$limiter" "$cost" "$ratio"
    done
done

echo
printf '%-18s %16s %12s\n' 'stacked, 1M keys' instr/decision vs-1-rule
stacked=${STACKED:-200000}
one=""
for rules in 1 2 4; do
    cost=$(per "$stacked" stacked "$rules")
    [ -z "$one" ] && one=$cost
    ratio=$(awk -v p="$cost" -v o="$one" 'BEGIN { printf "%.2fx", p / o }')
    printf '%-18s %16s %12s\n' "$rules rules" "$cost" "$ratio"
done

echo
printf '%-22s %16s %12s %10s\n' router instr/request added vs-bare
bare=""
for router in bare tollgate_allow tollgate_reject tower_governor_allow tower_governor_reject; do
    cost=$(per "$requests" layer "$router")
    [ -z "$bare" ] && bare=$cost
    added=$(awk -v p="$cost" -v b="$bare" 'BEGIN { printf "%+.0f", p - b }')
    ratio=$(awk -v p="$cost" -v b="$bare" 'BEGIN { printf "%.2fx", p / b }')
    printf '%-22s %16s %12s %10s\n' "$router" "$cost" "$added" "$ratio"
done
fi

# METRICS=1: what recording costs. The same requests, built with the feature `metrics`: with no
# recorder installed, and with a Prometheus recorder.
if [ "${METRICS:-0}" = 1 ]; then
    bin=$(cargo bench --quiet --bench instructions --features metrics --no-run --message-format=json 2>/dev/null |
        sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)
    echo
    printf '%-22s %22s %22s %10s\n' router "metrics, no recorder" "metrics, Prometheus" "added"
    for router in tollgate_allow tollgate_reject; do
        plain=$(per "$requests" layer "$router")
        recorded=$(RECORDER=prometheus per "$requests" layer "$router")
        added=$(awk -v p="$recorded" -v b="$plain" 'BEGIN { printf "%+.1f%%", 100 * (p - b) / b }')
        printf '%-22s %22s %22s %10s\n' "$router" "$plain" "$recorded" "$added"
    done
fi

# POLICY=1: what resolving a policy of 3 tiers × 1,000 routes and 10,000 tenants costs, against
# the same kind of rule fixed in the layer (benches/support/policy_apps.rs).
if [ "${POLICY:-0}" = 1 ]; then
    bin=$(cargo bench --quiet --bench instructions --no-run --message-format=json 2>/dev/null |
        sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)
    echo
    printf '%-22s %16s %12s\n' router instr/request "vs fixed"
    for pair in "fixed_ip policy_ip" "fixed_tenant policy_tenant policy_tenant_header"; do
        fixed=""
        for router in $pair; do
            cost=$(per "$requests" policy "$router")
            [ -z "$fixed" ] && fixed=$cost
            added=$(awk -v p="$cost" -v b="$fixed" 'BEGIN { printf "%+.0f", p - b }')
            printf '%-22s %16s %12s\n' "$router" "$cost" "$added"
        done
    done
fi

# REDIS=1: requests in waves of 32 through the Redis store (benches/instructions.rs, `redis`),
# against a redis-server of this run's own on a free port, stopped at the end: this process's
# instructions per request, and Redis's own time (`INFO commandstats`, usec of FCALL and
# EVALSHA) per request and per call. With 32 requests in flight, glibc's allocator leaves its
# per-thread cache of 7 blocks a size and takes its slow paths, whose cost depends on the
# heap's history: a change anywhere (even one that allocates nothing new) moves these counts
# by a few hundred. The column "large tcache" counts the same requests with a cache of 1,000
# blocks a size (GLIBC_TUNABLES), where every allocation takes the fast path: the code's own
# cost, steady from build to build.
if [ "${REDIS:-0}" = 1 ]; then
    for tool in redis-server redis-cli; do
        command -v "$tool" >/dev/null || { echo "error: $tool is not installed (Debian: apt-get install redis-server redis-tools)" >&2; exit 1; }
    done
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no >/dev/null &
    redis_pid=$!
    trap 'kill "$redis_pid" 2>/dev/null || true' EXIT
    for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
    export REDIS_URL="redis://127.0.0.1:$port"
    commandstats() { # -> "calls usec" of tollgate's code since the last reset
        redis-cli -p "$port" info commandstats | tr -d '\r' |
            awk -F'[=,:]' '/^cmdstat_(fcall|evalsha):/ { c += $3; u += $5 } END { printf "%d %d", c, u }'
    }
    waves=${WAVES_REQUESTS:-$requests}
    waves=$(((waves + 31) / 32 * 32)) # whole waves of 32, as the driver sends them
    echo
    printf '%-24s %14s %10s %14s %10s %12s %12s %12s\n' router instr/request added "large tcache" added calls/request "redis us/req" "redis us/call"
    bare=""
    for router in bare memory_allow redis_allow redis_allow_unbatched redis_reject redis_leased \
        memory_allow_two_rules redis_allow_two_rules; do
        redis-cli -p "$port" config resetstat >/dev/null
        # A run of no counted waves, for Redis's count of the uncounted first wave.
        refs redis "$router" 0 >/dev/null
        read -r c0 u0 <<<"$(commandstats)"
        cost=$(per "$waves" redis "$router")
        read -r c1 u1 <<<"$(commandstats)"
        # The n = 0 run made calls too (its wave), and so did the counted run's first wave: only
        # the counted waves'.
        [ -z "$bare" ] && bare=$cost
        cached=$(GLIBC_TUNABLES=glibc.malloc.tcache_count=1000 per "$waves" redis "$router")
        [ -z "${bare_cached:-}" ] && bare_cached=$cached
        awk -v r="$router" -v p="$cost" -v b="$bare" -v q="$cached" -v bq="$bare_cached" -v n="$waves" -v c0="$c0" -v u0="$u0" -v c1="$c1" -v u1="$u1" 'BEGIN {
            c = c1 - 2 * c0; u = u1 - 2 * u0; per_call = c > 0 ? u / c : 0
            printf "%-24s %14s %+10.0f %14s %+10.0f %12.3f %12.2f %12.2f\n", r, p, p - b, q, q - bq, c / n, u / n, per_call }'
    done
fi
