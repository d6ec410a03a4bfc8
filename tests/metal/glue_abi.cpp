// The MPS glue's decisions on Linux: csrc/mps/hebrus_glue.h, the header every csrc/mps/<op>.mm
// calls, built as a torch extension and called with DeviceType::CPU. Each op returns its launches
// (library, kernel, bound tensors, written and in-place flags, error and parameter buffer indices,
// parameter bytes, dispatch) and its outputs; tests/metal/hebrus_emu.py runs those launches in the
// emulator.
#include <torch/extension.h>

#include "hebrus_glue.h"

namespace {

py::tuple to_py(const hebrus::glue::Call& call) {
  py::list launches;
  for (const auto& l : call.launches) {
    py::dict d;
    d["stem"] = l.stem;
    d["kernel"] = l.kernel;
    d["tensors"] = l.tensors;
    d["written"] = l.written;
    d["in_place"] = l.in_place;
    d["error_index"] = l.error_index;
    d["params_index"] = l.params_index;
    d["params"] = py::bytes(reinterpret_cast<const char*>(l.params.data()), l.params.size());
    d["threads"] = l.threads;
    d["group"] = l.group;
    launches.append(d);
  }
  return py::make_tuple(launches, call.outputs);
}

constexpr auto kCpu = c10::DeviceType::CPU;

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("ple_conv", [](const at::Tensor& x, const at::Tensor& w, const at::Tensor& cu, const at::Tensor& state,
                       int64_t dilation, const std::string& act) {
    return to_py(hebrus::glue::ple_conv(x, w, cu, state, dilation, act, kCpu));
  });
  m.def("ple_ngram_ids", [](const at::Tensor& tokens, const at::Tensor& cu, const at::Tensor& history,
                            const at::Tensor& mult, const at::Tensor& sizes, const at::Tensor& offsets, int64_t eos,
                            int64_t vocab) {
    return to_py(hebrus::glue::ple_ngram_ids(tokens, cu, history, mult, sizes, offsets, eos, vocab, kCpu));
  });
  // The pools are updated in place: the launch binds the caller's tensor itself.
  m.def("ple_conv_slots", [](const at::Tensor& x, const at::Tensor& w, const at::Tensor& cu, const at::Tensor& pool,
                             const at::Tensor& slots, int64_t dilation, const std::string& act) {
    return to_py(hebrus::glue::ple_conv_slots(x, w, cu, pool, slots, dilation, act, kCpu));
  });
  m.def("ple_ngram_ids_slots", [](const at::Tensor& tokens, const at::Tensor& cu, const at::Tensor& pool,
                                  const at::Tensor& slots, const at::Tensor& mult, const at::Tensor& sizes,
                                  const at::Tensor& offsets, int64_t eos, int64_t vocab) {
    return to_py(hebrus::glue::ple_ngram_ids_slots(tokens, cu, pool, slots, mult, sizes, offsets, eos, vocab, kCpu));
  });
  m.def("qsa_pool", [](const at::Tensor& keys, const at::Tensor& cell_pos, const at::Tensor& group_cells,
                       const at::Tensor& group_pos, const at::Tensor& w, double eps, const at::Tensor& inv_freq) {
    return to_py(hebrus::glue::qsa_pool(keys, cell_pos, group_cells, group_pos, w, eps, inv_freq, kCpu));
  });
  m.def("qsa_select", [](const at::Tensor& q, const at::Tensor& pooled, const at::Tensor& seq_groups,
                         const at::Tensor& q_row, const at::Tensor& q_groups, int64_t top_k) {
    return to_py(hebrus::glue::qsa_select(q, pooled, seq_groups, q_row, q_groups, top_k, kCpu));
  });
  m.def("qsa_attention", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tc,
                            double scale) { return to_py(hebrus::glue::qsa_attention(q, k, v, tc, scale, kCpu)); });
  m.def("qsa_token_cells", [](const at::Tensor& selected, const at::Tensor& nvis, const at::Tensor& first,
                              const at::Tensor& cells, int64_t r) {
    return to_py(hebrus::glue::qsa_token_cells(selected, nvis, first, cells, r, kCpu));
  });
  m.def("rms_norm_rope", [](const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& cos,
                            const at::Tensor& sin) {
    return to_py(hebrus::glue::rms_norm_rope(x, weight, eps, cos, sin, kCpu));
  });
  m.def("sigmoid_gate", [](const at::Tensor& x, const at::Tensor& gate) {
    return to_py(hebrus::glue::sigmoid_gate(x, gate, kCpu));
  });
  // The state (pool) is updated in place: the launch binds the caller's tensor itself.
  m.def("gdn_delta_rule", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                             const at::Tensor& beta, const at::Tensor& cu, const at::Tensor& state, double scale,
                             bool l2) {
    return to_py(hebrus::glue::gdn_delta_rule(q, k, v, g, beta, cu, state, scale, l2, kCpu));
  });
  m.def("gdn_delta_rule_slots", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                   const at::Tensor& beta, const at::Tensor& cu, const at::Tensor& pool,
                                   const at::Tensor& slots, double scale, bool l2) {
    return to_py(hebrus::glue::gdn_delta_rule_slots(q, k, v, g, beta, cu, pool, slots, scale, l2, kCpu));
  });
  m.def("gdn_chunk_delta_rule_slots", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& g, const at::Tensor& beta, const at::Tensor& cu,
                                         const at::Tensor& start_pos, const at::Tensor& pool, const at::Tensor& slots,
                                         double scale, bool l2norm) {
    return to_py(hebrus::glue::gdn_chunk_delta_rule_slots(q, k, v, g, beta, cu, start_pos, pool, slots, scale, l2norm,
                                                          kCpu));
  });
  m.def("moe_experts", [](const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                          const at::Tensor& gate_up, const at::Tensor& down) {
    return to_py(hebrus::glue::moe_experts(x, ids, weights, gate_up, down, kCpu));
  });
  m.def("moe_experts_quantized", [](const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                                    const at::Tensor& guq, const at::Tensor& gus, const at::Tensor& gub,
                                    const at::Tensor& dq, const at::Tensor& ds, const at::Tensor& db, int64_t group_size,
                                    int64_t bits) {
    return to_py(hebrus::glue::moe_experts_quantized(x, ids, weights, guq, gus, gub, dq, ds, db, group_size, bits,
                                                     kCpu));
  });
  m.def("quantized_linear", [](const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                               const at::Tensor& biases, int64_t group_size, int64_t bits) {
    return to_py(hebrus::glue::quantized_linear(x, wq, scales, biases, group_size, bits, kCpu));
  });
  m.def("hc_rms_norm", [](const at::Tensor& x, const at::Tensor& weight, int64_t group_size, double eps) {
    return to_py(hebrus::glue::hc_rms_norm(x, weight, group_size, eps, kCpu));
  });
  m.def("gdn_gates", [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log, const at::Tensor& dt_bias) {
    return to_py(hebrus::glue::gdn_gates(a, b, A_log, dt_bias, kCpu));
  });
  m.def("gdn_gated_rms_norm", [](const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight, double eps,
                                 const std::string& activation) {
    return to_py(hebrus::glue::gdn_gated_rms_norm(x, gate, weight, eps, activation, kCpu));
  });
  m.def("hc_premix", [](const at::Tensor& h, const at::Tensor& norm_weight, const at::Tensor& down,
                        const at::Tensor& up, const c10::optional<at::Tensor>& inject, int64_t hc_count, double eps) {
    return to_py(hebrus::glue::hc_premix(h, norm_weight, down, up, inject, hc_count, eps, kCpu));
  });
  m.def("hc_premix_quantized",
        [](const at::Tensor& h, const at::Tensor& norm_weight, const at::Tensor& down_q, const at::Tensor& down_scales,
           const at::Tensor& down_biases, const at::Tensor& up_q, const at::Tensor& up_scales,
           const at::Tensor& up_biases, const c10::optional<at::Tensor>& inject_q,
           const c10::optional<at::Tensor>& inject_scales, const c10::optional<at::Tensor>& inject_biases,
           int64_t hc_count, double eps, int64_t group_size, int64_t bits) {
          return to_py(hebrus::glue::hc_premix_quantized(h, norm_weight, down_q, down_scales, down_biases, up_q,
                                                         up_scales, up_biases, inject_q, inject_scales, inject_biases,
                                                         hc_count, eps, group_size, bits, kCpu));
        });
  m.def("hc_post_combine", [](const at::Tensor& hyper, const at::Tensor& out, const at::Tensor& inject) {
    return to_py(hebrus::glue::hc_post_combine(hyper, out, inject, kCpu));
  });
  m.def("moe_route", [](const at::Tensor& logits, const std::optional<at::Tensor>& shared, int64_t top_k, bool norm) {
    return to_py(hebrus::glue::moe_route(logits, shared, top_k, norm, kCpu));
  });
  m.def("moe_shared_expert", [](const at::Tensor& x, const at::Tensor& routed, const at::Tensor& gp,
                                const at::Tensor& up, const at::Tensor& dp, const at::Tensor& gate) {
    return to_py(hebrus::glue::moe_shared_expert(x, routed, gp, up, dp, gate, kCpu));
  });
  m.def("moe_shared_expert_quantized",
        [](const at::Tensor& x, const at::Tensor& routed, const at::Tensor& gq, const at::Tensor& gs,
           const at::Tensor& gb, const at::Tensor& uq, const at::Tensor& us, const at::Tensor& ub,
           const at::Tensor& dq, const at::Tensor& ds, const at::Tensor& db, const at::Tensor& gate,
           int64_t group_size, int64_t bits) {
          return to_py(hebrus::glue::moe_shared_expert_quantized(x, routed, gq, gs, gb, uq, us, ub, dq, ds, db, gate,
                                                                 group_size, bits, kCpu));
        });
  m.def("error_buffer_bytes", [] { return sizeof(HebrusErrorMessages); });
}
