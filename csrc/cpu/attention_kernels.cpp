// CPU kernel of hebrus::qsa_attention (issue 6): every query attends to exactly the cells its QSA
// selection lists. The executable spec is hebrus_torch/reference.py (qsa_attention); the checks and
// messages mirror hebrus_torch/_validate.py and the reference's value checks.
//
// Work item: one query (or one query and one KV head, when there are few queries). The Hq/Hkv
// query heads that share a KV head are processed together (in register chunks of up to
// kMaxHeadChunk) so that every gathered key and value row is read once per chunk, and the item's
// KV heads advance block by block together, so that the rows of a cell for all of them, usually
// adjacent in memory, are fetched together. Keys and
// values are read in place through token_cells, never copied (fp16/bf16 elements are widened to
// fp32 in registers as they are loaded). The softmax is online in fp32 over blocks of kKeyBlock
// selected cells taken in token_cells order, and every reduction has a fixed order, so an output
// depends only on its own query's inputs: never on the other queries in the batch, the thread
// count or the vector width of the CPU. Every multiply-add of a dot product or a value sum is fused
// (one rounding; an instruction in every clone but the pre-2013 baseline, which calls libm's fmaf
// for the same bits, slowly): on Zen 5, decode with the rows in cache is 14% (bf16) and 22% (fp32)
// faster than with a multiply and an add (from DRAM: within the noise). On AVX-512 CPUs the hot
// loops of full 8-head chunks are hand-written kernels (below dots / value_columns) with the same
// arithmetic in the same order. bf16 dot products take dims in pairs, in the order of the x86
// AVX512-BF16 dot-product instruction, which the kernels use where the CPU has it (see dots).
// HEBRUS_CPU_CAPABILITY caps which hand-written kernels run (cpu_capability), so that the tests can
// compare every path's bits on one machine.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "cpu/hebrus_simd.h"
#include "cpu/undispatched.h"
#include "cpu/hebrus_widen.h"
#include "hebrus_check.h"
#include "op_checks.h"

