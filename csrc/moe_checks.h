#pragma once
// Metadata checks of hebrus::moe_experts, shared by the CPU kernel (csrc/cpu/moe_kernels.cpp) and the
// MPS glue (csrc/mps/moe_experts.mm). Same order and messages as hebrus_torch/moe/checks.py
// (check_moe_experts). Expert ids are values: the CPU kernel checks them (check_moe_ids).
//
// Plain C++, header-only.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "hebrus_check.h"
#include "op_checks.h"

namespace hebrus {

struct MoeSizes {
  int64_t rows;     // T
  int64_t hidden;   // H
  int64_t top_k;    // k
  int64_t experts;  // E
  int64_t inter;    // I (gate_up has 2 I rows per expert)
};

// topk_ids [T, k] and topk_weights [T, k] against x [T, H] (both ops).
inline void check_moe_routing(const char* op, const at::Tensor& x, const at::Tensor& topk_ids,
                              const at::Tensor& topk_weights) {
  HEBRUS_CHECK(topk_ids.size(0) == x.size(0), HebrusError, "hebrus::", op,
               ": topk_ids must have shape (T, k) with T = x.shape[0] = ", x.size(0), ", got ",
               shape_str(topk_ids.sizes()));
  HEBRUS_CHECK(topk_weights.sizes() == topk_ids.sizes(), HebrusError, "hebrus::", op,
               ": topk_weights must have the shape of topk_ids ", shape_str(topk_ids.sizes()), ", got ",
               shape_str(topk_weights.sizes()));
}

inline MoeSizes check_moe_experts_args(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                       const at::Tensor& gate_up, const at::Tensor& down) {
  const char* op = "moe_experts";
  check_dims(op, x, 2, "x");
  check_float(op, x, "x");
  check_dims(op, topk_ids, 2, "topk_ids");
  HEBRUS_CHECK(topk_ids.scalar_type() == at::kLong || topk_ids.scalar_type() == at::kInt, HebrusError,
               "hebrus::moe_experts: topk_ids must have dtype torch.int64 or torch.int32, got ",
               dtype_name(topk_ids.scalar_type()));
  check_kinds(op, {{"topk_weights", &topk_weights, 2, kAnyFloat},
                   {"gate_up", &gate_up, 3, kAnyFloat},
                   {"down", &down, 3, kAnyFloat}});
  check_same_dtype(op, gate_up, "gate_up", x, "x");
  check_same_dtype(op, down, "down", x, "x");
  check_moe_routing(op, x, topk_ids, topk_weights);
  const int64_t T = x.size(0), H = x.size(1), k = topk_ids.size(1);
  const int64_t E = gate_up.size(0);
  HEBRUS_CHECK(E >= 1 && gate_up.size(2) == H && gate_up.size(1) % 2 == 0 && gate_up.size(1) >= 2, HebrusError,
               "hebrus::moe_experts: gate_up must have shape (E, 2 * I, H) with E >= 1, I >= 1 and H = x.shape[1] = ",
               H, ", got ", shape_str(gate_up.sizes()));
  const int64_t I = gate_up.size(1) / 2;
  HEBRUS_CHECK(down.size(0) == E && down.size(1) == H && down.size(2) == I, HebrusError,
               "hebrus::moe_experts: down must have shape (E, H, I) = (", E, ", ", H, ", ", I,
               ") to match gate_up, got ", shape_str(down.sizes()));
  return {T, H, k, E, I};
}

// bits (4 or 8), then group_size (32, 64 or 128): the first checks of every op over quantized weights.
inline void check_quant_options(const char* op, int64_t group_size, int64_t bits) {
  HEBRUS_CHECK(bits == 4 || bits == 8, HebrusError, "hebrus::", op, ": bits must be 4 or 8, got ", bits);
  HEBRUS_CHECK(group_size == 32 || group_size == 64 || group_size == 128, HebrusError, "hebrus::", op,
               ": group_size must be 32, 64 or 128, got ", group_size);
}

// The quantized MoE ops' first checks: check_quant_options, then x 2-D and float.
inline void check_quant_format(const char* op, const at::Tensor& x, int64_t group_size, int64_t bits) {
  check_quant_options(op, group_size, bits);
  check_dims(op, x, 2, "x");
  check_float(op, x, "x");
}

// hebrus::moe_experts_quantized: the experts as packed int32 codes with per-group scales and biases in x's
// dtype (hebrus_torch/moe/quantize.py); H and I multiples of group_size.
inline MoeSizes check_moe_experts_quantized_args(const at::Tensor& x, const at::Tensor& topk_ids,
                                                 const at::Tensor& topk_weights, const at::Tensor& gate_up_q,
                                                 const at::Tensor& gate_up_scales, const at::Tensor& gate_up_biases,
                                                 const at::Tensor& down_q, const at::Tensor& down_scales,
                                                 const at::Tensor& down_biases, int64_t group_size, int64_t bits) {
  const char* op = "moe_experts_quantized";
  const char* pre = "hebrus::moe_experts_quantized: ";
  check_quant_format(op, x, group_size, bits);
  check_dims(op, topk_ids, 2, "topk_ids");
  HEBRUS_CHECK(topk_ids.scalar_type() == at::kLong || topk_ids.scalar_type() == at::kInt, HebrusError, pre,
               "topk_ids must have dtype torch.int64 or torch.int32, got ", dtype_name(topk_ids.scalar_type()));
  check_kinds(op, {{"topk_weights", &topk_weights, 2, kAnyFloat},
                   {"gate_up_q", &gate_up_q, 3, at::kInt},
                   {"down_q", &down_q, 3, at::kInt}});
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"gate_up_scales", &gate_up_scales},
                                {"gate_up_biases", &gate_up_biases}, {"down_scales", &down_scales},
                                {"down_biases", &down_biases}}) {
    check_dims(op, *t, 3, name);
    check_same_dtype(op, *t, name, x, "x");
  }
  check_moe_routing(op, x, topk_ids, topk_weights);
  const int64_t T = x.size(0), H = x.size(1), k = topk_ids.size(1);
  HEBRUS_CHECK(H % group_size == 0, HebrusError, pre, "H = x.shape[1] = ", H, " must be a multiple of group_size ",
               group_size);
  const int64_t E = gate_up_q.size(0), per_word = 32 / bits;
  HEBRUS_CHECK(E >= 1 && gate_up_q.size(1) >= 2 && gate_up_q.size(1) % 2 == 0 && gate_up_q.size(2) * per_word == H,
               HebrusError, pre, "gate_up_q must have shape (E, 2 * I, H * bits / 32) with E >= 1, I >= 1 and H = ", H,
               ", got ", shape_str(gate_up_q.sizes()));
  const int64_t I = gate_up_q.size(1) / 2;
  HEBRUS_CHECK(I % group_size == 0, HebrusError, pre, "I = ", I, " must be a multiple of group_size ", group_size);
  HEBRUS_CHECK(down_q.size(0) == E && down_q.size(1) == H && down_q.size(2) == I / per_word, HebrusError, pre,
               "down_q must have shape (E, H, I * bits / 32) = (", E, ", ", H, ", ", I / per_word, "), got ",
               shape_str(down_q.sizes()));
  const struct {
    const char* name;
    const at::Tensor* t;
    int64_t rows, groups;
  } tables[] = {{"gate_up_scales", &gate_up_scales, 2 * I, H / group_size},
                {"gate_up_biases", &gate_up_biases, 2 * I, H / group_size},
                {"down_scales", &down_scales, H, I / group_size},
                {"down_biases", &down_biases, H, I / group_size}};
  for (const auto& tb : tables) {
    HEBRUS_CHECK(tb.t->size(0) == E && tb.t->size(1) == tb.rows && tb.t->size(2) == tb.groups, HebrusError, pre,
                 tb.name, " must have shape (", E, ", ", tb.rows, ", ", tb.groups, "), got ", shape_str(tb.t->sizes()));
  }
  return {T, H, k, E, I};
}

