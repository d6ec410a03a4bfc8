// CPU kernels of hebrus::ple_ngram_ids and hebrus::ple_conv (SPEC §2); hebrus_torch/reference.py is
// the spec. Every check runs before any output is written. Each output element depends only on its
// own row's inputs, combined in a fixed order, so results are bitwise independent of how a stream is
// chunked and of the other rows in the batch. Index math is int64 throughout.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/hebrus_simd.h"
#include "cpu/undispatched.h"
#include "hebrus_check.h"
#include "op_checks.h"

// Vector values only live inside always_inline helpers of one clone; no ABI crosses them.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace hebrus {
namespace {

using at::Tensor;

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
// GCC vectorises 16-bit conversions 512 bits wide only with AVX-512BW, which plain "avx512f" lacks.
#define HEBRUS_VECTOR_CLONES_16 \
  __attribute__((target_clones("arch=x86-64-v4", "avx512f", "arch=x86-64-v3", "default")))
#else
#define HEBRUS_VECTOR_CLONES_16
#endif

// Every id in [0, vocab); where eos_allowed, an id equal to eos too (the history of a fresh sequence is
// [eos]*(N-1), and eos may lie outside the vocabulary: SPEC §2).
void check_ids_in_range(const char* op, const Tensor& ids, int64_t vocab, const char* name, bool eos_allowed,
                        int64_t eos) {
  const int64_t* p = ids.data_ptr<int64_t>();
  const int64_t cols = ids.dim() == 2 ? ids.size(1) : 1;
  for (const auto i : c10::irange(ids.numel())) {
    if ((p[i] < 0 || p[i] >= vocab) && !(eos_allowed && p[i] == eos)) {
      const std::string where = ids.dim() == 2 ? std::to_string(i / cols) + ", " + std::to_string(i % cols)
                                               : std::to_string(i);
      HEBRUS_CHECK(false, HebrusError, "hebrus::", op, ": ", name, "[", where, "] = ", p[i],
                   " is outside [0, vocab=", vocab, ")", eos_allowed ? " and is not eos" : "");
    }
  }
}

// Row holding token t (0 <= t < T): the last row r with cu[r] <= t, which skips empty rows.
int64_t row_of(const int32_t* cu, int64_t batch, int64_t t) {
  return static_cast<int64_t>(std::upper_bound(cu, cu + batch + 1, t) - cu) - 1;
}

// Python-style (floor) remainder, as torch.remainder; divisor > 0 is checked by the caller.
inline int64_t floor_mod(int64_t a, int64_t b) {
  const int64_t r = a % b;
  return r < 0 ? r + b : r;
}

// Wrapping int64 arithmetic (torch's int64 mul/add wrap; signed overflow is UB in C++).
inline int64_t wrap_mul(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
}
inline int64_t wrap_add(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}

// Exact floor remainder by per-head divisors 0 < p < 2^30 in double arithmetic, vectorised across
// the heads of one order (an int64 division per head made the op ~4x slower). With a + 2^63 = u2*2^42 +
// u1*2^21 + u0 (limbs of 22, 21 and 21 bits), a mod p = s mod p for s = u2*c2 + u1*c1 + u0 + cn, where
// c2 = 2^42 mod p, c1 = 2^21 mod p, cn = -2^63 mod p. Every product and partial sum is an integer
// below 2^53, so s is exact; the rounded quotient s/p is floor or floor + 1, so one correction
// gives the remainder.
constexpr int64_t kFastModLimit = int64_t{1} << 30;
// Heads per vector step: the per-order head count is a runtime value (8 for Qwen4Exp), so the
// constants are padded to a multiple of this and each step has a fixed trip count.
constexpr int64_t kHeadLanes = 8;

// Constants of the fast path for kHeadLanes consecutive heads of one order (padding lanes: p = 1,
// everything else 0).
struct alignas(64) HeadLanes {
  double p[kHeadLanes], inv[kHeadLanes], c2[kHeadLanes], c1[kHeadLanes], cn[kHeadLanes];
  int64_t offs[kHeadLanes];
  int32_t p32[kHeadLanes];  // p as int32
};

// Lane groups of every order, ceil(per_order / kHeadLanes) per order; every divisor must be below
// kFastModLimit.
std::vector<HeadLanes> head_lanes(const int64_t* sizes, const int64_t* offs, int64_t ctx, int64_t per_order) {
  const int64_t groups_per_order = (per_order + kHeadLanes - 1) / kHeadLanes;
  std::vector<HeadLanes> g(static_cast<size_t>(ctx * groups_per_order));
  for (auto& lanes : g) {
    for (const auto l : c10::irange(kHeadLanes)) {
      lanes.p[l] = lanes.inv[l] = 1.0;
      lanes.c2[l] = lanes.c1[l] = lanes.cn[l] = 0.0;
      lanes.offs[l] = 0;
      lanes.p32[l] = 1;
    }
  }
  for (const auto k : c10::irange(ctx)) {
    for (const auto jj : c10::irange(per_order)) {
      const int64_t j = k * per_order + jj;
      HeadLanes& lanes = g[static_cast<size_t>(k * groups_per_order + jj / kHeadLanes)];
      const int64_t l = jj % kHeadLanes;
      const uint64_t p = static_cast<uint64_t>(sizes[j]);
      lanes.p[l] = static_cast<double>(p);
      lanes.p32[l] = static_cast<int32_t>(p);
      lanes.inv[l] = 1.0 / static_cast<double>(p);
      lanes.c2[l] = static_cast<double>((uint64_t{1} << 42) % p);
      lanes.c1[l] = static_cast<double>((uint64_t{1} << 21) % p);
      lanes.cn[l] = static_cast<double>((p - (uint64_t{1} << 63) % p) % p);
      lanes.offs[l] = offs[j];
    }
  }
  return g;
}

struct NgramArgs {
  const int32_t* cu;
  const int64_t* tok;
  const int64_t* hist;
  const int64_t* mult;
  const int64_t* sizes;
  const int64_t* offs;
  const HeadLanes* lanes;  // null: some divisor is >= kFastModLimit
  int64_t batch, n, ctx, heads, eos;
  int64_t* out;
  const int32_t* slots = nullptr;  // ple_ngram_ids_slots: row r's history is hist[slots[r]] (else hist[r])
};

// out[l] = floor_mod(a, p[l]) + offs[l] for the kHeadLanes heads of g, a given by its limbs.
HEBRUS_INLINE void head_lanes_fast(double u2, double u1, double u0, const HeadLanes& g, int64_t* out) {
  constexpr double kRound = 6755399441055744.0;  // 1.5 * 2^52: adding it rounds to an integer
  int64_t rows[kHeadLanes];  // local, so nothing the loop reads can alias what it writes
  for (int64_t l = 0; l < kHeadLanes; ++l) {
    const double s = ((u2 * g.c2[l] + u1 * g.c1[l]) + u0) + g.cn[l];
    const double q = (s * g.inv[l] + kRound) - kRound;
    const auto r = static_cast<int32_t>(s - q * g.p[l]);  // in [-p, p), exact
    rows[l] = wrap_add(static_cast<int64_t>(r + (g.p32[l] & (r >> 31))), g.offs[l]);  // branch-free: SLP-vectorised
  }
  std::memcpy(out, rows, sizeof(rows));
}

// Row ids of the per_order heads of one order, lane groups g[0 ..], written to o[0 .. per_order).
HEBRUS_INLINE void rows_of_order_fast(int64_t mixed, const HeadLanes* g, int64_t per_order, int64_t* o) {
  constexpr uint64_t kLimbMask = (uint64_t{1} << 21) - 1;
  const uint64_t u = static_cast<uint64_t>(mixed) ^ (uint64_t{1} << 63);
  const double u2 = static_cast<double>(static_cast<int32_t>(u >> 42));
  const double u1 = static_cast<double>(static_cast<int32_t>((u >> 21) & kLimbMask));
  const double u0 = static_cast<double>(static_cast<int32_t>(u & kLimbMask));
  int64_t jb = 0;
  for (; jb + kHeadLanes <= per_order; jb += kHeadLanes, ++g) head_lanes_fast(u2, u1, u0, *g, o + jb);
  if (jb < per_order) {
    int64_t tail[kHeadLanes];
    head_lanes_fast(u2, u1, u0, *g, tail);
    std::copy(tail, tail + (per_order - jb), o + jb);
  }
}

// Row ids of tokens [begin, end).
HEBRUS_VECTOR_CLONES
void ngram_rows(const NgramArgs& a, int64_t begin, int64_t end) {
  const int64_t per_order = a.heads / a.ctx, ctx = a.ctx;
  const int64_t groups_per_order = (per_order + kHeadLanes - 1) / kHeadLanes;
  const HeadLanes* const lanes = a.lanes;
  int64_t row = row_of(a.cu, a.batch, begin);
  for (int64_t t = begin; t < end; ++t) {
    while (t >= a.cu[row + 1]) ++row;
    // z = history[row] ++ tokens[row]; token t sits at z index i = ctx + (t - start).
    const int64_t start = a.cu[row];
    const int64_t i = ctx + (t - start);
    const int64_t* h = a.hist + (a.slots != nullptr ? a.slots[row] : row) * ctx;
    int64_t mixed = wrap_mul(a.tok[t], a.mult[0]);
    bool valid = true;  // no EOS in z[i-k .. i-1]
    int64_t* o = a.out + t * a.heads;
    for (int64_t k = 1; k < a.n; ++k) {
      const int64_t m = i - k;
      const int64_t zk = m >= ctx ? a.tok[start + (m - ctx)] : h[m];
      valid = valid && zk != a.eos;
      mixed ^= wrap_mul(valid ? zk : a.eos, a.mult[k]);
      const int64_t lo = (k - 1) * per_order, hi = k * per_order;
      if (lanes != nullptr) {
        rows_of_order_fast(mixed, lanes + (k - 1) * groups_per_order, per_order, o + lo);
      } else {
        for (int64_t j = lo; j < hi; ++j) o[j] = wrap_add(floor_mod(mixed, a.sizes[j]), a.offs[j]);
      }
    }
  }
}

std::tuple<Tensor, Tensor> ple_ngram_ids_cpu(const Tensor& tokens, const Tensor& cu_seqlens, const Tensor& history,
                                             const Tensor& multipliers, const Tensor& vocab_sizes,
                                             const Tensor& offsets, int64_t eos, int64_t vocab) {
  const char* op = "ple_ngram_ids";
  check_on_device(op, at::kCPU,
                  {{"tokens", &tokens}, {"cu_seqlens", &cu_seqlens}, {"history", &history},
                   {"multipliers", &multipliers}, {"vocab_sizes", &vocab_sizes}, {"offsets", &offsets}});
  const PleNgramIdsSizes sz =
      check_ple_ngram_ids_args(tokens, cu_seqlens, history, multipliers, vocab_sizes, offsets, eos, vocab);
  const int64_t batch = sz.batch, n = sz.n, ctx = sz.ctx, heads = sz.heads, total = sz.total;
  const Tensor cu_t = check_cu_values(op, cu_seqlens, total);
  const Tensor tok_t = tokens.contiguous(), hist_t = history.contiguous(), mult_t = multipliers.contiguous();
  const Tensor sizes_t = vocab_sizes.contiguous(), off_t = offsets.contiguous();
  check_ids_in_range(op, tok_t, vocab, "tokens", false, eos);
  check_ids_in_range(op, hist_t, vocab, "history", true, eos);
  const int64_t* sizes = sizes_t.data_ptr<int64_t>();
  for (const auto h : c10::irange(heads)) {
    HEBRUS_CHECK(sizes[h] > 0, HebrusError, "hebrus::", op, ": vocab_sizes[", h, "] must be positive, got ", sizes[h]);
  }

  Tensor row_ids = empty_on_cpu({total, heads}, tokens.options());
  Tensor new_history = empty_on_cpu({batch, ctx}, history.options());
  const int32_t* cu = cu_t.data_ptr<int32_t>();
  const int64_t* tok = tok_t.data_ptr<int64_t>();
  const int64_t* hist = hist_t.data_ptr<int64_t>();
  const int64_t* mult = mult_t.data_ptr<int64_t>();
  const int64_t* offs = off_t.data_ptr<int64_t>();
  int64_t* out = row_ids.data_ptr<int64_t>();
  int64_t* out_hist = new_history.data_ptr<int64_t>();
  bool fast = true;
  for (const auto h : c10::irange(heads)) fast = fast && sizes[h] < kFastModLimit;
  const std::vector<HeadLanes> lanes = fast ? head_lanes(sizes, offs, ctx, heads / ctx) : std::vector<HeadLanes>{};
  const NgramArgs args{cu, tok, hist, mult, sizes, offs, fast ? lanes.data() : nullptr, batch, n, ctx, heads, eos, out};
  // ~9 ns per token on one core (fast path): a thread needs a few thousand tokens to pay off.
  at::parallel_for(0, total, 2048, [&](int64_t begin, int64_t end) { ngram_rows(args, begin, end); });
  for (const auto row : c10::irange(batch)) {
    const int64_t start = cu[row], len = cu[row + 1] - cu[row];
    for (const auto j : c10::irange(ctx)) {
      const int64_t m = len + j;  // last ctx entries of z, which has ctx + len entries
      out_hist[row * ctx + j] = m >= ctx ? tok[start + (m - ctx)] : hist[row * ctx + m];
    }
  }
  return {row_ids, new_history};
}

// exp_silu and silu: hebrus_simd.h (shared with moe_kernels.cpp).

// Storage types of the conv: widening to fp32 and narrowing back (round to nearest even, the same
// bits as c10's conversions for every non-NaN value), branch-free so the channel loops vectorise.
struct F32 {
  using T = float;
  static HEBRUS_INLINE float load(float v) { return v; }
  static HEBRUS_INLINE float store(float f) { return f; }
};

struct BF16 {
  using T = uint16_t;
  static HEBRUS_INLINE float load(uint16_t v) { return bits_to_float(static_cast<uint32_t>(v) << 16); }
  static HEBRUS_INLINE uint16_t store(float f) {
    const uint32_t w = float_to_bits(f);
    const auto rounded = static_cast<uint16_t>((w + (((w >> 16) & 1u) + 0x7FFFu)) >> 16);
    return f != f ? uint16_t{0x7FC0} : rounded;
  }
};

// c10's fp16_ieee_to_fp32_value / fp16_ieee_from_fp32_value (the portable, F16C-free versions).
struct F16 {
  using T = uint16_t;
  static HEBRUS_INLINE float load(uint16_t h) {
    const uint32_t w = static_cast<uint32_t>(h) << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = bits_to_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
    // Integer mask select: a ternary here lets GCC sink the float math into branches.
    const uint32_t denormal = 0u - static_cast<uint32_t>(two_w < (1u << 27));
    return bits_to_float(sign | (float_to_bits(denormalized) & denormal) | (float_to_bits(normalized) & ~denormal));
  }
  static HEBRUS_INLINE uint16_t store(float f) {
    float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = float_to_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t bias_raw = shl1_w & 0xFF000000u;
    const uint32_t bias = bias_raw < 0x71000000u ? 0x71000000u : bias_raw;
    base = bits_to_float((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = float_to_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    const uint32_t nan = 0u - static_cast<uint32_t>(shl1_w > 0xFF000000u);  // mask select, as in load
    return static_cast<uint16_t>((sign >> 16) | (0x7E00u & nan) | (nonsign & ~nan));
  }
};

// Channels per inner sweep and tokens per tile: a tile walks its tokens over one channel block, so
// the rows t - 3d .. t of the block and its weights stay in L1/L2 while x and y stream through once.
// The tile's x rows are C elements apart, a stride the hardware prefetchers follow poorly: each
// token prefetches its block of an x row a little ahead (measured: ~25% less time at C = 10240, one
// thread; 1024-channel blocks beat 256 to 4096). 48 tokens: a multiple of the 4d-token spans of
// conv4_group at Qwen4Exp's d = 3.
constexpr int64_t kChannelBlock = 1024;
constexpr int64_t kTokenTile = 48;
constexpr int64_t kPrefetchTokens = 2;

struct ConvArgs {
  const void* x;
  const void* state;
  const float* w;  // [K, C] fp32
  const int32_t* cu;
  void* y;
  int64_t total, batch, channels, width, state_len, dilation;
  bool silu;
  const int32_t* slots = nullptr;  // ple_conv_slots: row r's state is state[slots[r]] (else state[r])
};

// Requests channels [c0, c0 + nc) of x's row `token` (clamped to the last token), a few tokens before
// the conv reads them.
template <typename T>
HEBRUS_INLINE void prefetch_x(const ConvArgs& a, int64_t token, int64_t c0, int64_t nc) {
  const T* row = static_cast<const T*>(a.x) + std::min(token, a.total - 1) * a.channels + c0;
  for (int64_t c = 0; c < nc; c += 64 / static_cast<int64_t>(sizeof(T))) __builtin_prefetch(row + c);
}

// Channel c0 of row m of the stream u = state[row] ++ x[row], whose x part starts at token `start`
// (m < L reads the carried state).
template <typename T>
HEBRUS_INLINE const T* u_row(const ConvArgs& a, int64_t row, int64_t start, int64_t m, int64_t c0) {
  const int64_t channels = a.channels, state_len = a.state_len;
  return (m >= state_len ? static_cast<const T*>(a.x) + (start + m - state_len) * channels
                         : static_cast<const T*>(a.state) +
                               ((a.slots != nullptr ? a.slots[row] : row) * state_len + m) * channels) +
         c0;
}

// y over the channels [c0, c0 + nc) of token t, whose row starts at token `start`.
template <typename D, bool kSilu>
HEBRUS_INLINE void conv_block(const ConvArgs& a, int64_t row, int64_t start, int64_t t, int64_t c0, int64_t nc) {
  using T = typename D::T;
  const int64_t channels = a.channels, state_len = a.state_len, width = a.width;
  auto u_at = [&](int64_t m) { return u_row<T>(a, row, start, m, c0); };
  const int64_t i = state_len + (t - start);
  const float* w = a.w + c0;
  T* __restrict y = static_cast<T*>(a.y) + t * channels + c0;
  prefetch_x<T>(a, t + kPrefetchTokens, c0, nc);
  if (width == 4) {
    // Qwen4Exp's width, one pass: the same sum ((0 + w0u0) + w1u1) + ... as the general loop.
    const T* __restrict u0 = u_at(i - 3 * a.dilation);
    const T* __restrict u1 = u_at(i - 2 * a.dilation);
    const T* __restrict u2 = u_at(i - a.dilation);
    const T* __restrict u3 = u_at(i);
    const float* __restrict w0 = w;
    const float* __restrict w1 = w0 + channels;
    const float* __restrict w2 = w1 + channels;
    const float* __restrict w3 = w2 + channels;
    for (int64_t c = 0; c < nc; ++c) {
      float acc = 0.0f + w0[c] * D::load(u0[c]);
      acc += w1[c] * D::load(u1[c]);
      acc += w2[c] * D::load(u2[c]);
      acc += w3[c] * D::load(u3[c]);
      y[c] = D::store(kSilu ? silu(acc) : acc);
    }
    return;
  }
  float acc[kChannelBlock];
  for (int64_t c = 0; c < nc; ++c) acc[c] = 0.0f;
  for (int64_t k = 0; k < width; ++k) {
    const T* __restrict u = u_at(i - (width - 1 - k) * a.dilation);
    const float* __restrict wk = w + k * channels;
    for (int64_t c = 0; c < nc; ++c) acc[c] += wk[c] * D::load(u[c]);
  }
  for (int64_t c = 0; c < nc; ++c) y[c] = D::store(kSilu ? silu(acc[c]) : acc[c]);
}

// Width 4, the four tokens i, i + d, i + 2d, i + 3d of one row: they read the 7 input rows
// u[i - 3d], u[i - 2d], ..., u[i + 3d], each loaded once here, and the weights once (instead of 16
// row and 16 weight loads). Each output is the same sum ((0 + w0u0) + w1u1) + ... as conv_block's.
template <typename D, bool kSilu>
HEBRUS_INLINE void conv4_group(const typename D::T* __restrict u0, const typename D::T* __restrict u1,
                               const typename D::T* __restrict u2, const typename D::T* __restrict u3,
                               const typename D::T* __restrict u4, const typename D::T* __restrict u5,
                               const typename D::T* __restrict u6, const float* __restrict w0,
                               const float* __restrict w1, const float* __restrict w2, const float* __restrict w3,
                               typename D::T* __restrict y0, typename D::T* __restrict y1,
                               typename D::T* __restrict y2, typename D::T* __restrict y3, int64_t nc) {
  for (int64_t c = 0; c < nc; ++c) {
    const float a0 = D::load(u0[c]), a1 = D::load(u1[c]), a2 = D::load(u2[c]), a3 = D::load(u3[c]);
    const float a4 = D::load(u4[c]), a5 = D::load(u5[c]), a6 = D::load(u6[c]);
    const float k0 = w0[c], k1 = w1[c], k2 = w2[c], k3 = w3[c];
    const float s0 = (((0.0f + k0 * a0) + k1 * a1) + k2 * a2) + k3 * a3;
    const float s1 = (((0.0f + k0 * a1) + k1 * a2) + k2 * a3) + k3 * a4;
    const float s2 = (((0.0f + k0 * a2) + k1 * a3) + k2 * a4) + k3 * a5;
    const float s3 = (((0.0f + k0 * a3) + k1 * a4) + k2 * a5) + k3 * a6;
    y0[c] = D::store(kSilu ? silu(s0) : s0);
    y1[c] = D::store(kSilu ? silu(s1) : s1);
    y2[c] = D::store(kSilu ? silu(s2) : s2);
    y3[c] = D::store(kSilu ? silu(s3) : s3);
  }
}

template <typename D, bool kSilu>
HEBRUS_INLINE void conv_token(const ConvArgs& a, int64_t t, int64_t& row, int64_t c0, int64_t nc) {
  while (t >= a.cu[row + 1]) ++row;
  conv_block<D, kSilu>(a, row, a.cu[row], t, c0, nc);
}

// y of tokens [begin, end): tiles of kTokenTile tokens, each swept block by block over the channels.
// At width 4 a tile goes in spans of 4d tokens: for r < d, the tokens s + r, s + r + d, s + r + 2d,
// s + r + 3d form one conv4_group where they lie in one row, else go one by one.
template <typename D, bool kSilu>
HEBRUS_INLINE void conv_tokens_act(const ConvArgs& a, int64_t begin, int64_t end) {
  using T = typename D::T;
  T* yp = static_cast<T*>(a.y);
  const int64_t channels = a.channels, d = a.dilation, state_len = a.state_len;
  for (int64_t t0 = begin; t0 < end; t0 += kTokenTile) {
    const int64_t t1 = std::min(end, t0 + kTokenTile);
    const int64_t first_row = row_of(a.cu, a.batch, t0);
    for (int64_t c0 = 0; c0 < channels; c0 += kChannelBlock) {
      const int64_t nc = std::min(kChannelBlock, channels - c0);
      int64_t row = first_row;
      if (a.width != 4) {
        for (int64_t t = t0; t < t1; ++t) conv_token<D, kSilu>(a, t, row, c0, nc);
        continue;
      }
      for (int64_t s = t0; s < t1; s += 4 * d) {
        for (int64_t r = 0; r < d && s + r < t1; ++r) {
          const int64_t t = s + r, last = t + 3 * d;
          while (t >= a.cu[row + 1]) ++row;
          if (last >= t1 || last >= a.cu[row + 1]) {
            int64_t member_row = row;
            for (int64_t m = t; m < t1 && m <= last; m += d) conv_token<D, kSilu>(a, m, member_row, c0, nc);
            continue;
          }
          const int64_t start = a.cu[row], i = state_len + (t - start);
          auto u_at = [&](int64_t m) { return u_row<T>(a, row, start, m, c0); };
          for (int64_t j = 0; j < 4; ++j) prefetch_x<T>(a, t + j * d + 1, c0, nc);
          const float* w = a.w + c0;
          T* y = yp + t * channels + c0;
          conv4_group<D, kSilu>(u_at(i - 3 * d), u_at(i - 2 * d), u_at(i - d), u_at(i), u_at(i + d), u_at(i + 2 * d),
                                u_at(i + 3 * d), w, w + channels, w + 2 * channels, w + 3 * channels, y,
                                y + d * channels, y + 2 * d * channels, y + 3 * d * channels, nc);
        }
      }
    }
  }
}

template <typename D>
HEBRUS_INLINE void conv_tokens(const ConvArgs& a, int64_t begin, int64_t end) {
  if (a.silu) {
    conv_tokens_act<D, true>(a, begin, end);
  } else {
    conv_tokens_act<D, false>(a, begin, end);
  }
}

HEBRUS_VECTOR_CLONES
void conv_tokens_f32(const ConvArgs& a, int64_t begin, int64_t end) { conv_tokens<F32>(a, begin, end); }
// 16-bit lanes fill a 512-bit vector only with AVX-512BW (with AVX-512F alone GCC vectorises these
// loops 256 bits wide), hence one more clone; the bits are the same in all of them.
HEBRUS_VECTOR_CLONES_16
void conv_tokens_f16(const ConvArgs& a, int64_t begin, int64_t end) { conv_tokens<F16>(a, begin, end); }
HEBRUS_VECTOR_CLONES_16
void conv_tokens_bf16(const ConvArgs& a, int64_t begin, int64_t end) { conv_tokens<BF16>(a, begin, end); }

// Row `row`'s tail in `pool` after its tokens, in place: the last L entries of tail ++ x[row], i.e. the
// tail shifted by len rows and x's last rows after it. Runs once the row's outputs are written (they
// read the old tail).
HEBRUS_INLINE void shift_tail(const ConvArgs& a, char* pool, int64_t row, int64_t row_bytes) {
  const int64_t len = a.cu[row + 1] - a.cu[row], state_len = a.state_len;
  if (len == 0 || row_bytes == 0 || state_len == 0) return;
  const char* xb = static_cast<const char*>(a.x);
  char* tail = pool + static_cast<int64_t>(a.slots[row]) * state_len * row_bytes;
  if (len >= state_len) {
    std::memcpy(tail, xb + (a.cu[row + 1] - state_len) * row_bytes, static_cast<size_t>(state_len * row_bytes));
  } else {
    std::memmove(tail, tail + len * row_bytes, static_cast<size_t>((state_len - len) * row_bytes));
    std::memcpy(tail + (state_len - len) * row_bytes, xb + a.cu[row] * row_bytes, static_cast<size_t>(len * row_bytes));
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
// Hand-written AVX2 kernel of one bf16 decode row at width 4 (x86-64-v3 CPUs without AVX-512, as
// qsa's): y over all C channels from the tail rows 0, d, 2d and x, 16 channels a step. Every
// operation is conv_block's, silu's and BF16::store's, in their order ((0 + w0 u0) + w1 u1 ...;
// exp_silu's clamps on the bit patterns, its fused multiply-adds, 2^n as 2^(n-1) * 2; x / (1 + e);
// round to nearest even), so every value is the portable loop's, and a NaN is stored as 0x7FC0
// whatever its payload: the bits are the same (tests/test_ple_slots.py compares
// HEBRUS_CPU_CAPABILITY=default with avx2). Not for fp32, whose outputs keep NaN payloads: which
// operand's payload an add or multiply of two NaNs keeps is the compiler's choice of operand order,
// and GCC's for the portable loop differs. A decode step is memory-bound, but GCC's vectorisation of
// the portable loop spends ~25% more instructions per output than this, compute that the memory
// stalls do not all hide (measured at 64 rows, C = 10240, cold caches, 2 threads: ~5-7% less
// kernel time).
HEBRUS_AVX2 HEBRUS_INLINE __m256 silu_avx2(__m256 acc) {
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i b = _mm256_xor_si256(_mm256_castps_si256(acc), sign);  // the bits of -acc
  const __m256i neg_capped = _mm256_min_epu32(b, _mm256_set1_epi32(static_cast<int>(0xC2AF0000u)));  // -87.5f
  const __m256i flipped = _mm256_xor_si256(neg_capped, sign);
  const __m256i capped = _mm256_min_epu32(flipped, _mm256_set1_epi32(static_cast<int>(0x42B20000u ^ 0x80000000u)));
  const __m256 xc = _mm256_castsi256_ps(_mm256_xor_si256(capped, sign));
  const __m256 magic = _mm256_set1_ps(12582912.f);
  const __m256 t = _mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), magic);
  const __m256 n = _mm256_sub_ps(t, magic);
  const __m256i ni = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(magic));
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), xc));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 e_r = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), one);
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(126)), 23));
  const __m256 e = _mm256_mul_ps(_mm256_mul_ps(e_r, scale), _mm256_set1_ps(2.f));
  return _mm256_div_ps(acc, _mm256_add_ps(one, e));
}

