// liblayerzero_ort.so: ONNX Runtime custom-op library registering ai.layerzero::MoE (opset 1) on the CPU provider.
//
//   y[T, H], mask[T, E] bool = MoE(hidden[T, H], router_logits[T, E], w_gate[E, F, H], w_up[E, F, H],
//                                  w_down[E, H, F], threshold? [] float)                          (v1 layout)
//   y, mask = MoE(hidden, router_logits, w_gate, w_up, w_down, b_gate? [E, F], b_up? [E, F], b_down? [E, H],
//                 score_bias? [E], threshold? [] float)                                            (v2 layout)
//   y, mask = MoE(hidden, router_logits, c_gate, c_up, c_down, b_gate?, b_up?, b_down?, score_bias?, threshold?,
//                 s_gate [E, F, H/32], s_up [E, F, H/32], s_down [E, H, F/32] float16)     (quantized: q8 / q4)
//     q8: c_gate, c_up [E, F, H] int8, c_down [E, H, F] int8; q4: [E, F, H/2], [E, F, H/2], [E, H, F/2] uint8, two
//     codes a byte (element 2j low nibble, 2j+1 high, each code + 8); symmetric 32-blocks along each row (the
//     reduction axis), one float16 scale per block: w = code * scale (plugins/quant.py; H, F multiples of 32)
//   y, mask, kept? [T] int64 = MoE(hidden, router_logits, w_gate [E, H, F], w_up [E, H, F], w_down [E, H, F],
//                 b_gate?, b_up?, b_down?, score_bias?, threshold?, "", "", "", x_thresholds [H] float32,
//                 activation_scale [] float32)       (activation-sparse experts: gate_up_layout "input_major")
//     float experts only; gate / up stored input-major (row i = input channel i); x channel i dropped for every
//     expert's gate and up when |x_i| <= x_thresholds[i] * activation_scale (NaN kept); kept: each token's kept
//     channels (moe.h MoEWeights::input_major)
//   y, mask, kept?, confidence? [T] float = MoE(hidden [..., H], "", ...any layout above padded with "" to 15...,
//                 router_weight [E, H] float32, router_bias? [E] float32)      (the router in the op: 16-17 inputs)
//     logits = hidden @ router_weight^T + router_bias (float row kernels), routed as ever; confidence: each token's
//     top-1 routing probability (max of softmax / sigmoid of its logits); y keeps hidden's shape
//   attributes: top_k (int), normalize (0/1), scoring ("softmax" | "sigmoid"), activation ("silu" | "gelu" |
//               "relu" | "swiglu_oai"), zeroing_threshold (float), path (string, informative); v2
//               (moe_op_v2, defaults = v1): n_group, topk_group (int), routed_scaling_factor, activation_alpha,
//               activation_limit (float), routing ("topk"); weight_format ("f" | "q8" | "q4"), block_size (32);
//               gate_up_layout ("output_major" | "input_major"); code_layout ("rows" | "chunk16": q4 rows in
//               16-block chunks, qdot_rows.h; what layerzero compile writes)
//
// The layouts: inputs 0-4 and 5-8 at the positions of the op contract (moe_op_v2; "" = absent), the run-time
// threshold after them (9). A node of exactly 6 inputs whose 6th is named layerzero::threshold (or is declared a
// scalar) is the v1 layout the native lowering has written from the start: its 6th input is the threshold.
// Biases and score_bias are float32, float16 or bfloat16. The quantized layout (weight_format "q8" | "q4", default
// "f"; block_size 32) is the v2 one with the three scales appended (10-12): always 13 inputs.
//
// hidden / router_logits / y are float32 or float16 (one kernel each, same op name); the expert weights are
// float32, float16 or bfloat16, all three of one type, read in place from the tensors ONNX Runtime holds (no copy).
// The optional 6th input is the run-time threshold (layerzero::threshold); without it, zeroing_threshold.
// Attribute values this library does not implement are refused when the session is created, with the node's name.
// Semantics: layerzero/plugins/reference.py. Work is spread over ONNX Runtime's intra-op thread pool.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "moe.h"
#include "sparse_linear.h"
#include "status.h"

namespace {

constexpr const char* kDomain = "ai.layerzero";
constexpr const char* kOpName = "MoE";
constexpr size_t kInputs = 17;  // 5 required; 5-8 the v2 optional inputs, 9 the threshold, 10-12 the scales,
                                // 13-14 the activation thresholds and scale (gate_up_layout "input_major"),
                                // 15-16 the router's weight and bias (the logits computed in the op)
constexpr size_t kQuantInputs = 13;  // q8 / q4: exactly the scales' layout
constexpr size_t kFloatInputs = 10;  // weight_format "f": at most the threshold (15 with activation thresholds)
constexpr size_t kScales = 10;       // s_gate, s_up, s_down of the quantized formats
constexpr size_t kXThresholds = 13;  // x_thresholds [H] float32 (input_major)
constexpr size_t kXScale = 14;       // activation_scale [] float32 (input_major)
constexpr size_t kRouterWeight = 15;  // router_weight [E, H] float32: logits = hidden @ router_weight^T + bias
constexpr size_t kRouterBias = 16;    // router_bias [E] float32 (optional)
constexpr size_t kConfidence = 3;     // output 3 (optional): each token's top-1 routing probability [T]
constexpr size_t kScoreBias = 8;
constexpr size_t kThreshold = 9;
constexpr const char* kThresholdName = "layerzero::threshold";

using lz::Failure;
using lz::guarded;

bool weight_type(ONNXTensorElementDataType t, lz::WeightType* out) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
      *out = lz::WeightType::f32;
      return true;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
      *out = lz::WeightType::f16;
      return true;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
      *out = lz::WeightType::bf16;
      return true;
    default:
      return false;
  }
}

