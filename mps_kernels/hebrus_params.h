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
#define HEBRUS_MPS_GDN_MAX_KEY_DIM 256   // gdn_delta_rule(_slots): Dk, the k256 variants (Dv: any)
#define HEBRUS_MPS_GDN_CHUNK_MAX_KEY_DIM 128   // gdn_chunk_delta_rule_slots: Dk (state tiles in registers)

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

// hebrus::ple_conv_slots: ple_conv whose row b reads and updates state_pool[slots[b]] in place.
// Threads: (tokens + batch) items x channel_vecs, as ple_conv. A token item whose conv reaches into
// the carried tail (position in its row < state_len) is left to its row's item, which computes those
// outputs from the old tail and then shifts the tail in place: the only thread that reads or writes
// the pool's columns [c0, c0 + 4) of that slot, so no thread reads another thread's pool store.
struct PleConvSlotsParams {
  hebrus_i64 tokens;        // T
  hebrus_i64 channels;      // C
  hebrus_i64 width;         // K
  hebrus_i64 dilation;      // d
  hebrus_i64 state_len;     // L = (K - 1) * d
  hebrus_i64 batch;         // B
  hebrus_i64 channel_vecs;  // ceil(C / HEBRUS_PLE_CONV_VEC)
  hebrus_i64 pool;          // S: slots must lie in [0, S) and be distinct
  hebrus_i32 silu;          // 1: SiLU, 0: no activation
  hebrus_i32 pad0;
};

