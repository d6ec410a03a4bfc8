#pragma once
// Everything the MPS glue decides, in plain C++ (ATen only, no Metal API): for each op, the host
// checks (all metadata, before any launch), the early results of empty shapes, which kernels run
// (library, kernel name, variant), the tensors bound to [[buffer(0..n-1)]] in order (inputs made
// contiguous or bound as views, outputs allocated), where the stream's error buffer and the
// parameter block go, the parameter block's bytes and the dispatch. csrc/mps/<op>.mm calls these
// functions with DeviceType::MPS and only encodes the result (hebrus_mps.h: encode()); the Linux
// test binary (tests/metal/glue_abi.cpp) calls the same functions with DeviceType::CPU and the
// emulator runs exactly those launches (tests/metal/hebrus_emu.py). Values that only the kernel sees
// are checked in the kernel and reported through PyTorch's MPS error buffer (hebrus_params.h); no
// function here reads a tensor's values (tests/test_mps_glue.py checks the sources for host reads).
//
// Conventions every op's glue follows (a new op copies them):
//   * check_on_device(op, device, ...) first, then the op's metadata checks (csrc/op_checks.h);
//   * shapes where no kernel thread would look at a value-checked input still launch a check
//     kernel (<op>_check_cu, qsa_attention_check_cells) instead of reading it on the host;
//   * buffers: the tensors in the kernel's [[buffer(i)]] order, then the error buffer
//     (error_index = number of tensors), then the parameter block (params_index = error_index + 1);
//   * `written` marks the buffers the kernel writes (the emulator poisons them before a launch);
//     `in_place` marks those of them it also reads, a state pool updated in place (the emulator keeps
//     their contents; they are bound as they are, never as a copy, and guard-paged like the others);
//   * plan errors (launch limits) raise HebrusError "hebrus::<op> on MPS: ..." before any launch.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/metal/error.h>
#include <c10/util/string_view.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gdn_checks.h"
#include "gdn_fused_checks.h"
#include "hc_checks.h"
#include "hebrus_check.h"
#include "hebrus_launch.h"
#include "moe_checks.h"
#include "op_checks.h"
#include "qsa_fused_checks.h"

namespace hebrus::glue {

using at::Tensor;

// The kernels write PyTorch's MPS error buffer through HebrusErrorMessages: the same layout as
// c10::metal::ErrorMessages, which MPSStream::checkLastError reads.
static_assert(sizeof(HebrusErrorMessages) == sizeof(c10::metal::ErrorMessages), "error buffer layout");
static_assert(HEBRUS_ERROR_MESSAGE_COUNT == c10::metal::error_message_count, "error buffer layout");
static_assert(offsetof(HebrusErrorMessages, msg) == offsetof(c10::metal::ErrorMessages, msg), "error buffer layout");
static_assert(offsetof(HebrusErrorMessage, message) == offsetof(c10::metal::ErrorMessage, message), "layout");
static_assert(offsetof(HebrusErrorMessage, line) == offsetof(c10::metal::ErrorMessage, line), "layout");
static_assert(sizeof(HebrusErrorMessage) == sizeof(c10::metal::ErrorMessage), "error buffer layout");

#if defined(HEBRUS_METAL_BFLOAT) && HEBRUS_METAL_BFLOAT
constexpr bool kHasBFloat = true;
#else
constexpr bool kHasBFloat = false;
#endif

// One kernel launch, as the glue encodes it.
struct Launch {
  std::string stem;                // mps_kernels/<stem>.metal: the library
  std::string kernel;              // host_name of the kernel
  std::vector<Tensor> tensors;     // [[buffer(i)]], bound with their storage offset (setArg)
  std::vector<bool> written;       // the kernel writes tensors[i]
  std::vector<bool> in_place;      // ... and reads it: updated in place (a slot pool), not an output
  unsigned error_index = 0;        // [[buffer(error_index)]]: the stream's error buffer
  unsigned params_index = 0;       // [[buffer(params_index)]]: the parameter block (setBytes)
  std::vector<uint8_t> params;
  uint64_t threads = 0;            // dispatchThreads(threads) in threadgroups of `group`
  uint64_t group = 1;
};

// An op call: its launches, in order, and the tensors it returns.
struct Call {
  std::vector<Launch> launches;
  std::vector<Tensor> outputs;
};

template <typename Params>
inline Launch make_launch(const char* stem, std::string kernel, std::vector<Tensor> tensors,
                          std::vector<bool> written, const Params& params, const hebrus::metal::Dispatch& d,
                          std::vector<bool> in_place = {}) {
  Launch l;
  l.stem = stem;
  l.kernel = std::move(kernel);
  l.tensors = std::move(tensors);
  l.written = std::move(written);
  l.in_place = in_place.empty() ? std::vector<bool>(l.tensors.size(), false) : std::move(in_place);
  for (size_t i = 0; i < l.in_place.size(); ++i) {
    TORCH_INTERNAL_ASSERT(!l.in_place[i] || l.written[i], "hebrus: an in-place buffer is a written one");
  }
  l.error_index = static_cast<unsigned>(l.tensors.size());
  l.params_index = l.error_index + 1;
  l.params.resize(sizeof(Params));
  std::memcpy(l.params.data(), &params, sizeof(Params));
  l.threads = d.threads;
  l.group = d.group;
  return l;
}

// MSL type name of a floating dtype, as the kernels' host_name suffixes spell it.
inline const char* metal_type(const char* op, at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "float";
    case at::kHalf:
      return "half";
    case at::kBFloat16:
      HEBRUS_CHECK(kHasBFloat, HebrusError, "hebrus::", op, ": this build has no bfloat16 Metal kernels ",
                   "(built with HEBRUS_METAL_BFLOAT=0); rebuild with HEBRUS_METAL_BFLOAT=1 on macOS 14 or newer, ",
                   "or use float16 / float32");
      return "bfloat";
    default:
      HEBRUS_CHECK(false, HebrusError, "hebrus::", op, ": no Metal kernel for dtype ", t);
  }
  return "";
}

inline void check_plan(const char* op, const char* error) {
  HEBRUS_CHECK(error == nullptr, HebrusError, "hebrus::", op, " on MPS: ", error ? error : "");
}

// <stem>_check_cu over cu_seqlens (B + 1 entries, T tokens).
inline Launch check_cu_launch(const char* op, const Tensor& cu, int64_t total) {
  const auto plan = hebrus::metal::plan_check(total, cu.size(0) - 1, 0);
  check_plan(op, plan.error);
  return make_launch(op, std::string(op) + "_check_cu", {cu.contiguous()}, {false}, plan.params, plan.dispatch);
}

// ---- ple_conv ---------------------------------------------------------------------------------------

inline Call ple_conv(const Tensor& x_in, const Tensor& weight_in, const Tensor& cu_in, const Tensor& state_in,
                     int64_t dilation, c10::string_view activation, c10::DeviceType device) {
  const char* op = "ple_conv";
  check_on_device(op, device, {{"x", &x_in}, {"weight", &weight_in}, {"cu_seqlens", &cu_in}, {"state", &state_in}});
  const PleConvSizes sz = check_ple_conv_args(x_in, weight_in, cu_in, state_in, dilation, activation);
  const char* type = metal_type(op, x_in.scalar_type());
  Call call;
  if (sz.batch == 0 || sz.channels == 0) {  // no conv thread would look at cu_seqlens: the check kernel does
    call.launches.push_back(check_cu_launch(op, cu_in, sz.total));
    call.outputs = {at::empty_like(x_in, at::MemoryFormat::Contiguous), state_in.clone(at::MemoryFormat::Contiguous)};
    return call;
  }
  const auto plan = hebrus::metal::plan_ple_conv(sz.total, sz.channels, sz.width, sz.batch, dilation, sz.silu);
  check_plan(op, plan.error);
  const Tensor x = x_in.contiguous(), weight = weight_in.contiguous(), cu = cu_in.contiguous();
  const Tensor state = state_in.contiguous();
  Tensor y = at::empty_like(x), new_state = at::empty_like(state);
  call.launches.push_back(make_launch(op, hebrus::metal::kernel_name(op, "", type), {x, weight, cu, state, y, new_state},
                                      {false, false, false, false, true, true}, plan.params, plan.dispatch));
  call.outputs = {y, new_state};
  return call;
}

// ---- ple_ngram_ids ----------------------------------------------------------------------------------