HEBRUS_AVX2 HEBRUS_INLINE __m256 load8_bf16_avx2(const uint16_t* p) {  // the bits shifted up
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

// BF16::store of 8 floats, in the low 16 bits of each 32-bit lane.
HEBRUS_AVX2 HEBRUS_INLINE __m256i bf16_bits_avx2(__m256 f) {
  const __m256i w = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(w, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(w, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
  return _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)), nan));
}

template <bool kSilu>
HEBRUS_AVX2 HEBRUS_INLINE __m256 conv4_avx2(const uint16_t* u0, const uint16_t* u1, const uint16_t* u2,
                                            const uint16_t* u3, const float* w0, const float* w1, const float* w2,
                                            const float* w3) {
  __m256 acc = _mm256_add_ps(_mm256_mul_ps(load8_bf16_avx2(u0), _mm256_loadu_ps(w0)), _mm256_setzero_ps());
  acc = _mm256_add_ps(acc, _mm256_mul_ps(load8_bf16_avx2(u1), _mm256_loadu_ps(w1)));
  acc = _mm256_add_ps(acc, _mm256_mul_ps(load8_bf16_avx2(u2), _mm256_loadu_ps(w2)));
  acc = _mm256_add_ps(acc, _mm256_mul_ps(load8_bf16_avx2(u3), _mm256_loadu_ps(w3)));
  return kSilu ? silu_avx2(acc) : acc;
}

