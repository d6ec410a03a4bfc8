// hebrus::ple_conv_slots on Apple GPUs: ple_conv whose row b reads its carried input tail from
// state_pool[slots[b]] and writes the new tail back there, in place (SPEC section 2, issue 19;
// hebrus_torch/reference.py is the spec: gather, ple_conv, index_copy_).
//
// Thread layout (hebrus_launch.h): ple_conv's grid, item x channel vector, HEBRUS_PLE_CONV_VEC
// channels per thread. Items [0, T) are tokens; a token at position rel >= L of its row reads only x
// and computes y there. Items [T, T + B) are rows: the thread of (row b, channel vector) checks the
// row's cu_seqlens and slot, computes y of the row's first min(n, L) tokens (the ones whose conv
// reaches into the tail) from the old tail, and then shifts the tail in place. It is the only thread
// that reads or writes those pool entries, so no thread reads another thread's store and the update
// needs no second launch. Every y is ple_conv.metal's expression (acc = acc + w * u in fp32,
// ascending k), so outputs and tails are bitwise those of ple_conv on the gathered tails, and
// chunk invariant. A row whose slot is out of range or named twice touches nothing of the pool.
#include "hebrus_metal_common.h"

// y[t, c] of the token at position rel of a row starting at token `start`; u is x, or before the
// row's first token its tail `tail` ([L, C]; read only when rel < L).
template <typename T>
inline T ple_conv_slots_out(device const T* x, device const T* weight, device const T* tail,
                            constant PleConvSlotsParams& p, long start, long rel, long c) {
  float acc = 0.0f;
  for (long k = 0; k < p.width; ++k) {
    const long src = rel - (p.width - 1 - k) * p.dilation;  // >= -L
    const T u = src >= 0 ? x[(start + src) * p.channels + c] : tail[(p.state_len + src) * p.channels + c];
    acc = acc + static_cast<float>(weight[c * p.width + k]) * static_cast<float>(u);
  }
  if (p.silu != 0) {
    acc = acc / (1.0f + precise::exp(-acc));
  }
  return static_cast<T>(acc);
}

template <typename T>
[[kernel]] void ple_conv_slots(device const T* x [[buffer(0)]],               // [T, C]
                               device const T* weight [[buffer(1)]],          // [C, K]
                               device const int* cu_seqlens [[buffer(2)]],    // [B + 1]
                               device T* state_pool [[buffer(3)]],            // [S, L, C], updated in place
                               device const int* slots [[buffer(4)]],         // [B]
                               device T* y [[buffer(5)]],                     // [T, C]
                               device HebrusErrorMessages* err [[buffer(6)]], // the stream's error buffer
                               constant PleConvSlotsParams& p [[buffer(7)]],
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
      return;  // invalid cu_seqlens; the row threads report it
    }
    const long rel = t - start;
    if (rel < L) {
      return;  // its conv reads the tail: the row's thread computes it before updating the tail
    }
    for (long c = c0; c < c1; ++c) {
      y[t * channels + c] = ple_conv_slots_out(x, weight, state_pool, p, start, rel, c);  // reads x only
    }
    return;
  }

  const long b = item - p.tokens;
  const bool report = c0 == 0;  // one thread per row reports
  if (report ? !hebrus_cu_row_ok(err, "ple_conv_slots", cu_seqlens, p.batch, p.tokens, b)
             : !hebrus_row_valid(cu_seqlens, p.batch, p.tokens, b)) {
    return;
  }
  if (!hebrus_slot_ok(err, "ple_conv_slots", slots, p.batch, p.pool, b, report)) {
    return;
  }
  const long start = cu_seqlens[b];
  const long n = long(cu_seqlens[b + 1]) - start;
  device T* tail = state_pool + long(slots[b]) * L * channels;
  const long head = hebrus_min(n, L);
  for (long rel = 0; rel < head; ++rel) {  // the outputs that read the old tail, first
    for (long c = c0; c < c1; ++c) {
      y[(start + rel) * channels + c] = ple_conv_slots_out(x, weight, tail, p, start, rel, c);
    }
  }
  // Then the tail: the last L entries of tail ++ x[start:end]. Entry l takes tail[l + n] (n >= 1, so
  // ascending l reads every entry before it is overwritten) or x[start + n - L + l].
  if (n == 0) {
    return;
  }
  for (long l = 0; l < L; ++l) {
    const long src = n - L + l;  // position in the row; negative: still inside the old tail
    for (long c = c0; c < c1; ++c) {
      tail[l * channels + c] = src >= 0 ? x[(start + src) * channels + c] : tail[(n + l) * channels + c];
    }
  }
}

// cu_seqlens and slots checked where ple_conv_slots launches no thread (B == 0 or C == 0).
[[kernel]] void ple_conv_slots_check(device const int* cu_seqlens [[buffer(0)]],
                                     device const int* slots [[buffer(1)]],
                                     device HebrusErrorMessages* err [[buffer(2)]],
                                     constant HebrusSlotsCheckParams& p [[buffer(3)]],
                                     uint tid [[thread_position_in_grid]]) {
  hebrus_check_cu_slots(cu_seqlens, slots, err, p, "ple_conv_slots", long(tid));
}

HEBRUS_INSTANTIATE(ple_conv_slots, float, float)
HEBRUS_INSTANTIATE(ple_conv_slots, half, half)
#if HEBRUS_HAS_BFLOAT
HEBRUS_INSTANTIATE(ple_conv_slots, bfloat, bfloat)
#endif
