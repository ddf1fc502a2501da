// The native ai.layerzero::MoE computation, independent of ONNX Runtime (the custom op in custom_op.cpp feeds it;
// semantics: layerzero/plugins/reference.py). Routing, then only the routed experts, each on its own tokens.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dot_rows.h"
#include "qdot_rows.h"

namespace lz {

enum class Scoring { softmax = 0, sigmoid = 1 };
enum class Activation { silu = 0, gelu = 1, relu = 2, swiglu_oai = 3 };

// Parse the form's string attributes; false for a value this kernel does not implement.
bool parse_scoring(const std::string& s, Scoring* out);
bool parse_activation(const std::string& s, Activation* out);

// v1 attributes, then the v2 ones (moe_op_v2; their defaults reproduce v1 exactly).
struct MoEConfig {
  int64_t top_k = 1;
  bool normalize = false;
  Scoring scoring = Scoring::softmax;
  Activation activation = Activation::silu;
  float activation_alpha = 1.702f;  // swiglu_oai
  float activation_limit = 7.0f;    // swiglu_oai (inf: no clamp)
  int64_t n_group = 1;              // group-limited top-k: n_group equal groups, the topk_group best kept
  int64_t topk_group = 1;
  float routed_scaling_factor = 1.0f;
};

// Why (n_group, topk_group, top_k) cannot split E experts (empty when they can; n_group 1 always can).
std::string group_error(const MoEConfig& cfg, int64_t experts);

// How the expert weights are stored (the weight_format attribute): float (WeightType), or block-quantized codes
// with float16 scales per 32-block along the reduction axis (q8: int8 codes, q4: two offset nibbles a byte).
enum class WeightFormat { f = 0, q8 = 1, q4 = 2 };

// Expert weights read in place: w_gate, w_up [E, F, H], w_down [E, H, F], all of one WeightType (format f); or
// their codes (q8 [E, F, H] int8, q4 [E, F, H / 2] uint8, ...) with the scales s_gate, s_up [E, F, H / 32],
// s_down [E, H, F / 32] (float16 bits).
struct MoEWeights {
  const void* gate = nullptr;
  const void* up = nullptr;
  const void* down = nullptr;
  WeightType type = WeightType::f32;
  WeightFormat format = WeightFormat::f;
  bool chunked = false;  // q4 rows in 16-block chunks (code_layout "chunk16", qdot_rows.h)
  const uint16_t* s_gate = nullptr;
  const uint16_t* s_up = nullptr;
  const uint16_t* s_down = nullptr;
  int64_t experts = 0, ffn = 0, hidden = 0;
  // Optional expert biases (v2 inputs 5-7; nullptr = absent = 0): b_gate, b_up [E, F], b_down [E, H].
  const void* b_gate = nullptr;
  const void* b_up = nullptr;
  const void* b_down = nullptr;
  WeightType b_gate_type = WeightType::f32, b_up_type = WeightType::f32, b_down_type = WeightType::f32;
  // Activation sparsity of the experts' input (issue 23; gate_up_layout "input_major", format f only): w_gate and
  // w_up stored [E, H, F] (row i = input channel i, as SparseLinear's W), so a dropped channel is a row not read;
  // x channel i of a token is dropped when |x_i| <= x_limit[i] (NaN kept; x_limit nullptr: every channel kept).
  // gate / up of a token are then the sum over its kept channels, ascending, of x_i * W[e, i, :] (one fused
  // multiply-add per kept channel and column: sparse_linear_rows.cpp's float kernels). w_down stays [E, H, F].
  bool input_major = false;
  const float* x_limit = nullptr;
};

// Back [data, data + bytes) with transparent huge pages, in place (Linux: madvise MADV_HUGEPAGE, then
// MADV_COLLAPSE, which moves the contents of each whole 2 MB-aligned block inside the range into one huge page at
// the same address; the old small pages are freed, so nothing is copied for good). One core streams weights
// ~1.3x faster from huge pages (no TLB miss every 4 KB). Returns the bytes now collapsed; 0 where the kernel
// refuses (THP off, file-backed memory, another OS): the weights stay as they were, only slower to read.
// LAYERZERO_ORT_HUGEPAGES=0 turns it off.
size_t advise_huge_pages(const void* data, size_t bytes);

// Element i of a float32 / float16 / bfloat16 array.
float load_element(const void* p, WeightType type, int64_t i);

// fn(i) for i in [0, total), possibly in parallel; returns when all are done.
using ParallelFor = std::function<void(size_t total, const std::function<void(size_t)>& fn)>;

// Per token: scores, the selection scores (+ score_bias, group limits), top-k of those (ties to the lower expert
// index), the unbiased scores of the chosen renormalised and scaled, threshold. weights[t * E + e] is the
// routing weight of a kept expert (0 otherwise), mask[t * E + e] whether it runs. score_bias [E] may be null.
void route(const float* logits, int64_t tokens, int64_t experts, const MoEConfig& cfg, float threshold,
           const float* score_bias, std::vector<float>* weights, uint8_t* mask);

// Each token's top-1 routing probability (the router confidence the runtime reports): max over e of
// softmax(logits[t])[e] = 1 / sum_e exp(l_e - max l), or sigmoid(max l); float32, as ONNX Runtime's Softmax /
// Sigmoid then ReduceMax compute it up to rounding. NaN logits give NaN.
void routing_confidence(const float* logits, int64_t tokens, int64_t experts, Scoring scoring, float* out);

// The format's name ("f", "q8", "q4"); false for one this kernel does not implement.
bool parse_weight_format(const std::string& s, WeightFormat* out);
// The code_layout attribute: "rows" (chunked false) or "chunk16" (true: q4 rows in 16-block chunks, weight_format
// "q4" only). The error message, "" when none.
std::string parse_code_layout(const std::string& value, const std::string& format_name, bool* chunked);

// y[T, H] (float) = sum over kept (t, e) of weight * down_e(act(gate_e x_t) * up_e x_t); x is [T, H] float.
// Quantized formats: each token's x and each expert's intermediate h quantized per 32-block to int8
// (quantize_token), then the integer row dots of qdot_kernels(); the rest (routing weights, biases, glu, the sum
// in expert order) in float as for the float weights.
// kept [T] (nullptr: not wanted): the number of x channels each token keeps (input_major; H otherwise).
void run_experts(const float* x, int64_t tokens, const MoEWeights& w, const MoEConfig& cfg,
                 const std::vector<float>& weights, const uint8_t* mask, float* y, const ParallelFor& parallel_for,
                 int64_t* kept = nullptr);

}  // namespace lz
