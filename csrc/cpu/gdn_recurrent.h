#pragma once
// The recurrent form of the gated delta rule for one (row, value head), shared by hebrus::gdn_delta_rule
// (gdn_kernels.cpp) and the partial chunks of hebrus::gdn_chunk_delta_rule_slots (gdn_chunk_kernels.cpp),
// so that both give the same bits: per token, every sum over Dk adds dk = 0, 1, ... in ascending order,
// one Dv column per element, with separate multiplies and adds (-ffp-contract=off). Plain C++ (not
// inside a target_clones function: the compiler may vectorise over Dv, which changes no bits).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "undispatched.h"

#include <cmath>
#include <cstdint>

namespace hebrus {
namespace gdn {

constexpr float kL2Eps = 1e-6f;  // transformers' (and FLA's) l2norm epsilon

// x / sqrt(sum(x * x) + eps) * scale over n values, the sum in ascending order.
inline void normalise(float* x, int64_t n, bool l2, float scale) {
  float inv = 1.f;
  if (l2) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
    inv = 1.f / std::sqrt(ss + kL2Eps);
  }
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * inv * scale;
}

// The packed fp32 inputs of one call: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; out [T, Hv, Dv].
struct Packed {
  const float* q;
  const float* k;
  const float* v;
  const float* g;
  const float* beta;
  float* out;
  int64_t hk, hv, dk, dv;
  float scale;
  bool l2;
};

// One call's inputs widened to contiguous fp32, its fp32 output [T, Hv, Dv], and the Packed view of
// them: both CPU kernels run on these, so their inputs round the same way.
struct PackedCall {
  at::Tensor q, k, v, g, beta, out;
  Packed r;

  PackedCall(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
             const at::Tensor& beta_in, int64_t hk, int64_t hv, int64_t dk, int64_t dv, double scale, bool l2)
      : q(as_dtype(q_in, at::kFloat).contiguous()), k(as_dtype(k_in, at::kFloat).contiguous()),
        v(as_dtype(v_in, at::kFloat).contiguous()), g(as_dtype(g_in, at::kFloat).contiguous()),
        beta(as_dtype(beta_in, at::kFloat).contiguous()),
        out(at::empty({q_in.size(0), hv, dv}, v_in.options().dtype(at::kFloat))),
        r{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>(),
          beta.data_ptr<float>(), out.data_ptr<float>(), hk, hv, dk, dv, static_cast<float>(scale), l2} {}

  // The op's result: the output in v's dtype (the one rounding of a 16-bit call).
  at::Tensor result(at::ScalarType v_dtype) const { return as_dtype(out, v_dtype); }
};

// Tokens [t0, t1) (packed indices) of value head h through its state s [Dk, Dv], updated in place.
// buf: 2 Dk + Dv floats of scratch.
inline void run_recurrent(const Packed& r, float* s, int64_t h, int64_t t0, int64_t t1, float* buf) {
  const int64_t dk = r.dk, dv = r.dv;
  const int64_t kh = h / (r.hv / r.hk);
  float* qn = buf;
  float* kn = qn + dk;
  float* kv = kn + dk;  // [Dv]: sum_dk S * k, then delta
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

}  // namespace gdn
}  // namespace hebrus
