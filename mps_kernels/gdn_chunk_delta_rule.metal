// hebrus::gdn_chunk_delta_rule_slots on Apple GPUs: the gated delta rule of packed rows, row b reading
// and updating state_pool[slots[b]] in place, in the chunked (WY) form aligned to absolute positions
// (hebrus_torch/gdn/chunked.py is the spec: whole chunks of 64 chunked, partial chunks at a row's ends
// recurrent).
//
// Thread layout (hebrus_launch.h): one threadgroup of 4 SIMD-groups per (row, value head, block of 32
// value columns). The grid comes from shapes only; each threadgroup reads its row's cu_seqlens,
// start_pos and slot, checks them (one threadgroup per row reports) and walks the row's pieces in
// order, its [Dk, 32] block of the state on chip: in threadgroup memory during recurrent pieces, in
// simdgroup 8x8 tiles (SIMD-group s holds columns [8s, 8s + 8), all Dk rows) during chunks. Every
// value a threadgroup computes depends on its own row, head and columns only, in one fixed order, so
// results are bitwise independent of the other rows and of where a stream was cut at multiples of 64.
//
// One chunk (q, k normalised and scaled as the spec says, G the in-chunk cumulative gate, S the
// block at the chunk's start; the spec's U - W S is computed as T (beta (V - e^G K S))):
//   pass A, over Dk slabs of 16: K K^T and Q K^T (the 36 lower 8x8 tiles of each, 9 per SIMD-group),
//           K S and Q S (SIMD-group s: its columns), all accumulated in tiles;
//   M = -L (L[i, j] = beta_i k_i.k_j e^(G_i - G_j), j < i); Y = beta (V - e^G K S);
//   V' = (I + L)^-1 Y by blocked forward substitution: V'_I = T_II (Y_I + sum_{J<I} M_IJ V'_J), T_II the
//           inverted 8x8 diagonal blocks (scalar forward substitution);
//   M = A (A[i, j] = q_i.k_j e^(G_i - G_j), j <= i); O = e^G Q S + A V';
//   pass B, over Dk slabs: S = e^(G_last) S + (e^(G_last - G) K)^T V'.
#include "hebrus_metal_common.h"

#define GDN_C HEBRUS_GDN_CHUNK
#define GDN_DVB HEBRUS_GDN_CHUNK_DVB
#define GDN_SLAB HEBRUS_GDN_CHUNK_SLAB
#define GDN_DKT (HEBRUS_GDN_CHUNK_MAX_DK / 8)

// Lower tile (I, J), J <= I, of the 64 x 64 chunk matrices: index I (I + 1) / 2 + J, owned by SIMD-group
// index % 4 (9 tiles each).
inline bool gdn_owns(uint sg, uint I, uint J) { return (I * (I + 1) / 2 + J) % 4u == sg; }

