// exp(x) for x <= 0 without a libm call, for the attention kernel's softmax (liblayerzero_ort.so).
#pragma once

#include <cstdint>
#include <cstring>

namespace lz {

// exp(x) for x <= 0 (or NaN), branch-free so that a loop over a row vectorises: the Cody-Waite reduction
// x = n ln2 + r (|r| <= ln2 / 2) and a degree-7 Taylor polynomial of e^r (relative error below 2e-8 before
// rounding), times 2^n through the exponent bits; exactly 0 below -87.3 (where float32's normal range ends; -inf
// included); NaN stays NaN.
inline float exp_nonpositive(float x) {
  const bool tiny = x < -87.3f;
  const float xc = tiny ? -87.3f : (x > 0.0f ? 0.0f : x);
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest (|n| <= 126)
  const float r = (xc - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n == n ? n : 0.0f) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return tiny ? 0.0f : p * two_n;
}

}  // namespace lz
