// hebrus::moe_route on Apple GPUs (issue 37): a MoE block's router after its linear, and the shared
// expert's sigmoid gate, in one launch (hebrus_torch/reference/moe.py is the spec, transformers'
// Qwen4ExpTextTopKRouter the model).
//
// Thread layout (hebrus_launch.h): one SIMD-group (32 lanes) per row, 8 per threadgroup; the last
// threadgroup may hold fewer SIMD-groups, never a partial one. Lane l reads experts l, l + 32, ...:
//   softmax in fp32: m = simd_max of the logits, s = simd_sum of the lanes' sums of exp(x - m) (each in
//     ascending expert id), p_e = exp(x_e - m) * (1 / s);
//   top-k by k rounds of selection: round j takes the first (p, e) after round j - 1's in the order
//     "larger p first, the lower expert id first among equal p" (simd_max of the lanes' best p, then
//     simd_min of the ids that hold it), so every lane holds every value and id;
//   weights: p_j, or p_j / (((0 + p_0) + p_1) + ... + p_{k-1}) with norm, rounded to T; then the S shared
//     gates 1 / (1 + exp(-x)) in fp32, rounded to T.
// A row reads only its own logits: its outputs do not depend on the other rows of the launch.
#include "hebrus_metal_common.h"

// (v, i) comes before (w, j) in the selection's order: larger probability first, then the lower id.
inline bool hebrus_route_precedes(float v, int i, float w, int j) {
  return v > w || (v == w && i < j);
}

template <typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_MOE_ROUTE_TG)]] void moe_route(
    device const T* logits [[buffer(0)]],           // [T, E]
    device const T* shared [[buffer(1)]],           // [T, S] (router_logits again where S = 0: not read)
    device long* ids [[buffer(2)]],                 // [T, k]
    device T* weights [[buffer(3)]],                // [T, k + S]
    device HebrusErrorMessages* err [[buffer(4)]],  // the stream's error buffer (no value to check)
    constant MoeRouteParams& p [[buffer(5)]],
    uint tid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const long row = long(tid) / HEBRUS_SIMD_WIDTH;
  if (row >= p.rows) {
    return;  // whole SIMD-groups only: the grid is a multiple of 32 threads
  }
  const int experts = int(p.experts);
  device const T* lr = logits + row * p.experts;
  float mx = -INFINITY;
  for (int e = int(lane); e < experts; e += HEBRUS_SIMD_WIDTH) {
    mx = max(mx, static_cast<float>(lr[e]));
  }
  mx = simd_max(mx);
  float sum = 0.0f;
  for (int e = int(lane); e < experts; e += HEBRUS_SIMD_WIDTH) {
    sum = sum + precise::exp(static_cast<float>(lr[e]) - mx);
  }
  const float inv = 1.0f / simd_sum(sum);
  float top[HEBRUS_MOE_ROUTE_MAX_K];
  float total = 0.0f;
  float last_v = INFINITY;
  int last_i = -1;
  for (long j = 0; j < p.top_k; ++j) {
    float best_v = -1.0f;  // below every probability
    int best_i = 0x7FFFFFFF;
    for (int e = int(lane); e < experts; e += HEBRUS_SIMD_WIDTH) {
      const float v = precise::exp(static_cast<float>(lr[e]) - mx) * inv;
      if (hebrus_route_precedes(last_v, last_i, v, e) && hebrus_route_precedes(v, e, best_v, best_i)) {
        best_v = v;
        best_i = e;
      }
    }
    const float v = simd_max(best_v);
    const int i = simd_min(best_v == v ? best_i : 0x7FFFFFFF);
    top[j] = v;
    total = total + v;
    last_v = v;
    last_i = i;
    if (lane == 0) {
      ids[row * p.top_k + j] = long(i);
    }
  }
  device T* wr = weights + row * (p.top_k + p.shared);
  for (long j = long(lane); j < p.top_k; j += HEBRUS_SIMD_WIDTH) {
    wr[j] = static_cast<T>(p.norm != 0 ? top[j] / total : top[j]);
  }
  device const T* sr = shared + row * p.shared;
  for (long c = long(lane); c < p.shared; c += HEBRUS_SIMD_WIDTH) {
    const float x = static_cast<float>(sr[c]);
    wr[p.top_k + c] = static_cast<T>(1.0f / (1.0f + precise::exp(-x)));
  }
}

HEBRUS_INSTANTIATE(moe_route, float, float)
HEBRUS_INSTANTIATE(moe_route, half, half)
#if HEBRUS_HAS_BFLOAT
HEBRUS_INSTANTIATE(moe_route, bfloat, bfloat)
#endif