inline Call ple_ngram_ids(const Tensor& tokens_in, const Tensor& cu_in, const Tensor& history_in,
                          const Tensor& multipliers_in, const Tensor& vocab_sizes_in, const Tensor& offsets_in,
                          int64_t eos, int64_t vocab, c10::DeviceType device) {
  const char* op = "ple_ngram_ids";
  check_on_device(op, device, {{"tokens", &tokens_in}, {"cu_seqlens", &cu_in}, {"history", &history_in},
                               {"multipliers", &multipliers_in}, {"vocab_sizes", &vocab_sizes_in},
                               {"offsets", &offsets_in}});
  const PleNgramIdsSizes sz =
      check_ple_ngram_ids_args(tokens_in, cu_in, history_in, multipliers_in, vocab_sizes_in, offsets_in, eos, vocab);
  Call call;
  if (sz.batch == 0) {  // no row threads: the check kernel looks at cu_seqlens (T must be 0)
    call.launches.push_back(check_cu_launch(op, cu_in, sz.total));
    call.outputs = {at::empty({0, sz.heads}, tokens_in.options()), history_in.clone(at::MemoryFormat::Contiguous)};
    return call;
  }
  const auto plan = hebrus::metal::plan_ple_ngram_ids(sz.total, sz.batch, sz.n, sz.heads, eos, vocab);
  check_plan(op, plan.error);
  const Tensor tokens = tokens_in.contiguous(), cu = cu_in.contiguous(), history = history_in.contiguous();
  const Tensor multipliers = multipliers_in.contiguous(), vocab_sizes = vocab_sizes_in.contiguous();
  const Tensor offsets = offsets_in.contiguous();
  Tensor row_ids = at::empty({sz.total, sz.heads}, tokens.options());
  Tensor new_history = at::empty_like(history);
  call.launches.push_back(make_launch(op, hebrus::metal::kernel_name(op, "", "long"),
                                      {tokens, cu, history, multipliers, vocab_sizes, offsets, row_ids, new_history},
                                      {false, false, false, false, false, false, true, true}, plan.params,
                                      plan.dispatch));
  call.outputs = {row_ids, new_history};
  return call;
}

// ---- ple_conv_slots / ple_ngram_ids_slots -----------------------------------------------------------
// The pool is bound as it is (contiguous and overlapping no input: ple_slots_checks.h) and updated in
// place by the kernel. The slot values (range, duplicates) are the kernel's to check, like
// cu_seqlens: a row with a bad slot touches nothing of the pool; nothing is read here.

// <op>_check over cu_seqlens and the slots (one thread per row), and for ple_ngram_ids_slots the
// vocab sizes: the launch where no thread of the op would look at them.
inline Launch check_slots_launch(const char* op, const Tensor& cu, const Tensor& slots, const Tensor* vocab_sizes,
                                 int64_t total, int64_t pool) {
  const int64_t heads = vocab_sizes != nullptr ? vocab_sizes->size(0) : 0;
  const auto plan = hebrus::metal::plan_check_slots(total, cu.size(0) - 1, pool, heads);
  check_plan(op, plan.error);
  std::vector<Tensor> tensors{cu.contiguous(), slots.contiguous()};
  if (vocab_sizes != nullptr) tensors.push_back(vocab_sizes->contiguous());
  std::vector<bool> written(tensors.size(), false);
  return make_launch(op, std::string(op) + "_check", std::move(tensors), std::move(written), plan.params,
                     plan.dispatch);
}

inline Call ple_conv_slots(const Tensor& x_in, const Tensor& weight_in, const Tensor& cu_in, const Tensor& pool,
                           const Tensor& slots_in, int64_t dilation, c10::string_view activation,
                           c10::DeviceType device) {
  const char* op = "ple_conv_slots";
  check_on_device(op, device, {{"x", &x_in}, {"weight", &weight_in}, {"cu_seqlens", &cu_in}, {"state_pool", &pool},
                               {"slots", &slots_in}});
  const PleConvSizes sz = check_ple_conv_slots_args(x_in, weight_in, cu_in, pool, slots_in, dilation, activation);
  const char* type = metal_type(op, x_in.scalar_type());
  Call call;
  if (sz.batch == 0 || sz.channels == 0) {  // no conv thread would look at cu_seqlens or slots: the check kernel does
    call.launches.push_back(check_slots_launch(op, cu_in, slots_in, nullptr, sz.total, sz.pool));
    call.outputs = {at::empty_like(x_in, at::MemoryFormat::Contiguous)};
    return call;
  }
  const auto plan =
      hebrus::metal::plan_ple_conv_slots(sz.total, sz.channels, sz.width, sz.batch, dilation, sz.pool, sz.silu);
  check_plan(op, plan.error);
  const Tensor x = x_in.contiguous(), weight = weight_in.contiguous(), cu = cu_in.contiguous();
  const Tensor slots = slots_in.contiguous();
  Tensor y = at::empty_like(x);
  call.launches.push_back(make_launch(op, hebrus::metal::kernel_name(op, "", type), {x, weight, cu, pool, slots, y},
                                      {false, false, false, true, false, true}, plan.params, plan.dispatch,
                                      {false, false, false, true, false, false}));
  call.outputs = {y};
  return call;
}

inline Call ple_ngram_ids_slots(const Tensor& tokens_in, const Tensor& cu_in, const Tensor& pool,
                                const Tensor& slots_in, const Tensor& multipliers_in, const Tensor& vocab_sizes_in,
                                const Tensor& offsets_in, int64_t eos, int64_t vocab, c10::DeviceType device) {
  const char* op = "ple_ngram_ids_slots";
  check_on_device(op, device, {{"tokens", &tokens_in}, {"cu_seqlens", &cu_in}, {"history_pool", &pool},
                               {"slots", &slots_in}, {"multipliers", &multipliers_in},
                               {"vocab_sizes", &vocab_sizes_in}, {"offsets", &offsets_in}});
  const PleNgramIdsSizes sz = check_ple_ngram_ids_slots_args(tokens_in, cu_in, pool, slots_in, multipliers_in,
                                                                  vocab_sizes_in, offsets_in, vocab);
  Call call;
  if (sz.batch == 0) {  // no row threads: the check kernel looks at cu_seqlens (T must be 0) and vocab_sizes
    call.launches.push_back(check_slots_launch(op, cu_in, slots_in, &vocab_sizes_in, sz.total, sz.pool));
    call.outputs = {at::empty({0, sz.heads}, tokens_in.options())};
    return call;
  }
  const auto plan = hebrus::metal::plan_ple_ngram_ids_slots(sz.total, sz.batch, sz.n, sz.heads, eos, vocab, sz.pool);
  check_plan(op, plan.error);
  const Tensor tokens = tokens_in.contiguous(), cu = cu_in.contiguous(), slots = slots_in.contiguous();
  const Tensor multipliers = multipliers_in.contiguous(), vocab_sizes = vocab_sizes_in.contiguous();
  const Tensor offsets = offsets_in.contiguous();
  Tensor row_ids = at::empty({sz.total, sz.heads}, tokens.options());
  call.launches.push_back(make_launch(op, hebrus::metal::kernel_name(op, "", "long"),
                                      {tokens, cu, pool, slots, multipliers, vocab_sizes, offsets, row_ids},
                                      {false, false, true, false, false, false, false, true}, plan.params,
                                      plan.dispatch, {false, false, true, false, false, false, false, false}));
  call.outputs = {row_ids};
  return call;
}

// ---- qsa_pool ---------------------------------------------------------------------------------------

inline Call qsa_pool(const Tensor& keys_in, const Tensor& cell_pos_in, const Tensor& group_cells_in,
                     const Tensor& group_pos_in, const Tensor& norm_weight_in, double eps, const Tensor& inv_freq_in,
                     c10::DeviceType device) {
  const char* op = "qsa_pool";
  check_on_device(op, device, {{"keys", &keys_in}, {"cell_pos", &cell_pos_in}, {"group_cells", &group_cells_in},
                               {"group_pos", &group_pos_in}, {"norm_weight", &norm_weight_in},
                               {"inv_freq", &inv_freq_in}});
  const QsaPoolSizes sz =
      check_qsa_pool_args(keys_in, cell_pos_in, group_cells_in, group_pos_in, norm_weight_in, eps, inv_freq_in);
  const char* type = metal_type(op, keys_in.scalar_type());
  Call call;
  if (sz.groups == 0) {
    call.outputs = {at::empty({0, sz.dim}, keys_in.options())};
    return call;
  }
  const auto plan = hebrus::metal::plan_qsa_pool(sz.cells, sz.dim, sz.groups, sz.r, sz.half, eps);
  check_plan(op, plan.error);
  const Tensor keys = keys_in.contiguous(), cell_pos = cell_pos_in.contiguous();
  const Tensor group_cells = group_cells_in.contiguous(), group_pos = group_pos_in.contiguous();
  const Tensor weight = norm_weight_in.to(at::kFloat).contiguous();  // exact; the kernel reads fp32 (1 + w)
  const Tensor inv_freq = inv_freq_in.contiguous();
  Tensor pooled = at::empty({sz.groups, sz.dim}, keys.options());
  call.launches.push_back(make_launch(op, hebrus::metal::kernel_name(op, "", type),
                                      {keys, cell_pos, group_cells, group_pos, weight, inv_freq, pooled},
                                      {false, false, false, false, false, false, true}, plan.params, plan.dispatch));
  call.outputs = {pooled};
  return call;
}

