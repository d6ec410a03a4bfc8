// CPU kernel of hebrus::gdn_chunk_delta_rule_slots: the gated delta rule of packed rows in the chunked
// (WY) form, aligned to absolute positions; row b's state is state_pool[slots[b]], updated in place.
// hebrus_torch/gdn/chunked.py (chunk_delta_rule_reference) is the spec; the metadata checks are
// csrc/gdn_checks.h's (shared with the MPS glue), mirrored in hebrus_torch/_validate.py's
// gdn_chunk_delta_rule_slots with the same order and messages.
//
// Work item: one (row, value head), its pieces (row_pieces) in order. A piece that covers part of an
// aligned chunk of 64 positions runs gdn::run_recurrent, the code (and bits) of hebrus::gdn_delta_rule.
// A whole aligned chunk runs the WY form below with tile products of our own (no BLAS: its results
// may depend on alignment and threads), every output element summed in one fixed order (ascending
// reduction index, one fused multiply-add per term, from a fixed initial value), whatever the tile
// blocking, the vector width of the CPU or the thread count. An item reads only its row's tokens and
// state, so its bits do not depend on the other rows or on how a stream was cut at aligned positions.
//
// One chunk (fp32; Q, K normalised as in the recurrent form, Q scaled; G_i = g_0 + ... + g_i):
//   Lm[i, j] = beta_i (k_i . k_j) exp(G_i - G_j)   j < i          Tm = (I + Lm)^-1 (forward substitution)
//   Am[i, j] = (q_i . k_j) exp(G_i - G_j)          j <= i
//   R  = beta V - (beta exp(G) K) S                                V' = Tm R
//   O  = (exp(G) Q) S + Am V'                                      S <- exp(G_last) S + (exp(G_last - G) K)^T V'
// (V' = Tm beta V - Tm (beta exp(G) K) S is the reference's U - W S.)
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gdn_checks.h"
#include "gdn_recurrent.h"
#include "hebrus_check.h"
#include "hebrus_simd.h"
#include "op_checks.h"

namespace hebrus {
namespace {

using at::Tensor;

constexpr const char* kName = "gdn_chunk_delta_rule_slots";
constexpr int64_t kChunk = 64;  // hebrus_torch.gdn.chunked.CHUNK

// ---- tile products ------------------------------------------------------------------------------------
//
// out[i, c] = init(i, c) + sum_{j < J} A(i, j) * B[j, c], j ascending, each term one fused multiply-add;
// A(i, j) = a[i * ars + j * acs] (any layout), B and out row-major. init: 0, a copy of a matrix, or a
// matrix times a scalar (read before out is written, so init may be out itself).

enum class Init { kZero, kCopy, kScale };

// Rows of the product: all of them, lower-triangular A (J limited to the row block's end: the terms of
// A's upper part are zeros, padded to the block) or only the columns up to the row block's end (a
// product whose upper triangle is not needed; rounded up to whole vectors).
enum class Shape { kFull, kLowerA, kLowerOut };

struct Mat {
  const float* p;
  int64_t rs, cs;  // row and column strides
};

// 8-lane vectors: the AVX2 kernels' (one ymm register) and the portable code's.
typedef float Vec8 __attribute__((vector_size(8 * sizeof(float))));

template <typename V>
constexpr int lanes() {
  return static_cast<int>(sizeof(V) / sizeof(float));
}

template <typename V>
HEBRUS_INLINE V splat(float x) {
  V v;
  for (int i = 0; i < lanes<V>(); ++i) v[i] = x;
  return v;
}

template <typename V>
HEBRUS_INLINE void store_vector(float* p, const V& v) {
  std::memcpy(p, &v, sizeof(v));
}

template <typename V, int MR, int NV>
HEBRUS_INLINE void micro(const float* a, int64_t ars, int64_t acs, const float* b, int64_t ldb, int64_t J, float* out,
                         int64_t ldo, const float* init, int64_t ldi, Init mode, float scale) {
  constexpr int W = lanes<V>();
  V acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      if (mode == Init::kZero) {
        acc[r][v] = V{};
      } else {
        acc[r][v] = load_vector<V>(init + r * ldi + v * W);
        if (mode == Init::kScale) acc[r][v] = acc[r][v] * splat<V>(scale);
      }
    }
  }
  for (int64_t j = 0; j < J; ++j) {
    V bv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) bv[v] = load_vector<V>(b + j * ldb + v * W);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const V ar = splat<V>(a[r * ars + j * acs]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = FusedMulAdd::apply(ar, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) store_vector<V>(out + r * ldo + v * W, acc[r][v]);
  }
}

