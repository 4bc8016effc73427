#!/usr/bin/env bash
# Instructions per memory-store decision, tollgate against governor's keyed limiter, counted by
# callgrind (repeatable on a busy machine, unlike time). See examples/decision_cost.rs.
#
#   ./scripts/instructions.sh            # 1,000,000 decisions per case
#   N=200000 ./scripts/instructions.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v valgrind >/dev/null; then
    echo "error: valgrind is not installed (Debian: apt-get install valgrind)" >&2
    exit 1
fi
n=${N:-1000000}
cargo build --quiet --release --example decision_cost
bin=${CARGO_TARGET_DIR:-target}/release/examples/decision_cost
if [ ! -x "$bin" ]; then
    echo "error: $bin was not built" >&2
    exit 1
fi

refs() { # limiter case n -> instructions of the whole run
    local out
    if ! out=$(valgrind --tool=callgrind --callgrind-out-file=/dev/null "$bin" "$1" "$2" "$3" 2>&1); then
        echo "error: decision_cost $1 $2 $3 failed under valgrind:" >&2
        echo "$out" >&2
        exit 1
    fi
    awk '/Collected/ { print $NF }' <<<"$out"
}

printf '%-18s %-22s %12s %8s\n' case limiter instr/decision vs-governor
for case in hot_key_allowed hot_key_denied 100k_keys_allowed; do
    governor=""
    for limiter in governor tollgate_token_bucket tollgate_gcra; do
        setup=$(refs "$limiter" "$case" 0)
        total=$(refs "$limiter" "$case" "$n")
        per=$(awk -v t="$total" -v s="$setup" -v n="$n" 'BEGIN { printf "%.1f", (t - s) / n }')
        [ -z "$governor" ] && governor=$per
        ratio=$(awk -v p="$per" -v g="$governor" 'BEGIN { printf "%.2fx", p / g }')
        printf '%-18s %-22s %12s %8s\n' "$case" "$limiter" "$per" "$ratio"
    done
done
