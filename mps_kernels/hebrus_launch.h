#pragma once
// Launch geometry of the hebrus Metal kernels: the one place that fixes how many threads run, how
// they are grouped and which kernel variant runs. The kernels read the compile-time sizes (macros
// below); on the host, the plan_* functions turn tensor sizes into the parameter block and the
// dispatch. The glue (csrc/mps/hebrus_glue.h, called by the .mm files and, on Linux, by the
// emulator through tests/metal/glue_abi.cpp) calls these functions, so the emulator runs exactly
// the grid the GPU runs.
//
// Every dispatch is MetalKernelFunction::dispatch(threads, group), i.e. dispatchThreads with
// threadgroups of `group` threads; a partial last threadgroup is allowed only for kernels without
// barriers (ple_conv, ple_ngram_ids and their slot forms) or whose partial group still holds whole
// SIMD-groups (qsa_pool); qsa_select and qsa_attention launch whole threadgroups only.
#include "hebrus_params.h"

#define HEBRUS_SIMD_WIDTH 32
// Threadgroup memory of every Apple GPU family the kernels target (the emulator refuses more).
#define HEBRUS_MAX_THREADGROUP_MEMORY 32768

// ple_conv: one thread per (token, channel vector) plus one per (row, channel vector).
#define HEBRUS_PLE_CONV_TG 256
#define HEBRUS_PLE_CONV_VEC 4
// ple_ngram_ids: one thread per token plus one per row.
#define HEBRUS_PLE_NGRAM_TG 256
// qsa_pool: one SIMD-group per group, 8 groups per threadgroup.
#define HEBRUS_QSA_POOL_TG 256
// hc_rms_norm (issue 37): one SIMD-group per (row, group), 8 per threadgroup.
#define HEBRUS_HC_NORM_TG 256
// gdn_gates (issue 37): one thread per (row, value head); gdn_gated_rms_norm: one SIMD-group per row,
// 8 per threadgroup.
#define HEBRUS_GDN_GATES_TG 256
#define HEBRUS_GDN_NORM_TG 256
// hc_premix (issue 37): low, one SIMD-group per (row, low-rank or inject output), 8 per threadgroup;
// mix, one thread per (row, feature of a stream), 256 per threadgroup. hc_post_combine: one thread per
// output feature, 256 per threadgroup.
#define HEBRUS_HC_PREMIX_TG 256
#define HEBRUS_HC_COMBINE_TG 256
// qsa_token_cells (issue 37): one SIMD-group per query, 8 queries per threadgroup.
#define HEBRUS_QSA_TOKEN_CELLS_TG 256
// rms_norm_rope (issue 37): one SIMD-group per (token, head), 8 per threadgroup.
#define HEBRUS_NORM_ROPE_TG 256
// sigmoid_gate (issue 37): one thread per element.
#define HEBRUS_SIGMOID_GATE_TG 256
// moe_route (issue 37): one SIMD-group per row, 8 per threadgroup; a row's top-k values stay in
// registers, so k is bounded.
#define HEBRUS_MOE_ROUTE_TG 256
#define HEBRUS_MOE_ROUTE_MAX_K 64
// qsa_select: one threadgroup per block of queries; the pooled keys of a sequence are streamed in
// tiles of HEBRUS_QSA_SELECT_TILE groups (one per thread). Two variants trade queries per block for
// the per-query top-k capacity; both stay under Apple GPUs' 32 KiB of threadgroup memory:
//   k512:  4 queries x 512 keys  x 8 B + 4 x 256 x 8 B = 24 KiB
//   k2048: 1 query   x 2048 keys x 8 B + 1 x 256 x 8 B = 18 KiB
#define HEBRUS_QSA_SELECT_TG 256
#define HEBRUS_QSA_SELECT_TILE 256
#define HEBRUS_QSA_SELECT_K512_QB 4
#define HEBRUS_QSA_SELECT_K512_KMAX 512
#define HEBRUS_QSA_SELECT_K2048_QB 1
#define HEBRUS_QSA_SELECT_K2048_KMAX HEBRUS_MPS_MAX_KEEP
// qsa_attention: one threadgroup of 8 SIMD-groups per (query, KV head); SIMD-group s takes the
// entries s, s + 8, s + 16, ... of the query's token_cells row, lanes split the head dims
// (d = lane + 32 i). Variants "h<HB>_d<DMAX>": HB query heads of the KV head per pass over the cells
// (1, 2, 4 or 8: rep = Hq / Hkv rounded up to a power of two, at most 8; larger rep takes several
// passes), DMAX = 32 * DPL >= max(Dh, Dv) with DPL dims per lane (64, 128 or 256). Threadgroup
// memory at h8_d256: q 8 x 256 x 4 B + partial accumulators 8 x 256 x 4 B + 8 x 8 x 8 B = 16.5 KiB.
#define HEBRUS_QSA_ATTN_TG 256
#define HEBRUS_QSA_ATTN_MAX_HB 8
#define HEBRUS_QSA_ATTN_MAX_DIM HEBRUS_MPS_ATTN_MAX_DIM
// gdn_delta_rule(_slots): one threadgroup of 4 SIMD-groups per (row, value head, block of 16 value
// columns); SIMD-group s owns 4 columns, lane l the key dims l + 32 m (m < DKPL) of each, so the
// lane keeps DKPL x 4 fp32 state entries in registers. Variants "k<DKMAX>", DKMAX = 32 * DKPL in
// {32, 64, 128, 256} >= Dk. Tokens are staged HEBRUS_GDN_TILE at a time in threadgroup memory:
// q and k tiles 2 x 8 x DKMAX x 4 B (16 KiB at k256) + 2 x 8 x 4 B.
#define HEBRUS_GDN_SIMD_GROUPS 4
#define HEBRUS_GDN_COLS 4
#define HEBRUS_GDN_TG 128       // SIMD_GROUPS * SIMD_WIDTH, a literal for max_total_threads_per_threadgroup
#define HEBRUS_GDN_TG_COLS 16   // HEBRUS_GDN_SIMD_GROUPS * HEBRUS_GDN_COLS
#define HEBRUS_GDN_TILE 8

