// ai.layerzero::SparseLinear: the fused threshold + row-skip linear of activation sparsity (issue 23).
//
//   y [..., N], kept [...] int64 = SparseLinear(x [..., K] float32, w, thresholds [K] float32, scale? [] float32,
//                                               bias? [N] float32, w_scales? [K/32, N] float16)
//   w: weight_format "f": [K, N] float32 / float16 / bfloat16 (the MatMul's B: row i = input channel i);
//      "q8": [K, N] int8 codes; "q4": [K, N/2] uint8, within each 32-column block of a row byte j holding column
//      j (low nibble) and column j + 16 (high nibble) as code + 8; blocks of 32 along K: w_scales [K/32, N]
//      float16, element (i, n) = code * d[i / 32, n]. K, N multiples of 32. q8 / q4 rows are stored in column
//      tiles (plugins/quant.py quantize_k_blocks): tile t = columns [8192 t, min(N, 8192 t + 8192)), each a
//      row-major [K, width] block (q4: width / 2 bytes a row), the tiles one after the other; N <= 8192 is one
//      tile, the plain row-major matrix. A tile's rows are contiguous: a kept row of a block is one short stream
//      the next rows follow, a skipped row a skipped contiguous segment (kSparseQTile). q4: within a tile's row,
//      each whole 64-byte chunk (128 columns, 4 blocks of 32) holds at byte 16 L + 4 q + m the byte 4 L + m of
//      its block q (a 4 x 4 transpose of 4-byte groups: what 8 byte / word unpacks of 4 rows turn into vpdpbusd
//      lanes in column order); the bytes of a row's last partial chunk (< 64) are in block order.
//
// keep[t, i] = !(|x[t, i]| <= thresholds[i] * scale) (NaN kept). Format f: y[t, :] = sum over kept i, ascending,
// of x[t, i] * W[i, :] (float32, one fused multiply-add per kept channel and column) + bias. q8 / q4: the kept x
// (a skipped channel as 0) quantized per 32-channel block to int8 (llama.cpp's Q8_0: d_x = max|x| / 127,
// q = round_half_even(x * 127 / max|x|)); per block kb with a kept channel, ascending, and column n:
// y = y + float(isum) * (d[kb, n] * d_x[kb]) (a float32 multiply, a multiply and an add: no FMA), isum the
// exact int32 dot of the block's kept x codes and codes; then + bias. kept[t] = number of kept channels.
// Semantics: plugins/sparse.py sparse_linear_reference (bitwise, every format but the portable f build).
//
// The kernels (sparse_linear_rows.cpp, compiled per ISA): a column range [c0, c1) of y for the kept rows of a
// group of tokens; each row streamed once for all the group's tokens that keep it. A column's arithmetic does not
// depend on the range it falls in, so the result does not depend on how the columns are split over threads.
#pragma once

#include <cstdint>

struct OrtCustomOp;

