// The fused ops' row arithmetic (row_math.h): plain loops over fp32 rows, compiled once per vector width
// (HEBRUS_VECTOR_CLONES); the source fixes every order, so every clone gives the same bits.
#include "row_math.h"

#include <cmath>
#include <cstring>

#include "hebrus_simd.h"

namespace hebrus {

namespace {

// The sum of squares in two halves (hebrus_simd.h's Half; ~3% of a CPU prefill was its 16-lane accumulator's trips
// through the stack in the AVX2 clone).
HEBRUS_INLINE float scale_of(const float* x, int64_t n, float eps) {
  constexpr int64_t kHalf = kLanes / 2;
  Half lo = Half{} + 0.f, hi = Half{} + 0.f;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Half a = load_vector<Half>(x + i), b = load_vector<Half>(x + i + kHalf);
    lo += a * a;
    hi += b * b;
  }
  if (i < n) {
    float tail[kLanes] = {};
    std::memcpy(tail, x + i, static_cast<size_t>(n - i) * sizeof(float));
    const Half a = load_vector<Half>(tail), b = load_vector<Half>(tail + kHalf);
    lo += a * a;
    hi += b * b;
  }
  return 1.f / std::sqrt(reduce_halves(lo, hi) / static_cast<float>(n) + eps);
}

}  // namespace

HEBRUS_VECTOR_CLONES float rms_scale(const float* x, int64_t n, float eps) { return scale_of(x, n, eps); }

HEBRUS_VECTOR_CLONES void rms_norm_row(float* x, const float* weight, int64_t n, float eps) {
  const float s = scale_of(x, n, eps);
  for (int64_t i = 0; i < n; ++i) x[i] = (x[i] * s) * (1.f + weight[i]);
}

HEBRUS_VECTOR_CLONES void sigmoid_row(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float y = 1.f / (1.f + exp_silu(-v));
    // exp_silu(NaN) is finite: a NaN is kept, selected on its bits (a float compare-and-select here kept GCC from
    // vectorising the loop: one element at a time, the division's latency each, ~10% of a CPU prefill).
    const uint32_t vb = float_to_bits(v);
    const uint32_t nan = 0u - static_cast<uint32_t>((vb & 0x7FFFFFFFu) > 0x7F800000u);  // all ones for a NaN
    x[i] = bits_to_float((float_to_bits(y) & ~nan) | (vb & nan));
  }
}

HEBRUS_VECTOR_CLONES void silu_row(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = silu(x[i]);
}

HEBRUS_VECTOR_CLONES void softplus_row(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float y = (v > 0.f ? v : 0.f) + std::log1p(exp_silu(-std::fabs(v)));
    x[i] = v == v ? y : v;
  }
}

}  // namespace hebrus
