// ai.layerzero::Attention for ONNX Runtime's CPU provider (the op and its semantics: attention.h).
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "pool.h"

namespace lz {
namespace {

constexpr const char* kName = "Attention";
constexpr int64_t kRowBlock = 64;  // query rows whose scores are held at once (a [64, L] float buffer)

struct Refusal {
  OrtErrorCode code;
  std::string message;
};

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out;
  for (int64_t d : s) out += (out.empty() ? "" : ", ") + std::to_string(d);
  return "[" + out + "]";
}

// exp(x) for x <= 0 (x - max of a softmax row; no NaN), branch-free so that a loop over a row vectorises: the
// Cody-Waite reduction x = n ln2 + r (|r| <= ln2 / 2) and a degree-7 Taylor polynomial of e^r (relative error
// below 2e-8 before rounding), times 2^n through the exponent bits; exactly 0 below -87.3 (where float32's normal
// range ends; -inf included).
inline float exp_nonpositive(float x) {
  const bool tiny = x < -87.3f;
  const float xc = tiny ? -87.3f : x;
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest (|n| <= 126)
  const float r = (xc - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return tiny ? 0.0f : p * two_n;
}

// One (batch, kv head) pair's query rows [r0, r1) (row = head-in-group * T + t): scores against every key, the
// softmax, the weighted sum of the values. The keys and values are read once per block of rows (each key / value
// row then serves every query row of the block from L1). Compiled for AVX-512, AVX2 and the baseline; the loader
// picks one (GCC's target_clones).
struct Rows {
  const float* q;       // [B, H, T, D]
  const float* kg;      // this pair's keys [L, D]
  const float* vg;      // its values [L, Dv]
  const float* mask;    // nullptr, or at (b, 0, 0, 0) with strides mh, mt, ml
  int64_t mh, mt, ml;
  int64_t b, g, r, H, T, D, L, Dv;
  float q_scale, k_scale;
  bool bthd;
  float* o;
};

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) void attend_rows(
    const Rows& a, int64_t r0, int64_t r1, float* qs, float* s) {
  const int64_t n = r1 - r0, D = a.D, L = a.L, Dv = a.Dv;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = r0 + i, h = a.g * a.r + row / a.T, t = row % a.T;
    const float* qr = a.q + ((a.b * a.H + h) * a.T + t) * D;
    for (int64_t d = 0; d < D; ++d) qs[i * D + d] = qr[d] * a.q_scale;
  }
  for (int64_t l = 0; l < L; ++l) {
    const float* kl = a.kg + l * D;
    for (int64_t i = 0; i < n; ++i) {
      const float* qi = qs + i * D;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t d = 0;
      for (; d + 8 <= D; d += 8)
        for (int j = 0; j < 8; ++j) acc[j] += qi[d + j] * kl[d + j];
      float dot = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
      for (; d < D; ++d) dot += qi[d] * kl[d];
      s[i * L + l] = dot * a.k_scale;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = r0 + i, h = a.g * a.r + row / a.T, t = row % a.T;
    float* sr = s + i * L;
    if (a.mask != nullptr) {
      const float* mr = a.mask + h * a.mh + t * a.mt;
      for (int64_t l = 0; l < L; ++l) sr[l] += mr[l * a.ml];
    }
    float m = sr[0];
    bool nan = false;
    for (int64_t l = 0; l < L; ++l) {
      m = sr[l] > m ? sr[l] : m;
      nan |= sr[l] != sr[l];
    }
    float* out = a.bthd ? a.o + ((a.b * a.T + t) * a.H + h) * Dv : a.o + ((a.b * a.H + h) * a.T + t) * Dv;
    for (int64_t d = 0; d < Dv; ++d) out[d] = 0.0f;
    if (nan || !(m > -INFINITY) || !(m < INFINITY)) {  // softmax NaN everywhere: the row is 0
      for (int64_t l = 0; l < L; ++l) sr[l] = 0.0f;
      continue;
    }
    float sum = 0.0f;
    for (int64_t l = 0; l < L; ++l) {
      sr[l] = exp_nonpositive(sr[l] - m);
      sum += sr[l];
    }
    const float inv = 1.0f / sum;
    for (int64_t l = 0; l < L; ++l) sr[l] *= inv;
  }
  for (int64_t l = 0; l < L; ++l) {
    const float* vl = a.vg + l * Dv;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = r0 + i, h = a.g * a.r + row / a.T, t = row % a.T;
      float* out = a.bthd ? a.o + ((a.b * a.T + t) * a.H + h) * Dv : a.o + ((a.b * a.H + h) * a.T + t) * Dv;
      const float p = s[i * L + l];
      for (int64_t d = 0; d < Dv; ++d) out[d] += p * vl[d];
    }
  }
}

