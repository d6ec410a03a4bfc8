#pragma once
// Parameter blocks of the hebrus Metal kernels, shared by the kernels (mps_kernels/*.metal), the
// Objective-C++ glue (csrc/mps/*.mm) and the Linux emulator (tests/metal). Each is bound with
// setBytes as `constant <Name>& p [[buffer(i)]]`. Fixed-width fields only: sizes, strides and
// offsets are 64-bit element counts; the layout is identical on the host and on the GPU (every
// struct is a multiple of 8 bytes, 64-bit fields first). Keep the file ASCII: the glue embeds it in
// the Metal source string, which PyTorch hands to Metal as an ASCII NSString.

// Size limits of the native kernels: the one place they are written for C++ and Metal (the CPU
// kernels size per-thread scratch by them, the Metal kernels their threadgroup memory and variants).
// hebrus_torch/_limits.py states them for Python (the drop-in falls back past them); a test reads
// this file and checks the two agree.
#define HEBRUS_CPU_MAX_HEAD_DIM 256      // qsa_pool, qsa_select: D
#define HEBRUS_CPU_MAX_QUERY_HEADS 64    // qsa_select: Hq
#define HEBRUS_CPU_MAX_TOP_K 4096        // qsa_select: top_k
#define HEBRUS_MPS_MAX_KEEP 2048         // qsa_select: min(top_k, maxG), the k2048 variant's capacity
#define HEBRUS_MPS_ATTN_MAX_DIM 256      // qsa_attention: max(Dh, Dv), the d256 variants

#ifdef __METAL_VERSION__
typedef long hebrus_i64;
typedef int hebrus_i32;
#else
#include <cstdint>
typedef int64_t hebrus_i64;
typedef int32_t hebrus_i32;
#endif

// hebrus::ple_conv. Threads: (tokens + batch) items x channel_vecs; an item < tokens computes one
// token's outputs, an item >= tokens copies one row's new state (and checks its cu_seqlens).
struct PleConvParams {
  hebrus_i64 tokens;        // T
  hebrus_i64 channels;      // C
  hebrus_i64 width;         // K
  hebrus_i64 dilation;      // d
  hebrus_i64 state_len;     // L = (K - 1) * d
  hebrus_i64 batch;         // B
  hebrus_i64 channel_vecs;  // ceil(C / HEBRUS_PLE_CONV_VEC)
  hebrus_i32 silu;          // 1: SiLU, 0: no activation
  hebrus_i32 pad0;
};

// hebrus::ple_ngram_ids. Threads: tokens + batch items (token threads, then one thread per row).
struct PleNgramParams {
  hebrus_i64 tokens;           // T
  hebrus_i64 batch;            // B
  hebrus_i64 ngram;            // N
  hebrus_i64 heads;            // (N - 1) * H
  hebrus_i64 heads_per_order;  // H
  hebrus_i64 eos;              // E
  hebrus_i64 vocab;            // ids must lie in [0, vocab)
};

// hebrus::qsa_pool. Threads: groups x 32, one SIMD-group per pooled group.
struct QsaPoolParams {
  hebrus_i64 cells;       // rows of keys / entries of cell_pos
  hebrus_i64 dim;         // D
  hebrus_i64 groups;      // G
  hebrus_i64 group_size;  // r
  hebrus_i64 rot_half;    // R / 2 = inv_freq entries
  float eps;
  hebrus_i32 pad0;
};

// hebrus::qsa_select. Threads: blocks x HEBRUS_QSA_SELECT_TG, one threadgroup per block of
// consecutive queries; within a block the sequences present are handled one after the other.
struct QsaSelectParams {
  hebrus_i64 queries;      // Tq
  hebrus_i64 query_heads;  // Hq
  hebrus_i64 dim;          // D
  hebrus_i64 rows;         // rows of pooled
  hebrus_i64 batch;        // rows of seq_groups
  hebrus_i64 max_groups;   // columns of seq_groups
  hebrus_i64 top_k;        // columns of the output
  float sqrt_dim;          // (float) sqrt((double) D), as Python's math.sqrt rounds it
  hebrus_i32 pad0;
};

// hebrus::qsa_attention. Threads: queries x kv_heads threadgroups of HEBRUS_QSA_ATTN_TG, one per
// (query, KV head); the kernel variant's HB query heads of the KV head share one pass over the cells.
// q, token_cells and out are contiguous; k and v are read through element strides of their first
// two dims (their last dim is contiguous), so a view of a cache row such as [Hkv, cells, D]
// transposed to [cells, Hkv, D] is read in place: k[c, g, d] = k[c * k_stride0 + g * k_stride1 + d].
struct QsaAttentionParams {
  hebrus_i64 queries;      // Tq
  hebrus_i64 query_heads;  // Hq
  hebrus_i64 kv_heads;     // Hkv
  hebrus_i64 rep;          // Hq / Hkv query heads per KV head
  hebrus_i64 head_dim;     // Dh (q, k)
  hebrus_i64 value_dim;    // Dv (v, out)
  hebrus_i64 cells;        // rows of k and v
  hebrus_i64 width;        // W, columns of token_cells
  hebrus_i64 k_stride0;    // elements between k[c, g] and k[c + 1, g]
  hebrus_i64 k_stride1;    // elements between k[c, g] and k[c, g + 1]
  hebrus_i64 v_stride0;    // elements between v[c, g] and v[c + 1, g]
  hebrus_i64 v_stride1;    // elements between v[c, g] and v[c, g + 1]
  float scale;             // softmax scale as fp32 (the reference multiplies fp32 scores by it)
  hebrus_i32 pad0;
};

// Error slots: every kernel takes `device atomic_uint* err [[buffer(...)]]` with HEBRUS_ERR_SLOTS
// entries that the glue fills with HEBRUS_ERR_NONE; a thread that finds bad input stores the
// smallest offending index of its kind with atomic_fetch_min (the result does not depend on the
// order threads run in). The glue reads the slots back after the command buffer completes and
// raises; it publishes no output when any slot is set.
#define HEBRUS_ERR_SLOTS 4
#define HEBRUS_ERR_NONE 0xFFFFFFFFu

// ple_conv
#define HEBRUS_ERR_CONV_CU_ROW 0        // first row b whose cu_seqlens entries are invalid
// ple_ngram_ids
#define HEBRUS_ERR_NGRAM_CU_ROW 0       // first row b whose cu_seqlens entries are invalid
#define HEBRUS_ERR_NGRAM_TOKEN 1        // first token index t with tokens[t] outside [0, vocab)
#define HEBRUS_ERR_NGRAM_HISTORY 2      // first flat index b * (N-1) + j with history outside [0, vocab)
#define HEBRUS_ERR_NGRAM_VOCAB_SIZE 3   // first head h with vocab_sizes[h] <= 0
// qsa_pool
#define HEBRUS_ERR_POOL_CELL 0          // first flat index g * r + i with group_cells outside [0, cells)
#define HEBRUS_ERR_POOL_HOLE 1          // first flat index g * r + i whose position breaks the run
// qsa_select
#define HEBRUS_ERR_SELECT_ROW 0         // first query with q_row outside [0, B)
#define HEBRUS_ERR_SELECT_GROUPS 1      // first query with q_groups outside [0, maxG]
#define HEBRUS_ERR_SELECT_SEQ_GROUPS 2  // first row b with a visible seq_groups entry outside [0, rows)
// qsa_attention
#define HEBRUS_ERR_ATTN_CELL 0          // first flat index t * W + i with token_cells[t, i] >= cells
#define HEBRUS_ERR_ATTN_EMPTY 1         // first query t with no entry >= 0 in token_cells[t]
