#pragma once
// Device-independent metadata checks of the hebrus ops, shared by the CPU kernels (csrc/cpu/*.cpp)
// and the MPS glue (csrc/mps/*.mm). Each check_<op>_args checks dims, dtypes, shapes and scalar
// arguments in the order and with the messages of hebrus_torch/_validate.py, and returns the sizes
// its callers need. What stays with each backend: the device check (run before these), limits of
// that backend (CPU scratch sizes, MPS launch plans), and value checks that read tensor data
// (check_cu_values, check_slot_values: the CPU kernels' only).
//
// A slot form (ple_conv_slots, ple_ngram_ids_slots, gdn_*_slots) is its plain op's checks with the
// slots [B] int32 checked after cu_seqlens and the state pool [S, ...] written in place: contiguous and
// sharing no memory with an input. The slot ids are distinct (two rows writing one slot would race)
// and inside the pool.
//
// Plain C++ (no Objective-C), header-only: the .mm files also type-check as C++ on Linux.
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "hebrus_check.h"

namespace hebrus {

// ---- generic checks ---------------------------------------------------------------------------------

// Every tensor on the device of the kernel that runs (a mix is dispatched by the first tensor's
// device, so the kernel is where the mismatch is seen); worded as _validate.py words it.
inline void check_on_device(const char* op, c10::DeviceType want,
                            std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
  const auto& first = *tensors.begin();
  for (const auto& [name, t] : tensors) {
    HEBRUS_CHECK(t->device().type() == want, HebrusError, "hebrus::", op, ": all tensors must be on one device; ",
                 first.first, " is on ", first.second->device().str(), ", ", name, " is on ", t->device().str());
  }
}

// cu_seqlens values: 0 first, non-decreasing, T last. Returns the contiguous host copy it read (on
// MPS the error path and B == 0 check here, where no kernel thread looks).
inline at::Tensor check_cu_values(const char* op, const at::Tensor& cu_seqlens, int64_t total) {
  // (is_cpu first: Tensor::to is a dispatched op even where it returns its input.)
  at::Tensor cu = cu_seqlens.is_cpu() ? cu_seqlens.contiguous() : cu_seqlens.to(at::kCPU).contiguous();
  const int32_t* p = cu.data_ptr<int32_t>();
  const int64_t batch = cu.size(0) - 1;
  HEBRUS_CHECK(p[0] == 0 && p[batch] == total, HebrusError, "hebrus::", op,
               ": cu_seqlens must start at 0 and end at T = ", total, ", got ", p[0], " .. ", p[batch]);
  for (int64_t row = 0; row < batch; ++row) {
    HEBRUS_CHECK(p[row] <= p[row + 1], HebrusError, "hebrus::", op, ": cu_seqlens must be non-decreasing; row ", row,
                 " has cu_seqlens[", row, "] = ", p[row], " > cu_seqlens[", row + 1, "] = ", p[row + 1]);
  }
  return cu;
}

inline void check_dims(const char* op, const at::Tensor& t, int64_t n, const char* name) {
  HEBRUS_CHECK(t.dim() == n, HebrusError, "hebrus::", op, ": ", name, " must be ", n, "-D, got shape ",
               shape_str(t.sizes()));
}

inline void check_dtype(const char* op, const at::Tensor& t, at::ScalarType want, const char* name) {
  HEBRUS_CHECK(t.scalar_type() == want, HebrusError, "hebrus::", op, ": ", name, " must have dtype ",
               dtype_name(want), ", got ", dtype_name(t.scalar_type()));
}

inline bool is_float_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

inline void check_float(const char* op, const at::Tensor& t, const char* name) {
  HEBRUS_CHECK(is_float_dtype(t.scalar_type()), HebrusError, "hebrus::", op, ": ", name,
               " must have dtype torch.float32 or torch.float16 or torch.bfloat16, got ",
               dtype_name(t.scalar_type()));
}

// A tensor's rank, then its dtype (kAnyFloat: float32, float16 or bfloat16), for each of `kinds` in order
// (_validate.py's _ranks_and_dtypes).
constexpr at::ScalarType kAnyFloat = at::ScalarType::Undefined;

struct TensorKind {
  const char* name;
  const at::Tensor* t;
  int64_t dims;
  at::ScalarType dtype;
};

inline void check_kinds(const char* op, std::initializer_list<TensorKind> kinds) {
  for (const auto& k : kinds) {
    check_dims(op, *k.t, k.dims, k.name);
    if (k.dtype == kAnyFloat) {
      check_float(op, *k.t, k.name);
    } else {
      check_dtype(op, *k.t, k.dtype, k.name);
    }
  }
}

// t (named `name`) must have the dtype of ref (named `ref_name`).
inline void check_same_dtype(const char* op, const at::Tensor& t, const char* name, const at::Tensor& ref,
                             const char* ref_name) {
  HEBRUS_CHECK(t.scalar_type() == ref.scalar_type(), HebrusError, "hebrus::", op, ": ", name, " dtype ",
               dtype_name(t.scalar_type()), " must match ", ref_name, " dtype ", dtype_name(ref.scalar_type()));
}

// cu_seqlens metadata; returns B. Its values (0 first, non-decreasing, T last) are each backend's.
inline int64_t check_cu_meta(const char* op, const at::Tensor& cu_seqlens) {
  check_dims(op, cu_seqlens, 1, "cu_seqlens");
  check_dtype(op, cu_seqlens, at::kInt, "cu_seqlens");
  HEBRUS_CHECK(cu_seqlens.size(0) >= 1, HebrusError, "hebrus::", op, ": cu_seqlens must have B+1 >= 1 entries");
  return cu_seqlens.size(0) - 1;
}

// Whether two tensors may share memory. at::get_overlap_status answers exactly for dense tensors and
// "too hard" for any other view (a column slice, an expanded tensor); those count as overlapping only
// when they view one storage and the byte spans they cover intersect, as _validate.no_overlap decides.
inline bool may_overlap(const at::Tensor& a, const at::Tensor& b) {
  const at::MemOverlapStatus status = at::get_overlap_status(a, b);
  if (status != at::MemOverlapStatus::TooHard) return status != at::MemOverlapStatus::No;
  if (a.numel() == 0 || b.numel() == 0 || !a.storage().is_alias_of(b.storage())) return false;
  const auto span = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const int64_t start = t.storage_offset() * static_cast<int64_t>(t.element_size());
    return std::make_pair(start, start + (last + 1) * static_cast<int64_t>(t.element_size()));
  };
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  return a0 < b1 && b0 < a1;
}

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

