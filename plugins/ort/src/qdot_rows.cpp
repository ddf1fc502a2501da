// Quantized row-dot micro-kernels (see qdot_rows.h). Compiled once per instruction set; LZ_ISA_NS names the
// namespace (avx512vnni, avx2, generic).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "dot_rows.h"
#include "qdot_rows.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define LZ_Q_VNNI 1
#else
#define LZ_Q_VNNI 0
#endif
#if !LZ_Q_VNNI && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LZ_Q_AVX2 1
#else
#define LZ_Q_AVX2 0
#endif

#if LZ_Q_VNNI || LZ_Q_AVX2
// GCC 12's AVX-512 headers pass _mm512_undefined_*() to the masked builtins behind the unmasked intrinsics, which
// -Wuninitialized reports inside the header at every use (GCC bug 105593): silenced for these headers' lines.
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

#if LZ_Q_VNNI || LZ_Q_AVX2
// Software prefetch of each row's codes this many bytes ahead of the load (one prefetch a 64-byte line): the rows
// are sequential streams, but at one token the arithmetic between two loads leaves the hardware prefetcher behind on
// long rows. Intel AVX-512 host, one core, cold weights (bench/moe_quant.py's blocks in 24 copies): Mixtral-style
// E8 k2 H1024 F1536 q4 0.35 -> 0.27 ms, q8 0.83 -> 0.70 ms; E32 k4 H1024 F384 q4 unchanged; 512-4096 bytes alike
// within the noise; prefetching the scales as well brought nothing. Into L2 (T1), as the sparse row kernels: there
// T0 was the slower hint on the Zen 4 host (bench/README.md, sparse_linear.py); on this one T0 and T1 measure alike.
// On an AMD EPYC Zen 3 host (AVX2) the same prefetch costs instead: without it the AVX2 row kernels read cold rows
// 10-40 % faster (5 alternating runs per shape, one core: the lm_head [32000, 1024] 0.72-0.91 of the time, the
// Qwen3-MoE-style experts' gate / up 0.60-0.83, a Llama-1B [8192, 2048] 0.58-0.70, the K = 384 down 0.90-1.02),
// so each build has both forms (PF) and qdot_kernels() picks one per CPU.
constexpr int64_t kPrefetchBytes = 2048;

template <bool PF>
inline void prefetch_codes(const void* p) {
  if constexpr (PF) {
    _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T1);
  } else {
    (void)p;
  }
}
#endif

// One block's exact integer dot, any ISA (the vector loops' tails): signed codes against the token's order.
inline int32_t block_dot_q8(const int8_t* w, const int8_t* x) {
  int32_t s = 0;
  for (int j = 0; j < 32; ++j) s += int32_t(w[j]) * int32_t(x[j]);
  return s;
}
// q4 block b: its 16 code bytes against the token's even / odd elements of that block (QTokens' q4 order).
inline int32_t block_dot_q4(const uint8_t* w, const int8_t* xq, int64_t b) {
  const int8_t* xe = xq + (b / 4) * 128 + (b % 4) * 16;
  const int8_t* xo = xe + 64;
  int32_t s = 0;
  for (int j = 0; j < 16; ++j) s += (int32_t(w[j] & 15) - 8) * xe[j] + (int32_t(w[j] >> 4) - 8) * xo[j];
  return s;
}

// q4 block b of a row in chunks (b < chunked): its 4 bytes a step against the token's chunked order.
inline int32_t block_dot_q4_chunked(const uint8_t* row, const int8_t* xq, int64_t b) {
  const int64_t c = b / kQChunk, j = b % kQChunk;
  int32_t s = 0;
  for (int st = 0; st < 4; ++st) {
    const uint8_t* w = row + c * 256 + st * 64 + j * 4;
    const int8_t* xe = xq + c * 512 + st * 128 + j * 4;
    for (int m = 0; m < 4; ++m) s += (int32_t(w[m] & 15) - 8) * xe[m] + (int32_t(w[m] >> 4) - 8) * xe[m + 64];
  }
  return s;
}

