// hebrus::gdn_delta_rule and hebrus::gdn_delta_rule_slots on Apple GPUs: the gated delta rule of
// packed rows in the recurrent form, each row's fp32 state [Hv, Dk, Dv] updated in place (the slot
// form: row b's state is state_pool[slots[b]]). hebrus_torch/reference.py is the spec; per row b,
// value head h and token t, key head kh = h / (Hv / Hk), q and k l2-normalised over Dk when asked
// (x / sqrt(sum x*x + 1e-6)), q then times scale:
//   S = S * exp(g[t, h]);  delta = (v[t, h] - sum_dk(S * k)) * beta[t, h];  S = S + k (outer) delta;
//   out[t, h] = sum_dk(S * q)
//
// Thread layout (hebrus_launch.h): one threadgroup of HEBRUS_GDN_SIMD_GROUPS SIMD-groups per
// (row b, value head h, block of HEBRUS_GDN_TG_COLS value columns). SIMD-group sg owns the
// HEBRUS_GDN_COLS columns j = block * TG_COLS + sg * COLS + c; lane l owns the key dims
// i = l + 32 m (m < DKPL, the variant "k<32 * DKPL>"), so the state entries S[i, j] of the
// SIMD-group's columns sit in the lane's registers (DKPL x COLS floats) for the whole token loop:
// the state is read from memory once and written once per launch, whatever the row's length.
// Every sum over Dk is the lane's own terms in ascending m, then simd_sum over the 32 lanes.
//
// The row's tokens run in tiles of HEBRUS_GDN_TILE: the threadgroup loads the tile's q and k rows
// of head kh once (SIMD-group sg normalises tokens sg, sg + NSG, ...: simd_sum of squares),
// parks them in threadgroup memory in fp32 with exp(g) and beta, and every SIMD-group then runs
// the tile's tokens through its columns. Two barriers per tile: the tile is complete before it
// is read, and read by every SIMD-group before the next tile overwrites it.
//
// Each output and state entry is computed by one fixed lane/SIMD-group with a fixed order of
// operations (the simd_sum tree is fixed per call site on a device), so the results depend only on
// the row's own inputs: not on the other rows of the launch, on how the row's tokens were cut into
// calls, or on thread timing (batch and chunk invariance, bitwise on a device). They match the CPU
// kernel, which sums over Dk in ascending order, to fp32 rounding.
//
// Value errors: the threadgroup (b, h = 0, block 0) checks row b's cu_seqlens (and, in the slot
// form, its slot: in range, named by no other row) and reports a bad one through the stream's error
// buffer; every threadgroup of a bad row returns before touching the state. A row of 0 tokens
// leaves its state as it is.
#include "hebrus_metal_common.h"

#define HEBRUS_GDN_L2_EPS 1e-6f  // transformers' (and FLA's) l2norm epsilon, as the CPU kernel

