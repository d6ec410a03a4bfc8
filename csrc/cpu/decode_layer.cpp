// The engine's native decoder-layer calls (issue 37): hebrus::decode_gdn_layer, decode_moe_tail,
// decode_attention_head, decode_attention_tail, decode_attention_layer and decode_ple_gate run
// what hebrus_torch/models/qwen4_exp/forward.py's packed_decoder_layer runs for a stock layer (transformers' own
// modules, the fused path of every part), op for op: the same kernels (ATen's and hebrus's), in the same order, on
// the same values, so every output and state bit equals the Python path's. What they save is the Python between the
// ops (module checks, wrappers, views): a 1-request decode step issued ~35 ops a layer from Python; now 1-3 calls.
// hebrus_torch/models/qwen4_exp/native.py decides when a layer is stock and passes its weights; the inner hebrus ops
// go through the dispatcher (their own checks, their own kernels), while the projections, views, no-op conversions
// and plane writes are made without it (dense_mm.h, undispatched.h, copy_rows): inside a step every dispatched op
// costs several times its warm cost.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "../hebrus_check.h"
#include "dense_mm.h"

namespace hebrus {
namespace {

using at::Tensor;

template <typename Sig>
c10::TypedOperatorHandle<Sig> hebrus_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

std::tuple<Tensor, Tensor> hc_premix(const Tensor& h, const Tensor& norm_weight, const Tensor& down, const Tensor& up,
                                     const Tensor& inject, int64_t hc_count, double eps) {
  static const auto op = hebrus_op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                              const Tensor&, const std::optional<Tensor>&, int64_t,
                                                              double)>("hebrus::hc_premix");
  return op.call(h, norm_weight, down, up, std::optional<Tensor>(inject), hc_count, eps);
}

Tensor hc_post_combine(const Tensor& hyper, const Tensor& out, const Tensor& inject) {
  static const auto op =
      hebrus_op<Tensor(const Tensor&, const Tensor&, const Tensor&)>("hebrus::hc_post_combine");
  return op.call(hyper, out, inject);
}

// at::linear of a bias-free projection: for 2-D x, exactly the at::mm(x, w.t()) that at::linear reaches through
// at::matmul, without those two wrappers' dispatches, by the BLAS call at::mm makes (dense_mm.h). The views below are
// made by hand (undispatched.h: ATen's views, without their dispatches).
Tensor project(const Tensor& x, const Tensor& w) {
  return x.dim() == 2 && w.dim() == 2 && x.layout() == c10::kStrided ? dense_mm(x, w) : at::linear(x, w);
}

// The layer's weights, each list in the order hebrus_torch/models/qwen4_exp/native.py builds it.
constexpr size_t kHcWeights = 4;    // hc_norm.weight, input_mix_weight_down, input_mix_weight_up, block_inject_weight
constexpr size_t kMoeWeights = 7;   // gate.weight, shared_expert_gate.weight, experts.gate_up_proj, experts.down_proj,
                                    // shared_expert.{gate_proj, up_proj, down_proj}.weight
constexpr size_t kGdnWeights = 9;   // in_proj_{qkv, z, b, a}.weight, conv1d.weight, A_log, dt_bias, norm.weight,
                                    // out_proj.weight

void check_count(const char* op, const char* what, c10::ArrayRef<Tensor> list, size_t want) {
  HEBRUS_CHECK(list.size() == want, HebrusError, "hebrus::", op, ": ", what, " must hold ", want, " tensors, got ",
               list.size());
}

// packed_moe of transformers' own block: router and shared gate linears, hebrus::moe_route, moe_experts,
// moe_shared_expert (forward.py's route / routed_experts / moe_shared_expert sequence).
Tensor moe_block(const Tensor& x, c10::ArrayRef<Tensor> w, int64_t top_k, bool norm_topk_prob) {
  static const auto route = hebrus_op<std::tuple<Tensor, Tensor>(const Tensor&, const std::optional<Tensor>&,
                                                                  int64_t, bool)>("hebrus::moe_route");
  static const auto experts = hebrus_op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                               const Tensor&)>("hebrus::moe_experts");
  static const auto shared = hebrus_op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                              const Tensor&, const Tensor&)>("hebrus::moe_shared_expert");
  const Tensor logits = project(x, w[0]);
  const Tensor shared_logit = project(x, w[1]);
  auto [ids, weights] = route.call(logits, std::optional<Tensor>(shared_logit), top_k, norm_topk_prob);
  const int64_t width = weights.size(1);
  const Tensor routed = experts.call(x, ids, last_dim_columns(weights, 0, top_k), w[2], w[3]);
  return shared.call(x, routed, w[4], w[5], w[6], last_dim_columns(weights, top_k, width - top_k));
}

