#pragma once
// Metadata checks of the gated delta rule ops (hebrus::gdn_delta_rule, hebrus::gdn_delta_rule_slots,
// hebrus::gdn_chunk_delta_rule_slots), shared by the CPU kernels (csrc/cpu/gdn_kernels.cpp,
// gdn_chunk_kernels.cpp) and the MPS glue (csrc/mps/hebrus_glue.h). Same order and messages as
// hebrus_torch/gdn/delta_rule.py (check_delta_rule_args for the plain op, check_delta_rule_slots_args
// for the slot form) and hebrus_torch/_validate.py (gdn_chunk_delta_rule_slots). Values (cu_seqlens,
// start positions, slot ids) are not read here.
//
// Plain C++, header-only.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

#include "hebrus_check.h"
#include "op_checks.h"

namespace hebrus {

struct GdnSizes {
  int64_t total;  // T
  int64_t hk, dk, hv, dv;
  int64_t batch;  // B
  int64_t pool;   // S (the slot form; B for the plain op)
};

// q, k, v, g, beta, cu_seqlens: the checks both ops share, with message prefix `pre`
// ("hebrus_torch.gdn.gated_delta_rule" for the plain op, "hebrus::gdn_delta_rule_slots").
inline GdnSizes check_gdn_inputs(const char* pre, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& g, const at::Tensor& beta, const at::Tensor& cu_seqlens) {
  HEBRUS_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, HebrusError, pre,
               ": q, k must be [T, Hk, Dk] and v [T, Hv, Dv], got ", shape_str(q.sizes()), ", ",
               shape_str(k.sizes()), ", ", shape_str(v.sizes()));
  const int64_t T = q.size(0), hk = q.size(1), dk = q.size(2), hv = v.size(1), dv = v.size(2);
  HEBRUS_CHECK(k.sizes() == q.sizes(), HebrusError, pre, ": k must have q's shape ", shape_str(q.sizes()), ", got ",
               shape_str(k.sizes()));
  HEBRUS_CHECK(v.size(0) == T, HebrusError, pre, ": v has ", v.size(0), " tokens, q has ", T);
  HEBRUS_CHECK(hk >= 1 && dk >= 1 && hv >= 1 && dv >= 1 && hv % hk == 0, HebrusError, pre, ": value heads (", hv,
               ") must be a positive multiple of key heads (", hk, ")");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"g", &g}, {"beta", &beta}})
    HEBRUS_CHECK(t->dim() == 2 && t->size(0) == T && t->size(1) == hv, HebrusError, pre, ": ", name,
                 " must be [T, Hv] = (", T, ", ", hv, "), got ", shape_str(t->sizes()));
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"q", &q}, {"k", &k}, {"v", &v}, {"g", &g},
                                {"beta", &beta}})
    HEBRUS_CHECK(is_float_dtype(t->scalar_type()), HebrusError, pre, ": ", name,
                 " must be float32, float16 or bfloat16, got ", dtype_name(t->scalar_type()));
  HEBRUS_CHECK(q.scalar_type() == k.scalar_type(), HebrusError, pre, ": q and k must share a dtype, got ",
               dtype_name(q.scalar_type()), " and ", dtype_name(k.scalar_type()));
  HEBRUS_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.scalar_type() == at::kInt && cu_seqlens.size(0) >= 1,
               HebrusError, pre, ": cu_seqlens must be a 1-D int32 tensor of B+1 >= 1 entries, got ",
               shape_str(cu_seqlens.sizes()), " ", dtype_name(cu_seqlens.scalar_type()));
  return {T, hk, dk, hv, dv, cu_seqlens.size(0) - 1, cu_seqlens.size(0) - 1};
}

// hebrus::gdn_delta_rule: state [B, Hv, Dk, Dv] float32, contiguous (updated in place).
inline GdnSizes check_gdn_delta_rule_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const at::Tensor& g, const at::Tensor& beta, const at::Tensor& cu_seqlens,
                                          const at::Tensor& state) {
  const char* pre = "hebrus_torch.gdn.gated_delta_rule";
  const GdnSizes sz = check_gdn_inputs(pre, q, k, v, g, beta, cu_seqlens);
  HEBRUS_CHECK(state.dim() == 4 && state.size(0) == sz.batch && state.size(1) == sz.hv && state.size(2) == sz.dk &&
                   state.size(3) == sz.dv && state.scalar_type() == at::kFloat && state.is_contiguous(),
               HebrusError, pre, ": state must be a contiguous [B, Hv, Dk, Dv] = (", sz.batch, ", ", sz.hv, ", ",
               sz.dk, ", ", sz.dv, ") float32 tensor, got ", shape_str(state.sizes()), " ",
               dtype_name(state.scalar_type()));
  return sz;
}