// y of bf16 decode row `row` (one token), width 4.
template <bool kSilu>
HEBRUS_AVX2 __attribute__((noinline)) void decode_row4_bf16_avx2(const ConvArgs& a, int64_t row) {
  using D = BF16;
  using T = D::T;
  const int64_t channels = a.channels, d = a.dilation, t = a.cu[row];
  const T* tail = static_cast<const T*>(a.state) + static_cast<int64_t>(a.slots[row]) * a.state_len * channels;
  const T* u0 = tail;
  const T* u1 = tail + d * channels;
  const T* u2 = tail + 2 * d * channels;
  const T* u3 = static_cast<const T*>(a.x) + t * channels;
  const float* w0 = a.w;
  const float* w1 = w0 + channels;
  const float* w2 = w1 + channels;
  const float* w3 = w2 + channels;
  T* y = static_cast<T*>(a.y) + t * channels;
  int64_t c = 0;
  for (; c + 16 <= channels; c += 16) {
    const __m256 lo = conv4_avx2<kSilu>(u0 + c, u1 + c, u2 + c, u3 + c, w0 + c, w1 + c, w2 + c, w3 + c);
    const __m256 hi = conv4_avx2<kSilu>(u0 + c + 8, u1 + c + 8, u2 + c + 8, u3 + c + 8, w0 + c + 8, w1 + c + 8,
                                        w2 + c + 8, w3 + c + 8);
    const __m256i packed = _mm256_packus_epi32(bf16_bits_avx2(lo), bf16_bits_avx2(hi));  // lanes 0-3, 8-11, 4-7, 12-15
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + c), _mm256_permute4x64_epi64(packed, 0xD8));
  }
  if (c < channels) conv_block<D, kSilu>(a, row, t, t, c, channels - c);  // the last C mod 16 channels
}
#endif

