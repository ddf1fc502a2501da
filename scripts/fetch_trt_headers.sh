#!/usr/bin/env bash
# Fetch real TensorRT 10.14 headers for compile checks and the CPU lifecycle harness (tests only).
#
#   bash scripts/fetch_trt_headers.sh [DEST]      # default DEST: ${XDG_CACHE_HOME:-~/.cache}/layerzero/trt-headers-10.14
#
# NVIDIA publishes no headers-only package on PyPI; the third-party wheel kernel-lens==2.0.1 carries TensorRT
# 10.14.1.48's headers in kernel_lens/include/tensorrt/ (7 of its 11 headers are byte-identical to NVIDIA's;
# NvInferPlugin.h is a stub, which the plugin does not include). The wheel is pinned by version AND sha256
# (pip --require-hashes, then checked again here); nothing of it is installed or imported, only the headers are
# extracted, to DEST/include. Prints DEST/include on success. Exit 0: ok; 1: download or hash failed.
set -euo pipefail
VERSION=2.0.1
SHA256=07cc714e8b5e7f34b672f7c7fad93febe7c747be5837ba276b1527370134ffe0
WHEEL=kernel_lens-${VERSION}-py3-none-any.whl
DEST=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/layerzero/trt-headers-10.14}
PY=${PYTHON:-python3}

if [ -f "$DEST/include/NvInferRuntime.h" ] && [ "$(cat "$DEST/wheel.sha256" 2>/dev/null)" = "$SHA256" ]; then
    echo "$DEST/include"
    exit 0
fi
mkdir -p "$DEST"
TMP=$(mktemp -d "$DEST/.fetch.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
echo "kernel-lens==${VERSION} --hash=sha256:${SHA256}" > "$TMP/requirements.txt"
if ! "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary :all: --require-hashes \
        -r "$TMP/requirements.txt" -d "$TMP" >&2; then
    echo "fetch_trt_headers: pip download kernel-lens==${VERSION} failed (no network to PyPI?)" >&2
    exit 1
fi
GOT=$(sha256sum "$TMP/$WHEEL" | cut -d' ' -f1)
if [ "$GOT" != "$SHA256" ]; then
    echo "fetch_trt_headers: $WHEEL has sha256 $GOT, expected $SHA256" >&2
    exit 1
fi
"$PY" - "$TMP/$WHEEL" "$TMP/include" <<'PYEOF'
import pathlib, sys, zipfile
wheel, out = sys.argv[1], pathlib.Path(sys.argv[2])
out.mkdir(parents=True)
prefix = "kernel_lens/include/tensorrt/"
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(prefix) and n.endswith(".h")]
    for n in names:
        (out / n[len(prefix):]).write_bytes(z.read(n))
if not (out / "NvInferRuntime.h").is_file():
    sys.exit(f"fetch_trt_headers: {wheel} holds no {prefix}NvInferRuntime.h")
PYEOF
rm -rf "$DEST/include"
mv "$TMP/include" "$DEST/include"
echo "$SHA256" > "$DEST/wheel.sha256"
echo "$DEST/include"
