// The quantized (q8 / q4) kernels of ai.layerzero::SparseLinear (see sparse_linear.h): blocks of 32 along K, the
// activations int8. Compiled once per instruction set; LZ_ISA_NS names the namespace (avx512vnni with
// -march=x86-64-v4 -mavx512vnni -mavx512vbmi, avx2 with -march=x86-64-v3, generic) and -ffp-contract=off (the
// per-block float step is a multiply and an add in every build, as the numpy reference).
//
// A token's call: for the column range, its parts in the stored tiles (kSparseQTile columns, sparse_linear.h);
// per tile, the blocks of K with a kept channel in ascending order; per block and 128 / 64 / 32 (q4) or 64 / 32
// (q8) columns, int32 accumulators summed over the block's kept rows only (a skipped row is never read), then
// y += float(isum) * (d_w * d_x). A column's operations do not depend on the range it falls in, so the result does
// not depend on the thread split.
//
// AVX-512 VNNI: 4 kept rows a step. Their bytes for 32 columns (q8: 32 code bytes a row; q4: 16, two columns a
// byte) are put side by side in two vectors, [row 0 | row 1] and [row 2 | row 3], and one vpermt2b per 16 byte
// positions interleaves them into 16 lanes of 4 bytes (byte r of lane j = row r's byte j): the layout vpdpbusd
// multiplies against the 4 rows' x codes broadcast (one int32). The weights are the unsigned operand: q8 codes
// are XORed with 0x80 (code + 128), the accumulators start at -128 times the sum of the block's x codes, so the
// lanes hold the exact signed dot; q4 bytes go in whole and masked to their high nibble (q4_step: no shift per
// step). The 4th row of a short group repeats a kept row with x code 0 (adds 0). The rows of a tile are
// contiguous (a row's part of a tile 1 KB for q4), so 32 kept rows are 32 streams a few KB apart, not pages apart
// (the row-major [K, N/2] had every row of a block in the same L1 set at N = 8192, and took 1.5x the time).
//
// AVX2 (no VNNI; before, the portable loop ran there, ~25x slower): 2 kept rows a step, vpmaddubsw (below). The
// portable build (block_columns) also takes the AVX2 build's columns outside whole q4 chunks.
#include <cstring>

#include "dot_rows.h"
#include "sparse_linear.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VBMI__) && defined(__F16C__)
#define LZ_SQ_VNNI 1
#else
#define LZ_SQ_VNNI 0
#endif

#if !LZ_SQ_VNNI && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LZ_SQ_AVX2 1
#else
#define LZ_SQ_AVX2 0
#endif

#if LZ_SQ_VNNI || LZ_SQ_AVX2
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