// The weight [C, K] (any strides, x's dtype) as fp32 [K, C], the layout the channel loops read. fp32
// is copied and bf16 widened by hand (exactly: its bits shifted up, as c10 converts); ATen's
// to / t / contiguous took ~120 us hot and ~450 us with cold caches at C = 10240 (a decode step's conv
// itself takes ~1.3 ms). fp16 goes through ATen's conversion.
std::unique_ptr<float[]> weight_kc(const Tensor& weight) {
  const int64_t channels = weight.size(0), width = weight.size(1);
  std::unique_ptr<float[]> w(new float[static_cast<size_t>(std::max<int64_t>(1, channels * width))]);
  if (weight.scalar_type() == at::kHalf) {
    const Tensor t = weight.to(at::kFloat).t().contiguous();
    std::memcpy(w.get(), t.data_ptr<float>(), static_cast<size_t>(channels * width) * sizeof(float));
    return w;
  }
  const int64_t s0 = weight.stride(0), s1 = weight.stride(1);
  if (weight.scalar_type() == at::kFloat) {
    const float* p = weight.data_ptr<float>();
    for (const auto k : c10::irange(width)) {
      for (const auto c : c10::irange(channels)) w[k * channels + c] = p[c * s0 + k * s1];
    }
  } else {
    const auto* p = static_cast<const uint16_t*>(weight.data_ptr());
    for (const auto k : c10::irange(width)) {
      for (const auto c : c10::irange(channels)) w[k * channels + c] = BF16::load(p[c * s0 + k * s1]);
    }
  }
  return w;
}

