// ai.layerzero::SparseLinear: the fused threshold + row-skip linear of activation sparsity (issue 23).
//
//   y [..., N], kept [...] int64 = SparseLinear(x [..., K] float32, w, thresholds [K] float32, scale? [] float32,
//                                               bias? [N] float32, w_scales? [K, N/32] float16)
//   w: weight_format "f": [K, N] float32 / float16 / bfloat16 (the MatMul's B: row i = input channel i);
//      "q8": [K, N] int8; "q4": [K, N/2] uint8 (plugins/quant.py quantize_blocks(B, bits, 32, axis=-1): blocks of
//      32 along N, element 2j in the low nibble of byte j, stored code + 8); an element is code * d[i, n / 32].
//
// keep[t, i] = !(|x[t, i]| <= thresholds[i] * scale) (NaN kept); y[t, :] = sum over kept i, ascending, of
// x[t, i] * W[i, :] (float32, one fused multiply-add per kept channel and column, in ascending i) + bias;
// kept[t] = number of kept channels. Semantics: plugins/sparse.py sparse_linear_reference.
//
// The kernels (sparse_linear_rows.cpp, compiled per ISA): a column range [c0, c1) of y for the kept rows of a
// group of tokens; each row streamed once for all the group's tokens that keep it. A column's arithmetic does not
// depend on the range it falls in, so the result does not depend on how the columns are split over threads.
#pragma once

#include <cstdint>

struct OrtCustomOp;

namespace lz {

enum class SparseFormat { f32 = 0, f16 = 1, bf16 = 2, q8 = 3, q4 = 4 };

// One call of a row kernel: rows[r] (ascending) are the kept channels of the group (the union over its tokens);
// for row r, the tokens keeping it are tok[r * group .. r * group + ntok[r]) and their x values xv[same].
// y of token j starts at y + j * ldy. Every y column in [c0, c1) is accumulated into (y is not cleared).
struct SparseRows {
  const void* w = nullptr;             // [K, N] (codes for q8 / q4)
  const uint16_t* scales = nullptr;    // [K, N / 32] float16 bits (q8 / q4)
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
  SparseRowsFn by_format[5];  // indexed by SparseFormat
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

// The best kernels this CPU runs, chosen once (LAYERZERO_ORT_ISA=generic / avx2 forces one).
const SparseKernels& sparse_kernels();

// The op, for RegisterCustomOps (custom_op.cpp): float32 x / y.
const OrtCustomOp* sparse_linear_op();

}  // namespace lz