// The stored tile of column c (sparse_linear.h: tiles of kSparseQTile columns, each [K, width] row-major): its
// first byte and its row stride in bytes.
template <int Bits>
inline const uint8_t* tile_base(const SparseQRows& call, int64_t c, int64_t* stride, int64_t* first) {
  const int64_t c0 = c / kSparseQTile * kSparseQTile;
  const int64_t width = call.n - c0 < kSparseQTile ? call.n - c0 : kSparseQTile;
  *stride = Bits == 8 ? width : width / 2;
  *first = c0;
  return static_cast<const uint8_t*>(call.w) + call.k * (Bits == 8 ? c0 : c0 / 2);
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

// q4: per 16 byte positions (32 columns) two accumulators, one of the whole bytes (low nibble + 16 * high
// nibble) and one of the high nibbles (byte & 0xF0, i.e. 16 * high): low = whole - high, high = high >> 4, both
// exact. They start at -(8 + 128) and -128 times the sum of the x codes (the nibbles' offset 8 in both places).
inline void q4_finish(const __m512i* acc, int count, __m512i* out) {
  for (int q = 0; q < count; ++q) {
    out[2 * q] = _mm512_sub_epi32(acc[2 * q], acc[2 * q + 1]);
    out[2 * q + 1] = _mm512_srai_epi32(acc[2 * q + 1], 4);
  }
}

// q4, one whole 64-byte chunk of the block's rows at byte offset o (128 columns, stored transposed:
// sparse_linear.h): 4 row loads, bytes of rows (0, 1) and (2, 3) unpacked, then words: lane j of output q =
// the 4 rows' byte 4 L + m of block q (j = 4 L + m), i.e. columns 32 q + j (low) and 32 q + 16 + j (high).
inline void q4_chunk(const uint8_t* const* cur, const int32_t* xq4, int32_t ng, int64_t o, int32_t sum,
                     __m512i* out) {
  const __m512i high = _mm512_set1_epi8(static_cast<char>(0xF0));
  const __m512i s_all = _mm512_set1_epi32(-136 * sum), s_high = _mm512_set1_epi32(-128 * sum);
  __m512i acc[8];
  for (int q = 0; q < 4; ++q) {
    acc[2 * q] = s_all;
    acc[2 * q + 1] = s_high;
  }
  for (int32_t g = 0; g < ng; ++g) {
    const uint8_t* const* r = cur + 4 * g;
    const __m512i xv = _mm512_set1_epi32(xq4[g]);
    const __m512i r0 = _mm512_loadu_si512(r[0] + o), r1 = _mm512_loadu_si512(r[1] + o);
    const __m512i r2 = _mm512_loadu_si512(r[2] + o), r3 = _mm512_loadu_si512(r[3] + o);
    const __m512i lo01 = _mm512_unpacklo_epi8(r0, r1), hi01 = _mm512_unpackhi_epi8(r0, r1);
    const __m512i lo23 = _mm512_unpacklo_epi8(r2, r3), hi23 = _mm512_unpackhi_epi8(r2, r3);
    const __m512i p[4] = {_mm512_unpacklo_epi16(lo01, lo23), _mm512_unpackhi_epi16(lo01, lo23),
                          _mm512_unpacklo_epi16(hi01, hi23), _mm512_unpackhi_epi16(hi01, hi23)};
    for (int q = 0; q < 4; ++q) {
      acc[2 * q] = _mm512_dpbusd_epi32(acc[2 * q], p[q], xv);
      acc[2 * q + 1] = _mm512_dpbusd_epi32(acc[2 * q + 1], _mm512_and_si512(p[q], high), xv);
    }
  }
  q4_finish(acc, 4, out);
}

// q4, 64 columns in block order (a row's last partial chunk) at byte offset o: [r0 | r1], [r2 | r3] and one
// vpermt2b per 16 byte positions.
inline void q4_step64(const uint8_t* const* cur, const int32_t* xq4, int32_t ng, int64_t o, int32_t sum,
                      const __m512i& i0, const __m512i& i1, __m512i* out) {
  const __m512i high = _mm512_set1_epi8(static_cast<char>(0xF0));
  const __m512i s_all = _mm512_set1_epi32(-136 * sum), s_high = _mm512_set1_epi32(-128 * sum);
  __m512i acc[4] = {s_all, s_high, s_all, s_high};
  for (int32_t g = 0; g < ng; ++g) {
    const __m512i xv = _mm512_set1_epi32(xq4[g]);
    __m512i pa, pb;
    pair_rows(cur + 4 * g, o, pa, pb);
    const __m512i p0 = _mm512_permutex2var_epi8(pa, i0, pb), p1 = _mm512_permutex2var_epi8(pa, i1, pb);
    acc[0] = _mm512_dpbusd_epi32(acc[0], p0, xv);
    acc[1] = _mm512_dpbusd_epi32(acc[1], _mm512_and_si512(p0, high), xv);
    acc[2] = _mm512_dpbusd_epi32(acc[2], p1, xv);
    acc[3] = _mm512_dpbusd_epi32(acc[3], _mm512_and_si512(p1, high), xv);
  }
  q4_finish(acc, 2, out);
}

// The scales of a q4 chunk (128 columns: 256 bytes, 4 lines) are a stream of their own, one row of [K / 32, N]
// per block, 16 KB a tile: the next block's at these columns into L2 (as its rows), and this block's two chunks
// ahead into L1. Zen 4 host, 16 Llama-1B layers, interleaved rounds: -5 to -12 % at s = 0.5 (1 thread), -5 to
// -8 % (2); the scales read from one L1-resident line instead (wrong values, the same instructions) bounded it at
// -12 % (bench/README.md, sparse_linear.py). Prefetches never fault: past the last block's end they are dropped.
// s_next: the next block's scales row (nullptr after the last block), found once a block.
inline void prefetch_scales(const uint16_t* s_next, const uint16_t* s, int64_t c) {
  if (s_next != nullptr) {
    const char* next = reinterpret_cast<const char*>(s_next + c);
    for (int l = 0; l < 256; l += 64) _mm_prefetch(next + l, _MM_HINT_T1);
  }
  const char* ahead = reinterpret_cast<const char*>(s + c) + 512;
  for (int l = 0; l < 256; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
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
  const __m512i high = _mm512_set1_epi8(static_cast<char>(0xF0)), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  // The row addresses of a block (4 per group) at the range's first column, computed once per block and tile:
  // the current block's and the next one's (whose rows are prefetched while the current block runs).
  const uint8_t* cur[32];
  const uint8_t* nxt[32];
  for (int64_t a = c0; a < c1;) {
    int64_t stride = 0, first = 0;
    const uint8_t* base = tile_base<Bits>(call, a, &stride, &first);
    const int64_t b = first + kSparseQTile < c1 ? first + kSparseQTile : c1;
    const int64_t a_off = Bits == 8 ? a - first : (a - first) / 2;  // the range's first byte in a row of the tile
    auto addresses = [&](int64_t bi, const uint8_t** out) -> int {
      if (bi >= call.nblocks) return 0;
      const SparseQBlock& blk = call.blocks[bi];
      const int32_t* r4 = call.rows4 + 4 * int64_t(blk.g0);
      for (int32_t k = 0; k < 4 * blk.ng; ++k) out[k] = base + r4[k] * stride + a_off;
      return 4 * blk.ng;
    };
    addresses(0, cur);
    for (int64_t bi = 0; bi < call.nblocks; ++bi) {
      const SparseQBlock& blk = call.blocks[bi];
      const int nn = addresses(bi + 1, nxt);
      const uint16_t* s = call.scales + int64_t(blk.kb) * n;
      const uint16_t* s_next = bi + 1 < call.nblocks ? call.scales + int64_t(call.blocks[bi + 1].kb) * n : nullptr;
      const __m512 dx = _mm512_set1_ps(blk.dx);
      const int32_t* xq4 = call.xq4 + blk.g0;
      const int32_t ng = blk.ng;
      int64_t c = a;
      if constexpr (Bits == 4) {
        // Whole chunks: the range starts on one (c0 a multiple of 128, tiles of 8192), and a chunk is whole
        // when the tile's row holds its 64 bytes.
        const int64_t whole = first + (stride / 64) * 128;  // the end of the tile's whole chunks (a column)
        for (; c + 128 <= b && c + 128 <= whole; c += 128) {  // 64 bytes of each row: one cache line
          const int64_t o = (c - a) / 2;
          __m512i v[8];
          q4_chunk(cur, xq4, ng, o, blk.sum, v);
          // The next block's rows at these columns (its pass over the tile comes after this one's).
          for (int k = 0; k < nn; ++k) _mm_prefetch(reinterpret_cast<const char*>(nxt[k] + o), _MM_HINT_T1);
          prefetch_scales(s_next, s, c);
          apply<8>(v, s + c, dx, call.y + c);
        }
        if (c + 64 <= b) {
          const int64_t o = (c - a) / 2;
          __m512i v[4];
          q4_step64(cur, xq4, ng, o, blk.sum, i0, i1, v);
          for (int k = 0; k < nn; ++k) _mm_prefetch(reinterpret_cast<const char*>(nxt[k] + o), _MM_HINT_T1);
          apply<4>(v, s + c, dx, call.y + c);
          c += 64;
        }
        if (c < b) {  // 32 columns
          const int64_t o = (c - a) / 2;
          __m512i acc[2] = {_mm512_set1_epi32(-136 * blk.sum), _mm512_set1_epi32(-128 * blk.sum)};
          for (int32_t g = 0; g < ng; ++g) {
            const __m512i xv = _mm512_set1_epi32(xq4[g]);
            const __m512i p = _mm512_permutexvar_epi8(i32, quad_rows(cur + 4 * g, o));
            acc[0] = _mm512_dpbusd_epi32(acc[0], p, xv);
            acc[1] = _mm512_dpbusd_epi32(acc[1], _mm512_and_si512(p, high), xv);
          }
          __m512i v[2];
          q4_finish(acc, 1, v);
          apply<2>(v, s + c, dx, call.y + c);
        }
      } else {
        // q8: codes XORed with 0x80 (code + 128), the accumulators from -128 times the sum of the x codes.
        const __m512i start = _mm512_set1_epi32(-128 * blk.sum);
        for (; c + 64 <= b; c += 64) {
          __m512i acc[4] = {start, start, start, start};
          const int64_t o = c - a;
          for (int32_t g = 0; g < ng; ++g) {
            const uint8_t* const* r = cur + 4 * g;
            const __m512i xv = _mm512_set1_epi32(xq4[g]);
            __m512i pa, pb;
            pair_rows(r, o, pa, pb);
            acc[0] = _mm512_dpbusd_epi32(acc[0], _mm512_xor_si512(_mm512_permutex2var_epi8(pa, i0, pb), flip), xv);
            acc[1] = _mm512_dpbusd_epi32(acc[1], _mm512_xor_si512(_mm512_permutex2var_epi8(pa, i1, pb), flip), xv);
            pair_rows(r, o + 32, pa, pb);
            acc[2] = _mm512_dpbusd_epi32(acc[2], _mm512_xor_si512(_mm512_permutex2var_epi8(pa, i0, pb), flip), xv);
            acc[3] = _mm512_dpbusd_epi32(acc[3], _mm512_xor_si512(_mm512_permutex2var_epi8(pa, i1, pb), flip), xv);
          }
          for (int k = 0; k < nn; ++k) _mm_prefetch(reinterpret_cast<const char*>(nxt[k] + o), _MM_HINT_T1);
          apply<4>(acc, s + c, dx, call.y + c);
        }
        if (c < b) {  // 32 columns
          __m512i acc[2] = {start, start};
          for (int32_t g = 0; g < ng; ++g) {
            const __m512i xv = _mm512_set1_epi32(xq4[g]);
            __m512i pa, pb;
            pair_rows(cur + 4 * g, c - a, pa, pb);
            acc[0] = _mm512_dpbusd_epi32(acc[0], _mm512_xor_si512(_mm512_permutex2var_epi8(pa, i0, pb), flip), xv);
            acc[1] = _mm512_dpbusd_epi32(acc[1], _mm512_xor_si512(_mm512_permutex2var_epi8(pa, i1, pb), flip), xv);
          }
          apply<2>(acc, s + c, dx, call.y + c);
        }
      }
      std::memcpy(cur, nxt, sizeof(cur[0]) * static_cast<size_t>(nn));
    }
    a = b;
  }
}
#endif

// One block's contribution to the columns [c, b) of the tile at base (row stride `stride`, first column `first`),
// portable: per 32 columns the int32 sums over the block's kept rows (signed codes), then the float step per
// column. The generic build's whole kernel, and the AVX2 build's columns outside whole q4 chunks.
template <int Bits>
[[maybe_unused]] void block_columns(const SparseQRows& call, const uint8_t* base, int64_t stride, int64_t first,
                                    const SparseQBlock& blk, int64_t c, int64_t b) {
  const uint16_t* s = call.scales + int64_t(blk.kb) * call.n;
  for (; c < b; c += 32) {
    int32_t acc[32] = {};
    for (int32_t g = 0; g < blk.ng; ++g) {
      for (int k = 0; k < 4; ++k) {
        const int32_t xq = static_cast<int8_t>(static_cast<uint32_t>(call.xq4[blk.g0 + g]) >> (8 * k));
        if (xq == 0) continue;
        const uint8_t* r = base + call.rows4[4 * (blk.g0 + g) + k] * stride;
        if constexpr (Bits == 8) {
          const int8_t* q = reinterpret_cast<const int8_t*>(r + (c - first));
          for (int j = 0; j < 32; ++j) acc[j] += xq * int32_t(q[j]);
        } else {
          // byte j of the 32-column block: in a whole 64-byte chunk at 16 (j / 4) + 4 q + j % 4 (q the
          // block's place in the chunk), in a row's last partial chunk at j
          const int64_t off = (c - first) / 2, chunk = off / 64 * 64;
          const bool whole = chunk + 64 <= stride;
          const uint8_t* q = r + chunk;
          const int64_t qb = (off - chunk) / 16;
          for (int j = 0; j < 16; ++j) {
            const uint8_t byte = whole ? q[16 * (j / 4) + 4 * qb + j % 4] : q[16 * qb + j];
            acc[j] += xq * (int32_t(byte & 15) - 8);
            acc[j + 16] += xq * (int32_t(byte >> 4) - 8);
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

#if LZ_SQ_AVX2
// AVX2 without VNNI: 2 kept rows a step, their bytes interleaved by unpacks and multiplied against the pair's two x
// codes by vpmaddubsw (unsigned x signed bytes, pairs summed to int16).
//
// q4: the nibbles as unsigned codes (code + 8) against the signed x codes: a pair's int16 is at most 2 x 15 x 127
// = 3810, so 4 groups (8 pairs) sum in int16 (<= 30480) before they are widened and added to int32 lanes that
// start at -8 times the block's x code sum (the offset taken back exactly). A 32-byte half h of a whole 64-byte
// chunk holds bytes 4 L + m of every block q for L = 2 h, 2 h + 1 (sparse_linear.h); unpacklo / unpackhi of a
// pair take blocks (0, 1) / (2, 3), and one 64-bit permutation per int16 vector puts each block's 8 columns
// 32 q + 16 nibble + 8 h + (0 .. 7) in order in a 128-bit half: widened, they meet y and the scales in order.
// q8: the signed codes sign-extended to int16, a pair's products summed by vpmaddwd into exact int32 lanes.
// The float step as every build: y + float(isum) * (d_w * d_x), a multiply, a multiply and an add (no FMA).
inline void apply8(__m256i acc, const uint16_t* s, __m256 dx, float* y) {
  const __m256 m = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))), dx);
  _mm256_storeu_ps(y, _mm256_add_ps(_mm256_loadu_ps(y), _mm256_mul_ps(_mm256_cvtepi32_ps(acc), m)));
}

// r (nibble n, unpack u at n * 2 + u) widened into acc32[2 (n * 2 + u) + t], t the block 2 u + t's 8 columns.
inline void widen_q4(__m256i r0, __m256i r1, __m256i r2, __m256i r3, __m256i* acc32) {
  const __m256i r[4] = {r0, r1, r2, r3};
  for (int j = 0; j < 4; ++j) {
    const __m256i p = _mm256_permute4x64_epi64(r[j], 0xD8);  // 64-bit pieces 0, 2, 1, 3
    acc32[2 * j] = _mm256_add_epi32(acc32[2 * j], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(p)));
    acc32[2 * j + 1] = _mm256_add_epi32(acc32[2 * j + 1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(p, 1)));
  }
}

// One block over one whole q4 chunk (128 columns from c): rows[k] + o its kept rows' bytes there.
inline void q4_chunk(const uint8_t* const* rows, int64_t o, const int32_t* xq4, int32_t ng, int32_t sum,
                     const uint16_t* s, __m256 dx, float* y) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    __m256i acc32[8];
    for (int j = 0; j < 8; ++j) acc32[j] = _mm256_set1_epi32(-8 * sum);
    for (int32_t g0 = 0; g0 < ng; g0 += 4) {  // 4 groups (8 pairs) in int16, then widened
      __m256i r0 = _mm256_setzero_si256(), r1 = r0, r2 = r0, r3 = r0;
      const int32_t g1 = g0 + 4 < ng ? g0 + 4 : ng;
      for (int32_t g = g0; g < g1; ++g) {
        const uint32_t x4 = static_cast<uint32_t>(xq4[g]);
        for (int pr = 0; pr < 2; ++pr) {
          const __m256i xp = _mm256_set1_epi16(static_cast<int16_t>(x4 >> (16 * pr)));
          const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[4 * g + 2 * pr] + o + 32 * h));
          const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[4 * g + 2 * pr + 1] + o + 32 * h));
          // the pair's bytes interleaved, then split into nibbles: (low, unpacklo), (low, unpackhi), (high, ...)
          const __m256i ul = _mm256_unpacklo_epi8(v0, v1), uh = _mm256_unpackhi_epi8(v0, v1);
          r0 = _mm256_add_epi16(r0, _mm256_maddubs_epi16(_mm256_and_si256(ul, m4), xp));
          r1 = _mm256_add_epi16(r1, _mm256_maddubs_epi16(_mm256_and_si256(uh, m4), xp));
          r2 = _mm256_add_epi16(r2, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(ul, 4), m4), xp));
          r3 = _mm256_add_epi16(r3, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(uh, 4), m4), xp));
        }
      }
      widen_q4(r0, r1, r2, r3, acc32);
    }
    for (int j = 0; j < 4; ++j) {
      const int n = j / 2, u = j % 2;
      for (int t = 0; t < 2; ++t) {
        const int64_t col = 32 * (2 * u + t) + 16 * n + 8 * h;
        apply8(acc32[2 * j + t], s + col, dx, y + col);
      }
    }
  }
}

