#pragma once
// Helpers shared by the hebrus Metal kernels (Metal side only; keep ASCII).
#include <metal_stdlib>

#include "hebrus_launch.h"
#include "hebrus_params.h"

using namespace metal;

// Safe floating-point math whatever the compile options say. The kernels' NaN and -inf handling
// (x != x, a max that stays -inf) is part of their contract, and PYTORCH_MPS_FAST_MATH=1 makes
// PyTorch compile every library in fast mode, where the compiler may assume neither occurs. The
// pragma exists from MSL 3.2 (macOS 15); on macOS 14 that setting still applies (see README.md).
// FMA contraction pinned off as well: Metal fuses `a + b * c` by default even in safe math, which
// would make the GPU's bits depend on the compiler's choice; every product and sum in the kernels
// rounds on its own (the emulator builds them with -ffp-contract=off and =fast and compares).
#if __METAL_VERSION__ >= 320
#pragma METAL fp math_mode(safe)
#pragma METAL fp contract(off)
#endif

// Kernel names: "<op>_<type>" and "<op>_<variant>_<type>", instantiated MLX-style from decltype so
// the signature is never retyped. hebrus::metal::kernel_name() (hebrus_launch.h) builds the same
// strings on the host. The type names are MSL's: float, half, bfloat.
#define HEBRUS_INSTANTIATE(op, type, ...) \
  template [[host_name(#op "_" #type)]] [[kernel]] decltype(op<__VA_ARGS__>) op<__VA_ARGS__>;
#define HEBRUS_INSTANTIATE_VARIANT(op, variant, type, ...) \
  template [[host_name(#op "_" #variant "_" #type)]] [[kernel]] decltype(op<__VA_ARGS__>) op<__VA_ARGS__>;

// bfloat needs MSL 3.1 (macOS 14); the glue defines HEBRUS_METAL_BFLOAT when the extension was
// built with HEBRUS_METAL_BFLOAT=1 (the default).
#if defined(HEBRUS_METAL_BFLOAT) && __METAL_VERSION__ >= 310
#define HEBRUS_HAS_BFLOAT 1
#else
#define HEBRUS_HAS_BFLOAT 0
#endif

// 64-bit min / max spelled out, so no overload question arises for long operands.
inline long hebrus_min(long a, long b) { return a < b ? a : b; }
inline long hebrus_max(long a, long b) { return a > b ? a : b; }

// ---- value errors: PyTorch's MPS error buffer --------------------------------------------------------
// String literals are in the constant address space on Metal, as c10/metal/error.h's parameters
// say (the emulator and the strict clang check, where `constant` already means const, define
// HEBRUS_CSTR as a plain const char*).
#ifndef HEBRUS_CSTR
#define HEBRUS_CSTR constant const char*
#endif
// hebrus_report_error(buf, __FILE__, __LINE__, op, args...) is c10::metal::report_error of
// c10/metal/error.h (TORCH_REPORT_ERROR) over the same buffer layout: claim a message slot with an
// atomic add, write file, function (here the op) and the message, the concatenation of `args`
// (string literals and 64-bit integers), truncated to 249 characters. The stream raises the first
// message at its next synchronization. Which of several bad entries is named depends on thread
// timing; each message names the op, the entry and its value.
inline uint hebrus_put(device char* dst, uint cap, HEBRUS_CSTR src) {
  uint i = 0;
  while (src[i] != 0 && i + 1 < cap) {
    dst[i] = src[i];
    ++i;
  }
  dst[i] = 0;
  return i;
}

inline uint hebrus_put(device char* dst, uint cap, long v) {
  char digits[24];
  uint n = 0;
  ulong mag = v < 0 ? ulong(0) - ulong(v) : ulong(v);  // -LONG_MIN without overflow
  do {
    digits[n++] = char('0' + int(mag % 10ul));
    mag /= 10ul;
  } while (mag != 0ul);
  const uint len = n + (v < 0 ? 1u : 0u);
  if (len + 1 > cap) {
    dst[0] = 0;
    return 0;
  }
  uint i = 0;
  if (v < 0) {
    dst[i++] = '-';
  }
  while (n > 0) {
    dst[i++] = digits[--n];
  }
  dst[i] = 0;
  return i;
}

inline void hebrus_put_all(device char*, uint) {}

template <typename A, typename... Rest>
inline void hebrus_put_all(device char* dst, uint cap, A arg, Rest... rest) {
  const uint n = hebrus_put(dst, cap, arg);
  hebrus_put_all(dst + n, cap - n, rest...);
}

template <typename... Args>
inline void hebrus_report_error(device HebrusErrorMessages* buf, HEBRUS_CSTR file, int line, HEBRUS_CSTR op,
                                Args... args) {
  const uint idx = atomic_fetch_add_explicit(&buf->count, 1u, memory_order_relaxed);
  if (idx >= uint(HEBRUS_ERROR_MESSAGE_COUNT)) {
    return;
  }
  device HebrusErrorMessage* msg = &buf->msg[idx];
  hebrus_put(msg->file, 128, file);
  hebrus_put(msg->func, 128, op);
  hebrus_put_all(msg->message, 250, args...);
  msg->line = uint(line);
}

#define HEBRUS_REPORT_ERROR(buf, op, ...) hebrus_report_error(buf, __FILE__, __LINE__, op, __VA_ARGS__)

// The row b in [0, batch) with cu[b] <= t < cu[b + 1] for valid (non-decreasing) cu_seqlens; the
// caller checks the bounds it gets, so garbage cu_seqlens never lead to an out-of-bounds access.
inline long hebrus_row_of(device const int* cu, long batch, long t) {
  long lo = 0, hi = batch;
  while (hi - lo > 1) {
    const long mid = lo + (hi - lo) / 2;
    if (long(cu[mid]) <= t) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// cu_seqlens of row b are valid: 0 first, T last, non-decreasing.
inline bool hebrus_row_valid(device const int* cu, long batch, long tokens, long b) {
  const long start = cu[b], end = cu[b + 1];
  return start >= 0 && start <= end && end <= tokens && (b != 0 || start == 0) && (b != batch - 1 || end == tokens);
}

// Row b's cu_seqlens entries, checked as the reference checks them (0 first, T last, non-decreasing),
// with its messages. Returns whether the row can be used; a row that is unusable only because
// another row is bad (start < 0 or end > T between valid ends) reports nothing, that row does.
inline bool hebrus_cu_row_ok(device HebrusErrorMessages* err, HEBRUS_CSTR op, device const int* cu, long batch,
                             long tokens, long b) {
  const long start = cu[b], end = cu[b + 1];
  if ((b == 0 && start != 0) || (b == batch - 1 && end != tokens)) {
    HEBRUS_REPORT_ERROR(err, op, "hebrus::", op, ": cu_seqlens must start at 0 and end at T = ", tokens, ", got ",
                        long(cu[0]), " .. ", long(cu[batch]));
    return false;
  }
  if (start > end) {
    HEBRUS_REPORT_ERROR(err, op, "hebrus::", op, ": cu_seqlens must be non-decreasing; row ", b, " has cu_seqlens[",
                        b, "] = ", start, " > cu_seqlens[", b + 1, "] = ", end);
    return false;
  }
  return start >= 0 && end <= tokens;
}

// The check kernel of an op whose launch has no thread that looks at cu_seqlens (B == 0, or C == 0
// for ple_conv): one thread per row; with B == 0 one thread checks cu_seqlens = [0] and T == 0.
inline void hebrus_check_cu(device const int* cu, device HebrusErrorMessages* err, constant HebrusCheckParams& p,
                            HEBRUS_CSTR op, long b) {
  if (p.rows == 0) {
    if (b == 0 && (cu[0] != 0 || p.tokens != 0)) {
      HEBRUS_REPORT_ERROR(err, op, "hebrus::", op, ": cu_seqlens must start at 0 and end at T = ", p.tokens,
                          ", got ", long(cu[0]), " .. ", long(cu[0]));
    }
    return;
  }
  if (b < p.rows) {
    hebrus_cu_row_ok(err, op, cu, p.rows, p.tokens, b);
  }
}


// ---- slot-indexed state pools (ple_conv_slots, ple_ngram_ids_slots) --------------------------------

// Row b's slot lies in [0, pool) and no other row names it (two rows updating one slot in place would
// race). With `report`, a bad slot is reported with the CPU kernel's messages (csrc/ple_slots_checks.h):
// a slot out of range at its row; a duplicate at every later row naming it, with the first row that
// does (the CPU kernel's first message is among these). Every row of a duplicated slot returns false,
// the first one too, so none of them touches the pool. O(B) per call: every lane of a SIMD-group
// reads the same entries (one broadcast load per entry).
inline bool hebrus_slot_ok(device HebrusErrorMessages* err, HEBRUS_CSTR op, device const int* slots, long batch,
                           long pool, long b, bool report) {
  const long s = slots[b];
  if (s < 0 || s >= pool) {
    if (report) {
      HEBRUS_REPORT_ERROR(err, op, "hebrus::", op, ": slots[", b, "] = ", s, " is outside [0, S=", pool, ")");
    }
    return false;
  }
  for (long j = 0; j < batch; ++j) {
    if (j != b && long(slots[j]) == s) {  // the first hit: j < b is the slot's first row (ascending scan)
      if (report && j < b) {
        HEBRUS_REPORT_ERROR(err, op, "hebrus::", op, ": slot ", s, " appears twice in one batch (rows ", j, " and ",
                            b, "); each row updates its slot in place");
      }
      return false;
    }
  }
  return true;
}

// The check kernels of the slot ops (<op>_check), where the op launches no thread that would look
// (B == 0, or C == 0 for ple_conv_slots): one thread per row checks its cu_seqlens entries and its
// slot; with B == 0 one thread checks cu_seqlens = [0] and T == 0.
inline void hebrus_check_cu_slots(device const int* cu, device const int* slots, device HebrusErrorMessages* err,
                                  constant HebrusSlotsCheckParams& p, HEBRUS_CSTR op, long b) {
  if (p.rows == 0) {
    if (b == 0 && (cu[0] != 0 || p.tokens != 0)) {
      HEBRUS_REPORT_ERROR(err, op, "hebrus::", op, ": cu_seqlens must start at 0 and end at T = ", p.tokens,
                          ", got ", long(cu[0]), " .. ", long(cu[0]));
    }
    return;
  }
  if (b < p.rows) {
    hebrus_cu_row_ok(err, op, cu, p.rows, p.tokens, b);
    hebrus_slot_ok(err, op, slots, p.rows, p.pool, b, true);
  }
}