// ---- qsa_select -------------------------------------------------------------------------------------

inline Call qsa_select(const Tensor& q_in, const Tensor& pooled_in, const Tensor& seq_groups_in, const Tensor& q_row_in,
                       const Tensor& q_groups_in, int64_t top_k, c10::DeviceType device) {
  const char* op = "qsa_select";
  check_on_device(op, device, {{"q", &q_in}, {"pooled", &pooled_in}, {"seq_groups", &seq_groups_in},
                               {"q_row", &q_row_in}, {"q_groups", &q_groups_in}});
  const QsaSelectSizes sz = check_qsa_select_args(q_in, pooled_in, seq_groups_in, q_row_in, q_groups_in, top_k);
  Call call;
  if (sz.tq == 0) {
    call.outputs = {at::full({0, top_k}, -1, q_in.options().dtype(at::kInt))};
    return call;
  }
  const bool same = q_in.scalar_type() == pooled_in.scalar_type();  // else both widened to fp32: exact
  const Tensor q = same ? q_in.contiguous() : q_in.to(at::kFloat).contiguous();
  const Tensor pooled = same ? pooled_in.contiguous() : pooled_in.to(at::kFloat).contiguous();
  const char* type = metal_type(op, q.scalar_type());
  const auto plan = hebrus::metal::plan_qsa_select(sz.tq, sz.hq, sz.dim, sz.rows, sz.batch, sz.max_groups, top_k);
  check_plan(op, plan.error);
  const Tensor seq_groups = seq_groups_in.contiguous(), q_row = q_row_in.contiguous();
  const Tensor q_groups = q_groups_in.contiguous();
  Tensor selected = at::empty({sz.tq, top_k}, q.options().dtype(at::kInt));
  call.launches.push_back(make_launch(op, hebrus::metal::kernel_name(op, plan.variant, type),
                                      {q, pooled, seq_groups, q_row, q_groups, selected},
                                      {false, false, false, false, false, true}, plan.params, plan.dispatch));
  call.outputs = {selected};
  return call;
}

// ---- qsa_attention ----------------------------------------------------------------------------------

inline Call qsa_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const Tensor& token_cells_in,
                          double scale, c10::DeviceType device) {
  const char* op = "qsa_attention";
  check_on_device(op, device, {{"q", &q_in}, {"k", &k_in}, {"v", &v_in}, {"token_cells", &token_cells_in}});
  const QsaAttentionSizes sz = check_qsa_attention_args(q_in, k_in, v_in, token_cells_in, scale);
  const char* type = metal_type(op, q_in.scalar_type());
  Call call;
  if (sz.tq == 0) {
    call.outputs = {at::empty({0, sz.hq, sz.dv}, q_in.options())};
    return call;
  }
  if (sz.hq == 0 || sz.dv == 0 || sz.cells == 0) {  // no attention thread would read token_cells
    const auto plan = hebrus::metal::plan_check(sz.cells, sz.tq, sz.width);
    check_plan(op, plan.error);
    call.launches.push_back(make_launch(op, "qsa_attention_check_cells", {token_cells_in.contiguous()}, {false},
                                        plan.params, plan.dispatch));
    call.outputs = {at::empty({sz.tq, sz.hq, sz.dv}, q_in.options())};
    return call;
  }
  // K and V are read in place through the strides of their first two dims: views stay views.
  const Tensor k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
  const auto plan = hebrus::metal::plan_qsa_attention(sz.tq, sz.hq, sz.hkv, sz.dh, sz.dv, sz.cells, sz.width,
                                                      k.stride(0), k.stride(1), v.stride(0), v.stride(1), scale);
  check_plan(op, plan.error);
  const Tensor q = q_in.contiguous(), token_cells = token_cells_in.contiguous();
  Tensor out = at::empty({sz.tq, sz.hq, sz.dv}, q.options());
  call.launches.push_back(make_launch(op, hebrus::metal::kernel_name(op, plan.variant, type),
                                      {q, k, v, token_cells, out}, {false, false, false, false, true}, plan.params,
                                      plan.dispatch));
  call.outputs = {out};
  return call;
}

// ---- qsa_token_cells (issue 37) ---------------------------------------------------------------------
// One launch (mps_kernels/qsa_token_cells.metal); the values (runs inside cells, selected groups among
// the query's complete groups) are the kernel's to check, through the error buffer.
inline Call qsa_token_cells(const Tensor& selected_in, const Tensor& nvis_in, const Tensor& first_in,
                            const Tensor& cells_in, int64_t r, c10::DeviceType device) {
  const char* op = "qsa_token_cells";
  check_on_device(op, device, {{"selected", &selected_in}, {"nvis", &nvis_in}, {"first", &first_in},
                               {"cells", &cells_in}});
  const QsaTokenCellsSizes sz = check_qsa_token_cells_args(selected_in, nvis_in, first_in, cells_in, r);
  Call call;
  Tensor token_cells = at::empty({sz.tq, sz.width}, cells_in.options());
  Tensor token_offsets = at::empty({sz.tq, sz.width}, nvis_in.options());
  call.outputs = {token_cells, token_offsets};
  if (sz.tq == 0) return call;
  const auto plan = hebrus::metal::plan_qsa_token_cells(sz.tq, sz.top_k, sz.r, sz.width, sz.cells);
  check_plan(op, plan.error);
  // An empty selected or cells is bound as one unread -1 entry (no buffer of zero bytes).
  const Tensor selected = sz.top_k > 0 ? selected_in.contiguous() : at::full({1}, -1, selected_in.options());
  const Tensor cells = sz.cells > 0 ? cells_in.contiguous() : at::full({1}, -1, cells_in.options());
  call.launches.push_back(make_launch(op, hebrus::metal::kernel_name(op, "", "long"),
                                      {selected, nvis_in.contiguous(), first_in.contiguous(), cells, token_cells,
                                       token_offsets},
                                      {false, false, false, false, true, true}, plan.params, plan.dispatch));
  return call;
}

// ---- rms_norm_rope (issue 37) -------------------------------------------------------------------------
// One launch (mps_kernels/rms_norm_rope.metal); no value to check. x is read in place through the strides of
// its first two dims (a copy only where its last dim is not contiguous).
inline Call rms_norm_rope(const Tensor& x_in, const Tensor& weight_in, double eps, const Tensor& cos_in,
                          const Tensor& sin_in, c10::DeviceType device) {
  const char* op = "rms_norm_rope";
  check_on_device(op, device, {{"x", &x_in}, {"weight", &weight_in}, {"cos", &cos_in}, {"sin", &sin_in}});
  const RmsNormRopeSizes sz = check_rms_norm_rope_args(x_in, weight_in, eps, cos_in, sin_in);
  const char* type = metal_type(op, x_in.scalar_type());
  Call call;
  Tensor out = at::empty({sz.tokens, sz.heads, sz.dim}, x_in.options());
  call.outputs = {out};
  if (out.numel() == 0) return call;
  const Tensor x = last_dim_contiguous(x_in);
  const auto plan = hebrus::metal::plan_rms_norm_rope(sz.tokens, sz.heads, sz.dim, sz.rot, x.stride(0), x.stride(1),
                                                      eps);
  check_plan(op, plan.error);
  const Tensor weight = weight_in.to(at::kFloat).contiguous();  // exact; the kernel reads fp32 (1 + w)
  // No rotary dims: cos and sin are bound as one unread entry each (no buffer of zero bytes).
  const Tensor cos = sz.rot > 0 ? cos_in.contiguous() : at::zeros({1}, x_in.options());
  const Tensor sin = sz.rot > 0 ? sin_in.contiguous() : at::zeros({1}, x_in.options());
  call.launches.push_back(make_launch(op, hebrus::metal::kernel_name(op, "", type), {x, weight, cos, sin, out},
                                      {false, false, false, false, true}, plan.params, plan.dispatch));
  return call;
}

