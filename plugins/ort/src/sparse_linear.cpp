// ai.layerzero::SparseLinear for ONNX Runtime's CPU provider (the op and its semantics: sparse_linear.h). The
// threshold test and the kept list here; the row kernels in sparse_linear_rows.cpp (one build per ISA).
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include "sparse_linear.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "moe.h"
#include "pool.h"
#include "status.h"

namespace lz {

const SparseKernels& sparse_kernels() {
  static const SparseKernels* chosen = [] {
    const char* isa = std::getenv("LAYERZERO_ORT_ISA");
    const std::string want = isa != nullptr ? isa : "";
    if (want == "generic") return &generic::kSparseKernels;
    if (want != "avx2" && avx512::sparse_available()) return &avx512::kSparseKernels;
    return avx2::sparse_available() ? &avx2::kSparseKernels : &generic::kSparseKernels;
  }();
  return *chosen;
}

const SparseQKernels& sparse_q_kernels() {
  static const SparseQKernels* chosen = [] {
    const char* isa = std::getenv("LAYERZERO_ORT_ISA");
    const std::string want = isa != nullptr ? isa : "";
    if (want == "generic") return &generic::kSparseQKernels;
    if (want != "avx2" && avx512vnni::sparse_q_available()) return &avx512vnni::kSparseQKernels;
    return avx2::sparse_q_available() ? &avx2::kSparseQKernels : &generic::kSparseQKernels;
  }();
  return *chosen;
}

namespace {

constexpr const char* kOpName = "SparseLinear";
constexpr size_t kInputs = 6;  // x, w, thresholds, scale?, bias?, w_scales?
constexpr size_t kScale = 3, kBias = 4, kWScales = 5;
constexpr int64_t kGroup = 8;    // tokens whose kept rows are streamed together (T > 1)
constexpr int64_t kColumns = 64;  // the column split's granule
constexpr int64_t kQColumns = 128;  // q8 / q4: the split's granule (a q4 row's 64-byte chunk, sparse_linear.h)
constexpr int64_t kQBlock = 32;   // q8 / q4: channels of K per block (x's int8 quantization, w's scales)
constexpr int64_t kQTile = 256;   // q8 / q4, T > 1: columns a thread runs for every token before the next ones

// LAYERZERO_ORT_SPARSE_SPLIT: the number of column ranges every call is split into (tests: the result must not
// depend on it); 0 when unset.
int64_t forced_split() {
  static const int64_t forced = [] {
    const char* v = std::getenv("LAYERZERO_ORT_SPARSE_SPLIT");
    const long n = v != nullptr ? std::strtol(v, nullptr, 10) : 0;
    return n > 0 ? static_cast<int64_t>(n) : int64_t{0};
  }();
  return forced;
}

// How many column ranges a call is split into: the hardware threads (at most one range each, so a thread streams
// one contiguous part of every kept row), or the forced split.
int64_t split_items() {
  static const int64_t items = [] {
    if (forced_split() > 0) return forced_split();
    return std::max<int64_t>(1, std::thread::hardware_concurrency());
  }();
  return items;
}

int64_t attr_int(const OrtKernelInfo* info, const char* name, int64_t fallback) {
  int64_t v = fallback;
  OrtStatus* s = Ort::GetApi().KernelInfoGetAttribute_int64(info, name, &v);
  if (s != nullptr) Ort::GetApi().ReleaseStatus(s);
  return v;
}

std::string attr_string(const OrtKernelInfo* info, const char* name, const char* fallback) {
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
  v.resize(size > 0 ? size - 1 : 0);
  return v;
}

// An ints attribute into *out: false when the node has no ints attribute of that name.
bool attr_ints(const OrtKernelInfo* info, const char* name, std::vector<int64_t>* out) {
  size_t size = 0;
  OrtStatus* s = Ort::GetApi().KernelInfoGetAttributeArray_int64(info, name, nullptr, &size);
  if (s != nullptr) {
    Ort::GetApi().ReleaseStatus(s);
    return false;
  }
  out->assign(size, 0);
  if (size == 0) return true;
  s = Ort::GetApi().KernelInfoGetAttributeArray_int64(info, name, out->data(), &size);
  if (s != nullptr) {
    Ort::GetApi().ReleaseStatus(s);
    return false;
  }
  out->resize(size);
  return true;
}

// A constant input's value (nullptr when the input is absent or not an initializer).
const OrtValue* constant_input(const OrtKernelInfo* info, size_t i) {
  int is_constant = 0;
  const OrtValue* value = nullptr;
  OrtStatus* s = Ort::GetApi().KernelInfoGetConstantInput_tensor(info, i, &is_constant, &value);
  if (s != nullptr) {
    Ort::GetApi().ReleaseStatus(s);
    return nullptr;
  }
  return is_constant ? value : nullptr;
}

std::string dims(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

const char* type_name(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
      return "float32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
      return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
      return "bfloat16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8:
      return "int8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8:
      return "uint8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE:
      return "float64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64:
      return "int64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32:
      return "int32";
    default:
      return "another type";
  }
}

struct SparseLinearKernel {
  std::string node;
  std::string format_name;
  bool quant = false;
  SparseFormat format = SparseFormat::f32;  // from w's declared type (the node's runs use their w's own)
  // Whether ONNX Runtime's intra-op pool runs a call's column ranges on more than the calling thread (the custom-op
  // API does not say how many threads it has): -1 not known yet, 1 yes (an item ran on another thread), 0 no
  // (kSerialCalls calls in a row whose items all ran on the caller). Once 0, a call is one range (every
  // kProbeCalls-th call split again, to see other threads if a pool that was slow to wake has them): with one
  // thread, two ranges stream every kept row in two halves, shorter streams (q4, N = 2048, 1 thread: ~0.41x ->
  // 0.53x MatMulNBits' speed dense in a microbenchmark). The split never changes the result (sparse_linear.h).
  static constexpr int kSerialCalls = 3, kProbeCalls = 16;
  std::atomic<int> pool_parallel{-1};
  std::atomic<int> serial_calls{0};
  std::atomic<int> calls{0};