// y and new_state of ple_conv into contiguous buffers of the right shapes; the arguments are checked.
void run_ple_conv(const Tensor& x, const Tensor& weight, const Tensor& cu_t, const Tensor& state,
                  const PleConvSizes& sz, int64_t dilation, const Tensor& y, const Tensor& new_state) {
  const int64_t batch = sz.batch;
  const auto dtype = x.scalar_type();
  const Tensor xc = x.contiguous(), sc = state.contiguous();
  // fp32 [K, C] copy of the weight so the inner loop over channels reads it contiguously.
  const std::unique_ptr<float[]> w_kc = weight_kc(weight);
  const int64_t channels = sz.channels, state_len = sz.state_len;
  const ConvArgs args{xc.data_ptr(), sc.data_ptr(), w_kc.get(), cu_t.data_ptr<int32_t>(), y.data_ptr(),
                      sz.total, batch, channels, sz.width, state_len, dilation, sz.silu};
  void (*conv_tokens_fn)(const ConvArgs&, int64_t, int64_t) =
      dtype == at::kFloat ? conv_tokens_f32 : dtype == at::kHalf ? conv_tokens_f16 : conv_tokens_bf16;
  // At least ~64K outputs per thread (tens of microseconds of work).
  at::parallel_for(0, sz.total, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, channels)),
                   [&](int64_t begin, int64_t end) { conv_tokens_fn(args, begin, end); });
  // new_state: the last L entries of u = state ++ x, row by row.
  const auto elem = static_cast<int64_t>(xc.element_size());
  const char* xb = static_cast<const char*>(xc.data_ptr());
  const char* sb = static_cast<const char*>(sc.data_ptr());
  char* nb = static_cast<char*>(new_state.data_ptr());
  const int32_t* cu = cu_t.data_ptr<int32_t>();
  const int64_t row_bytes = channels * elem;
  const int64_t copy_grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, row_bytes));  // ~1 MiB
  at::parallel_for(0, row_bytes > 0 ? batch * state_len : 0, copy_grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t row = r / state_len, m = cu[row + 1] - cu[row] + r % state_len;  // u has L + len entries
      const char* src = m >= state_len ? xb + (cu[row] + m - state_len) * row_bytes
                                       : sb + (row * state_len + m) * row_bytes;
      std::memcpy(nb + r * row_bytes, src, static_cast<size_t>(row_bytes));
    }
  });
}