template <typename T, typename GT>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_GDN_CHUNK_TG)]] void gdn_chunk_delta_rule_slots(
    device const T* q [[buffer(0)]],                // [T, Hk, Dk]
    device const T* k [[buffer(1)]],                // [T, Hk, Dk]
    device const T* v [[buffer(2)]],                // [T, Hv, Dv]
    device const GT* g [[buffer(3)]],               // [T, Hv]
    device const GT* beta [[buffer(4)]],            // [T, Hv]
    device const int* cu_seqlens [[buffer(5)]],     // [B + 1]
    device const long* start_pos [[buffer(6)]],     // [B]
    device float* state_pool [[buffer(7)]],         // [S, Hv, Dk, Dv], updated in place
    device const int* slots [[buffer(8)]],          // [B]
    device T* out [[buffer(9)]],                    // [T, Hv, Dv]
    device HebrusErrorMessages* err [[buffer(10)]], // the stream's error buffer
    constant GdnChunkParams& p [[buffer(11)]],
    uint tg [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float mat[GDN_C * GDN_C];       // -L, then A; between chunks the state block [128][32]
  threadgroup float blk[GDN_C * GDN_DVB];     // Y, V', O [64][32]; the K / Q slabs [64][16] each
  threadgroup float tinv[8 * 64];             // (I + L)_II^-1, 8 blocks of 8 x 8; e^(G_last) I in pass B
  threadgroup float gate[GDN_C];              // G (in-chunk cumulative gate)
  threadgroup float bet[GDN_C];               // beta
  threadgroup float knorm[GDN_C];             // k and q l2-norm factors per token
  threadgroup float qnorm[GDN_C];

  const long nblk = p.dv_blocks, hv = p.value_heads, dk = p.key_dim, dv = p.value_dim;
  const long b = long(tg) / (nblk * hv);
  const long h = (long(tg) / nblk) % hv;
  const long c0 = (long(tg) % nblk) * GDN_DVB;  // first value column of the block
  const long hk = h / (hv / p.key_heads);       // GQA: value head h reads key head h / (Hv / Hk)
  const long dkt = (dk + 7) / 8;                 // key dim tiles
  const long slabs = (dk + GDN_SLAB - 1) / GDN_SLAB;
  if (b >= p.batch) {
    return;
  }
  // Row checks: every thread reads the same entries and takes the same branch; one thread per row reports.
  const bool report = tid == 0 && h == 0 && c0 == 0;
  if (report ? !hebrus_cu_row_ok(err, "gdn_chunk_delta_rule_slots", cu_seqlens, p.batch, p.tokens, b)
             : !hebrus_row_valid(cu_seqlens, p.batch, p.tokens, b)) {
    return;
  }
  if (!hebrus_slot_ok(err, "gdn_chunk_delta_rule_slots", slots, p.batch, p.pool, b, report)) {
    return;
  }
  const long start = start_pos[b];
  if (start < 0) {
    if (report) {
      HEBRUS_REPORT_ERROR(err, "gdn_chunk_delta_rule_slots", "hebrus::gdn_chunk_delta_rule_slots: start_pos[", b,
                          "] = ", start, " is negative");
    }
    return;
  }
  const long t0 = cu_seqlens[b];
  const long n = long(cu_seqlens[b + 1]) - t0;
  if (n == 0) {
    return;  // the state passes through untouched
  }
  device float* S = state_pool + (long(slots[b]) * hv + h) * dk * dv;  // [Dk, Dv]
  const float scale = p.scale;
  const bool l2 = p.l2norm != 0;

  // The state block into threadgroup memory ([128][32], zero past Dk and Dv).
  for (uint e = tid; e < GDN_DKT * 8 * GDN_DVB; e += HEBRUS_GDN_CHUNK_TG) {
    const long d = long(e) / GDN_DVB, col = c0 + long(e) % GDN_DVB;
    mat[e] = d < dk && col < dv ? S[d * dv + col] : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  threadgroup float* matp = mat;
  threadgroup float* blkp = blk;
  threadgroup float* tinvp = tinv;
  simdgroup_float8x8 st[GDN_DKT];  // the state block's column tile sg, in registers during chunks
  bool in_tiles = false;

  long pos = start;
  const long end = start + n;
  while (pos < end) {
    const long chunk_end = (pos / GDN_C + 1) * GDN_C;
    const long m = hebrus_min(chunk_end, end) - pos;
    const long tok = t0 + (pos - start);  // packed index of the piece's first token
    if (pos % GDN_C == 0 && m == GDN_C) {
      // ---------------- a whole chunk: the chunked form ----------------
      if (!in_tiles) {
        for (long d = 0; d < dkt; ++d) {
          simdgroup_load(st[d], matp + d * 8 * GDN_DVB + sg * 8, GDN_DVB);
        }
        in_tiles = true;
        threadgroup_barrier(mem_flags::mem_threadgroup);  // mat is the chunk's matrix from here on
      }
      // Gates, beta, norm factors.
      if (tid < GDN_C) {
        const long t = tok + tid;
        gate[tid] = static_cast<float>(g[t * hv + h]);
        bet[tid] = static_cast<float>(beta[t * hv + h]);
        float s = 0.0f;
        for (long d = 0; d < dk; ++d) {
          const float x = static_cast<float>(k[(t * p.key_heads + hk) * dk + d]);
          s = s + x * x;
        }
        knorm[tid] = l2 ? precise::rsqrt(s + 1e-6f) : 1.0f;
      } else {
        const long t = tok + (tid - GDN_C);
        float s = 0.0f;
        for (long d = 0; d < dk; ++d) {
          const float x = static_cast<float>(q[(t * p.key_heads + hk) * dk + d]);
          s = s + x * x;
        }
        qnorm[tid - GDN_C] = l2 ? precise::rsqrt(s + 1e-6f) : 1.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (tid == 0) {
        float acc = 0.0f;
        for (uint i = 0; i < GDN_C; ++i) {
          acc = acc + gate[i];
          gate[i] = acc;
        }
      }
      // Pass A: K K^T, Q K^T, K S, Q S over slabs of 16 key dims.
      simdgroup_float8x8 lt[9], at[9], ks[8], qs[8];
      for (uint u = 0; u < 9; ++u) {
        lt[u] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        at[u] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      }
      for (uint I = 0; I < 8; ++I) {
        ks[I] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        qs[I] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      }
      threadgroup float* kslab = blkp;
      threadgroup float* qslab = blkp + GDN_C * GDN_SLAB;
      for (long sl = 0; sl < slabs; ++sl) {
        for (uint e = tid; e < GDN_C * GDN_SLAB; e += HEBRUS_GDN_CHUNK_TG) {
          const long i = long(e) / GDN_SLAB, d = sl * GDN_SLAB + long(e) % GDN_SLAB;
          const long src = ((tok + i) * p.key_heads + hk) * dk + d;
          kslab[e] = d < dk ? static_cast<float>(k[src]) * knorm[i] : 0.0f;
          qslab[e] = d < dk ? static_cast<float>(q[src]) * qnorm[i] * scale : 0.0f;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (long tt = 0; tt < 2; ++tt) {
          const long d = sl * 2 + tt;
          if (d >= dkt) {
            break;
          }
          simdgroup_float8x8 kt[8];  // K_J^T: rows = these 8 key dims, columns = tokens of tile J
          for (uint J = 0; J < 8; ++J) {
            simdgroup_load(kt[J], kslab + J * 8 * GDN_SLAB + tt * 8, GDN_SLAB, ulong2(0, 0), true);
          }
          uint u = 0;
          for (uint I = 0; I < 8; ++I) {
            simdgroup_float8x8 xk, xq;
            simdgroup_load(xk, kslab + I * 8 * GDN_SLAB + tt * 8, GDN_SLAB);
            simdgroup_load(xq, qslab + I * 8 * GDN_SLAB + tt * 8, GDN_SLAB);
            simdgroup_multiply_accumulate(ks[I], xk, st[d], ks[I]);
            simdgroup_multiply_accumulate(qs[I], xq, st[d], qs[I]);
            for (uint J = 0; J <= I; ++J) {
              if (gdn_owns(sg, I, J)) {
                simdgroup_multiply_accumulate(lt[u], xk, kt[J], lt[u]);
                simdgroup_multiply_accumulate(at[u], xq, kt[J], at[u]);
                ++u;
              }
            }
          }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);  // the slabs are restaged next
      }
      // K K^T tiles into mat, K S into blk (the slabs are done).
      {
        uint u = 0;
        for (uint I = 0; I < 8; ++I) {
          for (uint J = 0; J <= I; ++J) {
            if (gdn_owns(sg, I, J)) {
              simdgroup_store(lt[u], matp + I * 8 * GDN_C + J * 8, GDN_C);
              ++u;
            }
          }
          simdgroup_store(ks[I], blkp + I * 8 * GDN_DVB + sg * 8, GDN_DVB);
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      // M = -L on the lower tiles; Y = beta (V - e^G K S).
      for (uint e = tid; e < GDN_C * GDN_C; e += HEBRUS_GDN_CHUNK_TG) {
        const uint i = e / GDN_C, j = e % GDN_C;
        if (j / 8 <= i / 8) {
          mat[e] = j < i ? -((bet[i] * mat[e]) * precise::exp(gate[i] - gate[j])) : 0.0f;
        }
      }
      for (uint e = tid; e < GDN_C * GDN_DVB; e += HEBRUS_GDN_CHUNK_TG) {
        const uint i = e / GDN_DVB;
        const long col = c0 + long(e % GDN_DVB);
        const float x = col < dv ? static_cast<float>(v[(tok + i) * hv * dv + h * dv + col]) : 0.0f;
        blk[e] = bet[i] * (x - precise::exp(gate[i]) * blk[e]);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      // (I + L)_II^-1 = (I - M_II)^-1 by forward substitution, one thread per (block, column).
      if (tid < 64) {
        const uint I = tid / 8, c = tid % 8;
        float x[8];
        for (uint r = 0; r < 8; ++r) {
          float acc = r == c ? 1.0f : 0.0f;
          for (uint j = c; j < r; ++j) {
            acc = acc + mat[(I * 8 + r) * GDN_C + I * 8 + j] * x[j];
          }
          x[r] = acc;
          tinv[I * 64 + r * 8 + c] = acc;
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      // V' = (I + L)^-1 Y, SIMD-group sg for its 8 columns.
      simdgroup_float8x8 vn[8];
      for (uint I = 0; I < 8; ++I) {
        simdgroup_float8x8 acc, mij, ti;
        simdgroup_load(acc, blkp + I * 8 * GDN_DVB + sg * 8, GDN_DVB);
        for (uint J = 0; J < I; ++J) {
          simdgroup_load(mij, matp + I * 8 * GDN_C + J * 8, GDN_C);
          simdgroup_multiply_accumulate(acc, mij, vn[J], acc);
        }
        simdgroup_load(ti, tinvp + I * 64, 8);
        simdgroup_multiply(vn[I], ti, acc);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // mat and blk are rewritten next
      // Q K^T tiles into mat, Q S into blk.
      {
        uint u = 0;
        for (uint I = 0; I < 8; ++I) {
          for (uint J = 0; J <= I; ++J) {
            if (gdn_owns(sg, I, J)) {
              simdgroup_store(at[u], matp + I * 8 * GDN_C + J * 8, GDN_C);
              ++u;
            }
          }
          simdgroup_store(qs[I], blkp + I * 8 * GDN_DVB + sg * 8, GDN_DVB);
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (uint e = tid; e < GDN_C * GDN_C; e += HEBRUS_GDN_CHUNK_TG) {
        const uint i = e / GDN_C, j = e % GDN_C;
        if (j / 8 <= i / 8) {
          mat[e] = j <= i ? mat[e] * precise::exp(gate[i] - gate[j]) : 0.0f;
        }
      }
      for (uint e = tid; e < GDN_C * GDN_DVB; e += HEBRUS_GDN_CHUNK_TG) {
        blk[e] = precise::exp(gate[e / GDN_DVB]) * blk[e];
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      // O = e^G Q S + A V'.
      for (uint I = 0; I < 8; ++I) {
        simdgroup_float8x8 acc, aij;
        simdgroup_load(acc, blkp + I * 8 * GDN_DVB + sg * 8, GDN_DVB);
        for (uint J = 0; J <= I; ++J) {
          simdgroup_load(aij, matp + I * 8 * GDN_C + J * 8, GDN_C);
          simdgroup_multiply_accumulate(acc, aij, vn[J], acc);
        }
        simdgroup_store(acc, blkp + I * 8 * GDN_DVB + sg * 8, GDN_DVB);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (uint e = tid; e < GDN_C * GDN_DVB; e += HEBRUS_GDN_CHUNK_TG) {
        const long col = c0 + long(e % GDN_DVB);
        if (col < dv) {
          out[(tok + long(e / GDN_DVB)) * hv * dv + h * dv + col] = static_cast<T>(blk[e]);
        }
      }
      // Pass B: S = e^(G_last) S + (e^(G_last - G) K)^T V'.
      const float glast = gate[GDN_C - 1];
      if (tid < 64) {
        tinv[tid] = tid / 8 == tid % 8 ? precise::exp(glast) : 0.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // blk's output is read; tinv holds e^(G_last) I
      simdgroup_float8x8 decay;
      simdgroup_load(decay, tinvp, 8);
      for (long sl = 0; sl < slabs; ++sl) {
        for (uint e = tid; e < GDN_C * GDN_SLAB; e += HEBRUS_GDN_CHUNK_TG) {
          const long i = long(e) / GDN_SLAB, d = sl * GDN_SLAB + long(e) % GDN_SLAB;
          kslab[e] = d < dk ? static_cast<float>(k[((tok + i) * p.key_heads + hk) * dk + d]) * knorm[i] *
                                  precise::exp(glast - gate[i])
                            : 0.0f;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (long tt = 0; tt < 2; ++tt) {
          const long d = sl * 2 + tt;
          if (d >= dkt) {
            break;
          }
          simdgroup_multiply(st[d], st[d], decay);
          for (uint I = 0; I < 8; ++I) {
            simdgroup_float8x8 kt;
            simdgroup_load(kt, kslab + I * 8 * GDN_SLAB + tt * 8, GDN_SLAB, ulong2(0, 0), true);
            simdgroup_multiply_accumulate(st[d], kt, vn[I], st[d]);
          }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
      }
    } else {
      // ---------------- a partial chunk: the recurrent form, token by token ----------------
      if (in_tiles) {
        for (long d = 0; d < dkt; ++d) {
          simdgroup_store(st[d], matp + d * 8 * GDN_DVB + sg * 8, GDN_DVB);
        }
        in_tiles = false;
        threadgroup_barrier(mem_flags::mem_threadgroup);
      }
      threadgroup float* kv = blkp;          // k of the token [128]
      threadgroup float* qv = blkp + 128;    // q of the token [128]
      for (long i = 0; i < m; ++i) {
        const long t = tok + i;
        {
          const long d = long(tid);
          const long src = (t * p.key_heads + hk) * dk + d;
          kv[d] = d < dk ? static_cast<float>(k[src]) : 0.0f;
          qv[d] = d < dk ? static_cast<float>(q[src]) : 0.0f;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (tid < 2) {
          threadgroup float* x = tid == 0 ? kv : qv;
          float s = 0.0f;
          for (long d = 0; d < dk; ++d) {
            s = s + x[d] * x[d];
          }
          const float f = l2 ? precise::rsqrt(s + 1e-6f) : 1.0f;
          if (tid == 0) {
            knorm[0] = f;
          } else {
            qnorm[0] = f;
          }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        const long col = c0 + long(tid);
        if (tid < GDN_DVB && col < dv) {
          const float decay = precise::exp(static_cast<float>(g[t * hv + h]));
          const float bt = static_cast<float>(beta[t * hv + h]);
          const float kn = knorm[0], qn = qnorm[0];
          float kvs = 0.0f;
          for (long d = 0; d < dk; ++d) {
            const float s = mat[d * GDN_DVB + tid] * decay;
            mat[d * GDN_DVB + tid] = s;
            kvs = kvs + s * (kv[d] * kn);
          }
          const float delta = (static_cast<float>(v[t * hv * dv + h * dv + col]) - kvs) * bt;
          float o = 0.0f;
          for (long d = 0; d < dk; ++d) {
            const float s = mat[d * GDN_DVB + tid] + (kv[d] * kn) * delta;
            mat[d * GDN_DVB + tid] = s;
            o = o + s * ((qv[d] * qn) * scale);
          }
          out[t * hv * dv + h * dv + col] = static_cast<T>(o);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);  // kv, qv and the norms are restaged next
      }
    }
    pos += m;
  }
  if (in_tiles) {
    for (long d = 0; d < dkt; ++d) {
      simdgroup_store(st[d], matp + d * 8 * GDN_DVB + sg * 8, GDN_DVB);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint e = tid; e < GDN_DKT * 8 * GDN_DVB; e += HEBRUS_GDN_CHUNK_TG) {
    const long d = long(e) / GDN_DVB, col = c0 + long(e) % GDN_DVB;
    if (d < dk && col < dv) {
      S[d * dv + col] = mat[e];
    }
  }
}

// cu_seqlens checked where gdn_chunk_delta_rule_slots launches no thread (B == 0).
[[kernel]] void gdn_chunk_delta_rule_slots_check(device const int* cu_seqlens [[buffer(0)]],
                                                 device const int* slots [[buffer(1)]],
                                                 device HebrusErrorMessages* err [[buffer(2)]],
                                                 constant HebrusSlotsCheckParams& p [[buffer(3)]],
                                                 uint tid [[thread_position_in_grid]]) {
  hebrus_check_cu_slots(cu_seqlens, slots, err, p, "gdn_chunk_delta_rule_slots", long(tid));
}

HEBRUS_INSTANTIATE(gdn_chunk_delta_rule_slots, float, float, float)
HEBRUS_INSTANTIATE(gdn_chunk_delta_rule_slots, half, half, half)
HEBRUS_INSTANTIATE_VARIANT(gdn_chunk_delta_rule_slots, gf32, half, half, float)
#if HEBRUS_HAS_BFLOAT
HEBRUS_INSTANTIATE(gdn_chunk_delta_rule_slots, bfloat, bfloat, bfloat)
HEBRUS_INSTANTIATE_VARIANT(gdn_chunk_delta_rule_slots, gf32, bfloat, bfloat, float)
#endif
