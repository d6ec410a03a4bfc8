#pragma once
// Metadata and host value checks of the slot-indexed PLE ops (hebrus::ple_ngram_ids_slots,
// hebrus::ple_conv_slots), shared by the CPU kernels and any device glue. Same order and messages
// as hebrus_torch/_validate.py (ple_ngram_ids_slots, ple_conv_slots). The pool is written in place,
// so it must be contiguous and share no memory with the inputs; the slots are distinct (two rows
// writing one slot would race) and inside the pool.
//
// Plain C++, header-only.
#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <string>
#include <vector>

#include "hebrus_check.h"
#include "op_checks.h"

namespace hebrus {

// slots: 1-D int32 with B entries.
inline void check_slots_meta(const char* op, const at::Tensor& slots, int64_t batch) {
  check_dims(op, slots, 1, "slots");
  check_dtype(op, slots, at::kInt, "slots");
  HEBRUS_CHECK(slots.size(0) == batch, HebrusError, "hebrus::", op, ": slots must have one entry per row (B = ", batch,
               "), got ", slots.size(0));
}

// pool is written in place: contiguous, and no input may share its memory.
inline void check_pool_writable(const char* op, const at::Tensor& pool, const char* pool_name,
                                std::initializer_list<std::pair<const char*, const at::Tensor*>> inputs) {
  HEBRUS_CHECK(pool.is_contiguous(), HebrusError, "hebrus::", op, ": ", pool_name,
               " must be contiguous (it is updated in place)");
  for (const auto& [name, t] : inputs) {
    HEBRUS_CHECK(!may_overlap(pool, *t), HebrusError, "hebrus::", op, ": ", pool_name, " shares memory with ", name,
                 "; the pool is written in place and must not overlap the inputs");
  }
}

// Slot values, read on the host: every slot in [0, S), no slot twice. Returns the contiguous host copy.
inline at::Tensor check_slot_values(const char* op, const at::Tensor& slots, int64_t pool_slots) {
  at::Tensor s = slots.is_cpu() ? slots.contiguous() : slots.to(at::kCPU).contiguous();
  const int32_t* p = s.data_ptr<int32_t>();
  const int64_t batch = s.size(0);
  std::vector<int64_t> first(static_cast<size_t>(pool_slots), -1);
  for (int64_t row = 0; row < batch; ++row) {
    HEBRUS_CHECK(p[row] >= 0 && p[row] < pool_slots, HebrusError, "hebrus::", op, ": slots[", row, "] = ", p[row],
                 " is outside [0, S=", pool_slots, ")");
    int64_t& seen = first[static_cast<size_t>(p[row])];
    HEBRUS_CHECK(seen < 0, HebrusError, "hebrus::", op, ": slot ", p[row], " appears twice in one batch (rows ", seen,
                 " and ", row, "); each row updates its slot in place");
    seen = row;
  }
  return s;
}

struct PleConvSlotsSizes {
  int64_t batch;      // B
  int64_t total;      // T
  int64_t channels;   // C
  int64_t width;      // K
  int64_t state_len;  // (K-1)*dilation
  int64_t pool;       // S
  bool silu;
};

inline PleConvSlotsSizes check_ple_conv_slots_args(const at::Tensor& x, const at::Tensor& weight,
                                                   const at::Tensor& cu_seqlens, const at::Tensor& state_pool,
                                                   const at::Tensor& slots, int64_t dilation,
                                                   c10::string_view activation) {
  const char* op = "ple_conv_slots";
  check_dims(op, x, 2, "x");
  check_dims(op, weight, 2, "weight");
  check_dims(op, state_pool, 3, "state_pool");
  check_float(op, x, "x");
  check_same_dtype(op, weight, "weight", x, "x");
  check_same_dtype(op, state_pool, "state_pool", x, "x");
  const int64_t batch = check_cu_meta(op, cu_seqlens);
  check_slots_meta(op, slots, batch);
  HEBRUS_CHECK(dilation >= 1, HebrusError, "hebrus::", op, ": dilation must be >= 1, got ", dilation);
  const bool silu = activation == "silu";
  HEBRUS_CHECK(silu || activation == "none", HebrusError, "hebrus::", op,
               ": activation must be one of ('silu', 'none'), got '", std::string(activation), "'");
  const int64_t channels = x.size(1), width = weight.size(1);
  HEBRUS_CHECK(weight.size(0) == channels && width >= 1, HebrusError, "hebrus::", op,
               ": weight must have shape (C, K) with C = ", channels, " and K >= 1, got ", shape_str(weight.sizes()));
  int64_t state_len = 0;
  const bool len_ok = !__builtin_mul_overflow(width - 1, dilation, &state_len);
  HEBRUS_CHECK(len_ok && state_pool.size(1) == state_len && state_pool.size(2) == channels, HebrusError, "hebrus::",
               op, ": state_pool must have shape (S, (K-1)*dilation, C) = (S, ",
               len_ok ? std::to_string(state_len) : std::to_string(width - 1) + "*" + std::to_string(dilation), ", ",
               channels, "), got ", shape_str(state_pool.sizes()));
  check_pool_writable(op, state_pool, "state_pool",
                      {{"x", &x}, {"weight", &weight}, {"cu_seqlens", &cu_seqlens}, {"slots", &slots}});
  return {batch, x.size(0), channels, width, state_len, state_pool.size(0), silu};
}

struct PleNgramIdsSlotsSizes {
  int64_t batch, n, ctx, heads, total, pool;
};

inline PleNgramIdsSlotsSizes check_ple_ngram_ids_slots_args(const at::Tensor& tokens, const at::Tensor& cu_seqlens,
                                                            const at::Tensor& history_pool, const at::Tensor& slots,
                                                            const at::Tensor& multipliers,
                                                            const at::Tensor& vocab_sizes, const at::Tensor& offsets,
                                                            int64_t vocab) {
  const char* op = "ple_ngram_ids_slots";
  check_dtype(op, tokens, at::kLong, "tokens");
  check_dtype(op, history_pool, at::kLong, "history_pool");
  check_dtype(op, multipliers, at::kLong, "multipliers");
  check_dtype(op, vocab_sizes, at::kLong, "vocab_sizes");
  check_dtype(op, offsets, at::kLong, "offsets");
  check_dims(op, tokens, 1, "tokens");
  check_dims(op, multipliers, 1, "multipliers");
  check_dims(op, vocab_sizes, 1, "vocab_sizes");
  check_dims(op, offsets, 1, "offsets");
  check_dims(op, history_pool, 2, "history_pool");
  const int64_t batch = check_cu_meta(op, cu_seqlens);
  check_slots_meta(op, slots, batch);
  const int64_t n = multipliers.size(0);
  HEBRUS_CHECK(n >= 2, HebrusError, "hebrus::", op, ": multipliers must have N >= 2 entries (ngram_size), got ", n);
  const int64_t ctx = n - 1;
  const int64_t heads = vocab_sizes.size(0);
  HEBRUS_CHECK(heads >= ctx && heads % ctx == 0, HebrusError, "hebrus::", op,
               ": vocab_sizes must have (N-1)*H entries for N=", n, ", got ", heads);
  HEBRUS_CHECK(offsets.size(0) == heads, HebrusError, "hebrus::", op, ": offsets must have ", heads,
               " entries like vocab_sizes, got ", offsets.size(0));
  HEBRUS_CHECK(history_pool.size(1) == ctx, HebrusError, "hebrus::", op, ": history_pool must have shape (S, N-1) = (S, ",
               ctx, "), got ", shape_str(history_pool.sizes()));
  HEBRUS_CHECK(vocab > 0, HebrusError, "hebrus::", op, ": vocab must be positive, got ", vocab);
  check_pool_writable(op, history_pool, "history_pool",
                      {{"tokens", &tokens}, {"cu_seqlens", &cu_seqlens}, {"slots", &slots},
                       {"multipliers", &multipliers}, {"vocab_sizes", &vocab_sizes}, {"offsets", &offsets}});
  return {batch, n, ctx, heads, tokens.size(0), history_pool.size(0)};
}

}  // namespace hebrus