// Vec values only ever live inside always_inline functions of one clone; no ABI crosses them.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace hebrus {
namespace {

// Selected cells per online-softmax step. The running max / sum / accumulator are rescaled once
// per block; block boundaries depend only on the query's own row of token_cells.
constexpr int64_t kKeyBlock = 32;
// Query heads sharing one KV head that are processed in one pass over the keys (registers).
constexpr int64_t kMaxHeadChunk = 8;
// Dims per step of a bf16 dot product: one pair per lane (see dots).
constexpr int64_t kPairDims = 2 * kLanes;

template <typename T>
constexpr bool kIsBf16 = std::is_same_v<T, c10::BFloat16>;

// Dims of a dot product taken in pairs: bf16 only, whole steps of kPairDims.
template <typename T>
HEBRUS_INLINE int64_t pair_dims(int64_t dh) {
  return kIsBf16<T> ? dh / kPairDims * kPairDims : 0;
}


struct Params {
  const void* q;
  int64_t q_s0, q_s1;  // strides in elements; the last dim of q, k and v is contiguous
  const void* k;
  int64_t k_s0, k_s1;
  const void* v;
  int64_t v_s0, v_s1;
  const int32_t* cells;  // [Tq, width], contiguous
  int64_t width;
  void* out;  // [Tq, Hq, Dv], contiguous
  int64_t hq, hkv, rep, dh, dv;
  float scale;
  CpuCapability isa;
};

// Query heads sharing one KV head, processed in one pass over the keys (registers).
struct HeadChunk {
  int64_t g, h0, hb;  // KV head, first query head (of the rep sharing g), heads
};

struct Scratch {
  std::vector<const void*> rows_k;  // selected rows of the item (KV head 0), token_cells order
  std::vector<const void*> rows_v;
  std::vector<HeadChunk> chunks;
  // Per chunk, at its first query head: q [hb * dh] interleaved by vector, so one pointer walks all
  // heads of the dot-product loop: bf16 pair steps as [pair_dims / kPairDims][hb][odd dims, even dims]
  // (kLanes each), then [.. / kLanes][hb][kLanes], then the last dh % kLanes dims as [hb][dh % kLanes];
  // qb: bf16 queries' bits, [pair_dims / kPairDims][hb][kPairDims] (the instruction's operand);
  // acc [hb * dv]; the running max and sum.
  std::vector<float> q;    // [hq, dh]
  std::vector<uint16_t> qb;  // [hq, pair_dims], bf16 only
  std::vector<float> acc;  // [hq, dv]
  std::vector<float> m;    // [chunks, kMaxHeadChunk]
  std::vector<float> l;
  // Scores, then probabilities, of one block: s[j][h], the heads of a key side by side so that the
  // softmax steps run across heads in one vector (lanes >= the chunk's heads are unused).
  alignas(64) float s[kKeyBlock][kMaxHeadChunk] = {};
};

// kLanes floats as one GCC vector: element-wise IEEE arithmetic, the same bits in every clone
// (an avx512f clone keeps one in a zmm register, the others in two ymm or four xmm registers).

HEBRUS_INLINE void store(float* p, const Vec& v) { std::memcpy(p, &v, sizeof(v)); }

// widen and load_row (a row's kLanes elements widened to fp32): cpu/hebrus_widen.h.

// One lane per query head of a chunk: the online-softmax state and its steps, which are
// element-wise, so every head gets the same arithmetic as if computed alone.
typedef float HeadVec __attribute__((vector_size(kMaxHeadChunk * sizeof(float))));
typedef int32_t HeadMask __attribute__((vector_size(kMaxHeadChunk * sizeof(int32_t))));

HEBRUS_INLINE HeadVec load_heads(const float* p) { return load_vector<HeadVec>(p); }

HEBRUS_INLINE HeadVec splat(float x) { return HeadVec{} + x; }

// exp(x) for x <= 0 (softmax arguments s - max), within about 1 ulp; NaN stays NaN; exp(0) == 1
// exactly. Cephes' expf polynomial with round-to-nearest range reduction through the 1.5 * 2^23
// trick (no float-to-int conversion, so it vectorises and has no undefined behaviour on NaN).
// V is HeadVec or Vec; every lane gets the same operations.
template <typename V>
HEBRUS_INLINE V exp_nonpositive(V x) {
  typedef uint32_t Bits __attribute__((vector_size(sizeof(V))));
  const float kLog2e = 1.44269504088896341f;
  const float kLn2Hi = 0.693359375f;
  const float kLn2Lo = -2.12194440e-4f;
  const V kMagic = V{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const auto tiny = x < -87.f;
  const V xc = tiny ? V{} - 87.f : x;
  const V t = xc * kLog2e + kMagic;
  const V n = t - kMagic;
  Bits tb, mb;
  std::memcpy(&tb, &t, sizeof(tb));
  std::memcpy(&mb, &kMagic, sizeof(mb));
  const Bits pow2 = ((tb - mb) + 127u) << 23;  // 2^n: n as a two's complement integer
  V scale;
  std::memcpy(&scale, &pow2, sizeof(scale));
  const V r = (xc - n * kLn2Hi) - n * kLn2Lo;
  const V result = exp_reduced(r) * scale;
  return tiny ? V{} : result;
}

// (a > b || a is NaN) ? a : b, per lane: the running maximum, which keeps a NaN once seen.
HEBRUS_INLINE HeadVec max_keep_nan(HeadVec a, HeadVec b) {
  const HeadMask take = (a > b) | (a != a);
  return take ? a : b;
}

// The rows of a list of scattered cells, requested in memory order a few lines per step of the
// arithmetic: requested all at once they would fill the miss queue, and the loads the arithmetic
// waits for would queue behind them; requested cell by cell in bursts, or in another order than
// memory's, they arrive more slowly (measured on 2 Zen 5 cores: fp32 decode 20-25% slower either
// way; requesting only some lines and leaving the rest to the hardware prefetchers: 2x slower).
// The cells' rows are walked as one stream of spans (a cell's rows of all its KV heads, when they
// lie side by side as in a contiguous cache, else one span per row), `per` bytes per step: as many
// as the arithmetic loads per step in the usual case, so that the next block arrives as this one is
// used, at about one instruction per line.
struct Prefetcher {
  const void* const* rows;  // KV head 0 of each cell
  int64_t count;            // cells
  int64_t spans;            // spans per cell: 1, or its KV heads' rows when they are not adjacent
  int64_t head_stride;      // bytes between a cell's KV heads
  int64_t span;             // bytes of one span
  int64_t per;              // bytes requested per step, a multiple of 64
  int64_t j = 0;            // the current span: cell j, head g
  int64_t g = 0;
  const char* base = nullptr;
  int64_t off = 0;          // next byte of the current span

  // `heads` rows of `bytes` per cell, head_stride bytes apart, spread over `steps` steps (all at the
  // first step if steps == 0).
  HEBRUS_INLINE Prefetcher(const void* const* rows_, int64_t count_, int64_t bytes, int64_t heads,
                           int64_t head_stride_, int64_t steps)
      : rows(rows_), count(count_), head_stride(head_stride_) {
    const bool adjacent = heads == 1 || head_stride == bytes;
    spans = adjacent ? 1 : heads;
    span = adjacent ? heads * bytes : bytes;
    const int64_t total = count * heads * bytes;
    per = steps > 0 ? ((total + steps - 1) / steps + 63) / 64 * 64 : total + 64;
    if (count > 0 && span > 0) base = static_cast<const char*>(rows[0]);
  }

  HEBRUS_INLINE void step() {
    if (base == nullptr) return;
    for (int64_t b = 0; b < per; b += 64) {
      __builtin_prefetch(base + off, 0, 3);
      off += 64;
      if (off >= span) {
        off = 0;
        if (++g == spans) {
          g = 0;
          if (++j == count) {
            base = nullptr;
            return;
          }
        }
        base = static_cast<const char*>(rows[j]) + g * head_stride;
      }
    }
  }

  HEBRUS_INLINE void finish() {
    per = std::numeric_limits<int64_t>::max() / 2;
    step();
  }
};

// The first line of the rows (KV head 0) of count cells. The selected cells lie scattered over a
// cache much larger than the TLB reaches, so this runs a block before the Prefetcher requests the
// rows' lines: the page walks are then done before the lines are wanted (measured: 15-25% faster
// decode with the cache in 4 KiB pages, no change with huge pages).
HEBRUS_INLINE void touch_pages(const void* const* rows_k, const void* const* rows_v, int64_t count) {
  for (int64_t j = 0; j < count; ++j) {
    __builtin_prefetch(rows_k[j], 0, 3);
    __builtin_prefetch(rows_v[j], 0, 3);
  }
}

// kPairDims bf16 values widened to fp32: the odd dims (the low half of each 32-bit word cleared) and
// the even dims (shifted up), kLanes each, in ascending order.
HEBRUS_INLINE void load_bf16_pairs(const c10::BFloat16* p, Vec& odd, Vec& even) {
  typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  Words w;
  std::memcpy(&w, p, sizeof(w));
  const Words o = w & 0xffff0000u;
  const Words e = w << 16;
  std::memcpy(&odd, &o, sizeof(odd));
  std::memcpy(&even, &e, sizeof(even));
}

// s[j + n][h] = scale * (q_h . k_{j+n}) for HB heads and NK key rows. Lane i of a dot product sums
// the dims d = i mod kLanes in ascending d with fused multiply-adds; the lanes then combine
// pairwise (reduce_lanes). bf16 rows first take kPairDims dims per step, lane i the pair 2i, 2i + 1
// of the step, dim 2i + 1 first: the order of VDPBF16PS (AVX512-BF16), whose products of two bf16
// are exact in fp32, so each pair is two fused multiply-adds (measured on Zen 5: bit-identical to
// them on normal numbers; it flushes subnormal inputs and sums to zero, the portable code does not).
template <typename T, int HB, int NK>
HEBRUS_INLINE void dots(const float* q, int64_t dh, const T* const* krow, float scale,
                        float (*s)[kMaxHeadChunk], int64_t j, Prefetcher& pf) {
  const int64_t full = dh / kLanes * kLanes;
  Vec acc[NK * HB];
  for (int i = 0; i < NK * HB; ++i) acc[i] = Vec{};
  int64_t d = 0;
  if constexpr (kIsBf16<T>) {
    for (; d + kPairDims <= dh; d += kPairDims) {
      pf.step();
      pf.step();
      Vec odd[NK], even[NK];
      for (int n = 0; n < NK; ++n) load_bf16_pairs(krow[j + n] + d, odd[n], even[n]);
      for (int h = 0; h < HB; ++h) {
        const Vec qo = load_vec(q + d * HB + h * kPairDims);
        const Vec qe = load_vec(q + d * HB + h * kPairDims + kLanes);
        for (int n = 0; n < NK; ++n) {
          acc[n * HB + h] = FusedMulAdd::apply(qo, odd[n], acc[n * HB + h]);
          acc[n * HB + h] = FusedMulAdd::apply(qe, even[n], acc[n * HB + h]);
        }
      }
    }
  }
  for (; d < full; d += kLanes) {
    pf.step();
    Vec kv[NK];
    for (int n = 0; n < NK; ++n) kv[n] = load_row<T>(krow[j + n] + d);
    for (int h = 0; h < HB; ++h) {
      const Vec qv = load_vec(q + d * HB + h * kLanes);
      for (int n = 0; n < NK; ++n) acc[n * HB + h] = FusedMulAdd::apply(qv, kv[n], acc[n * HB + h]);
    }
  }
  const float* q_tail = q + full * HB;
  for (int64_t i = 0; full + i < dh; ++i)
    for (int h = 0; h < HB; ++h)
      for (int n = 0; n < NK; ++n)
        acc[n * HB + h][i] =
            FusedMulAdd::apply(q_tail[h * (dh - full) + i], widen<T>(krow[j + n][full + i]), acc[n * HB + h][i]);
  if constexpr (NK * HB == kLanes && HB == kMaxHeadChunk) {
    store(s[j], reduce_lanes16(acc) * scale);  // rows j and j + 1 of s, all heads
  } else {
    for (int n = 0; n < NK; ++n)
      for (int h = 0; h < HB; ++h) s[j + n][h] = reduce_lanes(acc[n * HB + h]) * scale;
  }
}

// acc[h][d] += p[j][h] * v_j[d] (fused) for j = 0..nb-1 in ascending order, for every column d.
// Columns are taken NC vectors at a time so that the accumulators stay in registers.
template <typename T, int HB, int NC>
HEBRUS_INLINE void value_columns(const T* const* vrow, int64_t nb, int64_t dv, int64_t d0,
                                 const float (*p)[kMaxHeadChunk], float* acc, Prefetcher& pf) {
  Vec a[NC][HB];
  for (int c = 0; c < NC; ++c)
    for (int h = 0; h < HB; ++h) a[c][h] = load_vec(acc + h * dv + d0 + c * kLanes);
  for (int64_t j = 0; j < nb; ++j) {
    pf.step();
    Vec vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = load_row<T>(vrow[j] + d0 + c * kLanes);
    for (int h = 0; h < HB; ++h) {
      const Vec w = Vec{} + p[j][h];
      for (int c = 0; c < NC; ++c) a[c][h] = FusedMulAdd::apply(w, vv[c], a[c][h]);
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int h = 0; h < HB; ++h) store(acc + h * dv + d0 + c * kLanes, a[c][h]);
}

#if defined(__x86_64__) && defined(__GNUC__)
// Full chunks of 8 heads on AVX-512 CPUs, with the same arithmetic in the same order as dots and
// value_columns. Written here because GCC 12, from the portable code, reloads every query vector
// for each key it multiplies (the loop is then load-bound), widens bf16 through two 256-bit halves
// and spills a value accumulator. The noinline functions below are the only ones compiled for
// AVX-512; the portable helpers they call are inlined into them.
#define HEBRUS_AVX512 __attribute__((target("avx512f,fma")))

HEBRUS_AVX512 HEBRUS_INLINE Vec load_row512(const float* p) { return _mm512_loadu_ps(p); }

HEBRUS_AVX512 HEBRUS_INLINE Vec load_row512(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

HEBRUS_AVX512 HEBRUS_INLINE Vec load_row512(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Makes GCC keep v in a register: without it, a vector loaded once and used twice is loaded twice.
HEBRUS_AVX512 HEBRUS_INLINE void in_register(Vec& v) { asm("" : "+v"(v)); }

template <typename T>
HEBRUS_AVX512 HEBRUS_INLINE void dots8x2_avx512(const float* q, int64_t dh, const T* const* krow, float scale,
                                                 float (*s)[kMaxHeadChunk], int64_t j, Prefetcher& pf) {
  constexpr int HB = kMaxHeadChunk;
  const int64_t full = dh / kLanes * kLanes;
  Vec acc[2 * HB];
  for (int i = 0; i < 2 * HB; ++i) acc[i] = Vec{};
  const T* k0 = krow[j];
  const T* k1 = krow[j + 1];
  int64_t d = 0;
  if constexpr (kIsBf16<T>) {
    for (; d + kPairDims <= dh; d += kPairDims) {
      pf.step();
      pf.step();
      Vec odd0, even0, odd1, even1;
      load_bf16_pairs(k0 + d, odd0, even0);
      load_bf16_pairs(k1 + d, odd1, even1);
      for (int h = 0; h < HB; ++h) {
        Vec qo = load_vec(q + d * HB + h * kPairDims);
        Vec qe = load_vec(q + d * HB + h * kPairDims + kLanes);
        in_register(qo);
        in_register(qe);
        acc[h] = _mm512_fmadd_ps(qe, even0, _mm512_fmadd_ps(qo, odd0, acc[h]));
        acc[HB + h] = _mm512_fmadd_ps(qe, even1, _mm512_fmadd_ps(qo, odd1, acc[HB + h]));
      }
    }
  }
  for (; d < full; d += kLanes) {
    pf.step();
    const Vec kv0 = load_row512(k0 + d);
    const Vec kv1 = load_row512(k1 + d);
    for (int h = 0; h < HB; ++h) {
      Vec qv = load_vec(q + d * HB + h * kLanes);
      in_register(qv);
      acc[h] = _mm512_fmadd_ps(qv, kv0, acc[h]);
      acc[HB + h] = _mm512_fmadd_ps(qv, kv1, acc[HB + h]);
    }
  }
  const float* q_tail = q + full * HB;
  for (int64_t i = 0; full + i < dh; ++i)
    for (int h = 0; h < HB; ++h)
      for (int n = 0; n < 2; ++n)
        acc[n * HB + h][i] =
            FusedMulAdd::apply(q_tail[h * (dh - full) + i], widen<T>(krow[j + n][full + i]), acc[n * HB + h][i]);
  store(s[j], reduce_lanes16(acc) * scale);
}

// bf16 dot products of 8 heads and NK keys with VDPBF16PS (AVX512-BF16) when dh is whole pair steps:
// the order of dots, one instruction per pair step instead of two fused multiply-adds and the
// widening of the keys (measured on Zen 5: 22% less time for bf16 decode with every row in cache).
#define HEBRUS_AVX512_BF16 __attribute__((target("avx512f,avx512bf16,fma")))

template <int NK>
HEBRUS_AVX512_BF16 HEBRUS_INLINE void dots8_dpbf16(const uint16_t* qb, int64_t dh, const c10::BFloat16* const* krow,
                                                  float scale, float (*s)[kMaxHeadChunk], int64_t j,
                                                  Prefetcher& pf) {
  constexpr int HB = kMaxHeadChunk;
  Vec acc[NK * HB];
  for (int i = 0; i < NK * HB; ++i) acc[i] = Vec{};
  for (int64_t d = 0; d < dh; d += kPairDims) {
    pf.step();
    pf.step();
    __m512bh kv[NK];
    for (int n = 0; n < NK; ++n) kv[n] = (__m512bh)_mm512_loadu_si512(krow[j + n] + d);
    for (int h = 0; h < HB; ++h) {
      __m512i qw = _mm512_loadu_si512(qb + d * HB + h * kPairDims);
      asm("" : "+v"(qw));  // loaded once for both keys (see in_register)
      for (int n = 0; n < NK; ++n) acc[n * HB + h] = _mm512_dpbf16_ps(acc[n * HB + h], (__m512bh)qw, kv[n]);
    }
  }
  if constexpr (NK == 2) {
    store(s[j], reduce_lanes16(acc) * scale);
  } else {
    for (int h = 0; h < HB; ++h) s[j][h] = reduce_lanes(acc[h]) * scale;
  }
}

HEBRUS_AVX512_BF16 __attribute__((noinline)) void block_scores8_dpbf16(const uint16_t* qb, int64_t dh,
                                                                      const c10::BFloat16* const* krow, int64_t nb,
                                                                      float scale, float (*s)[kMaxHeadChunk],
                                                                      Prefetcher& pf_in) {
  Prefetcher pf = pf_in;  // in registers, as in block_scores8_avx512
  int64_t j = 0;
  for (; j + 2 <= nb; j += 2) dots8_dpbf16<2>(qb, dh, krow, scale, s, j, pf);
  for (; j < nb; ++j) dots8_dpbf16<1>(qb, dh, krow, scale, s, j, pf);
  pf_in = pf;
}

template <typename T>
HEBRUS_AVX512 __attribute__((noinline)) void block_scores8_avx512(const float* q, int64_t dh, const T* const* krow,
                                                                  int64_t nb, float scale, float (*s)[kMaxHeadChunk],
                                                                  Prefetcher& pf_in) {
  Prefetcher pf = pf_in;  // a local cursor stays in registers; through the reference it is stored every step
  int64_t j = 0;
  for (; j + 2 <= nb; j += 2) dots8x2_avx512<T>(q, dh, krow, scale, s, j, pf);
  for (; j < nb; ++j) dots<T, kMaxHeadChunk, 1>(q, dh, krow, scale, s, j, pf);
  pf_in = pf;
}

template <typename T>
HEBRUS_AVX512 HEBRUS_INLINE void value_columns8x2_avx512(const T* const* vrow, int64_t nb, int64_t dv, int64_t d0,
                                                          const float (*p)[kMaxHeadChunk], float* acc,
                                                          Prefetcher& pf) {
  constexpr int HB = kMaxHeadChunk;
  Vec a[2][HB];
  for (int c = 0; c < 2; ++c)
    for (int h = 0; h < HB; ++h) a[c][h] = load_vec(acc + h * dv + d0 + c * kLanes);
  for (int64_t j = 0; j < nb; ++j) {
    pf.step();
    const Vec vv0 = load_row512(vrow[j] + d0);
    const Vec vv1 = load_row512(vrow[j] + d0 + kLanes);
    for (int h = 0; h < HB; ++h) {
      Vec w = _mm512_set1_ps(p[j][h]);
      in_register(w);
      a[0][h] = _mm512_fmadd_ps(w, vv0, a[0][h]);
      a[1][h] = _mm512_fmadd_ps(w, vv1, a[1][h]);
    }
  }
  for (int c = 0; c < 2; ++c)
    for (int h = 0; h < HB; ++h) store(acc + h * dv + d0 + c * kLanes, a[c][h]);
}

template <typename T>
HEBRUS_AVX512 __attribute__((noinline)) void block_values8_avx512(const T* const* vrow, int64_t nb, int64_t dv,
                                                                  const float (*p)[kMaxHeadChunk], float* acc,
                                                                  Prefetcher& pf_in) {
  Prefetcher pf = pf_in;  // in registers, as in block_scores8_avx512
  constexpr int HB = kMaxHeadChunk;
  int64_t d0 = 0;
  for (; d0 + 2 * kLanes <= dv; d0 += 2 * kLanes) value_columns8x2_avx512<T>(vrow, nb, dv, d0, p, acc, pf);
  for (; d0 + kLanes <= dv; d0 += kLanes) value_columns<T, HB, 1>(vrow, nb, dv, d0, p, acc, pf);
  for (int64_t j = 0; j < nb; ++j)
    for (int h = 0; h < HB; ++h)
      for (int64_t d = d0; d < dv; ++d)
        acc[h * dv + d] = FusedMulAdd::apply(p[j][h], widen<T>(vrow[j][d]), acc[h * dv + d]);
  pf_in = pf;
}

#endif

#if defined(__x86_64__) && defined(__GNUC__)
// AVX2 CPUs (x86-64-v3 without AVX-512), with the same arithmetic in the same order as dots and
// value_columns. GCC 12 spells the portable code's 16-lane fused multiply-adds lane by lane and,
// where a vector is two ymm registers, builds them through the stack (measured on a 2-core AMD VM
// with AVX2: 170-600 ns per selected cell and KV head, 3-7x slower than these kernels). Here a
// 16-lane vector is a pair of ymm registers (lanes 0-7, 8-15), and the heads of a chunk are taken
// HG at a time so that the accumulators of HG heads x NK keys stay in the 16 registers.

HEBRUS_AVX2 HEBRUS_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

HEBRUS_AVX2 HEBRUS_INLINE __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

HEBRUS_AVX2 HEBRUS_INLINE __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// dots<T, HB, NK> for heads h0 .. h0 + HG - 1 of a chunk of HB heads; dh a multiple of kLanes.
template <typename T, int HB, int HG, int NK>
HEBRUS_AVX2 HEBRUS_INLINE void dots_avx2(const float* q, int64_t dh, int h0, const T* const* krow, float scale,
                                         float (*s)[kMaxHeadChunk], int64_t j, Prefetcher& pf, bool prefetch) {
  __m256 lo[NK * HG], hi[NK * HG];
  for (int i = 0; i < NK * HG; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  int64_t d = 0;
  if constexpr (kIsBf16<T>) {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    for (; d + kPairDims <= dh; d += kPairDims) {
      if (prefetch) {
        pf.step();
        pf.step();
      }
      __m256 odd_lo[NK], even_lo[NK], odd_hi[NK], even_hi[NK];
      for (int n = 0; n < NK; ++n) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(krow[j + n] + d));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(krow[j + n] + d + kLanes));
        odd_lo[n] = _mm256_castsi256_ps(_mm256_and_si256(w0, high));
        even_lo[n] = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
        odd_hi[n] = _mm256_castsi256_ps(_mm256_and_si256(w1, high));
        even_hi[n] = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
      }
      for (int h = 0; h < HG; ++h) {
        const float* qh = q + d * HB + (h0 + h) * kPairDims;
        const __m256 qo_lo = _mm256_loadu_ps(qh), qo_hi = _mm256_loadu_ps(qh + 8);
        const __m256 qe_lo = _mm256_loadu_ps(qh + kLanes), qe_hi = _mm256_loadu_ps(qh + kLanes + 8);
        for (int n = 0; n < NK; ++n) {
          lo[n * HG + h] = _mm256_fmadd_ps(qe_lo, even_lo[n], _mm256_fmadd_ps(qo_lo, odd_lo[n], lo[n * HG + h]));
          hi[n * HG + h] = _mm256_fmadd_ps(qe_hi, even_hi[n], _mm256_fmadd_ps(qo_hi, odd_hi[n], hi[n * HG + h]));
        }
      }
    }
  }
  for (; d < dh; d += kLanes) {
    if (prefetch) pf.step();
    __m256 k_lo[NK], k_hi[NK];
    for (int n = 0; n < NK; ++n) {
      k_lo[n] = load8(krow[j + n] + d);
      k_hi[n] = load8(krow[j + n] + d + 8);
    }
    for (int h = 0; h < HG; ++h) {
      const float* qh = q + d * HB + (h0 + h) * kLanes;
      const __m256 q_lo = _mm256_loadu_ps(qh), q_hi = _mm256_loadu_ps(qh + 8);
      for (int n = 0; n < NK; ++n) {
        lo[n * HG + h] = _mm256_fmadd_ps(q_lo, k_lo[n], lo[n * HG + h]);
        hi[n * HG + h] = _mm256_fmadd_ps(q_hi, k_hi[n], hi[n * HG + h]);
      }
    }
  }
  for (int n = 0; n < NK; ++n)
    for (int h = 0; h < HG; ++h) s[j + n][h0 + h] = reduce_lanes_avx2(lo[n * HG + h], hi[n * HG + h]) * scale;
}

template <typename T, int HB>
HEBRUS_AVX2 __attribute__((noinline)) void block_scores_avx2(const float* q, int64_t dh, const T* const* krow,
                                                             int64_t nb, float scale, float (*s)[kMaxHeadChunk],
                                                             Prefetcher& pf_in) {
  Prefetcher pf = pf_in;  // in registers, as in block_scores8_avx512
  constexpr int HG = HB >= 2 ? 2 : 1;
  constexpr int NK = kIsBf16<T> ? 1 : 2;
  int64_t j = 0;
  for (; j + NK <= nb; j += NK)
    for (int h0 = 0; h0 < HB; h0 += HG) dots_avx2<T, HB, HG, NK>(q, dh, h0, krow, scale, s, j, pf, h0 == 0);
  for (; j < nb; ++j)
    for (int h0 = 0; h0 < HB; h0 += HG) dots_avx2<T, HB, HG, 1>(q, dh, h0, krow, scale, s, j, pf, h0 == 0);
  pf_in = pf;
}

// acc[h][d0 + 8c + i] += p[j][h] * v_j[..] (fused), j ascending, for NC ymm columns of HB heads.
template <typename T, int HB, int NC>
HEBRUS_AVX2 HEBRUS_INLINE void value_columns_avx2(const T* const* vrow, int64_t nb, int64_t dv, int64_t d0,
                                                  const float (*p)[kMaxHeadChunk], float* acc, Prefetcher& pf) {
  __m256 a[NC][HB];
  for (int c = 0; c < NC; ++c)
    for (int h = 0; h < HB; ++h) a[c][h] = _mm256_loadu_ps(acc + h * dv + d0 + 8 * c);
  for (int64_t j = 0; j < nb; ++j) {
    pf.step();
    __m256 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = load8(vrow[j] + d0 + 8 * c);
    for (int h = 0; h < HB; ++h) {
      const __m256 w = _mm256_set1_ps(p[j][h]);
      for (int c = 0; c < NC; ++c) a[c][h] = _mm256_fmadd_ps(w, vv[c], a[c][h]);
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int h = 0; h < HB; ++h) _mm256_storeu_ps(acc + h * dv + d0 + 8 * c, a[c][h]);
}

template <typename T, int HB>
HEBRUS_AVX2 __attribute__((noinline)) void block_values_avx2(const T* const* vrow, int64_t nb, int64_t dv,
                                                             const float (*p)[kMaxHeadChunk], float* acc,
                                                             Prefetcher& pf_in) {
  Prefetcher pf = pf_in;
  constexpr int NC = 8 / HB;  // HB * NC accumulators of 8 lanes
  int64_t d0 = 0;
  for (; d0 + 8 * NC <= dv; d0 += 8 * NC) value_columns_avx2<T, HB, NC>(vrow, nb, dv, d0, p, acc, pf);
  for (; d0 + 8 <= dv; d0 += 8) value_columns_avx2<T, HB, 1>(vrow, nb, dv, d0, p, acc, pf);
  for (int64_t j = 0; j < nb; ++j)
    for (int h = 0; h < HB; ++h)
      for (int64_t d = d0; d < dv; ++d)
        acc[h * dv + d] = FusedMulAdd::apply(p[j][h], widen<T>(vrow[j][d]), acc[h * dv + d]);
  pf_in = pf;
}
#endif

template <typename T, int HB>
HEBRUS_INLINE void block_scores(const float* q, const uint16_t* qb, int64_t dh, const T* const* krow, int64_t nb,
                                float scale, float (*s)[kMaxHeadChunk], Prefetcher& pf, CpuCapability isa) {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (HB == kMaxHeadChunk) {
    if constexpr (kIsBf16<T>) {
      if (isa >= CpuCapability::kAvx512Bf16 && dh % kPairDims == 0)
        return block_scores8_dpbf16(qb, dh, krow, nb, scale, s, pf);
    }
    if (isa >= CpuCapability::kAvx512) return block_scores8_avx512<T>(q, dh, krow, nb, scale, s, pf);
  }
  if (isa == CpuCapability::kAvx2 && dh % kLanes == 0) return block_scores_avx2<T, HB>(q, dh, krow, nb, scale, s, pf);
#else
  (void)qb;
  (void)isa;
#endif
  int64_t j = 0;
  for (; j + 2 <= nb; j += 2) dots<T, HB, 2>(q, dh, krow, scale, s, j, pf);
  for (; j < nb; ++j) dots<T, HB, 1>(q, dh, krow, scale, s, j, pf);
}

template <typename T, int HB>
HEBRUS_INLINE void block_values(const T* const* vrow, int64_t nb, int64_t dv, const float (*p)[kMaxHeadChunk],
                                float* acc, Prefetcher& pf, CpuCapability isa) {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (HB == kMaxHeadChunk) {
    if (isa >= CpuCapability::kAvx512) return block_values8_avx512<T>(vrow, nb, dv, p, acc, pf);
  }
  if (isa == CpuCapability::kAvx2) return block_values_avx2<T, HB>(vrow, nb, dv, p, acc, pf);
#else
  (void)isa;
#endif
  int64_t d0 = 0;
  for (; d0 + 2 * kLanes <= dv; d0 += 2 * kLanes) value_columns<T, HB, 2>(vrow, nb, dv, d0, p, acc, pf);
  for (; d0 + kLanes <= dv; d0 += kLanes) value_columns<T, HB, 1>(vrow, nb, dv, d0, p, acc, pf);
  for (int64_t j = 0; j < nb; ++j)
    for (int h = 0; h < HB; ++h)
      for (int64_t d = d0; d < dv; ++d)
        acc[h * dv + d] = FusedMulAdd::apply(p[j][h], widen<T>(vrow[j][d]), acc[h * dv + d]);
}

// The online-softmax step of one block: s (scores of nb cells) becomes p = exp(s - m_new), m and l
// (the running max and sum of the chunk's heads) are updated, and the factor the accumulators must
// be scaled by is written to alpha_out. While every score so far is -inf (finite inputs whose dot
// product overflows), m_new is -inf and 0 is subtracted instead (exp(-inf - -inf) would be NaN):
// those cells get weight exactly 0, as in the reference, and a later finite block starts from
// l = 0, acc = 0 (alpha = exp(-inf - m_new) = 0). A NaN score still makes m_new, hence the output,
// NaN; a +inf score gives exp(+inf - +inf) = NaN, as the reference's softmax does. With finite
// scores nothing changes (m_new is subtracted as before). A function of its own: inlined into the
// item loop, its running max and sum were kept in memory (a chain of store-reloads; this is 2-4%
// faster in cache).
template <bool kCellPairs>
HEBRUS_INLINE void block_softmax_impl(float (*s)[kMaxHeadChunk], int64_t nb, bool first, float* m_out, float* l_out,
                                      float* alpha_out) {
  // Two running maxima (even and odd cells) halve the dependency chain; a max is exact, so this
  // order gives the same m up to the sign of a zero, which no result depends on (exp(+-0) == 1).
  HeadVec bm0 = load_heads(s[0]);
  HeadVec bm1 = bm0;
  int64_t j = 1;
  for (; j + 2 <= nb; j += 2) {
    bm0 = max_keep_nan(load_heads(s[j]), bm0);
    bm1 = max_keep_nan(load_heads(s[j + 1]), bm1);
  }
  if (j < nb) bm0 = max_keep_nan(load_heads(s[j]), bm0);
  const HeadVec bm = max_keep_nan(bm1, bm0);
  const HeadVec m = load_heads(m_out);
  const HeadVec m_new = first ? bm : max_keep_nan(bm, m);
  // What the scores are shifted by: m_new, or 0 where m_new is -inf (see above).
  const HeadVec m_sub = m_new == splat(-std::numeric_limits<float>::infinity()) ? splat(0.f) : m_new;
  HeadVec sum{};
  j = 0;
  if constexpr (kCellPairs) {
    // Two cells per vector of kLanes (the rows of s are adjacent); the sum still adds the cells in
    // order, so that it is the same as one cell at a time.
    static_assert(kLanes == 2 * kMaxHeadChunk, "two cells' heads per vector");
    Vec m_sub2;
    std::memcpy(&m_sub2, &m_sub, sizeof(m_sub));
    std::memcpy(reinterpret_cast<char*>(&m_sub2) + sizeof(m_sub), &m_sub, sizeof(m_sub));
    for (; j + 2 <= nb; j += 2) {
      const Vec p2 = exp_nonpositive(load_vec(s[j]) - m_sub2);
      std::memcpy(s[j], &p2, sizeof(p2));  // s now holds p
      HeadVec p0, p1;
      std::memcpy(&p0, &p2, sizeof(p0));
      std::memcpy(&p1, reinterpret_cast<const char*>(&p2) + sizeof(p0), sizeof(p1));
      sum += p0;
      sum += p1;
    }
  }
  for (; j < nb; ++j) {
    const HeadVec pj = exp_nonpositive(load_heads(s[j]) - m_sub);
    std::memcpy(s[j], &pj, sizeof(pj));
    sum += pj;
  }
  const HeadVec alpha = first ? splat(1.f) : exp_nonpositive(m - m_sub);
  const HeadVec l = first ? sum : load_heads(l_out) * alpha + sum;
  std::memcpy(m_out, &m_new, sizeof(m_new));
  std::memcpy(l_out, &l, sizeof(l));
  std::memcpy(alpha_out, &alpha, sizeof(alpha));
}

HEBRUS_VECTOR_CLONES void block_softmax(float (*s)[kMaxHeadChunk], int64_t nb, bool first, float* m_out,
                                        float* l_out, float* alpha_out) {
  block_softmax_impl<true>(s, nb, first, m_out, l_out, alpha_out);
}

#if defined(__x86_64__) && defined(__GNUC__)
// One cell per vector: GCC builds the two-cell vectors of block_softmax through the stack on AVX2
// (a third of the AVX2 kernel's time); every lane gets the same operations either way.
HEBRUS_AVX2 __attribute__((noinline)) void block_softmax_avx2(float (*s)[kMaxHeadChunk], int64_t nb, bool first,
                                                              float* m_out, float* l_out, float* alpha_out) {
  block_softmax_impl<false>(s, nb, first, m_out, l_out, alpha_out);
}
#endif

// One block of nb selected cells for the HB query heads of a chunk: scores, the online-softmax
// update of m, l and acc, then the probability-weighted values.
template <typename T, int HB>
HEBRUS_INLINE void attend_block(const Params& p, Scratch& sc, const T* const* krow, const T* const* vrow, int64_t nb,
                                bool first, const float* q, const uint16_t* qb, float* acc, float* m_out, float* l_out,
                                Prefetcher& pf_k, Prefetcher& pf_v) {
  const int64_t dv = p.dv;
  block_scores<T, HB>(q, qb, p.dh, krow, nb, p.scale, sc.s, pf_k, p.isa);
  float alpha[kMaxHeadChunk];
#if defined(__x86_64__) && defined(__GNUC__)
  if (p.isa == CpuCapability::kAvx2)
    block_softmax_avx2(sc.s, nb, first, m_out, l_out, alpha);
  else
#endif
    block_softmax(sc.s, nb, first, m_out, l_out, alpha);
  if (!first) {
    for (int h = 0; h < HB; ++h) {
      if (alpha[h] != 1.f) {
        float* a = acc + h * dv;
        for (int64_t d = 0; d < dv; ++d) a[d] *= alpha[h];
      }
    }
  }
  block_values<T, HB>(vrow, nb, dv, sc.s, acc, pf_v, p.isa);
}

// Query t, KV heads [g_begin, g_end) and the query heads sharing them. The KV heads' rows of a
// cell usually lie side by side, so the heads advance block by block together and each block's
// cells are fetched for all of them at once.
template <typename T>
HEBRUS_INLINE void attend_item(const Params& p, Scratch& sc, int64_t t, int64_t g_begin, int64_t g_end) {
  const int64_t dh = p.dh;
  const int64_t dv = p.dv;
  const int32_t* row = p.cells + t * p.width;
  const T* k = static_cast<const T*>(p.k) + g_begin * p.k_s1;
  const T* v = static_cast<const T*>(p.v) + g_begin * p.v_s1;
  int64_t n = 0;
  for (int64_t i = 0; i < p.width; ++i) {
    const int32_t c = row[i];
    if (c < 0) continue;  // padding, wherever it is in the row
    sc.rows_k[n] = k + static_cast<int64_t>(c) * p.k_s0;
    sc.rows_v[n] = v + static_cast<int64_t>(c) * p.v_s0;
    ++n;
  }
  // Heads in chunks of 8, 4, 2, 1: a head's result does not depend on the chunk it falls in.
  sc.chunks.clear();
  for (int64_t g = g_begin; g < g_end; ++g) {
    int64_t h0 = 0;
    for (int64_t hb = kMaxHeadChunk; hb >= 1; hb /= 2)
      for (; h0 + hb <= p.rep; h0 += hb) sc.chunks.push_back({g, h0, hb});
  }
  const int64_t full = dh / kLanes * kLanes;
  const int64_t pairs = pair_dims<T>(dh);
  const T* q_in = static_cast<const T*>(p.q) + t * p.q_s0;
  for (const HeadChunk& c : sc.chunks) {
    const int64_t head = c.g * p.rep + c.h0;
    float* q = sc.q.data() + head * dh;
    for (int64_t h = 0; h < c.hb; ++h) {
      const T* qh = q_in + (head + h) * p.q_s1;
      for (int64_t d = 0; d < pairs; ++d) {
        const int64_t i = d % kPairDims;
        q[(d - i) * c.hb + h * kPairDims + (i % 2 == 1 ? 0 : kLanes) + i / 2] = widen<T>(qh[d]);
      }
      for (int64_t d = pairs; d < full; ++d) q[(d - d % kLanes) * c.hb + h * kLanes + d % kLanes] = widen<T>(qh[d]);
      for (int64_t d = full; d < dh; ++d) q[full * c.hb + h * (dh - full) + d - full] = widen<T>(qh[d]);
      if constexpr (kIsBf16<T>) {
        uint16_t* qb = sc.qb.data() + head * pairs;
        for (int64_t d = 0; d < pairs; ++d) qb[(d - d % kPairDims) * c.hb + h * kPairDims + d % kPairDims] = qh[d].x;
      }
    }
  }
  std::fill(sc.acc.begin(), sc.acc.end(), 0.f);
  const int64_t k_bytes = dh * static_cast<int64_t>(sizeof(T));
  const int64_t v_bytes = dv * static_cast<int64_t>(sizeof(T));
  const int64_t k_head = p.k_s1 * static_cast<int64_t>(sizeof(T));
  const int64_t v_head = p.v_s1 * static_cast<int64_t>(sizeof(T));
  const int64_t chunks = static_cast<int64_t>(sc.chunks.size());
  // Rows are scattered over the cache: the first block's rows are requested at once; then the next
  // block's keys while this block's are scored, and the next block's values while this block's are
  // summed, spread over the steps of that work (measured: 25% faster than requesting a block's rows
  // at once, and no faster when requested two blocks ahead or with other locality hints); their
  // pages are touched one block earlier still (touch_pages).
  const int64_t score_steps = chunks * (kKeyBlock / 2) * (dh / kLanes);
  const int64_t value_steps = chunks * kKeyBlock * (dv / (2 * kLanes) + dv % (2 * kLanes) / kLanes);
  const int64_t heads = g_end - g_begin;
  Prefetcher(sc.rows_k.data(), std::min(kKeyBlock, n), k_bytes, heads, k_head, 0).finish();
  Prefetcher(sc.rows_v.data(), std::min(kKeyBlock, n), v_bytes, heads, v_head, 0).finish();
  const int64_t second = std::min(kKeyBlock, n);
  touch_pages(sc.rows_k.data() + second, sc.rows_v.data() + second, std::min(kKeyBlock, n - second));
  const T* krow[kKeyBlock];
  const T* vrow[kKeyBlock];
  for (int64_t j0 = 0; j0 < n; j0 += kKeyBlock) {
    const int64_t nb = std::min(kKeyBlock, n - j0);
    const int64_t next = std::min(kKeyBlock, n - j0 - nb);
    Prefetcher pf_k(sc.rows_k.data() + j0 + nb, next, k_bytes, heads, k_head, score_steps);
    Prefetcher pf_v(sc.rows_v.data() + j0 + nb, next, v_bytes, heads, v_head, value_steps);
    const int64_t far = std::min(j0 + 2 * kKeyBlock, n);
    touch_pages(sc.rows_k.data() + far, sc.rows_v.data() + far, std::min(kKeyBlock, n - far));
    int64_t g = -1;
    for (int64_t ci = 0; ci < chunks; ++ci) {
      const HeadChunk& c = sc.chunks[ci];
      if (c.g != g) {
        g = c.g;
        for (int64_t j = 0; j < nb; ++j) {
          krow[j] = static_cast<const T*>(sc.rows_k[j0 + j]) + (g - g_begin) * p.k_s1;
          vrow[j] = static_cast<const T*>(sc.rows_v[j0 + j]) + (g - g_begin) * p.v_s1;
        }
      }
      const int64_t head = c.g * p.rep + c.h0;
      const float* q = sc.q.data() + head * dh;
      const uint16_t* qb = sc.qb.data() + head * pairs;
      float* acc = sc.acc.data() + head * dv;
      float* m = sc.m.data() + ci * kMaxHeadChunk;
      float* l = sc.l.data() + ci * kMaxHeadChunk;
      switch (c.hb) {
        case 8: attend_block<T, 8>(p, sc, krow, vrow, nb, j0 == 0, q, qb, acc, m, l, pf_k, pf_v); break;
        case 4: attend_block<T, 4>(p, sc, krow, vrow, nb, j0 == 0, q, qb, acc, m, l, pf_k, pf_v); break;
        case 2: attend_block<T, 2>(p, sc, krow, vrow, nb, j0 == 0, q, qb, acc, m, l, pf_k, pf_v); break;
        default: attend_block<T, 1>(p, sc, krow, vrow, nb, j0 == 0, q, qb, acc, m, l, pf_k, pf_v); break;
      }
    }
    pf_k.finish();
    pf_v.finish();
  }
  T* out = static_cast<T*>(p.out) + t * p.hq * dv;
  for (int64_t ci = 0; ci < chunks; ++ci) {
    const HeadChunk& c = sc.chunks[ci];
    const int64_t head = c.g * p.rep + c.h0;
    for (int64_t h = 0; h < c.hb; ++h) {
      const float lh = sc.l[ci * kMaxHeadChunk + h];
      const float* acc = sc.acc.data() + (head + h) * dv;
      for (int64_t d = 0; d < dv; ++d) out[(head + h) * dv + d] = static_cast<T>(acc[d] / lh);
    }
  }
}

// One worker: takes items from the shared counter until none is left.
HEBRUS_VECTOR_CLONES
void attend_worker(const Params& p, at::ScalarType dtype, std::atomic<int64_t>* next, int64_t items, int64_t chunk,
                   int64_t splits) {
  Scratch sc;
  sc.rows_k.resize(p.width);
  sc.rows_v.resize(p.width);
  sc.q.resize(p.hq * std::max<int64_t>(p.dh, 1));
  if (dtype == at::kBFloat16) sc.qb.resize(p.hq * std::max<int64_t>(pair_dims<c10::BFloat16>(p.dh), 1));
  sc.acc.resize(p.hq * std::max<int64_t>(p.dv, 1));
  sc.m.resize(p.hq * kMaxHeadChunk);  // at most one chunk per query head
  sc.l.resize(p.hq * kMaxHeadChunk);
  sc.chunks.reserve(p.hq);
  for (;;) {
    const int64_t begin = next->fetch_add(chunk);
    if (begin >= items) break;
    const int64_t end = std::min(items, begin + chunk);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / splits;
      const int64_t g_begin = item % splits * p.hkv / splits;
      const int64_t g_end = (item % splits + 1) * p.hkv / splits;
      switch (dtype) {
        case at::kFloat: attend_item<float>(p, sc, t, g_begin, g_end); break;
        case at::kHalf: attend_item<c10::Half>(p, sc, t, g_begin, g_end); break;
        case at::kBFloat16: attend_item<c10::BFloat16>(p, sc, t, g_begin, g_end); break;
        default: break;
      }
    }
  }
}

at::Tensor qsa_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                             const at::Tensor& token_cells_in, double scale) {
  // Metadata checks in the order of _validate.qsa_attention, with the same messages.
  check_on_device("qsa_attention", at::kCPU,
                  {{"q", &q_in}, {"k", &k_in}, {"v", &v_in}, {"token_cells", &token_cells_in}});
  const QsaAttentionSizes sz = check_qsa_attention_args(q_in, k_in, v_in, token_cells_in, scale);
  const at::ScalarType dtype = q_in.scalar_type();
  const int64_t tq = sz.tq, hq = sz.hq, dh = sz.dh, cells = sz.cells, hkv = sz.hkv, dv = sz.dv, width = sz.width;

  at::Tensor out = empty_on_cpu({tq, hq, dv}, q_in.options().memory_format(at::MemoryFormat::Contiguous));
  if (tq == 0) return out;

  // Value checks, all before anything is computed, in the reference's order: the first
  // out-of-range entry in row-major order, then the first query with no selected cell.
  const at::Tensor token_cells = token_cells_in.contiguous();
  const int32_t* tc = token_cells.data_ptr<int32_t>();
  const int64_t entries = tq * width;
  const int64_t bad = at::parallel_reduce(
      0, entries, 1 << 14, entries,
      [&](int64_t begin, int64_t end, int64_t found) {
        for (int64_t i = begin; i < end && i < found; ++i)
          if (tc[i] >= cells) return i;
        return found;
      },
      [](int64_t a, int64_t b) { return std::min(a, b); });
  if (bad < entries) {
    const int64_t t = bad / width;
    const int64_t i = bad % width;
    HEBRUS_CHECK(false, HebrusError, "hebrus::qsa_attention: query ", t, " selects cell ", tc[bad],
                 " (token_cells[", t, ", ", i, "]), outside [0, cells=", cells, "); negative entries are padding");
  }
  for (int64_t t = 0; t < tq; ++t) {
    const int32_t* row = tc + t * width;
    HEBRUS_CHECK(std::any_of(row, row + width, [](int32_t c) { return c >= 0; }), HebrusError,
                 "hebrus::qsa_attention: query ", t, " selects no cell (every entry of token_cells[", t,
                 "] is negative padding); attention over an empty selection is undefined");
  }
  if (hq == 0 || dv == 0) return out;

  const at::Tensor q = last_dim_contiguous(q_in);
  const at::Tensor k = last_dim_contiguous(k_in);
  const at::Tensor v = last_dim_contiguous(v_in);
  Params p;
  p.q = q.data_ptr();
  p.q_s0 = q.stride(0);
  p.q_s1 = q.stride(1);
  p.k = k.data_ptr();
  p.k_s0 = k.stride(0);
  p.k_s1 = k.stride(1);
  p.v = v.data_ptr();
  p.v_s0 = v.stride(0);
  p.v_s1 = v.stride(1);
  p.cells = tc;
  p.width = width;
  p.out = out.data_ptr();
  p.hq = hq;
  p.hkv = hkv;
  p.rep = hq / hkv;
  p.dh = dh;
  p.dv = dv;
  p.scale = static_cast<float>(scale);
  p.isa = cpu_capability();

  // Items are queries (or, with few queries per thread, (query, KV head) pairs) taken dynamically
  // in small chunks, which balances rows with different selection sizes and cores shared with
  // other work; each head is computed by one thread from its own inputs only, so neither the
  // split nor the schedule ever changes a bit of the output.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t splits = tq >= 4 * threads ? 1 : hkv;
  const int64_t items = tq * splits;
  const int64_t chunk = std::clamp<int64_t>(items / (threads * 8), 1, 16);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, items), 1, [&](int64_t, int64_t) {
    attend_worker(p, dtype, &next, items, chunk, splits);
  });
  return out;
}

}  // namespace