std::tuple<Tensor, Tensor> ple_conv_cpu(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                                        const Tensor& state, int64_t dilation, c10::string_view activation) {
  const char* op = "ple_conv";
  check_on_device(op, at::kCPU, {{"x", &x}, {"weight", &weight}, {"cu_seqlens", &cu_seqlens}, {"state", &state}});
  const PleConvSizes sz = check_ple_conv_args(x, weight, cu_seqlens, state, dilation, activation);
  const Tensor cu_t = check_cu_values(op, cu_seqlens, sz.total);
  Tensor y = empty_on_cpu(x.sizes(), x.options());
  Tensor new_state = empty_on_cpu(state.sizes(), state.options());
  run_ple_conv(x, weight, cu_t, state, sz, dilation, y, new_state);
  return {y, new_state};
}

// ple_conv into caller-owned buffers: a prefill loop that reuses them skips allocating (and, for
// large outputs, page-faulting) a fresh [T, C] tensor per call.
void ple_conv_into_cpu(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens, const Tensor& state,
                       int64_t dilation, c10::string_view activation, Tensor& y, Tensor& new_state) {
  const char* op = "ple_conv_into";
  check_on_device(op, at::kCPU,
                  {{"x", &x}, {"weight", &weight}, {"cu_seqlens", &cu_seqlens}, {"state", &state}, {"y", &y},
                   {"new_state", &new_state}});
  const PleConvSizes sz = check_ple_conv_args(x, weight, cu_seqlens, state, dilation, activation, op);
  check_ple_conv_outs(x, weight, cu_seqlens, state, y, new_state);
  const Tensor cu_t = check_cu_values(op, cu_seqlens, sz.total);
  run_ple_conv(x, weight, cu_t, state, sz, dilation, y, new_state);
}

