// The native ai.layerzero::MoE computation (see moe.h).
#include "moe.h"

#include "fast_exp.h"
#include "sparse_linear.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <thread>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace lz {

bool parse_scoring(const std::string& s, Scoring* out) {
  if (s == "softmax") *out = Scoring::softmax;
  else if (s == "sigmoid") *out = Scoring::sigmoid;
  else return false;
  return true;
}

bool parse_activation(const std::string& s, Activation* out) {
  if (s == "silu") *out = Activation::silu;
  else if (s == "gelu") *out = Activation::gelu;
  else if (s == "relu") *out = Activation::relu;
  else if (s == "swiglu_oai") *out = Activation::swiglu_oai;
  else return false;
  return true;
}

std::string group_error(const MoEConfig& cfg, int64_t experts) {
  if (cfg.n_group == 1) return "";
  const std::string what = "n_group=" + std::to_string(cfg.n_group) + ", topk_group=" + std::to_string(cfg.topk_group);
  if (cfg.n_group < 1 || experts % cfg.n_group != 0 || cfg.topk_group < 1 || cfg.topk_group > cfg.n_group)
    return what + ": expected n_group dividing " + std::to_string(experts) + " experts and topk_group in 1..n_group";
  const int64_t size = experts / cfg.n_group;
  if (size < 2 || cfg.top_k > cfg.topk_group * size)
    return what + ", top_k=" + std::to_string(cfg.top_k) + ": groups of " + std::to_string(size) +
           " experts (at least 2, top_k <= topk_group x group size)";
  return "";
}

size_t advise_huge_pages(const void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  static const bool enabled = [] {
    const char* v = std::getenv("LAYERZERO_ORT_HUGEPAGES");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (!enabled || end <= begin) return 0;
  void* start = reinterpret_cast<void*>(begin);
  if (madvise(start, end - begin, MADV_HUGEPAGE) != 0) return 0;
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1; older kernels answer EINVAL and khugepaged collapses later (or never)
#endif
  if (madvise(start, end - begin, MADV_COLLAPSE) != 0) return 0;
  return end - begin;
#else
  (void)data;
  (void)bytes;
  return 0;
#endif
}

float load_element(const void* p, WeightType type, int64_t i) {
  const uint16_t* h = static_cast<const uint16_t*>(p);
  switch (type) {
    case WeightType::f32:
      return static_cast<const float*>(p)[i];
    case WeightType::f16:
      return half_to_float(h[i]);
    case WeightType::bf16:
      return bf16_to_float(h[i]);
  }
  return 0.0f;
}

bool parse_weight_format(const std::string& s, WeightFormat* out) {
  if (s == "f") *out = WeightFormat::f;
  else if (s == "q8") *out = WeightFormat::q8;
  else if (s == "q4") *out = WeightFormat::q4;
  else return false;
  return true;
}

std::string parse_code_layout(const std::string& value, const std::string& format_name, bool* chunked) {
  *chunked = value == "chunk16";
  if (value != "rows" && value != "chunk16")
    return "code_layout='" + value + "' is not implemented by liblayerzero_ort.so (rows, chunk16)";
  if (*chunked && format_name != "q4")
    return "code_layout='chunk16' is a q4 layout, not one of weight_format='" + format_name + "'";
  return "";
}

// The row kernels' software prefetch (qdot_rows.cpp): measured to help on Intel (an AVX-512 host, one core, cold
// experts: q4 0.35 -> 0.27 ms, its AVX2 build 0.52 -> 0.38) and to cost 10-40 % in the AVX2 build on an AMD EPYC
// Zen 3 host (the cold rows read faster without it), so off by default for the AVX2 build on AMD CPUs; the AVX-512
// build keeps it everywhere (an AMD Zen 4 host's figures were taken with it; not measured without).
// LAYERZERO_ORT_PREFETCH=0 / 1 forces it.
const QDotKernels& qdot_kernels() {
  static const QDotKernels* chosen = [] {
    const char* isa = std::getenv("LAYERZERO_ORT_ISA");
    const std::string want = isa != nullptr ? isa : "";
    const char* forced = std::getenv("LAYERZERO_ORT_PREFETCH");
    const auto prefetch = [forced](bool fallback) {
      return forced != nullptr && *forced != '\0' ? std::strcmp(forced, "0") != 0 : fallback;
    };
    if (want == "generic") return &generic::kQKernels;
    if (want != "avx2" && avx512vnni::q_available())
      return prefetch(true) ? &avx512vnni::kQKernels : &avx512vnni::kQKernelsNoPrefetch;
    if (!avx2::q_available()) return &generic::kQKernels;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    const bool amd = __builtin_cpu_is("amd");
#else
    const bool amd = false;
#endif
    return prefetch(!amd) ? &avx2::kQKernels : &avx2::kQKernelsNoPrefetch;
  }();
  return *chosen;
}

void quantize_token(const float* x, int64_t k, int bits, const QTokens& xq, int64_t t) {
  std::memset(xq.q + t * xq.kp, 0, static_cast<size_t>(xq.kp));
  std::memset(xq.d + t * xq.nb, 0, sizeof(float) * static_cast<size_t>(xq.nb));
  std::memset(xq.off + t * xq.nb, 0, sizeof(int32_t) * static_cast<size_t>(xq.nb));
  quantize_token_blocks(x, 0, k / kQBlock, bits, xq, t);
}

void quantize_token_blocks(const float* x, int64_t b0, int64_t b1, int bits, const QTokens& xq, int64_t t) {
  qdot_kernels().quantize(x, b0, b1, bits, xq, t);
}

const DotKernels& dot_kernels() {
  static const DotKernels* chosen = [] {
    const char* isa = std::getenv("LAYERZERO_ORT_ISA");
    bool generic_only = isa != nullptr && std::strcmp(isa, "generic") == 0;
    return (!generic_only && avx2::available()) ? &avx2::kKernels : &generic::kKernels;
  }();
  return *chosen;
}

float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | man << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  int32_t exp = static_cast<int32_t>((x >> 23) & 0xff) - 127 + 15;
  uint32_t man = x & 0x7fffffu;
  if (((x >> 23) & 0xff) == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (man ? 0x200u : 0));
  if (exp >= 0x1f) return static_cast<uint16_t>(sign | 0x7c00u);
  if (exp <= 0) {
    if (exp < -10) return static_cast<uint16_t>(sign);
    man |= 0x800000u;
    uint32_t shift = static_cast<uint32_t>(14 - exp);
    uint32_t half = man >> shift, rest = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rest > mid || (rest == mid && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = sign | static_cast<uint32_t>(exp) << 10 | man >> 13, rest = man & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1))) ++half;  // round to nearest even (may carry into exp)
  return static_cast<uint16_t>(half);
}

uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1);
  return static_cast<uint16_t>(x >> 16);
}

void routing_confidence(const float* logits, int64_t tokens, int64_t experts, Scoring scoring, float* out) {
  for (int64_t t = 0; t < tokens; ++t) {
    const float* l = logits + t * experts;
    if (experts == 0) {
      out[t] = 0.0f;
      continue;
    }
    float m = l[0];
    bool nan = false;
    for (int64_t e = 0; e < experts; ++e) {
      nan |= std::isnan(l[e]);
      m = l[e] > m ? l[e] : m;
    }
    if (nan) {
      out[t] = std::numeric_limits<float>::quiet_NaN();
    } else if (scoring == Scoring::softmax) {
      float sum = 0.0f;
      for (int64_t e = 0; e < experts; ++e) sum += std::exp(l[e] - m);
      out[t] = 1.0f / sum;
    } else {
      out[t] = 1.0f / (1.0f + std::exp(-m));
    }
  }
}

void route(const float* logits, int64_t tokens, int64_t experts, const MoEConfig& cfg, float threshold,
           const float* score_bias, std::vector<float>* weights, uint8_t* mask) {
  weights->assign(static_cast<size_t>(tokens * experts), 0.0f);
  std::memset(mask, 0, static_cast<size_t>(tokens * experts));
  const size_t E = static_cast<size_t>(experts);
  std::vector<double> probs(E), key(E);
  std::vector<int64_t> index(E);
  std::vector<double> top(static_cast<size_t>(cfg.top_k));
  const bool v2_selection = score_bias != nullptr || cfg.n_group != 1;
  const int64_t n_group = cfg.n_group, group_size = experts / std::max<int64_t>(n_group, 1);
  std::vector<float> group_score(static_cast<size_t>(std::max<int64_t>(n_group, 1)));
  std::vector<int64_t> group_index(group_score.size());
  std::vector<uint8_t> group_kept(group_score.size());
  for (int64_t t = 0; t < tokens; ++t) {
    const float* l = logits + t * experts;
    // In double, as the reference: top-k of nearly equal probabilities then agrees with it.
    if (cfg.scoring == Scoring::softmax) {
      double m = l[0];
      for (int64_t e = 1; e < experts; ++e) m = std::max(m, static_cast<double>(l[e]));
      double sum = 0.0;
      for (int64_t e = 0; e < experts; ++e) sum += probs[e] = std::exp(static_cast<double>(l[e]) - m);
      for (int64_t e = 0; e < experts; ++e) probs[e] /= sum;
    } else {
      for (int64_t e = 0; e < experts; ++e) probs[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(l[e])));
    }
    // The sort key: NaN ranks last (as the reference's argsort), which also keeps the comparison a strict weak
    // order (a NaN compared as is would make std::partial_sort undefined).
    if (!v2_selection) {
      for (int64_t e = 0; e < experts; ++e) key[e] = std::isnan(probs[e]) ? -HUGE_VAL : probs[e];
    } else {
      // v2 selection (reference._selection_scores): probs + score_bias in float32, as the models compute it
      // (which of two nearly equal sums is larger decides the choice); the weights stay the unbiased probs.
      for (int64_t e = 0; e < experts; ++e) {
        float s = static_cast<float>(probs[e]);
        if (score_bias != nullptr) s += score_bias[e];
        key[e] = std::isnan(s) ? -HUGE_VAL : static_cast<double>(s);
      }
      if (n_group > 1) {
        // A group's score: the sum of its two largest selection scores (float32); the topk_group best groups
        // (ties to the lower group) stay, the others go to -inf.
        for (int64_t g = 0; g < n_group; ++g) {
          double a = -HUGE_VAL, b = -HUGE_VAL;
          for (int64_t e = g * group_size; e < (g + 1) * group_size; ++e) {
            if (key[e] > a) {
              b = a;
              a = key[e];
            } else if (key[e] > b) {
              b = key[e];
            }
          }
          const float sum = static_cast<float>(a) + static_cast<float>(b);
          group_score[g] = std::isnan(sum) ? -HUGE_VALF : sum;
        }
        std::iota(group_index.begin(), group_index.end(), 0);
        std::stable_sort(group_index.begin(), group_index.end(),
                         [&](int64_t x, int64_t y) { return group_score[x] > group_score[y]; });
        std::fill(group_kept.begin(), group_kept.end(), 0);
        for (int64_t j = 0; j < cfg.topk_group; ++j) group_kept[group_index[j]] = 1;
        for (int64_t e = 0; e < experts; ++e)
          if (!group_kept[e / group_size]) key[e] = -HUGE_VAL;
      }
    }
    std::iota(index.begin(), index.end(), 0);
    // Ties towards the lower expert index (ONNX TopK, the reference's stable sort).
    std::partial_sort(index.begin(), index.begin() + cfg.top_k, index.end(), [&](int64_t a, int64_t b) {
      return key[a] > key[b] || (key[a] == key[b] && a < b);
    });
    double sum = 0.0, largest = 0.0;
    for (int64_t j = 0; j < cfg.top_k; ++j) sum += top[j] = probs[index[j]];
    for (int64_t j = 0; j < cfg.top_k; ++j) {
      // + 1e-20 as the reference (reference.NORMALIZE_EPS, the models' own formula); nothing in double for v1.
      if (cfg.normalize) top[j] /= sum + 1e-20;
      top[j] *= static_cast<double>(cfg.routed_scaling_factor);
      // A NaN weight makes the largest NaN, so no expert of the token passes the threshold (the reference's max).
      largest = (std::isnan(top[j]) || std::isnan(largest)) ? NAN : std::max(largest, top[j]);
    }
    double bound = static_cast<double>(threshold) * largest;
    for (int64_t j = 0; j < cfg.top_k; ++j) {
      if (!(top[j] >= bound)) continue;  // below threshold x the token's largest weight: skipped
      (*weights)[t * experts + index[j]] = static_cast<float>(top[j]);
      mask[t * experts + index[j]] = 1;
    }
  }
}

