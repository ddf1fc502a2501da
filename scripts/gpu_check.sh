#!/usr/bin/env bash
# GPU check of the LayerZero MoE kernels (and TensorRT plugin where TensorRT exists). Offline: installs nothing,
# downloads nothing. Budget: under 10 minutes on one H200 (typically ~3).
#
#   bash scripts/gpu_check.sh [--quick] [--only correctness|sanitizer|timing|tensorrt ...]
#
# Needs on the machine: an NVIDIA driver (nvidia-smi), nvcc and cmake (>= 3.24), python3 with numpy and CuPy
# (compute-sanitizer for the sanitizer check, tensorrt for the plan check; without them those checks are
# skipped, and a skip is not a pass). The project runs from this tree: nothing is pip-installed.
#
# 1. machine: GPU name / driver / compute capability, nvcc, cmake, python packages (a clear message for each);
# 2. build: cmake -S plugins -B build/gpu-check for this GPU's architecture (-lineinfo for the sanitizer's
#    reports), and the sanitizer driver tests/plugins/harness/kernel_driver.cpp, in parallel;
# 3. scripts/gpu_check.py: correctness vs the numpy reference, compute-sanitizer memcheck + racecheck, timings
#    routed vs a dense cuBLAS baseline, TensorRT plan vs ONNX Runtime (where TensorRT imports).
# Every figure goes to $GPU_CHECK_JSON (default build/gpu_check.json).
#
# Exit 0: every check ran and passed; 1: a check failed; 2: incomplete (the machine lacks something; the last
# line says what); 3: every check that ran passed, some were skipped (the last line lists them).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
START=$(date +%s)
BUILD_DIR=${GPU_CHECK_BUILD_DIR:-build/gpu-check}
JSON=${GPU_CHECK_JSON:-build/gpu_check.json}
BUDGET=${GPU_CHECK_BUDGET_S:-570}
mkdir -p "$(dirname "$JSON")"

incomplete() {
    local reason=${1//\"/\'}
    printf '{"status": "incomplete", "exit_code": 2, "reason": "%s", "checks": {}}\n' "$reason" > "$JSON"
    echo "GPU CHECK INCOMPLETE: $1"
    exit 2
}

echo "== machine"
command -v nvidia-smi >/dev/null || incomplete "nvidia-smi not found: no NVIDIA driver on this machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader \
    || incomplete "nvidia-smi failed: the driver does not answer"
CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
[[ "$CAP" =~ ^[0-9]+$ ]] || CAP=90
NVCC=${CUDACXX:-$(command -v nvcc || true)}
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
[ -n "$NVCC" ] && [ -x "$NVCC" ] || incomplete "nvcc not found (PATH, CUDACXX, /usr/local/cuda/bin): install the CUDA toolkit"
echo "nvcc: $NVCC ($("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))"
command -v cmake >/dev/null || incomplete "cmake not found: install cmake >= 3.24"
echo "cmake: $(cmake --version | head -1)"
command -v "$PY" >/dev/null || incomplete "$PY not found (set PYTHON)"
"$PY" -c "import numpy" 2>/dev/null || incomplete "$PY cannot import numpy"
"$PY" -c "import cupy; print('cupy', cupy.__version__)" || incomplete "$PY cannot import cupy (the check's device memory, streams, events and cuBLAS baseline)"
SANITIZER=$(command -v compute-sanitizer || true)
[ -z "$SANITIZER" ] && [ -x /usr/local/cuda/bin/compute-sanitizer ] && SANITIZER=/usr/local/cuda/bin/compute-sanitizer
echo "compute-sanitizer: ${SANITIZER:-not found (the sanitizer check will be a skip)}"
"$PY" -c "import tensorrt; print('tensorrt', tensorrt.__version__)" 2>/dev/null \
    || echo "tensorrt: not importable (the TensorRT check will be a skip)"

echo "== build (sm_$CAP)"
mkdir -p "$BUILD_DIR"
(
    cmake -S plugins -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$NVCC" \
        -DCMAKE_CUDA_ARCHITECTURES="${CAP}-real" -DCMAKE_CUDA_FLAGS=-lineinfo >"$BUILD_DIR/configure.log" 2>&1 \
        && cmake --build "$BUILD_DIR" -j "$(nproc)" >"$BUILD_DIR/build.log" 2>&1
) &
BUILD_PID=$!
# The driver links liblayerzero_kernels.so, so it is compiled now and linked once the library exists.
"$NVCC" -std=c++17 -O2 -lineinfo -arch="sm_$CAP" -Iplugins/include -c tests/plugins/harness/kernel_driver.cpp \
    -o "$BUILD_DIR/kernel_driver.o" >"$BUILD_DIR/driver.log" 2>&1
DRIVER_RC=$?
wait $BUILD_PID || { tail -30 "$BUILD_DIR"/configure.log "$BUILD_DIR"/build.log 2>/dev/null; incomplete "building plugins/ failed (see above)"; }
[ -f "$BUILD_DIR/liblayerzero_kernels.so" ] || incomplete "the build produced no liblayerzero_kernels.so ($BUILD_DIR/build_summary.json)"
DRIVER=""
if [ $DRIVER_RC -eq 0 ] && "$NVCC" -arch="sm_$CAP" "$BUILD_DIR/kernel_driver.o" -L"$BUILD_DIR" -llayerzero_kernels \
        -Xlinker -rpath="$(cd "$BUILD_DIR" && pwd)" -o "$BUILD_DIR/kernel_driver" >>"$BUILD_DIR/driver.log" 2>&1; then
    DRIVER=$BUILD_DIR/kernel_driver
else
    cat "$BUILD_DIR/driver.log"
    echo "sanitizer driver did not build (see above): the sanitizer check fails"
    DRIVER=$BUILD_DIR/kernel_driver.missing
fi
echo "built in $(( $(date +%s) - START )) s"

echo "== checks"
LEFT=$((BUDGET - ($(date +%s) - START)))
[ "$LEFT" -gt 60 ] || incomplete "no time left for the checks after the build"
timeout "$LEFT" "$PY" scripts/gpu_check.py --build-dir "$BUILD_DIR" \
    --driver "$DRIVER" --json "$JSON" "$@"
rc=$?
[ $rc -eq 124 ] && incomplete "scripts/gpu_check.py ran out of time (${LEFT} s)"
echo "total $(( $(date +%s) - START )) s; figures in $JSON"
exit $rc