// ---- slot-indexed forms: the state pool read and written in place by slot id -------------------------
// The same arithmetic as ple_ngram_ids / ple_conv (the same row loops, reading row r's state at its
// slot), so the bits equal the gather -> op -> scatter path. Every check runs before anything is
// written; the slots are distinct, so the rows' in-place updates never touch one another.

Tensor ple_ngram_ids_slots_cpu(const Tensor& tokens, const Tensor& cu_seqlens, Tensor& history_pool,
                               const Tensor& slots, const Tensor& multipliers, const Tensor& vocab_sizes,
                               const Tensor& offsets, int64_t eos, int64_t vocab) {
  const char* op = "ple_ngram_ids_slots";
  check_on_device(op, at::kCPU,
                  {{"tokens", &tokens}, {"cu_seqlens", &cu_seqlens}, {"history_pool", &history_pool},
                   {"slots", &slots}, {"multipliers", &multipliers}, {"vocab_sizes", &vocab_sizes},
                   {"offsets", &offsets}});
  const PleNgramIdsSizes sz = check_ple_ngram_ids_slots_args(tokens, cu_seqlens, history_pool, slots,
                                                                  multipliers, vocab_sizes, offsets, vocab);
  const int64_t batch = sz.batch, n = sz.n, ctx = sz.ctx, heads = sz.heads, total = sz.total;
  const Tensor cu_t = check_cu_values(op, cu_seqlens, total);
  const Tensor slot_t = check_slot_values(op, slots, sz.pool);
  const Tensor tok_t = tokens.contiguous(), mult_t = multipliers.contiguous();
  const Tensor sizes_t = vocab_sizes.contiguous(), off_t = offsets.contiguous();
  check_ids_in_range(op, tok_t, vocab, "tokens", false, eos);
  const int32_t* sl = slot_t.data_ptr<int32_t>();
  int64_t* hist = history_pool.data_ptr<int64_t>();
  for (const auto row : c10::irange(batch)) {
    for (const auto j : c10::irange(ctx)) {
      const int64_t v = hist[sl[row] * ctx + j];
      HEBRUS_CHECK((v >= 0 && v < vocab) || v == eos, HebrusError, "hebrus::", op, ": history_pool[", sl[row], ", ",
                   j, "] = ", v, " (slot of row ", row, ") is outside [0, vocab=", vocab, ") and is not eos");
    }
  }
  const int64_t* sizes = sizes_t.data_ptr<int64_t>();
  for (const auto h : c10::irange(heads)) {
    HEBRUS_CHECK(sizes[h] > 0, HebrusError, "hebrus::", op, ": vocab_sizes[", h, "] must be positive, got ", sizes[h]);
  }
  Tensor row_ids = empty_on_cpu({total, heads}, tokens.options());
  const int32_t* cu = cu_t.data_ptr<int32_t>();
  const int64_t* tok = tok_t.data_ptr<int64_t>();
  bool fast = true;
  for (const auto h : c10::irange(heads)) fast = fast && sizes[h] < kFastModLimit;
  const int64_t* offs = off_t.data_ptr<int64_t>();
  const std::vector<HeadLanes> lanes = fast ? head_lanes(sizes, offs, ctx, heads / ctx) : std::vector<HeadLanes>{};
  NgramArgs args{cu, tok, hist, mult_t.data_ptr<int64_t>(), sizes, offs, fast ? lanes.data() : nullptr,
                 batch, n, ctx, heads, eos, row_ids.data_ptr<int64_t>()};
  args.slots = sl;
  at::parallel_for(0, total, 2048, [&](int64_t begin, int64_t end) { ngram_rows(args, begin, end); });
  // Every row id is written: now the histories, in place (the last ctx entries of history ++ tokens).
  std::vector<int64_t> row_hist(static_cast<size_t>(ctx));
  for (const auto row : c10::irange(batch)) {
    const int64_t start = cu[row], len = cu[row + 1] - cu[row];
    if (len == 0) continue;
    int64_t* h = hist + sl[row] * ctx;
    for (const auto j : c10::irange(ctx)) {
      const int64_t m = len + j;
      row_hist[static_cast<size_t>(j)] = m >= ctx ? tok[start + (m - ctx)] : h[m];
    }
    std::copy(row_hist.begin(), row_hist.end(), h);
  }
  return row_ids;
}

