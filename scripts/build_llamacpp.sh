#!/usr/bin/env bash
# Build llama-cpp-python (llama.cpp's Python binding) from PyPI's source distribution for THIS machine's CPU and
# install it into the active virtual environment. bench/decode.py uses it for its llama.cpp columns (Q4_0 / Q8_0 /
# F32); nothing else in LayerZero needs it, and CI does not build it (the bench's tests skip those columns).
#
# The wheel is cached in $LLAMACPP_WHEEL_DIR (default /work/cache/wheels): when one is there it is installed as it is
# (a build takes ~11 minutes of two cores). The source distribution is kept in $LLAMACPP_SDIST_DIR (default
# /work/cache/sdist): its vendor/llama.cpp carries convert_hf_to_gguf.py, which bench/_llamacpp.py runs.
#
# GGML_NATIVE=ON builds for the host's instruction set (AVX-512 and VNNI where the CPU has them); AMX is switched off
# because the toolchain's assembler / this kernel's AMX permission are not dependable here.
set -euo pipefail
WHEELS=${LLAMACPP_WHEEL_DIR:-/work/cache/wheels}
SDIST=${LLAMACPP_SDIST_DIR:-/work/cache/sdist}
PY=${PYTHON:-python}
mkdir -p "$WHEELS" "$SDIST"

if ! ls "$SDIST"/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    "$PY" -m pip download --no-deps --no-binary llama-cpp-python llama-cpp-python -d "$SDIST"
fi

wheel=$(ls -t "$WHEELS"/llama_cpp_python-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
    NOAMX='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'
    export CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$NOAMX' -DCMAKE_CXX_FLAGS='$NOAMX'"
    export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
    sdist=$(ls -t "$SDIST"/llama_cpp_python-*.tar.gz | head -n 1)
    nice -n 10 "$PY" -m pip wheel --no-deps --no-binary llama-cpp-python "$sdist" -w "$WHEELS"
    wheel=$(ls -t "$WHEELS"/llama_cpp_python-*.whl | head -n 1)
fi
"$PY" -m pip install --no-deps "$wheel"
# llama_cpp's own runtime dependencies (small, pure Python), and the converter's.
"$PY" -m pip install numpy typing-extensions diskcache jinja2 gguf
"$PY" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
