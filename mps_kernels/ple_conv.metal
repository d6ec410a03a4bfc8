// hebrus::ple_conv on Apple GPUs: depthwise causal dilated conv over packed rows with carried input
// tails (SPEC section 2; hebrus_torch/reference.py is the spec).
//
// Thread layout (hebrus_launch.h): item x channel vector, HEBRUS_PLE_CONV_VEC channels per thread,
// consecutive threads on consecutive channel vectors (channel-contiguous, coalesced). Items
// [0, T) are tokens: y[t, c] = act(sum_k w[c, k] * u[t - (K-1-k) d, c]), accumulated in fp32 in
// ascending k as acc = acc + w * u, where u is the row's stream state ++ x. Items [T, T + B) are
// rows: they check the row's cu_seqlens and copy the last L inputs of the stream into new_state.
// Every output element is a function of its own row's inputs only, computed by the same
// expression whatever the chunking, so outputs and state are bitwise chunk invariant.
#include "hebrus_metal_common.h"

template <typename T>
[[kernel]] void ple_conv(device const T* x [[buffer(0)]],            // [T, C]
                         device const T* weight [[buffer(1)]],       // [C, K]
                         device const int* cu_seqlens [[buffer(2)]], // [B + 1]
                         device const T* state [[buffer(3)]],        // [B, L, C]
                         device T* y [[buffer(4)]],                  // [T, C]
                         device T* new_state [[buffer(5)]],          // [B, L, C]
                         device HebrusErrorMessages* err [[buffer(6)]], // the stream's error buffer
                         constant PleConvParams& p [[buffer(7)]],
                         uint tid [[thread_position_in_grid]]) {
  const long item = long(tid) / p.channel_vecs;
  const long c0 = (long(tid) % p.channel_vecs) * HEBRUS_PLE_CONV_VEC;
  if (item >= p.tokens + p.batch) {
    return;
  }
  const long channels = p.channels;
  const long c1 = hebrus_min(c0 + long(HEBRUS_PLE_CONV_VEC), channels);
  const long L = p.state_len;

  if (item < p.tokens) {
    const long t = item;
    const long b = hebrus_row_of(cu_seqlens, p.batch, t);
    const long start = cu_seqlens[b], end = cu_seqlens[b + 1];
    if (start < 0 || start > t || t >= end || end > p.tokens) {
      return;  // invalid cu_seqlens; the row threads report it and the glue raises
    }
    const long rel = t - start;  // position of token t in its row
    for (long c = c0; c < c1; ++c) {
      float acc = 0.0f;
      for (long k = 0; k < p.width; ++k) {
        const long src = rel - (p.width - 1 - k) * p.dilation;  // >= -L
        const T u = src >= 0 ? x[(start + src) * channels + c] : state[(b * L + L + src) * channels + c];
        acc = acc + static_cast<float>(weight[c * p.width + k]) * static_cast<float>(u);
      }
      if (p.silu != 0) {
        acc = acc / (1.0f + precise::exp(-acc));
      }
      y[t * channels + c] = static_cast<T>(acc);
    }
    return;
  }

  // Row item: check cu_seqlens, then new_state = last L entries of state[b] ++ x[start:end].
  const long b = item - p.tokens;
  if (c0 == 0 ? !hebrus_cu_row_ok(err, "ple_conv", cu_seqlens, p.batch, p.tokens, b)
              : !hebrus_row_valid(cu_seqlens, p.batch, p.tokens, b)) {
    return;
  }
  const long start = cu_seqlens[b];
  const long n = long(cu_seqlens[b + 1]) - start;
  for (long l = 0; l < L; ++l) {
    const long src = n - L + l;  // position in the row; negative: still inside the old state
    for (long c = c0; c < c1; ++c) {
      new_state[(b * L + l) * channels + c] =
          src >= 0 ? x[(start + src) * channels + c] : state[(b * L + n + l) * channels + c];
    }
  }
}

// cu_seqlens checked where ple_conv launches no thread (B == 0 or C == 0).
[[kernel]] void ple_conv_check_cu(device const int* cu_seqlens [[buffer(0)]],
                                  device HebrusErrorMessages* err [[buffer(1)]],
                                  constant HebrusCheckParams& p [[buffer(2)]],
                                  uint tid [[thread_position_in_grid]]) {
  hebrus_check_cu(cu_seqlens, err, p, "ple_conv", long(tid));
}

HEBRUS_INSTANTIATE(ple_conv, float, float)
HEBRUS_INSTANTIATE(ple_conv, half, half)
#if HEBRUS_HAS_BFLOAT
HEBRUS_INSTANTIATE(ple_conv, bfloat, bfloat)
#endif
