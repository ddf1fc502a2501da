// The row-skip kernels of ai.layerzero::SparseLinear (see sparse_linear.h). Compiled once per instruction set;
// LZ_ISA_NS names the namespace (avx512 with -march=x86-64-v4, avx2 with -march=x86-64-v3, generic).
//
// For a column range [c0, c1) (c0 a multiple of 64; c1 one too, or N) and the kept rows of a call: every column
// is y[c] = fma(W[i, c], m_i, y[c]) for the kept rows i in ascending order, m_i = x_i (format f) or
// x_i * d[i, c / 32] (q8 / q4: the code times that product), one fused multiply-add per row and column (the
// generic build: a multiply and an add). A column's operations do not depend on the range it falls in, the
// tokens of its group, or the unrolling (8 rows a step: y loaded and stored once per 8 rows), so the result of
// a token is the same at any thread count and in any group. Decode (1 token): the rows are streamed 8 at a time
// (the next 8 software-prefetched) over the whole range (float formats) or in tiles of kDecodeTile columns
// (quantized); groups of tokens: column tiles of kTile, each row's tile read from memory once (then in L1) for
// every token of the group that keeps the row.
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
constexpr int64_t kDecodeTile = 2048;  // columns of a decode tile (multiple of 64): y's tile (8 KB) stays in L1

constexpr bool quantized(SparseFormat f) { return f == SparseFormat::q8 || f == SparseFormat::q4; }

inline float scale_of(const uint16_t* s, int64_t c) {
#if LZ_S_AVX512 || LZ_S_AVX2
  return _cvtsh_ss(s[c / 32]);
#else
  return half_to_float(s[c / 32]);
#endif
}

// Row r's multiplier for the block of column c.
template <SparseFormat F>
inline float mult(float x, const uint16_t* s, int64_t c) {
  if constexpr (quantized(F)) return x * scale_of(s, c);
  else return x;
}

// Element c of a row (float).
template <SparseFormat F>
inline float element(const void* row, int64_t c) {
  if constexpr (F == SparseFormat::f32) return static_cast<const float*>(row)[c];
  if constexpr (F == SparseFormat::f16) return half_to_float(static_cast<const uint16_t*>(row)[c]);
  if constexpr (F == SparseFormat::bf16) return bf16_to_float(static_cast<const uint16_t*>(row)[c]);
  if constexpr (F == SparseFormat::q8) return static_cast<float>(static_cast<const int8_t*>(row)[c]);
  const uint8_t b = static_cast<const uint8_t*>(row)[c / 2];
  return static_cast<float>(int((c & 1) ? (b >> 4) : (b & 15)) - 8);
}

// The byte address of row i.
template <SparseFormat F>
inline const void* row_ptr(const void* w, int64_t n, int64_t i) {
  const uint8_t* p = static_cast<const uint8_t*>(w);
  switch (F) {
    case SparseFormat::f32:
      return p + i * n * 4;
    case SparseFormat::f16:
    case SparseFormat::bf16:
      return p + i * n * 2;
    case SparseFormat::q8:
      return p + i * n;
    default:
      return p + i * (n / 2);
  }
}

#if LZ_S_AVX512
// Columns c..c+32 of a row as two vectors of 16 floats (codes for q8 / q4).
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
  } else if constexpr (F == SparseFormat::bf16) {
    const uint16_t* p = static_cast<const uint16_t*>(row) + c;
    a = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
    b = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))), 16));
  } else if constexpr (F == SparseFormat::q8) {
    const int8_t* p = static_cast<const int8_t*>(row) + c;
    a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  } else {
    // 16 bytes = 32 nibbles: each byte widened to 16 bits, low nibble in the low byte, high nibble in the high
    // one (= the column order), minus 8, widened to 32-bit lanes.
    const uint8_t* p = static_cast<const uint8_t*>(row) + c / 2;
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    __m256i u = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi16(0x000F)),
                                _mm256_and_si256(_mm256_slli_epi16(v, 4), _mm256_set1_epi16(0x0F00)));
    u = _mm256_sub_epi8(u, _mm256_set1_epi8(8));
    a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(u)));
    b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(u, 1)));
  }
}