struct AttentionKernel {
  std::string node;
  float q_scale = 1.0f, k_scale = 1.0f;
  bool bthd = false;

  [[noreturn]] void fail(OrtErrorCode code, const std::string& what) const {
    throw Refusal{code, "ai.layerzero::Attention node '" + node + "': " + what};
  }

  explicit AttentionKernel(const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    node = ki.GetNodeName();
    auto float_attr = [&](const char* name) {
      try {
        return ki.GetAttribute<float>(name);
      } catch (const Ort::Exception&) {
        return 1.0f;
      }
    };
    q_scale = float_attr("q_scale");
    k_scale = float_attr("k_scale");
    std::string layout = "bhtd";
    try {
      layout = ki.GetAttribute<std::string>("output_layout");
    } catch (const Ort::Exception&) {
    }
    if (layout != "bhtd" && layout != "bthd")
      fail(ORT_INVALID_ARGUMENT, "output_layout='" + layout + "' is not implemented (bhtd, bthd)");
    bthd = layout == "bthd";
    const size_t inputs = ki.GetInputCount();
    if (inputs < 3 || inputs > 4) fail(ORT_INVALID_ARGUMENT, "takes 3 or 4 inputs (q, k, v[, mask]), not " +
                                                                 std::to_string(inputs));
    for (size_t i = 0; i < inputs; ++i) {
      Ort::TypeInfo type = ki.GetInputTypeInfo(i);
      if (type.GetONNXType() != ONNX_TYPE_TENSOR ||
          type.GetTensorTypeAndShapeInfo().GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
        fail(ORT_INVALID_ARGUMENT, "input " + std::to_string(i) + " must be a float32 tensor");
    }
  }

  void compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    Ort::ConstValue qv = ctx.GetInput(0), kv = ctx.GetInput(1), vv = ctx.GetInput(2);
    const std::vector<int64_t> qs = qv.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> ks = kv.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> vs = vv.GetTensorTypeAndShapeInfo().GetShape();
    if (qs.size() != 4 || ks.size() != 4 || vs.size() != 4)
      fail(ORT_INVALID_ARGUMENT, "q, k and v must be rank 4, not " + shape_text(qs) + ", " + shape_text(ks) + ", " +
                                     shape_text(vs));
    const int64_t B = qs[0], H = qs[1], T = qs[2], D = qs[3];
    const int64_t Bk = ks[0], Hk = ks[1], L = ks[2], Dv = vs[3];
    if (ks[3] != D || vs[0] != Bk || vs[1] != Hk || vs[2] != L)
      fail(ORT_INVALID_ARGUMENT, "shapes q " + shape_text(qs) + ", k " + shape_text(ks) + ", v " + shape_text(vs) +
                                     " do not fit ([B, H, T, D], [B, Hk, L, D], [B, Hk, L, Dv])");
    if (!(Bk == B || Bk == 1)) fail(ORT_INVALID_ARGUMENT, "k's batch " + std::to_string(Bk) + " is neither q's nor 1");
    if (Hk <= 0 ? H != 0 : H % Hk != 0)
      fail(ORT_INVALID_ARGUMENT, "q's heads " + std::to_string(H) + " are not a multiple of k's " + std::to_string(Hk));
    // The mask's strides over [B, H, T, L] (0 where it broadcasts).
    const float* mask = nullptr;
    int64_t mstride[4] = {0, 0, 0, 0};
    if (ctx.GetInputCount() > 3) {
      Ort::ConstValue mv = ctx.GetInput(3);
      if (mv != nullptr) {
        const std::vector<int64_t> ms = mv.GetTensorTypeAndShapeInfo().GetShape();
        const int64_t full[4] = {B, H, T, L};
        if (ms.size() > 4) fail(ORT_INVALID_ARGUMENT, "the mask's rank is above 4: " + shape_text(ms));
        int64_t stride = 1;
        for (size_t j = 0; j < ms.size(); ++j) {
          const size_t axis = 3 - j, m = ms.size() - 1 - j;
          if (ms[m] != 1 && ms[m] != full[axis])
            fail(ORT_INVALID_ARGUMENT, "the mask " + shape_text(ms) + " does not broadcast to [B, H, T, L] = " +
                                           shape_text({B, H, T, L}));
          mstride[axis] = ms[m] == 1 ? 0 : stride;
          stride *= ms[m];
        }
        mask = mv.GetTensorData<float>();
      }
    }
    std::vector<int64_t> os = bthd ? std::vector<int64_t>{B, T, H, Dv} : std::vector<int64_t>{B, H, T, Dv};
    float* o = ctx.GetOutput(0, os).GetTensorMutableData<float>();
    if (B == 0 || H == 0 || T == 0 || Dv == 0) return;
    if (L == 0) {
      std::fill(o, o + B * H * T * Dv, 0.0f);
      return;
    }
    const float* q = qv.GetTensorData<float>();
    const float* k = kv.GetTensorData<float>();
    const float* v = vv.GetTensorData<float>();
    const int64_t r = H / Hk;
    const int64_t items = B * Hk;
    // One (batch, kv head) pair: its r * T query rows (contiguous in q), in blocks of kRowBlock rows.
    const std::function<void(size_t)> work = [&](size_t item) {
      const int64_t b = int64_t(item) / Hk, g = int64_t(item) % Hk, bk = Bk == 1 ? 0 : b;
      Rows a{q, k + (bk * Hk + g) * L * D, v + (bk * Hk + g) * L * Dv, nullptr, 0, 0, 0, b, g, r, H, T, D, L, Dv,
             q_scale, k_scale, bthd, o};
      if (mask != nullptr) {
        a.mask = mask + b * mstride[0];
        a.mh = mstride[1];
        a.mt = mstride[2];
        a.ml = mstride[3];
      }
      const int64_t rows = r * T, block = std::min(rows, kRowBlock);
      std::vector<float> qs(static_cast<size_t>(block * D)), s(static_cast<size_t>(block * L));
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) attend_rows(a, r0, std::min(rows, r0 + kRowBlock), qs.data(),
                                                                   s.data());
    };
    parallel_items(ctx, static_cast<size_t>(items), work);
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    try {
      compute(context);
      return nullptr;
    } catch (const Refusal& f) {
      return Ort::GetApi().CreateStatus(f.code, f.message.c_str());
    } catch (const std::exception& e) {
      return Ort::GetApi().CreateStatus(ORT_RUNTIME_EXCEPTION, e.what());
    }
  }
};

struct AttentionOp : Ort::CustomOpBase<AttentionOp, AttentionKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    try {
      *kernel = new AttentionKernel(info);
      return nullptr;
    } catch (const Refusal& f) {
      return Ort::GetApi().CreateStatus(f.code, f.message.c_str());
    } catch (const std::exception& e) {
      return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, e.what());
    }
  }
  const char* GetName() const { return kName; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 4; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 3 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* attention_op() {
  static AttentionOp op;
  return &op;
}

}  // namespace lz
