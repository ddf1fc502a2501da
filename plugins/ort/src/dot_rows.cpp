// Row-dot micro-kernels (see dot_rows.h). Compiled once per instruction set; LZ_ISA_NS names the namespace.
#include "dot_rows.h"

#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LZ_HAVE_AVX2 1
#else
#define LZ_HAVE_AVX2 0
#endif

#ifndef LZ_ISA_NS
#error "LZ_ISA_NS must name the instruction-set namespace (avx2 or generic)"
#endif

namespace lz {
namespace LZ_ISA_NS {
namespace {

template <class W>
inline float load1(const W* p);
template <>
inline float load1<float>(const float* p) { return *p; }
template <>
inline float load1<uint16_t>(const uint16_t* p) { return half_to_float(*p); }
struct bf16_t {
  uint16_t bits;
};
template <>
inline float load1<bf16_t>(const bf16_t* p) { return bf16_to_float(p->bits); }

#if LZ_HAVE_AVX2
template <class W>
inline __m256 load8(const W* p);
template <>
inline __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <>
inline __m256 load8<uint16_t>(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <>
inline __m256 load8<bf16_t>(const bf16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R weight rows x N tokens, 8 lanes of k at a time: R*N accumulators stay in registers (R=4, N=3: 12 of 16),
// each weight vector loaded once per step and used N times, each token vector used R times.
template <class W, int R, int N>
inline void micro(const W* w, int64_t rs, int64_t k, const float* x, int64_t ldx, float* out, int64_t os,
                  int64_t ldo) {
  __m256 acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) acc[r][n] = _mm256_setzero_ps();
  int64_t i = 0;
  if constexpr (N == 1) {
    // GEMV: two vectors of k per step so that each row has two independent FMA chains.
    __m256 acc2[R];
    for (int r = 0; r < R; ++r) acc2[r] = _mm256_setzero_ps();
    for (; i + 16 <= k; i += 16) {
      const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
      for (int r = 0; r < R; ++r) {
        acc[r][0] = _mm256_fmadd_ps(load8<W>(w + r * rs + i), x0, acc[r][0]);
        acc2[r] = _mm256_fmadd_ps(load8<W>(w + r * rs + i + 8), x1, acc2[r]);
      }
    }
    for (int r = 0; r < R; ++r) acc[r][0] = _mm256_add_ps(acc[r][0], acc2[r]);
  }
  // No software prefetch: the rows are sequential streams the hardware prefetcher follows (see dot_rows_t).
  for (; i + 8 <= k; i += 8) {
    __m256 xv[N];
    for (int n = 0; n < N; ++n) xv[n] = _mm256_loadu_ps(x + n * ldx + i);
    for (int r = 0; r < R; ++r) {
      __m256 wv = load8<W>(w + r * rs + i);
      for (int n = 0; n < N; ++n) acc[r][n] = _mm256_fmadd_ps(wv, xv[n], acc[r][n]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < N; ++n) {
      float s = hsum(acc[r][n]);
      for (int64_t j = i; j < k; ++j) s += load1<W>(w + r * rs + j) * x[n * ldx + j];
      out[n * ldo + r * os] = s;
    }
  }
}
#else
template <class W, int R, int N>
inline void micro(const W* w, int64_t rs, int64_t k, const float* x, int64_t ldx, float* out, int64_t os,
                  int64_t ldo) {
  float acc[R][N][4] = {};
  int64_t i = 0;
  for (; i + 4 <= k; i += 4) {
    for (int r = 0; r < R; ++r) {
      float wv[4];
      for (int l = 0; l < 4; ++l) wv[l] = load1<W>(w + r * rs + i + l);
      for (int n = 0; n < N; ++n)
        for (int l = 0; l < 4; ++l) acc[r][n][l] += wv[l] * x[n * ldx + i + l];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < N; ++n) {
      float s = (acc[r][n][0] + acc[r][n][1]) + (acc[r][n][2] + acc[r][n][3]);
      for (int64_t j = i; j < k; ++j) s += load1<W>(w + r * rs + j) * x[n * ldx + j];
      out[n * ldo + r * os] = s;
    }
  }
}
#endif

template <class W, int R>
inline void micro_rows(const W* w, int64_t rs, int64_t k, const float* x, int64_t ldx, int64_t n, float* out,
                       int64_t os, int64_t ldo) {
  if (n == 3) micro<W, R, 3>(w, rs, k, x, ldx, out, os, ldo);
  else if (n == 2) micro<W, R, 2>(w, rs, k, x, ldx, out, os, ldo);
  else micro<W, R, 1>(w, rs, k, x, ldx, out, os, ldo);
}

// The rows are taken kSegments at a time, one from each of kSegments equal segments of the block (rows i, i + seg,
// i + 2 seg, ...): kSegments sequential streams pages apart. Measured (one core, weights not in cache): 4 such
// streams read ~1.5x faster than 4 adjacent rows, which share pages, or one stream; software prefetch did not
// help. GEMV (1 token): one row block per step. GEMM (many tokens): blocks of kSegments rows x 3 tokens; the rows
// (kSegments x k weights, L1/L2) are reused by every token triple before the next rows stream in, so each weight
// byte comes from memory once per call whatever the token count.
constexpr int kSegments = 4;  // 8 measured no faster (and spills the GEMM block's accumulators)

template <class W>
void dot_rows_t(const void* wv, int64_t rows, int64_t k, const float* x, int64_t tokens, int64_t ldx, float* out,
                int64_t ldo) {
  const W* w = static_cast<const W*>(wv);
  const int64_t seg = rows / kSegments;
  for (int64_t i = 0; i < seg; ++i) {
    for (int64_t t = 0; t < tokens; t += 3) {
      int64_t n = tokens - t < 3 ? tokens - t : 3;
      micro_rows<W, kSegments>(w + i * k, seg * k, k, x + t * ldx, ldx, n, out + t * ldo + i, seg, ldo);
    }
  }
  for (int64_t r = seg * kSegments; r < rows; ++r) {
    for (int64_t t = 0; t < tokens; t += 3) {
      int64_t n = tokens - t < 3 ? tokens - t : 3;
      micro_rows<W, 1>(w + r * k, k, k, x + t * ldx, ldx, n, out + t * ldo + r, 1, ldo);
    }
  }
}

float stream_read(const void* p, int64_t bytes) {
  const float* w = static_cast<const float*>(p);
  const int64_t seg = bytes / 4 / kSegments;
  float total = 0.0f;
#if LZ_HAVE_AVX2
  // As the GEMV steps: 16 floats (a cache line) of each stream per step, two independent chains per stream.
  __m256 acc[kSegments], acc2[kSegments];
  for (int s = 0; s < kSegments; ++s) acc[s] = acc2[s] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= seg; i += 16) {
    for (int s = 0; s < kSegments; ++s) {
      acc[s] = _mm256_add_ps(acc[s], _mm256_loadu_ps(w + s * seg + i));
      acc2[s] = _mm256_add_ps(acc2[s], _mm256_loadu_ps(w + s * seg + i + 8));
    }
  }
  for (int s = 0; s < kSegments; ++s) total += hsum(_mm256_add_ps(acc[s], acc2[s]));
#else
  int64_t i = 0;
#endif
  for (; i < seg; ++i)
    for (int s = 0; s < kSegments; ++s) total += w[s * seg + i];
  for (int64_t j = seg * kSegments; j < bytes / 4; ++j) total += w[j];  // the rows after the last whole segment
  return total;
}

}  // namespace

const DotKernels kKernels = {
#if LZ_HAVE_AVX2
    "avx2",
#else
    "generic",
#endif
    {&dot_rows_t<float>, &dot_rows_t<uint16_t>, &dot_rows_t<bf16_t>},
    &stream_read,
};

bool available() {
#if LZ_HAVE_AVX2
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return true;
#endif
}

}  // namespace LZ_ISA_NS
}  // namespace lz
