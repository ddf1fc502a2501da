// The quantized (q8 / q4) kernels of ai.layerzero::SparseLinear (see sparse_linear.h): blocks of 32 along K, the
// activations int8. Compiled once per instruction set; LZ_ISA_NS names the namespace (avx512vnni with
// -march=x86-64-v4 -mavx512vnni -mavx512vbmi, avx2 with -march=x86-64-v3, generic) and -ffp-contract=off (the
// per-block float step is a multiply and an add in every build, as the numpy reference).
//
// A token's call: for the column range, tiles of kTile columns; per tile, the blocks of K with a kept channel in
// ascending order; per block and 64 (q4) or 32 (q8) columns, an int32 accumulator per column summed over the
// block's kept rows only (a skipped row is never read), then y += float(isum) * (d_w * d_x). A column's
// operations do not depend on the range it falls in, so the result does not depend on the thread split.
//
// AVX-512 VNNI: 4 kept rows a step. Their bytes for 32 columns (q8: 32 code bytes a row; q4: 16, two columns a
// byte) are put side by side in two vectors, [row 0 | row 1] and [row 2 | row 3], and one vpermt2b per 16 byte
// positions interleaves them into 16 lanes of 4 bytes (byte r of lane j = row r's byte j): the layout vpdpbusd
// multiplies against the 4 rows' x codes broadcast (one int32). The weights are the unsigned operand: q4 nibbles
// are code + 8 (0..15), q8 codes are XORed with 0x80 (code + 128); the accumulators start at -8 (-128) times the
// sum of the block's x codes, so the lanes hold the exact signed dot. The 4th row of a short group repeats a kept
// row with x code 0 (adds 0).
#include <cstring>

#include "dot_rows.h"
#include "sparse_linear.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VBMI__) && defined(__F16C__)
#define LZ_SQ_VNNI 1
#else
#define LZ_SQ_VNNI 0
#endif

#if LZ_SQ_VNNI
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

#ifndef LZ_ISA_NS
#error "LZ_ISA_NS must name the instruction-set namespace (avx512vnni, avx2 or generic)"
#endif

namespace lz {
namespace LZ_ISA_NS {
namespace {

constexpr int64_t kTile = 2048;  // columns of a tile (multiple of 64): y's tile (8 KB) stays in L1

template <int Bits>
inline const uint8_t* row_ptr(const void* w, int64_t n, int64_t i) {
  return static_cast<const uint8_t*>(w) + i * (Bits == 8 ? n : n / 2);
}

#if LZ_SQ_VNNI
// idx for vpermt2b of A = [row 0 bytes 0..31 | row 1 bytes 0..31], B = [row 2 | row 3] (B's bytes 64..127):
// lane j = (row 0, row 1, row 2, row 3) byte j + off.
inline __m512i lanes_index(int off) {
  alignas(64) uint8_t idx[64];
  for (int j = 0; j < 16; ++j) {
    idx[4 * j + 0] = static_cast<uint8_t>(j + off);
    idx[4 * j + 1] = static_cast<uint8_t>(32 + j + off);
    idx[4 * j + 2] = static_cast<uint8_t>(64 + j + off);
    idx[4 * j + 3] = static_cast<uint8_t>(96 + j + off);
  }
  return _mm512_load_si512(idx);
}

// 4 rows' 32 bytes from byte offset o as [r0 | r1], [r2 | r3].
inline void pair_rows(const uint8_t* const* r, int64_t o, __m512i& a, __m512i& b) {
  a = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[0] + o))),
                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[1] + o)), 1);
  b = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[2] + o))),
                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[3] + o)), 1);
}
// 4 rows' 16 bytes from o as one vector [r0 | r1 | r2 | r3] (the q4 32-column tail).
inline __m512i quad_rows(const uint8_t* const* r, int64_t o) {
  __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r[0] + o)));
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r[1] + o)), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r[2] + o)), 2);
  return _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r[3] + o)), 3);
}

