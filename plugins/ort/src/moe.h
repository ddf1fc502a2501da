// The native ai.layerzero::MoE computation, independent of ONNX Runtime (the custom op in custom_op.cpp feeds it;
// semantics: layerzero/plugins/reference.py). Routing, then only the routed experts, each on its own tokens.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dot_rows.h"

namespace lz {

enum class Scoring { softmax = 0, sigmoid = 1 };
enum class Activation { silu = 0, gelu = 1, relu = 2 };

// Parse the form's string attributes; false for a value this kernel does not implement.
bool parse_scoring(const std::string& s, Scoring* out);
bool parse_activation(const std::string& s, Activation* out);

struct MoEConfig {
  int64_t top_k = 1;
  bool normalize = false;
  Scoring scoring = Scoring::softmax;
  Activation activation = Activation::silu;
};

// Expert weights read in place: w_gate, w_up [E, F, H], w_down [E, H, F], all of one WeightType.
struct MoEWeights {
  const void* gate = nullptr;
  const void* up = nullptr;
  const void* down = nullptr;
  WeightType type = WeightType::f32;
  int64_t experts = 0, ffn = 0, hidden = 0;
};

// fn(i) for i in [0, total), possibly in parallel; returns when all are done.
using ParallelFor = std::function<void(size_t total, const std::function<void(size_t)>& fn)>;

// Per token: scores, top-k (ties to the lower expert index), renormalise, threshold. weights[t * E + e] is the
// routing weight of a kept expert (0 otherwise), mask[t * E + e] whether it runs.
void route(const float* logits, int64_t tokens, int64_t experts, const MoEConfig& cfg, float threshold,
           std::vector<float>* weights, uint8_t* mask);

// y[T, H] (float) = sum over kept (t, e) of weight * down_e(act(gate_e x_t) * up_e x_t); x is [T, H] float.
void run_experts(const float* x, int64_t tokens, const MoEWeights& w, const MoEConfig& cfg,
                 const std::vector<float>& weights, const uint8_t* mask, float* y, const ParallelFor& parallel_for);

}  // namespace lz