template <class T>
struct Hidden;
template <>
struct Hidden<float> {
  static constexpr ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  static float to_float(float v) { return v; }
  static float from_float(float v) { return v; }
};
template <>
struct Hidden<Ort::Float16_t> {
  static constexpr ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
  static float to_float(Ort::Float16_t v) { return lz::half_to_float(v.val); }
  static Ort::Float16_t from_float(float v) { return Ort::Float16_t::FromBits(lz::float_to_half(v)); }
};

template <class V>
struct MoEKernel {
  std::string node;
  lz::MoEConfig cfg;
  float zeroing_threshold = 0.0f;
  size_t inputs = 5;
  int threshold_index = -1;  // the run-time threshold input (5 in the v1 layout, 9 in v2), -1: none
  bool v1_layout = true;
  lz::WeightFormat format = lz::WeightFormat::f;
  bool input_major = false;  // gate_up_layout "input_major": w_gate, w_up [E, H, F]; inputs 13-14 the thresholds
  bool router = false;       // inputs 15-16: the router's weight and bias (router_logits, input 1, then absent)
  bool chunked = false;      // code_layout "chunk16": the q4 rows in 16-block chunks

  static bool code_type(lz::WeightFormat f, ONNXTensorElementDataType t) {
    return (f == lz::WeightFormat::q8 && t == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8) ||
           (f == lz::WeightFormat::q4 && t == ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8);
  }
  static size_t element_bytes(ONNXTensorElementDataType t) {
    switch (t) {
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32:
        return 4;
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8:
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8:
        return 1;
      default:
        return 2;
    }
  }
  // The reduction length of a matrix's rows from its codes' last dimension (-1 when unknown).
  int64_t reduction(int64_t last) const { return last < 0 ? -1 : (format == lz::WeightFormat::q4 ? 2 * last : last); }
  // What the scales of the quantized weights (E, rows, k) must be, "" when they are.
  static std::string scale_error(const char* name, ONNXTensorElementDataType type, const std::vector<int64_t>& shape,
                                 const std::vector<int64_t>& want) {
    if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) return std::string(name) + " must be float16";
    if (shape.size() != 3) return std::string(name) + " must be rank 3";
    for (size_t i = 0; i < 3; ++i)
      if (shape[i] >= 0 && want[i] >= 0 && shape[i] != want[i])
        return std::string(name) + " must be [" + std::to_string(want[0]) + ", " + std::to_string(want[1]) + ", " +
               std::to_string(want[2]) + "] (one float16 scale per 32-block of each row), not [" +
               std::to_string(shape[0]) + ", " + std::to_string(shape[1]) + ", " + std::to_string(shape[2]) + "]";
    return "";
  }

  // Validates what session creation can know; throws Failure naming the node.
  explicit MoEKernel(const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    node = ki.GetNodeName();
    auto fail = [&](const std::string& what) { throw Failure{ORT_INVALID_ARGUMENT, "ai.layerzero::MoE node '" + node + "': " + what}; };
    inputs = ki.GetInputCount();
    const std::string format_name = attr_string(info, "weight_format", "f");
    if (!lz::parse_weight_format(format_name, &format))
      fail("weight_format='" + format_name + "' is not implemented by liblayerzero_ort.so (f, q8, q4)");
    const int64_t block_size = attr_int(info, "block_size", lz::kQBlock);
    if (block_size != lz::kQBlock)
      fail("block_size=" + std::to_string(block_size) + " is not implemented by liblayerzero_ort.so (32)");
    if (inputs < 5 || inputs > kInputs)
      fail("has " + std::to_string(inputs) + " inputs; this liblayerzero_ort.so implements 5 to 17 (hidden, "
           "router_logits, w_gate, w_up, w_down[, b_gate, b_up, b_down, score_bias, threshold, s_gate, s_up, "
           "s_down, x_thresholds, activation_scale, router_weight, router_bias]): rebuild it (layerzero plugins "
           "build)");
    // 16 or 17 inputs: the router's weight (and bias) at 15-16, the slots before them as the rest of the node
    // has them ("" where absent).
    router = inputs > kRouterWeight;
    const std::string layout = attr_string(info, "gate_up_layout", "output_major");
    if (layout != "output_major" && layout != "input_major")
      fail("gate_up_layout='" + layout + "' is not implemented by liblayerzero_ort.so (output_major, input_major)");
    input_major = layout == "input_major";
    if (const std::string e = lz::parse_code_layout(attr_string(info, "code_layout", "rows"), format_name, &chunked);
        !e.empty())
      fail(e);
    if (input_major && format != lz::WeightFormat::f)
      fail("gate_up_layout='input_major' takes float experts (weight_format='f'), not '" + format_name + "'");
    if (input_major && inputs < kRouterWeight)
      fail("gate_up_layout='input_major' needs 15 inputs (x_thresholds and activation_scale at 13-14; \"\" for "
           "absent ones before them), not " + std::to_string(inputs));
    if (format == lz::WeightFormat::f && !input_major && inputs > kFloatInputs && !router)
      fail("input size " + std::to_string(inputs) + ": weight_format='f' takes 5 to 10 inputs (the scales at "
           "10-12 are for q8 / q4, 13-14 for gate_up_layout='input_major')");
    if (format != lz::WeightFormat::f && inputs != kQuantInputs && !router)
      fail("weight_format='" + format_name + "' needs 13 inputs (the scales s_gate, s_up, s_down at 10-12; \"\" for "
           "absent ones before them), not " + std::to_string(inputs));
    if (inputs == 6) {
      const std::vector<int64_t> sixth = ki.GetInputTypeInfo(5).GetTensorTypeAndShapeInfo().GetShape();
      v1_layout = ki.GetInputName(5) == kThresholdName || sixth.empty();
    } else {
      v1_layout = inputs == 5;
    }
    threshold_index = v1_layout ? (inputs == 6 ? 5 : -1) : (inputs > kThreshold ? int(kThreshold) : -1);
    cfg.top_k = attr_int(info, "top_k", 1);
    const int64_t normalize = attr_int(info, "normalize", 0);
    if (normalize != 0 && normalize != 1) fail("normalize=" + std::to_string(normalize) + " (0 or 1)");
    cfg.normalize = normalize == 1;
    const std::string scoring = attr_string(info, "scoring", "softmax");
    if (!lz::parse_scoring(scoring, &cfg.scoring))
      fail("scoring='" + scoring + "' is not implemented by liblayerzero_ort.so (softmax, sigmoid)");
    const std::string activation = attr_string(info, "activation", "silu");
    if (!lz::parse_activation(activation, &cfg.activation))
      fail("activation='" + activation + "' is not implemented by liblayerzero_ort.so (silu, gelu, relu, swiglu_oai)");
    cfg.activation_alpha = attr_float(info, "activation_alpha", cfg.activation_alpha);
    cfg.activation_limit = attr_float(info, "activation_limit", cfg.activation_limit);
    cfg.n_group = attr_int(info, "n_group", 1);
    cfg.topk_group = attr_int(info, "topk_group", 1);
    cfg.routed_scaling_factor = attr_float(info, "routed_scaling_factor", 1.0f);
    const std::string routing = attr_string(info, "routing", "topk");
    if (routing != "topk") fail("routing='" + routing + "' is not implemented by liblayerzero_ort.so (topk)");
    zeroing_threshold = attr_float(info, "zeroing_threshold", 0.0f);
    if (!(zeroing_threshold >= 0.0f)) fail("zeroing_threshold=" + std::to_string(zeroing_threshold) + " (>= 0)");
    if (cfg.top_k < 1) fail("top_k=" + std::to_string(cfg.top_k) + " (>= 1)");
    // Weight types and static shapes, when ONNX Runtime knows them (initializers: always).
    ONNXTensorElementDataType first = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    std::vector<int64_t> shapes[3];
    for (size_t i = 2; i < 5; ++i) {
      Ort::TypeInfo type = ki.GetInputTypeInfo(i);
      if (type.GetONNXType() != ONNX_TYPE_TENSOR) fail("input " + std::to_string(i) + " is not a tensor");
      auto tensor = type.GetTensorTypeAndShapeInfo();
      lz::WeightType wt;
      if (format != lz::WeightFormat::f) {
        if (!code_type(format, tensor.GetElementType()))
          fail("expert weight input " + std::to_string(i) + " has element type " +
               std::to_string(static_cast<int>(tensor.GetElementType())) + "; weight_format='" + format_name +
               "' codes are " + (format == lz::WeightFormat::q8 ? "int8" : "uint8 (two 4-bit codes a byte)"));
      } else if (!weight_type(tensor.GetElementType(), &wt)) {
        fail("expert weight input " + std::to_string(i) + " has element type " +
             std::to_string(static_cast<int>(tensor.GetElementType())) + " (float32, float16 or bfloat16)");
      }
      if (i == 2) first = tensor.GetElementType();
      else if (tensor.GetElementType() != first) fail("w_gate, w_up and w_down have different element types");
      shapes[i - 2] = tensor.GetShape();
    }
    for (auto& s : shapes)
      if (s.size() != 3) fail("expert weights must be rank 3 ([E, F, H], [E, F, H], [E, H, F])");
    if (input_major && (shapes[0] != shapes[2] || shapes[1] != shapes[2]))
      fail("gate_up_layout='input_major': w_gate, w_up and w_down must all be [E, H, F]");
    const int64_t E = shapes[0][0];
    if (format != lz::WeightFormat::f) {
      // The reduction lengths (H of w_gate / w_up, F of w_down) must be whole 32-blocks: refused, not padded.
      const int64_t H = reduction(shapes[0][2]), F = reduction(shapes[2][2]);
      const char* what[3] = {"w_gate", "w_up", "w_down"};
      for (size_t m = 0; m < 3; ++m) {
        const int64_t k = reduction(shapes[m][2]);
        if (k >= 0 && k % lz::kQBlock != 0)
          fail(std::string(what[m]) + "'s rows have " + std::to_string(k) + " elements, not a multiple of the " +
               "block length 32 (weight_format='" + format_name + "')");
      }
      // The scales, when ONNX Runtime holds them as initializers (else checked when they are read).
      const char* names[3] = {"s_gate", "s_up", "s_down"};
      const std::vector<int64_t> want[3] = {{E, shapes[0][1], H < 0 ? -1 : H / lz::kQBlock},
                                            {E, shapes[1][1], H < 0 ? -1 : H / lz::kQBlock},
                                            {E, shapes[2][1], F < 0 ? -1 : F / lz::kQBlock}};
      for (size_t m = 0; m < 3; ++m) {
        int is_constant = 0;
        const OrtValue* value = nullptr;
        OrtStatus* st = Ort::GetApi().KernelInfoGetConstantInput_tensor(info, kScales + m, &is_constant, &value);
        if (st != nullptr) {
          Ort::GetApi().ReleaseStatus(st);
          continue;
        }
        if (!is_constant || value == nullptr) continue;
        auto shape = Ort::ConstValue(value).GetTensorTypeAndShapeInfo();
        const std::string err = scale_error(names[m], shape.GetElementType(), shape.GetShape(), want[m]);
        if (!err.empty()) fail(err);
      }
    }
    if (E > 0 && cfg.top_k > E) fail("top_k=" + std::to_string(cfg.top_k) + " > " + std::to_string(E) + " experts");
    if (E > 0 && !lz::group_error(cfg, E).empty()) fail(lz::group_error(cfg, E));
    // The expert weights are initializers ONNX Runtime has placed by now: back them with huge pages in place.
    for (size_t i = 2; i < (format == lz::WeightFormat::f ? 5u : kQuantInputs); ++i) {
      if (i >= 5 && i < kScales) continue;
      int is_constant = 0;
      const OrtValue* value = nullptr;
      OrtStatus* s = Ort::GetApi().KernelInfoGetConstantInput_tensor(info, i, &is_constant, &value);
      if (s != nullptr) {
        Ort::GetApi().ReleaseStatus(s);
        continue;
      }
      if (!is_constant || value == nullptr) continue;
      Ort::ConstValue tensor(value);
      auto shape = tensor.GetTensorTypeAndShapeInfo();
      lz::advise_huge_pages(tensor.GetTensorRawData(), shape.GetElementCount() * element_bytes(shape.GetElementType()));
    }
    // The v2 optional inputs (biases, score_bias) are checked when they are read: the kernel info of an
    // optional input after an absent one did not report its element type reliably (ONNX Runtime 1.32).
  }

  // Input i of the v2 layout when present (nullptr: absent, or the v1 layout).
  static const void* optional_input(Ort::KernelContext& ctx, size_t i, bool v1, const std::vector<int64_t>& shape,
                                    lz::WeightType* type, const std::function<void(const std::string&)>& fail,
                                    const char* name) {
    if (v1 || ctx.GetInputCount() <= i) return nullptr;
    Ort::ConstValue v = ctx.GetInput(i);
    if (v == nullptr) return nullptr;
    auto info = v.GetTensorTypeAndShapeInfo();
    if (!weight_type(info.GetElementType(), type)) fail(std::string(name) + " must be float32, float16 or bfloat16");
    if (info.GetShape() != shape) {
      std::string want;
      for (int64_t d : shape) want += (want.empty() ? "" : ", ") + std::to_string(d);
      fail(std::string(name) + " must be [" + want + "]");
    }
    return v.GetTensorRawData();
  }

  static int64_t attr_int(const OrtKernelInfo* info, const char* name, int64_t fallback) {
    int64_t v = fallback;
    OrtStatus* s = Ort::GetApi().KernelInfoGetAttribute_int64(info, name, &v);
    if (s != nullptr) Ort::GetApi().ReleaseStatus(s);
    return v;
  }
  static float attr_float(const OrtKernelInfo* info, const char* name, float fallback) {
    float v = fallback;
    OrtStatus* s = Ort::GetApi().KernelInfoGetAttribute_float(info, name, &v);
    if (s != nullptr) Ort::GetApi().ReleaseStatus(s);
    return v;
  }
  static std::string attr_string(const OrtKernelInfo* info, const char* name, const char* fallback) {
    size_t size = 0;
    OrtStatus* s = Ort::GetApi().KernelInfoGetAttribute_string(info, name, nullptr, &size);
    if (s != nullptr) {
      Ort::GetApi().ReleaseStatus(s);
      if (size == 0) return fallback;
    }
    std::string v(size, '\0');
    s = Ort::GetApi().KernelInfoGetAttribute_string(info, name, v.data(), &size);
    if (s != nullptr) {
      Ort::GetApi().ReleaseStatus(s);
      return fallback;
    }
    v.resize(size > 0 ? size - 1 : 0);  // size counts the terminating NUL
    return v;
  }

  void compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto fail = [&](const std::string& what) { throw Failure{ORT_INVALID_ARGUMENT, "ai.layerzero::MoE node '" + node + "': " + what}; };
    Ort::ConstValue hidden = ctx.GetInput(0), logits = ctx.GetInput(1);
    Ort::ConstValue wg = ctx.GetInput(2), wu = ctx.GetInput(3), wd = ctx.GetInput(4);
    Ort::ConstValue rw = router ? ctx.GetInput(kRouterWeight) : Ort::ConstValue(nullptr);
    if ((logits == nullptr) == (rw == nullptr))
      fail(logits == nullptr ? "needs router_logits (input 1) or router_weight (input 15)"
                             : "takes router_logits (input 1) or router_weight (input 15), not both");
    const std::vector<int64_t> hs = hidden.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> gs = wg.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> us = wu.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> ds = wd.GetTensorTypeAndShapeInfo().GetShape();
    if (gs.size() != 3 || ds.size() != 3) fail("w_gate must be [E, F, H], w_down [E, H, F]");
    const int64_t E = gs[0], F = input_major ? gs[2] : gs[1], H = input_major ? gs[1] : reduction(gs[2]);
    if (input_major && (us != gs || ds != gs)) fail("w_gate, w_up, w_down [E, H, F] expected (input_major)");
    if (!input_major && (us != gs || ds != std::vector<int64_t>{E, H, format == lz::WeightFormat::q4 ? F / 2 : F} ||
        (format == lz::WeightFormat::q4 && F % 2 != 0)))
      fail(format == lz::WeightFormat::f    ? "expert weights [E, F, H], [E, F, H], [E, H, F] expected"
           : format == lz::WeightFormat::q8 ? "expert weight codes [E, F, H], [E, F, H], [E, H, F] expected (q8)"
                                            : "expert weight codes [E, F, H/2], [E, F, H/2], [E, H, F/2] (q4)");
    if (format != lz::WeightFormat::f && (H % lz::kQBlock != 0 || F % lz::kQBlock != 0))
      fail("H=" + std::to_string(H) + ", F=" + std::to_string(F) + ": not multiples of the block length 32");
    if (hs.size() < 1 || hs.back() != H) fail("hidden's last dimension is not " + std::to_string(H));
    int64_t T = 1;
    for (size_t i = 0; i + 1 < hs.size(); ++i) T *= hs[i];
    if (logits != nullptr) {
      const std::vector<int64_t> ls = logits.GetTensorTypeAndShapeInfo().GetShape();
      if (ls.size() < 1 || ls.back() != E || logits.GetTensorTypeAndShapeInfo().GetElementCount() != size_t(T * E))
        fail("router_logits must be [" + std::to_string(T) + ", " + std::to_string(E) + "]");
    }
    // The router in the op: logits[t, e] = sum_h hidden[t, h] * router_weight[e, h] (+ router_bias[e]), float32.
    const float* router_w = nullptr;
    const float* router_b = nullptr;
    if (rw != nullptr) {
      auto info = rw.GetTensorTypeAndShapeInfo();
      if (info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || info.GetShape() != std::vector<int64_t>{E, H})
        fail("router_weight (input 15) must be float32 [" + std::to_string(E) + ", " + std::to_string(H) + "]");
      router_w = rw.GetTensorData<float>();
      if (ctx.GetInputCount() > kRouterBias) {
        Ort::ConstValue rb = ctx.GetInput(kRouterBias);
        if (rb != nullptr) {
          auto bi = rb.GetTensorTypeAndShapeInfo();
          if (bi.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || bi.GetShape() != std::vector<int64_t>{E})
            fail("router_bias (input 16) must be float32 [" + std::to_string(E) + "]");
          router_b = rb.GetTensorData<float>();
        }
      }
    }
    if (cfg.top_k > E) fail("top_k=" + std::to_string(cfg.top_k) + " > " + std::to_string(E) + " experts");
    if (!lz::group_error(cfg, E).empty()) fail(lz::group_error(cfg, E));
    float threshold = zeroing_threshold;
    if (threshold_index >= 0 && ctx.GetInputCount() > size_t(threshold_index)) {
      Ort::ConstValue thr = ctx.GetInput(size_t(threshold_index));
      if (thr != nullptr) {
        if (thr.GetTensorTypeAndShapeInfo().GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT ||
            thr.GetTensorTypeAndShapeInfo().GetElementCount() != 1)
          fail("threshold input must be a float32 scalar");
        threshold = *thr.GetTensorData<float>();
        if (!(threshold >= 0.0f)) fail("threshold " + std::to_string(threshold) + " < 0");
      }
    }
    // input_major: the activation thresholds (x channel i dropped when |x_i| <= x_thresholds[i] * scale).
    std::vector<float> x_limit;
    if (input_major) {
      Ort::ConstValue tv = ctx.GetInput(kXThresholds);
      Ort::ConstValue sv = ctx.GetInput(kXScale);
      if (tv == nullptr || sv == nullptr) fail("x_thresholds and activation_scale (inputs 13-14) are required");
      auto ti = tv.GetTensorTypeAndShapeInfo();
      auto si = sv.GetTensorTypeAndShapeInfo();
      if (ti.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || ti.GetElementCount() != size_t(H))
        fail("x_thresholds must be float32 [" + std::to_string(H) + "]");
      if (si.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || si.GetElementCount() != 1)
        fail("activation_scale must be a float32 scalar");
      const float scale = *sv.GetTensorData<float>();
      if (!(scale >= 0.0f) || std::isinf(scale)) fail("activation_scale " + std::to_string(scale) + " (finite, >= 0)");
      const float* t = tv.GetTensorData<float>();
      x_limit.resize(size_t(H));
      for (int64_t i = 0; i < H; ++i) {
        if (!(t[i] >= 0.0f) || std::isinf(t[i])) fail("x_thresholds must be finite and >= 0");
        x_limit[i] = t[i] * scale;
      }
    }
    Ort::UnownedValue y = ctx.GetOutput(0, hs);
    Ort::UnownedValue mask = ctx.GetOutput(1, std::vector<int64_t>{T, E});
    int64_t* kept = nullptr;
    if (ctx.GetOutputCount() > 2) {
      Ort::UnownedValue kv = ctx.GetOutput(2, std::vector<int64_t>(hs.begin(), hs.end() - 1));
      if (kv != nullptr) kept = kv.GetTensorMutableData<int64_t>();
    }
    float* confidence = nullptr;
    if (ctx.GetOutputCount() > kConfidence) {
      Ort::UnownedValue cv = ctx.GetOutput(kConfidence, std::vector<int64_t>{T});
      if (cv != nullptr) confidence = cv.GetTensorMutableData<float>();
    }
    lz::MoEWeights w;
    w.format = format;
    w.chunked = chunked;
    w.input_major = input_major;
    w.x_limit = input_major ? x_limit.data() : nullptr;
    if (format == lz::WeightFormat::f) {
      weight_type(wg.GetTensorTypeAndShapeInfo().GetElementType(), &w.type);
    } else {
      const char* names[3] = {"s_gate", "s_up", "s_down"};
      const std::vector<int64_t> want[3] = {{E, F, H / lz::kQBlock}, {E, F, H / lz::kQBlock}, {E, H, F / lz::kQBlock}};
      const uint16_t* scales[3] = {};
      for (size_t m = 0; m < 3; ++m) {
        Ort::ConstValue v = ctx.GetInput(kScales + m);
        if (v == nullptr) fail(std::string(names[m]) + " (input " + std::to_string(kScales + m) + ") is absent");
        auto info = v.GetTensorTypeAndShapeInfo();
        const std::string err = scale_error(names[m], info.GetElementType(), info.GetShape(), want[m]);
        if (!err.empty()) fail(err);
        scales[m] = static_cast<const uint16_t*>(v.GetTensorRawData());
      }
      w.s_gate = scales[0];
      w.s_up = scales[1];
      w.s_down = scales[2];
    }
    w.gate = wg.GetTensorRawData();
    w.up = wu.GetTensorRawData();
    w.down = wd.GetTensorRawData();
    w.experts = E;
    w.ffn = F;
    w.hidden = H;
    const std::function<void(const std::string&)> fail_fn = fail;
    w.b_gate = optional_input(ctx, 5, v1_layout, {E, F}, &w.b_gate_type, fail_fn, "b_gate");
    w.b_up = optional_input(ctx, 6, v1_layout, {E, F}, &w.b_up_type, fail_fn, "b_up");
    w.b_down = optional_input(ctx, 7, v1_layout, {E, H}, &w.b_down_type, fail_fn, "b_down");
    lz::WeightType sb_type = lz::WeightType::f32;
    const void* sb = optional_input(ctx, kScoreBias, v1_layout, {E}, &sb_type, fail_fn, "score_bias");
    std::vector<float> score_bias;
    if (sb != nullptr) {
      score_bias.resize(size_t(E));
      for (int64_t e = 0; e < E; ++e) score_bias[e] = lz::load_element(sb, sb_type, e);
    }

    const V* x = hidden.GetTensorData<V>();
    std::vector<float> lf, xf, yf;
    const float* logits_f = nullptr;
    const float* x_f;
    float* y_f;
    if constexpr (std::is_same_v<V, float>) {
      if (logits != nullptr) logits_f = logits.GetTensorData<float>();
      x_f = x;
      y_f = y.GetTensorMutableData<float>();
    } else {
      xf.resize(size_t(T * H));
      yf.resize(size_t(T * H));
      if (logits != nullptr) {
        const V* l = logits.GetTensorData<V>();
        lf.resize(size_t(T * E));
        for (size_t i = 0; i < lf.size(); ++i) lf[i] = Hidden<V>::to_float(l[i]);
        logits_f = lf.data();
      }
      for (size_t i = 0; i < xf.size(); ++i) xf[i] = Hidden<V>::to_float(x[i]);
      x_f = xf.data();
      y_f = yf.data();
    }
    if (router_w != nullptr) {  // the router's row dots (float kernels of the experts), then its bias
      lf.resize(size_t(T * E));
      lz::dot_kernels().by_type[static_cast<int>(lz::WeightType::f32)](router_w, E, H, x_f, T, H, lf.data(), E);
      if (router_b != nullptr)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t e = 0; e < E; ++e) lf[size_t(t * E + e)] += router_b[e];
      logits_f = lf.data();
    }
    if (confidence != nullptr) lz::routing_confidence(logits_f, T, E, cfg.scoring, confidence);
    std::vector<float> weights;
    uint8_t* m = reinterpret_cast<uint8_t*>(mask.GetTensorMutableData<bool>());
    lz::route(logits_f, T, E, cfg, threshold, sb != nullptr ? score_bias.data() : nullptr, &weights, m);
    lz::ParallelFor parallel_for = [&ctx](size_t total, const std::function<void(size_t)>& fn) {
      if (total == 0) return;
      if (total == 1) {
        fn(0);
        return;
      }
      ctx.ParallelFor(
          [](void* data, size_t i) { (*static_cast<const std::function<void(size_t)>*>(data))(i); }, total, 0,
          const_cast<void*>(static_cast<const void*>(&fn)));
    };
    lz::run_experts(x_f, T, w, cfg, weights, m, y_f, parallel_for, kept);
    if constexpr (!std::is_same_v<V, float>) {
      V* out = y.GetTensorMutableData<V>();
      for (size_t i = 0; i < yf.size(); ++i) out[i] = Hidden<V>::from_float(yf[i]);
    }
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return guarded(ORT_RUNTIME_EXCEPTION, [&] { compute(context); });  // (Ort::Exception is a std::exception)
  }
};

