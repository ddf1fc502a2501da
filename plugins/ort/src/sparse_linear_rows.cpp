// The row-skip kernels of ai.layerzero::SparseLinear's float formats (f32 / f16 / bf16; see sparse_linear.h;
// q8 / q4: sparse_linear_qrows.cpp). Compiled once per instruction set; LZ_ISA_NS names the namespace (avx512
// with -march=x86-64-v4, avx2 with -march=x86-64-v3, generic).
//
// For a column range [c0, c1) (c0 a multiple of 64; c1 one too, or N) and the kept rows of a call: every column
// is y[c] = fma(W[i, c], x_i, y[c]) for the kept rows i in ascending order, one fused multiply-add per row and
// column (the generic build: a multiply and an add). A column's operations do not depend on the range it falls
// in, the tokens of its group, or the unrolling (8 rows a step: y loaded and stored once per 8 rows), so the
// result of a token is the same at any thread count and in any group. Decode (1 token): the rows are streamed 8
// at a time (the next 8 software-prefetched) over the whole range; groups of tokens: column tiles of kTile, each
// row's tile read from memory once (then in L1) for every token of the group that keeps the row.
#include <cmath>
#include <cstring>

#include "dot_rows.h"
#include "sparse_linear.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define LZ_S_AVX512 1
#else
#define LZ_S_AVX512 0
#endif
#if !LZ_S_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LZ_S_AVX2 1
#else
#define LZ_S_AVX2 0
#endif

#if LZ_S_AVX512 || LZ_S_AVX2
// GCC 12's AVX-512 headers trip -Wuninitialized inside the header (GCC bug 105593): silenced for them only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

#ifndef LZ_ISA_NS
#error "LZ_ISA_NS must name the instruction-set namespace (avx512, avx2 or generic)"
#endif

namespace lz {
namespace LZ_ISA_NS {
namespace {

constexpr int64_t kTile = 512;         // columns of a group tile (multiple of 64): 8 tokens' y tiles = 16 KB
// Element c of a row (float).
template <SparseFormat F>
inline float element(const void* row, int64_t c) {
  if constexpr (F == SparseFormat::f32) return static_cast<const float*>(row)[c];
  if constexpr (F == SparseFormat::f16) return half_to_float(static_cast<const uint16_t*>(row)[c]);
  return bf16_to_float(static_cast<const uint16_t*>(row)[c]);
}

// The byte address of row i.
template <SparseFormat F>
inline const void* row_ptr(const void* w, int64_t n, int64_t i) {
  const uint8_t* p = static_cast<const uint8_t*>(w);
  switch (F) {
    case SparseFormat::f32:
      return p + i * n * 4;
    default:
      return p + i * n * 2;
  }
}

#if LZ_S_AVX512
// Columns c..c+32 of a row as two vectors of 16 floats.
template <SparseFormat F>
inline void load32(const void* row, int64_t c, __m512& a, __m512& b) {
  if constexpr (F == SparseFormat::f32) {
    const float* p = static_cast<const float*>(row) + c;
    a = _mm512_loadu_ps(p);
    b = _mm512_loadu_ps(p + 16);
  } else if constexpr (F == SparseFormat::f16) {
    const uint16_t* p = static_cast<const uint16_t*>(row) + c;
    a = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    b = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(row) + c;
    a = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
    b = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))), 16));
  }
}

// 16 columns from c (the first `count`, the others zero).
template <SparseFormat F>
inline __m512 load_part(const void* row, int64_t c, __mmask16 m) {
  if constexpr (F == SparseFormat::f32) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(row) + c);
  if constexpr (F == SparseFormat::f16)
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(row) + c));
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(row) + c)), 16));
}

// The cache lines of row `next` (nullptr: none) holding columns [c, c + 32): the rows of the next step, fetched
// while this one computes (the kept rows are not one sequential stream the hardware prefetcher follows).
template <SparseFormat F>
inline void prefetch32(const void* next, int64_t c) {
  if (next == nullptr) return;
  const char* p = static_cast<const char*>(next);
  if constexpr (F == SparseFormat::f32) {
    _mm_prefetch(p + c * 4, _MM_HINT_T1);
    _mm_prefetch(p + c * 4 + 64, _MM_HINT_T1);
  } else {
    _mm_prefetch(p + c * 2, _MM_HINT_T1);
  }
}

