// CPU kernel of hebrus::gdn_delta_rule: the gated delta rule of the gated-delta-net (linear attention)
// layers over packed rows, in the recurrent form, each row's state updated in place.
// hebrus_torch/reference.py (gdn_delta_rule) is the spec; the checks mirror
// hebrus_torch/gdn/delta_rule.py (check_delta_rule_args) with the same messages.
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
#include <vector>

#include "hebrus_check.h"
#include "op_checks.h"

namespace hebrus {
namespace {

using at::Tensor;

constexpr const char* kOp = "hebrus_torch.gdn.gated_delta_rule";
constexpr float kL2Eps = 1e-6f;  // transformers' (and FLA's) l2norm epsilon

bool is_float_dtype(c10::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

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
  float* state;  // [B, Hv, Dk, Dv]
  float* out;    // [T, Hv, Dv]
  int64_t hk, hv, dk, dv;
  float scale;
  bool l2;
};

// Tokens [t0, t1) of one row through the state of value head h.
void run_head(const Rows& r, int64_t b, int64_t h, int64_t t0, int64_t t1, std::vector<float>& buf) {
  const int64_t dk = r.dk, dv = r.dv;
  const int64_t kh = h / (r.hv / r.hk);
  float* s = r.state + (b * r.hv + h) * dk * dv;
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

Tensor gdn_delta_rule_cpu(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                          const Tensor& cu_seqlens, Tensor& state, double scale, bool use_qk_l2norm) {
  check_on_device("gdn_delta_rule", at::kCPU,
                  {{"q", &q}, {"k", &k}, {"v", &v}, {"g", &g}, {"beta", &beta}, {"cu_seqlens", &cu_seqlens},
                   {"state", &state}});
  HEBRUS_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, HebrusError, kOp,
               ": q, k must be [T, Hk, Dk] and v [T, Hv, Dv], got ", shape_str(q.sizes()), ", ",
               shape_str(k.sizes()), ", ", shape_str(v.sizes()));
  const int64_t T = q.size(0), hk = q.size(1), dk = q.size(2), hv = v.size(1), dv = v.size(2);
  HEBRUS_CHECK(k.sizes() == q.sizes(), HebrusError, kOp, ": k must have q's shape ", shape_str(q.sizes()), ", got ",
               shape_str(k.sizes()));
  HEBRUS_CHECK(v.size(0) == T, HebrusError, kOp, ": v has ", v.size(0), " tokens, q has ", T);
  HEBRUS_CHECK(hk >= 1 && dk >= 1 && hv >= 1 && dv >= 1 && hv % hk == 0, HebrusError, kOp, ": value heads (", hv,
               ") must be a positive multiple of key heads (", hk, ")");
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"g", &g}, {"beta", &beta}})
    HEBRUS_CHECK(t->dim() == 2 && t->size(0) == T && t->size(1) == hv, HebrusError, kOp, ": ", name,
                 " must be [T, Hv] = (", T, ", ", hv, "), got ", shape_str(t->sizes()));
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"q", &q}, {"k", &k}, {"v", &v}, {"g", &g},
                                {"beta", &beta}})
    HEBRUS_CHECK(is_float_dtype(t->scalar_type()), HebrusError, kOp, ": ", name,
                 " must be float32, float16 or bfloat16, got ", dtype_name(t->scalar_type()));
  HEBRUS_CHECK(q.scalar_type() == k.scalar_type(), HebrusError, kOp, ": q and k must share a dtype, got ",
               dtype_name(q.scalar_type()), " and ", dtype_name(k.scalar_type()));
  HEBRUS_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.scalar_type() == at::kInt && cu_seqlens.size(0) >= 1,
               HebrusError, kOp, ": cu_seqlens must be a 1-D int32 tensor of B+1 >= 1 entries, got ",
               shape_str(cu_seqlens.sizes()), " ", dtype_name(cu_seqlens.scalar_type()));
  const int64_t batch = cu_seqlens.size(0) - 1;
  HEBRUS_CHECK(state.dim() == 4 && state.size(0) == batch && state.size(1) == hv && state.size(2) == dk &&
                   state.size(3) == dv && state.scalar_type() == at::kFloat && state.is_contiguous(),
               HebrusError, kOp, ": state must be a contiguous [B, Hv, Dk, Dv] = (", batch, ", ", hv, ", ", dk, ", ",
               dv, ") float32 tensor, got ", shape_str(state.sizes()), " ", dtype_name(state.scalar_type()));
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

  const Tensor qf = q.to(at::kFloat).contiguous(), kf = k.to(at::kFloat).contiguous();
  const Tensor vf = v.to(at::kFloat).contiguous(), gf = g.to(at::kFloat).contiguous();
  const Tensor bf = beta.to(at::kFloat).contiguous();
  Tensor out = at::empty({T, hv, dv}, v.options().dtype(at::kFloat));
  Rows r{qf.data_ptr<float>(), kf.data_ptr<float>(), vf.data_ptr<float>(), gf.data_ptr<float>(),
         bf.data_ptr<float>(), state.data_ptr<float>(), out.data_ptr<float>(), hk, hv, dk, dv,
         static_cast<float>(scale), use_qk_l2norm};
  at::parallel_for(0, batch * hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(2 * dk + dv);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / hv, h = item % hv;
      if (cu[b + 1] > cu[b]) run_head(r, b, h, cu[b], cu[b + 1], buf);
    }
  });
  return v.scalar_type() == at::kFloat ? out : out.to(v.scalar_type());
}

}  // namespace
}  // namespace hebrus

TORCH_LIBRARY_IMPL(hebrus, CPU, m) {
  m.impl("gdn_delta_rule", &hebrus::gdn_delta_rule_cpu);
}