// ---- sigmoid_gate (issue 37) --------------------------------------------------------------------------
// One launch (mps_kernels/sigmoid_gate.metal); no value to check. The gate is read in place through the
// strides of its first two dims (a copy only where its last dim is not contiguous).
inline Call sigmoid_gate(const Tensor& x_in, const Tensor& gate_in, c10::DeviceType device) {
  const char* op = "sigmoid_gate";
  check_on_device(op, device, {{"x", &x_in}, {"gate", &gate_in}});
  const SigmoidGateSizes sz = check_sigmoid_gate_args(x_in, gate_in);
  const char* type = metal_type(op, x_in.scalar_type());
  Call call;
  Tensor out = at::empty({sz.tokens, sz.heads, sz.dim}, x_in.options());
  call.outputs = {out};
  if (out.numel() == 0) return call;
  const Tensor gate = last_dim_contiguous(gate_in);
  const auto plan = hebrus::metal::plan_sigmoid_gate(sz.tokens, sz.heads, sz.dim, gate.stride(0), gate.stride(1));
  check_plan(op, plan.error);
  call.launches.push_back(make_launch(op, hebrus::metal::kernel_name(op, "", type), {x_in.contiguous(), gate, out},
                                      {false, false, true}, plan.params, plan.dispatch));
  return call;
}

// ---- gdn_delta_rule / gdn_delta_rule_slots ---------------------------------------------------------
// One kernel body for both (mps_kernels/gdn_delta_rule.metal). The state (pool) is bound as it is,
// contiguous and checked by gdn_checks.h, and updated in place; cu_seqlens and the slot ids are the
// kernel's to check. The kernel runs in q's dtype when q, k and v share it; otherwise q, k and v are
// widened to fp32 (exact) and the fp32 output is narrowed to v's dtype by gdn_result, the one rounding
// the CPU kernel does too. g and beta are read as fp32 (widened here: [T, Hv], exact).

inline Call gdn_delta_rule_launches(const char* op, bool with_slots, const Tensor& q_in, const Tensor& k_in,
                                    const Tensor& v_in, const Tensor& g_in, const Tensor& beta_in,
                                    const Tensor& cu_in, const Tensor& state, const Tensor* slots_in,
                                    const GdnSizes& sz, double scale, bool use_qk_l2norm) {
  const bool same = q_in.scalar_type() == v_in.scalar_type();
  const at::ScalarType kernel_dtype = same ? v_in.scalar_type() : at::kFloat;
  const char* type = metal_type(op, kernel_dtype);
  const auto plan = hebrus::metal::plan_gdn_delta_rule(sz.total, sz.batch, sz.hk, sz.hv, sz.dk, sz.dv, sz.pool,
                                                       scale, use_qk_l2norm);
  check_plan(op, plan.error);
  const char* stem = "gdn_delta_rule";  // both ops' kernels live in mps_kernels/gdn_delta_rule.metal
  Call call;
  if (sz.batch == 0) {  // no threadgroup would look at cu_seqlens (or the slots): the check kernel does
    if (with_slots) {
      Launch l = check_slots_launch(op, cu_in, *slots_in, nullptr, sz.total, sz.pool);
      l.stem = stem;
      call.launches.push_back(std::move(l));
    } else {
      call.launches.push_back(check_cu_launch(op, cu_in, sz.total));
    }
    call.outputs = {at::empty({sz.total, sz.hv, sz.dv}, v_in.options().dtype(kernel_dtype))};
    return call;
  }
  const Tensor q = q_in.to(kernel_dtype).contiguous(), k = k_in.to(kernel_dtype).contiguous();
  const Tensor v = v_in.to(kernel_dtype).contiguous();
  const Tensor g = g_in.to(at::kFloat).contiguous(), beta = beta_in.to(at::kFloat).contiguous();
  const Tensor cu = cu_in.contiguous();
  Tensor out = at::empty({sz.total, sz.hv, sz.dv}, v.options());
  const std::string name = hebrus::metal::kernel_name(op, plan.variant, type);
  if (with_slots) {
    const Tensor slots = slots_in->contiguous();
    call.launches.push_back(make_launch(stem, name,
                                        {q, k, v, g, beta, cu, state, slots, out},
                                        {false, false, false, false, false, false, true, false, true}, plan.params,
                                        plan.dispatch, {false, false, false, false, false, false, true, false, false}));
  } else {
    call.launches.push_back(make_launch(stem, name, {q, k, v, g, beta, cu, state, out},
                                        {false, false, false, false, false, false, true, true}, plan.params,
                                        plan.dispatch, {false, false, false, false, false, false, true, false}));
  }
  call.outputs = {out};
  return call;
}

inline Call gdn_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                           const Tensor& cu_seqlens, const Tensor& state, double scale, bool use_qk_l2norm,
                           c10::DeviceType device) {
  const char* op = "gdn_delta_rule";
  check_on_device(op, device, {{"q", &q}, {"k", &k}, {"v", &v}, {"g", &g}, {"beta", &beta},
                               {"cu_seqlens", &cu_seqlens}, {"state", &state}});
  const GdnSizes sz = check_gdn_delta_rule_args(q, k, v, g, beta, cu_seqlens, state);
  return gdn_delta_rule_launches(op, false, q, k, v, g, beta, cu_seqlens, state, nullptr, sz, scale, use_qk_l2norm);
}

inline Call gdn_delta_rule_slots(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                 const Tensor& beta, const Tensor& cu_seqlens, const Tensor& state_pool,
                                 const Tensor& slots, double scale, bool use_qk_l2norm, c10::DeviceType device) {
  const char* op = "gdn_delta_rule_slots";
  check_on_device(op, device, {{"q", &q}, {"k", &k}, {"v", &v}, {"g", &g}, {"beta", &beta},
                               {"cu_seqlens", &cu_seqlens}, {"state_pool", &state_pool}, {"slots", &slots}});
  const GdnSizes sz = check_gdn_delta_rule_slots_args(q, k, v, g, beta, cu_seqlens, state_pool, slots);
  return gdn_delta_rule_launches(op, true, q, k, v, g, beta, cu_seqlens, state_pool, &slots, sz, scale,
                                 use_qk_l2norm);
}

// The op's result once the launches ran: the kernel's output in v's dtype (a copy only where the
// kernel ran in fp32 for mixed dtypes).
inline Tensor gdn_result(const Call& call, const Tensor& v) {
  const Tensor& out = call.outputs[0];
  return out.scalar_type() == v.scalar_type() ? out : out.to(v.scalar_type());
}

// ---- gdn_chunk_delta_rule_slots ----------------------------------------------------------------------
// The gated delta rule in the chunked form aligned to absolute positions (hebrus_torch/gdn/chunked.py),
// row b reading and updating state_pool[slots[b]] in place. The grid is sized from shapes (B, Hv, Dv);
// cu_seqlens, start_pos and the slots are the kernel's to check (nothing is read here); the metadata
// checks are gdn_checks.h's, the CPU kernel's.

// gdn_chunk_delta_rule_slots_check (B == 0): cu_seqlens must be [0] and T == 0.
inline Launch gdn_chunk_check_launch(const Tensor& cu, const Tensor& slots, int64_t total, int64_t pool) {
  const auto plan = hebrus::metal::plan_check_slots(total, cu.size(0) - 1, pool, 0);
  check_plan("gdn_chunk_delta_rule_slots", plan.error);
  return make_launch("gdn_chunk_delta_rule", "gdn_chunk_delta_rule_slots_check", {cu.contiguous(), slots.contiguous()},
                     {false, false}, plan.params, plan.dispatch);
}