// ---- ple_ngram_ids ----------------------------------------------------------------------------------

struct PleNgramIdsSizes {
  int64_t batch;  // B
  int64_t n;      // N (ngram size)
  int64_t ctx;    // N - 1
  int64_t heads;  // (N-1)*H
  int64_t total;  // T
  int64_t pool;   // S, the history pool's rows (the slot form); B for the plain op
};

// hebrus::ple_ngram_ids (slots == nullptr: history [B, N-1]) and hebrus::ple_ngram_ids_slots (history_pool
// [S, N-1], written in place at the rows' slots), in the order of _validate.py's _ple_ngram_ids.
inline PleNgramIdsSizes check_ngram_ids_args(const char* op, const at::Tensor& tokens, const at::Tensor& cu_seqlens,
                                             const at::Tensor& history, const at::Tensor* slots,
                                             const at::Tensor& multipliers, const at::Tensor& vocab_sizes,
                                             const at::Tensor& offsets, int64_t vocab) {
  const char* history_name = slots != nullptr ? "history_pool" : "history";
  check_dtype(op, tokens, at::kLong, "tokens");
  check_dtype(op, history, at::kLong, history_name);
  check_dtype(op, multipliers, at::kLong, "multipliers");
  check_dtype(op, vocab_sizes, at::kLong, "vocab_sizes");
  check_dtype(op, offsets, at::kLong, "offsets");
  check_dims(op, tokens, 1, "tokens");
  check_dims(op, multipliers, 1, "multipliers");
  check_dims(op, vocab_sizes, 1, "vocab_sizes");
  check_dims(op, offsets, 1, "offsets");
  check_dims(op, history, 2, history_name);
  const int64_t batch = check_cu_meta(op, cu_seqlens);
  if (slots != nullptr) check_slots_meta(op, *slots, batch);
  const int64_t n = multipliers.size(0);
  HEBRUS_CHECK(n >= 2, HebrusError, "hebrus::", op, ": multipliers must have N >= 2 entries (ngram_size), got ", n);
  const int64_t ctx = n - 1;
  const int64_t heads = vocab_sizes.size(0);
  HEBRUS_CHECK(heads >= ctx && heads % ctx == 0, HebrusError, "hebrus::", op,
               ": vocab_sizes must have (N-1)*H entries for N=", n, ", got ", heads);
  HEBRUS_CHECK(offsets.size(0) == heads, HebrusError, "hebrus::", op, ": offsets must have ", heads,
               " entries like vocab_sizes, got ", offsets.size(0));
  HEBRUS_CHECK((slots != nullptr || history.size(0) == batch) && history.size(1) == ctx, HebrusError, "hebrus::", op,
               ": ", history_name, " must have shape (", slots != nullptr ? "S" : "B", ", N-1) = (",
               slots != nullptr ? std::string("S") : std::to_string(batch), ", ", ctx, "), got ",
               shape_str(history.sizes()));
  HEBRUS_CHECK(vocab > 0, HebrusError, "hebrus::", op, ": vocab must be positive, got ", vocab);
  if (slots != nullptr)
    check_pool_writable(op, history, history_name,
                        {{"tokens", &tokens}, {"cu_seqlens", &cu_seqlens}, {"slots", slots},
                         {"multipliers", &multipliers}, {"vocab_sizes", &vocab_sizes}, {"offsets", &offsets}});
  return {batch, n, ctx, heads, tokens.size(0), history.size(0)};
}