// hebrus::quantized_linear: x [T, in] times the transpose of an affine-quantized W [out, in] (packed codes
// wq [out, in * bits / 32] int32, scales / biases [out, in / group_size] in x's dtype). Returns {T, in, out}.
struct QuantLinearSizes {
  int64_t rows, in, out;
};

inline QuantLinearSizes check_quantized_linear_args(const at::Tensor& x, const at::Tensor& wq,
                                                    const at::Tensor& scales, const at::Tensor& biases,
                                                    int64_t group_size, int64_t bits) {
  const char* op = "quantized_linear";
  const char* pre = "hebrus::quantized_linear: ";
  check_quant_format(op, x, group_size, bits);
  check_kinds(op, {{"wq", &wq, 2, at::kInt}});
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"scales", &scales}, {"biases", &biases}}) {
    check_dims(op, *t, 2, name);
    check_same_dtype(op, *t, name, x, "x");
  }
  const int64_t T = x.size(0), in = x.size(1), out = wq.size(0);
  HEBRUS_CHECK(in % group_size == 0, HebrusError, pre, "in = x.shape[1] = ", in, " must be a multiple of group_size ",
               group_size);
  HEBRUS_CHECK(wq.size(1) * (32 / bits) == in, HebrusError, pre,
               "wq must have shape (out, in * bits / 32) with in = ", in, ", got ", shape_str(wq.sizes()));
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"scales", &scales}, {"biases", &biases}}) {
    HEBRUS_CHECK(t->size(0) == out && t->size(1) == in / group_size, HebrusError, pre, name, " must have shape (",
                 out, ", ", in / group_size, "), got ", shape_str(t->sizes()));
  }
  return {T, in, out};
}

