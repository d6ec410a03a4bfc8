// The one place every hebrus op schema is declared. Device files only add TORCH_LIBRARY_IMPL blocks.
// Importing hebrus_torch._C (an empty module) runs these static registrars.
#include <Python.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/grad_mode.h>
#include <torch/library.h>

#include <utility>
#include <vector>

#include "cpu/row_math.h"
#include "hebrus_check.h"

namespace {

// _C._set_row_kernel(on: bool) -> bool: whether the CPU kernels' dense products of a few rows take row_kernel_mm
// (cpu/row_math.h); returns the previous setting.
PyObject* set_row_kernel(PyObject* /*self*/, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  return PyBool_FromLong(hebrus::set_row_kernel_enabled(on != 0));
}

// A snapshot of what ModuleWatch (hebrus_torch/models/qwen4_exp/native.py) compares every step, as C arrays: the
// same comparisons as its Python expression, in one pass over the objects after a pass that prefetches them. Inside a
// decode step these ~1000 objects are out of the caches (each native call streams megabytes of weights through
// them); touched one at a time by the interpreter's map loops each costs a full memory latency.
struct WatchSnapshot {
  std::vector<PyObject*> owned;              // one reference to every object below (dropped with the capsule)
  PyObject* hook_class = nullptr;            // torch.utils.hooks.RemovableHandle
  PyObject* next_id_name = nullptr;          // "next_id"
  PyObject* hook_id = nullptr;               // its next_id when the snapshot was taken
  std::vector<PyObject*> hook_dicts;         // their total size stays hook_count
  Py_ssize_t hook_count = 0;
  std::vector<PyObject*> member_dicts, member_names, members;   // member_dicts[i][member_names[i]] is members[i]
  std::vector<PyObject*> owner_dicts;        // each of size owner_sizes[i]
  std::vector<Py_ssize_t> owner_sizes;
  std::vector<PyObject*> instance_dicts, forwards, compiled;    // .get("forward") / .get("_compiled_call_impl")
  PyObject* forward_name = nullptr;
  PyObject* compiled_name = nullptr;
  std::vector<PyObject*> modules, types;     // type(modules[i]) is types[i]
  std::vector<PyObject*> params, dtypes;     // params[i].dtype is dtypes[i]
  PyObject* dtype_name = nullptr;
};

constexpr const char* kWatchCapsule = "hebrus.module_watch";

void drop_snapshot(PyObject* capsule) {
  auto* snap = static_cast<WatchSnapshot*>(PyCapsule_GetPointer(capsule, kWatchCapsule));
  if (snap == nullptr) return;
  for (PyObject* o : snap->owned) Py_DECREF(o);
  delete snap;
}

// The items of list `seq` into `out`, each kept alive by the snapshot (None stands for "absent" where compared).
bool take_list(PyObject* seq, std::vector<PyObject*>& out, WatchSnapshot& snap) {
  if (!PyList_Check(seq)) {
    PyErr_SetString(PyExc_TypeError, "_module_watch: expected a list");
    return false;
  }
  const Py_ssize_t n = PyList_Size(seq);
  out.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GetItem(seq, i);
    Py_INCREF(item);
    snap.owned.push_back(item);
    out.push_back(item);
  }
  return true;
}

PyObject* keep(PyObject* o, WatchSnapshot& snap) {
  Py_INCREF(o);
  snap.owned.push_back(o);
  return o;
}