template <typename T, int DKPL, bool SLOTS>
inline void gdn_delta_rule_run(device const T* q, device const T* k, device const T* v, device const float* g,
                               device const float* beta, device const int* cu_seqlens, device float* state,
                               device const int* slots, device T* out, device HebrusErrorMessages* err,
                               constant GdnDeltaRuleParams& p, threadgroup float* q_tile,
                               threadgroup float* k_tile, threadgroup float* decay_tile,
                               threadgroup float* beta_tile, HEBRUS_CSTR op, uint item, uint lid, uint lane,
                               uint sg) {
  constexpr int NSG = HEBRUS_GDN_SIMD_GROUPS;
  constexpr int COLS = HEBRUS_GDN_COLS;
  constexpr int TILE = HEBRUS_GDN_TILE;
  constexpr int DKMAX = DKPL * HEBRUS_SIMD_WIDTH;
  static_assert(NSG * HEBRUS_SIMD_WIDTH == HEBRUS_GDN_TG && NSG * COLS == HEBRUS_GDN_TG_COLS, "layout");
  const long hv = p.value_heads, dk = p.key_dim, dv = p.value_dim;
  const long block = long(item) % p.col_blocks;
  const long bh = long(item) / p.col_blocks;
  const long h = bh % hv, b = bh / hv;
  const long kh = h / p.rep;

  const bool report = h == 0 && block == 0 && lid == 0;  // one thread per row reports
  if (report ? !hebrus_cu_row_ok(err, op, cu_seqlens, p.batch, p.tokens, b)
             : !hebrus_row_valid(cu_seqlens, p.batch, p.tokens, b)) {
    return;  // the whole threadgroup: the condition reads only shared values
  }
  long row = b;
  if (SLOTS) {
    if (!hebrus_slot_ok(err, op, slots, p.batch, p.pool, b, report)) {
      return;
    }
    row = slots[b];
  }
  const long start = cu_seqlens[b], end = cu_seqlens[b + 1];
  if (end == start) {
    return;  // no tokens: the state passes through untouched
  }

  // The lane's key dims: i = lane + 32 m for m < valid (the others hold 0 and are never summed).
  const int valid = int(hebrus_max(0, hebrus_min(long(DKPL), (dk - long(lane) + 31) / 32)));
  const long col0 = block * (NSG * COLS) + long(sg) * COLS;
  device float* st = state + (row * hv + h) * dk * dv;
  float s[DKPL][COLS];
  for (int m = 0; m < DKPL; ++m) {
    const long i = long(lane) + 32 * m;
    for (int c = 0; c < COLS; ++c) {
      s[m][c] = (m < valid && col0 + c < dv) ? st[i * dv + col0 + c] : 0.0f;
    }
  }

  for (long t0 = start; t0 < end; t0 += TILE) {
    const int nt = int(hebrus_min(long(TILE), end - t0));
    // The tile: q, k of head kh normalised (one SIMD-group per token), exp(g) and beta of head h.
    for (int tt = int(sg); tt < nt; tt += NSG) {
      const long t = t0 + tt;
      float qv[DKPL], kv[DKPL];
      float qss = 0.0f, kss = 0.0f;
      for (int m = 0; m < DKPL; ++m) {
        const long i = long(lane) + 32 * m;
        qv[m] = m < valid ? static_cast<float>(q[(t * p.key_heads + kh) * dk + i]) : 0.0f;
        kv[m] = m < valid ? static_cast<float>(k[(t * p.key_heads + kh) * dk + i]) : 0.0f;
        qss = qss + qv[m] * qv[m];
        kss = kss + kv[m] * kv[m];
      }
      float qinv = 1.0f, kinv = 1.0f;
      if (p.l2 != 0) {
        qss = simd_sum(qss);
        kss = simd_sum(kss);
        qinv = 1.0f / precise::sqrt(qss + HEBRUS_GDN_L2_EPS);
        kinv = 1.0f / precise::sqrt(kss + HEBRUS_GDN_L2_EPS);
      }
      for (int m = 0; m < DKPL; ++m) {
        const int i = int(lane) + 32 * m;
        q_tile[tt * DKMAX + i] = qv[m] * qinv * p.scale;
        k_tile[tt * DKMAX + i] = kv[m] * kinv;
      }
      if (lane == 0) {
        decay_tile[tt] = precise::exp(g[t * hv + h]);
        beta_tile[tt] = beta[t * hv + h];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the tile is complete

    for (int tt = 0; tt < nt; ++tt) {
      const long t = t0 + tt;
      const float decay = decay_tile[tt], bt = beta_tile[tt];
      float kk[DKPL], qq[DKPL];
      for (int m = 0; m < DKPL; ++m) {
        kk[m] = k_tile[tt * DKMAX + int(lane) + 32 * m];
        qq[m] = q_tile[tt * DKMAX + int(lane) + 32 * m];
      }
      for (int c = 0; c < COLS; ++c) {
        const long j = col0 + c;
        if (j >= dv) {
          break;  // uniform in the SIMD-group
        }
        float part = 0.0f;
        for (int m = 0; m < DKPL; ++m) {
          if (m < valid) {
            s[m][c] = s[m][c] * decay;
            part = part + s[m][c] * kk[m];
          }
        }
        const float sk = simd_sum(part);
        const float delta = (static_cast<float>(v[(t * hv + h) * dv + j]) - sk) * bt;
        float part_o = 0.0f;
        for (int m = 0; m < DKPL; ++m) {
          if (m < valid) {
            s[m][c] = s[m][c] + kk[m] * delta;
            part_o = part_o + s[m][c] * qq[m];
          }
        }
        const float o = simd_sum(part_o);
        if (lane == 0) {
          out[(t * hv + h) * dv + j] = static_cast<T>(o);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // every SIMD-group is done with the tile
  }

  for (int m = 0; m < DKPL; ++m) {
    const long i = long(lane) + 32 * m;
    for (int c = 0; c < COLS; ++c) {
      if (m < valid && col0 + c < dv) {
        st[i * dv + col0 + c] = s[m][c];
      }
    }
  }
}

template <typename T, int DKPL>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_GDN_TG)]] void gdn_delta_rule(
    device const T* q [[buffer(0)]],              // [T, Hk, Dk]
    device const T* k [[buffer(1)]],              // [T, Hk, Dk]
    device const T* v [[buffer(2)]],              // [T, Hv, Dv]
    device const float* g [[buffer(3)]],          // [T, Hv]
    device const float* beta [[buffer(4)]],       // [T, Hv]
    device const int* cu_seqlens [[buffer(5)]],   // [B + 1]
    device float* state [[buffer(6)]],            // [B, Hv, Dk, Dv], updated in place
    device T* out [[buffer(7)]],                  // [T, Hv, Dv]
    device HebrusErrorMessages* err [[buffer(8)]],  // the stream's error buffer
    constant GdnDeltaRuleParams& p [[buffer(9)]],
    uint item [[threadgroup_position_in_grid]],
    uint lid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float q_tile[HEBRUS_GDN_TILE * DKPL * HEBRUS_SIMD_WIDTH];
  threadgroup float k_tile[HEBRUS_GDN_TILE * DKPL * HEBRUS_SIMD_WIDTH];
  threadgroup float decay_tile[HEBRUS_GDN_TILE];
  threadgroup float beta_tile[HEBRUS_GDN_TILE];
  gdn_delta_rule_run<T, DKPL, false>(q, k, v, g, beta, cu_seqlens, state, nullptr, out, err, p, q_tile, k_tile,
                                     decay_tile, beta_tile, "gdn_delta_rule", item, lid, lane, sg);
}

template <typename T, int DKPL>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_GDN_TG)]] void gdn_delta_rule_slots(
    device const T* q [[buffer(0)]],              // [T, Hk, Dk]
    device const T* k [[buffer(1)]],              // [T, Hk, Dk]
    device const T* v [[buffer(2)]],              // [T, Hv, Dv]
    device const float* g [[buffer(3)]],          // [T, Hv]
    device const float* beta [[buffer(4)]],       // [T, Hv]
    device const int* cu_seqlens [[buffer(5)]],   // [B + 1]
    device float* state_pool [[buffer(6)]],       // [S, Hv, Dk, Dv], rows slots[b] updated in place
    device const int* slots [[buffer(7)]],        // [B]
    device T* out [[buffer(8)]],                  // [T, Hv, Dv]
    device HebrusErrorMessages* err [[buffer(9)]],  // the stream's error buffer
    constant GdnDeltaRuleParams& p [[buffer(10)]],
    uint item [[threadgroup_position_in_grid]],
    uint lid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float q_tile[HEBRUS_GDN_TILE * DKPL * HEBRUS_SIMD_WIDTH];
  threadgroup float k_tile[HEBRUS_GDN_TILE * DKPL * HEBRUS_SIMD_WIDTH];
  threadgroup float decay_tile[HEBRUS_GDN_TILE];
  threadgroup float beta_tile[HEBRUS_GDN_TILE];
  gdn_delta_rule_run<T, DKPL, true>(q, k, v, g, beta, cu_seqlens, state_pool, slots, out, err, p, q_tile, k_tile,
                                    decay_tile, beta_tile, "gdn_delta_rule_slots", item, lid, lane, sg);
}