  int64_t items_for(int64_t units) {
    const int64_t items = std::min(units, split_items());
    if (forced_split() > 0 || pool_parallel.load(std::memory_order_relaxed) != 0) return items;
    return calls.fetch_add(1, std::memory_order_relaxed) % kProbeCalls == kProbeCalls - 1 ? items : 1;
  }

  // work(0 .. items) over the intra-op pool (inline when one item), learning pool_parallel.
  void run_items(Ort::KernelContext& ctx, int64_t items, const std::function<void(size_t)>& work) {
    if (items == 1) {
      work(0);
      return;
    }
    const std::thread::id caller = std::this_thread::get_id();
    std::atomic<bool> other{false};
    const std::function<void(size_t)> item = [&](size_t k) {
      if (std::this_thread::get_id() != caller) other.store(true, std::memory_order_relaxed);
      work(k);
    };
    parallel_items(ctx, static_cast<size_t>(items), item);
    if (other.load(std::memory_order_relaxed))
      pool_parallel.store(1, std::memory_order_relaxed);
    else if (pool_parallel.load(std::memory_order_relaxed) == -1 &&
             serial_calls.fetch_add(1, std::memory_order_relaxed) + 1 >= kSerialCalls)
      pool_parallel.store(0, std::memory_order_relaxed);
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw Failure{ORT_INVALID_ARGUMENT, "ai.layerzero::SparseLinear node '" + node + "': " + what};
  }

