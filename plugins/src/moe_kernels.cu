// LayerZero MoE kernels behind the C ABI of layerzero_kernels.h (no TensorRT here).
//
// One forward = 6 launches on the caller's stream, no host synchronisation, no allocation:
//   memset(counts) -> route (+ per-expert counts, slot of each pair inside its expert)
//   -> scan (expert offsets, tile offsets, list of active experts) -> scatter (permutation)
//   -> gate/up (fused, act(g) * u) -> down -> combine (un-permute, routing weights, cast)
// The gate/up and down products run only over experts with tokens: the tiled path maps each thread
// block to one BM-row tile of one active expert (found from the tile prefix sums); the small path
// (T <= 8) maps each block to one active expert and one warp to one output feature (a GEMV that
// streams each weight row once). Rows inside an expert come in atomic order, but every row is
// computed on its own and the combine sums a token's experts in top-k order, so y is
// deterministic.
#include "layerzero_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdarg>
#include <cstdio>

namespace {

thread_local char g_last_error[512] = "";

int32_t set_error(int32_t status, const char* fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(g_last_error, sizeof(g_last_error), fmt, args);
    va_end(args);
    return status;
}

int32_t ok() {
    g_last_error[0] = '\0';
    return LZ_OK;
}

// ------------------------------------------------------------------------------------ element types

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) {
    return v;
}
template <>
__device__ __forceinline__ float to_float<__half>(__half v) {
    return __half2float(v);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
    return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
    return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// Eight consecutive elements widened to fp32 (p is 16-byte aligned).
__device__ __forceinline__ void load8(const float* p, float out[8]) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
    out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}
__device__ __forceinline__ void load8(const __half* p, float out[8]) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(h[i]);
        out[2 * i] = f.x, out[2 * i + 1] = f.y;
    }
}
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float out[8]) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        out[2 * i] = f.x, out[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ float activate(float x, int activation) {
    switch (activation) {
        case LZ_ACT_GELU:
            return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
        case LZ_ACT_RELU:
            return fmaxf(x, 0.0f);
        default:  // LZ_ACT_SILU
            return x / (1.0f + expf(-x));
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// ---------------------------------------------------------------------------------------- routing

// One warp per token. Scores live in shared memory (warps_per_block * E floats); a chosen expert is
// marked -inf so the next round skips it (softmax and sigmoid scores are never -inf themselves).
template <typename T>
__global__ void route_kernel(const T* __restrict__ logits, int64_t tokens, int E, int K, int normalize,
                             int scoring, float threshold, int32_t* __restrict__ topk_index,
                             float* __restrict__ topk_weight, int32_t* __restrict__ mask,
                             int32_t* __restrict__ counts, int32_t* __restrict__ slot) {
    extern __shared__ float scores_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + warp;
    if (t >= tokens) return;  // the whole warp leaves together; no block-wide barrier below
    float* p = scores_smem + static_cast<size_t>(warp) * E;
    const T* row = logits + t * E;

    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32) {
        const float v = to_float(row[e]);
        p[e] = v;
        mx = fmaxf(mx, v);
    }
    if (scoring == LZ_SCORING_SOFTMAX) {
        mx = warp_max(mx);
        float s = 0.0f;
        for (int e = lane; e < E; e += 32) {
            const float v = expf(p[e] - mx);
            p[e] = v;
            s += v;
        }
        const float inv = 1.0f / warp_sum(s);
        for (int e = lane; e < E; e += 32) p[e] *= inv;
    } else {
        for (int e = lane; e < E; e += 32) p[e] = 1.0f / (1.0f + expf(-p[e]));
    }
    if (mask != nullptr)
        for (int e = lane; e < E; e += 32) mask[t * E + e] = 0;
    __syncwarp();

    float w[LZ_MAX_TOP_K];
    int idx[LZ_MAX_TOP_K];
    float sum = 0.0f;
    for (int j = 0; j < K; ++j) {
        float best = -INFINITY;
        int best_e = INT_MAX;
        for (int e = lane; e < E; e += 32) {
            const float v = p[e];
            if (v > best) best = v, best_e = e;  // strided ascending e: ties keep the lower index
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, off);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, off);
            if (ov > best || (ov == best && oe < best_e)) best = ov, best_e = oe;
        }
        __syncwarp();
        if (best_e < E && lane == (best_e & 31)) p[best_e] = -INFINITY;
        __syncwarp();
        idx[j] = best_e < E ? best_e : -1;  // -1: only NaN scores were left
        w[j] = best_e < E ? best : 0.0f;
        sum += w[j];
    }
    if (normalize && sum > 0.0f) {
        const float inv = 1.0f / sum;
        for (int j = 0; j < K; ++j) w[j] *= inv;
    }
    // The first pick is the largest weight; the cut is relative to it and is not renormalised.
    const float cut = threshold * w[0];
    if (lane == 0) {
        for (int j = 0; j < K; ++j) {
            const bool keep = idx[j] >= 0 && !(w[j] < cut);
            const int64_t o = t * K + j;
            if (topk_index != nullptr) topk_index[o] = keep ? idx[j] : -1;
            if (topk_weight != nullptr) topk_weight[o] = keep ? w[j] : 0.0f;
            if (!keep) continue;
            if (mask != nullptr) mask[t * E + idx[j]] = 1;
            if (counts != nullptr) slot[o] = atomicAdd(&counts[idx[j]], 1);
        }
    }
}