// The blocks [b0, nb) of one row (w its first code byte), scalar.
template <int Bits>
inline float tail_blocks(const uint8_t* w, const uint16_t* s, int64_t b0, int64_t nb, const int8_t* xq,
                         const float* xd, int64_t chunked = 0) {
  float acc = 0.0f;
  for (int64_t b = b0; b < nb; ++b) {
    const int32_t dot = Bits == 8      ? block_dot_q8(reinterpret_cast<const int8_t*>(w) + b * 32, xq + b * 32)
                        : b < chunked ? block_dot_q4_chunked(w, xq, b)
                                      : block_dot_q4(w + b * 16, xq, b);
    acc += (half_to_float(s[b]) * xd[b]) * static_cast<float>(dot);
  }
  return acc;
}

#if LZ_Q_VNNI
// The 16-lane sums of R accumulators, every one in the same order (that of _mm512_reduce_add_ps: 256-bit halves,
// 128-bit halves, then (x0 + x2) + (x1 + x3)); R = 4 transposes as it adds (10 shuffles and adds for 4 rows).
template <int R>
inline void reduce_rows(const __m512* acc, float* sums) {
  if constexpr (R == 4) {
    // [a.lo256 + a.hi256 | b.lo256 + b.hi256] for the pairs (0, 1) and (2, 3), then the 128-bit halves of those:
    // one 128-bit lane per row, then within each lane.
    const __m512 t0 =
        _mm512_add_ps(_mm512_shuffle_f32x4(acc[0], acc[1], 0x44), _mm512_shuffle_f32x4(acc[0], acc[1], 0xEE));
    const __m512 t1 =
        _mm512_add_ps(_mm512_shuffle_f32x4(acc[2], acc[3], 0x44), _mm512_shuffle_f32x4(acc[2], acc[3], 0xEE));
    __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, 0x88), _mm512_shuffle_f32x4(t0, t1, 0xDD));
    u = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));
    u = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));
    const __m512i first = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
    _mm_store_ps(sums, _mm512_castps512_ps128(_mm512_permutexvar_ps(first, u)));
  } else {
    for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(acc[r]);
  }
}

// One 64-byte step of R rows: `i` the step, `ix` the lanes' blocks in d16 (see micro).
template <int Bits, int R, bool PF>
inline void step(const uint8_t* w, int64_t rs, int64_t i, const int8_t* xq, const int32_t* xoff, __m512i ix,
                 const __m512* d16, __m512* acc) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  if constexpr (Bits == 4) {
    const __m512i xe = _mm512_loadu_si512(xq + i * 128), xo = _mm512_loadu_si512(xq + i * 128 + 64);
    const __m512i c = _mm512_maskz_expand_epi32(
        0x1111, _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xoff + i * 4))));
    for (int r = 0; r < R; ++r) {
      prefetch_codes<PF>(w + r * rs + i * 64);
      const __m512i v = _mm512_loadu_si512(w + r * rs + i * 64);
      const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      const __m512i dp = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c, lo, xe), hi, xo);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_permutexvar_ps(ix, d16[r]), acc[r]);
    }
  } else {
    const __m512i xv = _mm512_loadu_si512(xq + i * 64);
    const __m512i c = _mm512_maskz_expand_epi32(
        0x0101, _mm512_zextsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(xoff + i * 2))));
    for (int r = 0; r < R; ++r) {
      prefetch_codes<PF>(w + r * rs + i * 64);
      const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(w + r * rs + i * 64), flip);
      const __m512i dp = _mm512_dpbusd_epi32(c, v, xv);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_permutexvar_ps(ix, d16[r]), acc[r]);
    }
  }
}