Tensor ple_conv_slots_cpu(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens, Tensor& state_pool,
                          const Tensor& slots, int64_t dilation, c10::string_view activation) {
  const char* op = "ple_conv_slots";
  check_on_device(op, at::kCPU,
                  {{"x", &x}, {"weight", &weight}, {"cu_seqlens", &cu_seqlens}, {"state_pool", &state_pool},
                   {"slots", &slots}});
  const PleConvSizes sz =
      check_ple_conv_slots_args(x, weight, cu_seqlens, state_pool, slots, dilation, activation);
  const Tensor cu_t = check_cu_values(op, cu_seqlens, sz.total);
  const Tensor slot_t = check_slot_values(op, slots, sz.pool);
  const int64_t batch = sz.batch, channels = sz.channels, state_len = sz.state_len;
  Tensor y = empty_on_cpu(x.sizes(), x.options());
  const Tensor xc = x.contiguous();
  const std::unique_ptr<float[]> w_kc = weight_kc(weight);
  const int32_t* cu = cu_t.data_ptr<int32_t>();
  const int32_t* sl = slot_t.data_ptr<int32_t>();
  ConvArgs args{xc.data_ptr(), state_pool.data_ptr(), w_kc.get(), cu, y.data_ptr(),
                sz.total, batch, channels, sz.width, state_len, dilation, sz.silu};
  args.slots = sl;
  const auto dtype = x.scalar_type();
  char* pb = static_cast<char*>(state_pool.data_ptr());
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, channels));
  bool decode = true;
  for (const auto row : c10::irange(batch)) decode = decode && cu[row + 1] - cu[row] <= 1;
  void (*conv_tokens_fn)(const ConvArgs&, int64_t, int64_t) =
      dtype == at::kFloat ? conv_tokens_f32 : dtype == at::kHalf ? conv_tokens_f16 : conv_tokens_bf16;
  const int64_t row_bytes = channels * static_cast<int64_t>(xc.element_size());
  if (decode) {
    // A decode step (no row has more than one token): row by row, its conv (conv_tokens over its one
    // token: the code, hence the bits, of the general path below) and then its tail update right away,
    // while the tail rows the conv read are still in cache. The general path updates every tail in a
    // second pass, which reads half of them from memory again (measured at 64 rows, C = 10240, cold
    // caches, 2 threads: the kernel ~20% faster in bf16, ~15% in fp32).
    // Rows are taken one at a time from a shared counter, not split in advance: a thread woken late
    // (the pool sleeps between a decode step's ops) leaves its rows to the others.
    [[maybe_unused]] const bool avx2 =
        sz.width == 4 && dtype == at::kBFloat16 && cpu_capability() == CpuCapability::kAvx2;
    std::atomic<int64_t> next{0};
    auto rows = [&](int64_t, int64_t) {
      for (int64_t row = next.fetch_add(1); row < batch; row = next.fetch_add(1)) {
        if (cu[row + 1] == cu[row]) continue;
#if defined(__x86_64__) && defined(__GNUC__)
        if (avx2) {
          if (sz.silu) {
            decode_row4_bf16_avx2<true>(args, row);
          } else {
            decode_row4_bf16_avx2<false>(args, row);
          }
          shift_tail(args, pb, row, row_bytes);
          continue;
        }
#endif
        conv_tokens_fn(args, cu[row], cu[row + 1]);
        shift_tail(args, pb, row, row_bytes);
      }
    };
    const int64_t tasks = std::min<int64_t>(at::get_num_threads(), (batch + grain - 1) / grain);
    if (tasks > 1) {
      at::parallel_for(0, tasks, 1, rows);
    } else {
      rows(0, 1);
    }
    return y;
  }
  at::parallel_for(0, sz.total, grain, [&](int64_t begin, int64_t end) { conv_tokens_fn(args, begin, end); });
  // Every y is written (it read the old tails): now each row's tail, in place.
  const int64_t tail_grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, state_len * row_bytes));
  at::parallel_for(0, row_bytes > 0 && state_len > 0 ? batch : 0, tail_grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) shift_tail(args, pb, row, row_bytes);
  });
  return y;
}

}  // namespace
}  // namespace hebrus

TORCH_LIBRARY_IMPL(hebrus, CPU, m) {
  m.impl("ple_ngram_ids", &hebrus::ple_ngram_ids_cpu);
  m.impl("ple_conv", &hebrus::ple_conv_cpu);
  m.impl("ple_conv_into", &hebrus::ple_conv_into_cpu);
  m.impl("ple_ngram_ids_slots", &hebrus::ple_ngram_ids_slots_cpu);
  m.impl("ple_conv_slots", &hebrus::ple_conv_slots_cpu);
}