inline PleNgramIdsSizes check_ple_ngram_ids_args(const at::Tensor& tokens, const at::Tensor& cu_seqlens,
                                                 const at::Tensor& history, const at::Tensor& multipliers,
                                                 const at::Tensor& vocab_sizes, const at::Tensor& offsets, int64_t eos,
                                                 int64_t vocab) {
  // eos is any int64 (SPEC §2): it is only ever compared with token ids.
  (void)eos;
  return check_ngram_ids_args("ple_ngram_ids", tokens, cu_seqlens, history, nullptr, multipliers, vocab_sizes,
                              offsets, vocab);
}

inline PleNgramIdsSizes check_ple_ngram_ids_slots_args(const at::Tensor& tokens, const at::Tensor& cu_seqlens,
                                                       const at::Tensor& history_pool, const at::Tensor& slots,
                                                       const at::Tensor& multipliers, const at::Tensor& vocab_sizes,
                                                       const at::Tensor& offsets, int64_t vocab) {
  return check_ngram_ids_args("ple_ngram_ids_slots", tokens, cu_seqlens, history_pool, &slots, multipliers,
                              vocab_sizes, offsets, vocab);
}

// ---- ple_conv ---------------------------------------------------------------------------------------

struct PleConvSizes {
  int64_t batch;      // B
  int64_t total;      // T
  int64_t channels;   // C
  int64_t width;      // K
  int64_t state_len;  // (K-1)*dilation
  int64_t pool;       // S, the state pool's rows (the slot form); B for the plain op
  bool silu;          // activation == "silu" (else "none")
};