// 16 columns from c (the first `count`, the others zero): format f only (q8 / q4 ranges are whole blocks).
template <SparseFormat F>
inline __m512 load_part(const void* row, int64_t c, __mmask16 m) {
  if constexpr (F == SparseFormat::f32) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(row) + c);
  if constexpr (F == SparseFormat::f16)
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(row) + c));
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(row) + c)), 16));
}

// y[c0, c1) += R rows: rows[j] with scales srow[j] and x values x[j], ascending j per column.
// The cache lines of row `next` (nullptr: none) holding columns [c, c + 32): the rows of the next step, fetched
// while this one computes (the kept rows are not one sequential stream the hardware prefetcher follows).
template <SparseFormat F>
inline void prefetch32(const void* next, int64_t c) {
  if (next == nullptr) return;
  const char* p = static_cast<const char*>(next);
  if constexpr (F == SparseFormat::f32) {
    _mm_prefetch(p + c * 4, _MM_HINT_T0);
    _mm_prefetch(p + c * 4 + 64, _MM_HINT_T0);
  } else if constexpr (F == SparseFormat::f16 || F == SparseFormat::bf16) {
    _mm_prefetch(p + c * 2, _MM_HINT_T0);
  } else if constexpr (F == SparseFormat::q8) {
    if (c % 64 == 0) _mm_prefetch(p + c, _MM_HINT_T0);
  } else {
    if (c % 128 == 0) _mm_prefetch(p + c / 2, _MM_HINT_T0);
  }
}

template <SparseFormat F, int R>
inline void micro(const void* const* rows, const uint16_t* const* srow, const float* x, float* y, int64_t c0,
                  int64_t c1, const void* const* next) {
  int64_t c = c0;
  __m512 m[R];
  if constexpr (!quantized(F))
    for (int j = 0; j < R; ++j) m[j] = _mm512_set1_ps(x[j]);
  for (; c + 32 <= c1; c += 32) {
    __m512 y0 = _mm512_loadu_ps(y + c), y1 = _mm512_loadu_ps(y + c + 16);
    for (int j = 0; j < R; ++j) {
      if (next != nullptr) prefetch32<F>(next[j], c);
      if constexpr (quantized(F)) m[j] = _mm512_set1_ps(mult<F>(x[j], srow[j], c));
      __m512 a, b;
      load32<F>(rows[j], c, a, b);
      y0 = _mm512_fmadd_ps(a, m[j], y0);
      y1 = _mm512_fmadd_ps(b, m[j], y1);
    }
    _mm512_storeu_ps(y + c, y0);
    _mm512_storeu_ps(y + c + 16, y1);
  }
  if constexpr (!quantized(F)) {
    for (; c < c1; c += 16) {
      const int64_t left = c1 - c;
      const __mmask16 k = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      __m512 yv = _mm512_maskz_loadu_ps(k, y + c);
      for (int j = 0; j < R; ++j) yv = _mm512_fmadd_ps(load_part<F>(rows[j], c, k), m[j], yv);
      _mm512_mask_storeu_ps(y + c, k, yv);
    }
  }
}