// The decoder layer after its token mixer: the attention hyper-connection's post-combine, the MLP
// hyper-connection's pre-mix, the MoE block and its post-combine.
Tensor moe_tail(const Tensor& hyper, const Tensor& out, const Tensor& inject, c10::ArrayRef<Tensor> hc,
                c10::ArrayRef<Tensor> moe, int64_t hc_count, double hc_eps, int64_t top_k, bool norm_topk_prob) {
  const Tensor h = hc_post_combine(hyper, out, inject);
  auto [x, weights] = hc_premix(h, hc[0], hc[1], hc[2], hc[3], hc_count, hc_eps);
  return hc_post_combine(h, moe_block(x, moe, top_k, norm_topk_prob), weights);
}

Tensor decode_moe_tail_cpu(const Tensor& hyper, const Tensor& out, const Tensor& inject, at::TensorList mlp_hc,
                           at::TensorList moe, int64_t hc_count, double hc_eps, int64_t top_k, bool norm_topk_prob) {
  check_count("decode_moe_tail", "mlp_hc", mlp_hc, kHcWeights);
  check_count("decode_moe_tail", "moe", moe, kMoeWeights);
  return moe_tail(hyper, out, inject, mlp_hc, moe, hc_count, hc_eps, top_k, norm_topk_prob);
}

// gated_delta_net (models/qwen4_exp/gdn.py) with GDNState's conv and delta rule in their in-place slot form.
Tensor gated_delta_net(const Tensor& x, c10::ArrayRef<Tensor> w, Tensor& conv_pool, Tensor& recurrent_pool,
                       const Tensor& slots, const Tensor& cu_seqlens, c10::IntArrayRef heads, double norm_eps,
                       c10::string_view conv_activation, c10::string_view norm_activation) {
  static const auto gates = hebrus_op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                  const Tensor&)>("hebrus::gdn_gates");
  static const auto conv = hebrus_op<Tensor(const Tensor&, const Tensor&, const Tensor&, Tensor&, const Tensor&,
                                            int64_t, c10::string_view)>("hebrus::ple_conv_slots");
  static const auto delta = hebrus_op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                             const Tensor&, const Tensor&, Tensor&, const Tensor&, double, bool)>(
      "hebrus::gdn_delta_rule_slots");
  static const auto norm = hebrus_op<Tensor(const Tensor&, const Tensor&, const Tensor&, double, c10::string_view)>(
      "hebrus::gdn_gated_rms_norm");
  const int64_t t = x.size(0), hk = heads[0], hv = heads[1], dk = heads[2], dv = heads[3];
  Tensor mixed = project(x, w[0]);
  const Tensor z = project(x, w[1]);                     // [t, hv * dv]
  const Tensor b = project(x, w[2]);
  const Tensor a = project(x, w[3]);
  auto [g, beta] = gates.call(a, b, w[5], w[6]);
  // GDNState.conv: transformers' [conv_dim, 1, K] weight as [conv_dim, K], in x's dtype and device.
  Tensor weight = w[4];
  if (weight.dim() == 3) weight = reshaped(weight, {weight.size(0), weight.size(2)});
  if (weight.scalar_type() != x.scalar_type() || weight.device() != x.device())
    weight = weight.to(x.device(), x.scalar_type());
  mixed = conv.call(mixed, weight, cu_seqlens, conv_pool, slots, 1, conv_activation);
  // mixed.split_with_sizes({hk * dk, hk * dk, hv * dv}, -1), each part as [t, heads, dim]
  const Tensor q = reshaped(last_dim_columns(mixed, 0, hk * dk), {t, hk, dk});
  const Tensor k = reshaped(last_dim_columns(mixed, hk * dk, hk * dk), {t, hk, dk});
  const Tensor v = reshaped(last_dim_columns(mixed, 2 * hk * dk, hv * dv), {t, hv, dv});
  Tensor out = delta.call(q, k, v, g, beta, cu_seqlens, recurrent_pool, slots, std::pow(static_cast<double>(dk), -0.5),
                          true);
  out = reshaped(norm.call(reshaped(out, {-1, dv}), reshaped(z, {-1, dv}), w[7], norm_eps, norm_activation),
                 {t, hv * dv});
  return project(out, w[8]);
}