// hebrus::ple_conv (slots == nullptr: state [B, L, C]) and hebrus::ple_conv_slots (state_pool [S, L, C],
// written in place at the rows' slots), in the order of _validate.py's _ple_conv.
inline PleConvSizes check_conv_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                    const at::Tensor& cu_seqlens, const at::Tensor& state, const at::Tensor* slots,
                                    int64_t dilation, c10::string_view activation) {
  const char* state_name = slots != nullptr ? "state_pool" : "state";
  check_dims(op, x, 2, "x");
  check_dims(op, weight, 2, "weight");
  check_dims(op, state, 3, state_name);
  check_float(op, x, "x");
  check_same_dtype(op, weight, "weight", x, "x");
  check_same_dtype(op, state, state_name, x, "x");
  const int64_t batch = check_cu_meta(op, cu_seqlens);
  if (slots != nullptr) check_slots_meta(op, *slots, batch);
  HEBRUS_CHECK(dilation >= 1, HebrusError, "hebrus::", op, ": dilation must be >= 1, got ", dilation);
  const bool silu = activation == "silu";
  HEBRUS_CHECK(silu || activation == "none", HebrusError, "hebrus::", op,
               ": activation must be one of ('silu', 'none'), got '", std::string(activation), "'");
  const int64_t channels = x.size(1), width = weight.size(1);
  HEBRUS_CHECK(weight.size(0) == channels && width >= 1, HebrusError, "hebrus::", op,
               ": weight must have shape (C, K) with C = ", channels, " and K >= 1, got ", shape_str(weight.sizes()));
  int64_t state_len = 0;
  const bool len_ok = !__builtin_mul_overflow(width - 1, dilation, &state_len);
  HEBRUS_CHECK(len_ok && (slots != nullptr || state.size(0) == batch) && state.size(1) == state_len &&
                   state.size(2) == channels,
               HebrusError, "hebrus::", op, ": ", state_name, " must have shape (", slots != nullptr ? "S" : "B",
               ", (K-1)*dilation, C) = (", slots != nullptr ? std::string("S") : std::to_string(batch), ", ",
               len_ok ? std::to_string(state_len) : std::to_string(width - 1) + "*" + std::to_string(dilation), ", ",
               channels, "), got ", shape_str(state.sizes()));
  if (slots != nullptr)
    check_pool_writable(op, state, state_name,
                        {{"x", &x}, {"weight", &weight}, {"cu_seqlens", &cu_seqlens}, {"slots", slots}});
  return {batch, x.size(0), channels, width, state_len, state.size(0), silu};
}

inline PleConvSizes check_ple_conv_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cu_seqlens,
                                        const at::Tensor& state, int64_t dilation, c10::string_view activation,
                                        const char* op = "ple_conv") {
  return check_conv_args(op, x, weight, cu_seqlens, state, nullptr, dilation, activation);
}

inline PleConvSizes check_ple_conv_slots_args(const at::Tensor& x, const at::Tensor& weight,
                                              const at::Tensor& cu_seqlens, const at::Tensor& state_pool,
                                              const at::Tensor& slots, int64_t dilation,
                                              c10::string_view activation) {
  return check_conv_args("ple_conv_slots", x, weight, cu_seqlens, state_pool, &slots, dilation, activation);
}

// The buffers ple_conv_into writes: y like x and new_state like state (shape and dtype), contiguous,
// and sharing no memory with an input or with each other, since the kernel reads the inputs while it
// writes (views of one storage whose byte spans intersect count as overlapping).
inline void check_ple_conv_outs(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cu_seqlens,
                                const at::Tensor& state, const at::Tensor& y, const at::Tensor& new_state) {
  const char* op = "ple_conv_into";
  HEBRUS_CHECK(y.sizes() == x.sizes() && y.scalar_type() == x.scalar_type(), HebrusError, "hebrus::", op,
               ": y must have the shape and dtype of x, ", shape_str(x.sizes()), " ", dtype_name(x.scalar_type()),
               ", got ", shape_str(y.sizes()), " ", dtype_name(y.scalar_type()));
  HEBRUS_CHECK(new_state.sizes() == state.sizes() && new_state.scalar_type() == state.scalar_type(), HebrusError,
               "hebrus::", op, ": new_state must have the shape and dtype of state, ", shape_str(state.sizes()), " ",
               dtype_name(state.scalar_type()), ", got ", shape_str(new_state.sizes()), " ",
               dtype_name(new_state.scalar_type()));
  HEBRUS_CHECK(y.is_contiguous() && new_state.is_contiguous(), HebrusError, "hebrus::", op,
               ": y and new_state must be contiguous");
  const std::pair<const char*, const at::Tensor*> outs[] = {{"y", &y}, {"new_state", &new_state}};
  const std::pair<const char*, const at::Tensor*> others[] = {
      {"x", &x}, {"weight", &weight}, {"cu_seqlens", &cu_seqlens}, {"state", &state}, {"new_state", &new_state}};
  for (const auto& [out_name, out] : outs) {
    for (const auto& [name, t] : others) {
      if (t == out) continue;
      HEBRUS_CHECK(!may_overlap(*out, *t), HebrusError, "hebrus::", op, ": ",
                   out_name, " shares memory with ", name, "; the outputs must not overlap the inputs or each other");
    }
  }
}

