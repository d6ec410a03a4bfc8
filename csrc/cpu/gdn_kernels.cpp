// CPU kernels of hebrus::gdn_delta_rule and hebrus::gdn_delta_rule_slots: the gated delta rule of the
// gated-delta-net (linear attention) layers over packed rows, in the recurrent form, each row's state
// updated in place (the slot form: row b's state is state_pool[slots[b]]).
// hebrus_torch/reference.py (gdn_delta_rule, gdn_delta_rule_slots) is the spec; the metadata checks
// are csrc/gdn_checks.h, mirrored in hebrus_torch/gdn/delta_rule.py with the same messages.
//
// Work item: one (row, value head). Its state S [Dk, Dv] (fp32) stays in L1 while the row's tokens
// run through it in order; per token, every sum over Dk adds dk = 0, 1, ... in ascending order, one
// Dv column per vector lane. An output therefore depends only on its own row's inputs, never on the
// other rows of the step, on how the row's tokens were cut into steps or on the thread count.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "gdn_checks.h"
#include "gdn_fused_checks.h"
#include "gdn_recurrent.h"
#include "hebrus_check.h"
#include "op_checks.h"
#include "row_math.h"
#include "undispatched.h"

namespace hebrus {
namespace {

using at::Tensor;

constexpr const char* kOp = "hebrus_torch.gdn.gated_delta_rule";

// Tokens [t0, t1) of row b through the state of value head h (gdn_recurrent.h: the code the chunked op's
// partial chunks share). Row b's state is state[slots[b]] in the slot form (slots != nullptr), else state[b].
void run_head(const gdn::Packed& r, float* state, const int32_t* slots, int64_t b, int64_t h, int64_t t0,
              int64_t t1, std::vector<float>& buf) {
  const int64_t row = slots != nullptr ? static_cast<int64_t>(slots[b]) : b;
  gdn::run_recurrent(r, state + (row * r.hv + h) * r.dk * r.dv, h, t0, t1, buf.data());
}

// Both ops, after their checks: row b's state at slots[b] (slots == nullptr: at b), updated in place.
Tensor run_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                      const int32_t* cu, Tensor& state, const int32_t* slots, const GdnSizes& sz, double scale,
                      bool use_qk_l2norm) {
  const gdn::PackedCall call(q, k, v, g, beta, sz.hk, sz.hv, sz.dk, sz.dv, scale, use_qk_l2norm);
  const gdn::Packed& r = call.r;
  float* pool = state.data_ptr<float>();
  const int64_t batch = sz.batch, hv = sz.hv, dk = sz.dk, dv = sz.dv;
  at::parallel_for(0, batch * hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(2 * dk + dv);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / hv, h = item % hv;
      if (cu[b + 1] > cu[b]) run_head(r, pool, slots, b, h, cu[b], cu[b + 1], buf);
    }
  });
  return call.result(v.scalar_type());
}

Tensor gdn_delta_rule_cpu(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                          const Tensor& cu_seqlens, Tensor& state, double scale, bool use_qk_l2norm) {
  check_on_device("gdn_delta_rule", at::kCPU,
                  {{"q", &q}, {"k", &k}, {"v", &v}, {"g", &g}, {"beta", &beta}, {"cu_seqlens", &cu_seqlens},
                   {"state", &state}});
  const GdnSizes sz = check_gdn_delta_rule_args(q, k, v, g, beta, cu_seqlens, state);
  const int64_t T = sz.total, batch = sz.batch;
  const Tensor cu_c = cu_seqlens.contiguous();
  const int32_t* cu = cu_c.data_ptr<int32_t>();
  bool rising = cu[0] == 0 && cu[batch] == T;
  for (int64_t b = 0; b < batch && rising; ++b) rising = cu[b] <= cu[b + 1];
  if (!rising) {
    std::string got = "[";
    for (int64_t b = 0; b <= batch; ++b) got += (b ? ", " : "") + std::to_string(cu[b]);
    HEBRUS_CHECK(false, HebrusError, kOp, ": cu_seqlens must rise from 0 to T = ", T, " without decreasing, got ",
                 got, "]");
  }
  return run_delta_rule(q, k, v, g, beta, cu, state, nullptr, sz, scale, use_qk_l2norm);
}

// The slot form: the same row loops (run_head), row b's state read and written at state_pool[slots[b]],
// so its bits are those of gdn_delta_rule on the gathered states. Every check (cu_seqlens, slot ids in
// range and distinct) runs before anything is written; distinct slots never share a state.
Tensor gdn_delta_rule_slots_cpu(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                                const Tensor& cu_seqlens, Tensor& state_pool, const Tensor& slots, double scale,
                                bool use_qk_l2norm) {
  const char* op = "gdn_delta_rule_slots";
  check_on_device(op, at::kCPU,
                  {{"q", &q}, {"k", &k}, {"v", &v}, {"g", &g}, {"beta", &beta}, {"cu_seqlens", &cu_seqlens},
                   {"state_pool", &state_pool}, {"slots", &slots}});
  const GdnSizes sz = check_gdn_delta_rule_slots_args(q, k, v, g, beta, cu_seqlens, state_pool, slots);
  const Tensor cu_t = check_cu_values(op, cu_seqlens, sz.total);
  const Tensor slot_t = check_slot_values(op, slots, sz.pool);
  return run_delta_rule(q, k, v, g, beta, cu_t.data_ptr<int32_t>(), state_pool, slot_t.data_ptr<int32_t>(), sz,
                        scale, use_qk_l2norm);
}