Tensor decode_gdn_layer_cpu(const Tensor& h, at::TensorList attn_hc, at::TensorList gdn, Tensor& conv_pool,
                            Tensor& recurrent_pool, const Tensor& slots, const Tensor& cu_seqlens,
                            at::TensorList mlp_hc, at::TensorList moe, c10::IntArrayRef heads,
                            c10::ArrayRef<double> eps, c10::string_view conv_activation,
                            c10::string_view norm_activation, int64_t hc_count, int64_t top_k, bool norm_topk_prob) {
  const char* op = "decode_gdn_layer";
  check_count(op, "attn_hc", attn_hc, kHcWeights);
  check_count(op, "gdn", gdn, kGdnWeights);
  check_count(op, "mlp_hc", mlp_hc, kHcWeights);
  check_count(op, "moe", moe, kMoeWeights);
  HEBRUS_CHECK(heads.size() == 4, HebrusError, "hebrus::", op, ": heads must be [Hk, Hv, Dk, Dv], got ", heads.size(),
               " values");
  HEBRUS_CHECK(eps.size() == 3, HebrusError, "hebrus::", op,
               ": eps must be [attention hc norm, gated norm, mlp hc norm], got ", eps.size(), " values");
  HEBRUS_CHECK(h.dim() == 2, HebrusError, "hebrus::", op, ": h must be [T, hc * hidden], got ", shape_str(h.sizes()));
  auto [x, inject] = hc_premix(h, attn_hc[0], attn_hc[1], attn_hc[2], attn_hc[3], hc_count, eps[0]);
  const Tensor out = gated_delta_net(x, gdn, conv_pool, recurrent_pool, slots, cu_seqlens, heads, eps[1],
                                     conv_activation, norm_activation);
  return moe_tail(h, out, inject, mlp_hc, moe, hc_count, eps[2], top_k, norm_topk_prob);
}

constexpr size_t kAttentionWeights = 7;  // indexer.index_qk_proj.weight, indexer.q_layernorm.weight,
                                         // {q,k,v}_proj.weight, q_norm.weight, k_norm.weight