// ---- qsa_pool ---------------------------------------------------------------------------------------

struct QsaPoolSizes {
  int64_t cells;   // keys.size(0)
  int64_t dim;     // D
  int64_t groups;  // G
  int64_t r;       // members per group
  int64_t half;    // rotary pairs (inv_freq entries)
};

inline QsaPoolSizes check_qsa_pool_args(const at::Tensor& keys, const at::Tensor& cell_pos,
                                        const at::Tensor& group_cells, const at::Tensor& group_pos,
                                        const at::Tensor& norm_weight, double eps, const at::Tensor& inv_freq) {
  const char* op = "qsa_pool";
  check_kinds(op, {{"keys", &keys, 2, kAnyFloat}, {"cell_pos", &cell_pos, 1, at::kLong},
                   {"group_cells", &group_cells, 2, at::kInt}, {"group_pos", &group_pos, 1, at::kLong},
                   {"norm_weight", &norm_weight, 1, kAnyFloat}, {"inv_freq", &inv_freq, 1, at::kFloat}});
  const int64_t cells = keys.size(0), dim = keys.size(1);
  const int64_t groups = group_cells.size(0), r = group_cells.size(1), half = inv_freq.size(0);
  HEBRUS_CHECK(cell_pos.size(0) == cells, HebrusError, "hebrus::qsa_pool: cell_pos must have one entry per cell (",
               cells, "), got ", cell_pos.size(0));
  HEBRUS_CHECK(r >= 1, HebrusError, "hebrus::qsa_pool: group_cells must have r >= 1 columns");
  HEBRUS_CHECK(group_pos.size(0) == groups, HebrusError,
               "hebrus::qsa_pool: group_pos must have one entry per group (", groups, "), got ", group_pos.size(0));
  HEBRUS_CHECK(norm_weight.size(0) == dim, HebrusError, "hebrus::qsa_pool: norm_weight must have D = ", dim,
               " entries, got ", norm_weight.size(0));
  HEBRUS_CHECK(2 * half <= dim, HebrusError, "hebrus::qsa_pool: rotary dims 2*", half, " exceed head dim ", dim);
  HEBRUS_CHECK(eps >= 0, HebrusError, "hebrus::qsa_pool: eps must be >= 0, got ", eps);
  return {cells, dim, groups, r, half};
}

// ---- qsa_select -------------------------------------------------------------------------------------

struct QsaSelectSizes {
  int64_t tq;          // queries
  int64_t hq;          // query heads
  int64_t dim;         // D
  int64_t rows;        // pooled rows
  int64_t batch;       // B (seq_groups rows)
  int64_t max_groups;  // maxG (seq_groups columns)
};