template <class V>
struct MoEOp : Ort::CustomOpBase<MoEOp<V>, MoEKernel<V>, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    return guarded(ORT_INVALID_ARGUMENT, [&] { *kernel = new MoEKernel<V>(info); });
  }
  const char* GetName() const { return kOpName; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return kInputs; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (i <= 1) return Hidden<V>::type;
    if (i == kThreshold || i == kXThresholds || i == kXScale || i == kRouterWeight || i == kRouterBias)
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    // the scales (10-12): float16, checked when the kernel is created (a float format node with 11-13 inputs is
    // refused there too, with its count)
    // expert weights, biases, score_bias: float32, float16 or bfloat16 (checked when the kernel is created);
    // input 5: b_gate, or the v1 layout's threshold
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 5 || i == 1 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;  // 1: or router_weight (15)
  }
  size_t GetOutputTypeCount() const { return 4; }
  ONNXTensorElementDataType GetOutputType(size_t i) const {
    return i == 0   ? Hidden<V>::type
           : i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL
           : i == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64
                    : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  // kept [T...] int64 (2): the x channels each token keeps (H without activation thresholds); confidence [T]
  // float32 (3): each token's top-1 routing probability (ReduceMax of the scores).
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return i >= 2 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
};

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) return nullptr;  // cannot even build a status: ONNX Runtime older than API 21
  Ort::InitApi(api);
  static MoEOp<float> op_f32;
  static MoEOp<Ort::Float16_t> op_f16;
  // One domain object per registration (ONNX Runtime keeps a pointer); released at exit.
  static std::mutex lock;
  static std::vector<Ort::CustomOpDomain> domains;
  try {
    Ort::CustomOpDomain domain(kDomain);
    domain.Add(&op_f32);
    domain.Add(&op_f16);
    domain.Add(lz::sparse_linear_op());  // ai.layerzero::SparseLinear (sparse_linear.cpp)
    domain.Add(lz::qlinear_op());  // ai.layerzero::QLinear (sparse_linear.cpp)
    domain.Add(lz::attention_op());  // ai.layerzero::Attention (attention.cpp)
    Ort::UnownedSessionOptions(options).Add(domain);
    std::lock_guard<std::mutex> guard(lock);
    domains.push_back(std::move(domain));
  } catch (const Ort::Exception& e) {
    return api->CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}