// hebrus::ple_ngram_ids_slots: ple_ngram_ids whose row b reads and updates history_pool[slots[b]] in
// place. Threads: tokens + batch items; a token whose n-gram reaches into the history (position in
// its row < N - 1) is left to its row's thread, which computes its ids from the old history first.
struct PleNgramSlotsParams {
  hebrus_i64 tokens;           // T
  hebrus_i64 batch;            // B
  hebrus_i64 ngram;            // N
  hebrus_i64 heads;            // (N - 1) * H
  hebrus_i64 heads_per_order;  // H
  hebrus_i64 eos;              // E
  hebrus_i64 vocab;            // ids must lie in [0, vocab)
  hebrus_i64 pool;             // S: slots must lie in [0, S) and be distinct
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

// hebrus::qsa_token_cells (issue 37). Threads: Tq x 32, one SIMD-group per query.
struct QsaTokenCellsParams {
  hebrus_i64 queries;     // Tq
  hebrus_i64 top_k;       // columns of selected
  hebrus_i64 group_size;  // r
  hebrus_i64 width;       // W = top_k * r + r - 1, columns of the outputs
  hebrus_i64 cells;       // N, entries of cells
};

// hebrus::rms_norm_rope (issue 37). Threads: T * H SIMD-groups of 32, one per (token, head). x is read
// through element strides of its first two dims (its last dim contiguous); cos, sin and out are contiguous.
struct RmsNormRopeParams {
  hebrus_i64 tokens;     // T
  hebrus_i64 heads;      // H
  hebrus_i64 dim;        // D
  hebrus_i64 rot;        // R, rotary dims (even, <= D)
  hebrus_i64 x_stride0;  // elements between x[t, h] and x[t + 1, h]
  hebrus_i64 x_stride1;  // elements between x[t, h] and x[t, h + 1]
  float eps;
  hebrus_i32 pad0;
};

// hebrus::sigmoid_gate (issue 37). Threads: T * H * D, one per element. gate is read through element strides
// of its first two dims (its last dim contiguous); x and out are contiguous.
struct SigmoidGateParams {
  hebrus_i64 elements;   // T * H * D
  hebrus_i64 heads;      // H
  hebrus_i64 dim;        // D
  hebrus_i64 g_stride0;  // elements between gate[t, h] and gate[t + 1, h]
  hebrus_i64 g_stride1;  // elements between gate[t, h] and gate[t, h + 1]
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

// hebrus::gdn_delta_rule and hebrus::gdn_delta_rule_slots. Threads: (B * Hv * col_blocks)
// threadgroups of HEBRUS_GDN_TG, one per (row, value head, block of HEBRUS_GDN_TG_COLS value columns);
// the slot form reads and writes row b's state at state_pool[slots[b]]. q, k, v, g, beta, cu_seqlens,
// slots, state and out are contiguous (g and beta fp32).
struct GdnDeltaRuleParams {
  hebrus_i64 tokens;       // T
  hebrus_i64 batch;        // B
  hebrus_i64 key_heads;    // Hk
  hebrus_i64 value_heads;  // Hv
  hebrus_i64 rep;          // Hv / Hk: value head h reads key head h / rep
  hebrus_i64 key_dim;      // Dk
  hebrus_i64 value_dim;    // Dv
  hebrus_i64 col_blocks;   // ceil(Dv / HEBRUS_GDN_TG_COLS)
  hebrus_i64 pool;         // S: slots must lie in [0, S) and be distinct (the slot form; B otherwise)
  float scale;             // q's scale as fp32 (the CPU kernel narrows the double the same way)
  hebrus_i32 l2;           // 1: l2-normalise q and k over Dk
};

// Value errors found by a kernel go to PyTorch's MPS error buffer (the stream's
// c10::metal::ErrorMessages, bound with MetalKernelFunction::setErrorBufferIndex): the kernel writes
// a message naming the op, the offending index and its value (hebrus_report_error in
// hebrus_metal_common.h, what c10/metal/error.h's TORCH_REPORT_ERROR does) and writes nothing for the
// faulty work; the stream raises the first message (torch.AcceleratorError) at its next
// synchronization. No op reads anything back. HebrusErrorMessages is that buffer's layout (the glue
// static_asserts it equals c10::metal::ErrorMessages).
#define HEBRUS_ERROR_MESSAGE_COUNT 30
#ifdef __METAL_VERSION__
typedef metal::atomic_uint hebrus_error_count;
#else
typedef uint32_t hebrus_error_count;
#endif
struct HebrusErrorMessage {
  char file[128];
  char func[128];
  char message[250];
  unsigned int line;
};
struct HebrusErrorMessages {
  hebrus_error_count count;
  HebrusErrorMessage msg[HEBRUS_ERROR_MESSAGE_COUNT];
};

// The value checks that run where the op itself launches no thread that would look (B == 0, C == 0
// for ple_conv; Hq == 0, Dv == 0 or no cells for qsa_attention): one thread per row / query.
struct HebrusCheckParams {
  hebrus_i64 tokens;  // T (cu_seqlens checks) / cells (token_cells checks)
  hebrus_i64 rows;    // B (cu_seqlens has B + 1 entries) / Tq
  hebrus_i64 width;   // W (token_cells); 0 for cu_seqlens
};

// The checks of the slot ops where their launch has no thread that would look (B == 0, C == 0 for
// ple_conv_slots): one thread per row checks its cu_seqlens entries and its slot (range, duplicates);
// ple_ngram_ids_slots' thread 0 also checks the heads vocab sizes.
struct HebrusSlotsCheckParams {
  hebrus_i64 tokens;  // T
  hebrus_i64 rows;    // B (cu_seqlens has B + 1 entries, slots B)
  hebrus_i64 pool;    // S
  hebrus_i64 heads;   // entries of vocab_sizes (ple_ngram_ids_slots), 0 for ple_conv_slots
};

// hebrus::gdn_chunk_delta_rule_slots. Threads: batch x value_heads x dv_blocks threadgroups of
// HEBRUS_GDN_CHUNK_TG, one per (row, value head, block of HEBRUS_GDN_CHUNK_DVB value columns); each
// runs its row's pieces in order (whole aligned chunks of 64 in the chunked form with simdgroup 8x8
// tiles, partial chunks in the recurrent form) with its block of the state on chip.
struct GdnChunkParams {
  hebrus_i64 tokens;       // T
  hebrus_i64 batch;        // B
  hebrus_i64 key_heads;    // Hk
  hebrus_i64 value_heads;  // Hv (a multiple of Hk)
  hebrus_i64 key_dim;      // Dk <= HEBRUS_GDN_CHUNK_MAX_DK
  hebrus_i64 value_dim;    // Dv
  hebrus_i64 dv_blocks;    // ceil(Dv / HEBRUS_GDN_CHUNK_DVB)
  hebrus_i64 pool;         // S: slots must lie in [0, S) and be distinct
  float scale;             // q scale
  hebrus_i32 l2norm;       // 1: q, k l2-normalised first
};


// hebrus::moe_experts and hebrus::moe_experts_quantized. Decode: three launches (hebrus_launch.h): act (half a SIMD-group per (pair,
// intermediate output)), down (half a SIMD-group per (pair, hidden output)), sum (one thread per output element). Grouped (prefill):
// route, then act and down over (tile of one expert's pairs, block of outputs), then the same sum.
// A pair is p = t * top_k + j, in [0, pairs = rows * top_k).
struct MoeExpertsParams {
  hebrus_i64 rows;           // T
  hebrus_i64 hidden;         // H
  hebrus_i64 top_k;          // k
  hebrus_i64 experts;        // E: ids must lie in [0, E)
  hebrus_i64 inter;          // I
  hebrus_i64 pairs;          // T * k
  hebrus_i64 group_size;     // moe_experts_quantized: values per scale and bias (0 for moe_experts)
  hebrus_i64 max_tiles;      // grouped path: the tiles the launches cover (0 on the decode path)
  hebrus_i32 round_product;  // 1: the weighted output is rounded to x's dtype (topk_weights has it)
  hebrus_i32 pad0;
};

// hebrus::quantized_linear (moe_experts_quantized.metal): one launch, half a SIMD-group per (row, output).
struct QuantLinearParams {
  hebrus_i64 rows;        // T
  hebrus_i64 in;          // input features (a multiple of group_size)
  hebrus_i64 out;         // output features
  hebrus_i64 group_size;  // values per scale and bias
};

// hebrus::hc_rms_norm (issue 37). Threads: rows * (D / group) SIMD-groups of 32, one per (row, group).
struct HcRmsNormParams {
  hebrus_i64 rows;    // T
  hebrus_i64 dim;     // D
  hebrus_i64 group;   // features per group (divides D)
  float eps;
  hebrus_i32 pad0;
};

// hebrus::gdn_gates and hebrus::gdn_gated_rms_norm (issue 37, gdn_fused.metal). A [D] parameter vector
// (A_log, dt_bias, the norm's weight) is read in its own dtype: 0 float32, 1 float16, 2 bfloat16.
// gdn_gates threads: one per (row, head); gdn_gated_rms_norm: one SIMD-group of 32 per row.
struct GdnGatesParams {
  hebrus_i64 rows;           // numel(a) / Hv
  hebrus_i64 heads;          // Hv
  hebrus_i32 a_log_dtype;
  hebrus_i32 dt_bias_dtype;
};

struct GdnGatedNormParams {
  hebrus_i64 rows;           // numel(x) / D
  hebrus_i64 dim;            // D
  float eps;
  hebrus_i32 weight_dtype;
  hebrus_i32 round_product;  // 1: weight * norm is rounded to x's dtype (the module's promoted dtype is x's)
  hebrus_i32 sigmoid;        // 1: act = sigmoid, 0: silu
};

// hebrus::hc_premix and hebrus::hc_premix_quantized (issue 37). Two launches (hc_premix.metal): low, one SIMD-group per (row, output o)
// for o in [0, rank + injects); mix, one thread per (row, feature k of a stream).
struct HcPremixParams {
  hebrus_i64 rows;     // T
  hebrus_i64 hidden;   // features per stream
  hebrus_i64 hc;       // streams
  hebrus_i64 rank;     // R (down's rows)
  hebrus_i64 injects;  // hc with block_inject_weight, 0 without
  float eps;
  hebrus_i32 group_size;  // hc_premix_quantized: the projections' group size (32, 64 or 128); 0 for hc_premix
};

// hebrus::hc_post_combine (issue 37). Threads: rows * hc * hidden, one per output feature.
struct HcPostCombineParams {
  hebrus_i64 rows;    // T
  hebrus_i64 hidden;  // features per stream
  hebrus_i64 hc;      // streams
};

// hebrus::moe_route (issue 37). Threads: rows SIMD-groups of 32, one per row of router_logits.
struct MoeRouteParams {
  hebrus_i64 rows;     // T
  hebrus_i64 experts;  // E
  hebrus_i64 top_k;    // k (<= HEBRUS_MOE_ROUTE_MAX_K)
  hebrus_i64 shared;   // S: sigmoid-gated shared-expert logits per row (0: none)
  hebrus_i32 norm;     // 1: the top-k probabilities are renormalised to sum to 1
  hebrus_i32 pad0;
};

// hebrus::moe_shared_expert and moe_shared_expert_quantized (issue 37). Threads: half SIMD-groups
// (HEBRUS_MOE_LANES lanes), one per (row, intermediate output) in the act launch and one per (row, hidden
// output) in the down launch.
struct MoeSharedParams {
  hebrus_i64 rows;         // T
  hebrus_i64 hidden;       // H
  hebrus_i64 inter;        // I
  hebrus_i64 gate_stride;  // elements between the gates of consecutive rows
  hebrus_i64 group_size;   // the quantized projections' group size (0: dense projections)
};