// cu_seqlens checked where gdn_delta_rule launches no thread (B == 0: cu_seqlens must be [0], T 0).
[[kernel]] void gdn_delta_rule_check_cu(device const int* cu_seqlens [[buffer(0)]],
                                        device HebrusErrorMessages* err [[buffer(1)]],
                                        constant HebrusCheckParams& p [[buffer(2)]],
                                        uint tid [[thread_position_in_grid]]) {
  hebrus_check_cu(cu_seqlens, err, p, "gdn_delta_rule", long(tid));
}

// The same for the slot form (B == 0).
[[kernel]] void gdn_delta_rule_slots_check(device const int* cu_seqlens [[buffer(0)]],
                                           device const int* slots [[buffer(1)]],
                                           device HebrusErrorMessages* err [[buffer(2)]],
                                           constant HebrusSlotsCheckParams& p [[buffer(3)]],
                                           uint tid [[thread_position_in_grid]]) {
  hebrus_check_cu_slots(cu_seqlens, slots, err, p, "gdn_delta_rule_slots", long(tid));
}

#define HEBRUS_GDN_INSTANTIATE(type)                                         \
  HEBRUS_INSTANTIATE_VARIANT(gdn_delta_rule, k32, type, type, 1)             \
  HEBRUS_INSTANTIATE_VARIANT(gdn_delta_rule, k64, type, type, 2)             \
  HEBRUS_INSTANTIATE_VARIANT(gdn_delta_rule, k128, type, type, 4)            \
  HEBRUS_INSTANTIATE_VARIANT(gdn_delta_rule, k256, type, type, 8)            \
  HEBRUS_INSTANTIATE_VARIANT(gdn_delta_rule_slots, k32, type, type, 1)       \
  HEBRUS_INSTANTIATE_VARIANT(gdn_delta_rule_slots, k64, type, type, 2)       \
  HEBRUS_INSTANTIATE_VARIANT(gdn_delta_rule_slots, k128, type, type, 4)      \
  HEBRUS_INSTANTIATE_VARIANT(gdn_delta_rule_slots, k256, type, type, 8)

HEBRUS_GDN_INSTANTIATE(float)
HEBRUS_GDN_INSTANTIATE(half)
#if HEBRUS_HAS_BFLOAT
HEBRUS_GDN_INSTANTIATE(bfloat)
#endif
