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
#include <limits>
#include <string>
#include <vector>

#include "fast_exp.h"
#include "pool.h"
#include "status.h"

namespace lz {
namespace {

constexpr const char* kName = "Attention";
constexpr int64_t kRowBlock = 64;  // query rows whose scores are held at once (a [64, L] float buffer)
constexpr size_t kMask = 3, kQNorm = 6, kCos = 8, kPositions = 10, kBshInputs = 11;  // input_layout "bsh"'s inputs

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out;
  for (int64_t d : s) out += (out.empty() ? "" : ", ") + std::to_string(d);
  return "[" + out + "]";
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
  // mask_form "padding_causal": batch b's attention mask [L] (nullptr: none); key l is visible to query t when
  // am[l] != 0 and l <= causal + t (causal = L - T), else float32 lowest is added (the exporters' mask, per row)
  const int64_t* am = nullptr;
  int64_t causal = 0;
};

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) void attend_rows(
    const Rows& a, int64_t r0, int64_t r1, float* qs, float* s) {
  const int64_t n = r1 - r0, D = a.D, L = a.L, Dv = a.Dv;
  // Each row's output and mask rows, found once (not per key: a division per (key, row) cost more than the dots).
  float* outs[kRowBlock];
  const float* masks[kRowBlock];
  int64_t limits[kRowBlock];  // padding_causal: each row's last visible key
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = r0 + i, h = a.g * a.r + row / a.T, t = row % a.T;
    const float* qr = a.q + ((a.b * a.H + h) * a.T + t) * D;
    for (int64_t d = 0; d < D; ++d) qs[i * D + d] = qr[d] * a.q_scale;
    outs[i] = a.bthd ? a.o + ((a.b * a.T + t) * a.H + h) * Dv : a.o + ((a.b * a.H + h) * a.T + t) * Dv;
    masks[i] = a.mask != nullptr ? a.mask + h * a.mh + t * a.mt : nullptr;
    limits[i] = a.causal + t;
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
    float* sr = s + i * L;
    if (const float* mr = masks[i]; mr != nullptr) {
      if (a.ml == 1)
        for (int64_t l = 0; l < L; ++l) sr[l] += mr[l];
      else
        for (int64_t l = 0; l < L; ++l) sr[l] += mr[l * a.ml];
    } else if (a.am != nullptr) {
      const float hidden = std::numeric_limits<float>::lowest();
      for (int64_t l = 0; l < L; ++l) sr[l] += a.am[l] != 0 && l <= limits[i] ? 0.0f : hidden;
    }
    float m = sr[0];
    bool nan = false;
    for (int64_t l = 0; l < L; ++l) {
      m = sr[l] > m ? sr[l] : m;
      nan |= sr[l] != sr[l];
    }
    float* out = outs[i];
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
      float* __restrict out = outs[i];
      const float p = s[i * L + l];
      for (int64_t d = 0; d < Dv; ++d) out[d] += p * vl[d];
    }
  }
}

struct AttentionKernel {
  std::string node;
  float q_scale = 1.0f, k_scale = 1.0f;
  bool bthd = false;
  bool cached = false;  // past_key / past_value given: k, v are the new rows, presents are outputs 1 and 2
  bool bsh = false;     // input_layout "bsh": q / k / v as the projections write them ([B, T, heads * D])
  bool rotary = false;  // bsh with cos_cache, sin_cache, position_ids
  bool inv_freq = false;  // rotary_form "inv_freq": input 8 the frequencies [D/2], 9 absent, the angles computed
  bool padding_mask = false;  // mask_form "padding_causal": input 3 the attention_mask [B, Lm] (int64)
  int64_t heads = 0, kv_heads = 0;
  float norm_epsilon = 0.0f;

  [[noreturn]] void fail(OrtErrorCode code, const std::string& what) const {
    throw Failure{code, "ai.layerzero::Attention node '" + node + "': " + what};
  }