// The kernel ISA this process uses (for benchmarks and tests).
extern "C" __attribute__((visibility("default"))) const char* LayerZeroOrtIsa() { return lz::dot_kernels().isa; }
// The quantized (q8 / q4) kernels' ISA: avx512vnni, avx2 or generic.
extern "C" __attribute__((visibility("default"))) const char* LayerZeroOrtQuantIsa() { return lz::qdot_kernels().isa; }
// 1 when the quantized row kernels prefetch their rows' codes (LAYERZERO_ORT_PREFETCH; off for AVX2 on AMD CPUs).
extern "C" __attribute__((visibility("default"))) int LayerZeroOrtQuantPrefetch() {
  return lz::qdot_kernels().prefetch ? 1 : 0;
}

// Benchmarks (bench/moe.py): the kernels' read pattern over n regions without their arithmetic, i.e. how fast this
// core streams the bytes a call reads at best; and huge pages for a buffer, as the kernel gives the weights.
extern "C" __attribute__((visibility("default"))) float LayerZeroOrtStreamRead(const void* const* regions,
                                                                               const int64_t* bytes, int64_t n) {
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) total += lz::dot_kernels().stream_read(regions[i], bytes[i]);
  return total;
}
extern "C" __attribute__((visibility("default"))) size_t LayerZeroOrtAdviseHugePages(const void* data, size_t bytes) {
  return lz::advise_huge_pages(data, bytes);
}