  // The format a weight type means under weight_format (false: the type does not fit it).
  bool weight_format(ONNXTensorElementDataType t, SparseFormat* out) const {
    if (format_name == "q8") {
      *out = SparseFormat::q8;
      return t == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
    }
    if (format_name == "q4") {
      *out = SparseFormat::q4;
      return t == ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
    }
    switch (t) {
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
        *out = SparseFormat::f32;
        return true;
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
        *out = SparseFormat::f16;
        return true;
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
        *out = SparseFormat::bf16;
        return true;
      default:
        return false;
    }
  }
  const char* weight_types() const {
    return format_name == "q8" ? "int8" : format_name == "q4" ? "uint8 (two 4-bit codes a byte)"
                                                              : "float32, float16 or bfloat16";
  }
  // (K, N) of w's shape (-1 where unknown).
  void weight_dims(const std::vector<int64_t>& ws, SparseFormat f, int64_t* k, int64_t* n) const {
    if (ws.size() != 2) fail("w must be rank 2 ([K, N], q4 [K, N/2]), not " + dims(ws));
    *k = ws[0];
    *n = ws[1] < 0 ? -1 : (f == SparseFormat::q4 ? 2 * ws[1] : ws[1]);
  }
  // Checks of one input's type / shape against what K and N require ("" when it fits; -1 = unknown).
  std::string check_thresholds(ONNXTensorElementDataType t, const std::vector<int64_t>& s, int64_t k) const {
    if (t != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
      return std::string("thresholds must be float32, not ") + type_name(t);
    const bool scalar = s.empty() || (s.size() == 1 && s[0] == 1);
    if (!scalar && !(s.size() == 1 && (s[0] < 0 || k < 0 || s[0] == k)))
      return "thresholds must be [K] = [" + std::to_string(k) + "] (or a scalar), not " + dims(s);
    return "";
  }
  std::string check_bias(ONNXTensorElementDataType t, const std::vector<int64_t>& s, int64_t n) const {
    if (t != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) return std::string("bias must be float32, not ") + type_name(t);
    if (s.size() != 1 || (s[0] >= 0 && n >= 0 && s[0] != n))
      return "bias must be [N] = [" + std::to_string(n) + "], not " + dims(s);
    return "";
  }
  std::string check_scales(ONNXTensorElementDataType t, const std::vector<int64_t>& s, int64_t k, int64_t n) const {
    if (t != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16)
      return std::string("w_scales must be float16, not ") + type_name(t);
    const int64_t kb = k < 0 ? -1 : k / kQBlock;
    if (s.size() != 2 || (s[0] >= 0 && kb >= 0 && s[0] != kb) || (s[1] >= 0 && n >= 0 && s[1] != n))
      return "w_scales must be [K/32, N] = [" + std::to_string(kb) + ", " + std::to_string(n) + "], not " + dims(s);
    return "";
  }

  explicit SparseLinearKernel(const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    node = ki.GetNodeName();
    format_name = attr_string(info, "weight_format", "f");
    if (format_name != "f" && format_name != "q8" && format_name != "q4")
      fail("weight_format='" + format_name + "' is not implemented by liblayerzero_ort.so (f, q8, q4)");
    quant = format_name != "f";
    const int64_t layout = attr_int(info, "code_layout", 0);
    if (quant && layout != kCodeLayout)
      fail("code_layout=" + std::to_string(layout) + ": its " + format_name + " codes are not in this library's layout " +
           std::to_string(kCodeLayout) + " (column tiles of 8192; compiled by another LayerZero version: compile the "
           "model again)");
    const int64_t block = attr_int(info, "block_size", 32);
    if (block != 32) fail("block_size=" + std::to_string(block) + " is not implemented by liblayerzero_ort.so (32)");
    const size_t inputs = ki.GetInputCount();
    if (inputs < 3 || inputs > kInputs)
      fail("has " + std::to_string(inputs) + " inputs; SparseLinear takes 3 to 6 (x, w, thresholds[, scale, bias, "
           "w_scales])");
    if (quant && inputs != kInputs)
      fail("weight_format='" + format_name + "' needs w_scales (input 5; \"\" for absent scale / bias before it)");
    auto tensor_of = [&](size_t i) {
      Ort::TypeInfo type = ki.GetInputTypeInfo(i);
      if (type.GetONNXType() != ONNX_TYPE_TENSOR) fail("input " + std::to_string(i) + " is not a tensor");
      auto t = type.GetTensorTypeAndShapeInfo();
      return std::make_pair(t.GetElementType(), t.GetShape());
    };
    const auto [xt, xs] = tensor_of(0);
    if (xt != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) fail(std::string("x must be float32, not ") + type_name(xt));
    if (xs.empty()) fail("x must have rank >= 1 ([..., K])");
    const auto [wt, ws] = tensor_of(1);
    if (!weight_format(wt, &format))
      fail(std::string("w has element type ") + type_name(wt) + "; weight_format='" + format_name + "' takes " +
           weight_types());
    int64_t k = -1, n = -1;
    weight_dims(ws, format, &k, &n);
    if (xs.back() >= 0 && k >= 0 && xs.back() != k)
      fail("x's last dimension " + std::to_string(xs.back()) + " is not w's K = " + std::to_string(k));
    if (quant && n >= 0 && n % 32 != 0)
      fail("N = " + std::to_string(n) + " is not a multiple of the block length 32 (weight_format='" + format_name +
           "')");
    if (quant && k >= 0 && k % kQBlock != 0)
      fail("K = " + std::to_string(k) + " is not a multiple of the block length 32 (weight_format='" + format_name +
           "': blocks along K)");
    const auto [tt, ts] = tensor_of(2);
    std::string err = check_thresholds(tt, ts, k);
    if (!err.empty()) fail(err);
    // Optional inputs: checked here when ONNX Runtime holds them as initializers, else when the node runs.
    if (const OrtValue* v = constant_input(info, 2)) {
      Ort::ConstValue c(v);
      const float* p = c.GetTensorData<float>();
      const size_t count = c.GetTensorTypeAndShapeInfo().GetElementCount();
      for (size_t i = 0; i < count; ++i)
        if (!(p[i] >= 0.0f)) fail("thresholds[" + std::to_string(i) + "] = " + std::to_string(p[i]) + " (>= 0)");
    }
    if (const OrtValue* v = inputs > kBias ? constant_input(info, kBias) : nullptr) {
      auto s = Ort::ConstValue(v).GetTensorTypeAndShapeInfo();
      err = check_bias(s.GetElementType(), s.GetShape(), n);
      if (!err.empty()) fail(err);
    }
    if (const OrtValue* v = inputs > kWScales ? constant_input(info, kWScales) : nullptr) {
      if (!quant) fail("w_scales (input 5) is for weight_format q8 / q4, not 'f'");
      auto s = Ort::ConstValue(v).GetTensorTypeAndShapeInfo();
      err = check_scales(s.GetElementType(), s.GetShape(), k, n);
      if (!err.empty()) fail(err);
    }
    if (const OrtValue* v = constant_input(info, 1)) {  // the weights: huge pages in place (moe.h)
      Ort::ConstValue c(v);
      auto s = c.GetTensorTypeAndShapeInfo();
      const size_t bytes = s.GetElementCount() * (format == SparseFormat::f32 ? 4 : quant ? 1 : 2);
      advise_huge_pages(c.GetTensorRawData(), bytes);
    }
  }

  void compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    Ort::ConstValue xv = ctx.GetInput(0), wv = ctx.GetInput(1), tv = ctx.GetInput(2);
    const std::vector<int64_t> xs = xv.GetTensorTypeAndShapeInfo().GetShape();
    auto winfo = wv.GetTensorTypeAndShapeInfo();
    SparseFormat fmt;
    if (!weight_format(winfo.GetElementType(), &fmt))
      fail(std::string("w has element type ") + type_name(winfo.GetElementType()) + "; weight_format='" +
           format_name + "' takes " + weight_types());
    int64_t K, N;
    weight_dims(winfo.GetShape(), fmt, &K, &N);
    if (xs.empty() || xs.back() != K) fail("x's last dimension is not w's K = " + std::to_string(K));
    if (quant && (N % 32 != 0 || K % kQBlock != 0))
      fail("N = " + std::to_string(N) + " and K = " + std::to_string(K) + " must be multiples of the block length 32");
    auto tinfo = tv.GetTensorTypeAndShapeInfo();
    std::string err = check_thresholds(tinfo.GetElementType(), tinfo.GetShape(), K);
    if (!err.empty()) fail(err);
    const float* thr = tv.GetTensorData<float>();
    const bool uniform = tinfo.GetElementCount() == 1 && K != 1;
    float scale = 1.0f;
    const size_t inputs = ctx.GetInputCount();
    if (inputs > kScale) {
      Ort::ConstValue sv = ctx.GetInput(kScale);
      if (sv != nullptr) {
        auto si = sv.GetTensorTypeAndShapeInfo();
        if (si.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || si.GetElementCount() != 1)
          fail("scale must be a float32 scalar");
        scale = *sv.GetTensorData<float>();
        if (!(scale >= 0.0f)) fail("scale " + std::to_string(scale) + " (>= 0)");
      }
    }
    const float* bias = nullptr;
    if (inputs > kBias) {
      Ort::ConstValue bv = ctx.GetInput(kBias);
      if (bv != nullptr) {
        auto bi = bv.GetTensorTypeAndShapeInfo();
        err = check_bias(bi.GetElementType(), bi.GetShape(), N);
        if (!err.empty()) fail(err);
        bias = bv.GetTensorData<float>();
      }
    }
    const uint16_t* scales = nullptr;
    if (inputs > kWScales) {
      Ort::ConstValue sv = ctx.GetInput(kWScales);
      if (sv != nullptr) {
        if (!quant) fail("w_scales (input 5) is for weight_format q8 / q4, not 'f'");
        auto si = sv.GetTensorTypeAndShapeInfo();
        err = check_scales(si.GetElementType(), si.GetShape(), K, N);
        if (!err.empty()) fail(err);
        scales = static_cast<const uint16_t*>(sv.GetTensorRawData());
      }
    }
    if (quant && scales == nullptr) fail("w_scales (input 5) is absent");

    int64_t T = 1;
    for (size_t i = 0; i + 1 < xs.size(); ++i) T *= xs[i];
    std::vector<int64_t> ys(xs), ks(xs.begin(), xs.end() - 1);
    ys.back() = N;
    Ort::UnownedValue yv = ctx.GetOutput(0, ys);
    Ort::UnownedValue kv = ctx.GetOutput(1, ks);
    float* y = yv.GetTensorMutableData<float>();
    int64_t* kept = kv.GetTensorMutableData<int64_t>();
    const float* x = xv.GetTensorData<float>();
    if (T == 0 || N == 0) return;
    if (K == 0) {
      for (int64_t t = 0; t < T; ++t) {
        kept[t] = 0;
        for (int64_t c = 0; c < N; ++c) y[t * N + c] = bias ? bias[c] : 0.0f;
      }
      return;
    }
    std::vector<float> limit(static_cast<size_t>(K));
    for (int64_t i = 0; i < K; ++i) limit[i] = thr[uniform ? 0 : i] * scale;

    if (quant) {
      compute_quant(ctx, fmt, x, T, K, N, limit.data(), wv.GetTensorRawData(), scales, bias, y, kept);
      return;
    }
    const SparseRowsFn fn = sparse_kernels().by_format[static_cast<int>(fmt)];
    const int64_t units = (N + kColumns - 1) / kColumns;
    const int64_t items = items_for(units);
    const int64_t group = T == 1 ? 1 : kGroup;
    std::vector<int32_t> rows(static_cast<size_t>(K)), ntok, tok;
    std::vector<float> vals(static_cast<size_t>(K * group));
    if (group > 1) {
      ntok.resize(static_cast<size_t>(K));
      tok.resize(static_cast<size_t>(K * group));
    }
    for (int64_t t0 = 0; t0 < T; t0 += group) {
      const int64_t g = std::min(group, T - t0);
      SparseRows call;
      call.w = wv.GetTensorRawData();
      call.n = N;
      call.group = group;
      call.y = y + t0 * N;
      call.ldy = N;
      call.tokens = g;
      int64_t nr = 0;
      if (group == 1) {
        const float* xr = x + t0 * K;
        for (int64_t i = 0; i < K; ++i) {
          if (!(std::fabs(xr[i]) <= limit[i])) {
            rows[nr] = static_cast<int32_t>(i);
            vals[nr++] = xr[i];
          }
        }
        kept[t0] = nr;
      } else {
        for (int64_t j = 0; j < g; ++j) kept[t0 + j] = 0;
        for (int64_t i = 0; i < K; ++i) {
          int32_t m = 0;
          for (int64_t j = 0; j < g; ++j) {
            const float v = x[(t0 + j) * K + i];
            if (!(std::fabs(v) <= limit[i])) {
              tok[nr * group + m] = static_cast<int32_t>(j);
              vals[nr * group + m] = v;
              ++m;
              ++kept[t0 + j];
            }
          }
          if (m > 0) {
            rows[nr] = static_cast<int32_t>(i);
            ntok[nr++] = m;
          }
        }
        call.ntok = ntok.data();
        call.tok = tok.data();
      }
      call.rows = rows.data();
      call.nrows = nr;
      call.xv = vals.data();
      std::memset(call.y, 0, sizeof(float) * static_cast<size_t>(g * N));
      // Item k: the columns of 64-column units [k * units / items, (k + 1) * units / items).
      const std::function<void(size_t)> work = [&](size_t k) {
        const int64_t c0 = int64_t(k) * units / items * kColumns;
        const int64_t c1 = std::min(N, (int64_t(k) + 1) * units / items * kColumns);
        fn(call, c0, c1);
        if (bias != nullptr)
          for (int64_t j = 0; j < g; ++j)
            for (int64_t c = c0; c < c1; ++c) call.y[j * N + c] += bias[c];
      };
      run_items(ctx, items, work);
    }
  }