// _C._module_watch(hook_class, hook_id, hook_dicts, hook_count, member_dicts, member_names, members, owner_dicts,
// owner_sizes, instance_dicts, forwards, compiled, modules, types, params, dtypes) -> capsule
PyObject* module_watch(PyObject* /*self*/, PyObject* args) {
  PyObject *hook_class, *hook_id, *hook_dicts, *member_dicts, *member_names, *members, *owner_dicts, *owner_sizes,
      *instance_dicts, *forwards, *compiled, *modules, *types, *params, *dtypes;
  Py_ssize_t hook_count;
  if (!PyArg_ParseTuple(args, "OOOnOOOOOOOOOOOO", &hook_class, &hook_id, &hook_dicts, &hook_count, &member_dicts,
                        &member_names, &members, &owner_dicts, &owner_sizes, &instance_dicts, &forwards, &compiled,
                        &modules, &types, &params, &dtypes))
    return nullptr;
  auto* snap = new WatchSnapshot();
  PyObject* capsule = PyCapsule_New(snap, kWatchCapsule, drop_snapshot);
  if (capsule == nullptr) {
    delete snap;
    return nullptr;
  }
  snap->hook_class = keep(hook_class, *snap);
  snap->hook_id = keep(hook_id, *snap);
  snap->hook_count = hook_count;
  std::vector<PyObject*> sizes;
  if (!take_list(hook_dicts, snap->hook_dicts, *snap) || !take_list(member_dicts, snap->member_dicts, *snap) ||
      !take_list(member_names, snap->member_names, *snap) || !take_list(members, snap->members, *snap) ||
      !take_list(owner_dicts, snap->owner_dicts, *snap) || !take_list(owner_sizes, sizes, *snap) ||
      !take_list(instance_dicts, snap->instance_dicts, *snap) || !take_list(forwards, snap->forwards, *snap) ||
      !take_list(compiled, snap->compiled, *snap) || !take_list(modules, snap->modules, *snap) ||
      !take_list(types, snap->types, *snap) || !take_list(params, snap->params, *snap) ||
      !take_list(dtypes, snap->dtypes, *snap)) {
    Py_DECREF(capsule);
    return nullptr;
  }
  for (PyObject* n : sizes) {
    snap->owner_sizes.push_back(PyLong_AsSsize_t(n));
    if (PyErr_Occurred()) {
      Py_DECREF(capsule);
      return nullptr;
    }
  }
  const size_t nm = snap->member_dicts.size(), ni = snap->instance_dicts.size(), nt = snap->modules.size();
  if (snap->member_names.size() != nm || snap->members.size() != nm || snap->owner_sizes.size() !=
      snap->owner_dicts.size() || snap->forwards.size() != ni || snap->compiled.size() != ni ||
      snap->types.size() != nt || snap->dtypes.size() != snap->params.size()) {
    Py_DECREF(capsule);
    PyErr_SetString(PyExc_ValueError, "_module_watch: lists of different lengths");
    return nullptr;
  }
  for (const std::vector<PyObject*>* dicts : {&snap->hook_dicts, &snap->member_dicts, &snap->owner_dicts,
                                               &snap->instance_dicts})
    for (PyObject* o : *dicts)
      if (!PyDict_Check(o)) {
        Py_DECREF(capsule);
        PyErr_SetString(PyExc_TypeError, "_module_watch: expected dicts");
        return nullptr;
      }
  PyObject** names[] = {&snap->next_id_name, &snap->forward_name, &snap->compiled_name, &snap->dtype_name};
  const char* texts[] = {"next_id", "forward", "_compiled_call_impl", "dtype"};
  for (int i = 0; i < 4; ++i) {
    PyObject* name = PyUnicode_InternFromString(texts[i]);      // (a new reference: the snapshot's)
    if (name == nullptr) {
      Py_DECREF(capsule);
      return nullptr;
    }
    snap->owned.push_back(name);
    *names[i] = name;
  }
  return capsule;
}

void prefetch_all(const std::vector<PyObject*>& objects) {
  for (PyObject* o : objects) __builtin_prefetch(o);
}

// dict.get(d, key) is expected (None expected: the key absent).
bool holds(PyObject* d, PyObject* key, PyObject* expected) {
  PyObject* got = PyDict_GetItemWithError(d, key);          // (borrowed)
  if (got == nullptr && PyErr_Occurred()) {                 // (a key's hash or eq raised: taken as a change)
    PyErr_Clear();
    return false;
  }
  return got == nullptr ? expected == Py_None : got == expected;
}