// hebrus::moe_route (issue 37): router_logits [T, E] float, shared_gate_logits [T, S] in its dtype (or none),
// 1 <= top_k <= E. Same order and messages as hebrus_torch/moe/checks.py (check_moe_route).
struct MoeRouteSizes {
  int64_t rows, experts, top_k, shared;  // T, E, k, S (0 without shared_gate_logits)
};

inline MoeRouteSizes check_moe_route_args(const at::Tensor& logits, const at::Tensor* shared, int64_t top_k) {
  const char* op = "moe_route";
  check_dims(op, logits, 2, "router_logits");
  check_float(op, logits, "router_logits");
  const int64_t T = logits.size(0), E = logits.size(1);
  int64_t S = 0;
  if (shared != nullptr) {
    check_dims(op, *shared, 2, "shared_gate_logits");
    check_same_dtype(op, *shared, "shared_gate_logits", logits, "router_logits");
    HEBRUS_CHECK(shared->size(0) == T, HebrusError, "hebrus::moe_route: shared_gate_logits must have shape (T, S) "
                 "with T = router_logits.shape[0] = ", T, ", got ", shape_str(shared->sizes()));
    S = shared->size(1);
  }
  HEBRUS_CHECK(top_k >= 1 && top_k <= E, HebrusError, "hebrus::moe_route: top_k must be in [1, E = ", E, "], got ",
               top_k);
  return {T, E, top_k, S};
}

// 2-D tensors of the shapes the checks derived, in order: "hebrus::<op>: <name> must have shape (r, c), got ...".
struct ShapeWant {
  const char* name;
  const at::Tensor* t;
  int64_t rows, cols;
};

inline void check_shapes_2d(const char* op, std::initializer_list<ShapeWant> wants) {
  for (const auto& w : wants) {
    HEBRUS_CHECK(w.t->size(0) == w.rows && w.t->size(1) == w.cols, HebrusError, "hebrus::", op, ": ", w.name,
                 " must have shape (", w.rows, ", ", w.cols, "), got ", shape_str(w.t->sizes()));
  }
}

// hebrus::moe_shared_expert (issue 37): x [T, H] float; routed [T, H], gate_proj / up_proj [I, H], down_proj
// [H, I] and gate [T, 1], all in x's dtype; I >= 1. Same order and messages as hebrus_torch/moe/checks.py
// (check_moe_shared_expert).
struct MoeSharedSizes {
  int64_t rows, hidden, inter;  // T, H, I
};

