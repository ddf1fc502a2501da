// Small driver of liblayerzero_kernels.so for compute-sanitizer (memcheck, racecheck): scripts/gpu_check.py runs
//
//   compute-sanitizer --tool memcheck  --error-exitcode 86 kernel_driver
//   compute-sanitizer --tool racecheck --error-exitcode 86 kernel_driver
//
// Every buffer is its own cudaMalloc of exactly the size the C ABI documents (the workspace: exactly
// lz_moe_workspace_size), so an access past any of them is a memcheck finding. The cases cover both paths
// (GEMV for T <= 8, tiles above), T = 0, fp32 / fp16 / bf16, E up to 256, top_k up to 8, dims that are not
// multiples of 8 (scalar loads), thresholds, sigmoid / gelu / relu, and lz_moe_route alone. Exit 0: every call
// returned LZ_OK and y is finite; 1: a call failed (printed); the sanitizer's own exit code reports its findings.
//
// Build: nvcc -std=c++17 -O2 -I plugins/include kernel_driver.cpp -L<build> -llayerzero_kernels -o kernel_driver
#include "layerzero_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

struct Case {
    int64_t T, H, F, E;
    int32_t k, normalize, scoring, activation;
    float threshold;
    int32_t dtype;
};

uint32_t gSeed = 12345;
float uniform() {  // [-1, 1), deterministic
    gSeed = gSeed * 1664525u + 1013904223u;
    return static_cast<float>(gSeed >> 8) / 8388608.0F - 1.0F;
}

size_t elementSize(int32_t dtype) { return dtype == LZ_DTYPE_F32 ? 4 : 2; }

// n values of `dtype`, scaled, as bytes.
std::vector<unsigned char> randomValues(size_t n, int32_t dtype, float scale) {
    std::vector<unsigned char> bytes(n * elementSize(dtype));
    for (size_t i = 0; i < n; ++i) {
        float const v = uniform() * scale;
        if (dtype == LZ_DTYPE_F32) {
            std::memcpy(bytes.data() + 4 * i, &v, 4);
        } else if (dtype == LZ_DTYPE_F16) {
            __half const h = __float2half(v);
            std::memcpy(bytes.data() + 2 * i, &h, 2);
        } else {
            __nv_bfloat16 const b = __float2bfloat16(v);
            std::memcpy(bytes.data() + 2 * i, &b, 2);
        }
    }
    return bytes;
}

float toFloat(unsigned char const* p, int32_t dtype) {
    if (dtype == LZ_DTYPE_F32) {
        float v;
        std::memcpy(&v, p, 4);
        return v;
    }
    if (dtype == LZ_DTYPE_F16) {
        __half h;
        std::memcpy(&h, p, 2);
        return __half2float(h);
    }
    __nv_bfloat16 b;
    std::memcpy(&b, p, 2);
    return __bfloat162float(b);
}

bool cudaOk(cudaError_t err, char const* what) {
    if (err != cudaSuccess) std::printf("FAIL %s: %s\n", what, cudaGetErrorString(err));
    return err == cudaSuccess;
}

void* upload(std::vector<unsigned char> const& host) {
    void* p = nullptr;
    if (host.empty()) return nullptr;
    if (!cudaOk(cudaMalloc(&p, host.size()), "cudaMalloc")) return nullptr;
    cudaOk(cudaMemcpy(p, host.data(), host.size(), cudaMemcpyHostToDevice), "upload");
    return p;
}

