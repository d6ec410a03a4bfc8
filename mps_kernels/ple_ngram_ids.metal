// hebrus::ple_ngram_ids on Apple GPUs: hashed n-gram row ids with the frozen EOS history rule
// (SPEC section 2; hebrus_torch/reference.py is the spec).
//
// Thread layout (hebrus_launch.h): items [0, T) are tokens, one thread each; items [T, T + B) are
// rows, one thread each. A token thread walks back through its row's stream z = history ++ tokens
// (never into another row) for shifts 1..N-1: the shifted token is z[i-k] unless an EOS was met
// among z[i-k .. i-1], in which case it is EOS. The order-n mix is s0*m0 ^ ... ^ s(n-1)*m(n-1) in
// 64-bit two's complement (unsigned arithmetic, so no signed overflow), and head j of order n gets
// floor_mod(mix_n, P[h]) + offset[h], h = (n-2)*H + j, exactly torch.remainder's result for P > 0.
// A row thread checks its cu_seqlens and history entries and writes new_history: the last N-1 raw
// entries of z. Token ids outside [0, vocab), history ids outside it other than EOS (which may be any
// int64), and non-positive vocab sizes are reported through the error
// slots; the glue raises and returns nothing.
#include "hebrus_metal_common.h"

template <typename I>  // token id type: long (int64), the only one the op takes
[[kernel]] void ple_ngram_ids(device const I* tokens [[buffer(0)]],           // [T]
                              device const int* cu_seqlens [[buffer(1)]],     // [B + 1]
                              device const I* history [[buffer(2)]],          // [B, N-1]
                              device const long* multipliers [[buffer(3)]],   // [N]
                              device const long* vocab_sizes [[buffer(4)]],   // [(N-1) * H]
                              device const long* offsets [[buffer(5)]],       // [(N-1) * H]
                              device long* row_ids [[buffer(6)]],             // [T, (N-1) * H]
                              device I* new_history [[buffer(7)]],            // [B, N-1]
                              device HebrusErrorMessages* err [[buffer(8)]],  // the stream's error buffer
                              constant PleNgramParams& p [[buffer(9)]],
                              uint tid [[thread_position_in_grid]]) {
  const long item = long(tid);
  const long ctx = p.ngram - 1;
  if (item >= p.tokens + p.batch) {
    return;
  }

  if (item < p.tokens) {
    const long t = item;
    const long token = tokens[t];
    if (token < 0 || token >= p.vocab) {
      HEBRUS_REPORT_ERROR(err, "ple_ngram_ids", "hebrus::ple_ngram_ids: tokens[", t, "] = ", token,
                          " is outside [0, vocab=", p.vocab, ")");
      return;
    }
    const long b = hebrus_row_of(cu_seqlens, p.batch, t);
    const long start = cu_seqlens[b], end = cu_seqlens[b + 1];
    if (start < 0 || start > t || t >= end || end > p.tokens) {
      return;  // invalid cu_seqlens; the row threads report it
    }
    const long rel = t - start;
    ulong mix = ulong(token) * ulong(multipliers[0]);
    bool blocked = false;  // an EOS was met walking back: every older shift reads EOS
    for (long k = 1; k < p.ngram; ++k) {
      const long src = rel - k;  // >= -(N-1): inside the row's history
      const long v = src >= 0 ? tokens[start + src] : history[b * ctx + ctx + src];
      const long shifted = blocked ? p.eos : v;
      blocked = blocked || v == p.eos;
      mix ^= ulong(shifted) * ulong(multipliers[k]);
      for (long j = 0; j < p.heads_per_order; ++j) {
        const long h = (k - 1) * p.heads_per_order + j;
        const long size = vocab_sizes[h];
        if (size <= 0) {
          continue;  // the row thread of row 0 reports it
        }
        long rem = long(mix) % size;
        if (rem < 0) {
          rem += size;
        }
        row_ids[t * p.heads + h] = rem + offsets[h];
      }
    }
    return;
  }

  const long b = item - p.tokens;
  if (!hebrus_cu_row_ok(err, "ple_ngram_ids", cu_seqlens, p.batch, p.tokens, b)) {
    return;
  }
  if (b == 0) {
    for (long h = 0; h < p.heads; ++h) {
      if (vocab_sizes[h] <= 0) {
        HEBRUS_REPORT_ERROR(err, "ple_ngram_ids", "hebrus::ple_ngram_ids: vocab_sizes[", h,
                            "] must be positive, got ", vocab_sizes[h]);
      }
    }
  }
  for (long j = 0; j < ctx; ++j) {
    const long v = history[b * ctx + j];
    if ((v < 0 || v >= p.vocab) && v != p.eos) {  // eos is any int64 (SPEC section 2), the fresh history
      HEBRUS_REPORT_ERROR(err, "ple_ngram_ids", "hebrus::ple_ngram_ids: history[", b, ", ", j, "] = ", v,
                          " is outside [0, vocab=", p.vocab, ") and is not eos");
    }
  }
  const long start = cu_seqlens[b];
  const long n = long(cu_seqlens[b + 1]) - start;
  for (long j = 0; j < ctx; ++j) {
    const long idx = n + j;  // index in z of the j-th entry of the new history
    new_history[b * ctx + j] = idx < ctx ? history[b * ctx + idx] : tokens[start + idx - ctx];
  }
}

// cu_seqlens checked where ple_ngram_ids launches no row thread (B == 0).
[[kernel]] void ple_ngram_ids_check_cu(device const int* cu_seqlens [[buffer(0)]],
                                       device HebrusErrorMessages* err [[buffer(1)]],
                                       constant HebrusCheckParams& p [[buffer(2)]],
                                       uint tid [[thread_position_in_grid]]) {
  hebrus_check_cu(cu_seqlens, err, p, "ple_ngram_ids", long(tid));
}

HEBRUS_INSTANTIATE(ple_ngram_ids, long, long)