// R rows (row stride rs code bytes, ss scales) against one token. q4: a step is one group of 4 blocks, 64 code
// bytes split into low nibbles (the even elements) and high nibbles (the odd ones), each dpbusd'ed as unsigned
// (code + 8) against the token's signed codes, the lanes starting from off (-8 x the block's sum of x codes, in
// lane 4b of block b): 4 exact int32 lanes per block. Those times d_w * d_x of their block (a lane permutation of
// 16 blocks' products, computed once per 16 blocks), accumulated in float. q8: a step is 2 blocks, the codes
// XOR 0x80 (= code + 128 as unsigned), the lanes from -128 x the sum. Whole chunks of 16 blocks run their steps
// unrolled (constant permutations); the last chunk step by step, the blocks after the last whole step in scalar.
template <int Bits, int R, bool PF>
inline void micro(const uint8_t* w, int64_t rs, const uint16_t* s, int64_t ss, int64_t nb, const int8_t* xq,
                  const float* xd, const int32_t* xoff, float* out, int64_t os, int64_t chunked) {
  constexpr int64_t kBlocks = Bits == 4 ? 4 : 2;  // blocks per 64-byte step
  constexpr int64_t kSteps = 16 / kBlocks;        // steps per chunk of 16 blocks
  const int64_t nv = nb / kBlocks * kBlocks;
  __m512 acc[R], d16[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  if constexpr (Bits == 4) {
    // q4 rows in chunks: per chunk of 16 blocks, lane j = block j in each of its 4 steps; the low nibbles (v & 0x0F)
    // against the even elements and the high ones kept in place (v & 0xF0 = 16 x nibble) against the odd ones, in
    // two int32 accumulators: the lane's exact dot is lo + (hi >> 4) (hi a multiple of 16), lo starting from the
    // block's offset (-8 x the sum of its x codes). Then one conversion and one multiply-add per chunk.
    const __m512i m4 = _mm512_set1_epi8(0x0F), mh = _mm512_set1_epi8(static_cast<char>(0xF0));
    for (int64_t b0 = 0; b0 < chunked; b0 += kQChunk) {
      const __m512 dx = _mm512_loadu_ps(xd + b0);
      const __m512i off = _mm512_loadu_si512(xoff + b0);
      const uint8_t* wc = w + b0 * 16;
      const int8_t* xc = xq + b0 * 32;
      __m512i lo[R], hi[R];
      for (int r = 0; r < R; ++r) {
        lo[r] = off;
        hi[r] = _mm512_setzero_si512();
      }
      for (int st = 0; st < 4; ++st) {
        const __m512i xe = _mm512_loadu_si512(xc + st * 128), xo = _mm512_loadu_si512(xc + st * 128 + 64);
        for (int r = 0; r < R; ++r) {
          prefetch_codes<PF>(wc + r * rs + st * 64);
          const __m512i v = _mm512_loadu_si512(wc + r * rs + st * 64);
          lo[r] = _mm512_dpbusd_epi32(lo[r], _mm512_and_si512(v, m4), xe);
          hi[r] = _mm512_dpbusd_epi32(hi[r], _mm512_and_si512(v, mh), xo);
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 d = _mm512_mul_ps(
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + r * ss + b0))), dx);
        const __m512i dot = _mm512_add_epi32(lo[r], _mm512_srai_epi32(hi[r], 4));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d, acc[r]);
      }
    }
  } else {
    (void)chunked;
  }
  const __m512i lanes = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          Bits == 4 ? 2 : 3);
  for (int64_t b0 = Bits == 4 ? chunked : 0; b0 < nv; b0 += 16) {
    const int64_t left = nv - b0;
    const __mmask16 m = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512 dx = _mm512_maskz_loadu_ps(m, xd + b0);
    for (int r = 0; r < R; ++r)
      d16[r] = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, s + r * ss + b0)), dx);
    const int64_t i0 = b0 / kBlocks;
    if (left >= 16) {
      for (int64_t j = 0; j < kSteps; ++j)  // (unrolled: the permutations are constants)
        step<Bits, R, PF>(w, rs, i0 + j, xq, xoff, _mm512_add_epi32(lanes, _mm512_set1_epi32(int(j * kBlocks))), d16,
                      acc);
    } else {
      for (int64_t j = 0; j < left / kBlocks; ++j)
        step<Bits, R, PF>(w, rs, i0 + j, xq, xoff, _mm512_add_epi32(lanes, _mm512_set1_epi32(int(j * kBlocks))), d16,
                      acc);
    }
  }
  alignas(16) float sums[R];
  reduce_rows<R>(acc, sums);
  for (int r = 0; r < R; ++r)
    out[r * os] = sums[r] + tail_blocks<Bits>(w + r * rs, s + r * ss, nv, nb, xq, xd);  // (chunked <= nv)
}
#elif LZ_Q_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One step's int32 lanes of row w (madd of the exact int16 products): q4 4 a block of its 2 blocks, q8 8 of its one.
template <int Bits>
inline __m256i step_lanes(const uint8_t* wp, __m256i xe, __m256i xo) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
  __m256i s16;
  if constexpr (Bits == 4) {
    const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
  } else {
    s16 = _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(xe, v));
  }
  return _mm256_madd_epi16(s16, ones);
}