// gdn_chunk_delta_rule_slots: one threadgroup of 4 SIMD-groups per (row, value head, block of 32 value
// columns); SIMD-group s owns columns [8s, 8s + 8) of the block. Whole chunks of 64 tokens run the
// chunked (WY) form in 8x8 simdgroup tiles, Dk <= 128 in tiles of 8 (zero padded). Threadgroup
// memory: the chunk's 64 x 64 matrix (L, then A; the state block [128, 32] between chunks) 16 KiB,
// a [64, 32] block (V'; the K and Q slabs [64, 16] while they stream) 8 KiB, the inverted 8x8
// diagonal blocks of I + L 2 KiB, gates and norms 1 KiB: 27 KiB.
#define HEBRUS_GDN_CHUNK 64
#define HEBRUS_GDN_CHUNK_TG 128
#define HEBRUS_GDN_CHUNK_DVB 32
#define HEBRUS_GDN_CHUNK_MAX_DK HEBRUS_MPS_GDN_CHUNK_MAX_KEY_DIM
#define HEBRUS_GDN_CHUNK_SLAB 16

// moe_experts: a dot product is summed by half a SIMD-group (HEBRUS_MOE_LANES lanes, lane l over the
// inputs d = l mod 16 in ascending d, then the pairwise tree of the CPU kernels' reduce_lanes), so the
// GPU sums in the CPU kernel's order; every thread of a launch reaches the shuffles (the grid is a
// whole number of SIMD-groups; items past the end compute nothing and write nothing).
#define HEBRUS_MOE_TG 256
#define HEBRUS_MOE_LANES 16
#define HEBRUS_MOE_SUM_TG 256
// The grouped (prefill) path: moe_experts_route (one threadgroup of HEBRUS_MOE_ROUTE_TG threads) lists
// the pairs of each expert in ascending pair order and cuts the lists into tiles of at most
// HEBRUS_MOE_TILE_ROWS pairs; the grouped act / down launches run one threadgroup of HEBRUS_MOE_TG
// threads per (tile, block of HEBRUS_MOE_TILE_COLS outputs), staging HEBRUS_MOE_TILE_K inputs of the
// tile's rows and weights at a time in threadgroup memory. The 16 half SIMD-groups of a threadgroup
// are its cells: cell c sums tile row c % 8 against outputs 8 * (c / 8) .. + 8, each dot in the
// decode kernels' lane order. quantized_linear's tiled launch uses the same tiles over plain rows.
#define HEBRUS_MOE_ROUTE_TG 256
#define HEBRUS_MOE_TILE_ROWS 8
#define HEBRUS_MOE_TILE_COLS 16
#define HEBRUS_MOE_CELL_COLS 8
#define HEBRUS_MOE_TILE_K 128

#ifndef __METAL_VERSION__
#include <cmath>
#include <cstdint>
#include <string>