inline MoeSharedSizes check_moe_shared_expert_args(const at::Tensor& x, const at::Tensor& routed,
                                                   const at::Tensor& gate_proj, const at::Tensor& up_proj,
                                                   const at::Tensor& down_proj, const at::Tensor& gate) {
  const char* op = "moe_shared_expert";
  check_dims(op, x, 2, "x");
  check_float(op, x, "x");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"routed", &routed}, {"gate_proj", &gate_proj},
                                {"up_proj", &up_proj}, {"down_proj", &down_proj}, {"gate", &gate}}) {
    check_dims(op, *t, 2, name);
    check_same_dtype(op, *t, name, x, "x");
  }
  const int64_t T = x.size(0), H = x.size(1), I = gate_proj.size(0);
  HEBRUS_CHECK(I >= 1, HebrusError, "hebrus::moe_shared_expert: gate_proj must have I >= 1 rows, got shape ",
               shape_str(gate_proj.sizes()));
  check_shapes_2d(op, {{"routed", &routed, T, H}, {"gate_proj", &gate_proj, I, H}, {"up_proj", &up_proj, I, H},
                       {"down_proj", &down_proj, H, I}, {"gate", &gate, T, 1}});
  return {T, H, I};
}

// hebrus::moe_shared_expert_quantized (issue 37): moe_shared_expert with its three projections affine-quantized
// (hebrus_torch/moe/quantize.py; one bits / group_size for all three): <proj>_q [out, in * bits / 32] int32,
// <proj>_scales / <proj>_biases [out, in / group_size] in x's dtype, gate_proj / up_proj [I, H], down_proj
// [H, I]; H and I multiples of group_size. Same order and messages as hebrus_torch/moe/checks.py
// (check_moe_shared_expert_quantized).
inline MoeSharedSizes check_moe_shared_expert_quantized_args(
    const at::Tensor& x, const at::Tensor& routed, const at::Tensor& gate_proj_q, const at::Tensor& gate_proj_scales,
    const at::Tensor& gate_proj_biases, const at::Tensor& up_proj_q, const at::Tensor& up_proj_scales,
    const at::Tensor& up_proj_biases, const at::Tensor& down_proj_q, const at::Tensor& down_proj_scales,
    const at::Tensor& down_proj_biases, const at::Tensor& gate, int64_t group_size, int64_t bits) {
  const char* op = "moe_shared_expert_quantized";
  const char* pre = "hebrus::moe_shared_expert_quantized: ";
  check_quant_format(op, x, group_size, bits);
  check_kinds(op, {{"gate_proj_q", &gate_proj_q, 2, at::kInt},
                   {"up_proj_q", &up_proj_q, 2, at::kInt},
                   {"down_proj_q", &down_proj_q, 2, at::kInt}});
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"routed", &routed},
                                {"gate_proj_scales", &gate_proj_scales}, {"gate_proj_biases", &gate_proj_biases},
                                {"up_proj_scales", &up_proj_scales}, {"up_proj_biases", &up_proj_biases},
                                {"down_proj_scales", &down_proj_scales}, {"down_proj_biases", &down_proj_biases},
                                {"gate", &gate}}) {
    check_dims(op, *t, 2, name);
    check_same_dtype(op, *t, name, x, "x");
  }
  const int64_t T = x.size(0), H = x.size(1), I = gate_proj_q.size(0), per_word = 32 / bits;
  HEBRUS_CHECK(I >= 1, HebrusError, pre, "gate_proj_q must have I >= 1 rows, got shape ",
               shape_str(gate_proj_q.sizes()));
  HEBRUS_CHECK(H % group_size == 0, HebrusError, pre, "H = x.shape[1] = ", H, " must be a multiple of group_size ",
               group_size);
  HEBRUS_CHECK(I % group_size == 0, HebrusError, pre, "I = gate_proj_q.shape[0] = ", I,
               " must be a multiple of group_size ", group_size);
  const int64_t hg = H / group_size, ig = I / group_size;
  check_shapes_2d(op, {{"routed", &routed, T, H},
                       {"gate_proj_q", &gate_proj_q, I, H / per_word},
                       {"gate_proj_scales", &gate_proj_scales, I, hg},
                       {"gate_proj_biases", &gate_proj_biases, I, hg},
                       {"up_proj_q", &up_proj_q, I, H / per_word},
                       {"up_proj_scales", &up_proj_scales, I, hg},
                       {"up_proj_biases", &up_proj_biases, I, hg},
                       {"down_proj_q", &down_proj_q, H, I / per_word},
                       {"down_proj_scales", &down_proj_scales, H, ig},
                       {"down_proj_biases", &down_proj_biases, H, ig},
                       {"gate", &gate, T, 1}});
  return {T, H, I};
}

}  // namespace hebrus