#ifndef LZ_SOURCE_STAMP
#define LZ_SOURCE_STAMP ""
#endif
// The stamp of the sources this library was built from (CMakeLists.txt), also as bytes of the file after a marker:
// plugins/ort_library.py reads it there before registering the library, without loading it (a library loaded
// once stays mapped under its path: a check that loaded a stale build would read the old stamp, and hand ONNX
// Runtime the old code, after a rebuild in the same process).
#define LZ_STAMP_MARKER "layerzero-ort-source-stamp:"
__attribute__((used)) static const char kSourceStampMarker[] = LZ_STAMP_MARKER LZ_SOURCE_STAMP;
extern "C" __attribute__((visibility("default"))) const char* LayerZeroOrtSourceStamp() {
  return kSourceStampMarker + sizeof(LZ_STAMP_MARKER) - 1;
}

// Tests (tests/plugins/test_ort_quant.py): one token's x [k] quantized per 32-block as the kernels quantize it,
// by the best kernels the CPU runs (portable 0) or the portable ones (1), for q4 rows in chunks when layout is 1
// (code_layout); q [k] int8 in element order (not the kernels' q4 order), d and off [k / 32]. Returns 0, or -1 for
// bits not 8 / 4 or k not a multiple of 32.
extern "C" __attribute__((visibility("default"))) int LayerZeroOrtQuantizeToken(const float* x, int64_t k, int bits,
                                                                               int layout, int portable, int8_t* q,
                                                                               float* d, int32_t* off) {
  if ((bits != 8 && bits != 4) || k % lz::kQBlock != 0 || k < 0) return -1;
  const int64_t kp = (k + lz::kQPad - 1) / lz::kQPad * lz::kQPad, nb = k / lz::kQBlock;
  std::vector<int8_t> qs(static_cast<size_t>(kp));
  std::vector<float> ds(static_cast<size_t>(kp / lz::kQBlock));
  std::vector<int32_t> os(ds.size());
  const lz::QTokens xq{qs.data(), ds.data(), os.data(), kp, kp / lz::kQBlock,
                       layout == 1 && bits == 4 ? lz::q4_chunked_blocks(k) : 0};
  (portable ? lz::generic::kQKernels : lz::qdot_kernels()).quantize(x, 0, nb, bits, xq, 0);
  for (int64_t b = 0; b < nb; ++b) {
    d[b] = ds[static_cast<size_t>(b)];
    off[b] = os[static_cast<size_t>(b)];
    for (int64_t j = 0; j < lz::kQBlock; ++j) q[b * lz::kQBlock + j] = qs[static_cast<size_t>(lz::q_position(bits, xq.chunked, b, j))];
  }
  return 0;
}