// One column c of rows [0, mr): the same terms in the same order as a vector lane.
HEBRUS_INLINE void micro_column(int mr, const float* a, int64_t ars, int64_t acs, const float* b, int64_t ldb,
                                int64_t J, float* out, int64_t ldo, const float* init, int64_t ldi, Init mode,
                                float scale) {
  for (int r = 0; r < mr; ++r) {
    float acc = 0.f;
    if (mode != Init::kZero) acc = init[r * ldi];
    if (mode == Init::kScale) acc = acc * scale;
    for (int64_t j = 0; j < J; ++j) acc = FusedMulAdd::apply(a[r * ars + j * acs], b[j * ldb], acc);
    out[r * ldo] = acc;
  }
}

// NV vectors per register tile: 4 x 4 zmm (AVX-512: 32 registers), 4 x 2 ymm (AVX2: 16).
template <typename V, int MR>
HEBRUS_INLINE void row_block(int mr, int64_t ncols, const float* a, int64_t ars, int64_t acs, const float* b,
                             int64_t ldb, int64_t J, float* out, int64_t ldo, const float* init, int64_t ldi, Init mode,
                             float scale) {
  constexpr int W = lanes<V>(), NV = W == 16 ? 4 : 2;
  int64_t c = 0;
  for (; c + NV * W <= ncols; c += NV * W)
    micro<V, MR, NV>(a, ars, acs, b + c, ldb, J, out + c, ldo, init ? init + c : nullptr, ldi, mode, scale);
  for (; c + W <= ncols; c += W)
    micro<V, MR, 1>(a, ars, acs, b + c, ldb, J, out + c, ldo, init ? init + c : nullptr, ldi, mode, scale);
  for (; c < ncols; ++c)
    micro_column(mr, a, ars, acs, b + c, ldb, J, out + c, ldo, init ? init + c : nullptr, ldi, mode, scale);
}

// out [M, N] = init + A [M, J] B [J, N] (see above). The row blocks (MR = 4) fix the padded terms of
// kLowerA; nothing else about the blocking or the vector width V changes a bit.
template <typename V>
HEBRUS_INLINE void gemm(int64_t M, int64_t N, int64_t J, Shape shape, Mat a, const float* b, int64_t ldb, float* out,
                        int64_t ldo, const float* init, int64_t ldi, Init mode, float scale = 1.f) {
  constexpr int MR = 4;
  for (int64_t i0 = 0; i0 < M; i0 += MR) {
    const int mr = static_cast<int>(std::min<int64_t>(MR, M - i0));
    const int64_t jn = shape == Shape::kLowerA ? std::min(J, i0 + MR) : J;
    const int64_t nc = shape == Shape::kLowerOut ? std::min(N, (i0 + MR + kLanes - 1) / kLanes * kLanes) : N;
    const float* ai = a.p + i0 * a.rs;
    float* oi = out + i0 * ldo;
    const float* ii = init ? init + i0 * ldi : nullptr;
    if (mr == MR) {
      row_block<V, MR>(mr, nc, ai, a.rs, a.cs, b, ldb, jn, oi, ldo, ii, ldi, mode, scale);
    } else {
      for (int r = 0; r < mr; ++r)
        row_block<V, 1>(1, nc, ai + r * a.rs, a.rs, a.cs, b, ldb, jn, oi + r * ldo, ldo, ii ? ii + r * ldi : nullptr, ldi,
                     mode, scale);
    }
  }
}