// Quantized rows (c0, c1 multiples of 32, c1 - c0 <= kDecodeTile): the rows' multipliers x * d of every block of
// the range first (16 blocks a vector: float16 scales converted, times x), then per 32 columns each row's codes
// as floats times its block's multiplier, fused into y. q4: the 16 code bytes zero-extended to 16 lanes; a lane's
// low 4 bits (the even column's nibble) and, shifted, its high 4 bits (the odd column's) index a table of the 16
// code values (nibble - 8) as floats (vpermps reads only the index's low 4 bits): no mask, no conversion. y's 32
// columns are then held as the 16 even columns followed by the 16 odd ones (q4_natural_order puts them back once
// the call's rows are done): the same fused multiply-add per column as the other builds, in another lane.
// q4, 128 columns (64 code bytes) of R rows a step, [c0, cg): the 64 bytes loaded as 16 lanes of 4 bytes; nibble
// s of lane k (bits 4s..4s+3) is column 8k + s, so 8 shifts give 8 vectors of 16 columns, each made a float
// exactly as (0x4B000000 | nibble) - (2^23 + 8) = nibble - 8 (in-lane integer logic and a subtraction: no
// widening, no conversion); the multiplier of lane k is that of block k / 4. y's 128 columns are then held as
// vector s = columns 8k + s (q4_natural_order restores them).
template <int R>
inline void q4_groups(const void* const* rows, const float (*mb)[kDecodeTile / 32 + 16], float* y, int64_t c0,
                      int64_t cg, const void* const* next) {
  const __m512i low = _mm512_set1_epi32(15), magic = _mm512_set1_epi32(0x4B000000);
  const __m512 bias = _mm512_set1_ps(8388616.0f);
  const __m512i bidx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  for (int64_t c = c0; c < cg; c += 128) {
    const int64_t blk = (c - c0) / 32;
    __m512 acc[8];
    for (int s = 0; s < 8; ++s) acc[s] = _mm512_loadu_ps(y + c + 16 * s);
    for (int j = 0; j < R; ++j) {
      if (next != nullptr) prefetch32<SparseFormat::q4>(next[j], c);
      const __m512 m = _mm512_permutexvar_ps(bidx, _mm512_loadu_ps(mb[j] + blk));
      const __m512i v = _mm512_loadu_si512(static_cast<const uint8_t*>(rows[j]) + c / 2);
      for (int s = 0; s < 8; ++s) {
        const __m512i q = s == 0 ? v : _mm512_srli_epi32(v, 4 * s);
        const __m512i bits = s == 7 ? _mm512_or_si512(q, magic) : _mm512_ternarylogic_epi32(q, low, magic, 0xEA);
        acc[s] = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_castsi512_ps(bits), bias), m, acc[s]);
      }
    }
    for (int s = 0; s < 8; ++s) _mm512_storeu_ps(y + c + 16 * s, acc[s]);
  }
}

template <SparseFormat F, int R>
inline void qmicro(const void* const* rows, const uint16_t* const* srow, const float* x, float* y, int64_t c0,
                   int64_t c1, const void* const* next) {
  alignas(64) float mb[R][kDecodeTile / 32 + 16];  // (+16: q4_groups loads 16 from any block)
  const int64_t nb = (c1 - c0) / 32, b0 = c0 / 32;
  for (int j = 0; j < R; ++j) {
    const __m512 xj = _mm512_set1_ps(x[j]);
    for (int64_t b = 0; b < nb; b += 16) {
      const int64_t left = nb - b;
      const __mmask16 m = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, srow[j] + b0 + b));
      _mm512_mask_storeu_ps(mb[j] + b, m, _mm512_mul_ps(d, xj));
    }
  }
  const __m512 table = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f,
                                      6.f, 7.f);
  int64_t first = 0;
  if constexpr (F == SparseFormat::q4) {
    const int64_t cg = c0 + (c1 - c0) / 128 * 128;
    q4_groups<R>(rows, mb, y, c0, cg, next);
    first = (cg - c0) / 32;
  }
  for (int64_t blk = first; blk < nb; ++blk) {
    const int64_t c = c0 + blk * 32;
    __m512 y0 = _mm512_loadu_ps(y + c), y1 = _mm512_loadu_ps(y + c + 16);
    for (int j = 0; j < R; ++j) {
      if (next != nullptr) prefetch32<F>(next[j], c);
      const __m512 m = _mm512_set1_ps(mb[j][blk]);
      __m512 a, b;
      if constexpr (F == SparseFormat::q4) {
        const __m512i z = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(rows[j]) + c / 2)));
        a = _mm512_permutexvar_ps(z, table);
        b = _mm512_permutexvar_ps(_mm512_srli_epi32(z, 4), table);
      } else {
        load32<F>(rows[j], c, a, b);
      }
      y0 = _mm512_fmadd_ps(a, m, y0);
      y1 = _mm512_fmadd_ps(b, m, y1);
    }
    _mm512_storeu_ps(y + c, y0);
    _mm512_storeu_ps(y + c + 16, y1);
  }
}