// Blocks g0 .. g0 + N * (Bits == 4 ? 2 : 1) - 1 (at most 8; g0 a multiple of 8) of R rows outside the chunks:
// each step's lanes summed by hadds to one exact int32 per block (q4: 3 hadds for 4 steps, the blocks left as
// [0 2 4 6 | 1 3 5 7]; q8: 3 per 4 steps, [lo lanes of 4 blocks | hi lanes of them], the halves then added
// across), q4's offset added as an integer, then one conversion and multiply-add per 8 blocks (was a conversion,
// a permutation and an FMA a step, plus a float offset correction: the K = 384 rows of a Qwen3-MoE-style expert's
// down projection ran at half the chunked rows' rate per byte). The steps past N are zero lanes; a group of fewer
// than 8 blocks loads its scales masked (x's blocks are padded to kQPad with zero scales: 8 always load).
template <int Bits, int R, int N, bool PF>
inline void group8(const uint8_t* w, int64_t rs, const uint16_t* s, int64_t ss, int64_t g0, const int8_t* xq,
                   const float* xd, const int32_t* xoff, __m256* acc) {
  constexpr int64_t kBlocks = Bits == 4 ? 2 : 1;
  constexpr int kSteps = Bits == 4 ? 4 : 8, kLeft = N * static_cast<int>(kBlocks);
  const int64_t i0 = g0 / kBlocks;
  const __m256i p4 = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  __m256i quad[R], pair[R], part[R], first4[R];
#pragma GCC unroll 8
  for (int st = 0; st < kSteps; ++st) {
    __m256i xe = _mm256_setzero_si256(), xo = xe;
    if (st < N) {
      if constexpr (Bits == 4) {
        const int64_t b0 = g0 + st * 2, g = b0 / 4, hf = (b0 % 4) / 2;
        xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * 128 + hf * 32));
        xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * 128 + 64 + hf * 32));
      } else {
        xe = xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (i0 + st) * 32));
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m256i lanes = _mm256_setzero_si256();
      if (st < N) {
        const uint8_t* wp = w + r * rs + (i0 + st) * 32;
        if ((i0 + st) % 2 == 0) prefetch_codes<PF>(wp);
        lanes = step_lanes<Bits>(wp, xe, xo);
      }
      if (st % 2 == 0) {
        part[r] = lanes;
      } else if (st % 4 == 1) {
        pair[r] = _mm256_hadd_epi32(part[r], lanes);
      } else {
        quad[r] = _mm256_hadd_epi32(pair[r], _mm256_hadd_epi32(part[r], lanes));
        if (st == 3) first4[r] = quad[r];
      }
    }
  }
  const __m256 dx = Bits == 4 ? _mm256_permutevar8x32_ps(_mm256_loadu_ps(xd + g0), p4) : _mm256_loadu_ps(xd + g0);
  __m256i off = _mm256_setzero_si256();
  if constexpr (Bits == 4)
    off = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xoff + g0)), p4);
  const __m128i smask = _mm_cmpgt_epi32(_mm_set1_epi32(kLeft / 2), _mm_setr_epi32(0, 1, 2, 3));
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    __m256i dot;
    if constexpr (Bits == 4) {
      dot = _mm256_add_epi32(first4[r], off);
    } else {
      dot = _mm256_add_epi32(_mm256_permute2x128_si256(first4[r], quad[r], 0x20),
                             _mm256_permute2x128_si256(first4[r], quad[r], 0x31));
    }
    const uint16_t* sp = s + r * ss + g0;
    __m128i h;
    if constexpr (kLeft == 8) {
      h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sp));
    } else {  // the scales' pairs as int32 lanes, masked (kLeft odd: the last one inserted)
      h = _mm_maskload_epi32(reinterpret_cast<const int*>(sp), smask);
      if constexpr (kLeft % 2 == 1) h = _mm_insert_epi16(h, static_cast<int>(sp[kLeft - 1]), kLeft - 1);
    }
    __m256 sw = _mm256_cvtph_ps(h);
    if constexpr (Bits == 4) sw = _mm256_permutevar8x32_ps(sw, p4);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sw, dx), acc[r]);
  }
}