// ---- one whole chunk --------------------------------------------------------------------------------

// Scratch of one work item (fp32), sized for Dk, Dv.
struct Scratch {
  std::vector<float> buf;
  float *qn, *kn, *kt, *ab, *kd, *gram, *qk, *tm, *am, *bv, *rq, *vn, *g, *eg, *rec;
  Scratch(int64_t dk, int64_t dv) {
    const int64_t C = kChunk;
    buf.assign(static_cast<size_t>(C * dk * 6 + C * C * 4 + C * dv * 4 + 2 * C + 2 * dk + dv), 0.f);
    float* p = buf.data();
    auto take = [&](int64_t n) {
      float* q = p;
      p += n;
      return q;
    };
    qn = take(C * dk);      // normalised, scaled q
    kn = take(C * dk);      // normalised k
    kt = take(dk * C);      // kn transposed [Dk, C]
    ab = take(2 * C * dk);  // rows 0..C-1: -(beta exp(G) k); rows C..2C-1: exp(G) q
    kd = take(C * dk);      // exp(G_last - G) k
    gram = take(C * C);     // k . k
    qk = take(C * C);       // q . k
    tm = take(C * C);       // Lm, then (I + Lm)^-1
    am = take(C * C);
    bv = take(C * dv);      // beta v
    rq = take(2 * C * dv);  // R; (exp(G) Q) S
    vn = take(C * dv);      // V'
    g = take(C);            // G
    eg = take(C);           // exp(G)
    rec = take(2 * dk + dv);  // gdn::run_recurrent's scratch
  }
};