// hebrus::gdn_delta_rule_slots: state_pool [S, Hv, Dk, Dv] float32, contiguous, sharing no memory with
// an input (updated in place); slots [B] int32.
inline GdnSizes check_gdn_delta_rule_slots_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const at::Tensor& g, const at::Tensor& beta,
                                                const at::Tensor& cu_seqlens, const at::Tensor& state_pool,
                                                const at::Tensor& slots) {
  const char* op = "gdn_delta_rule_slots";
  GdnSizes sz = check_gdn_inputs("hebrus::gdn_delta_rule_slots", q, k, v, g, beta, cu_seqlens);
  check_slots_meta(op, slots, sz.batch);
  HEBRUS_CHECK(state_pool.dim() == 4 && state_pool.size(1) == sz.hv && state_pool.size(2) == sz.dk &&
                   state_pool.size(3) == sz.dv && state_pool.scalar_type() == at::kFloat,
               HebrusError, "hebrus::", op, ": state_pool must be a [S, Hv, Dk, Dv] = (S, ", sz.hv, ", ", sz.dk, ", ",
               sz.dv, ") float32 tensor, got ", shape_str(state_pool.sizes()), " ",
               dtype_name(state_pool.scalar_type()));
  check_pool_writable(op, state_pool, "state_pool",
                      {{"q", &q}, {"k", &k}, {"v", &v}, {"g", &g}, {"beta", &beta}, {"cu_seqlens", &cu_seqlens},
                       {"slots", &slots}});
  sz.pool = state_pool.size(0);
  return sz;
}

// hebrus::gdn_chunk_delta_rule_slots: the checks of hebrus_torch/_validate.py's gdn_chunk_delta_rule_slots
// (their own order and messages: "hebrus::gdn_chunk_delta_rule_slots: ..."); start_pos [B] int64,
// state_pool [S, Hv, Dk, Dv] float32 written in place, slots [B] int32.
inline GdnSizes check_gdn_chunk_delta_rule_slots_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      const at::Tensor& g, const at::Tensor& beta,
                                                      const at::Tensor& cu_seqlens, const at::Tensor& start_pos,
                                                      const at::Tensor& state_pool, const at::Tensor& slots) {
  const char* op = "gdn_chunk_delta_rule_slots";
  check_dims(op, q, 3, "q");
  check_dims(op, k, 3, "k");
  check_dims(op, v, 3, "v");
  check_dims(op, g, 2, "g");
  check_dims(op, beta, 2, "beta");
  check_float(op, q, "q");
  check_float(op, v, "v");
  check_float(op, g, "g");
  check_float(op, beta, "beta");
  check_same_dtype(op, k, "k", q, "q");
  const int64_t T = q.size(0), hk = q.size(1), dk = q.size(2), hv = v.size(1), dv = v.size(2);
  HEBRUS_CHECK(k.sizes() == q.sizes(), HebrusError, "hebrus::", op, ": k must have q's shape ", shape_str(q.sizes()),
               ", got ", shape_str(k.sizes()));
  HEBRUS_CHECK(v.size(0) == T, HebrusError, "hebrus::", op, ": v has ", v.size(0), " tokens, q has ", T);
  HEBRUS_CHECK(hk >= 1 && dk >= 1 && hv >= 1 && dv >= 1 && hv % hk == 0, HebrusError, "hebrus::", op,
               ": value heads (", hv, ") must be a positive multiple of key heads (", hk, "), with Dk, Dv >= 1");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"g", &g}, {"beta", &beta}})
    HEBRUS_CHECK(t->size(0) == T && t->size(1) == hv, HebrusError, "hebrus::", op, ": ", name,
                 " must have shape (T, Hv) = (", T, ", ", hv, "), got ", shape_str(t->sizes()));
  const int64_t batch = check_cu_meta(op, cu_seqlens);
  check_dims(op, start_pos, 1, "start_pos");
  check_dtype(op, start_pos, at::kLong, "start_pos");
  HEBRUS_CHECK(start_pos.size(0) == batch, HebrusError, "hebrus::", op,
               ": start_pos must have one entry per row (B = ", batch, "), got ", start_pos.size(0));
  check_slots_meta(op, slots, batch);
  check_dims(op, state_pool, 4, "state_pool");
  check_dtype(op, state_pool, at::kFloat, "state_pool");
  HEBRUS_CHECK(state_pool.size(1) == hv && state_pool.size(2) == dk && state_pool.size(3) == dv, HebrusError,
               "hebrus::", op, ": state_pool must have shape (S, Hv, Dk, Dv) = (S, ", hv, ", ", dk, ", ", dv,
               "), got ", shape_str(state_pool.sizes()));
  check_pool_writable(op, state_pool, "state_pool",
                      {{"q", &q}, {"k", &k}, {"v", &v}, {"g", &g}, {"beta", &beta}, {"cu_seqlens", &cu_seqlens},
                       {"start_pos", &start_pos}, {"slots", &slots}});
  return {T, hk, dk, hv, dv, batch, state_pool.size(0)};
}

}  // namespace hebrus
