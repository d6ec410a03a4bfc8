// The fused ops' row arithmetic (row_math.h): plain loops over fp32 rows, compiled once per vector width
// (HEBRUS_VECTOR_CLONES); the source fixes every order, so every clone gives the same bits.
#include "row_math.h"

#include <algorithm>
#include <atomic>
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

// How far ahead of the columns it reads row_kernel_mm prefetches each weight row: lines of the rows a few blocks on
// (a decode step's rows are short, and the hardware's stream prefetcher does not find them in time). Measured on an
// Intel Xeon VM (session 36, a 1-request decode step, one core): 4 KB 5% shorter than 2 KB, 8 KB another ~1.6%,
// 16 KB ~1.7% more, 32 KB 7% longer (the lines wait in L1 before they are read: 32 KB is an AMD Zen 3's whole L1,
// so the smaller of the two good distances is kept).
constexpr int64_t kRowPrefetchBytes = 8192;

// The dot products of one row x with R consecutive rows of w (each k long) into out[0 .. R): each is reduce_halves
// of a 16-lane sum (lane j: the products of the columns c = j mod 16 in ascending c; the last columns zero-padded
// to a whole 16).
template <int R>
HEBRUS_INLINE void row_block_dots(const float* x, const float* w, int64_t k, bool prefetch, float* out) {
  constexpr int64_t kHalf = kLanes / 2;
  Half acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = Half{} + 0.f;
  const int64_t whole = k / kLanes * kLanes;
  for (int64_t c = 0; c < whole; c += kLanes) {
    if (prefetch)
      for (int r = 0; r < R; ++r) __builtin_prefetch(reinterpret_cast<const char*>(w + r * k + c) + kRowPrefetchBytes);
    for (int h = 0; h < 2; ++h) {
      const Half xv = load_vector<Half>(x + c + h * kHalf);
      for (int r = 0; r < R; ++r) acc[r][h] += load_vector<Half>(w + r * k + c + h * kHalf) * xv;
    }
  }
  if (whole < k) {
    float xt[kLanes] = {}, wt[kLanes] = {};
    std::memcpy(xt, x + whole, static_cast<size_t>(k - whole) * sizeof(float));
    for (int r = 0; r < R; ++r) {
      std::memcpy(wt, w + r * k + whole, static_cast<size_t>(k - whole) * sizeof(float));
      for (int h = 0; h < 2; ++h) acc[r][h] += load_vector<Half>(wt + h * kHalf) * load_vector<Half>(xt + h * kHalf);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = reduce_halves(acc[r][0], acc[r][1]);
}

std::atomic<bool> row_kernel_on{true};

}  // namespace

bool row_kernel_enabled() { return row_kernel_on.load(std::memory_order_relaxed); }

bool set_row_kernel_enabled(bool on) { return row_kernel_on.exchange(on); }

// Blocks of 4 weight rows; each block's rows are read once for all m rows of x (the first row's pass prefetches).
HEBRUS_VECTOR_CLONES void row_kernel_mm_span(const float* x, int64_t m, const float* w, int64_t n0, int64_t n1,
                                             int64_t n, int64_t k, float* out) {
  int64_t j = n0;
  for (; j + 4 <= n1; j += 4)
    for (int64_t i = 0; i < m; ++i) row_block_dots<4>(x + i * k, w + j * k, k, i == 0, out + i * n + j);
  for (; j < n1; ++j)
    for (int64_t i = 0; i < m; ++i) row_block_dots<1>(x + i * k, w + j * k, k, i == 0, out + i * n + j);
}

void row_kernel_mm(const float* x, int64_t m, const float* w, int64_t n, int64_t k, float* out) {
  // (each output is one dot product in a fixed order: how the columns are split between threads changes nothing)
  // Blocks of 4 weight rows, at least 4 blocks or ~64 KB of weights a chunk.
  const int64_t block_grain = std::max<int64_t>(4, (int64_t{1} << 14) / std::max<int64_t>(k, 1));
  at::parallel_for(0, (n + 3) / 4, block_grain, [&](int64_t b0, int64_t b1) {
    row_kernel_mm_span(x, m, w, b0 * 4, std::min(n, b1 * 4), n, k, out);
  });
}

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