// q4's y of [c0, c1) back to the columns' order: the 128-column groups of q4_groups from c0, then 32-column
// blocks of (16 even columns, 16 odd ones).
inline void q4_natural_order(float* y, int64_t c0, int64_t c1) {
  int64_t c = c0;
  for (; c + 128 <= c1; c += 128) {
    float t[128];
    std::memcpy(t, y + c, sizeof(t));
    for (int s = 0; s < 8; ++s)
      for (int k = 0; k < 16; ++k) y[c + 8 * k + s] = t[16 * s + k];
  }
  c0 = c;
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t c = c0; c < c1; c += 32) {
    const __m512 e = _mm512_loadu_ps(y + c), o = _mm512_loadu_ps(y + c + 16);
    _mm512_storeu_ps(y + c, _mm512_permutex2var_ps(e, lo, o));
    _mm512_storeu_ps(y + c + 16, _mm512_permutex2var_ps(e, hi, o));
  }
}
#define LZ_S_QMICRO 1
#elif LZ_S_AVX2
template <SparseFormat F>
inline void load32(const void* row, int64_t c, __m256* v) {
  if constexpr (F == SparseFormat::f32) {
    const float* p = static_cast<const float*>(row) + c;
    for (int q = 0; q < 4; ++q) v[q] = _mm256_loadu_ps(p + 8 * q);
  } else if constexpr (F == SparseFormat::f16) {
    const uint16_t* p = static_cast<const uint16_t*>(row) + c;
    for (int q = 0; q < 4; ++q) v[q] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * q)));
  } else if constexpr (F == SparseFormat::bf16) {
    const uint16_t* p = static_cast<const uint16_t*>(row) + c;
    for (int q = 0; q < 4; ++q)
      v[q] = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * q))), 16));
  } else if constexpr (F == SparseFormat::q8) {
    const int8_t* p = static_cast<const int8_t*>(row) + c;
    for (int q = 0; q < 4; ++q)
      v[q] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * q))));
  } else {
    const uint8_t* p = static_cast<const uint8_t*>(row) + c / 2;
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    __m256i u = _mm256_or_si256(_mm256_and_si256(w, _mm256_set1_epi16(0x000F)),
                                _mm256_and_si256(_mm256_slli_epi16(w, 4), _mm256_set1_epi16(0x0F00)));
    u = _mm256_sub_epi8(u, _mm256_set1_epi8(8));
    const __m128i lo = _mm256_castsi256_si128(u), hi = _mm256_extracti128_si256(u, 1);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
  }
}

template <SparseFormat F, int R>
inline void micro(const void* const* rows, const uint16_t* const* srow, const float* x, float* y, int64_t c0,
                  int64_t c1, const void* const*) {
  int64_t c = c0;
  for (; c + 32 <= c1; c += 32) {
    __m256 yv[4];
    for (int q = 0; q < 4; ++q) yv[q] = _mm256_loadu_ps(y + c + 8 * q);
    for (int j = 0; j < R; ++j) {
      const __m256 m = _mm256_set1_ps(mult<F>(x[j], srow[j], c));
      __m256 v[4];
      load32<F>(rows[j], c, v);
      for (int q = 0; q < 4; ++q) yv[q] = _mm256_fmadd_ps(v[q], m, yv[q]);
    }
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(y + c + 8 * q, yv[q]);
  }
  // (format f only) the columns after the last whole 32: the same fused operation, one column at a time.
  for (; c < c1; ++c) {
    float acc = y[c];
    for (int j = 0; j < R; ++j) acc = std::fma(element<F>(rows[j], c), x[j], acc);
    y[c] = acc;
  }
}
#else
template <SparseFormat F, int R>
inline void micro(const void* const* rows, const uint16_t* const* srow, const float* x, float* y, int64_t c0,
                  int64_t c1, const void* const*) {
  for (int64_t c = c0; c < c1; c += 32) {
    const int64_t e = c + 32 < c1 ? c + 32 : c1;
    float m[R];
    for (int j = 0; j < R; ++j) m[j] = mult<F>(x[j], srow[j], c);
    for (int64_t k = c; k < e; ++k) {
      float acc = y[k];
      for (int j = 0; j < R; ++j) acc += element<F>(rows[j], k) * m[j];
      y[k] = acc;
    }
  }
}
#endif

