// The CPU fused ops' own row arithmetic (issue 37): the norms, gates and activations around the matrix products,
// computed in fp32 over one row at a time, the results rounded to the op's dtype where the module's ops round
// theirs (the ops' kernels do the rounding; these functions work in fp32). Every sum is in a fixed
// order (rms_scale's sum of squares: 16 lanes, lane j the elements i = j mod 16 in ascending i, the lanes combined as
// reduce_lanes does) and every exp is the same polynomial (exp_silu), so a row's result depends on that row alone,
// never on how many rows the call has, the thread that runs it, or the CPU's vector width. These are not the
// bits of transformers' modules (ATen's reductions and exp follow its own vector width; docs/engine.md, "The CPU
// fused ops' arithmetic"); the fused-op suites compare with the modules within a tolerance.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

namespace hebrus {

// An RMSNorm's scale of one group: 1 / sqrt(sum over i < n of x[i]^2 / n + eps), the sum in the fixed order above.
float rms_scale(const float* x, int64_t n, float eps);

// RMSNorm of a zero-centred weight on one group, in place: x[i] = (x[i] * rms_scale(x)) * (1 + weight[i]).
void rms_norm_row(float* x, const float* weight, int64_t n, float eps);

// x[i] = 1 / (1 + exp(-x[i])).
void sigmoid_row(float* x, int64_t n);

// x[i] = silu(x[i]) = x[i] / (1 + exp(-x[i])).
void silu_row(float* x, int64_t n);

// x[i] = max(x[i], 0) + log1p(exp(-|x[i]|)) (softplus, without overflow).
void softplus_row(float* x, int64_t n);

// out [m, n] = x [m, k] @ w [n, k].T in fp32, every output one dot product in a fixed order: 16 lanes, lane j the
// products of the columns c = j mod 16 in ascending c (the last columns zero-padded), the lanes combined as
// reduce_lanes does. Row i of out depends on row i of x alone: not on m, the threads, or the CPU's vector width.
// dense_mm takes it for a few rows (a decode step's), where it is faster than MKL's small-row products on the AMD
// VM this was measured on (benchmarks/RESULTS.md, "The row kernel"); x, w, out dense and row-major.
void row_kernel_mm(const float* x, int64_t m, const float* w, int64_t n, int64_t k, float* out);

// Whether dense_mm takes row_kernel_mm for a few rows (the default) or always ATen's mm (the bits of the model's own
// nn.Linear): hebrus_torch.dense_row_kernel sets it; set_row_kernel_enabled returns what it was.
bool row_kernel_enabled();
bool set_row_kernel_enabled(bool on);

template <typename T>
inline void widen_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void narrow_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// A per-feature parameter (a norm's weight, a bias) as the row loops read it: Tensor[D] float32, contiguous (the
// tensor itself where it is one).
inline at::Tensor float_weight(const at::Tensor& weight) {
  return weight.scalar_type() == at::kFloat && weight.is_contiguous() ? weight : weight.to(at::kFloat).contiguous();
}

// out[r] = the group-wise zero-centred RMSNorm of row r of x, each row on its own (groups of `group`; weight from
// float_weight), out contiguous; row r read in place at x + (r / per) * outer + (r % per) * inner (the (token, head)
// rows of a [T, H, dim] view whose last dimension is dense: per = H).
template <typename T>
void norm_rows_at(const T* x, int64_t per, int64_t inner, int64_t outer, const float* weight, T* out, int64_t rows,
                  int64_t dim, int64_t group, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(static_cast<size_t>(dim));
    for (int64_t r = r0; r < r1; ++r) {
      widen_row(x + (r / per) * outer + (r % per) * inner, row.data(), dim);
      for (int64_t g = 0; g < dim; g += group)
        rms_norm_row(row.data() + g, weight + g, group, static_cast<float>(eps));
      narrow_row(row.data(), out + r * dim, dim);
    }
  });
}

// norm_rows_at of contiguous rows of dim.
template <typename T>
void norm_rows(const T* x, const float* weight, T* out, int64_t rows, int64_t dim, int64_t group, double eps) {
  norm_rows_at(x, 1, 0, dim, weight, out, rows, dim, group, eps);
}

}  // namespace hebrus