// R rows against one token. q4: a step is 2 blocks (32 code bytes): low / high nibbles as unsigned (code + 8)
// against the token's even / odd codes (maddubs: at most 2 x 15 x 127 per int16, no saturation), madd to 8 int32
// lanes (4 per block), times d_w * d_x of the block, float; the + 8 is taken back per row in float as
// sum_b d_w d_x off_b. q8: a step is one block, the sign trick (|w| unsigned x (x with w's sign): at most
// 2 x 128 x 127 per int16).
template <int Bits, int R, bool PF>
inline void micro(const uint8_t* w, int64_t rs, const uint16_t* s, int64_t ss, int64_t nb, const int8_t* xq,
                  const float* xd, const int32_t* xoff, float* out, int64_t os, int64_t chunked) {
  constexpr int64_t kBlocks = Bits == 4 ? 2 : 1;
  const int64_t steps = nb / kBlocks, nv = steps * kBlocks;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  if constexpr (Bits == 4) {
    // q4 rows in chunks: each half of a chunk (8 blocks, one int32 lane each) over the chunk's 4 steps, the nibbles
    // as unsigned against the token's codes (maddubs, exact). A step's int16 lane is at most 2 x 2 x 15 x 127 =
    // 7620, so the 4 steps sum in int16 (<= 30480) and one madd per half-chunk widens them (3 of 4 madds and
    // int32 adds saved a half-chunk); the offset added as an integer, then one conversion and multiply-add per 8
    // blocks.
    for (int64_t b0 = 0; b0 < chunked; b0 += kQChunk) {
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t bh = b0 + half * 8;
        const __m256 dx = _mm256_loadu_ps(xd + bh);
        const __m256i off = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xoff + bh));
        __m256i s16[R];
        for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
        for (int st = 0; st < 4; ++st) {
          const int8_t* xs = xq + b0 * 32 + st * 128 + half * 32;
          const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs));
          const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + 64));
          for (int r = 0; r < R; ++r) {
            if (half == 0) prefetch_codes<PF>(w + r * rs + b0 * 16 + st * 64);
            const __m256i v =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * rs + b0 * 16 + st * 64 + half * 32));
            const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            s16[r] = _mm256_add_epi16(
                s16[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo)));
          }
        }
        for (int r = 0; r < R; ++r) {
          const __m256i dot = _mm256_add_epi32(off, _mm256_madd_epi16(s16[r], ones));
          const __m256 d = _mm256_mul_ps(
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + r * ss + bh))), dx);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, acc[r]);
        }
      }
    }
  } else {
    (void)chunked;
  }
  // The blocks after the chunks (every block for q8), 8 at a time (group8); the last group's steps as many as
  // are left.
  int64_t g0 = Bits == 4 ? chunked : 0;
  for (; g0 + 8 <= nv; g0 += 8) group8<Bits, R, 8 / kBlocks, PF>(w, rs, s, ss, g0, xq, xd, xoff, acc);
  switch ((nv - g0) / kBlocks) {
#define LZ_GROUP(n) \
  case n:           \
    if constexpr (n < 8 / kBlocks) group8<Bits, R, n, PF>(w, rs, s, ss, g0, xq, xd, xoff, acc); \
    break;
    LZ_GROUP(1)
    LZ_GROUP(2)
    LZ_GROUP(3)
    LZ_GROUP(4)
    LZ_GROUP(5)
    LZ_GROUP(6)
    LZ_GROUP(7)
#undef LZ_GROUP
    default:
      break;
  }
  alignas(16) float sums[R];
  if constexpr (R == 4) {  // 4 rows' sums at once: 3 hadds and the 128-bit halves added (was 4 separate sums)
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    _mm_store_ps(sums, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  } else {
    for (int r = 0; r < R; ++r) sums[r] = hsum(acc[r]);
  }
  for (int r = 0; r < R; ++r)
    out[r * os] = nv < nb ? sums[r] + tail_blocks<Bits>(w + r * rs, s + r * ss, nv, nb, xq, xd) : sums[r];
}
#else
// Portable: block by block, the signed codes' exact integer dot times d_w * d_x, in float.
template <int Bits, int R, bool PF>
inline void micro(const uint8_t* w, int64_t rs, const uint16_t* s, int64_t ss, int64_t nb, const int8_t* xq,
                  const float* xd, const int32_t* xoff, float* out, int64_t os, int64_t chunked) {
  (void)xoff;
  for (int r = 0; r < R; ++r)
    out[r * os] = tail_blocks<Bits>(w + r * rs, s + r * ss, 0, nb, xq, xd, Bits == 4 ? chunked : 0);
}
#endif