  // q8 / q4: per token, the kept channels' x quantized per 32-channel block (as moe.cpp's quantize_token_blocks:
  // d = max|x| / 127, NaN winning; codes round half to even, clipped to +-127, NaN -> 0; a skipped channel 0),
  // the blocks with a kept channel and their kept rows in groups of 4 (sparse_linear.h SparseQRows); then the
  // columns split over the threads, each running its range for every token (T > 1: kQTile columns at a time,
  // so the tile's weights stay in cache across the tokens).
  void compute_quant(Ort::KernelContext& ctx, SparseFormat fmt, const float* x, int64_t T, int64_t K, int64_t N,
                     const float* limit, const void* w, const uint16_t* scales, const float* bias, float* y,
                     int64_t* kept) {
    const int64_t nkb = K / kQBlock;
    std::vector<SparseQBlock> blocks(static_cast<size_t>(T * nkb));
    std::vector<int32_t> rows4(static_cast<size_t>(T * K)), xq4(static_cast<size_t>(T * K / 4));
    std::vector<SparseQRows> calls(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
      const float* xr = x + t * K;
      SparseQBlock* bl = blocks.data() + t * nkb;
      int32_t* r4 = rows4.data() + t * K;
      int32_t* x4 = xq4.data() + t * K / 4;
      int64_t nb = 0, ng = 0, nk = 0;
      for (int64_t kb = 0; kb < nkb; ++kb) {
        int32_t idx[kQBlock];
        float val[kQBlock];
        int m = 0;
        float amax = 0.0f;
        for (int64_t j = 0; j < kQBlock; ++j) {  // no branch on the keep test (half the channels at s = 0.5)
          const int64_t i = kb * kQBlock + j;
          const float v = xr[i], a = std::fabs(v);
          const bool keep = !(a <= limit[i]);
          idx[m] = static_cast<int32_t>(i);
          val[m] = v;
          m += keep ? 1 : 0;
          const float ak = keep ? a : 0.0f;
          amax = (ak > amax || ak != ak) ? ak : amax;  // NaN wins, as numpy's max
        }
        if (m == 0) continue;
        nk += m;
        const float inv = (amax > 0.0f && amax <= 3.4028234663852886e38f) ? 127.0f / amax : 0.0f;
        SparseQBlock& b = bl[nb++];
        b.kb = static_cast<int32_t>(kb);
        b.g0 = static_cast<int32_t>(ng);
        b.ng = (m + 3) / 4;
        b.dx = amax / 127.0f;
        int32_t sum = 0;
        for (int g = 0; g < b.ng; ++g) {
          uint32_t packed = 0;
          for (int r = 0; r < 4; ++r) {
            const int e = 4 * g + r;
            int8_t c = 0;
            if (e < m) {
              float v = std::nearbyint(val[e] * inv);  // round half to even, as np.rint
              v = v != v ? 0.0f : (v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
              c = static_cast<int8_t>(v);
            }
            sum += c;
            packed |= static_cast<uint32_t>(static_cast<uint8_t>(c)) << (8 * r);
            r4[4 * (ng + g) + r] = idx[e < m ? e : m - 1];
          }
          x4[ng + g] = static_cast<int32_t>(packed);
        }
        b.sum = sum;
        ng += b.ng;
      }
      kept[t] = nk;
      SparseQRows& call = calls[static_cast<size_t>(t)];
      call.w = w;
      call.k = K;
      call.scales = scales;
      call.n = N;
      call.blocks = bl;
      call.nblocks = nb;
      call.rows4 = r4;
      call.xq4 = x4;
      call.y = y + t * N;
    }
    std::memset(y, 0, sizeof(float) * static_cast<size_t>(T * N));
    const SparseQFn fn = fmt == SparseFormat::q8 ? sparse_q_kernels().q8 : sparse_q_kernels().q4;
    const int64_t units = (N + kQColumns - 1) / kQColumns;
    const int64_t items = items_for(units);
    const std::function<void(size_t)> work = [&](size_t k) {
      const int64_t c0 = int64_t(k) * units / items * kQColumns;
      const int64_t c1 = std::min(N, (int64_t(k) + 1) * units / items * kQColumns);
      const int64_t step = T == 1 ? c1 - c0 : kQTile;
      for (int64_t a = c0; a < c1; a += step) {
        const int64_t b = std::min(c1, a + step);
        for (int64_t t = 0; t < T; ++t) fn(calls[static_cast<size_t>(t)], a, b);
      }
      if (bias != nullptr)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t c = c0; c < c1; ++c) y[t * N + c] += bias[c];
    };
    run_items(ctx, items, work);
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return guarded(ORT_RUNTIME_EXCEPTION, [&] { compute(context); });
  }
};

struct SparseLinearOp : Ort::CustomOpBase<SparseLinearOp, SparseLinearKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    return guarded(ORT_INVALID_ARGUMENT, [&] { *kernel = new SparseLinearKernel(info); });
  }
  const char* GetName() const { return kOpName; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return kInputs; }
  // Every input's type is checked when the kernel is created (one line naming the node), not by ONNX Runtime.
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= kScale ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t i) const {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  }
};

