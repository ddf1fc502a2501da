/*
 * LayerZero CUDA kernels: a plain C ABI, usable without TensorRT (ctypes, CuPy, C, C++).
 *
 * The MoE forward of the skipping form (`ai.layerzero::MoE`): route each token (softmax or sigmoid
 * scores, top-k with ties to the lower expert index, optional renormalisation, relative zeroing
 * threshold), group the kept (token, expert) pairs by expert (counts, prefix sums, permutation),
 * run only the experts that received tokens (grouped GEMM; a GEMV path for up to 8 tokens), then
 * un-permute and apply the routing weights.
 *
 *   probs  = scoring(router_logits[t])                       softmax over E | sigmoid
 *   top-k  = k largest probs, ties -> lower index
 *   w      = probs at top-k, / sum(w) when normalize
 *   keep   = w >= zeroing_threshold * max(w)                 dropped weights are not renormalised
 *   y[t]   = sum_kept w_e * W_down[e] (act(W_gate[e] x_t) * (W_up[e] x_t))
 *
 * Layouts (row-major, contiguous, device memory): hidden [T, H], router_logits [T, E] (same dtype as
 * hidden), w_gate [E, F, H], w_up [E, F, H], w_down [E, H, F] (each expert's weight is [out, in]),
 * y [T, H] (dtype of hidden), mask [T, E] int32 (1 = expert e runs for token t).
 * All arithmetic is fp32 (fp16/bf16 inputs are widened on load, y is rounded once on store).
 *
 * Every call is asynchronous on `stream`, allocates nothing and does not synchronise, so it can be
 * captured in a CUDA graph. A call returns LZ_OK or an lz_status; lz_last_error() (per host thread)
 * says what was wrong.
 */
#ifndef LAYERZERO_KERNELS_H
#define LAYERZERO_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define LZ_API __declspec(dllexport)
#else
#define LZ_API __attribute__((visibility("default")))
#endif

/* Bumped when a signature or struct below changes; loader.py checks it. */
#define LZ_KERNELS_ABI_VERSION 1

#define LZ_MAX_EXPERTS 8192
#define LZ_MAX_TOP_K 32

/* Same type as cudaStream_t (struct CUstream_st*), without including the CUDA headers. */
typedef struct CUstream_st* lz_stream_t;

typedef enum lz_dtype { LZ_DTYPE_F32 = 0, LZ_DTYPE_F16 = 1, LZ_DTYPE_BF16 = 2 } lz_dtype;
typedef enum lz_scoring { LZ_SCORING_SOFTMAX = 0, LZ_SCORING_SIGMOID = 1 } lz_scoring;
/* gelu is the exact (erf) form, as ONNX Gelu and torch.nn.functional.gelu compute by default. */
typedef enum lz_activation { LZ_ACT_SILU = 0, LZ_ACT_GELU = 1, LZ_ACT_RELU = 2 } lz_activation;

typedef enum lz_status {
    LZ_OK = 0,
    LZ_ERR_INVALID_ARGUMENT = 1,   /* a size, attribute, dtype or pointer is wrong */
    LZ_ERR_WORKSPACE_TOO_SMALL = 2, /* see lz_moe_workspace_size */
    LZ_ERR_CUDA = 3                 /* a kernel launch failed (lz_last_error has cudaGetErrorString) */
} lz_status;

typedef struct lz_moe_config {
    int64_t tokens;          /* T >= 0 (T == 0 is a no-op) */
    int64_t hidden;          /* H > 0 */
    int64_t ffn;             /* F > 0 */
    int64_t experts;         /* 0 < E <= LZ_MAX_EXPERTS */
    int32_t top_k;           /* 1 <= top_k <= min(E, LZ_MAX_TOP_K) */
    int32_t normalize;       /* 0 | 1: renormalise the top-k weights to sum to 1 */
    int32_t scoring;         /* lz_scoring */
    int32_t activation;      /* lz_activation */
    float zeroing_threshold; /* >= 0: drop an expert whose weight < threshold * the token's largest */
} lz_moe_config;

LZ_API int32_t lz_abi_version(void);
LZ_API const char* lz_status_string(int32_t status);
/* What the last failing call on this host thread complained about ("" after a success). */
LZ_API const char* lz_last_error(void);

/* LZ_OK when cfg is valid; else LZ_ERR_INVALID_ARGUMENT with lz_last_error() naming the field. */
LZ_API int32_t lz_moe_check_config(const lz_moe_config* cfg);

/* Bytes of workspace lz_moe_forward needs for cfg (0 for an invalid cfg); it grows with
 * T * top_k * (F + H) * 4 bytes (the per-row intermediate and expert outputs, in fp32). */
LZ_API size_t lz_moe_workspace_size(const lz_moe_config* cfg);

/* Routing only: topk_index [T, top_k] int32 (-1 where the threshold dropped the expert),
 * topk_weight [T, top_k] fp32 (0 where dropped), mask [T, E] int32. Any output may be NULL. */
LZ_API int32_t lz_moe_route(const lz_moe_config* cfg, int32_t dtype, const void* router_logits,
                            int32_t* topk_index, float* topk_weight, int32_t* mask, lz_stream_t stream);

/* The whole MoE block. `dtype` (lz_dtype) is the type of hidden, router_logits, the weights and y.
 * mask may be NULL. workspace: lz_moe_workspace_size(cfg) bytes, 256-byte aligned. */
LZ_API int32_t lz_moe_forward(const lz_moe_config* cfg, int32_t dtype, const void* hidden,
                              const void* router_logits, const void* w_gate, const void* w_up,
                              const void* w_down, void* y, int32_t* mask, void* workspace,
                              size_t workspace_size, lz_stream_t stream);

/* Typed wrappers of lz_moe_forward (fp16 / bf16 values are passed as their 16-bit patterns). */
LZ_API int32_t lz_moe_forward_f32(const lz_moe_config* cfg, const float* hidden, const float* router_logits,
                                  const float* w_gate, const float* w_up, const float* w_down, float* y,
                                  int32_t* mask, void* workspace, size_t workspace_size, lz_stream_t stream);
LZ_API int32_t lz_moe_forward_f16(const lz_moe_config* cfg, const uint16_t* hidden, const uint16_t* router_logits,
                                  const uint16_t* w_gate, const uint16_t* w_up, const uint16_t* w_down,
                                  uint16_t* y, int32_t* mask, void* workspace, size_t workspace_size,
                                  lz_stream_t stream);
LZ_API int32_t lz_moe_forward_bf16(const lz_moe_config* cfg, const uint16_t* hidden, const uint16_t* router_logits,
                                   const uint16_t* w_gate, const uint16_t* w_up, const uint16_t* w_down,
                                   uint16_t* y, int32_t* mask, void* workspace, size_t workspace_size,
                                   lz_stream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* LAYERZERO_KERNELS_H */