// An indexed-attention layer up to its QSA cache: the attention hyper-connection's pre-mix, the indexer's queries
// (q_layernorm-ed, roped) and raw keys, and the attention's q, k (normed, roped), v and output gate
// (models/qwen4_exp/attention.py: index_queries_and_keys, _raw_projections, norm_and_rope's rms_norm_rope).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> decode_attention_head_cpu(
    const Tensor& h, at::TensorList attn_hc, at::TensorList w, const Tensor& cos, const Tensor& sin,
    c10::IntArrayRef dims, c10::ArrayRef<double> eps, int64_t hc_count) {
  static const auto norm_rope = hebrus_op<Tensor(const Tensor&, const Tensor&, double, const Tensor&, const Tensor&)>(
      "hebrus::rms_norm_rope");
  const char* op = "decode_attention_head";
  check_count(op, "attn_hc", attn_hc, kHcWeights);
  check_count(op, "attention", w, kAttentionWeights);
  HEBRUS_CHECK(dims.size() == 4, HebrusError, "hebrus::", op,
               ": dims must be [index heads, index kv heads, index head dim, head dim], got ", dims.size(), " values");
  HEBRUS_CHECK(eps.size() == 4, HebrusError, "hebrus::", op,
               ": eps must be [hc norm, q_layernorm, q_norm, k_norm], got ", eps.size(), " values");
  HEBRUS_CHECK(h.dim() == 2, HebrusError, "hebrus::", op, ": h must be [T, hc * hidden], got ", shape_str(h.sizes()));
  const int64_t index_heads = dims[0], index_kv = dims[1], d = dims[2], hd = dims[3];
  HEBRUS_CHECK(index_kv == 1, HebrusError, "hebrus::", op, ": the indexer must have one key head, got ", index_kv);
  auto [x, inject] = hc_premix(h, attn_hc[0], attn_hc[1], attn_hc[2], attn_hc[3], hc_count, eps[0]);
  const int64_t t = x.size(0);
  // split_with_sizes({index_heads * d, index_kv * d}, -1) of the indexer's projection
  const Tensor index = project(x, w[0]);
  const Tensor q_index = norm_rope.call(reshaped(last_dim_columns(index, 0, index_heads * d), {t, -1, d}), w[1],
                                        eps[1], cos, sin);
  const Tensor raw_keys = last_dim_columns(index, index_heads * d, d);          // [t, d]
  // view({t, -1, hd * 2}).chunk(2, -1) of the query projection: each head's query, then its output gate
  const Tensor q_gate = reshaped(project(x, w[2]), {t, -1, hd * 2});
  const Tensor k = reshaped(project(x, w[3]), {t, -1, hd});
  const Tensor v = reshaped(project(x, w[4]), {t, -1, hd});
  return {inject, q_index, raw_keys, norm_rope.call(last_dim_columns(q_gate, 0, hd), w[5], eps[2], cos, sin),
          norm_rope.call(k, w[6], eps[3], cos, sin), v, last_dim_columns(q_gate, hd, hd)};
}

// The rest of an indexed-attention layer after its attention: the output gate and o_proj (_gated_heads), then
// moe_tail.
Tensor decode_attention_tail_cpu(const Tensor& hyper, const Tensor& attn_out, const Tensor& gate,
                                 const Tensor& o_proj, const Tensor& inject, at::TensorList mlp_hc, at::TensorList moe,
                                 int64_t hc_count, double hc_eps, int64_t top_k, bool norm_topk_prob) {
  static const auto sigmoid_gate =
      hebrus_op<Tensor(const Tensor&, const Tensor&)>("hebrus::sigmoid_gate");
  check_count("decode_attention_tail", "mlp_hc", mlp_hc, kHcWeights);
  check_count("decode_attention_tail", "moe", moe, kMoeWeights);
  const Tensor out = project(reshaped(sigmoid_gate.call(attn_out, gate), {attn_out.size(0), -1}), o_proj);
  return moe_tail(hyper, out, inject, mlp_hc, moe, hc_count, hc_eps, top_k, norm_topk_prob);
}

// plane.index_copy_(0, index, rows) as it runs here, below ADInplaceOrView (no version bump): one memcpy a row where
// plane and rows are plain contiguous CPU tensors of one dtype and shape past dim 0, index a contiguous int64 vector
// of rows.size(0) entries (distinct by the plan's contract) all in range, the two not overlapping; index_copy_ itself
// otherwise (its checks, its errors). A decode step writes one row per plane, where index_copy_ was three dispatched
// ops.
void copy_rows(const Tensor& plane, const Tensor& index, const Tensor& rows) {
  const int64_t n = index.numel();
  bool direct = plain_cpu_tensor(plane) && plain_cpu_tensor(rows) && plain_cpu_tensor(index) &&
                plane.dim() >= 1 && rows.dim() == plane.dim() && index.dim() == 1 &&
                index.scalar_type() == at::kLong && rows.scalar_type() == plane.scalar_type() &&
                plane.is_contiguous() && rows.is_contiguous() && index.is_contiguous() && rows.size(0) == n &&
                rows.sizes().slice(1) == plane.sizes().slice(1) && !autograd_could_record(plane) &&
                !autograd_could_record(rows) && at::get_overlap_status(plane, rows) == at::MemOverlapStatus::No;
  const int64_t* at = direct ? index.const_data_ptr<int64_t>() : nullptr;
  for (int64_t j = 0; direct && j < n; ++j) direct = at[j] >= 0 && at[j] < plane.size(0);
  if (!direct) {
    plane.index_copy_(0, index, rows);
    return;
  }
  const size_t row_bytes = static_cast<size_t>(plane.numel() / std::max<int64_t>(plane.size(0), 1)) *
                           plane.element_size();
  char* dst = static_cast<char*>(plane.mutable_data_ptr());
  const char* src = static_cast<const char*>(rows.const_data_ptr());
  for (int64_t j = 0; j < n; ++j) std::memcpy(dst + at[j] * row_bytes, src + j * row_bytes, row_bytes);
}