inline Call gdn_chunk_delta_rule_slots(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const Tensor& g_in,
                                       const Tensor& beta_in, const Tensor& cu_in, const Tensor& start_pos_in,
                                       const Tensor& pool, const Tensor& slots_in, double scale, bool use_qk_l2norm,
                                       c10::DeviceType device) {
  const char* op = "gdn_chunk_delta_rule_slots";
  const char* stem = "gdn_chunk_delta_rule";  // mps_kernels/gdn_chunk_delta_rule.metal
  check_on_device(op, device, {{"q", &q_in}, {"k", &k_in}, {"v", &v_in}, {"g", &g_in}, {"beta", &beta_in},
                               {"cu_seqlens", &cu_in}, {"start_pos", &start_pos_in}, {"state_pool", &pool},
                               {"slots", &slots_in}});
  const GdnSizes sz = check_gdn_chunk_delta_rule_slots_args(q_in, k_in, v_in, g_in, beta_in, cu_in, start_pos_in,
                                                            pool, slots_in);
  // The kernel runs in q's dtype when v shares it, else in fp32 (q, k, v widened: exact; the fp32 output
  // is narrowed to v's dtype by the caller, the one rounding the CPU kernel does too). g and beta are
  // read in the kernel's dtype when both have it, else as fp32 (widened: exact; variant gf32).
  const at::ScalarType kt = q_in.scalar_type() == v_in.scalar_type() ? q_in.scalar_type() : at::kFloat;
  const at::ScalarType gt = g_in.scalar_type() == kt && beta_in.scalar_type() == kt ? kt : at::kFloat;
  const char* type = metal_type(op, kt);
  const char* variant = gt != kt ? "gf32" : "";
  Call call;
  if (sz.batch == 0) {  // no threadgroup would look at cu_seqlens: the check kernel does (T must be 0)
    call.launches.push_back(gdn_chunk_check_launch(cu_in, slots_in, sz.total, sz.pool));
    call.outputs = {at::empty({sz.total, sz.hv, sz.dv}, v_in.options().dtype(kt))};
    return call;
  }
  const auto plan = hebrus::metal::plan_gdn_chunk_delta_rule_slots(
      sz.total, sz.batch, sz.hk, sz.hv, sz.dk, sz.dv, sz.pool, scale, use_qk_l2norm);
  check_plan(op, plan.error);
  const Tensor q = q_in.to(kt).contiguous(), k = k_in.to(kt).contiguous(), v = v_in.to(kt).contiguous();
  const Tensor g = g_in.to(gt).contiguous(), beta = beta_in.to(gt).contiguous(), cu = cu_in.contiguous();
  const Tensor start_pos = start_pos_in.contiguous(), slots = slots_in.contiguous();
  Tensor out = at::empty_like(v);
  call.launches.push_back(make_launch(stem, hebrus::metal::kernel_name(op, variant, type),
                                      {q, k, v, g, beta, cu, start_pos, pool, slots, out},
                                      {false, false, false, false, false, false, false, true, false, true},
                                      plan.params, plan.dispatch,
                                      {false, false, false, false, false, false, false, true, false, false}));
  call.outputs = {out};
  return call;
}

// ---- moe_experts, moe_experts_quantized ---------------------------------------------------------------

// What both ops' launches share: the ids and router weights converted on the device (int64, fp32), never
// read here; the fp32 scratch act [T * k, I] and ywt [T * k, H]; on the grouped path the route's pair lists
// order [T * k] and tile table tiles [1 + 3 * max_tiles] (int64, written on the device); the output; the plan.
struct MoeBuffers {
  Tensor ids, weights, act, ywt, out, order, tiles;
  hebrus::metal::MoeExpertsPlan plan;
};

inline MoeBuffers moe_buffers(const char* op, const Tensor& x, const Tensor& ids_in, const Tensor& weights_in,
                              const MoeSizes& sz, int64_t group_size) {
  MoeBuffers b;
  b.plan = hebrus::metal::plan_moe_experts(sz.rows, sz.hidden, sz.top_k, sz.experts, sz.inter,
                                           weights_in.scalar_type() == x.scalar_type(), group_size);
  check_plan(op, b.plan.error);
  b.ids = ids_in.to(at::kLong).contiguous();
  b.weights = weights_in.to(at::kFloat).contiguous();
  const int64_t pairs = sz.rows * sz.top_k;
  b.act = at::empty({pairs, sz.inter}, x.options().dtype(at::kFloat));
  b.ywt = at::empty({pairs, sz.hidden}, x.options().dtype(at::kFloat));
  b.out = at::empty({sz.rows, sz.hidden}, x.options());
  if (b.plan.grouped) {
    b.order = at::empty({pairs}, x.options().dtype(at::kLong));
    b.tiles = at::empty({1 + 3 * b.plan.params.max_tiles}, x.options().dtype(at::kLong));
  }
  return b;
}

// The grouped path's first launch: moe_experts.metal's moe_experts_route (one threadgroup), which lists the
// pairs by expert and reports bad ids for both ops.
inline Launch moe_route_launch(const MoeBuffers& b) {
  return make_launch("moe_experts", "moe_experts_route", {b.ids, b.order, b.tiles}, {false, true, true},
                     b.plan.params, b.plan.route);
}

// The last launch of both ops: moe_experts.metal's moe_experts_sum over the weighted outputs.
inline Launch moe_sum_launch(const MoeBuffers& b, const char* type) {
  return make_launch("moe_experts", hebrus::metal::kernel_name("moe_experts_sum", nullptr, type), {b.ywt, b.out},
                     {false, true}, b.plan.params, b.plan.sum);
}

// Launches from shapes only, whatever the experts hit (mps_kernels/moe_experts.metal): decode (the gather
// GEMV) act, down, sum; grouped (hebrus::metal::moe_grouped: T * k >= max(E, 16)) route, act_grouped,
// down_grouped, sum. Both give the same bits. Bad ids are reported by act (decode) or route (grouped).
inline Call moe_experts(const Tensor& x_in, const Tensor& ids_in, const Tensor& weights_in, const Tensor& gate_up_in,
                        const Tensor& down_in, c10::DeviceType device) {
  const char* op = "moe_experts";
  check_on_device(op, device, {{"x", &x_in}, {"topk_ids", &ids_in}, {"topk_weights", &weights_in},
                               {"gate_up", &gate_up_in}, {"down", &down_in}});
  const MoeSizes sz = check_moe_experts_args(x_in, ids_in, weights_in, gate_up_in, down_in);
  const char* type = metal_type(op, x_in.scalar_type());
  Call call;
  if (sz.rows == 0 || sz.hidden == 0 || sz.top_k == 0) {
    call.outputs = {at::zeros({sz.rows, sz.hidden}, x_in.options())};
    return call;
  }
  const Tensor x = x_in.contiguous(), gate_up = gate_up_in.contiguous(), down = down_in.contiguous();
  const MoeBuffers b = moe_buffers(op, x, ids_in, weights_in, sz, 0);
  using hebrus::metal::kernel_name;
  if (b.plan.grouped) {
    call.launches.push_back(moe_route_launch(b));
    call.launches.push_back(make_launch(op, kernel_name("moe_experts_act_grouped", nullptr, type),
                                        {x, b.order, b.tiles, gate_up, b.act}, {false, false, false, false, true},
                                        b.plan.params, b.plan.act));
    call.launches.push_back(make_launch(op, kernel_name("moe_experts_down_grouped", nullptr, type),
                                        {b.order, b.tiles, b.weights, down, b.act, b.ywt},
                                        {false, false, false, false, false, true}, b.plan.params, b.plan.down));
  } else {
    call.launches.push_back(make_launch(op, kernel_name("moe_experts_act", nullptr, type),
                                        {x, b.ids, gate_up, b.act}, {false, false, false, true}, b.plan.params,
                                        b.plan.act));
    call.launches.push_back(make_launch(op, kernel_name("moe_experts_down", nullptr, type),
                                        {b.ids, b.weights, down, b.act, b.ywt}, {false, false, false, false, true},
                                        b.plan.params, b.plan.down));
  }
  call.launches.push_back(moe_sum_launch(b, type));
  call.outputs = {b.out};
  return call;
}

// quantized_linear: one launch of moe_experts_quantized.metal's quantized_linear (variant q4 / q8), or of
// quantized_linear_tiled from T >= 16 rows (hebrus::metal::plan_quantized_linear; the same bits).
inline Call quantized_linear(const Tensor& x_in, const Tensor& wq_in, const Tensor& scales_in, const Tensor& biases_in,
                             int64_t group_size, int64_t bits, c10::DeviceType device) {
  const char* op = "quantized_linear";
  check_on_device(op, device, {{"x", &x_in}, {"wq", &wq_in}, {"scales", &scales_in}, {"biases", &biases_in}});
  const QuantLinearSizes sz = check_quantized_linear_args(x_in, wq_in, scales_in, biases_in, group_size, bits);
  const char* type = metal_type(op, x_in.scalar_type());
  Call call;
  if (sz.rows == 0 || sz.out == 0 || sz.in == 0) {
    call.outputs = {at::zeros({sz.rows, sz.out}, x_in.options())};
    return call;
  }
  const hebrus::metal::QuantLinearPlan plan = hebrus::metal::plan_quantized_linear(sz.rows, sz.in, sz.out, group_size);
  check_plan(op, plan.error);
  const Tensor x = x_in.contiguous(), wq = wq_in.contiguous(), scales = scales_in.contiguous(),
               biases = biases_in.contiguous();
  const Tensor out = at::empty({sz.rows, sz.out}, x.options());
  call.launches.push_back(make_launch("moe_experts_quantized",
                                      hebrus::metal::kernel_name(plan.tiled ? "quantized_linear_tiled" : op,
                                                                 bits == 4 ? "q4" : "q8", type),
                                      {x, wq, scales, biases, out}, {false, false, false, false, true}, plan.params,
                                      plan.dispatch));
  call.outputs = {out};
  return call;
}