// ai.layerzero::QLinear (sparse_linear.h): the dense quantized linear on the MoE experts' row kernels.
constexpr const char* kQLinearName = "QLinear";
constexpr size_t kQLinearInputs = 4;  // x, codes, scales, bias?
constexpr int64_t kQLinearRows = 64;  // the row split's granule

struct QLinearKernel {
  std::string node;
  int bits = 4;
  bool chunked = false;         // code_layout "chunk16": the q4 rows in 16-block chunks (qdot_rows.h)
  std::vector<int64_t> splits;  // the outputs' columns (the splits attribute); empty: one output of N columns

  [[noreturn]] void fail(const std::string& what) const {
    throw Failure{ORT_INVALID_ARGUMENT, "ai.layerzero::QLinear node '" + node + "': " + what};
  }

  // {N, K} of codes [N, K / 2] uint8 (q4) / [N, K] int8 (q8) ("" when its type fits; -1 = unknown).
  std::string check_codes(ONNXTensorElementDataType t, const std::vector<int64_t>& s, int64_t* n, int64_t* k) const {
    const auto want = bits == 4 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
    if (t != want)
      return std::string("codes have element type ") + type_name(t) + "; weight_format='" + (bits == 4 ? "q4" : "q8") +
             "' takes " + (bits == 4 ? "uint8 (two 4-bit codes a byte)" : "int8");
    if (s.size() != 2) return std::string("codes must be rank 2 ([N, K") + (bits == 4 ? "/2" : "") + "]), not " + dims(s);
    *n = s[0];
    *k = s[1] < 0 ? -1 : (bits == 4 ? 2 * s[1] : s[1]);
    return "";
  }
  std::string check_scales(ONNXTensorElementDataType t, const std::vector<int64_t>& s, int64_t n, int64_t k) const {
    if (t != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) return std::string("scales must be float16, not ") + type_name(t);
    const int64_t kb = k < 0 ? -1 : k / kQBlock;
    if (s.size() != 2 || (s[0] >= 0 && n >= 0 && s[0] != n) || (s[1] >= 0 && kb >= 0 && s[1] != kb))
      return "scales must be [N, K/32] = [" + std::to_string(n) + ", " + std::to_string(kb) + "], not " + dims(s);
    return "";
  }
  std::string check_bias(ONNXTensorElementDataType t, const std::vector<int64_t>& s, int64_t n) const {
    if (t != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) return std::string("bias must be float32, not ") + type_name(t);
    if (s.size() != 1 || (s[0] >= 0 && n >= 0 && s[0] != n))
      return "bias must be [N] = [" + std::to_string(n) + "], not " + dims(s);
    return "";
  }

