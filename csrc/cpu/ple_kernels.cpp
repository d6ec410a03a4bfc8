// CPU kernels of hebrus::ple_ngram_ids and hebrus::ple_conv (SPEC §2); hebrus_torch/reference.py is
// the spec. Every check runs before any output is written. Each output element depends only on its
// own row's inputs, combined in a fixed order, so results are bitwise independent of how a stream is
// chunked and of the other rows in the batch. Index math is int64 throughout.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "hebrus_check.h"
#include "op_checks.h"

// Vector values only live inside always_inline helpers of one clone; no ABI crosses them.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace hebrus {
namespace {

using at::Tensor;

#if defined(__GNUC__)
#define HEBRUS_INLINE inline __attribute__((always_inline))
#else
#define HEBRUS_INLINE inline
#endif

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
// One binary for every x86 CPU; the clones differ in vector width only. -ffp-contract=off holds in
// every clone and the source fixes every operation's order, so all of them produce the same bits.
// Everything the hot loops call is always_inline, so it is compiled inside each clone.
#define HEBRUS_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define HEBRUS_VECTOR_CLONES
#endif

void check_devices(const char* op, std::initializer_list<std::pair<const char*, const Tensor*>> tensors) {
  for (const auto& [name, t] : tensors) {
    HEBRUS_CHECK(t->device().is_cpu(), HebrusError, "hebrus::", op,
                 ": all tensors must be on one device; the CPU kernel got ", name, " on ", t->device());
  }
}

// cu_seqlens values: 0 first, non-decreasing, T last. Returns the contiguous copy the kernel reads.
Tensor check_cu_values(const char* op, const Tensor& cu_seqlens, int64_t total) {
  Tensor cu = cu_seqlens.contiguous();
  const int32_t* p = cu.data_ptr<int32_t>();
  const int64_t batch = cu.size(0) - 1;
  HEBRUS_CHECK(p[0] == 0 && p[batch] == total, HebrusError, "hebrus::", op,
               ": cu_seqlens must start at 0 and end at T = ", total, ", got ", p[0], " .. ", p[batch]);
  for (const auto row : c10::irange(batch)) {
    HEBRUS_CHECK(p[row] <= p[row + 1], HebrusError, "hebrus::", op, ": cu_seqlens must be non-decreasing; row ", row,
                 " has cu_seqlens[", row, "] = ", p[row], " > cu_seqlens[", row + 1, "] = ", p[row + 1]);
  }
  return cu;
}

void check_ids_in_range(const char* op, const Tensor& ids, int64_t vocab, const char* name) {
  const int64_t* p = ids.data_ptr<int64_t>();
  const int64_t cols = ids.dim() == 2 ? ids.size(1) : 1;
  for (const auto i : c10::irange(ids.numel())) {
    if (p[i] < 0 || p[i] >= vocab) {
      const std::string where = ids.dim() == 2 ? std::to_string(i / cols) + ", " + std::to_string(i % cols)
                                               : std::to_string(i);
      HEBRUS_CHECK(false, HebrusError, "hebrus::", op, ": ", name, "[", where, "] = ", p[i],
                   " is outside [0, vocab=", vocab, ")");
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
// the heads of one order (an int64 division per head costs ~10x more). With a + 2^63 = u2*2^42 +
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

// Lane groups of every order, `groups_per_order` per order; empty when some divisor is >= kFastModLimit.
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
    const int64_t* h = a.hist + row * ctx;
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
  check_devices(op, {{"tokens", &tokens}, {"cu_seqlens", &cu_seqlens}, {"history", &history},
                     {"multipliers", &multipliers}, {"vocab_sizes", &vocab_sizes}, {"offsets", &offsets}});
  const PleNgramIdsSizes sz =
      check_ple_ngram_ids_args(tokens, cu_seqlens, history, multipliers, vocab_sizes, offsets, eos, vocab);
  const int64_t batch = sz.batch, n = sz.n, ctx = sz.ctx, heads = sz.heads, total = sz.total;
  const Tensor cu_t = check_cu_values(op, cu_seqlens, total);
  const Tensor tok_t = tokens.contiguous(), hist_t = history.contiguous(), mult_t = multipliers.contiguous();
  const Tensor sizes_t = vocab_sizes.contiguous(), off_t = offsets.contiguous();
  check_ids_in_range(op, tok_t, vocab, "tokens");
  check_ids_in_range(op, hist_t, vocab, "history");
  const int64_t* sizes = sizes_t.data_ptr<int64_t>();
  for (const auto h : c10::irange(heads)) {
    HEBRUS_CHECK(sizes[h] > 0, HebrusError, "hebrus::", op, ": vocab_sizes[", h, "] must be positive, got ", sizes[h]);
  }

  Tensor row_ids = at::empty({total, heads}, tokens.options());
  Tensor new_history = at::empty({batch, ctx}, history.options());
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

constexpr int64_t kChannelBlock = 256;

template <typename scalar_t>
inline void store_activation(scalar_t* y, const float* acc, int64_t n, bool silu) {
  if (silu) {
    for (int64_t c = 0; c < n; ++c) y[c] = static_cast<scalar_t>(acc[c] / (1.0f + std::exp(-acc[c])));
  } else {
    for (int64_t c = 0; c < n; ++c) y[c] = static_cast<scalar_t>(acc[c]);
  }
}

template <typename scalar_t>
void ple_conv_kernel(const Tensor& x, const Tensor& w_kc, const int32_t* cu, const Tensor& state, Tensor& y,
                     Tensor& new_state, int64_t batch, int64_t dilation, bool silu) {
  const int64_t total = x.size(0), channels = x.size(1), width = w_kc.size(0), state_len = state.size(1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* sp = state.data_ptr<scalar_t>();
  const float* wp = w_kc.data_ptr<float>();
  scalar_t* yp = y.data_ptr<scalar_t>();
  scalar_t* nsp = new_state.data_ptr<scalar_t>();
  // Row m of the stream u = state[row] ++ x[row] (m < L reads the carried state).
  auto u_row = [&](int64_t row, int64_t start, int64_t m) -> const scalar_t* {
    return m >= state_len ? xp + (start + m - state_len) * channels : sp + (row * state_len + m) * channels;
  };
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, channels * width));
  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    float acc[kChannelBlock];
    int64_t row = row_of(cu, batch, begin);
    for (int64_t t = begin; t < end; ++t) {
      while (t >= cu[row + 1]) ++row;
      const int64_t start = cu[row];
      const int64_t i = state_len + (t - start);
      for (int64_t c0 = 0; c0 < channels; c0 += kChannelBlock) {
        const int64_t nc = std::min(kChannelBlock, channels - c0);
        if (width == 4) {
          // Qwen4Exp's width, one pass: the same sum ((0 + w0u0) + w1u1) + ... as the general loop.
          const scalar_t* u0 = u_row(row, start, i - 3 * dilation) + c0;
          const scalar_t* u1 = u_row(row, start, i - 2 * dilation) + c0;
          const scalar_t* u2 = u_row(row, start, i - dilation) + c0;
          const scalar_t* u3 = u_row(row, start, i) + c0;
          const float *w0 = wp + c0, *w1 = w0 + channels, *w2 = w1 + channels, *w3 = w2 + channels;
          for (int64_t c = 0; c < nc; ++c) {
            float a = 0.0f + w0[c] * static_cast<float>(u0[c]);
            a += w1[c] * static_cast<float>(u1[c]);
            a += w2[c] * static_cast<float>(u2[c]);
            a += w3[c] * static_cast<float>(u3[c]);
            acc[c] = a;
          }
        } else {
          std::fill(acc, acc + nc, 0.0f);
          for (int64_t k = 0; k < width; ++k) {
            const scalar_t* u = u_row(row, start, i - (width - 1 - k) * dilation) + c0;
            const float* wk = wp + k * channels + c0;
            for (int64_t c = 0; c < nc; ++c) acc[c] += wk[c] * static_cast<float>(u[c]);
          }
        }
        store_activation(yp + t * channels + c0, acc, nc, silu);
      }
    }
  });
  at::parallel_for(0, batch * state_len, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, channels)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t row = r / state_len, j = r % state_len;
      const int64_t len = cu[row + 1] - cu[row];
      const scalar_t* src = u_row(row, cu[row], len + j);  // last L entries of u, which has L + len
      std::copy(src, src + channels, nsp + r * channels);
    }
  });
}

