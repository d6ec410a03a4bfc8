// Deliberately broken (and a few correct) kernels: tests/test_metal_harness.py checks that the
// emulator reports each bug. Not part of the product.
#include <metal_stdlib>
using namespace metal;

// Correct: reverses each threadgroup's 64 values through threadgroup memory.
kernel void tg_reverse(device float* data [[buffer(0)]], uint lid [[thread_position_in_threadgroup]],
                       uint tg [[threadgroup_position_in_grid]]) {
  threadgroup float tmp[64];
  tmp[lid] = data[tg * 64 + lid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  data[tg * 64 + lid] = tmp[63 - lid];
}

// BUG: missing barrier between the write and the read of threadgroup memory.
kernel void racy_reverse(device float* data [[buffer(0)]], uint lid [[thread_position_in_threadgroup]],
                         uint tg [[threadgroup_position_in_grid]]) {
  threadgroup float tmp[64];
  tmp[lid] = data[tg * 64 + lid];
  data[tg * 64 + lid] = tmp[63 - lid];
}

// BUG: a barrier inside divergent control flow (two different barrier calls).
kernel void divergent_barrier(device float* data [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  if (lid < 32) {
    data[lid] *= 2;
    threadgroup_barrier(mem_flags::mem_device);
  } else {
    threadgroup_barrier(mem_flags::mem_device);
  }
}

// BUG: out-of-range threads return before the barrier the others wait at.
kernel void early_return(device float* data [[buffer(0)]], constant uint& n [[buffer(1)]],
                         uint gid [[thread_position_in_grid]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float tmp[64];
  if (gid >= n) return;
  tmp[lid] = data[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  data[gid] = tmp[lid ^ 1];
}

// BUG: a SIMD-group reduction that only half of the lanes reach.
kernel void divergent_simd(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  float s = -1.0f;
  if (lane < 16) s = simd_sum(float(lane));
  out[lane] = s;
}

// Correct: a SIMD-group sum every lane reaches.
kernel void uniform_simd(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]],
                         uint sg [[simdgroup_index_in_threadgroup]]) {
  const float s = simd_sum(float(lane));
  const bool any = simd_any(lane == 7u);
  if (lane == 0) out[sg] = any ? s : -1.0f;
}

// BUG: reads one element past the end of `in` (n elements) in the last thread.
kernel void read_past_end(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],
                          constant uint& n [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  if (gid < n) out[gid] = in[gid + 1];
}

// BUG: reads one element before the start of `in` in thread 0.
kernel void read_before_start(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],
                              constant uint& n [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  if (gid < n) out[gid] = in[int(gid) - 1];
}

// BUG: a negative index scaled by a row size (a padding entry used as a row index) lands far away
// from every buffer, not on a guard page.
kernel void wild_read(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],
                      device const int* rows [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  out[gid] = in[long(rows[gid]) * 4096 + gid];
}

// BUG: writes one element past the end of `out`.
kernel void write_past_end(device float* out [[buffer(0)]], constant uint& n [[buffer(1)]],
                           uint gid [[thread_position_in_grid]]) {
  if (gid <= n) out[gid] = 1.0f;
}

// BUG: threadgroup array indexed out of bounds.
kernel void tg_out_of_bounds(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float tmp[32];
  tmp[lid] = float(lid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = tmp[lid];
}

// Conversions the hebrus kernels rely on: float -> half / bfloat (round to nearest even) and back.
kernel void convert_float(device const float* in [[buffer(0)]], device half* h [[buffer(1)]],
                          device bfloat* b [[buffer(2)]], device float* back [[buffer(3)]],
                          uint gid [[thread_position_in_grid]]) {
  h[gid] = static_cast<half>(in[gid]);
  b[gid] = static_cast<bfloat>(in[gid]);
  back[gid] = static_cast<float>(b[gid]);
}

// Builtins of a dispatchThreads launch with a partial last threadgroup.
kernel void builtins(device uint* out [[buffer(0)]], uint gid [[thread_position_in_grid]],
                     uint lid [[thread_position_in_threadgroup]], uint tgsize [[threads_per_threadgroup]],
                     uint tg [[threadgroup_position_in_grid]], uint lane [[thread_index_in_simdgroup]],
                     uint sg [[simdgroup_index_in_threadgroup]]) {
  out[gid * 6 + 0] = gid;
  out[gid * 6 + 1] = lid;
  out[gid * 6 + 2] = tgsize;
  out[gid * 6 + 3] = tg;
  out[gid * 6 + 4] = lane;
  out[gid * 6 + 5] = sg;
}

// Strict clang check cases (compiled with -DCASE=n by the tests; CASE 0 is valid MSL).
inline void set_device(device float* p) { p[0] = 1.0f; }
kernel void address_spaces(device float* out [[buffer(0)]], constant float* c [[buffer(1)]],
                           device atomic_uint* flag [[buffer(2)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[32];
  threadgroup atomic_uint tflag;
  t[lid] = c[0];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  set_device(out);
  atomic_fetch_min_explicit(flag, lid, memory_order_relaxed);
  atomic_fetch_min_explicit(&tflag, lid, memory_order_relaxed);
  out[lid] = t[lid];
#if CASE == 1
  set_device(t);  // threadgroup pointer passed as a device pointer
#elif CASE == 2
  c[0] = 1.0f;  // write through the constant address space
#elif CASE == 3
  set_device(c);  // constant pointer passed as a device pointer
#elif CASE == 4
  device atomic_uint* wrong = &tflag;  // threadgroup atomic used as a device atomic
  (void)wrong;
#endif
}

// tg_reverse with a barrier that orders execution but publishes no threadgroup memory: Metal makes
// threadgroup stores visible to other threads only at a barrier whose flags include mem_threadgroup.
kernel void tg_reverse_no_mem_flag(device float* data [[buffer(0)]], uint lid [[thread_position_in_threadgroup]],
                                   uint gid [[threadgroup_position_in_grid]]) {
  threadgroup float tmp[64];
  tmp[lid] = data[gid * 64 + lid];
  threadgroup_barrier(mem_flags::mem_none);
  data[gid * 64 + lid] = tmp[63 - lid];
}

// Thread 0 writes device memory that thread 1 reads after a barrier; only mem_device publishes it.
kernel void device_publish(device float* data [[buffer(0)]], constant uint& with_device_flag [[buffer(1)]],
                           uint lid [[thread_position_in_threadgroup]]) {
  if (lid == 0) data[0] = 42.0f;
  if (with_device_flag != 0u) {
    threadgroup_barrier(mem_flags::mem_device);
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (lid == 1) data[1] = data[0];
}

// A SIMD-group sum compared bitwise with the sum in lane order: true only on a GPU that happens to
// add in lane order; the emulator's reduction tree is random (simd_seed).
kernel void simd_order_assumed(device const float* in [[buffer(0)]], device uint* same [[buffer(1)]],
                               uint lane [[thread_index_in_simdgroup]]) {
  const float v = in[lane];
  const float s = simd_sum(v);
  float seq = 0.0f;
  for (ushort l = 0; l < 32; ++l) {
    seq += simd_shuffle(v, l);
  }
  if (lane == 0) same[0] = s == seq ? 1u : 0u;
}

// ---- simdgroup_matrix --------------------------------------------------------------------------------

// Correct: C[16, 16] = A[16, 16] B[16, 16] (or A B^T with transpose_b) in 8x8 tiles, one SIMD-group. A
// is read from device memory through matrix_origin, B staged through threadgroup memory and read
// through pointer offsets; C stored to device memory.
kernel void mat_gemm16(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                       device float* c [[buffer(2)]], constant uint& transpose_b [[buffer(3)]],
                       uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float bt[256];
  for (uint i = lane; i < 256; i += 32) bt[i] = b[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  threadgroup const float* bp = bt;
  for (uint ti = 0; ti < 2; ++ti) {
    for (uint tj = 0; tj < 2; ++tj) {
      simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (uint tk = 0; tk < 2; ++tk) {
        simdgroup_float8x8 x, y;
        simdgroup_load(x, a, 16, ulong2(tk * 8, ti * 8));
        if (transpose_b != 0u) {
          simdgroup_load(y, bp + tj * 8 * 16 + tk * 8, 16, ulong2(0, 0), true);
        } else {
          simdgroup_load(y, bp + tk * 8 * 16 + tj * 8, 16);
        }
        simdgroup_multiply_accumulate(acc, x, y, acc);
      }
      simdgroup_store(acc, c + ti * 8 * 16 + tj * 8, 16);
    }
  }
}

// Correct: D = A B (no accumulator) in half, stored through thread_elements() read back.
kernel void mat_half(device const half* a [[buffer(0)]], device const half* b [[buffer(1)]],
                     device half* d [[buffer(2)]], device half* elems [[buffer(3)]],
                     uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_half8x8 x, y, z;
  simdgroup_load(x, a);
  simdgroup_load(y, b);
  simdgroup_multiply(z, x, y);
  simdgroup_store(z, d);
  elems[lane * 2] = z.thread_elements()[0];
  elems[lane * 2 + 1] = z.thread_elements()[1];
}

// BUG: a multiply-accumulate that only half of the lanes reach.
kernel void mat_divergent(device const float* a [[buffer(0)]], device float* c [[buffer(1)]],
                          uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 x, acc = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
  simdgroup_load(x, a);
  if (lane < 16) simdgroup_multiply_accumulate(acc, x, x, acc);
  simdgroup_store(acc, c);
}

// BUG: an 8x8 tile read from a buffer of rows * 8 floats at row `row0`: past the end when row0 > rows - 8.
kernel void mat_load_oob(device const float* a [[buffer(0)]], device float* c [[buffer(1)]],
                         constant uint& row0 [[buffer(2)]]) {
  simdgroup_float8x8 x;
  simdgroup_load(x, a + row0 * 8);
  simdgroup_store(x, c);
}

// BUG: an 8x8 tile read from threadgroup memory one row past a 64-float array.
kernel void mat_tg_oob(device float* c [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float t[64];
  t[lane] = 1.0f;
  t[lane + 32] = 2.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  threadgroup const float* tp = t;
  simdgroup_float8x8 x;
  simdgroup_load(x, tp + 8);
  simdgroup_store(x, c);
}

// BUG: a tile pointer that differs between lanes (must be uniform over the SIMD-group).
kernel void mat_nonuniform(device const float* a [[buffer(0)]], device float* c [[buffer(1)]],
                           uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 x;
  simdgroup_load(x, a + (lane / 16) * 8);
  simdgroup_store(x, c);
}

// A tile product compared bitwise with the products summed in index order: true only on hardware
// that adds in that order; the emulator's tree is random (simd_seed).
kernel void mat_order_assumed(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                              device uint* same [[buffer(2)]], uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 x, y, z;
  simdgroup_load(x, a);
  simdgroup_load(y, b);
  simdgroup_multiply(z, x, y);
  threadgroup float t[64];
  threadgroup float* tp = t;
  simdgroup_store(z, tp);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lane == 0) {
    uint ok = 1u;
    for (uint i = 0; i < 8; ++i) {
      for (uint j = 0; j < 8; ++j) {
        float s = a[i * 8] * b[j];
        for (uint k = 1; k < 8; ++k) s = s + a[i * 8 + k] * b[k * 8 + j];
        ok = ok & (s == t[i * 8 + j] ? 1u : 0u);
      }
    }
    same[0] = ok;
  }
}

// BUG: never terminates for an odd n (i steps over it); every iteration stores, so no compiler may drop
// the loop. The emulator's watchdog must stop it and name the kernel.
kernel void spin_forever(device uint* data [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  const uint n = data[0];
  for (uint i = 0; i != n; i += 2) {
    data[1 + gid] = i;
  }
}

// BUG: threads wait at a barrier in a loop whose exit no thread ever takes (the loop's bound is read
// back from threadgroup memory that every thread resets): the watchdog stops it between barriers too.
kernel void barrier_forever(device uint* data [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup uint stop[1];
  for (;;) {
    if (lid == 0) {
      stop[0] = data[0];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (stop[0] != 0) {
      break;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}