// moe_experts over quantized experts (mps_kernels/moe_experts_quantized.metal, variant q4 / q8; on the grouped
// path after the dense op's route launch), then the dense op's sum launch.
inline Call moe_experts_quantized(const Tensor& x_in, const Tensor& ids_in, const Tensor& weights_in,
                                  const Tensor& gate_up_q_in, const Tensor& gate_up_scales_in,
                                  const Tensor& gate_up_biases_in, const Tensor& down_q_in,
                                  const Tensor& down_scales_in, const Tensor& down_biases_in, int64_t group_size,
                                  int64_t bits, c10::DeviceType device) {
  const char* op = "moe_experts_quantized";
  check_on_device(op, device, {{"x", &x_in}, {"topk_ids", &ids_in}, {"topk_weights", &weights_in},
                               {"gate_up_q", &gate_up_q_in}, {"gate_up_scales", &gate_up_scales_in},
                               {"gate_up_biases", &gate_up_biases_in}, {"down_q", &down_q_in},
                               {"down_scales", &down_scales_in}, {"down_biases", &down_biases_in}});
  const MoeSizes sz = check_moe_experts_quantized_args(x_in, ids_in, weights_in, gate_up_q_in, gate_up_scales_in,
                                                       gate_up_biases_in, down_q_in, down_scales_in, down_biases_in,
                                                       group_size, bits);
  const char* type = metal_type(op, x_in.scalar_type());
  Call call;
  if (sz.rows == 0 || sz.hidden == 0 || sz.top_k == 0) {
    call.outputs = {at::zeros({sz.rows, sz.hidden}, x_in.options())};
    return call;
  }
  const Tensor x = x_in.contiguous(), gate_up_q = gate_up_q_in.contiguous(),
               gate_up_scales = gate_up_scales_in.contiguous(), gate_up_biases = gate_up_biases_in.contiguous(),
               down_q = down_q_in.contiguous(), down_scales = down_scales_in.contiguous(),
               down_biases = down_biases_in.contiguous();
  const MoeBuffers b = moe_buffers(op, x, ids_in, weights_in, sz, group_size);
  const char* variant = bits == 4 ? "q4" : "q8";
  using hebrus::metal::kernel_name;
  if (b.plan.grouped) {
    call.launches.push_back(moe_route_launch(b));
    call.launches.push_back(make_launch(op, kernel_name("moe_experts_quantized_act_grouped", variant, type),
                                        {x, b.order, b.tiles, gate_up_q, gate_up_scales, gate_up_biases, b.act},
                                        {false, false, false, false, false, false, true}, b.plan.params, b.plan.act));
    call.launches.push_back(make_launch(op, kernel_name("moe_experts_quantized_down_grouped", variant, type),
                                        {b.order, b.tiles, b.weights, down_q, down_scales, down_biases, b.act, b.ywt},
                                        {false, false, false, false, false, false, false, true}, b.plan.params,
                                        b.plan.down));
  } else {
    call.launches.push_back(make_launch(op, kernel_name("moe_experts_quantized_act", variant, type),
                                        {x, b.ids, gate_up_q, gate_up_scales, gate_up_biases, b.act},
                                        {false, false, false, false, false, true}, b.plan.params, b.plan.act));
    call.launches.push_back(make_launch(op, kernel_name("moe_experts_quantized_down", variant, type),
                                        {b.ids, b.weights, down_q, down_scales, down_biases, b.act, b.ywt},
                                        {false, false, false, false, false, false, true}, b.plan.params,
                                        b.plan.down));
  }
  call.launches.push_back(moe_sum_launch(b, type));
  call.outputs = {b.out};
  return call;
}

// ---- moe_route (issue 37) ------------------------------------------------------------------------------
// One launch (mps_kernels/moe_route.metal); no value to check. Without shared gate logits the router logits
// are bound again in their place (the kernel reads S = 0 of them).
inline Call moe_route(const Tensor& logits_in, const std::optional<Tensor>& shared_in, int64_t top_k, bool norm,
                      c10::DeviceType device) {
  const char* op = "moe_route";
  const Tensor* shared_ptr = shared_in.has_value() ? &*shared_in : nullptr;
  if (shared_ptr != nullptr) {
    check_on_device(op, device, {{"router_logits", &logits_in}, {"shared_gate_logits", shared_ptr}});
  } else {
    check_on_device(op, device, {{"router_logits", &logits_in}});
  }
  const MoeRouteSizes sz = check_moe_route_args(logits_in, shared_ptr, top_k);
  const char* type = metal_type(op, logits_in.scalar_type());
  Call call;
  const Tensor ids = at::empty({sz.rows, sz.top_k}, logits_in.options().dtype(at::kLong));
  const Tensor weights = at::empty({sz.rows, sz.top_k + sz.shared}, logits_in.options());
  call.outputs = {ids, weights};
  if (sz.rows == 0) return call;
  const auto plan = hebrus::metal::plan_moe_route(sz.rows, sz.experts, sz.top_k, sz.shared, norm);
  check_plan(op, plan.error);
  const Tensor logits = logits_in.contiguous();
  const Tensor shared = shared_ptr != nullptr ? shared_ptr->contiguous() : logits;
  call.launches.push_back(make_launch(op, hebrus::metal::kernel_name(op, "", type), {logits, shared, ids, weights},
                                      {false, false, true, true}, plan.params, plan.dispatch));
  return call;
}

// ---- moe_shared_expert (issue 37) ----------------------------------------------------------------------
// Two launches (act, down: mps_kernels/moe_shared_expert.metal); no value to check. The gate [T, 1] is bound as
// it is (moe_route's last column is a strided view) with its row stride in the parameter block.
inline Call moe_shared_expert(const Tensor& x_in, const Tensor& routed_in, const Tensor& gate_proj_in,
                              const Tensor& up_proj_in, const Tensor& down_proj_in, const Tensor& gate_in,
                              c10::DeviceType device) {
  const char* op = "moe_shared_expert";
  check_on_device(op, device, {{"x", &x_in}, {"routed", &routed_in}, {"gate_proj", &gate_proj_in},
                               {"up_proj", &up_proj_in}, {"down_proj", &down_proj_in}, {"gate", &gate_in}});
  const MoeSharedSizes sz = check_moe_shared_expert_args(x_in, routed_in, gate_proj_in, up_proj_in, down_proj_in,
                                                         gate_in);
  const char* type = metal_type(op, x_in.scalar_type());
  Call call;
  if (sz.rows == 0 || sz.hidden == 0) {
    call.outputs = {at::empty({sz.rows, sz.hidden}, x_in.options())};
    return call;
  }
  const auto plan = hebrus::metal::plan_moe_shared_expert(sz.rows, sz.hidden, sz.inter, gate_in.stride(0));
  check_plan(op, plan.error);
  const Tensor x = x_in.contiguous(), routed = routed_in.contiguous(), gate_proj = gate_proj_in.contiguous(),
               up_proj = up_proj_in.contiguous(), down_proj = down_proj_in.contiguous();
  const Tensor act = at::empty({sz.rows, sz.inter}, x.options().dtype(at::kFloat));
  const Tensor out = at::empty({sz.rows, sz.hidden}, x.options());
  using hebrus::metal::kernel_name;
  call.launches.push_back(make_launch(op, kernel_name("moe_shared_expert_act", nullptr, type),
                                      {x, gate_proj, up_proj, act}, {false, false, false, true}, plan.params,
                                      plan.act));
  call.launches.push_back(make_launch(op, kernel_name("moe_shared_expert_down", nullptr, type),
                                      {down_proj, act, gate_in, routed, out}, {false, false, false, false, true},
                                      plan.params, plan.down));
  call.outputs = {out};
  return call;
}