  // "" when splits (if given) sum to N.
  std::string check_splits(int64_t n) const {
    int64_t sum = 0;
    for (const int64_t v : splits) sum += v;
    if (splits.empty() || sum == n) return "";
    return "splits " + dims(splits) + " sum to " + std::to_string(sum) + ", not the codes' N = " + std::to_string(n);
  }

  explicit QLinearKernel(const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    node = ki.GetNodeName();
    const std::string format_name = attr_string(info, "weight_format", "");
    if (format_name != "q4" && format_name != "q8")
      fail("weight_format='" + format_name + "' is not implemented by liblayerzero_ort.so (q4, q8)");
    bits = format_name == "q4" ? 4 : 8;
    if (const std::string e = parse_code_layout(attr_string(info, "code_layout", "rows"), format_name, &chunked);
        !e.empty())
      fail(e);
    const int64_t block = attr_int(info, "block_size", 32);
    if (block != 32) fail("block_size=" + std::to_string(block) + " is not implemented by liblayerzero_ort.so (32)");
    const size_t inputs = ki.GetInputCount();
    if (inputs < 3 || inputs > kQLinearInputs)
      fail("has " + std::to_string(inputs) + " inputs; QLinear takes 3 or 4 (x, codes, scales[, bias])");
    const size_t outputs = ki.GetOutputCount();
    if (attr_int(info, "splits", -1) != -1 || attr_int(info, "splits", -2) != -2)  // a scalar int attribute
      fail("splits must be a list of ints (the outputs' columns), not one int");
    if (attr_ints(info, "splits", &splits)) {
      if (splits.empty()) fail("splits is empty (one entry per output)");
      for (const int64_t v : splits)
        if (v <= 0) fail("splits must be positive, not " + dims(splits));
      if (outputs != splits.size())
        fail("has " + std::to_string(outputs) + " outputs; splits " + dims(splits) + " gives " +
             std::to_string(splits.size()));
    } else if (outputs != 1) {
      fail("has " + std::to_string(outputs) + " outputs; QLinear without splits has one (y)");
    }
    auto tensor_of = [&](size_t i) {
      Ort::TypeInfo type = ki.GetInputTypeInfo(i);
      if (type.GetONNXType() != ONNX_TYPE_TENSOR) fail("input " + std::to_string(i) + " is not a tensor");
      auto t = type.GetTensorTypeAndShapeInfo();
      return std::make_pair(t.GetElementType(), t.GetShape());
    };
    const auto [xt, xs] = tensor_of(0);  // (an unknown rank reads as []: the rank is checked when it runs)
    if (xt != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) fail(std::string("x must be float32, not ") + type_name(xt));
    const auto [ct, cs] = tensor_of(1);
    int64_t n = -1, k = -1;
    std::string err = check_codes(ct, cs, &n, &k);
    if (!err.empty()) fail(err);
    if (k >= 0 && k % kQBlock != 0)
      fail("K = " + std::to_string(k) + " is not a multiple of the block length 32 (blocks along K)");
    if (!xs.empty() && xs.back() >= 0 && k >= 0 && xs.back() != k)
      fail("x's last dimension " + std::to_string(xs.back()) + " is not the codes' K = " + std::to_string(k));
    const auto [st, ss] = tensor_of(2);
    err = check_scales(st, ss, n, k);
    if (!err.empty()) fail(err);
    if (inputs > 3) {
      const auto [bt, bs] = tensor_of(3);
      err = check_bias(bt, bs, n);
      if (!err.empty()) fail(err);
    }
    if (n >= 0) {
      err = check_splits(n);
      if (!err.empty()) fail(err);
    }
    if (const OrtValue* v = constant_input(info, 1)) {  // the codes: huge pages in place (moe.h)
      Ort::ConstValue c(v);
      advise_huge_pages(c.GetTensorRawData(), c.GetTensorTypeAndShapeInfo().GetElementCount());
    }
  }