// y[c0, c1) += R rows: rows[j] with x values x[j], ascending j per column.
template <SparseFormat F, int R>
inline void micro(const void* const* rows, const float* x, float* y, int64_t c0, int64_t c1,
                  const void* const* next) {
  int64_t c = c0;
  __m512 m[R];
  for (int j = 0; j < R; ++j) m[j] = _mm512_set1_ps(x[j]);
  for (; c + 32 <= c1; c += 32) {
    __m512 y0 = _mm512_loadu_ps(y + c), y1 = _mm512_loadu_ps(y + c + 16);
    for (int j = 0; j < R; ++j) {
      if (next != nullptr) prefetch32<F>(next[j], c);
      __m512 a, b;
      load32<F>(rows[j], c, a, b);
      y0 = _mm512_fmadd_ps(a, m[j], y0);
      y1 = _mm512_fmadd_ps(b, m[j], y1);
    }
    _mm512_storeu_ps(y + c, y0);
    _mm512_storeu_ps(y + c + 16, y1);
  }
  for (; c < c1; c += 16) {
    const int64_t left = c1 - c;
    const __mmask16 k = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    __m512 yv = _mm512_maskz_loadu_ps(k, y + c);
    for (int j = 0; j < R; ++j) yv = _mm512_fmadd_ps(load_part<F>(rows[j], c, k), m[j], yv);
    _mm512_mask_storeu_ps(y + c, k, yv);
  }
}
#elif LZ_S_AVX2
template <SparseFormat F>
inline void load32(const void* row, int64_t c, __m256* v) {
  if constexpr (F == SparseFormat::f32) {
    const float* p = static_cast<const float*>(row) + c;
    for (int q = 0; q < 4; ++q) v[q] = _mm256_loadu_ps(p + 8 * q);
  } else if constexpr (F == SparseFormat::f16) {
    const uint16_t* p = static_cast<const uint16_t*>(row) + c;
    for (int q = 0; q < 4; ++q) v[q] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * q)));
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(row) + c;
    for (int q = 0; q < 4; ++q)
      v[q] = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * q))), 16));
  }
}

template <SparseFormat F, int R>
inline void micro(const void* const* rows, const float* x, float* y, int64_t c0, int64_t c1, const void* const*) {
  int64_t c = c0;
  for (; c + 32 <= c1; c += 32) {
    __m256 yv[4];
    for (int q = 0; q < 4; ++q) yv[q] = _mm256_loadu_ps(y + c + 8 * q);
    for (int j = 0; j < R; ++j) {
      const __m256 m = _mm256_set1_ps(x[j]);
      __m256 v[4];
      load32<F>(rows[j], c, v);
      for (int q = 0; q < 4; ++q) yv[q] = _mm256_fmadd_ps(v[q], m, yv[q]);
    }
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(y + c + 8 * q, yv[q]);
  }
  // the columns after the last whole 32: the same fused operation, one column at a time.
  for (; c < c1; ++c) {
    float acc = y[c];
    for (int j = 0; j < R; ++j) acc = std::fma(element<F>(rows[j], c), x[j], acc);
    y[c] = acc;
  }
}
#else
template <SparseFormat F, int R>
inline void micro(const void* const* rows, const float* x, float* y, int64_t c0, int64_t c1, const void* const*) {
  for (int64_t k = c0; k < c1; ++k) {
    float acc = y[k];
    for (int j = 0; j < R; ++j) acc += element<F>(rows[j], k) * x[j];
    y[k] = acc;
  }
}
#endif

// Decode: 8 rows a step (y's range loaded and stored once per 8 rows), each kept row's whole range streamed
// (measured: 8 rows and no tiles ~10 % less time than 4 rows in 2048-column tiles, cold weights).
constexpr int kStepRows = 8;

template <SparseFormat F>
void sparse_rows(const SparseRows& call, int64_t c0, int64_t c1) {
  const int64_t n = call.n;
  if (c1 <= c0) return;
  constexpr int kRows = kStepRows;
  if (call.group <= 1) {
    const void* rows[kRows];
    const void* next[kRows];
    int64_t r = 0;
    for (; r + kRows <= call.nrows; r += kRows) {
      for (int j = 0; j < kRows; ++j) {
        rows[j] = row_ptr<F>(call.w, n, call.rows[r + j]);
        // the next step's rows (the last ones for the last step: already in cache)
        const int64_t nr = r + kRows + j < call.nrows ? r + kRows + j : call.nrows - 1;
        next[j] = row_ptr<F>(call.w, n, call.rows[nr]);
      }
      micro<F, kRows>(rows, call.xv + r, call.y, c0, c1, next);
    }
    for (; r < call.nrows; ++r) {
      rows[0] = row_ptr<F>(call.w, n, call.rows[r]);
      micro<F, 1>(rows, call.xv + r, call.y, c0, c1, nullptr);
    }
  } else {
    for (int64_t a = c0; a < c1; a += kTile) {
      const int64_t b = a + kTile < c1 ? a + kTile : c1;
      for (int64_t r = 0; r < call.nrows; ++r) {
        const void* row = row_ptr<F>(call.w, n, call.rows[r]);
        const int32_t* tok = call.tok + r * call.group;
        const float* xv = call.xv + r * call.group;
        for (int32_t j = 0; j < call.ntok[r]; ++j)
          micro<F, 1>(&row, xv + j, call.y + tok[j] * call.ldy, a, b, nullptr);
      }
    }
  }
}

}  // namespace

const SparseKernels kSparseKernels = {
#if LZ_S_AVX512
    "avx512",
#elif LZ_S_AVX2
    "avx2",
#else
    "generic",
#endif
    {&sparse_rows<SparseFormat::f32>, &sparse_rows<SparseFormat::f16>, &sparse_rows<SparseFormat::bf16>},
};

bool sparse_available() {
#if LZ_S_AVX512
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("f16c");
#elif LZ_S_AVX2
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return true;
#endif
}

}  // namespace LZ_ISA_NS
}  // namespace lz