// One block over 32 q8 columns from byte offset o of the rows: 4 int32 accumulators (columns 0-3 | 8-11,
// 4-7 | 12-15, and the same + 16), put in order by 128-bit permutations.
inline void q8_cols32(const uint8_t* const* rows, int64_t o, const int32_t* xq4, int32_t ng, const uint16_t* s,
                      __m256 dx, float* y) {
  __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int32_t g = 0; g < ng; ++g) {
    for (int pr = 0; pr < 2; ++pr) {
      const uint32_t x2 = static_cast<uint32_t>(xq4[g]) >> (16 * pr);
      const int32_t x0 = static_cast<int8_t>(x2 & 0xFF), x1 = static_cast<int8_t>((x2 >> 8) & 0xFF);
      const __m256i xp = _mm256_set1_epi32(static_cast<int32_t>((static_cast<uint32_t>(x1) << 16) |
                                                                (static_cast<uint32_t>(x0) & 0xFFFF)));
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[4 * g + 2 * pr] + o));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[4 * g + 2 * pr + 1] + o));
      for (int hf = 0; hf < 2; ++hf) {
        const __m256i a0 = _mm256_cvtepi8_epi16(hf ? _mm256_extracti128_si256(v0, 1) : _mm256_castsi256_si128(v0));
        const __m256i a1 = _mm256_cvtepi8_epi16(hf ? _mm256_extracti128_si256(v1, 1) : _mm256_castsi256_si128(v1));
        acc[2 * hf] = _mm256_add_epi32(acc[2 * hf], _mm256_madd_epi16(_mm256_unpacklo_epi16(a0, a1), xp));
        acc[2 * hf + 1] = _mm256_add_epi32(acc[2 * hf + 1], _mm256_madd_epi16(_mm256_unpackhi_epi16(a0, a1), xp));
      }
    }
  }
  for (int hf = 0; hf < 2; ++hf) {
    apply8(_mm256_permute2x128_si256(acc[2 * hf], acc[2 * hf + 1], 0x20), s + 16 * hf, dx, y + 16 * hf);
    apply8(_mm256_permute2x128_si256(acc[2 * hf], acc[2 * hf + 1], 0x31), s + 16 * hf + 8, dx, y + 16 * hf + 8);
  }
}