// The chunk of packed tokens [t0, t0 + 64) of value head h through its state s [Dk, Dv], with vectors V.
template <typename V>
HEBRUS_INLINE void whole_chunk(const gdn::Packed& r, float* s, int64_t h, int64_t t0, Scratch& w) {
  constexpr int W = lanes<V>();
  const int64_t C = kChunk, dk = r.dk, dv = r.dv, hv = r.hv;
  const int64_t kh = h / (hv / r.hk);
  float G = 0.f;
  for (int64_t i = 0; i < C; ++i) {
    const int64_t t = t0 + i;
    float* qi = w.qn + i * dk;
    float* ki = w.kn + i * dk;
    for (int64_t d = 0; d < dk; ++d) {
      qi[d] = r.q[(t * r.hk + kh) * dk + d];
      ki[d] = r.k[(t * r.hk + kh) * dk + d];
    }
    gdn::normalise(qi, dk, r.l2, r.scale);
    gdn::normalise(ki, dk, r.l2, 1.f);
    G = G + r.g[t * hv + h];
    w.g[i] = G;
    w.eg[i] = std::exp(G);
  }
  const float last = w.g[C - 1], decay = w.eg[C - 1];
  for (int64_t i = 0; i < C; ++i) {
    const int64_t t = t0 + i;
    const float beta = r.beta[t * hv + h];
    const float kb = beta * w.eg[i], ke = std::exp(last - w.g[i]);
    const float* ki = w.kn + i * dk;
    const float* qi = w.qn + i * dk;
    float* nkb = w.ab + i * dk;
    float* qe = w.ab + (C + i) * dk;
    float* kdi = w.kd + i * dk;
    for (int64_t d = 0; d < dk; ++d) {
      nkb[d] = -(kb * ki[d]);
      qe[d] = w.eg[i] * qi[d];
      kdi[d] = ke * ki[d];
      w.kt[d * C + i] = ki[d];
    }
    const float* vt = r.v + (t * hv + h) * dv;
    for (int64_t e = 0; e < dv; ++e) w.bv[i * dv + e] = beta * vt[e];
  }
  // Gram matrices (lower triangles), then Lm and Am with their decays.
  gemm<V>(C, C, dk, Shape::kLowerOut, {w.kn, dk, 1}, w.kt, C, w.gram, C, nullptr, 0, Init::kZero);
  gemm<V>(C, C, dk, Shape::kLowerOut, {w.qn, dk, 1}, w.kt, C, w.qk, C, nullptr, 0, Init::kZero);
  for (int64_t i = 0; i < C; ++i) {
    const float beta = r.beta[(t0 + i) * hv + h];
    for (int64_t j = 0; j < C; ++j) {
      float lm = 0.f, a = 0.f;
      if (j <= i) {
        const float e = std::exp(w.g[i] - w.g[j]);
        a = w.qk[i * C + j] * e;
        if (j < i) lm = beta * w.gram[i * C + j] * e;
      }
      w.am[i * C + j] = a;
      w.gram[i * C + j] = lm;  // gram now holds Lm
    }
  }
  // Tm = (I + Lm)^-1, row by row: Tm_i = e_i - sum_{j < i} Lm_ij Tm_j (j ascending; Tm_j is 0 past column j).
  for (int64_t i = 0; i < C; ++i) {
    float* ti = w.tm + i * C;
    const int64_t nv = i / W + 1;  // vectors holding columns 0..i (the others stay +0 in every row)
    V acc[kChunk / W];
    for (int64_t v = 0; v < kChunk / W; ++v) acc[v] = V{};
    acc[i / W][i % W] = 1.f;
    for (int64_t j = 0; j < i; ++j) {
      const V l = splat<V>(-w.gram[i * C + j]);
      const float* tj = w.tm + j * C;
      for (int64_t v = 0; v < nv; ++v) acc[v] = FusedMulAdd::apply(l, load_vector<V>(tj + v * W), acc[v]);
    }
    for (int64_t v = 0; v < kChunk / W; ++v) store_vector<V>(ti + v * W, acc[v]);
  }
  // R = beta V - (beta exp(G) K) S and (exp(G) Q) S: one product of [2C, Dk] by S.
  gemm<V>(C, dv, dk, Shape::kFull, {w.ab, dk, 1}, s, dv, w.rq, dv, w.bv, dv, Init::kCopy);
  gemm<V>(C, dv, dk, Shape::kFull, {w.ab + C * dk, dk, 1}, s, dv, w.rq + C * dv, dv, nullptr, 0, Init::kZero);
  // V' = Tm R; O = (exp(G) Q) S + Am V' (into out's rows of this head).
  gemm<V>(C, dv, C, Shape::kLowerA, {w.tm, C, 1}, w.rq, dv, w.vn, dv, nullptr, 0, Init::kZero);
  gemm<V>(C, dv, C, Shape::kLowerA, {w.am, C, 1}, w.vn, dv, r.out + (t0 * hv + h) * dv, hv * dv, w.rq + C * dv, dv,
       Init::kCopy);
  // S = exp(G_last) S + (exp(G_last - G) K)^T V'.
  gemm<V>(dk, dv, C, Shape::kFull, {w.kd, 1, dk}, w.vn, dv, s, dv, s, dv, Init::kScale, decay);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define HEBRUS_CHUNK_AVX512 __attribute__((target("avx512f,fma"), noinline))
HEBRUS_CHUNK_AVX512 void whole_chunk_avx512(const gdn::Packed& r, float* s, int64_t h, int64_t t0, Scratch& w) {
  whole_chunk<Vec>(r, s, h, t0, w);
}
HEBRUS_AVX2 __attribute__((noinline)) void whole_chunk_avx2(const gdn::Packed& r, float* s, int64_t h, int64_t t0,
                                                            Scratch& w) {
  whole_chunk<Vec8>(r, s, h, t0, w);
}
#endif
__attribute__((noinline)) void whole_chunk_portable(const gdn::Packed& r, float* s, int64_t h, int64_t t0,
                                                    Scratch& w) {
  whole_chunk<Vec8>(r, s, h, t0, w);
}

// The widest kernel the CPU (capped by HEBRUS_CPU_CAPABILITY) runs; all give the same bits.
void run_whole_chunk(CpuCapability isa, const gdn::Packed& r, float* s, int64_t h, int64_t t0, Scratch& w) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (isa >= CpuCapability::kAvx512) return whole_chunk_avx512(r, s, h, t0, w);
  if (isa == CpuCapability::kAvx2) return whole_chunk_avx2(r, s, h, t0, w);
#endif
  (void)isa;
  whole_chunk_portable(r, s, h, t0, w);
}