inline QsaSelectSizes check_qsa_select_args(const at::Tensor& q, const at::Tensor& pooled,
                                            const at::Tensor& seq_groups, const at::Tensor& q_row,
                                            const at::Tensor& q_groups, int64_t top_k) {
  const char* op = "qsa_select";
  check_kinds(op, {{"q", &q, 3, kAnyFloat}, {"pooled", &pooled, 2, kAnyFloat},
                   {"seq_groups", &seq_groups, 2, at::kInt}, {"q_row", &q_row, 1, at::kInt},
                   {"q_groups", &q_groups, 1, at::kInt}});
  const int64_t tq = q.size(0), hq = q.size(1), dim = q.size(2);
  const int64_t rows = pooled.size(0), batch = seq_groups.size(0), max_groups = seq_groups.size(1);
  HEBRUS_CHECK(dim == pooled.size(1), HebrusError, "hebrus::qsa_select: q head dim ", dim, " must equal pooled dim ",
               pooled.size(1));
  HEBRUS_CHECK(q_row.size(0) == tq && q_groups.size(0) == tq, HebrusError,
               "hebrus::qsa_select: q_row and q_groups must have Tq = ", tq, " entries, got ", q_row.size(0), " and ",
               q_groups.size(0));
  HEBRUS_CHECK(top_k >= 1 && top_k <= INT32_MAX, HebrusError,
               "hebrus::qsa_select: top_k must be in [1, 2147483647] (group indices are int32), got ", top_k);
  return {tq, hq, dim, rows, batch, max_groups};
}

// ---- qsa_attention ----------------------------------------------------------------------------------

// t itself when its last dim is contiguous (or has at most one element), else a contiguous copy:
// both kernels read k and v (and the CPU one q) through the strides of dims 0 and 1, so the views of
// a cache row that callers pass ([Hkv, cells, D] transposed) are read in place, never copied.
inline at::Tensor last_dim_contiguous(const at::Tensor& t) {
  return (t.size(2) <= 1 || t.stride(2) == 1) ? t : t.contiguous();
}

struct QsaAttentionSizes {
  int64_t tq;     // queries
  int64_t hq;     // query heads
  int64_t dh;     // q / k head dim
  int64_t cells;  // k / v rows
  int64_t hkv;    // KV heads
  int64_t dv;     // v head dim
  int64_t width;  // token_cells columns
};

inline QsaAttentionSizes check_qsa_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& token_cells, double scale) {
  const char* op = "qsa_attention";
  check_dims(op, q, 3, "q");
  check_float(op, q, "q");
  check_dims(op, k, 3, "k");
  check_dims(op, v, 3, "v");
  check_same_dtype(op, k, "k", q, "q");
  check_same_dtype(op, v, "v", q, "q");
  check_dims(op, token_cells, 2, "token_cells");
  check_dtype(op, token_cells, at::kInt, "token_cells");
  const int64_t tq = q.size(0), hq = q.size(1), dh = q.size(2);
  const int64_t cells = k.size(0), hkv = k.size(1);
  HEBRUS_CHECK(hkv >= 1, HebrusError, "hebrus::qsa_attention: k must have Hkv >= 1 heads, got shape ",
               shape_str(k.sizes()));
  HEBRUS_CHECK(k.size(2) == dh, HebrusError, "hebrus::qsa_attention: k head dim ", k.size(2),
               " must equal q head dim ", dh);
  HEBRUS_CHECK(v.size(0) == cells && v.size(1) == hkv, HebrusError,
               "hebrus::qsa_attention: v must have shape (cells, Hkv, Dv) with cells = ", cells, " and Hkv = ", hkv,
               " like k, got ", shape_str(v.sizes()));
  HEBRUS_CHECK(hq % hkv == 0, HebrusError, "hebrus::qsa_attention: query heads Hq = ", hq,
               " must be a multiple of KV heads Hkv = ", hkv);
  HEBRUS_CHECK(token_cells.size(0) == tq, HebrusError,
               "hebrus::qsa_attention: token_cells must have one row per query (Tq = ", tq, "), got shape ",
               shape_str(token_cells.sizes()));
  HEBRUS_CHECK(std::isfinite(scale), HebrusError, "hebrus::qsa_attention: scale must be finite, got ", scale);
  return {tq, hq, dh, cells, hkv, v.size(2), token_cells.size(1)};
}

}  // namespace hebrus