// One block's codes from x (scalar: any ISA, and the blocks whose maximum is zero, infinite or NaN in the vector
// build): d = max|x| / 127 (a NaN wins, as numpy's max), q = round half to even of x * (127 / max|x|), clipped to
// +-127, every code 0 when that maximum is not a positive finite number.
inline void quantize_block_scalar(const float* xb, int bits, int64_t chunked, int8_t* q, float* d, int32_t* off,
                                  int64_t b) {
  float amax = 0.0f;
  for (int64_t j = 0; j < kQBlock; ++j) {
    const float a = std::fabs(xb[j]);
    amax = (a > amax || a != a) ? a : amax;
  }
  d[b] = amax / 127.0f;
  const float inv = (amax > 0.0f && amax <= 3.4028234663852886e38f) ? 127.0f / amax : 0.0f;
  int32_t sum = 0;
  for (int64_t j = 0; j < kQBlock; ++j) {
    float v = std::nearbyint(xb[j] * inv);  // round half to even, as np.rint
    v = v != v ? 0.0f : (v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
    const int8_t c = static_cast<int8_t>(v);
    sum += c;
    q[q_position(bits, chunked, b, j)] = c;
  }
  off[b] = -(bits == 4 ? 8 : 128) * sum;
}

#if LZ_Q_VNNI || LZ_Q_AVX2
// A q4 block's 16 even and 16 odd codes at e (its place in the token's row, q_position): together for a plain block,
// 4 bytes of each to each of the chunk's 4 steps (128 apart) for a block in a chunk.
inline void store_q4_block(int8_t* e, __m128i even, __m128i odd, bool chunked) {
  if (!chunked) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(e), even);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(e + 64), odd);
    return;
  }
  alignas(16) int8_t eb[16], ob[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(eb), even);
  _mm_store_si128(reinterpret_cast<__m128i*>(ob), odd);
  for (int st = 0; st < 4; ++st) {
    std::memcpy(e + st * 128, eb + st * 4, 4);
    std::memcpy(e + st * 128 + 64, ob + st * 4, 4);
  }
}
#endif

void quantize_blocks_t(const float* x, int64_t b0, int64_t b1, int bits, const QTokens& xq, int64_t t) {
  int8_t* q = xq.q + t * xq.kp;
  float* d = xq.d + t * xq.nb;
  int32_t* off = xq.off + t * xq.nb;
#if LZ_Q_VNNI
  // 32 elements as two 16-lane vectors: the maximum of |x| (exact), the same float product and round half to even
  // (roundscale, the default rounding mode: nearbyint's), then int32 codes narrowed to bytes; q4 takes the even
  // and the odd elements apart first (QTokens' order).
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512 lim = _mm512_set1_ps(127.0f), nlim = _mm512_set1_ps(-127.0f);
  for (int64_t b = b0; b < b1; ++b) {
    const float* xb = x + b * kQBlock;
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const bool nan = (_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q)) != 0;
    if (nan || !(amax > 0.0f && amax <= 3.4028234663852886e38f)) {  // zero, infinite or NaN (max_ps drops NaNs)
      quantize_block_scalar(xb, bits, xq.chunked, q, d, off, b);
      continue;
    }
    const float inv1 = 127.0f / amax;
    if (!(inv1 <= 3.4028234663852886e38f)) {  // max below ~3.7e-37: x * inf, and 0 * inf = NaN becomes code 0
      quantize_block_scalar(xb, bits, xq.chunked, q, d, off, b);
      continue;
    }
    d[b] = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(inv1);
    const auto code = [&](__m512 v) {
      const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      return _mm512_cvttps_epi32(_mm512_max_ps(_mm512_min_ps(r, lim), nlim));
    };
    const __m512i c0 = code(v0), c1 = code(v1);
    off[b] = -(bits == 4 ? 8 : 128) * _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
    if (bits == 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kQBlock), _mm512_cvtepi32_epi8(c0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kQBlock + 16), _mm512_cvtepi32_epi8(c1));
    } else {
      const __m128i ce = _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(c0, even, c1));
      const __m128i co = _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(c0, odd, c1));
      store_q4_block(q + q_position(4, xq.chunked, b, 0), ce, co, b < xq.chunked);
    }
  }