// Row b's pieces (hebrus_torch.gdn.chunked.row_pieces) of value head h through its state s.
void run_row_head(CpuCapability isa, const gdn::Packed& r, float* s, int64_t h, int64_t t0, int64_t t1, int64_t start, Scratch& w) {
  int64_t p = start;
  const int64_t end = start + (t1 - t0);
  while (p < end) {
    const int64_t chunk_end = (p / kChunk + 1) * kChunk;
    const int64_t n = std::min(chunk_end, end) - p;
    const int64_t t = t0 + (p - start);
    if (p % kChunk == 0 && n == kChunk) {
      run_whole_chunk(isa, r, s, h, t, w);
    } else {
      gdn::run_recurrent(r, s, h, t, t + n, w.rec);
    }
    p += n;
  }
}

// ---- the op -----------------------------------------------------------------------------------------

Tensor gdn_chunk_delta_rule_slots_cpu(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                      const Tensor& beta, const Tensor& cu_seqlens, const Tensor& start_pos,
                                      Tensor& state_pool, const Tensor& slots, double scale, bool use_qk_l2norm) {
  const char* op = kName;
  check_on_device(op, at::kCPU,
                  {{"q", &q}, {"k", &k}, {"v", &v}, {"g", &g}, {"beta", &beta}, {"cu_seqlens", &cu_seqlens},
                   {"start_pos", &start_pos}, {"state_pool", &state_pool}, {"slots", &slots}});
  const GdnSizes sz = check_gdn_chunk_delta_rule_slots_args(q, k, v, g, beta, cu_seqlens, start_pos, state_pool,
                                                                slots);
  const Tensor cu_t = check_cu_values(op, cu_seqlens, sz.total);
  const Tensor pos_t = start_pos.contiguous();
  const int64_t* pos = pos_t.data_ptr<int64_t>();
  for (int64_t b = 0; b < sz.batch; ++b)
    HEBRUS_CHECK(pos[b] >= 0, HebrusError, "hebrus::", op, ": start_pos[", b, "] = ", pos[b], " is negative");
  const Tensor slot_t = check_slot_values(op, slots, sz.pool);
  const int32_t* cu = cu_t.data_ptr<int32_t>();
  const int32_t* slot = slot_t.data_ptr<int32_t>();

  const gdn::PackedCall call(q, k, v, g, beta, sz.hk, sz.hv, sz.dk, sz.dv, scale, use_qk_l2norm);
  const gdn::Packed& r = call.r;
  float* pool = state_pool.data_ptr<float>();
  const int64_t hv = sz.hv, head = sz.dk * sz.dv;
  const CpuCapability isa = cpu_capability();
  at::parallel_for(0, sz.batch * hv, 1, [&](int64_t begin, int64_t end) {
    Scratch w(sz.dk, sz.dv);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / hv, h = item % hv;
      if (cu[b + 1] > cu[b])
        run_row_head(isa, r, pool + (static_cast<int64_t>(slot[b]) * hv + h) * head, h, cu[b], cu[b + 1], pos[b], w);
    }
  });
  return call.result(v.scalar_type());
}

}  // namespace
}  // namespace hebrus

TORCH_LIBRARY_IMPL(hebrus, CPU, m) {
  m.impl("gdn_chunk_delta_rule_slots", &hebrus::gdn_chunk_delta_rule_slots_cpu);
}
