// hebrus::ple_ngram_ids_slots on Apple GPUs: ple_ngram_ids whose row b reads its history from
// history_pool[slots[b]] and writes the new history back there, in place (SPEC section 2, issue 19;
// hebrus_torch/reference.py is the spec: gather, ple_ngram_ids, index_copy_).
//
// Thread layout (hebrus_launch.h): ple_ngram_ids' grid, items [0, T) are tokens, [T, T + B) rows,
// one thread each. A token at position rel >= N-1 of its row walks back through tokens only and
// writes its row ids. A row thread checks the row's cu_seqlens, slot and history entries, computes
// the ids of the row's first min(n, N-1) tokens (whose n-grams reach into the history) from the old
// history, and then writes the new history (the last N-1 entries of history ++ tokens) in place: the
// only thread that reads or writes that pool row. The ids are ple_ngram_ids.metal's expression
// (frozen EOS rule, 64-bit two's complement mix, floor modulo), so they equal ple_ngram_ids' on the
// gathered histories bitwise. Nothing is written for bad input: no ids for a token outside
// [0, vocab) (or, for the first tokens, a bad history), and the pool row keeps its history when its
// slot, a history entry or a token copied into it is bad.
#include "hebrus_metal_common.h"

// Row ids of token t (id `token`, position rel of its row starting at token `start`); `hist` is the
// row's history ([N-1], read only when rel < N-1).
template <typename I>
inline void ple_ngram_slots_ids(device const I* tokens, device const I* hist, device const long* multipliers,
                                device const long* vocab_sizes, device const long* offsets, device long* row_ids,
                                constant PleNgramSlotsParams& p, long t, long start, long token) {
  const long ctx = p.ngram - 1;
  const long rel = t - start;
  ulong mix = ulong(token) * ulong(multipliers[0]);
  bool blocked = false;  // an EOS was met walking back: every older shift reads EOS
  for (long k = 1; k < p.ngram; ++k) {
    const long src = rel - k;  // >= -(N-1): inside the row's history
    const long v = src >= 0 ? long(tokens[start + src]) : long(hist[ctx + src]);
    const long shifted = blocked ? p.eos : v;
    blocked = blocked || v == p.eos;
    mix ^= ulong(shifted) * ulong(multipliers[k]);
    for (long j = 0; j < p.heads_per_order; ++j) {
      const long h = (k - 1) * p.heads_per_order + j;
      const long size = vocab_sizes[h];
      if (size <= 0) {
        continue;  // the thread of row 0 reports it
      }
      long rem = long(mix) % size;
      if (rem < 0) {
        rem += size;
      }
      row_ids[t * p.heads + h] = rem + offsets[h];
    }
  }
}

inline bool ple_ngram_slots_token_ok(long token, constant PleNgramSlotsParams& p) {
  return token >= 0 && token < p.vocab;
}

