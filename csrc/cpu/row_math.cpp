// The fused ops' row arithmetic (row_math.h): plain loops over fp32 rows, compiled once per vector width
// (HEBRUS_VECTOR_CLONES); the source fixes every order, so every clone gives the same bits.
#include "row_math.h"

#include <cmath>
#include <cstring>

#include "hebrus_simd.h"

namespace hebrus {

namespace {

HEBRUS_INLINE float scale_of(const float* x, int64_t n, float eps) {
  Vec acc = Vec{} + 0.f;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = load_vec(x + i);
    acc += v * v;
  }
  if (i < n) {
    float tail[kLanes] = {};
    std::memcpy(tail, x + i, static_cast<size_t>(n - i) * sizeof(float));
    const Vec v = load_vec(tail);
    acc += v * v;
  }
  return 1.f / std::sqrt(reduce_lanes(acc) / static_cast<float>(n) + eps);
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
    x[i] = v == v ? y : v;  // exp_silu(NaN) is finite: keep the NaN
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