namespace {

// The gated unit glu(g, u) (reference.glu): act(g) * u, or GPT-OSS's clamped swiglu_oai.
inline float glu(float g, float u, const MoEConfig& cfg) {
  switch (cfg.activation) {
    case Activation::silu:
      return g / (1.0f + std::exp(-g)) * u;
    case Activation::gelu:
      return 0.5f * g * (1.0f + std::erf(g * 0.70710678118654752f)) * u;
    case Activation::relu:
      return (g > 0.0f ? g : 0.0f) * u;
    case Activation::swiglu_oai: {
      const float limit = cfg.activation_limit;
      // NaN propagates as through np.minimum / np.clip (a comparison with NaN is false: the value is kept).
      const float gc = limit < g ? limit : g;
      const float uc = u > limit ? limit : (u < -limit ? -limit : u);
      return (uc + 1.0f) * gc / (1.0f + std::exp(-cfg.activation_alpha * gc));
    }
  }
  return g * u;
}

// h[r] = silu(g[r]) * u[r] for the quantized experts (their h is quantized next): sigmoid from exp_nonpositive
// of -|g| (e / (1 + e) below 0, 1 / (1 + e) above), branch-free so that the loop vectorises; relative error ~1e-7
// against glu's libm exp (NaN stays NaN). A Qwen3-MoE-style block (E32 k4 F384, 1 token): the scalar glu's expf
// calls were ~8 % of its time.
void silu_glu(const float* __restrict g, const float* __restrict u, int64_t rows, float* __restrict h) {
  for (int64_t r = 0; r < rows; ++r) {
    const float x = g[r], e = exp_nonpositive(-std::fabs(x));
    const float sig = (x >= 0.0f ? 1.0f : e) / (1.0f + e);
    h[r] = x * sig * u[r];
  }
}

size_t element_size(WeightType t) { return t == WeightType::f32 ? 4 : 2; }

// Work items are contiguous row ranges of one expert's matrices: the longer a range, the longer the sequential
// streams the kernels read (the hardware prefetcher ramps up again at the start of every stream; the weights are
// not in cache: a token's experts are read once). An expert's matrix is split into pieces only as far as the
// threads need items: about kItemsPerThread per hardware thread over the active experts, never below kMinRows rows.
constexpr int64_t kItemsPerThread = 2;
constexpr int64_t kMinRows = 64;

int64_t pieces_for(int64_t rows, size_t active) {
  static const int64_t threads = std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()));
  const int64_t want = (kItemsPerThread * threads + static_cast<int64_t>(active) - 1) / static_cast<int64_t>(active);
  return std::max<int64_t>(1, std::min<int64_t>(want, rows / kMinRows));
}