// What the CPU offers, lowered by HEBRUS_CPU_CAPABILITY; read once. An unknown value is refused at
// every call rather than ignored, so that a test or benchmark never measures another path than named.
CpuCapability cpu_capability() {
  static const std::pair<CpuCapability, std::string> chosen = [] {
    CpuCapability best = CpuCapability::kDefault;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
      best = __builtin_cpu_supports("avx512bf16") ? CpuCapability::kAvx512Bf16 : CpuCapability::kAvx512;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      best = CpuCapability::kAvx2;
#endif
    const char* env = std::getenv("HEBRUS_CPU_CAPABILITY");
    if (env == nullptr || *env == '\0') return std::make_pair(best, std::string());
    const std::string name(env);
    CpuCapability asked;
    if (name == "default") {
      asked = CpuCapability::kDefault;
    } else if (name == "avx2") {
      asked = CpuCapability::kAvx2;
    } else if (name == "avx512") {
      asked = CpuCapability::kAvx512;
    } else if (name == "avx512_bf16") {
      asked = CpuCapability::kAvx512Bf16;
    } else {
      return std::make_pair(best, name);
    }
    return std::make_pair(std::min(asked, best), std::string());
  }();
  HEBRUS_CHECK(chosen.second.empty(), HebrusError, "HEBRUS_CPU_CAPABILITY='", chosen.second,
               "' is not one of default, avx2, avx512, avx512_bf16 (or unset: the best the CPU has)");
  return chosen.first;
}

}  // namespace hebrus

TORCH_LIBRARY_IMPL(hebrus, CPU, m) {
  m.impl("qsa_attention", &hebrus::qsa_attention_cpu);
}