constexpr size_t kQsaPlanes = 4;   // the layer's keys, k_cache, v_cache, pooled
constexpr size_t kQsaInputs = 3;   // cell_pos, norm_weight, inv_freq
constexpr size_t kQsaPlan = 10;    // cells, pool_cells, pool_pos, pool_rows, sel_groups, sel_row, q_groups, nvis_q,
                                   // first, cells32

// A whole indexed-attention layer over a QSA step plan: decode_attention_head, what QSACache.write does for a
// chunk of fresh cells (index_copy_ of the raw keys, k and v in the planes' dtype; qsa_pool of the groups the chunk
// completes into their pooled rows: _resolve_pending), what QSACache.plan and ChunkStep.qsa_attention do once the
// rows are planned (qsa_select, qsa_token_cells, qsa_attention), then decode_attention_tail. The host bookkeeping
// (flags, pending rows, undo) stays QSACache's (step_plan / settle_step_plan).
Tensor decode_attention_layer_cpu(const Tensor& h, at::TensorList attn_hc, at::TensorList attention, const Tensor& cos,
                                  const Tensor& sin, c10::IntArrayRef dims, c10::ArrayRef<double> eps,
                                  int64_t hc_count, at::TensorList planes, at::TensorList qsa, at::TensorList plan,
                                  c10::IntArrayRef sizes, double qsa_eps, double scaling, const Tensor& o_proj,
                                  at::TensorList mlp_hc, at::TensorList moe, double hc_eps, int64_t top_k,
                                  bool norm_topk_prob) {
  static const auto pool = hebrus_op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                            const Tensor&, double, const Tensor&)>("hebrus::qsa_pool");
  static const auto select = hebrus_op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                              const Tensor&, int64_t)>("hebrus::qsa_select");
  static const auto token_cells = hebrus_op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                       const Tensor&, int64_t)>(
      "hebrus::qsa_token_cells");
  static const auto attend = hebrus_op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double)>(
      "hebrus::qsa_attention");
  const char* op = "decode_attention_layer";
  check_count(op, "planes", planes, kQsaPlanes);
  check_count(op, "qsa", qsa, kQsaInputs);
  check_count(op, "plan", plan, kQsaPlan);
  HEBRUS_CHECK(sizes.size() == 2, HebrusError, "hebrus::", op, ": sizes must be [top_k groups, compress ratio], got ",
               sizes.size(), " values");
  const auto [inject, q_index, raw_keys, q, k, v, gate] =
      decode_attention_head_cpu(h, attn_hc, attention, cos, sin, dims, eps, hc_count);
  const Tensor& cells = plan[0];
  copy_rows(planes[0], cells, as_dtype(raw_keys, planes[0].scalar_type()));
  copy_rows(planes[1], cells, as_dtype(k, planes[1].scalar_type()));
  copy_rows(planes[2], cells, as_dtype(v, planes[2].scalar_type()));
  if (plan[3].numel() > 0) {
    copy_rows(planes[3], plan[3], pool.call(planes[0], qsa[0], plan[1], plan[2], qsa[1], qsa_eps, qsa[2]));
  }
  const Tensor selected = select.call(q_index, planes[3], plan[4], plan[5], plan[6], sizes[0]);
  const Tensor out = attend.call(q, planes[1], planes[2],
                                 std::get<0>(token_cells.call(selected, plan[7], plan[8], plan[9], sizes[1])), scaling);
  HEBRUS_CHECK(out.sizes() == gate.sizes() && out.scalar_type() == gate.scalar_type(), HebrusError, "hebrus::", op,
               ": the attention's output ", shape_str(out.sizes()), " does not match its gate ",
               shape_str(gate.sizes()), " (a value head dim other than the head dim: run the head and tail apart)");
  return decode_attention_tail_cpu(h, out, gate, o_proj, inject, mlp_hc, moe, hc_count, hc_eps, top_k,
                                   norm_topk_prob);
}