// _C._module_watch_unchanged(capsule) -> bool: ModuleWatch.unchanged's comparisons over the snapshot.
PyObject* module_watch_unchanged(PyObject* /*self*/, PyObject* capsule) {
  auto* s = static_cast<WatchSnapshot*>(PyCapsule_GetPointer(capsule, kWatchCapsule));
  if (s == nullptr) return nullptr;
  prefetch_all(s->hook_dicts);
  prefetch_all(s->owner_dicts);
  prefetch_all(s->instance_dicts);
  prefetch_all(s->modules);
  prefetch_all(s->params);
  bool same = true;
  PyObject* next_id = PyObject_GetAttr(s->hook_class, s->next_id_name);
  if (next_id == nullptr) return nullptr;
  const int eq = PyObject_RichCompareBool(next_id, s->hook_id, Py_EQ);
  Py_DECREF(next_id);
  if (eq < 0) return nullptr;
  same = eq == 1;
  if (same) {
    Py_ssize_t hooks = 0;
    for (PyObject* d : s->hook_dicts) hooks += PyDict_Size(d);
    same = hooks == s->hook_count;
  }
  for (size_t i = 0; same && i < s->owner_dicts.size(); ++i) same = PyDict_Size(s->owner_dicts[i]) == s->owner_sizes[i];
  for (size_t i = 0; same && i < s->member_dicts.size(); ++i)
    same = holds(s->member_dicts[i], s->member_names[i], s->members[i]);
  for (size_t i = 0; same && i < s->instance_dicts.size(); ++i)
    same = holds(s->instance_dicts[i], s->forward_name, s->forwards[i]) &&
           holds(s->instance_dicts[i], s->compiled_name, s->compiled[i]);
  for (size_t i = 0; same && i < s->modules.size(); ++i)
    same = reinterpret_cast<PyObject*>(Py_TYPE(s->modules[i])) == s->types[i];
  for (size_t i = 0; same && i < s->params.size(); ++i) {
    PyObject* dtype = PyObject_GetAttr(s->params[i], s->dtype_name);
    if (dtype == nullptr) return nullptr;
    same = dtype == s->dtypes[i];
    Py_DECREF(dtype);
  }
  return PyBool_FromLong(same);
}

