#!/usr/bin/env bash
# Instructions per memory-store decision (tollgate against governor's keyed limiter) and per
# in-process axum request (bare, tollgate, tower_governor), counted by callgrind: repeatable on a
# busy machine, unlike time. See benches/instructions.rs.
#
#   ./scripts/instructions.sh                  # 1,000,000 decisions and 20,000 requests per case
#   N=200000 REQUESTS=5000 STACKED=100000 ./scripts/instructions.sh
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
    local count=$1
    shift
    local setup total
    setup=$(refs "$@" 0)
    total=$(refs "$@" "$count")
    awk -v t="$total" -v s="$setup" -v n="$count" 'BEGIN { printf "%.1f", (t - s) / n }'
}

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
