#!/usr/bin/env bash
# Build a patched llama-server beside the pinned one, reusing the pinned build's objects (minutes, not the full build):
# the patch is applied to the installed source tree, llama-server rebuilt, the binary copied to OUT_DIR, the patch
# reverted and the pinned binaries put back. The installed llama.cpp is the pinned one again when this ends, on every
# path out.
#   bash benchmarks/llamacpp_patches/build.sh benchmarks/llamacpp_patches/keep-draft-kv.patch OUT_DIR
set -euo pipefail
PATCH=$(realpath "$1")
OUT=$(realpath -m "$2")
HOME_DIR=$(python -c "from specdrafter.core import llamacpp; print(llamacpp.home())")
SRC="$HOME_DIR/src"
BIN="$HOME_DIR/build/bin"
KEEP=$(mktemp -d)
cp "$BIN/llama-server" "$KEEP/"
restore() {
    (cd "$SRC" && patch -p1 -R --silent < "$PATCH" 2>/dev/null || true)
    cp "$KEEP/llama-server" "$BIN/llama-server"  # the pinned binary, byte for byte
    rm -rf "$KEEP"
}
trap restore EXIT
(cd "$SRC" && patch -p1 --forward < "$PATCH")
cmake --build "$HOME_DIR/build" --target llama-server -j "${JOBS:-2}"
mkdir -p "$OUT"
cp "$BIN/llama-server" "$OUT/llama-server"
echo "patched llama-server: $OUT/llama-server"