// A block's kept rows (4 a group) at the start of the tile: the row addresses, as many as it has.
inline int block_rows(const SparseQRows& call, int64_t bi, const uint8_t* base, int64_t stride, const uint8_t** out) {
  if (bi >= call.nblocks) return 0;
  const SparseQBlock& blk = call.blocks[bi];
  const int32_t* r4 = call.rows4 + 4 * int64_t(blk.g0);
  for (int32_t k = 0; k < 4 * blk.ng; ++k) out[k] = base + r4[k] * stride;
  return 4 * blk.ng;
}

template <int Bits>
void qrows(const SparseQRows& call, int64_t c0, int64_t c1) {
  // The current block's rows and the next one's, whose lines at the current columns are prefetched (into L2) as
  // the current block passes them: its pass over the tile comes next.
  const uint8_t* cur[32];
  const uint8_t* nxt[32];
  for (int64_t a = c0; a < c1;) {
    int64_t stride = 0, first = 0;
    const uint8_t* base = tile_base<Bits>(call, a, &stride, &first);
    const int64_t b = first + kSparseQTile < c1 ? first + kSparseQTile : c1;
    block_rows(call, 0, base, stride, cur);
    for (int64_t bi = 0; bi < call.nblocks; ++bi) {
      const SparseQBlock& blk = call.blocks[bi];
      const int nn = block_rows(call, bi + 1, base, stride, nxt);
      const uint16_t* s = call.scales + int64_t(blk.kb) * call.n;
      const __m256 dx = _mm256_set1_ps(blk.dx);
      int64_t c = a;
      if constexpr (Bits == 4) {
        const int64_t whole = first + (stride / 64) * 128;  // the end of the tile's whole chunks (a column)
        for (; c + 128 <= b && c + 128 <= whole; c += 128) {
          const int64_t o = (c - first) / 2;
          q4_chunk(cur, o, call.xq4 + blk.g0, blk.ng, blk.sum, s + c, dx, call.y + c);
          for (int k = 0; k < nn; ++k) _mm_prefetch(reinterpret_cast<const char*>(nxt[k] + o), _MM_HINT_T1);
        }
      } else {
        for (; c + 32 <= b; c += 32) {
          q8_cols32(cur, c - first, call.xq4 + blk.g0, blk.ng, s + c, dx, call.y + c);
          if ((c - a) % 64 == 0)
            for (int k = 0; k < nn; ++k) _mm_prefetch(reinterpret_cast<const char*>(nxt[k] + (c - first)), _MM_HINT_T1);
        }
      }
      block_columns<Bits>(call, base, stride, first, blk, c, b);  // a partial chunk / the last columns
      std::memcpy(cur, nxt, sizeof(cur[0]) * static_cast<size_t>(nn));
    }
    a = b;
  }
}
#elif !LZ_SQ_VNNI
// Portable: block_columns over the whole range, block after block.
template <int Bits>
void qrows(const SparseQRows& call, int64_t c0, int64_t c1) {
  for (int64_t a = c0; a < c1;) {
    int64_t stride = 0, first = 0;
    const uint8_t* base = tile_base<Bits>(call, a, &stride, &first);
    const int64_t b = first + kSparseQTile < c1 ? first + kSparseQTile : c1;
    for (int64_t bi = 0; bi < call.nblocks; ++bi) block_columns<Bits>(call, base, stride, first, call.blocks[bi], a, b);
    a = b;
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
