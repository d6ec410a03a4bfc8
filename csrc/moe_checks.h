#pragma once
// Metadata checks of hebrus::moe_experts, shared by the CPU kernel (csrc/cpu/moe_kernels.cpp) and the
// MPS glue (csrc/mps/moe_experts.mm). Same order and messages as hebrus_torch/moe/checks.py
// (check_moe_experts). Expert ids are values: the CPU kernel checks them (check_moe_ids).
//
// Plain C++, header-only.
#include <ATen/core/Tensor.h>

#include <cstdint>

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
  const int64_t T = x.size(0), H = x.size(1), k = topk_ids.size(1);
  HEBRUS_CHECK(topk_ids.size(0) == T, HebrusError, "hebrus::moe_experts: topk_ids must have shape (T, k) with T = ",
               "x.shape[0] = ", T, ", got ", shape_str(topk_ids.sizes()));
  HEBRUS_CHECK(topk_weights.sizes() == topk_ids.sizes(), HebrusError,
               "hebrus::moe_experts: topk_weights must have the shape of topk_ids ", shape_str(topk_ids.sizes()),
               ", got ", shape_str(topk_weights.sizes()));
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

}  // namespace hebrus