template <typename I>  // token id type: long (int64), the only one the op takes
[[kernel]] void ple_ngram_ids_slots(device const I* tokens [[buffer(0)]],           // [T]
                                    device const int* cu_seqlens [[buffer(1)]],     // [B + 1]
                                    device I* history_pool [[buffer(2)]],           // [S, N-1], updated in place
                                    device const int* slots [[buffer(3)]],          // [B]
                                    device const long* multipliers [[buffer(4)]],   // [N]
                                    device const long* vocab_sizes [[buffer(5)]],   // [(N-1) * H]
                                    device const long* offsets [[buffer(6)]],       // [(N-1) * H]
                                    device long* row_ids [[buffer(7)]],             // [T, (N-1) * H]
                                    device HebrusErrorMessages* err [[buffer(8)]],  // the stream's error buffer
                                    constant PleNgramSlotsParams& p [[buffer(9)]],
                                    uint tid [[thread_position_in_grid]]) {
  const long item = long(tid);
  const long ctx = p.ngram - 1;
  if (item >= p.tokens + p.batch) {
    return;
  }

  if (item < p.tokens) {
    const long t = item;
    const long b = hebrus_row_of(cu_seqlens, p.batch, t);
    const long start = cu_seqlens[b], end = cu_seqlens[b + 1];
    if (start < 0 || start > t || t >= end || end > p.tokens) {
      return;  // invalid cu_seqlens; the row threads report it
    }
    if (t - start < ctx) {
      return;  // its n-grams read the history: the row's thread checks and computes it first
    }
    const long token = tokens[t];
    if (!ple_ngram_slots_token_ok(token, p)) {
      HEBRUS_REPORT_ERROR(err, "ple_ngram_ids_slots", "hebrus::ple_ngram_ids_slots: tokens[", t, "] = ", token,
                          " is outside [0, vocab=", p.vocab, ")");
      return;
    }
    ple_ngram_slots_ids(tokens, history_pool, multipliers, vocab_sizes, offsets, row_ids, p, t, start, token);
    return;
  }

  const long b = item - p.tokens;
  if (!hebrus_cu_row_ok(err, "ple_ngram_ids_slots", cu_seqlens, p.batch, p.tokens, b)) {
    return;
  }
  if (b == 0) {
    for (long h = 0; h < p.heads; ++h) {
      if (vocab_sizes[h] <= 0) {
        HEBRUS_REPORT_ERROR(err, "ple_ngram_ids_slots", "hebrus::ple_ngram_ids_slots: vocab_sizes[", h,
                            "] must be positive, got ", vocab_sizes[h]);
      }
    }
  }
  if (!hebrus_slot_ok(err, "ple_ngram_ids_slots", slots, p.batch, p.pool, b, true)) {
    return;
  }
  const long slot = slots[b];
  device I* hist = history_pool + slot * ctx;
  bool hist_ok = true;
  for (long j = 0; j < ctx; ++j) {
    const long v = hist[j];
    if ((v < 0 || v >= p.vocab) && v != p.eos) {  // eos is any int64 (SPEC section 2), the fresh history
      HEBRUS_REPORT_ERROR(err, "ple_ngram_ids_slots", "hebrus::ple_ngram_ids_slots: history_pool[", slot, ", ", j,
                          "] = ", v, " (slot of row ", b, ") is outside [0, vocab=", p.vocab, ") and is not eos");
      hist_ok = false;
    }
  }
  const long start = cu_seqlens[b];
  const long n = long(cu_seqlens[b + 1]) - start;
  bool copied_ok = hist_ok;  // every entry of the new history is valid
  for (long rel = 0; rel < hebrus_min(n, ctx); ++rel) {  // the ids that read the old history, first
    const long t = start + rel;
    const long token = tokens[t];
    if (!ple_ngram_slots_token_ok(token, p)) {
      HEBRUS_REPORT_ERROR(err, "ple_ngram_ids_slots", "hebrus::ple_ngram_ids_slots: tokens[", t, "] = ", token,
                          " is outside [0, vocab=", p.vocab, ")");
      copied_ok = copied_ok && rel < n - ctx;  // a bad token that stays in the new history
      continue;
    }
    if (hist_ok) {
      ple_ngram_slots_ids(tokens, hist, multipliers, vocab_sizes, offsets, row_ids, p, t, start, token);
    }
  }
  for (long rel = hebrus_max(ctx, n - ctx); rel < n; ++rel) {  // reported by their own token threads
    copied_ok = copied_ok && ple_ngram_slots_token_ok(tokens[start + rel], p);
  }
  if (n == 0 || !copied_ok) {
    return;
  }
  // The new history in place: entry j is entry n + j of history ++ tokens; n >= 1, so ascending j
  // reads every history entry before it is overwritten.
  for (long j = 0; j < ctx; ++j) {
    const long idx = n + j;
    hist[j] = idx < ctx ? hist[idx] : tokens[start + idx - ctx];
  }
}

// cu_seqlens, slots and vocab_sizes checked where ple_ngram_ids_slots launches no thread (B == 0).
[[kernel]] void ple_ngram_ids_slots_check(device const int* cu_seqlens [[buffer(0)]],
                                          device const int* slots [[buffer(1)]],
                                          device const long* vocab_sizes [[buffer(2)]],
                                          device HebrusErrorMessages* err [[buffer(3)]],
                                          constant HebrusSlotsCheckParams& p [[buffer(4)]],
                                          uint tid [[thread_position_in_grid]]) {
  hebrus_check_cu_slots(cu_seqlens, slots, err, p, "ple_ngram_ids_slots", long(tid));
  if (tid == 0) {
    for (long h = 0; h < p.heads; ++h) {
      if (vocab_sizes[h] <= 0) {
        HEBRUS_REPORT_ERROR(err, "ple_ngram_ids_slots", "hebrus::ple_ngram_ids_slots: vocab_sizes[", h,
                            "] must be positive, got ", vocab_sizes[h]);
      }
    }
  }
}

HEBRUS_INSTANTIATE(ple_ngram_ids_slots, long, long)