constexpr size_t kPleWeights = 5;  // key_proj.weight, norm_key.weight, value_proj.weight, norm_query.weight,
                                   // norm_conv.weight

Tensor hc_rms_norm(const Tensor& x, const Tensor& weight, int64_t group, double eps) {
  static const auto op =
      hebrus_op<Tensor(const Tensor&, const Tensor&, int64_t, double)>("hebrus::hc_rms_norm");
  return op.call(x, weight, group, eps);
}

// The gate after its dot products for float32 (a decode step's case): `dots / sqrt(hidden)`, `abs`, `clamp_min(1e-6)`,
// `* sign` and `* value.unsqueeze(-2)` as loops around ATen's own sqrt and sigmoid, six ATen ops fewer (each several
// microseconds inside a step). Those six are one correctly rounded float operation per element, the same in ATen's
// vector body and its scalar tail, so the loops give ATen's bits; sqrt and sigmoid are not (MKL's vector functions:
// their bits depend on where an element falls), so they stay ATen's, on tensors of the shapes the ATen ops saw. A
// scaled dot that is NaN or -0.0 (ATen's scalar sign reads the sign bit, its vector sign does not), another dtype or
// layout: false, and the caller runs the ATen ops. gated: [..., hc * V] from dots [..., hc, 1] and value [..., V].
bool gate_by_hand(const Tensor& dots, const Tensor& value, int64_t hidden, Tensor& gated) {
  if (dots.scalar_type() != at::kFloat || value.scalar_type() != at::kFloat || !plain_cpu_tensor(dots) ||
      !plain_cpu_tensor(value) || !dots.is_contiguous() || !value.is_contiguous() || dots.dim() < 2 ||
      value.dim() != dots.dim() - 1 || autograd_could_record(dots) || autograd_could_record(value))
    return false;
  const int64_t hc = dots.size(-2), v_dim = value.size(-1), rows = value.numel() / std::max<int64_t>(v_dim, 1);
  if (dots.size(-1) != 1 || dots.numel() != rows * hc ||
      value.sizes().slice(0, value.dim() - 1) != dots.sizes().slice(0, dots.dim() - 2))
    return false;
  const float scale = static_cast<float>(std::sqrt(static_cast<double>(hidden)));   // (div's float scalar)
  const float floor = static_cast<float>(1e-6);                                      // (clamp_min's)
  const float* d = dots.const_data_ptr<float>();
  const int64_t n = dots.numel();
  Tensor magnitude = empty_on_cpu(dots.sizes(), dots.options());
  float* m = magnitude.mutable_data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const float s = d[i] / scale;
    if (std::isnan(s) || (s == 0.f && std::signbit(s))) return false;
    m[i] = std::max(std::fabs(s), floor);
  }
  Tensor gate = at::sqrt(magnitude);
  float* g = gate.mutable_data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const float s = d[i] / scale;
    g[i] *= static_cast<float>((0.f < s) - (s < 0.f));
  }
  const Tensor sig = at::sigmoid(gate);
  std::vector<int64_t> shape(value.sizes().begin(), value.sizes().end());
  shape.back() = hc * v_dim;
  gated = empty_on_cpu(shape, value.options());
  const float* sp = sig.const_data_ptr<float>();
  const float* vp = value.const_data_ptr<float>();
  float* out = gated.mutable_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < hc; ++h) {
      const float s = sp[r * hc + h];
      float* o = out + (r * hc + h) * v_dim;
      const float* v = vp + r * v_dim;
      for (int64_t j = 0; j < v_dim; ++j) o[j] = s * v[j];
    }
  return true;
}

