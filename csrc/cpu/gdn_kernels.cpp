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
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "gdn_checks.h"
#include "hebrus_check.h"
#include "op_checks.h"
#include "ple_slots_checks.h"

namespace hebrus {
namespace {

using at::Tensor;

constexpr const char* kOp = "hebrus_torch.gdn.gated_delta_rule";
constexpr float kL2Eps = 1e-6f;  // transformers' (and FLA's) l2norm epsilon

// x / sqrt(sum(x * x) + eps) * scale over n values, the sum in ascending order.
void normalise(float* x, int64_t n, bool l2, float scale) {
  float inv = 1.f;
  if (l2) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
    inv = 1.f / std::sqrt(ss + kL2Eps);
  }
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * inv * scale;
}

struct Rows {
  const float* q;  // [T, Hk, Dk]
  const float* k;
  const float* v;  // [T, Hv, Dv]
  const float* g;  // [T, Hv]
  const float* beta;
  float* state;  // [B, Hv, Dk, Dv], or the pool [S, Hv, Dk, Dv] of the slot form
  const int32_t* slots;  // the slot form: row b's state is state[slots[b]] (else state[b])
  float* out;    // [T, Hv, Dv]
  int64_t hk, hv, dk, dv;
  float scale;
  bool l2;
};

// Tokens [t0, t1) of one row through the state of value head h.
void run_head(const Rows& r, int64_t b, int64_t h, int64_t t0, int64_t t1, std::vector<float>& buf) {
  const int64_t dk = r.dk, dv = r.dv;
  const int64_t kh = h / (r.hv / r.hk);
  const int64_t row = r.slots != nullptr ? static_cast<int64_t>(r.slots[b]) : b;
  float* s = r.state + (row * r.hv + h) * dk * dv;
  float* qn = buf.data();
  float* kn = qn + dk;
  float* kv = kn + dk;     // [Dv]: sum_dk S * k, then delta
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t i = 0; i < dk; ++i) {
      qn[i] = r.q[(t * r.hk + kh) * dk + i];
      kn[i] = r.k[(t * r.hk + kh) * dk + i];
    }
    normalise(qn, dk, r.l2, r.scale);
    normalise(kn, dk, r.l2, 1.f);
    const float decay = std::exp(r.g[t * r.hv + h]);
    const float beta = r.beta[t * r.hv + h];
    const float* vt = r.v + (t * r.hv + h) * dv;
    float* ot = r.out + (t * r.hv + h) * dv;
    // S = S * decay; kv = sum_dk S[dk] * k[dk]
    for (int64_t j = 0; j < dv; ++j) kv[j] = 0.f;
    for (int64_t i = 0; i < dk; ++i) {
      float* row = s + i * dv;
      const float ki = kn[i];
      for (int64_t j = 0; j < dv; ++j) {
        row[j] = row[j] * decay;
        kv[j] = kv[j] + row[j] * ki;
      }
    }
    for (int64_t j = 0; j < dv; ++j) kv[j] = (vt[j] - kv[j]) * beta;
    // S = S + k (outer) delta; out = sum_dk S[dk] * q[dk]
    for (int64_t j = 0; j < dv; ++j) ot[j] = 0.f;
    for (int64_t i = 0; i < dk; ++i) {
      float* row = s + i * dv;
      const float ki = kn[i], qi = qn[i];
      for (int64_t j = 0; j < dv; ++j) {
        row[j] = row[j] + ki * kv[j];
        ot[j] = ot[j] + row[j] * qi;
      }
    }
  }
}

// Both ops, after their checks: row b's state at slots[b] (slots == nullptr: at b), updated in place.
Tensor run_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                      const int32_t* cu, Tensor& state, const int32_t* slots, const GdnSizes& sz, double scale,
                      bool use_qk_l2norm) {
  const Tensor qf = q.to(at::kFloat).contiguous(), kf = k.to(at::kFloat).contiguous();
  const Tensor vf = v.to(at::kFloat).contiguous(), gf = g.to(at::kFloat).contiguous();
  const Tensor bf = beta.to(at::kFloat).contiguous();
  Tensor out = at::empty({sz.total, sz.hv, sz.dv}, v.options().dtype(at::kFloat));
  Rows r{qf.data_ptr<float>(), kf.data_ptr<float>(), vf.data_ptr<float>(), gf.data_ptr<float>(),
         bf.data_ptr<float>(), state.data_ptr<float>(), slots, out.data_ptr<float>(), sz.hk, sz.hv, sz.dk, sz.dv,
         static_cast<float>(scale), use_qk_l2norm};
  const int64_t batch = sz.batch, hv = sz.hv, dk = sz.dk, dv = sz.dv;
  at::parallel_for(0, batch * hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(2 * dk + dv);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / hv, h = item % hv;
      if (cu[b + 1] > cu[b]) run_head(r, b, h, cu[b], cu[b + 1], buf);
    }
  });
  return v.scalar_type() == at::kFloat ? out : out.to(v.scalar_type());
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

}  // namespace
}  // namespace hebrus

TORCH_LIBRARY_IMPL(hebrus, CPU, m) {
  m.impl("gdn_delta_rule", &hebrus::gdn_delta_rule_cpu);
  m.impl("gdn_delta_rule_slots", &hebrus::gdn_delta_rule_slots_cpu);
}
