#pragma once
// x @ W.T of a dense projection in the CPU kernels: the BLAS sgemm call ATen's mm makes for it, made directly.
//
// Why: inside a decode step a projection runs after other kernels streamed weights through the caches, and ATen's
// path to the BLAS call (addmm_impl_cpu_'s checks and choices) is then mostly cache and TLB misses: on the development
// machine (2-core Xeon, one thread) a 16 KB weight's at::mm took ~42 us after a 16 MB stream against ~7 us for the
// direct call (warm: 1.6 against 0.4 us). A 1-request decode step makes ~70 projections from C++; in the step the
// saving is smaller, as the caches are not always that cold (benchmarks/RESULTS.md).
//
// The direct call is taken only where it is, by construction, the call at::mm(x, w.t()) makes: float32 tensors on
// the CPU, both 2-D and contiguous, non-empty, sizes within BLAS's int, plain CPU tensors (undispatched.h's test),
// nothing autograd could record, fp32 matmul precision left at IEEE (oneDNN's bf16 / tf32 modes take another path
// in ATen), and ATen built with MKL on x86-64 Linux, whose sgemm_ is looked up in the library that holds ATen
// itself (the symbol ATen's own call binds to). Anything else calls at::mm(x, transposed(w)).
// tests/test_dense_mm.py checks the two bit for bit on every path the kernels take.
#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <climits>
#include <cstdint>

#if defined(__linux__) && defined(__x86_64__)
#include <dlfcn.h>
#define HEBRUS_DIRECT_SGEMM 1
#else
#define HEBRUS_DIRECT_SGEMM 0
#endif

#include "row_math.h"
#include "undispatched.h"

namespace hebrus {

// Fortran BLAS sgemm (LP64): C = alpha * op(A) op(B) + beta * C, column-major.
using SgemmFn = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                         const int*, const float*, const int*, const float*, float*, const int*);

// The sgemm_ ATen's mm calls, or nullptr where it cannot be named (no MKL, another platform).
inline SgemmFn aten_sgemm() {
  static const SgemmFn fn = []() -> SgemmFn {
#if HEBRUS_DIRECT_SGEMM
    if (!at::hasMKL()) return nullptr;
    Dl_info info;
    if (dladdr(reinterpret_cast<void*>(&at::hasMKL), &info) == 0 || info.dli_fname == nullptr) return nullptr;
    void* lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (lib == nullptr) return nullptr;
    void* sym = dlsym(lib, "sgemm_");
    dlclose(lib);  // (RTLD_NOLOAD: only drops the reference this lookup took; ATen stays loaded)
    return reinterpret_cast<SgemmFn>(sym);
#else
    return nullptr;
#endif
  }();
  return fn;
}

// A non-empty contiguous float32 matrix, a plain CPU tensor autograd would not record, its sizes within BLAS's int.
inline bool plain_float_matrix(const at::Tensor& t) {
  return plain_cpu_tensor(t) && t.dim() == 2 && t.scalar_type() == at::kFloat && !autograd_could_record(t) &&
         t.is_contiguous() && t.size(0) > 0 && t.size(1) > 0 && t.size(0) <= INT_MAX && t.size(1) <= INT_MAX;
}

// Neither the generic nor oneDNN's matmul fp32 precision set to tf32 / bf16 (torch.set_float32_matmul_precision
// sets them too; its own getter is not read: it throws once both APIs were used).
inline bool ieee_fp32_matmul() {
  const at::Context& ctx = at::globalContext();
  const auto reduced = [](at::Float32Precision p) {
    return p == at::Float32Precision::TF32 || p == at::Float32Precision::BF16;
  };
  return !reduced(ctx.float32Precision(at::Float32Backend::GENERIC, at::Float32Op::ALL)) &&
         !reduced(ctx.float32Precision(at::Float32Backend::MKLDNN, at::Float32Op::MATMUL));
}

// The most rows dense_mm gives row_kernel_mm: a decode step's (one token per request, a few requests). Past it the
// BLAS's blocked sgemm reads each weight once for many rows, which the row kernel does not.
constexpr int64_t kRowKernelMaxRows = 8;

// x [M, K] @ w [N, K].T -> [M, N]: float32 matrices of at most kRowKernelMaxRows rows by row_kernel_mm (row_math.h:
// a fixed order, each row's bits its own) unless hebrus_torch.dense_row_kernel turned it off or fp32 matmuls are
// set to a reduced precision; otherwise the bits of at::mm(x, w.t()).
inline at::Tensor dense_mm(const at::Tensor& x, const at::Tensor& w) {
  if (!plain_float_matrix(x) || !plain_float_matrix(w) || x.size(1) != w.size(1) || !ieee_fp32_matmul())
    return at::mm(x, transposed(w));
  if (x.size(0) <= kRowKernelMaxRows && row_kernel_enabled()) {
    at::Tensor out = at::detail::empty_cpu({x.size(0), w.size(0)}, at::kFloat, std::nullopt, std::nullopt,
                                           std::nullopt, std::nullopt);
    row_kernel_mm(x.const_data_ptr<float>(), x.size(0), w.const_data_ptr<float>(), w.size(0), x.size(1),
                  out.mutable_data_ptr<float>());
    return out;
  }
  const SgemmFn sgemm = aten_sgemm();
  if (sgemm == nullptr || x.size(0) * w.size(0) > INT_MAX) return at::mm(x, transposed(w));
  const int m = static_cast<int>(x.size(0)), n = static_cast<int>(w.size(0)), k = static_cast<int>(x.size(1));
  at::Tensor out = at::detail::empty_cpu({x.size(0), w.size(0)}, at::kFloat, std::nullopt, std::nullopt,
                                         std::nullopt, std::nullopt);
  const float one = 1.f, zero = 0.f;
  // Row-major out = x w^T is column-major out^T = w x^T: w read transposed ("T", lda k), x^T as stored ("N", ldb k).
  sgemm("T", "N", &n, &m, &k, &one, w.const_data_ptr<float>(), &k, x.const_data_ptr<float>(), &k, &zero,
        out.mutable_data_ptr<float>(), &n);
  return out;
}

}  // namespace hebrus