namespace hebrus::metal {

// The layout rule of hebrus_params.h (64-bit fields first, a multiple of 8 bytes), checked on the host.
static_assert(sizeof(PleConvParams) % 8 == 0 && sizeof(PleNgramParams) % 8 == 0, "params size");
static_assert(sizeof(QsaPoolParams) % 8 == 0 && sizeof(QsaSelectParams) % 8 == 0, "params size");
static_assert(sizeof(QsaAttentionParams) == 13 * 8, "QsaAttentionParams: 12 x 64-bit, float, pad");
static_assert(sizeof(QsaTokenCellsParams) == 5 * 8, "QsaTokenCellsParams: 5 x 64-bit");
static_assert(sizeof(RmsNormRopeParams) == 7 * 8, "RmsNormRopeParams: 6 x 64-bit, float, pad");
static_assert(sizeof(SigmoidGateParams) == 5 * 8, "SigmoidGateParams: 5 x 64-bit");
static_assert(sizeof(HebrusCheckParams) == 3 * 8, "HebrusCheckParams");
static_assert(sizeof(PleConvSlotsParams) == 9 * 8 && sizeof(PleNgramSlotsParams) == 8 * 8, "params size");
static_assert(sizeof(HebrusSlotsCheckParams) == 4 * 8, "HebrusSlotsCheckParams");
static_assert(sizeof(GdnDeltaRuleParams) == 10 * 8, "GdnDeltaRuleParams: 9 x 64-bit, float, int");
static_assert(HEBRUS_GDN_TG == HEBRUS_GDN_SIMD_GROUPS * HEBRUS_SIMD_WIDTH, "gdn threadgroup");
static_assert(HEBRUS_GDN_TG_COLS == HEBRUS_GDN_SIMD_GROUPS * HEBRUS_GDN_COLS, "gdn columns per threadgroup");
static_assert(sizeof(MoeExpertsParams) == 9 * 8, "MoeExpertsParams: 8 x 64-bit, 2 x 32-bit");
static_assert(sizeof(QuantLinearParams) == 4 * 8, "QuantLinearParams: 4 x 64-bit");
static_assert(HEBRUS_SIMD_WIDTH % HEBRUS_MOE_LANES == 0 && HEBRUS_MOE_TG % HEBRUS_SIMD_WIDTH == 0, "moe lanes");
static_assert(HEBRUS_MOE_TG == HEBRUS_MOE_LANES * HEBRUS_MOE_TILE_ROWS * (HEBRUS_MOE_TILE_COLS / HEBRUS_MOE_CELL_COLS),
              "moe tiles: one half SIMD-group per (tile row, cell of outputs)");
static_assert(HEBRUS_MOE_TILE_K % 128 == 0 && HEBRUS_MOE_TILE_K % HEBRUS_MOE_LANES == 0,
              "moe tiles: a step of inputs holds whole quantization groups (32, 64, 128)");
static_assert(sizeof(HcRmsNormParams) == 4 * 8, "HcRmsNormParams: 3 x 64-bit, float, pad");
static_assert(sizeof(GdnGatesParams) == 3 * 8, "GdnGatesParams: 2 x 64-bit, 2 x 32-bit");
static_assert(sizeof(GdnGatedNormParams) == 4 * 8, "GdnGatedNormParams: 2 x 64-bit, float, 3 x 32-bit");
static_assert(sizeof(HcPremixParams) == 6 * 8, "HcPremixParams: 5 x 64-bit, float, int32");
static_assert(sizeof(HcPostCombineParams) == 3 * 8, "HcPostCombineParams: 3 x 64-bit");
static_assert(sizeof(MoeRouteParams) == 5 * 8, "MoeRouteParams: 4 x 64-bit, 2 x 32-bit");
static_assert(sizeof(MoeSharedParams) == 5 * 8, "MoeSharedParams: 5 x 64-bit");

// dispatchThreads(threads) in threadgroups of `group` threads; threads == 0 means nothing to launch.
struct Dispatch {
  uint64_t threads = 0;
  uint64_t group = 1;
};

// "<op>_<type>" or "<op>_<variant>_<type>"; the kernels build the same string in
// HEBRUS_INSTANTIATE / HEBRUS_INSTANTIATE_VARIANT (hebrus_metal_common.h).
inline std::string kernel_name(const char* op, const char* variant, const char* type) {
  std::string name(op);
  if (variant != nullptr && variant[0] != '\0') name += std::string("_") + variant;
  return name + "_" + type;
}

constexpr uint64_t kMaxThreads = 0xFFFFFFFFull;  // thread_position_in_grid is a 32-bit uint

inline uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

// What plan_<op>() returns: the kernel's parameter block, its dispatch, and the limit of the Metal
// kernel the launch would exceed (nullptr when it fits).
template <typename Params>
struct LaunchPlan {
  Params params{};
  Dispatch dispatch;
  const char* error = nullptr;
};

using PleConvPlan = LaunchPlan<PleConvParams>;

inline PleConvPlan plan_ple_conv(int64_t tokens, int64_t channels, int64_t width, int64_t batch, int64_t dilation,
                                 bool silu) {
  PleConvPlan plan;
  PleConvParams& p = plan.params;
  p.tokens = tokens;
  p.channels = channels;
  p.width = width;
  p.dilation = dilation;
  p.state_len = (width - 1) * dilation;
  p.batch = batch;
  p.channel_vecs = static_cast<int64_t>(ceil_div(static_cast<uint64_t>(channels), HEBRUS_PLE_CONV_VEC));
  p.silu = silu ? 1 : 0;
  const uint64_t threads = static_cast<uint64_t>(tokens + batch) * static_cast<uint64_t>(p.channel_vecs);
  if (threads > kMaxThreads) plan.error = "more than 2^32-1 threads ((T + B) * ceil(C / 4))";
  plan.dispatch = {channels > 0 ? threads : 0, HEBRUS_PLE_CONV_TG};
  return plan;
}

using PleNgramPlan = LaunchPlan<PleNgramParams>;

inline PleNgramPlan plan_ple_ngram_ids(int64_t tokens, int64_t batch, int64_t ngram, int64_t heads, int64_t eos,
                                       int64_t vocab) {
  PleNgramPlan plan;
  PleNgramParams& p = plan.params;
  p.tokens = tokens;
  p.batch = batch;
  p.ngram = ngram;
  p.heads = heads;
  p.heads_per_order = ngram > 1 ? heads / (ngram - 1) : 0;
  p.eos = eos;
  p.vocab = vocab;
  const uint64_t threads = static_cast<uint64_t>(tokens + batch);
  if (threads > kMaxThreads) plan.error = "more than 2^32-1 threads (T + B)";
  plan.dispatch = {threads, HEBRUS_PLE_NGRAM_TG};
  return plan;
}

// The slot forms run ple_conv's and ple_ngram_ids' grids (the token items whose inputs reach into the
// carried state are computed by their row's item, see hebrus_params.h), with the pool size added.
using PleConvSlotsPlan = LaunchPlan<PleConvSlotsParams>;

inline PleConvSlotsPlan plan_ple_conv_slots(int64_t tokens, int64_t channels, int64_t width, int64_t batch,
                                            int64_t dilation, int64_t pool, bool silu) {
  const PleConvPlan base = plan_ple_conv(tokens, channels, width, batch, dilation, silu);
  PleConvSlotsPlan plan;
  PleConvSlotsParams& p = plan.params;
  p.tokens = base.params.tokens;
  p.channels = base.params.channels;
  p.width = base.params.width;
  p.dilation = base.params.dilation;
  p.state_len = base.params.state_len;
  p.batch = base.params.batch;
  p.channel_vecs = base.params.channel_vecs;
  p.pool = pool;
  p.silu = base.params.silu;
  plan.dispatch = base.dispatch;
  plan.error = base.error;
  return plan;
}

using PleNgramSlotsPlan = LaunchPlan<PleNgramSlotsParams>;

inline PleNgramSlotsPlan plan_ple_ngram_ids_slots(int64_t tokens, int64_t batch, int64_t ngram, int64_t heads,
                                                  int64_t eos, int64_t vocab, int64_t pool) {
  const PleNgramPlan base = plan_ple_ngram_ids(tokens, batch, ngram, heads, eos, vocab);
  PleNgramSlotsPlan plan;
  PleNgramSlotsParams& p = plan.params;
  p.tokens = base.params.tokens;
  p.batch = base.params.batch;
  p.ngram = base.params.ngram;
  p.heads = base.params.heads;
  p.heads_per_order = base.params.heads_per_order;
  p.eos = base.params.eos;
  p.vocab = base.params.vocab;
  p.pool = pool;
  plan.dispatch = base.dispatch;
  plan.error = base.error;
  return plan;
}

using QsaPoolPlan = LaunchPlan<QsaPoolParams>;

inline QsaPoolPlan plan_qsa_pool(int64_t cells, int64_t dim, int64_t groups, int64_t group_size, int64_t rot_half,
                                 double eps) {
  QsaPoolPlan plan;
  QsaPoolParams& p = plan.params;
  p.cells = cells;
  p.dim = dim;
  p.groups = groups;
  p.group_size = group_size;
  p.rot_half = rot_half;
  p.eps = static_cast<float>(eps);
  const uint64_t threads = static_cast<uint64_t>(groups) * HEBRUS_SIMD_WIDTH;
  if (threads > kMaxThreads || static_cast<uint64_t>(groups) * static_cast<uint64_t>(group_size) >= kMaxThreads) {
    plan.error = "more than 2^32-1 threads or group members (G * 32, G * r)";
  }
  plan.dispatch = {threads, HEBRUS_QSA_POOL_TG};
  return plan;
}

// ---- the fused QSA-layer ops (issue 37): a parameter block and a grid of `threads` threads -----------------
template <typename Params>
inline LaunchPlan<Params> plan_grid(const Params& params, uint64_t threads, uint64_t group, const char* too_many) {
  LaunchPlan<Params> plan;
  plan.params = params;
  if (threads > kMaxThreads) plan.error = too_many;
  plan.dispatch = {threads, group};
  return plan;
}

// qsa_token_cells: one SIMD-group per query, whole SIMD-groups only.
inline LaunchPlan<QsaTokenCellsParams> plan_qsa_token_cells(int64_t queries, int64_t top_k, int64_t group_size,
                                                            int64_t width, int64_t cells) {
  return plan_grid(QsaTokenCellsParams{queries, top_k, group_size, width, cells},
                   static_cast<uint64_t>(queries) * HEBRUS_SIMD_WIDTH, HEBRUS_QSA_TOKEN_CELLS_TG,
                   "more than 2^32-1 threads (Tq * 32)");
}

// rms_norm_rope: one SIMD-group per (token, head), whole SIMD-groups only.
inline LaunchPlan<RmsNormRopeParams> plan_rms_norm_rope(int64_t tokens, int64_t heads, int64_t dim, int64_t rot,
                                                        int64_t x_stride0, int64_t x_stride1, double eps) {
  return plan_grid(RmsNormRopeParams{tokens, heads, dim, rot, x_stride0, x_stride1, static_cast<float>(eps), 0},
                   static_cast<uint64_t>(tokens) * static_cast<uint64_t>(heads) * HEBRUS_SIMD_WIDTH,
                   HEBRUS_NORM_ROPE_TG, "more than 2^32-1 threads (T * H * 32)");
}

// sigmoid_gate: one thread per element.
inline LaunchPlan<SigmoidGateParams> plan_sigmoid_gate(int64_t tokens, int64_t heads, int64_t dim, int64_t g_stride0,
                                                       int64_t g_stride1) {
  const uint64_t threads = static_cast<uint64_t>(tokens) * static_cast<uint64_t>(heads) * static_cast<uint64_t>(dim);
  return plan_grid(SigmoidGateParams{static_cast<int64_t>(threads), heads, dim, g_stride0, g_stride1}, threads,
                   HEBRUS_SIGMOID_GATE_TG, "more than 2^32-1 threads (T * H * D)");
}

struct QsaSelectPlan : LaunchPlan<QsaSelectParams> {
  const char* variant = "k512";
  int64_t queries_per_block = HEBRUS_QSA_SELECT_K512_QB;
};

// The variant is chosen by the largest number of groups a query can keep: min(top_k, maxG).
inline QsaSelectPlan plan_qsa_select(int64_t queries, int64_t query_heads, int64_t dim, int64_t rows, int64_t batch,
                                     int64_t max_groups, int64_t top_k) {
  QsaSelectPlan plan;
  QsaSelectParams& p = plan.params;
  p.queries = queries;
  p.query_heads = query_heads;
  p.dim = dim;
  p.rows = rows;
  p.batch = batch;
  p.max_groups = max_groups;
  p.top_k = top_k;
  p.sqrt_dim = static_cast<float>(std::sqrt(static_cast<double>(dim)));
  const int64_t keep = top_k < max_groups ? top_k : max_groups;
  if (keep <= HEBRUS_QSA_SELECT_K512_KMAX) {
    plan.variant = "k512";
    plan.queries_per_block = HEBRUS_QSA_SELECT_K512_QB;
  } else {
    plan.variant = "k2048";
    plan.queries_per_block = HEBRUS_QSA_SELECT_K2048_QB;
    if (keep > HEBRUS_QSA_SELECT_K2048_KMAX) {
      plan.error = "the Metal kernel keeps at most 2048 groups per query (min(top_k, maxG) <= 2048)";
    }
  }
  if (max_groups >= static_cast<int64_t>(kMaxThreads) || queries >= static_cast<int64_t>(kMaxThreads)) {
    plan.error = "more than 2^32-1 queries or groups per sequence";
  }
  const uint64_t blocks = ceil_div(static_cast<uint64_t>(queries), static_cast<uint64_t>(plan.queries_per_block));
  if (blocks * HEBRUS_QSA_SELECT_TG > kMaxThreads) plan.error = "more than 2^32-1 threads";
  plan.dispatch = {blocks * HEBRUS_QSA_SELECT_TG, HEBRUS_QSA_SELECT_TG};
  return plan;
}

struct QsaAttentionPlan : LaunchPlan<QsaAttentionParams> {
  const char* variant = "h1_d64";
  int64_t heads_per_pass = 1;  // HB of the variant
  int64_t dim_max = 64;        // DMAX of the variant
};

// Called with Tq, Hq, Dv, cells >= 1 (the glue handles empty shapes on the host). k_stride0/1 and
// v_stride0/1 are the element strides of dims 0 (cell) and 1 (KV head) of k and v, whose last dim the
// glue has made contiguous (a copy only when it was not); q, token_cells and out are contiguous.
// The variant is the smallest one that holds max(Dh, Dv) and min(rep, 8) query heads, so the
// per-lane registers (HB x DMAX / 32 accumulators) are no larger than the shape needs.
inline QsaAttentionPlan plan_qsa_attention(int64_t queries, int64_t query_heads, int64_t kv_heads, int64_t head_dim,
                                           int64_t value_dim, int64_t cells, int64_t width, int64_t k_stride0,
                                           int64_t k_stride1, int64_t v_stride0, int64_t v_stride1, double scale) {
  static const char* const kVariants[4][3] = {{"h1_d64", "h1_d128", "h1_d256"},
                                              {"h2_d64", "h2_d128", "h2_d256"},
                                              {"h4_d64", "h4_d128", "h4_d256"},
                                              {"h8_d64", "h8_d128", "h8_d256"}};
  QsaAttentionPlan plan;
  QsaAttentionParams& p = plan.params;
  p.queries = queries;
  p.query_heads = query_heads;
  p.kv_heads = kv_heads;
  p.rep = kv_heads > 0 ? query_heads / kv_heads : 0;
  p.head_dim = head_dim;
  p.value_dim = value_dim;
  p.cells = cells;
  p.width = width;
  p.k_stride0 = k_stride0;
  p.k_stride1 = k_stride1;
  p.v_stride0 = v_stride0;
  p.v_stride1 = v_stride1;
  p.scale = static_cast<float>(scale);
  int hb_index = 0;
  while (hb_index < 3 && (int64_t{1} << hb_index) < p.rep) ++hb_index;
  plan.heads_per_pass = int64_t{1} << hb_index;
  const int64_t dim = head_dim > value_dim ? head_dim : value_dim;
  int dim_index = 0;
  while (dim_index < 2 && (int64_t{64} << dim_index) < dim) ++dim_index;
  plan.dim_max = int64_t{64} << dim_index;
  plan.variant = kVariants[hb_index][dim_index];
  if (dim > HEBRUS_QSA_ATTN_MAX_DIM) {
    plan.error = "the Metal kernel takes head dims up to 256 (max(Dh, Dv) <= 256)";
  }
  const uint64_t groups = static_cast<uint64_t>(queries) * static_cast<uint64_t>(kv_heads);
  if (groups * HEBRUS_QSA_ATTN_TG > kMaxThreads) plan.error = "more than 2^32-1 threads (Tq * Hkv * 256)";
  if (static_cast<uint64_t>(queries) * static_cast<uint64_t>(width) >= kMaxThreads) {
    plan.error = "more than 2^32-2 token_cells entries (Tq * W)";
  }
  plan.dispatch = {groups * HEBRUS_QSA_ATTN_TG, HEBRUS_QSA_ATTN_TG};
  return plan;
}

struct GdnDeltaRulePlan : LaunchPlan<GdnDeltaRuleParams> {
  const char* variant = "k32";
  int64_t key_dim_max = 32;  // DKMAX of the variant
};

// gdn_delta_rule and gdn_delta_rule_slots (pool = S; B for the plain op), called with B >= 1 (the glue
// launches the check kernel for B == 0). The variant is the smallest DKMAX >= Dk, so a lane keeps no
// more state registers than the shape needs.
inline GdnDeltaRulePlan plan_gdn_delta_rule(int64_t tokens, int64_t batch, int64_t key_heads, int64_t value_heads,
                                            int64_t key_dim, int64_t value_dim, int64_t pool, double scale,
                                            bool l2) {
  static const char* const kVariants[4] = {"k32", "k64", "k128", "k256"};
  GdnDeltaRulePlan plan;
  GdnDeltaRuleParams& p = plan.params;
  p.tokens = tokens;
  p.batch = batch;
  p.key_heads = key_heads;
  p.value_heads = value_heads;
  p.rep = key_heads > 0 ? value_heads / key_heads : 0;
  p.key_dim = key_dim;
  p.value_dim = value_dim;
  p.col_blocks = static_cast<int64_t>(ceil_div(static_cast<uint64_t>(value_dim), HEBRUS_GDN_TG_COLS));
  p.pool = pool;
  p.scale = static_cast<float>(scale);
  p.l2 = l2 ? 1 : 0;
  int index = 0;
  while (index < 3 && (int64_t{32} << index) < key_dim) ++index;
  plan.variant = kVariants[index];
  plan.key_dim_max = int64_t{32} << index;
  if (key_dim > HEBRUS_MPS_GDN_MAX_KEY_DIM) {
    plan.error = "the Metal kernel takes key head dims up to 256 (Dk <= 256)";
  }
  const uint64_t groups =
      static_cast<uint64_t>(batch) * static_cast<uint64_t>(value_heads) * static_cast<uint64_t>(p.col_blocks);
  if (groups * HEBRUS_GDN_TG > kMaxThreads) plan.error = "more than 2^32-1 threads (B * Hv * ceil(Dv / 16) * 128)";
  plan.dispatch = {groups * HEBRUS_GDN_TG, HEBRUS_GDN_TG};
  return plan;
}

using GdnChunkPlan = LaunchPlan<GdnChunkParams>;

// Called with Hk, Dk, Hv, Dv >= 1 and B >= 1 (B == 0 runs the check kernel).
inline GdnChunkPlan plan_gdn_chunk_delta_rule_slots(int64_t tokens, int64_t batch, int64_t key_heads,
                                                    int64_t value_heads, int64_t key_dim, int64_t value_dim,
                                                    int64_t pool, double scale, bool l2norm) {
  static_assert(sizeof(GdnChunkParams) == 9 * 8, "GdnChunkParams: 8 x 64-bit, float, int");
  GdnChunkPlan plan;
  GdnChunkParams& p = plan.params;
  p.tokens = tokens;
  p.batch = batch;
  p.key_heads = key_heads;
  p.value_heads = value_heads;
  p.key_dim = key_dim;
  p.value_dim = value_dim;
  p.dv_blocks = static_cast<int64_t>(ceil_div(static_cast<uint64_t>(value_dim), HEBRUS_GDN_CHUNK_DVB));
  p.pool = pool;
  p.scale = static_cast<float>(scale);
  p.l2norm = l2norm ? 1 : 0;
  if (key_dim > HEBRUS_GDN_CHUNK_MAX_DK) plan.error = "the Metal kernel takes key dims up to 128 (Dk <= 128)";
  const uint64_t groups = static_cast<uint64_t>(batch) * static_cast<uint64_t>(value_heads) *
                          static_cast<uint64_t>(p.dv_blocks);
  if (groups * HEBRUS_GDN_CHUNK_TG > kMaxThreads) plan.error = "more than 2^32-1 threads (B * Hv * ceil(Dv / 32) * 128)";
  plan.dispatch = {groups * HEBRUS_GDN_CHUNK_TG, HEBRUS_GDN_CHUNK_TG};
  return plan;
}

using CheckPlan = LaunchPlan<HebrusCheckParams>;

// The check kernels (<op>_check_cu, qsa_attention_check_cells): one thread per row / query, at least one.
#define HEBRUS_CHECK_TG 256
inline CheckPlan plan_check(int64_t tokens, int64_t rows, int64_t width) {
  CheckPlan plan;
  plan.params.tokens = tokens;
  plan.params.rows = rows;
  plan.params.width = width;
  const uint64_t threads = rows > 0 ? static_cast<uint64_t>(rows) : 1;
  if (threads > kMaxThreads) plan.error = "more than 2^32-1 threads (one per row)";
  plan.dispatch = {threads, HEBRUS_CHECK_TG};
  return plan;
}

using SlotsCheckPlan = LaunchPlan<HebrusSlotsCheckParams>;

// The check kernels of the slot ops (<op>_check): one thread per row, at least one.
inline SlotsCheckPlan plan_check_slots(int64_t tokens, int64_t rows, int64_t pool, int64_t heads) {
  SlotsCheckPlan plan;
  plan.params.tokens = tokens;
  plan.params.rows = rows;
  plan.params.pool = pool;
  plan.params.heads = heads;
  const uint64_t threads = rows > 0 ? static_cast<uint64_t>(rows) : 1;
  if (threads > kMaxThreads) plan.error = "more than 2^32-1 threads (one per row)";
  plan.dispatch = {threads, HEBRUS_CHECK_TG};
  return plan;
}

// moe_experts' launches (called with T, H, k, I >= 1). Decode (the gather GEMV): act over pairs x I items,
// down over pairs x H items (HEBRUS_MOE_LANES threads each, rounded up to whole SIMD-groups), sum over
// T x H. Grouped (prefill): route (one threadgroup), act over max_tiles x ceil(I / 16) threadgroups,
// down over max_tiles x ceil(H / 16), the same sum. Both paths give every pair's act and weighted output
// the same bits, so the choice is only about speed; it is made from T, k and E alone (moe_grouped).
struct MoeExpertsPlan {
  MoeExpertsParams params{};
  bool grouped = false;
  Dispatch route, act, down, sum;
  const char* error = nullptr;
};

inline uint64_t moe_half_simd_threads(uint64_t items) {
  return ceil_div(items * HEBRUS_MOE_LANES, HEBRUS_SIMD_WIDTH) * HEBRUS_SIMD_WIDTH;
}

// The grouped path runs when the pairs are at least as many as the experts (so an expert hit is hit by
// about one pair or more on average, and a tile reads its weights once for several pairs) and fill two
// tiles. Shapes only: never the ids, so a row's path does not depend on which experts the batch hits.
inline bool moe_grouped(int64_t rows, int64_t top_k, int64_t experts) {
  const int64_t pairs = rows * top_k;
  return pairs >= experts && pairs >= 2 * HEBRUS_MOE_TILE_ROWS;
}

// The most tiles the route can cut: sum over experts of ceil(n_e / R) <= ceil(pairs / R) + min(E, pairs).
inline int64_t moe_max_tiles(int64_t pairs, int64_t experts) {
  return (pairs + HEBRUS_MOE_TILE_ROWS - 1) / HEBRUS_MOE_TILE_ROWS + (experts < pairs ? experts : pairs);
}

// moe_experts_quantized passes its group size (its kernels' variant, "q4" / "q8", is the bit width).
inline MoeExpertsPlan plan_moe_experts(int64_t rows, int64_t hidden, int64_t top_k, int64_t experts, int64_t inter,
                                       bool round_product, int64_t group_size = 0) {
  MoeExpertsPlan plan;
  MoeExpertsParams& p = plan.params;
  p.rows = rows;
  p.hidden = hidden;
  p.top_k = top_k;
  p.experts = experts;
  p.inter = inter;
  p.pairs = rows * top_k;
  p.group_size = group_size;
  p.round_product = round_product ? 1 : 0;
  plan.grouped = moe_grouped(rows, top_k, experts);
  const uint64_t pairs = static_cast<uint64_t>(p.pairs);
  uint64_t act = 0, down = 0;
  if (plan.grouped) {
    p.max_tiles = moe_max_tiles(p.pairs, experts);
    const uint64_t tiles = static_cast<uint64_t>(p.max_tiles);
    act = tiles * ceil_div(static_cast<uint64_t>(inter), HEBRUS_MOE_TILE_COLS) * HEBRUS_MOE_TG;
    down = tiles * ceil_div(static_cast<uint64_t>(hidden), HEBRUS_MOE_TILE_COLS) * HEBRUS_MOE_TG;
    plan.route = {HEBRUS_MOE_ROUTE_TG, HEBRUS_MOE_ROUTE_TG};
  } else {
    act = moe_half_simd_threads(pairs * static_cast<uint64_t>(inter));
    down = moe_half_simd_threads(pairs * static_cast<uint64_t>(hidden));
  }
  const uint64_t sum = static_cast<uint64_t>(rows) * static_cast<uint64_t>(hidden);
  if (act > kMaxThreads || down > kMaxThreads || sum > kMaxThreads) {
    plan.error = plan.grouped ? "more than 2^32-1 threads (max_tiles * ceil(max(I, H) / 16) * 256)"
                              : "more than 2^32-1 threads (T * k * max(I, H) * 16)";
  }
  plan.act = {act, HEBRUS_MOE_TG};
  plan.down = {down, HEBRUS_MOE_TG};
  plan.sum = {sum, HEBRUS_MOE_SUM_TG};
  return plan;
}

// quantized_linear's one launch (called with T, out >= 1). Few rows: rows x out items of HEBRUS_MOE_LANES
// threads. Many rows (T >= 2 tiles, a shape rule): one threadgroup per (tile of 8 rows, 16 outputs), the
// weights staged once per tile; the same bits either way.
struct QuantLinearPlan {
  QuantLinearParams params{};
  bool tiled = false;
  Dispatch dispatch;
  const char* error = nullptr;
};

inline QuantLinearPlan plan_quantized_linear(int64_t rows, int64_t in, int64_t out, int64_t group_size) {
  QuantLinearPlan plan;
  plan.params = {rows, in, out, group_size};
  plan.tiled = rows >= 2 * HEBRUS_MOE_TILE_ROWS;
  const uint64_t threads =
      plan.tiled ? ceil_div(static_cast<uint64_t>(rows), HEBRUS_MOE_TILE_ROWS) *
                       ceil_div(static_cast<uint64_t>(out), HEBRUS_MOE_TILE_COLS) * HEBRUS_MOE_TG
                 : moe_half_simd_threads(static_cast<uint64_t>(rows) * static_cast<uint64_t>(out));
  if (threads > kMaxThreads) plan.error = "more than 2^32-1 threads (T * out * 16)";
  plan.dispatch = {threads, HEBRUS_MOE_TG};
  return plan;
}

// ---- hc_rms_norm (issue 37) ---------------------------------------------------------------------------
// One SIMD-group per (row, group), HEBRUS_HC_NORM_TG threads per threadgroup; the last threadgroup may
// hold fewer SIMD-groups, never a partial one (the grid is a multiple of 32 threads).
using HcRmsNormPlan = LaunchPlan<HcRmsNormParams>;

inline HcRmsNormPlan plan_hc_rms_norm(int64_t rows, int64_t dim, int64_t group, double eps) {
  HcRmsNormPlan plan;
  HcRmsNormParams& p = plan.params;
  p.rows = rows;
  p.dim = dim;
  p.group = group;
  p.eps = static_cast<float>(eps);
  const uint64_t pairs = static_cast<uint64_t>(rows) * static_cast<uint64_t>(dim / group);
  const uint64_t threads = pairs * HEBRUS_SIMD_WIDTH;
  if (threads > kMaxThreads) plan.error = "more than 2^32-1 threads (T * D / group * 32)";
  plan.dispatch = {threads, HEBRUS_HC_NORM_TG};
  return plan;
}

// ---- gdn_gates, gdn_gated_rms_norm (issue 37) ----------------------------------------------------------
// gdn_gates: one thread per (row, head), no barrier, so the last threadgroup may be partial.
// gdn_gated_rms_norm: one SIMD-group per row; the grid is a multiple of 32 threads (whole SIMD-groups).
using GdnGatesPlan = LaunchPlan<GdnGatesParams>;
using GdnGatedNormPlan = LaunchPlan<GdnGatedNormParams>;

inline GdnGatesPlan plan_gdn_gates(int64_t rows, int64_t heads, int a_log_dtype, int dt_bias_dtype) {
  GdnGatesPlan plan;
  plan.params = {rows, heads, a_log_dtype, dt_bias_dtype};
  const uint64_t threads = static_cast<uint64_t>(rows) * static_cast<uint64_t>(heads);
  if (threads > kMaxThreads) plan.error = "more than 2^32-1 threads (rows * Hv)";
  plan.dispatch = {threads, HEBRUS_GDN_GATES_TG};
  return plan;
}

inline GdnGatedNormPlan plan_gdn_gated_rms_norm(int64_t rows, int64_t dim, double eps, int weight_dtype,
                                                bool round_product, bool sigmoid) {
  GdnGatedNormPlan plan;
  plan.params = {rows, dim, static_cast<float>(eps), weight_dtype, round_product ? 1 : 0, sigmoid ? 1 : 0};
  const uint64_t threads = static_cast<uint64_t>(rows) * HEBRUS_SIMD_WIDTH;
  if (threads > kMaxThreads) plan.error = "more than 2^32-1 threads (rows * 32)";
  plan.dispatch = {threads, HEBRUS_GDN_NORM_TG};
  return plan;
}

// ---- hc_premix, hc_post_combine (issue 37) -------------------------------------------------------------
// hc_premix (and hc_premix_quantized, group_size > 0): low launches rows * (rank + injects) SIMD-groups (whole
// SIMD-groups only), mix launches rows * hidden threads.
struct HcPremixPlan {
  HcPremixParams params{};
  Dispatch low, mix;
  const char* error = nullptr;
};

inline HcPremixPlan plan_hc_premix(int64_t rows, int64_t hidden, int64_t hc, int64_t rank, int64_t injects,
                                   double eps, int64_t group_size = 0) {
  HcPremixPlan plan;
  plan.params = HcPremixParams{rows,    hidden, hc, rank, injects, static_cast<float>(eps),
                               static_cast<int32_t>(group_size)};
  const uint64_t low = static_cast<uint64_t>(rows) * static_cast<uint64_t>(rank + injects) * HEBRUS_SIMD_WIDTH;
  const uint64_t mix = static_cast<uint64_t>(rows) * static_cast<uint64_t>(hidden);
  if (low > kMaxThreads) plan.error = "more than 2^32-1 threads (T * (R + hc) * 32)";
  if (mix > kMaxThreads) plan.error = "more than 2^32-1 threads (T * hidden)";
  plan.low = {low, HEBRUS_HC_PREMIX_TG};
  plan.mix = {mix, HEBRUS_HC_PREMIX_TG};
  return plan;
}

using HcPostCombinePlan = LaunchPlan<HcPostCombineParams>;

inline HcPostCombinePlan plan_hc_post_combine(int64_t rows, int64_t hidden, int64_t hc) {
  HcPostCombinePlan plan;
  plan.params = HcPostCombineParams{rows, hidden, hc};
  const uint64_t threads = static_cast<uint64_t>(rows) * static_cast<uint64_t>(hc) * static_cast<uint64_t>(hidden);
  if (threads > kMaxThreads) plan.error = "more than 2^32-1 threads (T * hc * hidden)";
  plan.dispatch = {threads, HEBRUS_HC_COMBINE_TG};
  return plan;
}

// ---- moe_route (issue 37) ------------------------------------------------------------------------------
// One SIMD-group per row, HEBRUS_MOE_ROUTE_TG threads per threadgroup (whole SIMD-groups only).
using MoeRoutePlan = LaunchPlan<MoeRouteParams>;

inline MoeRoutePlan plan_moe_route(int64_t rows, int64_t experts, int64_t top_k, int64_t shared, bool norm) {
  MoeRoutePlan plan;
  MoeRouteParams& p = plan.params;
  p.rows = rows;
  p.experts = experts;
  p.top_k = top_k;
  p.shared = shared;
  p.norm = norm ? 1 : 0;
  const uint64_t threads = static_cast<uint64_t>(rows) * HEBRUS_SIMD_WIDTH;
  if (top_k > HEBRUS_MOE_ROUTE_MAX_K) plan.error = "top_k > 64 (a row's top-k values are kept in registers)";
  if (experts >= int64_t{0x7FFFFFFF}) plan.error = "2^31-1 or more experts (ids are compared as 32-bit)";
  if (threads > kMaxThreads) plan.error = "more than 2^32-1 threads (T * 32)";
  plan.dispatch = {threads, HEBRUS_MOE_ROUTE_TG};
  return plan;
}

// ---- moe_shared_expert, moe_shared_expert_quantized (issue 37) -------------------------------------------
// Two launches of half SIMD-groups (moe_experts' layout): act over (row, i), down over (row, d); group_size 0
// for dense projections.
struct MoeSharedPlan {
  MoeSharedParams params{};
  Dispatch act, down;
  const char* error = nullptr;
};

inline MoeSharedPlan plan_moe_shared_expert(int64_t rows, int64_t hidden, int64_t inter, int64_t gate_stride,
                                            int64_t group_size = 0) {
  MoeSharedPlan plan;
  MoeSharedParams& p = plan.params;
  p.rows = rows;
  p.hidden = hidden;
  p.inter = inter;
  p.gate_stride = gate_stride;
  p.group_size = group_size;
  const uint64_t act = moe_half_simd_threads(static_cast<uint64_t>(rows) * static_cast<uint64_t>(inter));
  const uint64_t down = moe_half_simd_threads(static_cast<uint64_t>(rows) * static_cast<uint64_t>(hidden));
  if (act > kMaxThreads || down > kMaxThreads) plan.error = "more than 2^32-1 threads (T * max(I, H) * 16)";
  plan.act = {act, HEBRUS_MOE_TG};
  plan.down = {down, HEBRUS_MOE_TG};
  return plan;
}

}  // namespace hebrus::metal
#endif  // __METAL_VERSION__