bool runCase(Case const& c, cudaStream_t stream) {
    lz_moe_config cfg{};
    cfg.tokens = c.T, cfg.hidden = c.H, cfg.ffn = c.F, cfg.experts = c.E, cfg.top_k = c.k;
    cfg.normalize = c.normalize, cfg.scoring = c.scoring, cfg.activation = c.activation;
    cfg.zeroing_threshold = c.threshold;
    size_t const es = elementSize(c.dtype);
    std::vector<void*> buffers;
    auto put = [&](size_t n, float scale) {
        void* p = upload(randomValues(n, c.dtype, scale));
        buffers.push_back(p);
        return p;
    };
    auto alloc = [&](size_t bytes) {
        void* p = nullptr;
        if (bytes > 0) cudaOk(cudaMalloc(&p, bytes), "cudaMalloc");
        buffers.push_back(p);
        return p;
    };
    void* hidden = put(c.T * c.H, 1.0F);
    void* logits = put(c.T * c.E, 2.0F);
    void* wg = put(c.E * c.F * c.H, 1.0F / std::sqrt(static_cast<float>(c.H)));
    void* wu = put(c.E * c.F * c.H, 1.0F / std::sqrt(static_cast<float>(c.H)));
    void* wd = put(c.E * c.H * c.F, 1.0F / std::sqrt(static_cast<float>(c.F)));
    void* y = alloc(c.T * c.H * es);
    auto* mask = static_cast<int32_t*>(alloc(c.T * c.E * 4));
    size_t const wsBytes = lz_moe_workspace_size(&cfg);
    void* ws = alloc(wsBytes);
    auto* index = static_cast<int32_t*>(alloc(c.T * c.k * 4));
    auto* weight = static_cast<float*>(alloc(c.T * c.k * 4));
    auto* mask2 = static_cast<int32_t*>(alloc(c.T * c.E * 4));

    bool ok = true;
    int32_t s = lz_moe_forward(&cfg, c.dtype, hidden, logits, wg, wu, wd, y, mask, ws, wsBytes,
                               reinterpret_cast<lz_stream_t>(stream));
    if (s != LZ_OK) std::printf("FAIL lz_moe_forward: %s: %s\n", lz_status_string(s), lz_last_error()), ok = false;
    s = lz_moe_route(&cfg, c.dtype, logits, index, weight, mask2, reinterpret_cast<lz_stream_t>(stream));
    if (s != LZ_OK) std::printf("FAIL lz_moe_route: %s: %s\n", lz_status_string(s), lz_last_error()), ok = false;
    ok &= cudaOk(cudaStreamSynchronize(stream), "synchronize");
    if (ok && c.T > 0) {
        std::vector<unsigned char> out(c.T * c.H * es);
        ok &= cudaOk(cudaMemcpy(out.data(), y, out.size(), cudaMemcpyDeviceToHost), "download");
        for (int64_t i = 0; ok && i < c.T * c.H; ++i) {
            if (!std::isfinite(toFloat(out.data() + i * es, c.dtype))) {
                std::printf("FAIL y[%lld] is not finite\n", static_cast<long long>(i));
                ok = false;
            }
        }
    }
    // A workspace one byte short is refused, never overrun.
    if (c.T > 0 && wsBytes > 0) {
        s = lz_moe_forward(&cfg, c.dtype, hidden, logits, wg, wu, wd, y, mask, ws, wsBytes - 1,
                           reinterpret_cast<lz_stream_t>(stream));
        if (s != LZ_ERR_WORKSPACE_TOO_SMALL) std::printf("FAIL short workspace accepted (%d)\n", s), ok = false;
    }
    for (void* p : buffers) cudaFree(p);
    std::printf("%s T=%lld H=%lld F=%lld E=%lld k=%d dtype=%d scoring=%d act=%d thr=%g\n", ok ? "ok  " : "FAIL",
                static_cast<long long>(c.T), static_cast<long long>(c.H), static_cast<long long>(c.F),
                static_cast<long long>(c.E), c.k, c.dtype, c.scoring, c.activation, static_cast<double>(c.threshold));
    return ok;
}

}  // namespace

int main() {
    if (lz_abi_version() != LZ_KERNELS_ABI_VERSION) {
        std::printf("FAIL ABI version %d, driver built for %d\n", lz_abi_version(), LZ_KERNELS_ABI_VERSION);
        return 1;
    }
    cudaStream_t stream = nullptr;
    if (!cudaOk(cudaStreamCreate(&stream), "cudaStreamCreate")) return 1;
    Case const cases[] = {
        {0, 64, 96, 8, 2, 1, LZ_SCORING_SOFTMAX, LZ_ACT_SILU, 0.0F, LZ_DTYPE_F32},
        {1, 64, 96, 8, 2, 1, LZ_SCORING_SOFTMAX, LZ_ACT_SILU, 0.0F, LZ_DTYPE_F32},
        {5, 36, 52, 6, 6, 1, LZ_SCORING_SOFTMAX, LZ_ACT_GELU, 0.0F, LZ_DTYPE_F16},
        {8, 64, 96, 256, 8, 0, LZ_SCORING_SIGMOID, LZ_ACT_RELU, 0.2F, LZ_DTYPE_BF16},
        {9, 64, 96, 8, 2, 1, LZ_SCORING_SOFTMAX, LZ_ACT_SILU, 0.1F, LZ_DTYPE_F32},
        {70, 36, 52, 6, 3, 0, LZ_SCORING_SIGMOID, LZ_ACT_GELU, 0.0F, LZ_DTYPE_F16},
        {130, 64, 96, 256, 8, 1, LZ_SCORING_SOFTMAX, LZ_ACT_SILU, 0.05F, LZ_DTYPE_BF16},
    };
    bool ok = true;
    for (Case const& c : cases) ok &= runCase(c, stream);
    cudaStreamDestroy(stream);
    std::printf(ok ? "DRIVER PASSED\n" : "DRIVER FAILED\n");
    return ok ? 0 : 1;
}