#elif LZ_Q_AVX2
  // The same arithmetic in four 8-lane vectors (round half to even: _mm256_round_ps' nearest, nearbyint's), the
  // int32 codes packed to bytes (packs interleave the 128-bit lanes: a permutation puts them back in order); q4
  // then splits each 128-bit lane's bytes into even and odd elements and gathers the halves (QTokens' order).
  // Bitwise the scalar codes, scales and offsets; was scalar on AVX2 (~5 % of a Qwen3-MoE-style block's time).
  const __m256 lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12,
                                         14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int64_t b = b0; b < b1; ++b) {
    const float* xb = x + b * kQBlock;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                   _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const __m256 unord = _mm256_or_ps(_mm256_cmp_ps(v[0], v[1], _CMP_UNORD_Q), _mm256_cmp_ps(v[2], v[3], _CMP_UNORD_Q));
    const float inv1 = 127.0f / amax;
    if (_mm256_movemask_ps(unord) != 0 || !(amax > 0.0f && amax <= 3.4028234663852886e38f) ||
        !(inv1 <= 3.4028234663852886e38f)) {  // NaN, zero or infinite maximum, or 127 / max overflowing: scalar
      quantize_block_scalar(xb, bits, xq.chunked, q, d, off, b);
      continue;
    }
    d[b] = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(inv1);
    __m256i c[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      c[i] = _mm256_cvttps_epi32(_mm256_max_ps(_mm256_min_ps(r, lim), nlim));
    }
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    off[b] = -(bits == 4 ? 8 : 128) * _mm_cvtsi128_si32(s4);
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])), order);
    if (bits == 8) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kQBlock), bytes);
    } else {  // [even 0..14, odd 1..15 | even 16..30, odd 17..31] -> [even 0..30 | odd 1..31]
      const __m256i eo = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(bytes, split), 0xD8);
      store_q4_block(q + q_position(4, xq.chunked, b, 0), _mm256_castsi256_si128(eo),
                     _mm256_extracti128_si256(eo, 1), b < xq.chunked);
    }
  }
#else
  for (int64_t b = b0; b < b1; ++b) quantize_block_scalar(x + b * kQBlock, bits, xq.chunked, q, d, off, b);
#endif
}

// As the float kernels (dot_rows.cpp): the rows taken kSegments at a time from kSegments equal segments of the
// block (rows i, i + seg, ...: sequential streams pages apart); every token of the call against those rows
// (then in L1) before the next rows stream in, so each weight byte comes from memory once per call.
constexpr int kSegments = 4;

template <int Bits, bool PF>
void qdot_rows_t(const void* codes, const uint16_t* scales, int64_t rows, int64_t k, const QTokens& x,
                 int64_t tokens, float* out, int64_t ldo) {
  const uint8_t* w = static_cast<const uint8_t*>(codes);
  const int64_t rb = Bits == 8 ? k : k / 2, nb = k / kQBlock;  // code bytes and blocks per row
  const int64_t seg = rows / kSegments;
  for (int64_t i = 0; i < seg; ++i)
    for (int64_t t = 0; t < tokens; ++t)
      micro<Bits, kSegments, PF>(w + i * rb, seg * rb, scales + i * nb, seg * nb, nb, x.q + t * x.kp, x.d + t * x.nb,
                             x.off + t * x.nb, out + t * ldo + i, seg, x.chunked);
  for (int64_t r = seg * kSegments; r < rows; ++r)
    for (int64_t t = 0; t < tokens; ++t)
      micro<Bits, 1, PF>(w + r * rb, rb, scales + r * nb, nb, nb, x.q + t * x.kp, x.d + t * x.nb, x.off + t * x.nb,
                     out + t * ldo + r, 1, x.chunked);
}

}  // namespace

#if LZ_Q_VNNI
#define LZ_Q_ISA "avx512vnni"
#elif LZ_Q_AVX2
#define LZ_Q_ISA "avx2"
#else
#define LZ_Q_ISA "generic"
#endif
const QDotKernels kQKernels = {LZ_Q_ISA, LZ_Q_VNNI || LZ_Q_AVX2, &qdot_rows_t<8, true>, &qdot_rows_t<4, true>,
                               &quantize_blocks_t};
const QDotKernels kQKernelsNoPrefetch = {LZ_Q_ISA, false, &qdot_rows_t<8, false>, &qdot_rows_t<4, false>,
                                         &quantize_blocks_t};
#undef LZ_Q_ISA

bool q_available() {
#if LZ_Q_VNNI
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
         __builtin_cpu_supports("f16c");
#elif LZ_Q_AVX2
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return true;
#endif
}

}  // namespace LZ_ISA_NS
}  // namespace lz