namespace lz {

enum class SparseFormat { f32 = 0, f16 = 1, bf16 = 2, q8 = 3, q4 = 4 };

// One call of a float row kernel (weight_format f): rows[r] (ascending) are the kept channels of the group (the
// union over its tokens); for row r, the tokens keeping it are tok[r * group .. r * group + ntok[r]) and their x
// values xv[same]. y of token j starts at y + j * ldy. Every y column in [c0, c1) is accumulated into (y is not
// cleared).
struct SparseRows {
  const void* w = nullptr;             // [K, N]
  int64_t n = 0;                       // N
  const int32_t* rows = nullptr;
  int64_t nrows = 0;
  int64_t group = 1;                   // tokens in the group (1: decode)
  const int32_t* ntok = nullptr;       // [nrows] (group > 1)
  const int32_t* tok = nullptr;        // [nrows * group] (group > 1)
  const float* xv = nullptr;           // [nrows] (group 1) or [nrows * group]
  float* y = nullptr;
  int64_t ldy = 0;
  int64_t tokens = 1;                  // y rows of the call (the group's tokens)
};

using SparseRowsFn = void (*)(const SparseRows& call, int64_t c0, int64_t c1);

struct SparseKernels {
  const char* isa;
  SparseRowsFn by_format[3];  // f32, f16, bf16 (SparseFormat 0..2)
};

// One token of a quantized (q8 / q4) call. x is quantized per 32-channel block of K to int8 (the kept channels;
// a skipped channel counts 0): the blocks with a kept channel, ascending, each with its kept rows in groups of 4
// (ascending; the last group padded by repeating its last row, with x code 0). Per group g: rows4[4g .. 4g + 4)
// and xq4[g] = the 4 x codes as the bytes of an int32 (row 4g + r in byte r).
struct SparseQBlock {
  int32_t kb;    // the block index (channels 32 kb .. 32 kb + 32)
  int32_t g0;    // its first group
  int32_t ng;    // its groups
  int32_t sum;   // the sum of its x codes
  float dx;      // its x scale: max |x| / 127 over the kept channels (float32)
};

// Columns of a stored q8 / q4 tile (the header's w): also the kernels' column tile (y's 32 KB). A kept row of a full
// tile is one run of 4 KB (q4) / 8 KB (q8): what the memory system streams near its full read rate with half of
// the runs skipped (1 KB runs, tiles of 2048: ~70 % of it; bench/README.md, sparse_linear.py).
constexpr int64_t kSparseQTile = 8192;
// The q8 / q4 code layout these kernels read (the node's code_layout attribute; compiler/contract.py
// SPARSE_LINEAR_CODE_LAYOUT): 2 = column tiles of kSparseQTile (8192), q4 rows' 64-byte chunks 4x4-transposed
// (1 was the same with tiles of 2048).
constexpr int64_t kCodeLayout = 2;

struct SparseQRows {
  const void* w = nullptr;             // q8 [K, N] int8; q4 [K, N/2] uint8, in column tiles (w above)
  int64_t k = 0;                       // K (the tiles' rows)
  const uint16_t* scales = nullptr;    // [K/32, N] float16 bits
  int64_t n = 0;                       // N
  const SparseQBlock* blocks = nullptr;
  int64_t nblocks = 0;
  const int32_t* rows4 = nullptr;      // (a padding entry holds a valid row of the block, x code 0)
  const int32_t* xq4 = nullptr;
  float* y = nullptr;                  // the token's y (accumulated into)
};

// y[c] += the token's blocks' contributions, columns [c0, c1) (c0 a multiple of 128, c1 of 128 or c1 = N: a
// range starts on a q4 chunk).
using SparseQFn = void (*)(const SparseQRows& call, int64_t c0, int64_t c1);

struct SparseQKernels {
  const char* isa;
  SparseQFn q8;
  SparseQFn q4;
};

namespace avx512 {
extern const SparseKernels kSparseKernels;
bool sparse_available();
}  // namespace avx512
namespace avx2 {
extern const SparseKernels kSparseKernels;
bool sparse_available();
}  // namespace avx2
namespace generic {
extern const SparseKernels kSparseKernels;
bool sparse_available();
}  // namespace generic

namespace avx512vnni {
extern const SparseQKernels kSparseQKernels;
bool sparse_q_available();
}  // namespace avx512vnni
namespace avx2 {
extern const SparseQKernels kSparseQKernels;
bool sparse_q_available();
}  // namespace avx2
namespace generic {
extern const SparseQKernels kSparseQKernels;
bool sparse_q_available();
}  // namespace generic

// The best quantized kernels this CPU runs (AVX-512 VNNI + VBMI, AVX2, portable), chosen once
// (LAYERZERO_ORT_ISA=generic / avx2 forces one).
const SparseQKernels& sparse_q_kernels();

// The best kernels this CPU runs, chosen once (LAYERZERO_ORT_ISA=generic / avx2 forces one).
const SparseKernels& sparse_kernels();

// The op, for RegisterCustomOps (custom_op.cpp): float32 x / y.
const OrtCustomOp* sparse_linear_op();

// ai.layerzero::QLinear, for RegisterCustomOps: the dense product of block-quantized weights (the MoE experts'
// format and row kernels, qdot_rows.h), what --weights int4 / int8 compiles a MatMul to with --linear-kernel native:
//   y [..., N] float32 = QLinear(x [..., K] float32, codes, scales [N, K/32] float16, bias? [N] float32)
//   codes: weight_format "q4": [N, K/2] uint8 (MatMulNBits' B bytes: element 2j of a block in byte j's low nibble,
//   code + 8), "q8": [N, K] int8; blocks of 32 along K; row n = output n. Per token x is quantized per 32-block to
//   int8 (plugins/quant.py quantize_activations), y[n] = sum over blocks of float(isum) * (d_w * d_x) + bias[n]
//   (plugins/quant.py qdot_rows; the MoE's float order). The same y for a token alone or batched, at any threads.
//   splits? (ints, positive, summing to N): one output per entry instead of y (a variadic output), output i [..., n_i]
//   holding columns [sum(n_<i), sum(n_<=i)) of y, written in place (no copy): the projections that read one x
//   (q / k / v, gate / up) as one node, x quantized once (passes/native_linear.py); bitwise the separate nodes'.
const OrtCustomOp* qlinear_op();

}  // namespace lz