std::tuple<Tensor, Tensor> ple_conv_cpu(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                                        const Tensor& state, int64_t dilation, c10::string_view activation) {
  const char* op = "ple_conv";
  check_devices(op, {{"x", &x}, {"weight", &weight}, {"cu_seqlens", &cu_seqlens}, {"state", &state}});
  const PleConvSizes sz = check_ple_conv_args(x, weight, cu_seqlens, state, dilation, activation);
  const int64_t batch = sz.batch;
  const bool silu = sz.silu;
  const auto dtype = x.scalar_type();
  const Tensor cu_t = check_cu_values(op, cu_seqlens, sz.total);

  const Tensor xc = x.contiguous(), sc = state.contiguous();
  // fp32 [K, C] copy of the weight so the inner loop over channels reads it contiguously.
  const Tensor w_kc = weight.to(at::kFloat).t().contiguous();
  Tensor y = at::empty_like(xc);
  Tensor new_state = at::empty_like(sc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "hebrus::ple_conv", [&] {
    ple_conv_kernel<scalar_t>(xc, w_kc, cu_t.data_ptr<int32_t>(), sc, y, new_state, batch, dilation, silu);
  });
  return {y, new_state};
}

}  // namespace
}  // namespace hebrus

TORCH_LIBRARY_IMPL(hebrus, CPU, m) {
  m.impl("ple_ngram_ids", &hebrus::ple_ngram_ids_cpu);
  m.impl("ple_conv", &hebrus::ple_conv_cpu);
}
