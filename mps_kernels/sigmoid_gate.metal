// hebrus::sigmoid_gate on Apple GPUs (issue 37): the indexed attention's output gate, x * sigmoid(gate) in x's
// dtype, in one launch (hebrus_torch/reference/attention.py sigmoid_gate is the spec; it replaces the gate's
// contiguous copy, torch.sigmoid and the mul of transformers' Qwen4ExpTextAttention).
//
// Thread layout (hebrus_launch.h): one thread per element of x [T, H, D]. As torch computes it: the sigmoid
// in fp32 rounded to T, then the product in fp32 rounded to T. The gate is read through the strides of its
// first two dims (its last dim is contiguous), so q_proj's gate half is read in place.
#include "hebrus_metal_common.h"

template <typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_SIGMOID_GATE_TG)]] void sigmoid_gate(
    device const T* x [[buffer(0)]],              // [T, H, D]
    device const T* gate [[buffer(1)]],           // [T, H, D] through strides (g_stride0, g_stride1, 1)
    device T* out [[buffer(2)]],                  // [T, H, D]
    device HebrusErrorMessages* err [[buffer(3)]],  // the stream's error buffer (no value to check)
    constant SigmoidGateParams& p [[buffer(4)]],
    uint tid [[thread_position_in_grid]]) {
  const long i = long(tid);
  if (i >= p.elements) {
    return;
  }
  const long d = i % p.dim, row = i / p.dim;
  const long t = row / p.heads, h = row % p.heads;
  const float g = static_cast<float>(gate[t * p.g_stride0 + h * p.g_stride1 + d]);
  const T s = static_cast<T>(1.0f / (1.0f + precise::exp(-g)));
  out[i] = static_cast<T>(static_cast<float>(x[i]) * static_cast<float>(s));
}

HEBRUS_INSTANTIATE(sigmoid_gate, float, float)
HEBRUS_INSTANTIATE(sigmoid_gate, half, half)
#if HEBRUS_HAS_BFLOAT
HEBRUS_INSTANTIATE(sigmoid_gate, bfloat, bfloat)
#endif