#ifndef LZ_S_QMICRO
#define LZ_S_QMICRO 0
#endif

// R rows into y[c0, c1) (c1 - c0 <= kDecodeTile).
template <SparseFormat F, int R>
inline void rows_into(const void* const* rows, const uint16_t* const* srow, const float* x, float* y, int64_t c0,
                      int64_t c1, const void* const* next = nullptr) {
#if LZ_S_QMICRO
  if constexpr (quantized(F)) {
    qmicro<F, R>(rows, srow, x, y, c0, c1, next);
    return;
  }
#endif
  micro<F, R>(rows, srow, x, y, c0, c1, next);
}

// Decode: 8 rows a step (y's range loaded and stored once per 8 rows). The float formats stream each kept row's
// whole range (measured: 8 rows and no tiles ~10 % less time than 4 rows in 2048-column tiles, cold weights);
// the quantized ones in tiles of kDecodeTile columns (their block multipliers for a tile are computed first).
constexpr int kStepRows = 8;
template <SparseFormat F>
constexpr int64_t decode_tile() {
  return quantized(F) ? kDecodeTile : int64_t(1) << 62;
}

template <SparseFormat F>
void sparse_rows(const SparseRows& call, int64_t c0, int64_t c1) {
  const int64_t n = call.n, nb = n / 32;
  if (c1 <= c0) return;
  constexpr int kRows = kStepRows;
  if (call.group <= 1) {
    const void* rows[kRows];
    const void* next[kRows];
    const uint16_t* srow[kRows];
    constexpr int64_t kT = decode_tile<F>();
    for (int64_t a = c0; a < c1; a += kT) {
      const int64_t b = c1 - a > kT ? a + kT : c1;
      int64_t r = 0;
      for (; r + kRows <= call.nrows; r += kRows) {
        for (int j = 0; j < kRows; ++j) {
          rows[j] = row_ptr<F>(call.w, n, call.rows[r + j]);
          srow[j] = quantized(F) ? call.scales + int64_t(call.rows[r + j]) * nb : nullptr;
          // the next step's rows (the last ones of the tile for the last step: already in cache)
          const int64_t nr = r + kRows + j < call.nrows ? r + kRows + j : call.nrows - 1;
          next[j] = row_ptr<F>(call.w, n, call.rows[nr]);
        }
        rows_into<F, kRows>(rows, srow, call.xv + r, call.y, a, b, next);
      }
      for (; r < call.nrows; ++r) {
        rows[0] = row_ptr<F>(call.w, n, call.rows[r]);
        srow[0] = quantized(F) ? call.scales + int64_t(call.rows[r]) * nb : nullptr;
        rows_into<F, 1>(rows, srow, call.xv + r, call.y, a, b);
      }
    }
  } else {
    for (int64_t a = c0; a < c1; a += kTile) {
      const int64_t b = a + kTile < c1 ? a + kTile : c1;
      for (int64_t r = 0; r < call.nrows; ++r) {
        const void* row = row_ptr<F>(call.w, n, call.rows[r]);
        const uint16_t* srow = quantized(F) ? call.scales + int64_t(call.rows[r]) * nb : nullptr;
        const int32_t* tok = call.tok + r * call.group;
        const float* xv = call.xv + r * call.group;
        for (int32_t j = 0; j < call.ntok[r]; ++j)
          rows_into<F, 1>(&row, &srow, xv + j, call.y + tok[j] * call.ldy, a, b);
      }
    }
  }
#if LZ_S_QMICRO
  if constexpr (F == SparseFormat::q4)
    for (int64_t t = 0; t < call.tokens; ++t) q4_natural_order(call.y + t * call.ldy, c0, c1);
#endif
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
    {&sparse_rows<SparseFormat::f32>, &sparse_rows<SparseFormat::f16>, &sparse_rows<SparseFormat::bf16>,
     &sparse_rows<SparseFormat::q8>, &sparse_rows<SparseFormat::q4>},
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