  explicit AttentionKernel(const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    node = ki.GetNodeName();
    // Attributes and input types through the C API (an absent attribute is a status, not an exception: the
    // AddressSanitizer build runs under LD_PRELOAD, where a C++ throw from the ORT headers aborts).
    const OrtApi& api = Ort::GetApi();
    auto float_attr = [&](const char* name, float fallback) {
      float v = fallback;
      if (OrtStatus* st = api.KernelInfoGetAttribute_float(info, name, &v)) {
        api.ReleaseStatus(st);
        v = fallback;
      }
      return v;
    };
    auto int_attr = [&](const char* name) {
      int64_t v = 0;
      if (OrtStatus* st = api.KernelInfoGetAttribute_int64(info, name, &v)) {
        api.ReleaseStatus(st);
        v = 0;
      }
      return v;
    };
    auto string_attr = [&](const char* name, const char* fallback) {
      size_t size = 0;
      if (OrtStatus* st = api.KernelInfoGetAttribute_string(info, name, nullptr, &size)) {
        api.ReleaseStatus(st);
        if (size == 0) return std::string(fallback);
      }
      std::string v(size, '\0');
      if (OrtStatus* st = api.KernelInfoGetAttribute_string(info, name, v.data(), &size)) {
        api.ReleaseStatus(st);
        return std::string(fallback);
      }
      v.resize(size > 0 ? size - 1 : 0);
      return v;
    };
    const std::string mask_form = string_attr("mask_form", "additive");
    if (mask_form != "additive" && mask_form != "padding_causal")
      fail(ORT_INVALID_ARGUMENT, "mask_form='" + mask_form + "' is not implemented (additive, padding_causal)");
    padding_mask = mask_form == "padding_causal";
    q_scale = float_attr("q_scale", 1.0f);
    k_scale = float_attr("k_scale", 1.0f);
    const std::string in_layout = string_attr("input_layout", "bhtd");
    if (in_layout != "bhtd" && in_layout != "bsh")
      fail(ORT_INVALID_ARGUMENT, "input_layout='" + in_layout + "' is not implemented (bhtd, bsh)");
    bsh = in_layout == "bsh";
    const std::string layout = string_attr("output_layout", bsh ? "bsh" : "bhtd");
    if (bsh ? layout != "bsh" : (layout != "bhtd" && layout != "bthd"))
      fail(ORT_INVALID_ARGUMENT, "output_layout='" + layout + "' is not implemented with input_layout='" + in_layout +
                                     "' (" + (bsh ? "bsh" : "bhtd, bthd") + ")");
    bthd = layout != "bhtd";  // bsh: the same memory as bthd, viewed [B, T, H * Dv]
    const size_t inputs = ki.GetInputCount(), outputs = ki.GetOutputCount();
    if (bsh) {
      heads = int_attr("num_heads");
      kv_heads = int_attr("kv_num_heads");
      if (heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0)
        fail(ORT_INVALID_ARGUMENT, "input_layout='bsh' needs num_heads and kv_num_heads > 0, num_heads a multiple of "
                                   "kv_num_heads (" + std::to_string(heads) + ", " + std::to_string(kv_heads) + ")");
      norm_epsilon = float_attr("norm_epsilon", 0.0f);
      if (inputs > kBshInputs || (inputs > 3 && inputs < 6))
        fail(ORT_INVALID_ARGUMENT, "input_layout='bsh' takes 3 or 6 to 11 inputs (q, k, v[, mask, past_key, "
                                   "past_value[, q_norm, k_norm, cos_cache, sin_cache, position_ids]]), not " +
                                       std::to_string(inputs));
      rotary = inputs > kCos;
      if (rotary && inputs != kBshInputs)
        fail(ORT_INVALID_ARGUMENT, "the rotary embedding needs cos_cache, sin_cache and position_ids (inputs 8-10)");
      const std::string form = string_attr("rotary_form", "cache");
      if (form != "cache" && form != "inv_freq")
        fail(ORT_INVALID_ARGUMENT, "rotary_form='" + form + "' is not implemented (cache, inv_freq)");
      inv_freq = form == "inv_freq";
    } else if (inputs < 3 || inputs > 6 || inputs == 5) {
      fail(ORT_INVALID_ARGUMENT, "takes 3, 4 or 6 inputs (q, k, v[, mask[, past_key, past_value]]), not " +
                                     std::to_string(inputs));
    }
    cached = inputs >= 6;
    if (outputs != (cached ? 3u : 1u))
      fail(ORT_INVALID_ARGUMENT, std::string("has ") + std::to_string(outputs) + " outputs; " +
                                     (cached ? "with a past it writes o, present_key, present_value (3)" : "o (1)"));
    for (size_t i = 0; i < inputs; ++i) {
      OrtTypeInfo* raw = nullptr;
      if (OrtStatus* st = api.KernelInfo_GetInputTypeInfo(info, i, &raw)) {
        api.ReleaseStatus(st);
        continue;  // an absent optional input ("")
      }
      Ort::TypeInfo type(raw);
      const ONNXType kind = type.GetONNXType();
      if (kind == ONNX_TYPE_UNKNOWN) continue;
      const ONNXTensorElementDataType element = kind == ONNX_TYPE_TENSOR
                                                    ? type.GetTensorTypeAndShapeInfo().GetElementType()
                                                    : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
      const bool ints = i == kPositions || (i == kMask && padding_mask);
      const auto want = ints ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
      if (kind != ONNX_TYPE_TENSOR || element != want)
        fail(ORT_INVALID_ARGUMENT, "input " + std::to_string(i) + " must be a " + (ints ? "int64" : "float32") +
                                       " tensor");
    }
  }

