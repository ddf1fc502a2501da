// ai.layerzero::Attention: the attention core of a decoder layer as one node (passes/native_attention.py writes it
// with --linear-kernel native, in place of the ~14 nodes the exporters' scaled_dot_product_attention decomposes to).
//
//   o = Attention(q [B, H, T, D] float32, k [Bk, Hk, L, D] float32, v [Bk, Hk, L, Dv] float32,
//                 mask? float32 of rank <= 4, broadcast to [B, H, T, L])
//   o, present_key, present_value = Attention(q, k_new [B, Hk, Tn, D], v_new [B, Hk, Tn, Dv], mask? ("" if none),
//                 past_key [B, Hk, P, D], past_value [B, Hk, P, Dv])      (the past form: the cache's Concat too)
//     present_* = concat(past_*, *_new) along the sequence (bitwise: copied), k / v below = the presents (L = P + Tn)
//     Cache buffer: when the mask's last dimension Lm is below P + Tn, the past is a buffer of capacity P whose
//     first Lm - Tn rows are in use: the presents have the past's shape, the new rows are written at rows
//     [Lm - Tn, Lm) and the attention reads rows [0, Lm) (L = Lm; Lm > P is refused). When present_* is the
//     past's own memory (the caller binds one buffer as both, as ONNX Runtime GenAI does for its
//     GroupQueryAttention) only the new rows are written: no copy of the cache a step. Otherwise the rows in use are
//     copied and the rest of the presents is 0.
//   o [B, T, H*Dv], present_key, present_value = Attention(q [B, T, H*D], k_new [B, T, Hk*D], v_new [B, T, Hk*Dv],
//                 mask?, past_key, past_value, q_norm? [D], k_norm? [D], cos_cache? [M, D/2], sin_cache? [M, D/2],
//                 position_ids? [B, T] int64)      (input_layout "bsh": the projections' outputs as they are)
//     each token's head h of q (k) is split off, RMS-normalised when its norm weight is given (x / sqrt(mean(x^2) +
//     norm_epsilon) * w: SimplifiedLayerNormalization), then rotated when the caches are given (non-interleaved
//     rotate_half over the whole head with cache row position_ids[b, t]: com.microsoft.RotaryEmbedding); v's heads
//     are split off; then the past form above; o is written [B, T, H*Dv]. Attributes num_heads, kv_num_heads,
//     norm_epsilon; output_layout "bsh"; rotary_form "cache" (default) | "inv_freq": input 8 the frequencies
//     [D/2], input 9 absent, the rows cos / sin(float(position_ids[b, t]) * inv_freq) computed in float32.
//   attributes: q_scale, k_scale (float, default 1), output_layout ("bhtd" (default) | "bthd"), mask_form
//     ("additive" (default) | "padding_causal": input 3 is the attention mask [B, L] int64 and the mask added is
//     the exporters' 0 where attention_mask[b, l] != 0 and l <= L - T + t, float32 min elsewhere)
//
//   s[b, h, t, l] = (sum_d (q[b, h, t, d] * q_scale) * k[b', g, l, d]) * k_scale + mask[b, h, t, l]
//   p[b, h, t, :] = softmax(s[b, h, t, :]), a row holding a NaN or an infinity (every key masked with -inf) as 0
//                   (NaN probabilities, which the exporters' Where(IsNaN(p), 0, p) makes 0)
//   o[b, h, t, :] = sum_l p[b, h, t, l] * v[b', g, l, :]     (output_layout "bthd": stored at o[b, t, h, :])
//
// with g = h / (H / Hk) (grouped-query attention: H a multiple of Hk, query heads g*r .. g*r + r - 1 read kv head
// g; Hk = 1 is a broadcast k / v) and b' = b, or 0 when Bk = 1 (a broadcast batch). The graph scales k before its
// MatMul and this kernel after the dot (the same product to float32 rounding, without a scaled copy of the cache a
// step); the dots, the softmax (exp to ~2 ulp, exactly 0 below e^-87.3) and the weighted sum are float32 in this
// kernel's order: results agree with ONNX Runtime's to float32 rounding, not bitwise. L = 0: o = 0. Work is split
// over (b, kv head) pairs on ONNX Runtime's intra-op thread pool; a row's arithmetic does not depend on the split,
// so the result does not depend on the thread count. AVX-512, AVX2 and baseline builds of the row loop (GCC's
// target_clones, chosen at load).
// Semantics: layerzero/plugins/reference.py attention_reference.
#pragma once

struct OrtCustomOp;

namespace lz {

const OrtCustomOp* attention_op();

}  // namespace lz