struct Active {
  int64_t expert;
  std::vector<int64_t> tokens;  // routed to it, ascending
  const float* x;               // its tokens' rows [n, H] (the input itself when every token is routed)
  int64_t x_offset;             // into the gathered buffer
  int64_t h_offset;             // into the intermediate buffer [n, F]
  int64_t o_offset;             // into the output buffer [n, H] (its share of y before the routing weight)
};


// A 64-byte aligned buffer of n elements, zeroed.
template <class T>
struct Aligned {
  std::vector<unsigned char> raw;
  T* data = nullptr;
  explicit Aligned(size_t n) : raw(n * sizeof(T) + 64, 0) {
    data = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(raw.data()) + 63) & ~uintptr_t(63));
  }
};

struct QActive {
  int64_t expert;
  std::vector<int64_t> tokens;  // routed to it, ascending
  QTokens x;                    // its tokens' quantized x (the all-token buffer itself when every token is routed)
  int64_t h_offset;             // into the intermediate buffers ([n, F] float, [n, kpF] quantized)
  int64_t o_offset;             // into the output buffer [n, H]
};

// The quantized formats (weight_format q8 / q4): as run_experts' float path, with x quantized once per token
// (all tokens, then gathered per expert: a few bytes a token), h quantized per (expert, token) between the phases.
void run_experts_quant(const float* x, int64_t tokens, const MoEWeights& w, const MoEConfig& cfg,
                       const std::vector<float>& weights, const uint8_t* mask, float* y,
                       const ParallelFor& parallel_for) {
  const int64_t E = w.experts, F = w.ffn, H = w.hidden;
  const int bits = w.format == WeightFormat::q4 ? 4 : 8;
  const auto pad = [](int64_t k) { return (k + kQPad - 1) / kQPad * kQPad; };
  const int64_t kpH = pad(H), kpF = pad(F), nbH = kpH / kQBlock, nbF = kpF / kQBlock;
  std::vector<QActive> active;
  int64_t gathered = 0, inter = 0, outs = 0;
  for (int64_t e = 0; e < E; ++e) {
    QActive a{e, {}, {}, 0, 0};
    for (int64_t t = 0; t < tokens; ++t)
      if (mask[t * E + e]) a.tokens.push_back(t);
    if (a.tokens.empty()) continue;  // no token routed: its weights are never read
    const int64_t n = static_cast<int64_t>(a.tokens.size());
    if (n < tokens) {
      a.x.kp = gathered;  // (offset in tokens, set to the buffer below)
      gathered += n;
    } else {
      a.x.kp = -1;
    }
    a.h_offset = inter;
    inter += n;
    a.o_offset = outs;
    outs += n * H;
    active.push_back(std::move(a));
  }
  if (active.empty()) return;
  // All tokens' x quantized (each token on its own: the same codes at any thread count).
  Aligned<int8_t> xq_all(static_cast<size_t>(tokens * kpH)), xq_g(static_cast<size_t>(gathered * kpH));
  std::vector<float> xd_all(static_cast<size_t>(tokens * nbH)), xd_g(static_cast<size_t>(gathered * nbH));
  std::vector<int32_t> xo_all(xd_all.size()), xo_g(xd_g.size());
  const int64_t chunkH = w.chunked ? q4_chunked_blocks(H) : 0, chunkF = w.chunked ? q4_chunked_blocks(F) : 0;
  const QTokens all{xq_all.data, xd_all.data(), xo_all.data(), kpH, nbH, chunkH};
  parallel_for(static_cast<size_t>(tokens), [&](size_t t) { quantize_token(x + t * H, H, bits, all, t); });
  for (QActive& a : active) {
    if (a.x.kp < 0) {
      a.x = all;
      continue;
    }
    const int64_t base = a.x.kp;
    a.x = QTokens{xq_g.data + base * kpH, xd_g.data() + base * nbH, xo_g.data() + base * nbH, kpH, nbH, chunkH};
    for (size_t i = 0; i < a.tokens.size(); ++i) {
      const int64_t t = a.tokens[i];
      std::memcpy(a.x.q + i * kpH, all.q + t * kpH, static_cast<size_t>(kpH));
      std::memcpy(a.x.d + i * nbH, all.d + t * nbH, sizeof(float) * static_cast<size_t>(nbH));
      std::memcpy(a.x.off + i * nbH, all.off + t * nbH, sizeof(int32_t) * static_cast<size_t>(nbH));
    }
  }
  std::vector<float> hbuf(static_cast<size_t>(inter * F)), obuf(static_cast<size_t>(outs));
  Aligned<int8_t> hq(static_cast<size_t>(inter * kpF));
  std::vector<float> hd(static_cast<size_t>(inter * nbF));
  std::vector<int32_t> ho(hd.size());
  const QTokens hall{hq.data, hd.data(), ho.data(), kpF, nbF, chunkF};
  const QDotKernels& kernels = qdot_kernels();
  const QDotRowsFn dot = bits == 4 ? kernels.q4 : kernels.q8;
  const int64_t rbH = bits == 4 ? H / 2 : H, rbF = bits == 4 ? F / 2 : F;  // code bytes per row
  const char* gate = static_cast<const char*>(w.gate);
  const char* up = static_cast<const char*>(w.up);
  const char* down = static_cast<const char*>(w.down);

  // Phase 1, items = active experts x F pieces of whole 32-blocks: h[n, piece] = act(x W_gate[piece]^T) *
  // (x W_up[piece]^T), then quantized per block (a block's codes and scale depend on that block only).
  const int64_t want = pieces_for(F, active.size()), f_rows = (F / kQBlock + want - 1) / want * kQBlock;
  const int64_t f_pieces = (F + f_rows - 1) / f_rows;
  const auto phase1 = [&](size_t item) {
    const QActive& a = active[item / f_pieces];
    const int64_t f0 = static_cast<int64_t>(item % f_pieces) * f_rows, rows = std::min(f_rows, F - f0);
    if (rows <= 0) return;
    const int64_t n = static_cast<int64_t>(a.tokens.size());
    const int64_t row = a.expert * F + f0;
    thread_local std::vector<float> g, u;
    g.resize(static_cast<size_t>(n * rows));
    u.resize(static_cast<size_t>(n * rows));
    dot(gate + row * rbH, w.s_gate + row * (H / kQBlock), rows, H, a.x, n, g.data(), rows);
    dot(up + row * rbH, w.s_up + row * (H / kQBlock), rows, H, a.x, n, u.data(), rows);
    float* h = hbuf.data() + a.h_offset * F;
    if (cfg.activation == Activation::silu && w.b_gate == nullptr && w.b_up == nullptr) {
      for (int64_t i = 0; i < n; ++i) silu_glu(g.data() + i * rows, u.data() + i * rows, rows, h + i * F + f0);
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        const float bg = w.b_gate != nullptr ? load_element(w.b_gate, w.b_gate_type, row + r) : 0.0f;
        const float bu = w.b_up != nullptr ? load_element(w.b_up, w.b_up_type, row + r) : 0.0f;
        for (int64_t i = 0; i < n; ++i) h[i * F + f0 + r] = glu(g[i * rows + r] + bg, u[i * rows + r] + bu, cfg);
      }
    }
    for (int64_t i = 0; i < n; ++i)  // (the padding after F stays as allocated: zero)
      quantize_token_blocks(h + i * F, f0 / kQBlock, (f0 + rows) / kQBlock, bits, hall, a.h_offset + i);
  };

  // Phase 2, items = active experts x H pieces: o[n, piece] = h W_down[piece]^T (+ b_down).
  const int64_t h_pieces = pieces_for(H, active.size()), h_rows = (H + h_pieces - 1) / h_pieces;
  const auto phase2 = [&](size_t item) {
    const QActive& a = active[item / h_pieces];
    const int64_t h0 = static_cast<int64_t>(item % h_pieces) * h_rows, rows = std::min(h_rows, H - h0);
    if (rows <= 0) return;
    const int64_t n = static_cast<int64_t>(a.tokens.size());
    const int64_t row = a.expert * H + h0;
    const QTokens hx{hall.q + a.h_offset * kpF, hall.d + a.h_offset * nbF, hall.off + a.h_offset * nbF, kpF, nbF,
                     chunkF};
    float* o = obuf.data() + a.o_offset + h0;  // [n, H] with row stride H
    dot(down + row * rbF, w.s_down + row * (F / kQBlock), rows, F, hx, n, o, H);
    if (w.b_down != nullptr) {
      for (int64_t r = 0; r < rows; ++r) {
        const float bd = load_element(w.b_down, w.b_down_type, row + r);
        for (int64_t i = 0; i < n; ++i) o[i * H + r] += bd;
      }
    }
  };
  if (f_pieces == 1 && h_pieces == 1) {
    // Each expert one item in both phases: one dispatch, both phases per expert (the same row dots, so the same
    // result), the thread pool woken once. E128 H512 F256, 1 token, 2 threads, q4, the same interleaved rounds
    // (load ~1.8/2): 0.114-0.123 -> 0.110-0.116 ms.
    parallel_for(active.size(), [&](size_t item) {
      phase1(item);
      phase2(item);
    });
  } else {
    parallel_for(active.size() * static_cast<size_t>(f_pieces), phase1);
    parallel_for(active.size() * static_cast<size_t>(h_pieces), phase2);
  }

  for (const QActive& a : active) {
    const int64_t n = static_cast<int64_t>(a.tokens.size());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = a.tokens[i];
      const float scale = weights[t * E + a.expert];
      const float* o = obuf.data() + a.o_offset + i * H;
      float* yt = y + t * H;
      for (int64_t r = 0; r < H; ++r) yt[r] += scale * o[r];
    }
  }
}

}  // namespace