// ---- moe_shared_expert_quantized (issue 37) --------------------------------------------------------------
// moe_shared_expert's two launches over quantized projections (moe_shared_expert.metal's
// moe_shared_expert_quantized_act / _down, variant q4 / q8); no value to check. The gate is bound as it is.
inline Call moe_shared_expert_quantized(const Tensor& x_in, const Tensor& routed_in, const Tensor& gate_proj_q_in,
                                        const Tensor& gate_proj_scales_in, const Tensor& gate_proj_biases_in,
                                        const Tensor& up_proj_q_in, const Tensor& up_proj_scales_in,
                                        const Tensor& up_proj_biases_in, const Tensor& down_proj_q_in,
                                        const Tensor& down_proj_scales_in, const Tensor& down_proj_biases_in,
                                        const Tensor& gate_in, int64_t group_size, int64_t bits,
                                        c10::DeviceType device) {
  const char* op = "moe_shared_expert_quantized";
  check_on_device(op, device,
                  {{"x", &x_in}, {"routed", &routed_in}, {"gate_proj_q", &gate_proj_q_in},
                   {"gate_proj_scales", &gate_proj_scales_in}, {"gate_proj_biases", &gate_proj_biases_in},
                   {"up_proj_q", &up_proj_q_in}, {"up_proj_scales", &up_proj_scales_in},
                   {"up_proj_biases", &up_proj_biases_in}, {"down_proj_q", &down_proj_q_in},
                   {"down_proj_scales", &down_proj_scales_in}, {"down_proj_biases", &down_proj_biases_in},
                   {"gate", &gate_in}});
  const MoeSharedSizes sz = check_moe_shared_expert_quantized_args(
      x_in, routed_in, gate_proj_q_in, gate_proj_scales_in, gate_proj_biases_in, up_proj_q_in, up_proj_scales_in,
      up_proj_biases_in, down_proj_q_in, down_proj_scales_in, down_proj_biases_in, gate_in, group_size, bits);
  const char* type = metal_type(op, x_in.scalar_type());
  Call call;
  if (sz.rows == 0 || sz.hidden == 0) {
    call.outputs = {at::empty({sz.rows, sz.hidden}, x_in.options())};
    return call;
  }
  const auto plan = hebrus::metal::plan_moe_shared_expert(sz.rows, sz.hidden, sz.inter, gate_in.stride(0), group_size);
  check_plan(op, plan.error);
  const Tensor x = x_in.contiguous(), routed = routed_in.contiguous();
  const Tensor gate_proj_q = gate_proj_q_in.contiguous(), gate_proj_scales = gate_proj_scales_in.contiguous(),
               gate_proj_biases = gate_proj_biases_in.contiguous(), up_proj_q = up_proj_q_in.contiguous(),
               up_proj_scales = up_proj_scales_in.contiguous(), up_proj_biases = up_proj_biases_in.contiguous(),
               down_proj_q = down_proj_q_in.contiguous(), down_proj_scales = down_proj_scales_in.contiguous(),
               down_proj_biases = down_proj_biases_in.contiguous();
  const Tensor act = at::empty({sz.rows, sz.inter}, x.options().dtype(at::kFloat));
  const Tensor out = at::empty({sz.rows, sz.hidden}, x.options());
  using hebrus::metal::kernel_name;
  const char* variant = bits == 4 ? "q4" : "q8";
  call.launches.push_back(make_launch("moe_shared_expert", kernel_name("moe_shared_expert_quantized_act", variant, type),
                                      {x, gate_proj_q, gate_proj_scales, gate_proj_biases, up_proj_q, up_proj_scales,
                                       up_proj_biases, act},
                                      {false, false, false, false, false, false, false, true}, plan.params, plan.act));
  call.launches.push_back(make_launch("moe_shared_expert",
                                      kernel_name("moe_shared_expert_quantized_down", variant, type),
                                      {down_proj_q, down_proj_scales, down_proj_biases, act, gate_in, routed, out},
                                      {false, false, false, false, false, false, true}, plan.params, plan.down));
  call.outputs = {out};
  return call;
}

// ---- hc_rms_norm (issue 37) ----------------------------------------------------------------------------
// One launch (mps_kernels/hc_rms_norm.metal); no value to check, so nothing for the error buffer.
inline Call hc_rms_norm(const Tensor& x_in, const Tensor& weight_in, int64_t group_size, double eps,
                        c10::DeviceType device) {
  const char* op = "hc_rms_norm";
  check_on_device(op, device, {{"x", &x_in}, {"weight", &weight_in}});
  const HcRmsNormSizes sz = check_hc_rms_norm_args(x_in, weight_in, group_size, eps);
  const char* type = metal_type(op, x_in.scalar_type());
  Call call;
  if (sz.rows == 0) {
    call.outputs = {at::empty_like(x_in, at::MemoryFormat::Contiguous)};
    return call;
  }
  const auto plan = hebrus::metal::plan_hc_rms_norm(sz.rows, sz.dim, sz.group, eps);
  check_plan(op, plan.error);
  const Tensor x = x_in.contiguous();
  const Tensor weight = weight_in.to(at::kFloat).contiguous();  // exact; the kernel reads fp32 (1 + w)
  Tensor out = at::empty_like(x);
  call.launches.push_back(make_launch(op, hebrus::metal::kernel_name(op, "", type), {x, weight, out},
                                      {false, false, true}, plan.params, plan.dispatch));
  call.outputs = {out};
  return call;
}

// ---- gdn_gates, gdn_gated_rms_norm (issue 37) -------------------------------------------------------------
// One launch each (mps_kernels/gdn_fused.metal); no value to check, so nothing for the error buffer. The
// [Hv] / [D] parameter vectors are bound in their own dtype (no cast launched: the kernel widens them).

// The kernels' code of a parameter vector's dtype (gdn_fused.metal: gdn_param).
inline int gdn_param_dtype(const Tensor& t) {
  return t.scalar_type() == at::kHalf ? 1 : t.scalar_type() == at::kBFloat16 ? 2 : 0;
}

inline Call gdn_gates(const Tensor& a_in, const Tensor& b_in, const Tensor& A_log_in, const Tensor& dt_bias_in,
                      c10::DeviceType device) {
  const char* op = "gdn_gates";
  check_on_device(op, device, {{"a", &a_in}, {"b", &b_in}, {"A_log", &A_log_in}, {"dt_bias", &dt_bias_in}});
  const GdnRowsSizes sz = check_gdn_gates_args(a_in, b_in, A_log_in, dt_bias_in);
  const char* type = metal_type(op, a_in.scalar_type());
  Call call;
  const auto fp32 = a_in.options().dtype(at::kFloat);
  if (sz.rows == 0 || sz.dim == 0) {
    call.outputs = {at::empty(a_in.sizes(), fp32), at::empty(a_in.sizes(), fp32)};
    return call;
  }
  const auto plan = hebrus::metal::plan_gdn_gates(sz.rows, sz.dim, gdn_param_dtype(A_log_in),
                                                  gdn_param_dtype(dt_bias_in));
  check_plan(op, plan.error);
  const Tensor a = a_in.contiguous(), b = b_in.contiguous();
  const Tensor A_log = A_log_in.contiguous(), dt_bias = dt_bias_in.contiguous();
  Tensor g = at::empty(a_in.sizes(), fp32), beta = at::empty(a_in.sizes(), fp32);
  call.launches.push_back(make_launch("gdn_fused", hebrus::metal::kernel_name(op, "", type),
                                      {a, b, A_log, dt_bias, g, beta}, {false, false, false, false, true, true},
                                      plan.params, plan.dispatch));
  call.outputs = {g, beta};
  return call;
}

inline Call gdn_gated_rms_norm(const Tensor& x_in, const Tensor& gate_in, const Tensor& weight_in, double eps,
                               c10::string_view activation, c10::DeviceType device) {
  const char* op = "gdn_gated_rms_norm";
  check_on_device(op, device, {{"x", &x_in}, {"gate", &gate_in}, {"weight", &weight_in}});
  const GdnRowsSizes sz = check_gdn_gated_rms_norm_args(x_in, gate_in, weight_in, eps, activation);
  const char* type = metal_type(op, x_in.scalar_type());
  Call call;
  if (sz.rows == 0 || sz.dim == 0) {
    call.outputs = {at::empty_like(x_in, at::MemoryFormat::Contiguous)};
    return call;
  }
  // The module's weight * norm has dtype promote(weight, x): x's (rounded) when the weight has x's dtype
  // or x is fp32, else fp32 (bf16 x fp16, or an fp32 weight of bf16 / fp16 activations).
  const bool round_product = weight_in.scalar_type() == x_in.scalar_type() && x_in.scalar_type() != at::kFloat;
  const auto plan = hebrus::metal::plan_gdn_gated_rms_norm(sz.rows, sz.dim, eps, gdn_param_dtype(weight_in),
                                                           round_product, activation == "sigmoid");
  check_plan(op, plan.error);
  const Tensor x = x_in.contiguous(), gate = gate_in.contiguous(), weight = weight_in.contiguous();
  Tensor out = at::empty_like(x);
  call.launches.push_back(make_launch("gdn_fused", hebrus::metal::kernel_name(op, "", type), {x, gate, weight, out},
                                      {false, false, false, true}, plan.params, plan.dispatch));
  call.outputs = {out};
  return call;
}

