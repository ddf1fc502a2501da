// Row-dot micro-kernels of the quantized expert weights (weight_format q8 / q4; the format: plugins/quant.py and
// plugins/ort/README.md): out[t * ldo + r] = sum over the row's 32-blocks b of (d_w[r, b] * d_x[t, b]) *
// sum_j code_w[r, b, j] * q_x[t, b, j], the tokens' x already quantized per 32-block to int8 (QTokens).
//
// qdot_rows.cpp is compiled once per instruction set (LZ_ISA_NS = avx512vnni with -march=x86-64-v4 -mavx512vnni,
// avx2 with -march=x86-64-v3, generic with the compiler's baseline); qdot_kernels() picks the best one the CPU
// runs, once (LAYERZERO_ORT_ISA=generic / avx2 forces one).
#pragma once

#include <cstdint>

namespace lz {

constexpr int64_t kQBlock = 32;
// A token's quantized row is padded to a multiple of kQPad elements (zero codes, zero scales): the kernels'
// vector steps (up to 8 blocks) never read past it.
constexpr int64_t kQPad = 256;

// q4 rows in 16-block chunks (code_layout 1, plugins/quant.py chunk_q4_rows): each whole chunk of 16 blocks of a
// row (256 code bytes) holds, at byte 64 s + 4 j, bytes 4 s .. 4 s + 3 of block j's 16 (s = 0..3): one 32-bit lane
// per block in each 64-byte step, so a lane's integer dot accumulates over the chunk's 4 steps and is scaled once.
// The blocks after the last whole chunk (k / 32 % 16 of them) stay in the plain order (block b at byte 16 b).
constexpr int64_t kQChunk = 16;
inline int64_t q4_chunked_blocks(int64_t k) { return k / kQBlock / kQChunk * kQChunk; }

// Quantized tokens [tokens, kp] (kp = k rounded up to kQPad): q int8 codes, d float scales and off int32 per
// block (kp / 32 each). For q4 the codes of each group of 4 blocks (128 elements) are stored as the 64 even
// elements (block 0's 16, block 1's, ...) then the 64 odd ones: the order of the weight nibbles once a kernel has
// split 64 code bytes into low and high nibbles (the integer dot does not depend on the order). For q4 rows in
// chunks (chunked > 0: the blocks [0, chunked) are in whole chunks) those blocks' codes follow the chunks instead:
// chunk c's 512 codes as 4 steps of 128, step s = the even elements 8 s, 8 s + 2, 8 s + 4, 8 s + 6 of each of its
// 16 blocks (4 bytes a block, block order), then the odd ones. For q8 the natural order. off[b] = -offset *
// sum_j q[b, j] (offset 8 for q4, 128 for q8): what the kernels that multiply the codes as unsigned (code +
// offset) subtract.
struct QTokens {
  int8_t* q = nullptr;
  float* d = nullptr;
  int32_t* off = nullptr;
  int64_t kp = 0, nb = 0;  // padded elements and blocks per token
  int64_t chunked = 0;     // q4: the blocks in whole 16-block chunks (q4_chunked_blocks(k) for code_layout 1), else 0
};

// Quantize one token's x[k] (k a multiple of 32) into token t of xq, for `bits` 8 or 4. Per block, in float32:
// d = max|x| / 127, q = clamp(round_half_even(x * (127 / max|x|)), -127, 127) (0 for a zero or non-finite block
// maximum); plugins/quant.py quantize_activations is the same arithmetic.
void quantize_token(const float* x, int64_t k, int bits, const QTokens& xq, int64_t t);
// Blocks [b0, b1) of it only (x is the whole row; the other blocks and the padding are left as they are).
void quantize_token_blocks(const float* x, int64_t b0, int64_t b1, int bits, const QTokens& xq, int64_t t);

// Where element j (0..31) of block b of a token's x goes in its quantized row (see QTokens).
inline int64_t q_position(int bits, int64_t chunked, int64_t b, int64_t j) {
  if (bits == 8) return b * kQBlock + j;
  if (b < chunked) return (b / kQChunk) * 512 + (j / 8) * 128 + (j % 2) * 64 + (b % kQChunk) * 4 + (j / 2) % 4;
  return (b / 4) * 128 + (j % 2) * 64 + (b % 4) * 16 + j / 2;
}

// codes [rows, k] int8 (q8) or [rows, k / 2] uint8 (q4), scales [rows, k / 32] float16 bits; tokens of xq. q4
// rows are in chunks when xq.chunked > 0 (it must then be q4_chunked_blocks(k)).
using QDotRowsFn = void (*)(const void* codes, const uint16_t* scales, int64_t rows, int64_t k, const QTokens& x,
                            int64_t tokens, float* out, int64_t ldo);

// quantize_token_blocks of one instruction set (bitwise the same codes, scales and offsets in every one).
using QuantizeBlocksFn = void (*)(const float* x, int64_t b0, int64_t b1, int bits, const QTokens& xq, int64_t t);

struct QDotKernels {
  const char* isa;
  bool prefetch;  // the row kernels prefetch each row's codes ahead (qdot_rows.cpp kPrefetchBytes)
  QDotRowsFn q8, q4;
  QuantizeBlocksFn quantize;
};

namespace avx512vnni {
extern const QDotKernels kQKernels, kQKernelsNoPrefetch;
bool q_available();
}  // namespace avx512vnni
namespace avx2 {
extern const QDotKernels kQKernels, kQKernelsNoPrefetch;
bool q_available();
}  // namespace avx2
namespace generic {
extern const QDotKernels kQKernels, kQKernelsNoPrefetch;
bool q_available();
}  // namespace generic

// The best kernels this CPU runs (LAYERZERO_ORT_ISA=generic / avx2 forces one), with or without the rows' software
// prefetch (LAYERZERO_ORT_PREFETCH=0 / 1; by default off for the AVX2 build on AMD CPUs: moe.cpp says why).
const QDotKernels& qdot_kernels();

}  // namespace lz