// y[c .. c + 16 * V) += float(acc[v]) * (d_w[c + 16 v ..] * dx): a multiply, a multiply, an add.
template <int V>
inline void apply(const __m512i* acc, const uint16_t* s, __m512 dx, float* y) {
  for (int v = 0; v < V; ++v) {
    const __m512 m = _mm512_mul_ps(
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16 * v))), dx);
    const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[v]), m);
    _mm512_storeu_ps(y + 16 * v, _mm512_add_ps(_mm512_loadu_ps(y + 16 * v), p));
  }
}

template <int Bits>
void qrows(const SparseQRows& call, int64_t c0, int64_t c1) {
  const int64_t n = call.n;
  const __m512i i0 = lanes_index(0), i1 = lanes_index(16), i32 = [] {
    alignas(64) uint8_t idx[64];
    for (int j = 0; j < 16; ++j)
      for (int r = 0; r < 4; ++r) idx[4 * j + r] = static_cast<uint8_t>(16 * r + j);
    return _mm512_load_si512(idx);
  }();
  const __m512i m4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  constexpr int32_t kOffset = Bits == 4 ? 8 : 128;
  // The row addresses of a block (4 per group), computed once per block and tile: the current block's and the
  // next one's (whose rows are prefetched while the current block runs).
  const uint8_t* cur[32];
  const uint8_t* nxt[32];
  auto addresses = [&](int64_t bi, const uint8_t** out) -> int {
    if (bi >= call.nblocks) return 0;
    const SparseQBlock& blk = call.blocks[bi];
    const int32_t* r4 = call.rows4 + 4 * int64_t(blk.g0);
    for (int32_t k = 0; k < 4 * blk.ng; ++k) out[k] = row_ptr<Bits>(call.w, n, r4[k]);
    return 4 * blk.ng;
  };
  for (int64_t a = c0; a < c1; a += kTile) {
    const int64_t b = c1 - a > kTile ? a + kTile : c1;
    addresses(0, cur);
    for (int64_t bi = 0; bi < call.nblocks; ++bi) {
      const SparseQBlock& blk = call.blocks[bi];
      const int nn = addresses(bi + 1, nxt);
      const uint16_t* s = call.scales + int64_t(blk.kb) * n;
      const __m512 dx = _mm512_set1_ps(blk.dx);
      const __m512i start = _mm512_set1_epi32(-kOffset * blk.sum);
      const int32_t* xq4 = call.xq4 + blk.g0;
      const int32_t ng = blk.ng;
      int64_t c = a;
      for (; c + 64 <= b; c += 64) {
        __m512i acc[4] = {start, start, start, start};
        const int64_t o = Bits == 4 ? c / 2 : c;
        for (int32_t g = 0; g < ng; ++g) {
          const uint8_t* const* r = cur + 4 * g;
          const __m512i xv = _mm512_set1_epi32(xq4[g]);
          __m512i pa, pb;
          pair_rows(r, o, pa, pb);
          const __m512i p0 = _mm512_permutex2var_epi8(pa, i0, pb), p1 = _mm512_permutex2var_epi8(pa, i1, pb);
          if constexpr (Bits == 4) {
            // byte j of a 32-column block: column j (low nibble), column j + 16 (high nibble)
            acc[0] = _mm512_dpbusd_epi32(acc[0], _mm512_and_si512(p0, m4), xv);
            acc[1] = _mm512_dpbusd_epi32(acc[1], _mm512_and_si512(_mm512_srli_epi16(p0, 4), m4), xv);
            acc[2] = _mm512_dpbusd_epi32(acc[2], _mm512_and_si512(p1, m4), xv);
            acc[3] = _mm512_dpbusd_epi32(acc[3], _mm512_and_si512(_mm512_srli_epi16(p1, 4), m4), xv);
          } else {
            acc[0] = _mm512_dpbusd_epi32(acc[0], _mm512_xor_si512(p0, flip), xv);
            acc[1] = _mm512_dpbusd_epi32(acc[1], _mm512_xor_si512(p1, flip), xv);
            pair_rows(r, o + 32, pa, pb);
            acc[2] = _mm512_dpbusd_epi32(acc[2], _mm512_xor_si512(_mm512_permutex2var_epi8(pa, i0, pb), flip), xv);
            acc[3] = _mm512_dpbusd_epi32(acc[3], _mm512_xor_si512(_mm512_permutex2var_epi8(pa, i1, pb), flip), xv);
          }
        }
        // The next block's rows at these columns (its pass over the tile comes after this one's).
        if (Bits == 8 || c % 128 == 0)
          for (int k = 0; k < nn; ++k) _mm_prefetch(reinterpret_cast<const char*>(nxt[k] + o), _MM_HINT_T0);
        apply<4>(acc, s + c, dx, call.y + c);
      }
      if (c < b) {  // 32 columns
        __m512i acc[2] = {start, start};
        for (int32_t g = 0; g < ng; ++g) {
          const uint8_t* const* r = cur + 4 * g;
          const __m512i xv = _mm512_set1_epi32(xq4[g]);
          if constexpr (Bits == 4) {
            const __m512i p = _mm512_permutexvar_epi8(i32, quad_rows(r, c / 2));
            acc[0] = _mm512_dpbusd_epi32(acc[0], _mm512_and_si512(p, m4), xv);
            acc[1] = _mm512_dpbusd_epi32(acc[1], _mm512_and_si512(_mm512_srli_epi16(p, 4), m4), xv);
          } else {
            __m512i pa, pb;
            pair_rows(r, c, pa, pb);
            acc[0] = _mm512_dpbusd_epi32(acc[0], _mm512_xor_si512(_mm512_permutex2var_epi8(pa, i0, pb), flip), xv);
            acc[1] = _mm512_dpbusd_epi32(acc[1], _mm512_xor_si512(_mm512_permutex2var_epi8(pa, i1, pb), flip), xv);
          }
        }
        apply<2>(acc, s + c, dx, call.y + c);
      }
      std::memcpy(cur, nxt, sizeof(cur[0]) * static_cast<size_t>(nn));
    }
  }
}
#else
// Portable (also the AVX2 build, auto-vectorized): per block and 32 columns, the int32 sums over the block's
// kept rows (signed codes), then the float step per column.
template <int Bits>
void qrows(const SparseQRows& call, int64_t c0, int64_t c1) {
  const int64_t n = call.n;
  for (int64_t a = c0; a < c1; a += kTile) {
    const int64_t b = c1 - a > kTile ? a + kTile : c1;
    for (int64_t bi = 0; bi < call.nblocks; ++bi) {
      const SparseQBlock& blk = call.blocks[bi];
      const uint16_t* s = call.scales + int64_t(blk.kb) * n;
      for (int64_t c = a; c < b; c += 32) {
        int32_t acc[32] = {};
        for (int32_t g = 0; g < blk.ng; ++g) {
          for (int k = 0; k < 4; ++k) {
            const int32_t xq = static_cast<int8_t>(static_cast<uint32_t>(call.xq4[blk.g0 + g]) >> (8 * k));
            if (xq == 0) continue;
            const uint8_t* r = row_ptr<Bits>(call.w, n, call.rows4[4 * (blk.g0 + g) + k]);
            if constexpr (Bits == 8) {
              const int8_t* q = reinterpret_cast<const int8_t*>(r + c);
              for (int j = 0; j < 32; ++j) acc[j] += xq * int32_t(q[j]);
            } else {
              const uint8_t* q = r + c / 2;
              for (int j = 0; j < 16; ++j) {
                acc[j] += xq * (int32_t(q[j] & 15) - 8);
                acc[j + 16] += xq * (int32_t(q[j] >> 4) - 8);
              }
            }
          }
        }
        float* y = call.y + c;
        for (int j = 0; j < 32; ++j) {
          const float m = half_to_float(s[c + j]) * blk.dx;
          y[j] = y[j] + static_cast<float>(acc[j]) * m;
        }
      }
    }
  }
}
#endif

}  // namespace

const SparseQKernels kSparseQKernels = {
#if LZ_SQ_VNNI
    "avx512vnni",
#elif defined(__AVX2__)
    "avx2",
#else
    "generic",
#endif
    &qrows<8>,
    &qrows<4>,
};

bool sparse_q_available() {
#if LZ_SQ_VNNI
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
         __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("f16c");
#elif defined(__AVX2__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return true;
#endif
}

}  // namespace LZ_ISA_NS
}  // namespace lz