// ------------------------------------------------------------------------------- grouping by expert

constexpr int kScanThreads = 256;

// One block: exclusive prefix sums of counts (row offsets), of ceil(count / tile_rows) (tile
// offsets), and the compacted list of experts with at least one row.
__global__ void scan_kernel(const int32_t* __restrict__ counts, int E, int tile_rows, int32_t* __restrict__ offsets,
                            int32_t* __restrict__ tile_offsets, int32_t* __restrict__ active,
                            int32_t* __restrict__ n_active) {
    __shared__ int s_rows[kScanThreads], s_tiles[kScanThreads], s_active[kScanThreads];
    const int tid = threadIdx.x;
    const int chunk = (E + kScanThreads - 1) / kScanThreads;
    const int begin = min(E, tid * chunk), end = min(E, begin + chunk);
    int rows = 0, tiles = 0, act = 0;
    for (int e = begin; e < end; ++e) {
        const int c = counts[e];
        rows += c;
        tiles += (c + tile_rows - 1) / tile_rows;
        act += c > 0;
    }
    s_rows[tid] = rows, s_tiles[tid] = tiles, s_active[tid] = act;
    __syncthreads();
    for (int off = 1; off < kScanThreads; off <<= 1) {  // Hillis-Steele inclusive scan
        const int r = tid >= off ? s_rows[tid - off] : 0;
        const int ti = tid >= off ? s_tiles[tid - off] : 0;
        const int a = tid >= off ? s_active[tid - off] : 0;
        __syncthreads();
        s_rows[tid] += r, s_tiles[tid] += ti, s_active[tid] += a;
        __syncthreads();
    }
    rows = s_rows[tid] - rows, tiles = s_tiles[tid] - tiles, act = s_active[tid] - act;
    for (int e = begin; e < end; ++e) {
        const int c = counts[e];
        offsets[e] = rows, tile_offsets[e] = tiles;
        if (c > 0) active[act++] = e;
        rows += c;
        tiles += (c + tile_rows - 1) / tile_rows;
    }
    if (tid == kScanThreads - 1) {
        offsets[E] = s_rows[tid], tile_offsets[E] = s_tiles[tid], *n_active = s_active[tid];
    }
}

// Row r of the grouped problem is (token perm_token[r], expert e) with offsets[e] <= r < offsets[e+1];
// slot_row maps each (token, k) pair back to its row (-1 when dropped).
__global__ void scatter_kernel(const int32_t* __restrict__ topk_index, const int32_t* __restrict__ slot,
                               const int32_t* __restrict__ offsets, int64_t pairs, int K,
                               int32_t* __restrict__ perm_token, int32_t* __restrict__ slot_row) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= pairs) return;
    const int e = topk_index[i];
    if (e < 0) {
        slot_row[i] = -1;
        return;
    }
    const int row = offsets[e] + slot[i];
    perm_token[row] = static_cast<int32_t>(i / K);
    slot_row[i] = row;
}

// ------------------------------------------------------------------------------------ grouped GEMM
// C[r, n] = sum_k A[src(r), k] * W[e][n, k]   (both operands K-contiguous; W is [out, in] per expert)
// GATED: C = act(A W_gate^T) * (A W_up^T), the two products sharing the A tile.
// GATHER: src(r) = perm_token[r] (rows of hidden); else src(r) = r (rows of the intermediate).

