#!/usr/bin/env bash
# GPU check of the LayerZero MoE kernels and TensorRT plugin. Budget: under 5 minutes on one H200.
#
#   bash scripts/gpu_check.sh [--quick]
#
# 1. the GPU and its driver (nvidia-smi);
# 2. Python packages: this project (pip install -e .), cuda-python matching the driver's CUDA major version
#    (device memory and streams for the ctypes calls); installed from $WHEELHOUSE first when it is set
#    (offline machines: `pip download "cuda-python<13" -d wheelhouse` elsewhere and carry the folder);
# 3. the kernels: `layerzero plugins build --build-dir build/gpu-check` when nvcc is here; else the prebuilt
#    libraries in $LAYERZERO_PLUGIN_DIR (built elsewhere with `layerzero plugins build --build-dir
#    build/plugins`; nvcc 13 output needs a CUDA 13 driver, >= 580). The TensorRT plugin is built too when the
#    TensorRT headers are here (TENSORRT_ROOT);
# 4. scripts/gpu_check.py: kernels vs the numpy reference (fp32/fp16/bf16, max errors), 1- and 64-token timings
#    routed vs dense, and, when `import tensorrt` works, plan vs ONNX Runtime.
#
# Exit 0: passed; 1: a check failed; 2: the machine lacks something (the last line says what).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
START=$(date +%s)

incomplete() { echo "GPU CHECK INCOMPLETE: $*"; exit 2; }

echo "== GPU"
command -v nvidia-smi >/dev/null || incomplete "nvidia-smi not found: no NVIDIA driver on this machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || incomplete "nvidia-smi failed"
CUDA_MAJOR=$(nvidia-smi | sed -n 's/.*CUDA Version: \([0-9]*\)\..*/\1/p' | head -1)
echo "driver supports CUDA ${CUDA_MAJOR:-unknown}"

echo "== Python packages"
pip_install() {
    local args=(-m pip install -q --disable-pip-version-check --timeout 20 --retries 1)
    if [ -n "${WHEELHOUSE:-}" ]; then
        $PY "${args[@]}" --no-index --find-links "$WHEELHOUSE" "$@" 2>/dev/null && return 0
    fi
    $PY "${args[@]}" "$@"
}
if ! $PY -c "import layerzero.plugins.loader" 2>/dev/null; then
    if $PY -c "import numpy, onnx, onnx_ir, onnxruntime, rich, yaml" 2>/dev/null; then
        $PY -m pip install -q --no-deps --no-build-isolation -e . || incomplete "pip install -e . failed"
    else
        pip_install -e . || incomplete "cannot install this project's dependencies (numpy, onnx, onnx-ir, onnxruntime, rich, pyyaml): no network? set WHEELHOUSE"
    fi
fi
if ! $PY -c "import cuda.bindings.runtime" 2>/dev/null && ! $PY -c "from cuda import cudart" 2>/dev/null; then
    case "${CUDA_MAJOR:-12}" in
        12) SPEC="cuda-python>=12.4,<13" ;;
        *) SPEC="cuda-python>=${CUDA_MAJOR}.0,<$((CUDA_MAJOR + 1))" ;;
    esac
    echo "installing $SPEC"
    pip_install "$SPEC" || incomplete "cannot install $SPEC (needed for device memory): no network? set WHEELHOUSE"
fi
$PY -c "import tensorrt; print('tensorrt', tensorrt.__version__)" 2>/dev/null || echo "tensorrt: not importable (the TensorRT part is skipped)"

echo "== kernels"
BUILD_DIR=""
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
    BUILD_DIR=build/gpu-check
    timeout 150 $PY -m layerzero plugins build --build-dir "$BUILD_DIR" || incomplete "layerzero plugins build failed (see above)"
elif [ -n "${LAYERZERO_PLUGIN_DIR:-}" ] && [ -f "$LAYERZERO_PLUGIN_DIR/liblayerzero_kernels.so" ]; then
    echo "no nvcc here: using the prebuilt libraries in $LAYERZERO_PLUGIN_DIR"
    BUILD_DIR=$LAYERZERO_PLUGIN_DIR
else
    incomplete "no nvcc to build the kernels and no prebuilt liblayerzero_kernels.so in LAYERZERO_PLUGIN_DIR"
fi

echo "== checks"
mkdir -p build
LEFT=$((290 - ($(date +%s) - START)))
[ "$LEFT" -gt 30 ] || incomplete "no time left for the checks after setup"
timeout "$LEFT" $PY scripts/gpu_check.py --build-dir "$BUILD_DIR" --json "${GPU_CHECK_JSON:-build/gpu_check.json}" "$@"
rc=$?
[ $rc -eq 124 ] && incomplete "scripts/gpu_check.py ran out of time (${LEFT}s)"
echo "total $(( $(date +%s) - START )) s"
exit $rc
