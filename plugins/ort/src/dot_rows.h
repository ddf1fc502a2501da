// Row-dot micro-kernels of the native MoE op: out[t * ldo + r] = dot(w[r, :], x[t, :]) for a block of weight rows
// stored [rows, k] (the form's [out, in] layout, read in place) and a block of tokens stored [tokens, ldx].
//
// dot_rows.cpp is compiled once per instruction set (LZ_ISA_NS = avx2 with -mavx2 -mfma -mf16c, generic with
// the compiler's baseline); dot_kernels() picks the best one the CPU runs, once.
#pragma once

#include <cstdint>

namespace lz {

enum class WeightType { f32 = 0, f16 = 1, bf16 = 2 };

using DotRowsFn = void (*)(const void* w, int64_t rows, int64_t k, const float* x, int64_t tokens, int64_t ldx,
                           float* out, int64_t ldo);

// The row kernels' read pattern without their arithmetic: `bytes` read as kSegments sequential streams (benchmarks:
// how fast this core streams the same bytes at best); returns a sum of what was read, so the reads are kept.
using StreamReadFn = float (*)(const void* p, int64_t bytes);

struct DotKernels {
  const char* isa;
  DotRowsFn by_type[3];  // indexed by WeightType
  StreamReadFn stream_read;
};

namespace avx2 {
extern const DotKernels kKernels;
bool available();
}  // namespace avx2
namespace generic {
extern const DotKernels kKernels;
bool available();
}  // namespace generic

// The kernels for this CPU (LAYERZERO_ORT_ISA=generic forces the portable ones).
const DotKernels& dot_kernels();

// The portable half / bfloat16 conversions (also used outside the kernels).
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
inline float bf16_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}
uint16_t float_to_bf16(float f);

}  // namespace lz
