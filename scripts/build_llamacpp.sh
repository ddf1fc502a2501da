#!/usr/bin/env bash
# Build llama-cpp-python (llama.cpp's Python binding) from PyPI's source distribution for THIS machine's CPU and
# install it into the active virtual environment. bench/decode.py uses it for its llama.cpp columns (Q4_0 / Q8_0 /
# F32); nothing else in LayerZero needs it, and CI does not build it (the bench's tests skip those columns).
#
# The wheel is cached in $LLAMACPP_WHEEL_DIR (default /work/cache/wheels): when one is there it is installed as it is
# (a build takes ~11 minutes of two cores). The source distribution is kept in $LLAMACPP_SDIST_DIR (default
# /work/cache/sdist): its vendor/llama.cpp carries convert_hf_to_gguf.py, which bench/_llamacpp.py runs.
#
# GGML_NATIVE=ON builds for the host's instruction set (-march=native: AVX-512, VNNI, BF16 where the CPU has them);
# the AMX flags are switched off explicitly, as in issue 22's measurements (no AMX kernels whatever -march=native
# reports on a virtual CPU). CMAKE_BUILD_PARALLEL_LEVEL=2 and nice: the machine is shared. The build took ~25+
# minutes here at load ~9 (~11 on a quiet machine).
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
# llama_cpp's own runtime dependencies (small, pure Python; an installed numpy is kept as it is). The converter
# takes its gguf package from the sdist's gguf-py (bench/_llamacpp.py), not from PyPI; sentencepiece: its Llama / Mixtral
# vocabulary path imports it before it falls back to tokenizer.json.
"$PY" -m pip install numpy typing-extensions diskcache jinja2 sentencepiece
"$PY" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