// ---- fused gates and gated output norm (issue 37) ------------------------------------------------------
// The formulas of the packed forward's Python (hebrus_torch/reference/gdn.py: gdn_gates, gdn_gated_rms_norm) in
// hebrus's own row arithmetic (row_math.h: fp32, fixed orders, rounded where the modules' ops round), each row on
// its own; on MPS each is one Metal launch (mps_kernels/gdn_fused.metal).

// g = -exp(A_log) * softplus(a + dt_bias) (fp32) and beta = sigmoid(b) in fp32 rounded to b's dtype, returned
// widened to fp32; Tensor[..., Hv] each.
template <typename T>
void gates_rows(const T* a, const T* b, const float* growth, const float* dt_bias, float* g, float* beta, int64_t rows,
                int64_t hv) {
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* gr = g + r * hv;
      float* br = beta + r * hv;
      for (int64_t h = 0; h < hv; ++h) gr[h] = static_cast<float>(a[r * hv + h]) + dt_bias[h];
      softplus_row(gr, hv);
      for (int64_t h = 0; h < hv; ++h) gr[h] = -(growth[h] * gr[h]);   // (-e) * x, exactly: rounding is odd
      widen_row(b + r * hv, br, hv);
      sigmoid_row(br, hv);
      for (int64_t h = 0; h < hv; ++h) br[h] = static_cast<float>(static_cast<T>(br[h]));
    }
  });
}

std::tuple<Tensor, Tensor> gdn_gates_cpu(const Tensor& a, const Tensor& b, const Tensor& A_log,
                                         const Tensor& dt_bias) {
  check_on_device("gdn_gates", at::kCPU, {{"a", &a}, {"b", &b}, {"A_log", &A_log}, {"dt_bias", &dt_bias}});
  const GdnRowsSizes sz = check_gdn_gates_args(a, b, A_log, dt_bias);
  Tensor g = empty_on_cpu(a.sizes(), a.options().dtype(at::kFloat).memory_format(at::MemoryFormat::Contiguous));
  Tensor beta = at::empty_like(g);
  if (g.numel() == 0) return {g, beta};
  const Tensor ac = a.contiguous(), bc = b.contiguous(), dt = float_weight(dt_bias);
  // exp(A_log) by ATen's exp (the module's bits); its negation is in gates_rows (one dispatched op fewer)
  const Tensor growth = as_dtype(A_log, at::kFloat).exp().contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "gdn_gates", [&] {
    gates_rows<scalar_t>(ac.data_ptr<scalar_t>(), bc.data_ptr<scalar_t>(), growth.data_ptr<float>(),
                         dt.data_ptr<float>(), g.data_ptr<float>(), beta.data_ptr<float>(), sz.rows, sz.dim);
  });
  return {g, beta};
}

// transformers' Qwen4ExpTextRMSNormGated: rms_norm(x) * weight * act(gate), act in fp32, rounded where the module
// rounds: the normed x to x's dtype, weight * normed in their promoted dtype (x's where `round_weighted`), the
// result to x's dtype.
template <typename T>
void gated_norm_rows(const T* x, const T* gate, const float* weight, T* out, int64_t rows, int64_t dim, float eps,
                     bool silu, bool round_weighted) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> xr(static_cast<size_t>(dim)), gr(static_cast<size_t>(dim));
    for (int64_t r = r0; r < r1; ++r) {
      widen_row(x + r * dim, xr.data(), dim);
      widen_row(gate + r * dim, gr.data(), dim);
      const float s = rms_scale(xr.data(), dim, eps);
      if (silu) {
        silu_row(gr.data(), dim);
      } else {
        sigmoid_row(gr.data(), dim);
      }
      T* o = out + r * dim;
      for (int64_t d = 0; d < dim; ++d) {
        float weighted = static_cast<float>(static_cast<T>(xr[d] * s)) * weight[d];
        if (round_weighted) weighted = static_cast<float>(static_cast<T>(weighted));
        o[d] = static_cast<T>(weighted * gr[d]);
      }
    }
  });
}

Tensor gdn_gated_rms_norm_cpu(const Tensor& x, const Tensor& gate, const Tensor& weight, double eps,
                              c10::string_view activation) {
  check_on_device("gdn_gated_rms_norm", at::kCPU, {{"x", &x}, {"gate", &gate}, {"weight", &weight}});
  const GdnRowsSizes sz = check_gdn_gated_rms_norm_args(x, gate, weight, eps, activation);
  Tensor out = empty_on_cpu(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const Tensor xc = x.contiguous(), gc = gate.contiguous(), w = float_weight(weight);
  const bool silu = activation == "silu";
  const bool round_weighted = c10::promoteTypes(weight.scalar_type(), x.scalar_type()) == x.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "gdn_gated_rms_norm", [&] {
    gated_norm_rows<scalar_t>(xc.data_ptr<scalar_t>(), gc.data_ptr<scalar_t>(), w.data_ptr<float>(),
                              out.data_ptr<scalar_t>(), sz.rows, sz.dim, static_cast<float>(eps), silu, round_weighted);
  });
  return out;
}

}  // namespace
}  // namespace hebrus

TORCH_LIBRARY_IMPL(hebrus, CPU, m) {
  m.impl("gdn_delta_rule", &hebrus::gdn_delta_rule_cpu);
  m.impl("gdn_delta_rule_slots", &hebrus::gdn_delta_rule_slots_cpu);
  m.impl("gdn_gates", &hebrus::gdn_gates_cpu);
  m.impl("gdn_gated_rms_norm", &hebrus::gdn_gated_rms_norm_cpu);
}