constexpr int kBM = 64, kBN = 64, kBK = 16, kGemmThreads = 256;

template <typename TA, typename TW, bool GATED, bool GATHER>
__global__ void __launch_bounds__(kGemmThreads)
    grouped_gemm_kernel(const TA* __restrict__ A, int64_t lda, const int32_t* __restrict__ perm_token,
                        const TW* __restrict__ W0, const TW* __restrict__ W1, int N, int Kdim,
                        const int32_t* __restrict__ counts, const int32_t* __restrict__ offsets,
                        const int32_t* __restrict__ tile_offsets, int E, int activation, float* __restrict__ C) {
    const int tile = blockIdx.x;
    if (tile >= tile_offsets[E]) return;
    int lo = 0, hi = E;  // tile_offsets[lo] <= tile < tile_offsets[hi]
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (tile_offsets[mid] <= tile) lo = mid;
        else hi = mid;
    }
    const int e = lo;
    const int row0 = offsets[e] + (tile - tile_offsets[e]) * kBM;
    const int rows = min(kBM, offsets[e] + counts[e] - row0);
    const int n0 = blockIdx.y * kBN;
    const TW* B0 = W0 + static_cast<int64_t>(e) * N * Kdim;
    const TW* B1 = GATED ? W1 + static_cast<int64_t>(e) * N * Kdim : nullptr;

    __shared__ __align__(16) float As[kBK][kBM + 4];
    __shared__ __align__(16) float Bs0[kBK][kBN + 4];
    __shared__ __align__(16) float Bs1[kBK][kBN + 4];  // unused unless GATED

    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    float acc0[4][4] = {}, acc1[4][4] = {};

    for (int k0 = 0; k0 < Kdim; k0 += kBK) {
#pragma unroll
        for (int l = 0; l < (kBM * kBK) / kGemmThreads; ++l) {
            const int i = tid + l * kGemmThreads;
            const int r = i / kBK, kk = i % kBK, k = k0 + kk;
            float a = 0.0f;
            if (r < rows && k < Kdim) {
                const int64_t src = GATHER ? static_cast<int64_t>(perm_token[row0 + r]) : row0 + r;
                a = to_float(A[src * lda + k]);
            }
            As[kk][r] = a;
            const bool in_b = n0 + r < N && k < Kdim;
            const int64_t bo = static_cast<int64_t>(n0 + r) * Kdim + k;
            Bs0[kk][r] = in_b ? to_float(B0[bo]) : 0.0f;
            if (GATED) Bs1[kk][r] = in_b ? to_float(B1[bo]) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kBK; ++kk) {
            const float4 a4 = *reinterpret_cast<const float4*>(&As[kk][ty * 4]);
            const float4 b4 = *reinterpret_cast<const float4*>(&Bs0[kk][tx * 4]);
            const float a[4] = {a4.x, a4.y, a4.z, a4.w}, b[4] = {b4.x, b4.y, b4.z, b4.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc0[i][j] = fmaf(a[i], b[j], acc0[i][j]);
            if (GATED) {
                const float4 c4 = *reinterpret_cast<const float4*>(&Bs1[kk][tx * 4]);
                const float c[4] = {c4.x, c4.y, c4.z, c4.w};
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int j = 0; j < 4; ++j) acc1[i][j] = fmaf(a[i], c[j], acc1[i][j]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = ty * 4 + i;
        if (r >= rows) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = n0 + tx * 4 + j;
            if (n >= N) continue;
            const float v = GATED ? activate(acc0[i][j], activation) * acc1[i][j] : acc0[i][j];
            C[static_cast<int64_t>(row0 + r) * N + n] = v;
        }
    }
}

// ----------------------------------------------------------------------------- grouped GEMV (T <= 8)

constexpr int kGemvMaxRows = 8, kGemvWarps = 8;

template <typename TA, typename TW, bool GATED, bool GATHER, bool VEC8>
__global__ void __launch_bounds__(kGemvWarps * 32)
    grouped_gemv_kernel(const TA* __restrict__ A, int64_t lda, const int32_t* __restrict__ perm_token,
                        const TW* __restrict__ W0, const TW* __restrict__ W1, int N, int Kdim,
                        const int32_t* __restrict__ counts, const int32_t* __restrict__ offsets,
                        const int32_t* __restrict__ active, const int32_t* __restrict__ n_active, int activation,
                        float* __restrict__ C) {
    if (static_cast<int>(blockIdx.y) >= *n_active) return;
    const int e = active[blockIdx.y];
    const int rows = min(counts[e], kGemvMaxRows), row0 = offsets[e];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = blockIdx.x * kGemvWarps + warp;
    if (n >= N) return;
    const TW* b0 = W0 + (static_cast<int64_t>(e) * N + n) * Kdim;
    const TW* b1 = GATED ? W1 + (static_cast<int64_t>(e) * N + n) * Kdim : nullptr;
    const TA* a_row[kGemvMaxRows];
#pragma unroll
    for (int r = 0; r < kGemvMaxRows; ++r) {
        const int64_t src = r < rows ? (GATHER ? static_cast<int64_t>(perm_token[row0 + r]) : row0 + r) : 0;
        a_row[r] = A + src * lda;
    }
    float acc0[kGemvMaxRows] = {}, acc1[kGemvMaxRows] = {};
    if (VEC8) {
        for (int k = lane * 8; k < Kdim; k += 32 * 8) {
            float w0[8], w1[8], a[8];
            load8(b0 + k, w0);
            if (GATED) load8(b1 + k, w1);
#pragma unroll
            for (int r = 0; r < kGemvMaxRows; ++r) {
                if (r >= rows) break;
                load8(a_row[r] + k, a);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    acc0[r] = fmaf(a[i], w0[i], acc0[r]);
                    if (GATED) acc1[r] = fmaf(a[i], w1[i], acc1[r]);
                }
            }
        }
    } else {
        for (int k = lane; k < Kdim; k += 32) {
            const float w0 = to_float(b0[k]);
            const float w1 = GATED ? to_float(b1[k]) : 0.0f;
#pragma unroll
            for (int r = 0; r < kGemvMaxRows; ++r) {
                if (r >= rows) break;
                const float a = to_float(a_row[r][k]);
                acc0[r] = fmaf(a, w0, acc0[r]);
                if (GATED) acc1[r] = fmaf(a, w1, acc1[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < kGemvMaxRows; ++r) {
        if (r >= rows) break;
        const float g = warp_sum(acc0[r]);
        const float u = GATED ? warp_sum(acc1[r]) : 0.0f;
        if (lane == 0) C[static_cast<int64_t>(row0 + r) * N + n] = GATED ? activate(g, activation) * u : g;
    }
}

// --------------------------------------------------------------------------------------- combine

template <typename T>
__global__ void combine_kernel(const float* __restrict__ out_rows, const int32_t* __restrict__ slot_row,
                               const float* __restrict__ topk_weight, int K, int64_t H, T* __restrict__ y) {
    __shared__ int32_t s_row[LZ_MAX_TOP_K];
    __shared__ float s_w[LZ_MAX_TOP_K];
    const int64_t t = blockIdx.x;
    if (threadIdx.x < K) {
        s_row[threadIdx.x] = slot_row[t * K + threadIdx.x];
        s_w[threadIdx.x] = topk_weight[t * K + threadIdx.x];
    }
    __syncthreads();
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < K; ++j)  // top-k order: a fixed summation order, run to run
            if (s_row[j] >= 0) acc = fmaf(s_w[j], out_rows[static_cast<int64_t>(s_row[j]) * H + h], acc);
        y[t * H + h] = from_float<T>(acc);
    }
}

// ------------------------------------------------------------------------------------------- host

constexpr size_t kAlign = 256;

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct Workspace {
    int32_t* topk_index;
    float* topk_weight;
    int32_t* slot;
    int32_t* slot_row;
    int32_t* perm_token;
    int32_t* counts;
    int32_t* offsets;
    int32_t* tile_offsets;
    int32_t* active;
    int32_t* n_active;
    float* inter;     // [rows, F]
    float* out_rows;  // [rows, H]
};

// Carves the workspace (or, with base == nullptr, only measures it); returns the bytes used.
size_t carve(const lz_moe_config& c, char* base, Workspace* ws) {
    const size_t pairs = static_cast<size_t>(c.tokens) * c.top_k;
    const size_t E = static_cast<size_t>(c.experts);
    size_t off = 0;
    auto take = [&](size_t bytes) {
        char* p = base == nullptr ? nullptr : base + off;
        off += align_up(bytes);
        return p;
    };
    Workspace w{};
    w.topk_index = reinterpret_cast<int32_t*>(take(pairs * 4));
    w.topk_weight = reinterpret_cast<float*>(take(pairs * 4));
    w.slot = reinterpret_cast<int32_t*>(take(pairs * 4));
    w.slot_row = reinterpret_cast<int32_t*>(take(pairs * 4));
    w.perm_token = reinterpret_cast<int32_t*>(take(pairs * 4));
    w.counts = reinterpret_cast<int32_t*>(take(E * 4));
    w.offsets = reinterpret_cast<int32_t*>(take((E + 1) * 4));
    w.tile_offsets = reinterpret_cast<int32_t*>(take((E + 1) * 4));
    w.active = reinterpret_cast<int32_t*>(take(E * 4));
    w.n_active = reinterpret_cast<int32_t*>(take(4));
    w.inter = reinterpret_cast<float*>(take(pairs * static_cast<size_t>(c.ffn) * 4));
    w.out_rows = reinterpret_cast<float*>(take(pairs * static_cast<size_t>(c.hidden) * 4));
    if (ws != nullptr) *ws = w;
    return off;
}

int32_t check_config(const lz_moe_config* c) {
    if (c == nullptr) return set_error(LZ_ERR_INVALID_ARGUMENT, "config is NULL");
    if (c->tokens < 0 || c->tokens > INT_MAX)
        return set_error(LZ_ERR_INVALID_ARGUMENT, "tokens (T) = %lld must be in [0, 2^31)", (long long)c->tokens);
    if (c->hidden <= 0 || c->hidden > INT_MAX)
        return set_error(LZ_ERR_INVALID_ARGUMENT, "hidden (H) = %lld must be in [1, 2^31)", (long long)c->hidden);
    if (c->ffn <= 0 || c->ffn > INT_MAX)
        return set_error(LZ_ERR_INVALID_ARGUMENT, "ffn (F) = %lld must be in [1, 2^31)", (long long)c->ffn);
    if (c->experts <= 0 || c->experts > LZ_MAX_EXPERTS)
        return set_error(LZ_ERR_INVALID_ARGUMENT, "experts (E) = %lld must be in [1, %d]", (long long)c->experts,
                         LZ_MAX_EXPERTS);
    const int64_t kmax = c->experts < LZ_MAX_TOP_K ? c->experts : LZ_MAX_TOP_K;
    if (c->top_k < 1 || c->top_k > kmax)
        return set_error(LZ_ERR_INVALID_ARGUMENT, "top_k = %d must be in [1, min(E=%lld, %d)]", c->top_k,
                         (long long)c->experts, LZ_MAX_TOP_K);
    if (c->tokens * c->top_k >= INT_MAX)
        return set_error(LZ_ERR_INVALID_ARGUMENT, "tokens * top_k = %lld must be < 2^31",
                         (long long)(c->tokens * c->top_k));
    if (c->normalize != 0 && c->normalize != 1)
        return set_error(LZ_ERR_INVALID_ARGUMENT, "normalize = %d must be 0 or 1", c->normalize);
    if (c->scoring != LZ_SCORING_SOFTMAX && c->scoring != LZ_SCORING_SIGMOID)
        return set_error(LZ_ERR_INVALID_ARGUMENT, "scoring = %d must be 0 (softmax) or 1 (sigmoid)", c->scoring);
    if (c->activation < LZ_ACT_SILU || c->activation > LZ_ACT_RELU)
        return set_error(LZ_ERR_INVALID_ARGUMENT, "activation = %d must be 0 (silu), 1 (gelu) or 2 (relu)",
                         c->activation);
    if (!(c->zeroing_threshold >= 0.0f) || std::isinf(c->zeroing_threshold))
        return set_error(LZ_ERR_INVALID_ARGUMENT, "zeroing_threshold = %g must be finite and >= 0",
                         (double)c->zeroing_threshold);
    return LZ_OK;
}

int route_warps_per_block(int64_t E) {
    const int64_t w = 12288 / E;  // keep warps * E * 4 bytes of scores under 48 KiB
    return static_cast<int>(w < 1 ? 1 : (w > 8 ? 8 : w));
}

// Each launch returns its own result (cudaLaunchKernelEx), so no cudaGetLastError: that would clear, and
// report as ours, an error some other code left on this thread.
template <typename... KernelArgs, typename... Args>
cudaError_t launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   Args... args) {
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    return cudaLaunchKernelEx(&config, kernel, static_cast<KernelArgs>(args)...);
}

int32_t cuda_status(cudaError_t err, const char* what) {
    if (err != cudaSuccess) return set_error(LZ_ERR_CUDA, "%s: %s", what, cudaGetErrorString(err));
    return ok();
}

template <typename T>
cudaError_t launch_route(const lz_moe_config& c, const void* logits, int32_t* topk_index, float* topk_weight,
                         int32_t* mask, int32_t* counts, int32_t* slot, cudaStream_t stream) {
    const int wpb = route_warps_per_block(c.experts);
    const int64_t blocks = (c.tokens + wpb - 1) / wpb;
    const size_t smem = static_cast<size_t>(wpb) * c.experts * sizeof(float);
    return launch(route_kernel<T>, dim3(static_cast<unsigned>(blocks)), dim3(wpb * 32), smem, stream,
                  static_cast<const T*>(logits), c.tokens, static_cast<int>(c.experts), c.top_k, c.normalize,
                  c.scoring, c.zeroing_threshold, topk_index, topk_weight, mask, counts, slot);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename TA, typename TW, bool GATED, bool GATHER>
cudaError_t launch_gemv(const TA* A, int64_t lda, const Workspace& w, const TW* W0, const TW* W1, int N, int Kdim,
                        int max_active, int activation, float* C, cudaStream_t stream) {
    const dim3 grid((N + kGemvWarps - 1) / kGemvWarps, max_active);
    const bool vec8 = Kdim % 8 == 0 && aligned16(A) && aligned16(W0) && (!GATED || aligned16(W1));
    auto* kernel = vec8 ? grouped_gemv_kernel<TA, TW, GATED, GATHER, true>
                        : grouped_gemv_kernel<TA, TW, GATED, GATHER, false>;
    return launch(kernel, grid, dim3(kGemvWarps * 32), 0, stream, A, lda, w.perm_token, W0, W1, N, Kdim, w.counts,
                  w.offsets, w.active, w.n_active, activation, C);
}

template <typename TA, typename TW, bool GATED, bool GATHER>
cudaError_t launch_gemm(const TA* A, int64_t lda, const Workspace& w, const TW* W0, const TW* W1, int N, int Kdim,
                        int E, int64_t max_tiles, int activation, float* C, cudaStream_t stream) {
    const dim3 grid(static_cast<unsigned>(max_tiles), (N + kBN - 1) / kBN);
    return launch(grouped_gemm_kernel<TA, TW, GATED, GATHER>, grid, dim3(kGemmThreads), 0, stream, A, lda,
                  w.perm_token, W0, W1, N, Kdim, w.counts, w.offsets, w.tile_offsets, E, activation, C);
}

template <typename T>
int32_t forward(const lz_moe_config& c, const void* hidden_v, const void* logits, const void* w_gate_v,
                const void* w_up_v, const void* w_down_v, void* y_v, int32_t* mask, void* workspace,
                cudaStream_t stream) {
    const T* hidden = static_cast<const T*>(hidden_v);
    const T* w_gate = static_cast<const T*>(w_gate_v);
    const T* w_up = static_cast<const T*>(w_up_v);
    const T* w_down = static_cast<const T*>(w_down_v);
    T* y = static_cast<T*>(y_v);
    const int E = static_cast<int>(c.experts), H = static_cast<int>(c.hidden), F = static_cast<int>(c.ffn);
    const int64_t pairs = c.tokens * c.top_k;

    Workspace w{};
    carve(c, static_cast<char*>(workspace), &w);
    cudaError_t err = cudaMemsetAsync(w.counts, 0, sizeof(int32_t) * E, stream);
    if (err != cudaSuccess) return cuda_status(err, "lz_moe_forward: memset");
    err = launch_route<T>(c, logits, w.topk_index, w.topk_weight, mask, w.counts, w.slot, stream);
    if (err != cudaSuccess) return cuda_status(err, "lz_moe_forward: route");
    const bool small = c.tokens <= kGemvMaxRows;  // then no expert has more than 8 rows
    err = launch(scan_kernel, dim3(1), dim3(kScanThreads), 0, stream, w.counts, E, small ? 1 : kBM, w.offsets,
                 w.tile_offsets, w.active, w.n_active);
    if (err != cudaSuccess) return cuda_status(err, "lz_moe_forward: scan");
    err = launch(scatter_kernel, dim3(static_cast<unsigned>((pairs + 255) / 256)), dim3(256), 0, stream,
                 w.topk_index, w.slot, w.offsets, pairs, c.top_k, w.perm_token, w.slot_row);
    if (err != cudaSuccess) return cuda_status(err, "lz_moe_forward: scatter");
    if (small) {
        const int max_active = static_cast<int>(pairs < E ? pairs : E);
        err = launch_gemv<T, T, true, true>(hidden, H, w, w_gate, w_up, F, H, max_active, c.activation, w.inter,
                                            stream);
        if (err != cudaSuccess) return cuda_status(err, "lz_moe_forward: gate/up");
        err = launch_gemv<float, T, false, false>(w.inter, F, w, w_down, nullptr, H, F, max_active, c.activation,
                                                  w.out_rows, stream);
    } else {
        // sum_e ceil(c_e / BM) <= pairs / BM + (number of active experts)
        const int64_t max_tiles = (pairs + kBM - 1) / kBM + (pairs < E ? pairs : E);
        err = launch_gemm<T, T, true, true>(hidden, H, w, w_gate, w_up, F, H, E, max_tiles, c.activation, w.inter,
                                            stream);
        if (err != cudaSuccess) return cuda_status(err, "lz_moe_forward: gate/up");
        err = launch_gemm<float, T, false, false>(w.inter, F, w, w_down, nullptr, H, F, E, max_tiles,
                                                  c.activation, w.out_rows, stream);
    }
    if (err != cudaSuccess) return cuda_status(err, "lz_moe_forward: down");
    err = launch(combine_kernel<T>, dim3(static_cast<unsigned>(c.tokens)), dim3(256), 0, stream, w.out_rows,
                 w.slot_row, w.topk_weight, c.top_k, static_cast<int64_t>(H), y);
    return cuda_status(err, "lz_moe_forward: combine");
}

}  // namespace

// ------------------------------------------------------------------------------------------ C ABI

extern "C" {

LZ_API int32_t lz_abi_version(void) { return LZ_KERNELS_ABI_VERSION; }

LZ_API const char* lz_status_string(int32_t status) {
    switch (status) {
        case LZ_OK:
            return "ok";
        case LZ_ERR_INVALID_ARGUMENT:
            return "invalid argument";
        case LZ_ERR_WORKSPACE_TOO_SMALL:
            return "workspace too small";
        case LZ_ERR_CUDA:
            return "CUDA error";
        default:
            return "unknown status";
    }
}

LZ_API const char* lz_last_error(void) { return g_last_error; }

LZ_API int32_t lz_moe_check_config(const lz_moe_config* cfg) {
    const int32_t s = check_config(cfg);
    return s == LZ_OK ? ok() : s;
}

LZ_API size_t lz_moe_workspace_size(const lz_moe_config* cfg) {
    if (check_config(cfg) != LZ_OK) return 0;
    return carve(*cfg, nullptr, nullptr);
}

LZ_API int32_t lz_moe_route(const lz_moe_config* cfg, int32_t dtype, const void* router_logits, int32_t* topk_index,
                            float* topk_weight, int32_t* mask, lz_stream_t stream) {
    const int32_t s = check_config(cfg);
    if (s != LZ_OK) return s;
    if (cfg->tokens == 0) return ok();
    if (router_logits == nullptr) return set_error(LZ_ERR_INVALID_ARGUMENT, "router_logits is NULL");
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    cudaError_t err = cudaSuccess;
    switch (dtype) {
        case LZ_DTYPE_F32:
            err = launch_route<float>(*cfg, router_logits, topk_index, topk_weight, mask, nullptr, nullptr, st);
            break;
        case LZ_DTYPE_F16:
            err = launch_route<__half>(*cfg, router_logits, topk_index, topk_weight, mask, nullptr, nullptr, st);
            break;
        case LZ_DTYPE_BF16:
            err = launch_route<__nv_bfloat16>(*cfg, router_logits, topk_index, topk_weight, mask, nullptr, nullptr,
                                              st);
            break;
        default:
            return set_error(LZ_ERR_INVALID_ARGUMENT, "dtype = %d must be 0 (f32), 1 (f16) or 2 (bf16)", dtype);
    }
    return cuda_status(err, "lz_moe_route");
}

LZ_API int32_t lz_moe_forward(const lz_moe_config* cfg, int32_t dtype, const void* hidden, const void* router_logits,
                              const void* w_gate, const void* w_up, const void* w_down, void* y, int32_t* mask,
                              void* workspace, size_t workspace_size, lz_stream_t stream) {
    const int32_t s = check_config(cfg);
    if (s != LZ_OK) return s;
    if (dtype != LZ_DTYPE_F32 && dtype != LZ_DTYPE_F16 && dtype != LZ_DTYPE_BF16)
        return set_error(LZ_ERR_INVALID_ARGUMENT, "dtype = %d must be 0 (f32), 1 (f16) or 2 (bf16)", dtype);
    if (cfg->tokens == 0) return ok();
    const char* null_name = hidden == nullptr          ? "hidden"
                            : router_logits == nullptr ? "router_logits"
                            : w_gate == nullptr        ? "w_gate"
                            : w_up == nullptr          ? "w_up"
                            : w_down == nullptr        ? "w_down"
                            : y == nullptr             ? "y"
                            : workspace == nullptr     ? "workspace"
                                                       : nullptr;
    if (null_name != nullptr) return set_error(LZ_ERR_INVALID_ARGUMENT, "%s is NULL", null_name);
    if ((reinterpret_cast<uintptr_t>(workspace) & (kAlign - 1)) != 0)
        return set_error(LZ_ERR_INVALID_ARGUMENT, "workspace must be %zu-byte aligned", kAlign);
    const size_t need = carve(*cfg, nullptr, nullptr);
    if (workspace_size < need)
        return set_error(LZ_ERR_WORKSPACE_TOO_SMALL, "workspace has %zu bytes, the MoE needs %zu", workspace_size,
                         need);
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    switch (dtype) {
        case LZ_DTYPE_F32:
            return forward<float>(*cfg, hidden, router_logits, w_gate, w_up, w_down, y, mask, workspace, st);
        case LZ_DTYPE_F16:
            return forward<__half>(*cfg, hidden, router_logits, w_gate, w_up, w_down, y, mask, workspace, st);
        default:
            return forward<__nv_bfloat16>(*cfg, hidden, router_logits, w_gate, w_up, w_down, y, mask, workspace,
                                          st);
    }
}

LZ_API int32_t lz_moe_forward_f32(const lz_moe_config* cfg, const float* hidden, const float* router_logits,
                                  const float* w_gate, const float* w_up, const float* w_down, float* y,
                                  int32_t* mask, void* workspace, size_t workspace_size, lz_stream_t stream) {
    return lz_moe_forward(cfg, LZ_DTYPE_F32, hidden, router_logits, w_gate, w_up, w_down, y, mask, workspace,
                          workspace_size, stream);
}

LZ_API int32_t lz_moe_forward_f16(const lz_moe_config* cfg, const uint16_t* hidden, const uint16_t* router_logits,
                                  const uint16_t* w_gate, const uint16_t* w_up, const uint16_t* w_down, uint16_t* y,
                                  int32_t* mask, void* workspace, size_t workspace_size, lz_stream_t stream) {
    return lz_moe_forward(cfg, LZ_DTYPE_F16, hidden, router_logits, w_gate, w_up, w_down, y, mask, workspace,
                          workspace_size, stream);
}

LZ_API int32_t lz_moe_forward_bf16(const lz_moe_config* cfg, const uint16_t* hidden, const uint16_t* router_logits,
                                   const uint16_t* w_gate, const uint16_t* w_up, const uint16_t* w_down, uint16_t* y,
                                   int32_t* mask, void* workspace, size_t workspace_size, lz_stream_t stream) {
    return lz_moe_forward(cfg, LZ_DTYPE_BF16, hidden, router_logits, w_gate, w_up, w_down, y, mask, workspace,
                          workspace_size, stream);
}

}  // extern "C"