// Tests (tests/plugins/test_ort_quant.py): the quantized row kernel alone. x [tokens, k] float is quantized per
// 32-block as the op quantizes it; out[t * rows + r] = the row dot of codes row r (q8 [rows, k] int8, q4
// [rows, k / 2] uint8; in 16-block chunks when layout is 1: code_layout) with scales [rows, k / 32] (float16 bits).
// Returns 0, or -1 for bits not 8 / 4 or k not a multiple of 32.
extern "C" __attribute__((visibility("default"))) int LayerZeroOrtQDotRows(const void* codes, const uint16_t* scales,
                                                                          int64_t rows, int64_t k, int bits,
                                                                          int layout, const float* x, int64_t tokens,
                                                                          float* out) {
  if ((bits != 8 && bits != 4) || k % lz::kQBlock != 0 || rows < 0 || tokens < 0) return -1;
  const int64_t kp = (k + lz::kQPad - 1) / lz::kQPad * lz::kQPad;
  std::vector<int8_t> q(static_cast<size_t>(tokens * kp));
  std::vector<float> d(static_cast<size_t>(tokens * kp / lz::kQBlock));
  std::vector<int32_t> off(d.size());
  const lz::QTokens xq{q.data(), d.data(), off.data(), kp, kp / lz::kQBlock,
                       layout == 1 && bits == 4 ? lz::q4_chunked_blocks(k) : 0};
  for (int64_t t = 0; t < tokens; ++t) lz::quantize_token(x + t * k, k, bits, xq, t);
  (bits == 4 ? lz::qdot_kernels().q4 : lz::qdot_kernels().q8)(codes, scales, rows, k, xq, tokens, out, rows);
  return 0;
}