void run_experts(const float* x, int64_t tokens, const MoEWeights& w, const MoEConfig& cfg,
                 const std::vector<float>& weights, const uint8_t* mask, float* y, const ParallelFor& parallel_for,
                 int64_t* kept) {
  const int64_t E = w.experts, F = w.ffn, H = w.hidden;
  std::memset(y, 0, sizeof(float) * static_cast<size_t>(tokens * H));
  if (kept != nullptr && !w.input_major)
    for (int64_t t = 0; t < tokens; ++t) kept[t] = H;
  if (tokens == 0) return;
  if (w.format != WeightFormat::f) {
    run_experts_quant(x, tokens, w, cfg, weights, mask, y, parallel_for);
    return;
  }
  std::vector<Active> active;
  // Each token block starts on a cache line: the kernels' 32-byte loads of x and h then never straddle two lines
  // (a straddling load costs two; with std::vector's 16-byte alignment every other one did: the GEMM ran ~1.4x
  // slower). A caller's x is used in place only when it is aligned so.
  constexpr int64_t kAlign = 16;  // floats
  const auto round_up = [](int64_t v) { return (v + kAlign - 1) / kAlign * kAlign; };
  const bool x_aligned = reinterpret_cast<uintptr_t>(x) % (kAlign * sizeof(float)) == 0;
  int64_t gathered = 0, inter = 0, outs = 0;
  for (int64_t e = 0; e < E; ++e) {
    Active a{e, {}, nullptr, 0, 0, 0};
    for (int64_t t = 0; t < tokens; ++t)
      if (mask[t * E + e]) a.tokens.push_back(t);
    if (a.tokens.empty()) continue;  // no token routed: its weights are never read
    const int64_t n = static_cast<int64_t>(a.tokens.size());
    if (n < tokens || !x_aligned) {
      a.x_offset = gathered;
      gathered += round_up(n * H);
    }
    a.h_offset = inter;
    inter += round_up(n * F);
    a.o_offset = outs;
    outs += n * H;
    active.push_back(std::move(a));
  }
  if (active.empty()) return;
  std::vector<float> storage(static_cast<size_t>(gathered + inter + kAlign)), obuf(static_cast<size_t>(outs));
  float* const xg = reinterpret_cast<float*>(
      (reinterpret_cast<uintptr_t>(storage.data()) + kAlign * sizeof(float) - 1) & ~(kAlign * sizeof(float) - 1));
  float* const hbuf = xg + gathered;
  for (Active& a : active) {
    const int64_t n = static_cast<int64_t>(a.tokens.size());
    if (n == tokens && x_aligned) {
      a.x = x;
      continue;
    }
    float* dst = xg + a.x_offset;
    for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * H, x + a.tokens[i] * H, sizeof(float) * H);
    a.x = dst;
  }
  const DotRowsFn dot = dot_kernels().by_type[static_cast<int>(w.type)];
  const size_t esize = element_size(w.type);
  // input_major: each token's kept x channels (ascending) and their values, computed once for all its experts.
  std::vector<int32_t> kept_rows;
  std::vector<float> kept_vals;
  std::vector<int64_t> kept_count;
  if (w.input_major) {
    kept_rows.resize(static_cast<size_t>(tokens * H));
    kept_vals.resize(kept_rows.size());
    kept_count.assign(static_cast<size_t>(tokens), 0);
    for (int64_t t = 0; t < tokens; ++t) {
      int64_t n = 0;
      for (int64_t i = 0; i < H; ++i) {
        const float v = x[t * H + i];
        if (w.x_limit == nullptr || !(std::fabs(v) <= w.x_limit[i])) {
          kept_rows[t * H + n] = static_cast<int32_t>(i);
          kept_vals[t * H + n++] = v;
        }
      }
      kept_count[t] = n;
      if (kept != nullptr) kept[t] = n;
    }
  }
  const SparseRowsFn rows_fn = w.input_major ? sparse_kernels().by_format[static_cast<int>(w.type)] : nullptr;
  const char* gate = static_cast<const char*>(w.gate);
  const char* up = static_cast<const char*>(w.up);
  const char* down = static_cast<const char*>(w.down);

  // Phase 1, items = active experts x F pieces: h[n, piece] = act(x W_gate[piece]^T) * (x W_up[piece]^T).
  // (input_major: pieces of whole 64-column units, the row kernels' granule.)
  const int64_t f_pieces = pieces_for(F, active.size());
  const int64_t f_rows = w.input_major ? (F / 64 + f_pieces - 1) / f_pieces * 64 : (F + f_pieces - 1) / f_pieces;
  parallel_for(active.size() * static_cast<size_t>(f_pieces), [&](size_t item) {
    const Active& a = active[item / f_pieces];
    const int64_t f0 = static_cast<int64_t>(item % f_pieces) * f_rows;
    const int64_t rows = item % f_pieces + 1 == static_cast<size_t>(f_pieces) ? F - f0 : std::min(f_rows, F - f0);
    if (rows <= 0) return;
    const int64_t n = static_cast<int64_t>(a.tokens.size());
    thread_local std::vector<float> g, u;
    g.resize(static_cast<size_t>(n * rows));
    u.resize(static_cast<size_t>(n * rows));
    if (w.input_major) {
      // Each token of the expert on its own (its kept rows, streamed once; y = g of the piece, columns f0..).
      std::fill(g.begin(), g.end(), 0.0f);
      std::fill(u.begin(), u.end(), 0.0f);
      const size_t matrix = static_cast<size_t>(a.expert * H * F) * esize;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t t = a.tokens[j];
        SparseRows call;
        call.n = F;
        call.rows = kept_rows.data() + t * H;
        call.nrows = kept_count[t];
        call.xv = kept_vals.data() + t * H;
        call.ldy = rows;
        call.tokens = 1;
        call.w = gate + matrix;
        call.y = g.data() + j * rows - f0;
        rows_fn(call, f0, f0 + rows);
        call.w = up + matrix;
        call.y = u.data() + j * rows - f0;
        rows_fn(call, f0, f0 + rows);
      }
    } else {
      const size_t offset = (static_cast<size_t>(a.expert * F + f0) * H) * esize;
      dot(gate + offset, rows, H, a.x, n, H, g.data(), rows);
      dot(up + offset, rows, H, a.x, n, H, u.data(), rows);
    }
    float* h = hbuf + a.h_offset;
    if (w.b_gate != nullptr || w.b_up != nullptr) {  // v2 expert biases, added to the projections' outputs
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = a.expert * F + f0 + r;
        const float bg = w.b_gate != nullptr ? load_element(w.b_gate, w.b_gate_type, at) : 0.0f;
        const float bu = w.b_up != nullptr ? load_element(w.b_up, w.b_up_type, at) : 0.0f;
        for (int64_t i = 0; i < n; ++i) {
          g[i * rows + r] += bg;
          u[i * rows + r] += bu;
        }
      }
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t r = 0; r < rows; ++r) h[i * F + f0 + r] = glu(g[i * rows + r], u[i * rows + r], cfg);
  });

  // Phase 2, items = active experts x H pieces: o[n, piece] = h W_down[piece]^T (+ b_down), each expert's share
  // in its own buffer; a row's dot does not depend on how the rows are split, so neither do the results.
  const int64_t h_pieces = pieces_for(H, active.size()), h_rows = (H + h_pieces - 1) / h_pieces;
  parallel_for(active.size() * static_cast<size_t>(h_pieces), [&](size_t item) {
    const Active& a = active[item / h_pieces];
    const int64_t h0 = static_cast<int64_t>(item % h_pieces) * h_rows, rows = std::min(h_rows, H - h0);
    if (rows <= 0) return;
    const int64_t n = static_cast<int64_t>(a.tokens.size());
    float* o = obuf.data() + a.o_offset + h0;  // [n, H] with row stride H
    dot(down + (static_cast<size_t>(a.expert * H + h0) * F) * esize, rows, F, hbuf + a.h_offset, n, F, o, H);
    if (w.b_down != nullptr) {  // v2: y += w * (down h + b_down)
      for (int64_t r = 0; r < rows; ++r) {
        const float bd = load_element(w.b_down, w.b_down_type, a.expert * H + h0 + r);
        for (int64_t i = 0; i < n; ++i) o[i * H + r] += bd;
      }
    }
  });

  // y[t] += weight * o, the experts added in expert order (the same order at any thread count).
  for (const Active& a : active) {
    const int64_t n = static_cast<int64_t>(a.tokens.size());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = a.tokens[i];
      const float scale = weights[t * E + a.expert];
      const float* o = obuf.data() + a.o_offset + i * H;
      float* yt = y + t * H;
      for (int64_t r = 0; r < H; ++r) yt[r] += scale * o[r];
    }
  }
}

}  // namespace lz