PyMethodDef module_methods[] = {
    {"_set_row_kernel", set_row_kernel, METH_O, "Set whether a few rows' dense products take the row kernel."},
    {"_module_watch", module_watch, METH_VARARGS, "A snapshot of what ModuleWatch compares (a capsule)."},
    {"_module_watch_unchanged", module_watch_unchanged, METH_O, "Whether nothing in a module watch's snapshot changed."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, module_methods};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(hebrus, m) {
  // PLE (SPEC §2): hashed n-gram row ids with the frozen EOS history rule.
  m.def(
      "ple_ngram_ids(Tensor tokens, Tensor cu_seqlens, Tensor history, Tensor multipliers, "
      "Tensor vocab_sizes, Tensor offsets, int eos, int vocab) -> (Tensor, Tensor)");
  // PLE (SPEC §2): depthwise causal dilated conv over packed rows with carried input tails.
  m.def(
      "ple_conv(Tensor x, Tensor weight, Tensor cu_seqlens, Tensor state, int dilation, "
      "str activation) -> (Tensor, Tensor)");
  // ple_conv into caller-owned buffers y [T, C] and new_state [B, L, C] (not in the SPEC: the
  // out-variant a prefill loop uses to reuse its output memory).
  m.def(
      "ple_conv_into(Tensor x, Tensor weight, Tensor cu_seqlens, Tensor state, int dilation, "
      "str activation, Tensor(a!) y, Tensor(b!) new_state) -> ()");
  // Slot-indexed forms of the PLE ops (issue 19): row r's history / conv tail is read from and
  // written back to pool[slots[r]] in place (as causal-conv1d's conv_state_indices); distinct slots.
  m.def(
      "ple_ngram_ids_slots(Tensor tokens, Tensor cu_seqlens, Tensor(a!) history_pool, Tensor slots, "
      "Tensor multipliers, Tensor vocab_sizes, Tensor offsets, int eos, int vocab) -> Tensor");
  m.def(
      "ple_conv_slots(Tensor x, Tensor weight, Tensor cu_seqlens, Tensor(a!) state_pool, Tensor slots, "
      "int dilation, str activation) -> Tensor");
  // QSA (SPEC §3): pooled, normed, roped key per 4-token group; fails on a hole.
  m.def(
      "qsa_pool(Tensor keys, Tensor cell_pos, Tensor group_cells, Tensor group_pos, "
      "Tensor norm_weight, float eps, Tensor inv_freq) -> Tensor");
  // QSA (SPEC §3): per-query top-k groups, ascending, -1 padded.
  m.def(
      "qsa_select(Tensor q, Tensor pooled, Tensor seq_groups, Tensor q_row, Tensor q_groups, "
      "int top_k) -> Tensor");
  // QSA attention (issue 6): softmax(scale q.k) v per query over exactly its selected cells.
  m.def("qsa_attention(Tensor q, Tensor k, Tensor v, Tensor token_cells, float scale) -> Tensor");
  // The cells each query attends (issue 37): its selected groups' r cells each, in the given order, then
  // its raw tail, then -1 (token_cells [Tq, W] int32 and their offsets in the run [Tq, W] int64,
  // W = top_k * r + r - 1): what qsa_attention reads, from qsa_select's groups in one dispatch.
  m.def("qsa_token_cells(Tensor selected, Tensor nvis, Tensor first, Tensor cells, int r) -> (Tensor, Tensor)");
  // The selection rows of a one-row chunk over its run (the host's step plan, issue 37): the run's contiguity and
  // the chunk's cells checked (HoleError), then [sel_groups, sel_row, q_groups, cells32, nvis_q, first, q_p0, q_rows].
  m.def(
      "qsa_plan_one_row(Tensor cell_pos, Tensor run_cells, Tensor run_groups, Tensor cells, int p0, int start, "
      "int r) -> Tensor[]");
  // A chunk's cells taken at the QSA allocator's head (issue 37): cells [start, start + T) (all free, none freed in
  // this block) referenced, given the rows' positions (starts[i] + 0, 1, ... for counts[i] tokens) and flagged
  // unwritten in every layer; returns (cells, positions, cu_seqlens, old cell_ref, old cell_pos, old unwritten).
  m.def(
      "qsa_claim_cells(Tensor(a!) cell_ref, Tensor(b!) cell_pos, Tensor(c!) unwritten, Tensor freed, int start, "
      "int[] starts, int[] counts) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Qwen4Exp's RMSNorm of every head of x [T, H, D] then transformers' rotate-half RoPE of its first R dims
  // at each token's cos/sin [T, R] in x's dtype (issue 37): a q_norm / k_norm / q_layernorm and its RoPE.
  m.def("rms_norm_rope(Tensor x, Tensor weight, float eps, Tensor cos, Tensor sin) -> Tensor");
  // The attention's output gate (issue 37): x [T, H, D] * sigmoid(gate [T, H, D]) in x's dtype, the gate read in
  // place (a view of q_proj's output).
  m.def("sigmoid_gate(Tensor x, Tensor gate) -> Tensor");
  // Gated delta rule (issue 17) of the gated-delta-net layers over packed rows, recurrent form; each
  // row's state [Hv, Dk, Dv] (fp32) is updated in place.
  m.def(
      "gdn_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens, "
      "Tensor(a!) state, float scale, bool use_qk_l2norm) -> Tensor");
  // gdn_delta_rule whose row b's state is read from and written back to state_pool[slots[b]] in place
  // (issue 25; distinct slots), as ple_conv_slots does for the conv tails.
  m.def(
      "gdn_delta_rule_slots(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens, "
      "Tensor(a!) state_pool, Tensor slots, float scale, bool use_qk_l2norm) -> Tensor");
  // The gated delta rule in the chunked (WY) form (issue 25), chunks of 64 aligned to absolute
  // positions (start_pos[b]: row b's first); row b's state is state_pool[slots[b]], updated in place.
  m.def(
      "gdn_chunk_delta_rule_slots(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens, "
      "Tensor start_pos, Tensor(a!) state_pool, Tensor slots, float scale, bool use_qk_l2norm) -> Tensor");
  // ---- fused GDN gates and output norm (issue 37) ----
  // The gated-delta-net layer's gates from its a / b projections [..., Hv]: g = -exp(A_log) *
  // softplus(a + dt_bias) (fp32) and beta = sigmoid(b) rounded to b's dtype (returned as fp32).
  m.def("gdn_gates(Tensor a, Tensor b, Tensor A_log, Tensor dt_bias) -> (Tensor, Tensor)");
  // Its gated RMSNorm (transformers' Qwen4ExpTextRMSNormGated) of every row of x [..., D], gated by
  // act(gate), activation 'silu' or 'sigmoid'.
  m.def("gdn_gated_rms_norm(Tensor x, Tensor gate, Tensor weight, float eps, str activation) -> Tensor");
  // ---- fused hyper-connection ops (issue 37) ----
  // Qwen4Exp's RMSNorm of every row of x [..., D] over groups of group_size features (zero-centred
  // weight [D], fp32 math): the hyper-connections' hc_norm (or q_norm of x [T, H, D]) in one dispatch.
  m.def("hc_rms_norm(Tensor x, Tensor weight, int group_size, float eps) -> Tensor");
  // The hyper-connection pre-mix of h [T, hc * hidden] (transformers' Qwen4ExpTextGatedResidual): hc_norm,
  // the low-rank down / SiLU / up / sigmoid stream weights, the mean of the weighted streams (mixed
  // [T, hidden]) and, where inject [hc, hc * hidden] is given, 2 sigmoid(inject . normed / hc) ([T, hc];
  // [T, 0] without it). down [R, hc * hidden], up [hc * hidden, R], both of h's dtype.
  m.def(
      "hc_premix(Tensor h, Tensor norm_weight, Tensor down, Tensor up, Tensor? inject, int hc_count, float eps) "
      "-> (Tensor, Tensor)");
  // hc_premix with down, up and inject affine-quantized (hebrus_torch/moe/quantize.py; one group_size and bits
  // for the three): <name>_q [out, in * bits / 32] int32, <name>_scales / _biases [out, in / group_size] of h's
  // dtype; inject's three tensors all given or none. On CPU: the module path's bits (QuantizedLinear calls).
  m.def(
      "hc_premix_quantized(Tensor h, Tensor norm_weight, Tensor down_q, Tensor down_scales, Tensor down_biases, "
      "Tensor up_q, Tensor up_scales, Tensor up_biases, Tensor? inject_q, Tensor? inject_scales, "
      "Tensor? inject_biases, int hc_count, float eps, int group_size, int bits) -> (Tensor, Tensor)");
  // The hyper-connection post-combine: hyper [T, hc * hidden] + out [T, hidden] weighted per stream by
  // inject [T, hc] (the decoder layer's `hyper_input + (out.unsqueeze(-2) * w.unsqueeze(-1)).flatten(-2)`).
  m.def("hc_post_combine(Tensor hyper, Tensor out, Tensor inject) -> Tensor");
  // The routed experts of a MoE block (issue 36) over packed rows x [T, H]: per row, the SiLU-gated MLP
  // of each of its top-k experts (gate_up [E, 2I, H], down [E, H, I]) weighted and summed in slot order.
  m.def("moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor gate_up, Tensor down) -> Tensor");
  // moe_experts with the experts' weights affine-quantized per group (MLX's format, 4 or 8 bits; issue 36).
  m.def(
      "moe_experts_quantized(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor gate_up_q, "
      "Tensor gate_up_scales, Tensor gate_up_biases, Tensor down_q, Tensor down_scales, Tensor down_biases, "
      "int group_size, int bits) -> Tensor");
  // x [T, in] times the transpose of an affine-quantized W [out, in] (the format of moe_experts_quantized).
  m.def("quantized_linear(Tensor x, Tensor wq, Tensor scales, Tensor biases, int group_size, int bits) -> Tensor");
  // A MoE block's router after its logits (issue 37): per row of router_logits [T, E], softmax in fp32,
  // top-k, optional renormalisation, cast to the logits' dtype -> (ids [T, k] int64, weights [T, k + S]),
  // the last S weights sigmoid(shared_gate_logits [T, S]) (the shared expert's gate), where given.
  m.def("moe_route(Tensor router_logits, Tensor? shared_gate_logits, int top_k, bool norm_topk_prob) -> (Tensor, Tensor)");
  // A MoE block's shared expert added to its routed experts' output (issue 37): routed [T, H] +
  // gate [T, 1] * down_proj(silu(gate_proj(x)) * up_proj(x)), each step rounded to x's dtype where
  // transformers' modules round it (dense weights gate_proj / up_proj [I, H], down_proj [H, I]).
  m.def(
      "moe_shared_expert(Tensor x, Tensor routed, Tensor gate_proj, Tensor up_proj, Tensor down_proj, "
      "Tensor gate) -> Tensor");
  // moe_shared_expert with the three projections affine-quantized (the format of quantized_linear, one
  // group_size / bits for all three): each projection is quantized_linear's (codes, scales, biases).
  m.def(
      "moe_shared_expert_quantized(Tensor x, Tensor routed, Tensor gate_proj_q, Tensor gate_proj_scales, "
      "Tensor gate_proj_biases, Tensor up_proj_q, Tensor up_proj_scales, Tensor up_proj_biases, Tensor down_proj_q, "
      "Tensor down_proj_scales, Tensor down_proj_biases, Tensor gate, int group_size, int bits) -> Tensor");
  // ---- native decoder-layer calls (issue 37; CPU): packed_decoder_layer's ops for a stock layer in one call ----
  // The layer after its token mixer: post-combine, the MLP hyper-connection's pre-mix, the MoE block (router and
  // shared gate linears, moe_route, moe_experts, moe_shared_expert) and its post-combine. mlp_hc: hc_norm.weight,
  // input_mix_weight_down, input_mix_weight_up, block_inject_weight; moe: gate.weight, shared_expert_gate.weight,
  // experts.gate_up_proj, experts.down_proj, shared_expert.{gate,up,down}_proj.weight.
  m.def(
      "decode_moe_tail(Tensor hyper, Tensor out, Tensor inject, Tensor[] mlp_hc, Tensor[] moe, int hc_count, "
      "float hc_eps, int top_k, bool norm_topk_prob) -> Tensor");
  // A whole gated-delta-net decoder layer after its PLE: the attention hyper-connection's pre-mix, the GDN (its
  // conv tails and recurrent states updated in place at slots, as ple_conv_slots / gdn_delta_rule_slots do) and
  // decode_moe_tail. gdn: in_proj_{qkv,z,b,a}.weight, conv1d.weight, A_log, dt_bias, norm.weight,
  // out_proj.weight; heads [Hk, Hv, Dk, Dv]; eps [attention hc norm, gated norm, mlp hc norm].
  m.def(
      "decode_gdn_layer(Tensor h, Tensor[] attn_hc, Tensor[] gdn, Tensor(a!) conv_pool, Tensor(b!) recurrent_pool, "
      "Tensor slots, Tensor cu_seqlens, Tensor[] mlp_hc, Tensor[] moe, int[] heads, float[] eps, "
      "str conv_activation, str norm_activation, int hc_count, int top_k, bool norm_topk_prob) -> Tensor");
  // An indexed-attention layer up to its QSA cache: the attention hyper-connection's pre-mix, then (injection
  // weights, indexer queries (normed, roped), raw indexer keys [T, D], q and k (normed, roped), v, the output gate).
  // attention: indexer.index_qk_proj.weight, indexer.q_layernorm.weight, {q,k,v}_proj.weight, q_norm.weight,
  // k_norm.weight; dims [index heads, index kv heads, index head dim, head dim]; eps [hc norm, q_layernorm, q_norm,
  // k_norm].
  m.def(
      "decode_attention_head(Tensor h, Tensor[] attn_hc, Tensor[] attention, Tensor cos, Tensor sin, int[] dims, "
      "float[] eps, int hc_count) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // The rest of it after the attention: o_proj(sigmoid_gate(attn_out, gate)), then decode_moe_tail.
  m.def(
      "decode_attention_tail(Tensor hyper, Tensor attn_out, Tensor gate, Tensor o_proj, Tensor inject, "
      "Tensor[] mlp_hc, Tensor[] moe, int hc_count, float hc_eps, int top_k, bool norm_topk_prob) -> Tensor");
  // A whole indexed-attention layer when its QSA cache's step plan is known (QSACache.step_plan): the head, then
  // the cache's write of the chunk's fresh cells (raw keys, k, v into planes), the pooling of the groups this chunk
  // completes (into the pooled plane's plan rows), qsa_select, qsa_token_cells and qsa_attention, then the tail.
  // planes: the layer's keys, k_cache, v_cache, pooled (written in place); qsa: cell_pos, norm_weight, inv_freq;
  // plan: cells, pool_cells, pool_pos, pool_rows, sel_groups, sel_row, q_groups, nvis_q, first, cells32;
  // sizes: [top_k groups, compress ratio].
  m.def(
      "decode_attention_layer(Tensor h, Tensor[] attn_hc, Tensor[] attention, Tensor cos, Tensor sin, int[] dims, "
      "float[] eps, int hc_count, Tensor(a!)[] planes, Tensor[] qsa, Tensor[] plan, int[] sizes, float qsa_eps, "
      "float scaling, Tensor o_proj, Tensor[] mlp_hc, Tensor[] moe, float hc_eps, int top_k, bool norm_topk_prob) "
      "-> Tensor");
  // A PLE layer's gate before its conv: (the gated values [T, hc * H], them normed by norm_conv). ple:
  // key_proj.weight, norm_key.weight, value_proj.weight, norm_query.weight, norm_conv.weight; groups and eps: the
  // three norms' (norm_key, norm_query, norm_conv).
  m.def(
      "decode_ple_gate(Tensor rows, Tensor h, Tensor[] ple, int[] groups, float[] eps, int hc_count, int hidden) "
      "-> (Tensor, Tensor)");
  // x [T, K] @ weight [N, K].T as the native calls compute their projections (cpu/dense_mm.h: the row kernel for a
  // few float32 rows): the engine's lm_head of a decode step.
  m.def("dense_projection(Tensor x, Tensor weight) -> Tensor");
}

namespace {

// The tensor arguments of a boxed call, with their schema entries.
std::vector<std::pair<const c10::Argument*, at::Tensor>> tensor_args(const c10::OperatorHandle& op,
                                                                     const torch::jit::Stack& stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack.size() - args.size();
  std::vector<std::pair<const c10::Argument*, at::Tensor>> tensors;
  for (size_t i = 0; i < args.size(); ++i)
    if (stack[first + i].isTensor()) tensors.emplace_back(&args[i], stack[first + i].toTensor());
  return tensors;
}

// Whether the schema annotates the argument (a!): the op writes into it.
bool is_written(const c10::Argument& arg) { return arg.alias_info() != nullptr && arg.alias_info()->isWrite(); }

// ple_conv_into under autograd, as aten's out= ops: refused when grad mode is on and an argument
// requires grad (the buffers would hold values with no gradient history) and on an inference tensor
// outside inference mode.
void out_variant_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  for (const auto& [arg, t] : tensor_args(op, *stack)) {
    HEBRUS_CHECK(!(at::GradMode::is_enabled() && t.requires_grad()), HebrusError, op.schema().name(),
                 ": writes into out= buffers, which do not support automatic differentiation, but ",
                 arg->name(), " requires grad (call it under torch.no_grad())");
    HEBRUS_CHECK(!(is_written(*arg) && t.is_inference()), HebrusError, op.schema().name(), ": ", arg->name(),
                 " is an inference tensor; writing into it outside torch.inference_mode() is not allowed");
  }
  at::AutoDispatchBelowAutograd guard;
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

// After the write, the version counters of the buffers it wrote are bumped (also in inference mode,
// for normal tensors), so that autograd notices a tensor it saved being overwritten. torch's
// autogradNotImplementedInplaceOrViewFallback bumps only mutated tensors an op returns; this op
// returns none.
void out_variant_inplace_or_view(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  std::vector<at::Tensor> written;
  for (const auto& [arg, t] : tensor_args(op, *stack))
    if (is_written(*arg) && !t.is_inference()) written.push_back(t);
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor& t : written) t.unsafeGetTensorImpl()->bump_version();
}

}  // namespace

// No op has a backward (they serve inference). Without an Autograd kernel, PyTorch's default
// fallback lets outputs require grad and backward() return with no gradient at all; with these,
// backward() through an op raises, and ple_conv_into behaves as an aten out= op.
TORCH_LIBRARY_IMPL(hebrus, Autograd, m) {
  for (const char* op : {"ple_ngram_ids", "ple_conv", "qsa_pool", "qsa_select", "qsa_attention", "moe_experts",
                         "moe_experts_quantized", "quantized_linear"})
    m.impl(op, torch::autograd::autogradNotImplementedFallback());
  // The slot ops write their pool in place as ple_conv_into writes its buffers (refused under grad
  // mode with an input that requires grad; autogradNotImplementedFallback would skip the
  // ADInplaceOrView kernel below, which bumps the pool's version).
  for (const char* op : {"ple_conv_into", "ple_ngram_ids_slots", "ple_conv_slots", "gdn_delta_rule",
                         "gdn_delta_rule_slots"})
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&out_variant_autograd>());
  m.impl("gdn_chunk_delta_rule_slots", torch::CppFunction::makeFromBoxedFunction<&out_variant_autograd>());
  m.impl("moe_route", torch::autograd::autogradNotImplementedFallback());
  m.impl("moe_shared_expert", torch::autograd::autogradNotImplementedFallback());
  m.impl("moe_shared_expert_quantized", torch::autograd::autogradNotImplementedFallback());
  m.impl("decode_moe_tail", torch::autograd::autogradNotImplementedFallback());
  m.impl("decode_attention_head", torch::autograd::autogradNotImplementedFallback());
  m.impl("decode_attention_tail", torch::autograd::autogradNotImplementedFallback());
  m.impl("decode_attention_layer", torch::autograd::autogradNotImplementedFallback());
  m.impl("decode_ple_gate", torch::autograd::autogradNotImplementedFallback());
  m.impl("decode_gdn_layer", torch::CppFunction::makeFromBoxedFunction<&out_variant_autograd>());
}

TORCH_LIBRARY_IMPL(hebrus, ADInplaceOrView, m) {
  m.impl("ple_conv_into", torch::CppFunction::makeFromBoxedFunction<&out_variant_inplace_or_view>());
  // The slot ops write their pool in place (and return only fresh outputs): its version is bumped.
  m.impl("ple_ngram_ids_slots", torch::CppFunction::makeFromBoxedFunction<&out_variant_inplace_or_view>());
  m.impl("ple_conv_slots", torch::CppFunction::makeFromBoxedFunction<&out_variant_inplace_or_view>());
  m.impl("gdn_delta_rule", torch::CppFunction::makeFromBoxedFunction<&out_variant_inplace_or_view>());
  m.impl("gdn_delta_rule_slots", torch::CppFunction::makeFromBoxedFunction<&out_variant_inplace_or_view>());
  m.impl("gdn_chunk_delta_rule_slots", torch::CppFunction::makeFromBoxedFunction<&out_variant_inplace_or_view>());
  m.impl("decode_gdn_layer", torch::CppFunction::makeFromBoxedFunction<&out_variant_inplace_or_view>());
}