  void compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    Ort::ConstValue xv = ctx.GetInput(0), cv = ctx.GetInput(1), sv = ctx.GetInput(2);
    const std::vector<int64_t> xs = xv.GetTensorTypeAndShapeInfo().GetShape();
    auto ci = cv.GetTensorTypeAndShapeInfo();
    int64_t N = -1, K = -1;
    std::string err = check_codes(ci.GetElementType(), ci.GetShape(), &N, &K);
    if (!err.empty()) fail(err);
    if (K % kQBlock != 0) fail("K = " + std::to_string(K) + " is not a multiple of the block length 32");
    if (xs.empty() || xs.back() != K) fail("x's last dimension is not the codes' K = " + std::to_string(K));
    auto si = sv.GetTensorTypeAndShapeInfo();
    err = check_scales(si.GetElementType(), si.GetShape(), N, K);
    if (!err.empty()) fail(err);
    const float* bias = nullptr;
    if (ctx.GetInputCount() > 3) {
      Ort::ConstValue bv = ctx.GetInput(3);
      if (bv != nullptr) {
        auto bi = bv.GetTensorTypeAndShapeInfo();
        err = check_bias(bi.GetElementType(), bi.GetShape(), N);
        if (!err.empty()) fail(err);
        bias = bv.GetTensorData<float>();
      }
    }
    err = check_splits(N);
    if (!err.empty()) fail(err);
    int64_t T = 1;
    for (size_t i = 0; i + 1 < xs.size(); ++i) T *= xs[i];
    // Output p: columns [start[p], start[p + 1]) of the product, x's leading dims and n_p = start[p + 1] - start[p].
    const std::vector<int64_t> parts = splits.empty() ? std::vector<int64_t>{N} : splits;
    const size_t P = parts.size();
    std::vector<int64_t> start(P + 1, 0), ustart(P + 1, 0);  // first column, first row unit of each output
    std::vector<float*> ys(P);
    for (size_t p = 0; p < P; ++p) {
      std::vector<int64_t> shape(xs);
      shape.back() = parts[p];
      ys[p] = ctx.GetOutput(p, shape).GetTensorMutableData<float>();
      start[p + 1] = start[p] + parts[p];
      ustart[p + 1] = ustart[p] + (parts[p] + kQLinearRows - 1) / kQLinearRows;
    }
    if (T == 0 || N == 0) return;
    if (K == 0) {
      for (size_t p = 0; p < P; ++p)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t c = 0; c < parts[p]; ++c) ys[p][t * parts[p] + c] = bias ? bias[start[p] + c] : 0.0f;
      return;
    }
    const float* x = xv.GetTensorData<float>();
    // Each token's x quantized per 32-block to int8 once (quantize_token: the MoE experts' rounding), then every
    // row's dot (qdot_rows.h) against every token; the rows split over the threads, each row's arithmetic the same
    // in any range (so the result does not depend on the split, nor on T: a token's y is the same alone or batched,
    // nor on splits: a row's y is the same in one node's output or another's).
    const int64_t kp = (K + kQPad - 1) / kQPad * kQPad, nb = kp / kQBlock;
    std::vector<int8_t> q(static_cast<size_t>(T * kp));
    std::vector<float> d(static_cast<size_t>(T * nb));
    std::vector<int32_t> off(static_cast<size_t>(T * nb));
    const QTokens xq{q.data(), d.data(), off.data(), kp, nb, chunked ? q4_chunked_blocks(K) : 0};
    for (int64_t t = 0; t < T; ++t) quantize_token(x + t * K, K, bits, xq, t);
    const QDotRowsFn fn = bits == 4 ? qdot_kernels().q4 : qdot_kernels().q8;
    const uint8_t* codes = static_cast<const uint8_t*>(cv.GetTensorRawData());
    const uint16_t* scales = static_cast<const uint16_t*>(sv.GetTensorRawData());
    const int64_t rb = bits == 4 ? K / 2 : K, sb = K / kQBlock;
    // The work: each output's rows in units of kQLinearRows (its last unit short), the units of all outputs in a
    // row; item i takes units [i U / items, (i + 1) U / items), a unit never straddling two outputs, and runs each
    // output's part of them as one call writing straight into that output (ldy = its columns). One output (no
    // splits): the units and ranges of the single-output op.
    const int64_t units = ustart[P];
    const int64_t items = std::min(units, split_items());
    const std::function<void(size_t)> work = [&](size_t i) {
      const int64_t u0 = int64_t(i) * units / items, u1 = (int64_t(i) + 1) * units / items;
      for (size_t p = 0; p < P; ++p) {
        const int64_t a = std::max(u0, ustart[p]), b = std::min(u1, ustart[p + 1]);
        if (b <= a) continue;
        const int64_t n = parts[p];
        const int64_t r0 = (a - ustart[p]) * kQLinearRows, r1 = std::min(n, (b - ustart[p]) * kQLinearRows);
        const int64_t g0 = start[p] + r0;  // the rows' first column of the whole product
        float* y = ys[p];
        fn(codes + g0 * rb, scales + g0 * sb, r1 - r0, K, xq, T, y + r0, n);
        if (bias != nullptr)
          for (int64_t t = 0; t < T; ++t)
            for (int64_t c = r0; c < r1; ++c) y[t * n + c] += bias[start[p] + c];
      }
    };
    parallel_items(ctx, static_cast<size_t>(items), work);
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return guarded(ORT_RUNTIME_EXCEPTION, [&] { compute(context); });
  }
};