// A PLE layer's gate up to its conv (models/qwen4_exp/ple.py's packed_ple): each stream's normed activations gate
// the n-gram value against that stream's key; returns (the gated values, them normed for the conv).
std::tuple<Tensor, Tensor> decode_ple_gate_cpu(const Tensor& rows, const Tensor& h, at::TensorList w,
                                               c10::IntArrayRef groups, c10::ArrayRef<double> eps, int64_t hc_count,
                                               int64_t hidden) {
  const char* op = "decode_ple_gate";
  check_count(op, "ple", w, kPleWeights);
  HEBRUS_CHECK(groups.size() == 3 && eps.size() == 3, HebrusError, "hebrus::", op,
               ": groups and eps must hold the norms' [norm_key, norm_query, norm_conv] values, got ", groups.size(),
               " and ", eps.size());
  HEBRUS_CHECK(rows.dim() >= 2, HebrusError, "hebrus::", op, ": rows must be [T, N, dim], got ",
               shape_str(rows.sizes()));
  // (the views as flatten / unflatten / unsqueeze make them: shape_with's last `drop` sizes replaced by `tail`)
  const auto shape_with = [](const Tensor& t, size_t drop, std::initializer_list<int64_t> tail) {
    std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end() - drop);
    shape.insert(shape.end(), tail);
    return shape;
  };
  const Tensor emb = reshaped(rows, shape_with(rows, 2, {rows.size(-2) * rows.size(-1)}));    // flatten(-2)
  const Tensor key_h = hc_rms_norm(project(emb, w[0]), w[1], groups[0], eps[0]);
  const Tensor key = reshaped(key_h, shape_with(key_h, 1, {hc_count, hidden}));        // unflatten(-1, {hc, H})
  const Tensor value = project(emb, w[2]);
  const Tensor query_h = hc_rms_norm(h, w[3], groups[1], eps[1]);
  const Tensor query = reshaped(query_h, shape_with(query_h, 1, {hc_count, hidden}));
  const Tensor dots = (key * query).sum(-1, true);                                       // [..., hc, 1]
  Tensor gated;
  if (!gate_by_hand(dots, value, hidden, gated)) {
    Tensor gate = dots / std::sqrt(static_cast<double>(hidden));
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign();
    const Tensor product = at::sigmoid(gate) * reshaped(value, shape_with(value, 1, {1, value.size(-1)}));  // unsqueeze
    gated = reshaped(product, shape_with(product, 2, {product.size(-2) * product.size(-1)}));
  }
  return {gated, hc_rms_norm(gated, w[4], groups[2], eps[2])};
}

// x [T, K] @ weight [N, K].T, as project computes the native calls' projections.
Tensor dense_projection_cpu(const Tensor& x, const Tensor& weight) {
  const char* op = "dense_projection";
  HEBRUS_CHECK(x.device().type() == at::kCPU && weight.device().type() == at::kCPU, HebrusError, "hebrus::", op,
               ": all tensors must be on one device; x is on ", x.device().str(), ", weight is on ",
               weight.device().str());
  HEBRUS_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), HebrusError, "hebrus::", op,
               ": x must be [T, K] and weight [N, K], got ", shape_str(x.sizes()), " and ",
               shape_str(weight.sizes()));
  HEBRUS_CHECK(x.scalar_type() == weight.scalar_type() && at::isFloatingType(x.scalar_type()), HebrusError,
               "hebrus::", op, ": x and weight must have one floating dtype, got ", x.scalar_type(), " and ",
               weight.scalar_type());
  return project(x, weight);
}

}  // namespace
}  // namespace hebrus

TORCH_LIBRARY_IMPL(hebrus, CPU, m) {
  m.impl("decode_ple_gate", &hebrus::decode_ple_gate_cpu);
  m.impl("decode_moe_tail", &hebrus::decode_moe_tail_cpu);
  m.impl("decode_gdn_layer", &hebrus::decode_gdn_layer_cpu);
  m.impl("decode_attention_head", &hebrus::decode_attention_head_cpu);
  m.impl("decode_attention_tail", &hebrus::decode_attention_tail_cpu);
  m.impl("decode_attention_layer", &hebrus::decode_attention_layer_cpu);
  m.impl("dense_projection", &hebrus::dense_projection_cpu);
}