// ---- hc_premix, hc_post_combine (issue 37) ---------------------------------------------------------------
// What hc_premix and hc_premix_quantized allocate: the outputs (mixed [T, hidden], weights [T, hc] or [T, 0]) and,
// for T > 0, the launches' fp32 scratch inv [T, hc] and low [T, R] and the low launch's weights buffer (a 1-entry
// scratch without inject).
struct HcPremixBuffers {
  int64_t injects = 0;
  Tensor mixed, weights, inv, low, weights_out;
};

inline HcPremixBuffers hc_premix_buffers(const HcPremixSizes& sz, const Tensor& h) {
  HcPremixBuffers b;
  b.injects = sz.has_inject ? sz.hc : 0;
  b.mixed = at::empty({sz.rows, sz.hidden}, h.options());
  b.weights = at::empty({sz.rows, b.injects}, h.options());
  if (sz.rows == 0) return b;
  b.inv = at::empty({sz.rows, sz.hc}, h.options().dtype(at::kFloat));
  b.low = at::empty({sz.rows, sz.rank}, h.options().dtype(at::kFloat));
  b.weights_out = sz.has_inject ? b.weights : at::empty({1}, h.options());
  return b;
}

// hc_premix: two launches (mps_kernels/hc_premix.metal: low, then mix) through fp32 scratch inv [T, hc] and
// low [T, R]; no value to check. Without inject the low launch reads down in its place and writes a
// 1-entry scratch, and the op returns weights [T, 0].
inline Call hc_premix(const Tensor& h_in, const Tensor& norm_weight_in, const Tensor& down_in, const Tensor& up_in,
                      const c10::optional<Tensor>& inject_in, int64_t hc_count, double eps, c10::DeviceType device) {
  const char* op = "hc_premix";
  check_on_device(op, device, {{"h", &h_in}, {"norm_weight", &norm_weight_in}, {"down", &down_in}, {"up", &up_in}});
  if (inject_in.has_value() && inject_in->defined()) {
    check_on_device(op, device, {{"h", &h_in}, {"inject", &*inject_in}});
  }
  const HcPremixSizes sz = check_hc_premix_args(h_in, norm_weight_in, down_in, up_in, inject_in, hc_count, eps);
  const char* type = metal_type(op, h_in.scalar_type());
  const HcPremixBuffers b = hc_premix_buffers(sz, h_in);
  Call call;
  call.outputs = {b.mixed, b.weights};
  if (sz.rows == 0) return call;
  const auto plan = hebrus::metal::plan_hc_premix(sz.rows, sz.hidden, sz.hc, sz.rank, b.injects, eps);
  check_plan(op, plan.error);
  const Tensor h = h_in.contiguous(), down = down_in.contiguous(), up = up_in.contiguous();
  const Tensor norm_weight = norm_weight_in.to(at::kFloat).contiguous();  // exact; the kernels read fp32 (1 + w)
  const Tensor inject = sz.has_inject ? inject_in->contiguous() : down;
  using hebrus::metal::kernel_name;
  call.launches.push_back(make_launch(op, kernel_name("hc_premix_low", nullptr, type),
                                      {h, norm_weight, down, inject, b.inv, b.low, b.weights_out},
                                      {false, false, false, false, true, true, true}, plan.params, plan.low));
  call.launches.push_back(make_launch(op, kernel_name("hc_premix_mix", nullptr, type),
                                      {h, norm_weight, up, b.inv, b.low, b.mixed},
                                      {false, false, false, false, false, true}, plan.params, plan.mix));
  return call;
}

// hc_premix_quantized: hc_premix's two launches with the quantized kernels (hc_premix_quantized_low / _mix,
// variant q4 / q8) reading each projection's codes, scales and biases; without inject the low launch reads down's
// three in its place.
inline Call hc_premix_quantized(const Tensor& h_in, const Tensor& norm_weight_in, const Tensor& down_q_in,
                                const Tensor& down_scales_in, const Tensor& down_biases_in, const Tensor& up_q_in,
                                const Tensor& up_scales_in, const Tensor& up_biases_in,
                                const c10::optional<Tensor>& inject_q_in, const c10::optional<Tensor>& inject_scales_in,
                                const c10::optional<Tensor>& inject_biases_in, int64_t hc_count, double eps,
                                int64_t group_size, int64_t bits, c10::DeviceType device) {
  const char* op = "hc_premix_quantized";
  const c10::optional<HcQuantProjection> inject_in = hc_quant_inject(inject_q_in, inject_scales_in, inject_biases_in);
  check_on_device(op, device, {{"h", &h_in}, {"norm_weight", &norm_weight_in}, {"down_q", &down_q_in},
                               {"down_scales", &down_scales_in}, {"down_biases", &down_biases_in}, {"up_q", &up_q_in},
                               {"up_scales", &up_scales_in}, {"up_biases", &up_biases_in}});
  if (inject_in.has_value()) {
    check_on_device(op, device, {{"h", &h_in}, {"inject_q", inject_in->q}, {"inject_scales", inject_in->scales},
                                 {"inject_biases", inject_in->biases}});
  }
  const HcPremixSizes sz = check_hc_premix_quantized_args(
      h_in, norm_weight_in, {"down", &down_q_in, &down_scales_in, &down_biases_in},
      {"up", &up_q_in, &up_scales_in, &up_biases_in}, inject_in, hc_count, eps, group_size, bits);
  const char* type = metal_type(op, h_in.scalar_type());
  const HcPremixBuffers b = hc_premix_buffers(sz, h_in);
  Call call;
  call.outputs = {b.mixed, b.weights};
  if (sz.rows == 0) return call;
  const auto plan = hebrus::metal::plan_hc_premix(sz.rows, sz.hidden, sz.hc, sz.rank, b.injects, eps, group_size);
  check_plan(op, plan.error);
  const Tensor h = h_in.contiguous(), down_q = down_q_in.contiguous(), down_scales = down_scales_in.contiguous(),
               down_biases = down_biases_in.contiguous(), up_q = up_q_in.contiguous(),
               up_scales = up_scales_in.contiguous(), up_biases = up_biases_in.contiguous();
  const Tensor norm_weight = norm_weight_in.to(at::kFloat).contiguous();  // exact; the kernels read fp32 (1 + w)
  const Tensor inject_q = sz.has_inject ? inject_in->q->contiguous() : down_q;
  const Tensor inject_scales = sz.has_inject ? inject_in->scales->contiguous() : down_scales;
  const Tensor inject_biases = sz.has_inject ? inject_in->biases->contiguous() : down_biases;
  const char* variant = bits == 4 ? "q4" : "q8";
  using hebrus::metal::kernel_name;
  call.launches.push_back(make_launch("hc_premix", kernel_name("hc_premix_quantized_low", variant, type),
                                      {h, norm_weight, down_q, down_scales, down_biases, inject_q, inject_scales,
                                       inject_biases, b.inv, b.low, b.weights_out},
                                      {false, false, false, false, false, false, false, false, true, true, true},
                                      plan.params, plan.low));
  call.launches.push_back(make_launch("hc_premix", kernel_name("hc_premix_quantized_mix", variant, type),
                                      {h, norm_weight, up_q, up_scales, up_biases, b.inv, b.low, b.mixed},
                                      {false, false, false, false, false, false, false, true}, plan.params, plan.mix));
  return call;
}

// hc_post_combine: one launch of hc_premix.metal's hc_post_combine; no value to check.
inline Call hc_post_combine(const Tensor& hyper_in, const Tensor& out_in, const Tensor& inject_in,
                            c10::DeviceType device) {
  const char* op = "hc_post_combine";
  check_on_device(op, device, {{"hyper", &hyper_in}, {"out", &out_in}, {"inject", &inject_in}});
  const HcPostCombineSizes sz = check_hc_post_combine_args(hyper_in, out_in, inject_in);
  const char* type = metal_type(op, hyper_in.scalar_type());
  Tensor result = at::empty({sz.rows, sz.hc * sz.hidden}, hyper_in.options());
  Call call;
  if (result.numel() == 0) {
    call.outputs = {result};
    return call;
  }
  const auto plan = hebrus::metal::plan_hc_post_combine(sz.rows, sz.hidden, sz.hc);
  check_plan(op, plan.error);
  const Tensor hyper = hyper_in.contiguous(), out = out_in.contiguous(), inject = inject_in.contiguous();
  call.launches.push_back(make_launch("hc_premix", hebrus::metal::kernel_name(op, nullptr, type),
                                      {hyper, out, inject, result}, {false, false, false, true}, plan.params,
                                      plan.dispatch));
  call.outputs = {result};
  return call;
}

}  // namespace hebrus::glue