  // input_layout "bsh": q [B, T, H*D], k / v [B, T, Hk*D(v)] to [B, heads, T, D] buffers, each head's row through
  // the optional RMS norm (x / sqrt(mean(x^2) + eps) * w: SimplifiedLayerNormalization) and the rotary embedding
  // (rotate_half, non-interleaved: com.microsoft.RotaryEmbedding's, cache row = position_ids[b, t]).
  void heads_of(Ort::KernelContext& ctx, const Ort::ConstValue& x, int64_t nh, int64_t B, int64_t T,
                const float* norm, bool rope, std::vector<float>* out, int64_t* width) const {
    const std::vector<int64_t> xs = x.GetTensorTypeAndShapeInfo().GetShape();
    if (xs.size() != 3 || xs[0] != B || xs[1] != T || xs[2] % nh != 0)
      fail(ORT_INVALID_ARGUMENT, "input_layout='bsh': q, k and v must be [B, T, heads * D] of one B and T, not " +
                                     shape_text(xs));
    const int64_t D = xs[2] / nh, half = D / 2;
    *width = D;
    out->resize(static_cast<size_t>(B * nh * T * D));
    const float* src = x.GetTensorData<float>();
    const float *cos = nullptr, *sin = nullptr;
    const int64_t* ids = nullptr;
    int64_t rows = 0;
    std::vector<float> angles;  // rotary_form "inv_freq": one token's cos and sin rows
    const float* freq = nullptr;
    if (rope) {
      Ort::ConstValue cv = ctx.GetInput(kCos), pv = ctx.GetInput(kPositions);
      Ort::ConstValue sv = inv_freq ? Ort::ConstValue(nullptr) : ctx.GetInput(kCos + 1);
      const std::vector<int64_t> cs = cv.GetTensorTypeAndShapeInfo().GetShape();
      const std::vector<int64_t> ps = pv.GetTensorTypeAndShapeInfo().GetShape();
      if (inv_freq) {
        if (D % 2 != 0 || cs != std::vector<int64_t>{half} || ps != std::vector<int64_t>{B, T})
          fail(ORT_INVALID_ARGUMENT, "inv_freq " + shape_text(cs) + " / position_ids " + shape_text(ps) +
                                         " do not fit [" + std::to_string(half) + "] and [B, T] = " + shape_text({B, T}));
        freq = cv.GetTensorData<float>();
        angles.resize(static_cast<size_t>(2 * half));
      } else {
        const std::vector<int64_t> ss = sv.GetTensorTypeAndShapeInfo().GetShape();
        if (D % 2 != 0 || cs.size() != 2 || cs[1] != half || ss != cs || ps != std::vector<int64_t>{B, T})
          fail(ORT_INVALID_ARGUMENT, "cos_cache " + shape_text(cs) + " / sin_cache " + shape_text(ss) +
                                         " / position_ids " + shape_text(ps) + " do not fit [rows, " +
                                         std::to_string(half) + "] and [B, T] = " + shape_text({B, T}));
        cos = cv.GetTensorData<float>();
        sin = sv.GetTensorData<float>();
        rows = cs[0];
      }
      ids = pv.GetTensorData<int64_t>();
    }
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const float *c = nullptr, *sn = nullptr;
        if (rope && freq != nullptr) {  // the graph's Cos / Sin of float(position) * inv_freq, in float32
          const float pos = static_cast<float>(ids[b * T + t]);
          for (int64_t i = 0; i < half; ++i) {
            const float a = pos * freq[i];
            angles[static_cast<size_t>(i)] = std::cos(a);
            angles[static_cast<size_t>(half + i)] = std::sin(a);
          }
          c = angles.data();
          sn = angles.data() + half;
        } else if (rope) {
          const int64_t pos = ids[b * T + t];
          if (pos < 0 || pos >= rows)
            fail(ORT_INVALID_ARGUMENT, "position id " + std::to_string(pos) + " is outside the rotary caches' " +
                                           std::to_string(rows) + " rows");
          c = cos + pos * half;
          sn = sin + pos * half;
        }
        for (int64_t h = 0; h < nh; ++h) {
          const float* in = src + ((b * T + t) * nh + h) * D;
          float* o = out->data() + ((b * nh + h) * T + t) * D;
          if (norm != nullptr) {
            float ss = 0.0f;
            for (int64_t d = 0; d < D; ++d) ss += in[d] * in[d];
            const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + norm_epsilon);
            for (int64_t d = 0; d < D; ++d) o[d] = in[d] * inv * norm[d];
          } else {
            std::copy(in, in + D, o);
          }
          if (rope)
            for (int64_t i = 0; i < half; ++i) {
              const float x1 = o[i], x2 = o[i + half];
              o[i] = x1 * c[i] - x2 * sn[i];
              o[i + half] = x2 * c[i] + x1 * sn[i];
            }
        }
      }
  }

  // A norm weight input ([D] float32) or nullptr when absent.
  const float* norm_weight(Ort::KernelContext& ctx, size_t i, int64_t D) const {
    if (ctx.GetInputCount() <= i) return nullptr;
    Ort::ConstValue w = ctx.GetInput(i);
    if (w == nullptr) return nullptr;
    const std::vector<int64_t> ws = w.GetTensorTypeAndShapeInfo().GetShape();
    if (ws != std::vector<int64_t>{D})
      fail(ORT_INVALID_ARGUMENT, "the norm weight (input " + std::to_string(i) + ") is " + shape_text(ws) +
                                     ", not [" + std::to_string(D) + "]");
    return w.GetTensorData<float>();
  }

  // With a past: present = concat(past, new) along the sequence, written as outputs 1 and 2; points k, v at them
  // and returns the keys' row capacity per (batch, head) of the presents (their L). `valid` (>= 0: the mask's key
  // length, the past rows in use + the new ones) below the past's rows + the new ones: the past is a cache buffer
  // (attention.h), the presents are the buffer's shape and the new rows go to [valid - Tn, valid); when the
  // presents are the past's own memory (bound so by the caller) only those rows are written.
  int64_t presents(Ort::KernelContext& ctx, const std::vector<int64_t>& ks, const std::vector<int64_t>& vs,
                   int64_t valid, const float** k, const float** v, std::vector<int64_t>* pks,
                   std::vector<int64_t>* pvs) const {
    Ort::ConstValue pk = ctx.GetInput(4), pv = ctx.GetInput(5);
    if (pk == nullptr || pv == nullptr) fail(ORT_INVALID_ARGUMENT, "past_key and past_value must both be given");
    const std::vector<int64_t> a = pk.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> b = pv.GetTensorTypeAndShapeInfo().GetShape();
    if (a.size() != 4 || b.size() != 4 || a[0] != ks[0] || a[1] != ks[1] || a[3] != ks[3] || b[0] != vs[0] ||
        b[1] != vs[1] || b[2] != a[2] || b[3] != vs[3])
      fail(ORT_INVALID_ARGUMENT, "past_key " + shape_text(a) + " / past_value " + shape_text(b) +
                                     " do not fit the new keys " + shape_text(ks) + " / values " + shape_text(vs));
    const int64_t cap = a[2], tn = ks[2];
    const bool buffer = valid >= 0 && valid < cap + tn;
    if (buffer && (valid < tn || valid > cap))
      fail(ORT_INVALID_ARGUMENT, "the mask covers " + std::to_string(valid) + " keys: with " + std::to_string(tn) +
                                     " new ones that is " + (valid < tn ? "fewer than the new keys"
                                                                       : "more than the cache buffer's " +
                                                                             std::to_string(cap) + " rows"));
    const int64_t used = buffer ? valid - tn : cap;  // past rows in use; the new rows go after them
    const int64_t rows = buffer ? cap : cap + tn;    // the presents' rows
    *pks = {ks[0], ks[1], rows, ks[3]};
    *pvs = {vs[0], vs[1], rows, vs[3]};
    float* ok = ctx.GetOutput(1, *pks).GetTensorMutableData<float>();
    float* ov = ctx.GetOutput(2, *pvs).GetTensorMutableData<float>();
    const float* past[2] = {pk.GetTensorData<float>(), pv.GetTensorData<float>()};
    const float* fresh[2] = {*k, *v};
    float* out[2] = {ok, ov};
    const int64_t width[2] = {a[3], b[3]};
    const int64_t heads = ks[0] * ks[1];
    for (int m = 0; m < 2; ++m) {
      const bool in_place = buffer && out[m] == past[m];
      const int64_t w = width[m];
      for (int64_t h = 0; h < heads; ++h) {  // per (batch, head): the past's rows in use, the new ones, the rest
        float* dst = out[m] + h * rows * w;
        if (!in_place) std::copy(past[m] + h * cap * w, past[m] + (h * cap + used) * w, dst);
        std::copy(fresh[m] + h * tn * w, fresh[m] + (h + 1) * tn * w, dst + used * w);
        if (buffer && !in_place) std::fill(dst + (used + tn) * w, dst + rows * w, 0.0f);
      }
    }
    *k = ok;
    *v = ov;
    return rows;
  }

  void compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    Ort::ConstValue qv = ctx.GetInput(0), kv = ctx.GetInput(1), vv = ctx.GetInput(2);
    std::vector<int64_t> qs = qv.GetTensorTypeAndShapeInfo().GetShape();
    std::vector<int64_t> ks = kv.GetTensorTypeAndShapeInfo().GetShape();
    std::vector<int64_t> vs = vv.GetTensorTypeAndShapeInfo().GetShape();
    const float* q = qv.GetTensorData<float>();
    const float* k = kv.GetTensorData<float>();
    const float* v = vv.GetTensorData<float>();
    std::vector<float> qb, kb, vb;  // input_layout "bsh": the heads as [B, heads, T, D]
    if (bsh) {
      if (qs.size() != 3 || qs[2] % heads != 0)
        fail(ORT_INVALID_ARGUMENT, "input_layout='bsh': q must be [B, T, num_heads * D], not " + shape_text(qs));
      const int64_t B = qs[0], T = qs[1], D = qs[2] / heads;
      int64_t dq = 0, dk = 0, dv = 0;
      heads_of(ctx, qv, heads, B, T, norm_weight(ctx, kQNorm, D), rotary, &qb, &dq);
      heads_of(ctx, kv, kv_heads, B, T, norm_weight(ctx, kQNorm + 1, D), rotary, &kb, &dk);
      heads_of(ctx, vv, kv_heads, B, T, nullptr, false, &vb, &dv);
      qs = {B, heads, T, dq};
      ks = {B, kv_heads, T, dk};
      vs = {B, kv_heads, T, dv};
      q = qb.data();
      k = kb.data();
      v = vb.data();
    }
    if (qs.size() != 4 || ks.size() != 4 || vs.size() != 4)
      fail(ORT_INVALID_ARGUMENT, "q, k and v must be rank 4, not " + shape_text(qs) + ", " + shape_text(ks) + ", " +
                                     shape_text(vs));
    // The mask's key length: with a past shorter than that length says, the past is a cache buffer (presents()).
    int64_t mask_keys = -1;
    if (ctx.GetInputCount() > 3) {
      Ort::ConstValue mv = ctx.GetInput(3);
      if (mv != nullptr) {
        const std::vector<int64_t> ms = mv.GetTensorTypeAndShapeInfo().GetShape();
        // (an additive mask's last dim of 1 may be a broadcast; an attention mask [B, Lm] is always the keys)
        if (!ms.empty() && (padding_mask || ms.back() != 1)) mask_keys = ms.back();
      }
    }
    int64_t stride_rows = -1;  // the keys' rows per (batch, kv head) in memory (L, or a cache buffer's capacity)
    if (cached) {
      stride_rows = presents(ctx, std::vector<int64_t>(ks), std::vector<int64_t>(vs), mask_keys, &k, &v, &ks, &vs);
      if (mask_keys >= 0 && mask_keys < ks[2]) ks[2] = vs[2] = mask_keys;  // attend over the rows in use
    }
    const int64_t B = qs[0], H = qs[1], T = qs[2], D = qs[3];
    const int64_t Bk = ks[0], Hk = ks[1], L = ks[2], Dv = vs[3];
    const int64_t cap = stride_rows >= 0 ? stride_rows : L;
    if (ks[3] != D || vs[0] != Bk || vs[1] != Hk || vs[2] != L)
      fail(ORT_INVALID_ARGUMENT, "shapes q " + shape_text(qs) + ", k " + shape_text(ks) + ", v " + shape_text(vs) +
                                     " do not fit ([B, H, T, D], [B, Hk, L, D], [B, Hk, L, Dv])");
    if (!(Bk == B || Bk == 1)) fail(ORT_INVALID_ARGUMENT, "k's batch " + std::to_string(Bk) + " is neither q's nor 1");
    if (Hk <= 0 ? H != 0 : H % Hk != 0)
      fail(ORT_INVALID_ARGUMENT, "q's heads " + std::to_string(H) + " are not a multiple of k's " + std::to_string(Hk));
    // The mask's strides over [B, H, T, L] (0 where it broadcasts).
    const float* mask = nullptr;
    int64_t mstride[4] = {0, 0, 0, 0};
    const int64_t* padding = nullptr;  // mask_form "padding_causal": the attention mask [B, L] (attend_rows)
    if (padding_mask && ctx.GetInputCount() > kMask && ctx.GetInput(kMask) != nullptr) {
      Ort::ConstValue mv = ctx.GetInput(kMask);
      const std::vector<int64_t> ms = mv.GetTensorTypeAndShapeInfo().GetShape();
      if (ms.size() != 2 || ms[0] != B || ms[1] != L)
        fail(ORT_INVALID_ARGUMENT, "mask_form='padding_causal': the attention mask " + shape_text(ms) +
                                       " is not [B, L] = " + shape_text({B, L}));
      padding = mv.GetTensorData<int64_t>();
    } else if (ctx.GetInputCount() > 3) {
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
    std::vector<int64_t> os = bsh    ? std::vector<int64_t>{B, T, H * Dv}
                              : bthd ? std::vector<int64_t>{B, T, H, Dv}
                                     : std::vector<int64_t>{B, H, T, Dv};
    float* o = ctx.GetOutput(0, os).GetTensorMutableData<float>();
    if (B == 0 || H == 0 || T == 0 || Dv == 0) return;
    if (L == 0) {
      std::fill(o, o + B * H * T * Dv, 0.0f);
      return;
    }
    const int64_t r = H / Hk;
    const int64_t items = B * Hk;
    // One (batch, kv head) pair: its r * T query rows (contiguous in q), in blocks of kRowBlock rows.
    const std::function<void(size_t)> work = [&](size_t item) {
      const int64_t b = int64_t(item) / Hk, g = int64_t(item) % Hk, bk = Bk == 1 ? 0 : b;
      Rows a{q, k + (bk * Hk + g) * cap * D, v + (bk * Hk + g) * cap * Dv, nullptr, 0, 0, 0, b, g, r, H, T, D, L, Dv,
             q_scale, k_scale, bthd, o};
      if (mask != nullptr) {
        a.mask = mask + b * mstride[0];
        a.mh = mstride[1];
        a.mt = mstride[2];
        a.ml = mstride[3];
      } else if (padding != nullptr) {
        a.am = padding + b * L;
        a.causal = L - T;
      }
      const int64_t rows = r * T, block = std::min(rows, kRowBlock);
      std::vector<float> qs(static_cast<size_t>(block * D)), s(static_cast<size_t>(block * L));
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) attend_rows(a, r0, std::min(rows, r0 + kRowBlock), qs.data(),
                                                                   s.data());
    };
    parallel_items(ctx, static_cast<size_t>(items), work);
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return guarded(ORT_RUNTIME_EXCEPTION, [&] { compute(context); });
  }
};

struct AttentionOp : Ort::CustomOpBase<AttentionOp, AttentionKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    return guarded(ORT_INVALID_ARGUMENT, [&] { *kernel = new AttentionKernel(info); });
  }
  const char* GetName() const { return kName; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return kBshInputs; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 3 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 3; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return i >= 1 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* attention_op() {
  static AttentionOp op;
  return &op;
}

}  // namespace lz