struct QLinearOp : Ort::CustomOpBase<QLinearOp, QLinearKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    return guarded(ORT_INVALID_ARGUMENT, [&] { *kernel = new QLinearKernel(info); });
  }
  const char* GetName() const { return kQLinearName; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return kQLinearInputs; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 3 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  // One output, or one per entry of splits: a variadic float32 output (at least one; every one float32).
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t) const { return INPUT_OUTPUT_VARIADIC; }
  int GetVariadicOutputMinArity() const { return 1; }
  bool GetVariadicOutputHomogeneity() const { return true; }
};

}  // namespace

const OrtCustomOp* qlinear_op() {
  static QLinearOp op;
  return &op;
}

const OrtCustomOp* sparse_linear_op() {
  static SparseLinearOp op;
  return &op;
}

}  // namespace lz

// The SparseLinear kernels' ISA (avx512, avx2 or generic), for benchmarks and tests.
extern "C" __attribute__((visibility("default"))) const char* LayerZeroOrtSparseIsa() {
  return lz::sparse_kernels().isa;
}

// The SparseLinear q8 / q4 kernels' ISA (avx512vnni, avx2 or generic), for benchmarks and tests.
extern "C" __attribute__((visibility("default"))) const char* LayerZeroOrtSparseQIsa() {
  return lz::sparse_q_kernels().isa;
}
