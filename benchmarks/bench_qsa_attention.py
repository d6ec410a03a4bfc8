"""QSA sparse attention (issue 6) at Qwen4Exp attention sizes: hebrus::qsa_attention vs dense masked
attention (what transformers runs) and vs the gathered-then-dense composite, same run.

Sizes: Hq 16, Hkv 2, Dh = Dv = 256, budget 2048 with r = 4, so W = 2051 (512 groups + a tail of at
most 3 tokens); bf16 and fp32. Every query selects 512 random complete groups of its visible run
plus its tail, which is what the QSA plan hands attention.

Cases, at 8K, 32K and 128K tokens of context:
- decode: 16 sequences x 1 new token. At 8K and 32K each sequence has its own cache; at 128K the
  16 sequences share one 128K-token cache (16 forks of one prompt), because 16 separate 128K caches
  (4-8 GiB) do not fit next to the other jobs on this machine. Every path still reads per sequence.
- prefill: one sequence, a block of new tokens ending at the context length. hebrus::qsa_attention
  and the dense path run the whole 4096-token block, except at 128K, where dense would take minutes
  here: it runs a smaller block (see --dense-block) at two sizes and the full block is estimated; the
  composite runs 32 tokens (per-token times compared).
- Decode is timed call by call from flushed caches, each call followed by a copy that samples the
  bandwidth of that moment (benchmarks/common.py timeit_cold_paired); the dense path
  reads transformers' cache layout [seq, Hkv, position, Dh] contiguous, the op a token-major pool.

Dense masked = transformers' sdpa_attention_forward (F.scaled_dot_product_attention with the boolean
selection mask over the whole cache; repeat_kv in prefill, pack_gqa in decode). Composite = gather
the selected K/V rows (index_select), then F.scaled_dot_product_attention(enable_gqa=True) with a
padding mask. Decode also times two bare reads of the selected rows with no attention: index_select
(gather into a buffer) and F.embedding_bag(mode="sum") (read in order, one row written per query),
and the op itself with every selected row in cache (its arithmetic alone).
Writes the "QSA sparse attention (issue 6)" section of RESULTS.md.

    python benchmarks/bench_qsa_attention.py [--contexts 8192,32768,131072] [--dtypes bf16,fp32]
"""

from __future__ import annotations

import argparse
import os
import gc
import statistics
import time

import torch
import torch.nn.functional as F

import hebrus_torch as ht
from common import bandwidth_note, copy_bandwidth, machine, table, timeit, timeit_cold_paired, write_section

HQ, HKV, DH, R, BUDGET = 16, 2, 256, 4, 2048
TOP_K = BUDGET // R
W = BUDGET + R - 1
SCALE = DH ** -0.5
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def token_cells(positions: torch.Tensor, cell_base: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """QSA-shaped selection [T, W] int32 for queries at ``positions`` (runs start at 0): 512 random
    complete groups (or all of them) plus the tail, as cells ``cell_base + position``, -1 padded."""
    out = torch.full((positions.numel(), W), -1, dtype=torch.int32)
    for start in range(0, positions.numel(), 256):
        p = positions[start:start + 256]
        n = p + 1
        groups = n // R
        scores = torch.rand(p.numel(), int(groups.max()), generator=gen)
        scores[torch.arange(scores.shape[1])[None, :] >= groups[:, None]] = -1.0
        k = min(TOP_K, scores.shape[1])
        chosen = scores.topk(k, dim=1).indices                                    # score order
        valid = torch.gather(scores, 1, chosen) >= 0
        toks = (chosen[:, :, None] * R + torch.arange(R)[None, None, :]).flatten(1)
        toks = torch.where(valid.repeat_interleave(R, 1), toks, -1)
        tail = groups[:, None] * R + torch.arange(R - 1)[None, :]
        tail = torch.where(tail < n[:, None], tail, -1)
        toks = torch.cat([toks, tail], 1)
        # Selected first, padding last (stable sort on "is padding").
        order = torch.sort((toks < 0).to(torch.int8), dim=1, stable=True).indices
        toks = torch.gather(toks, 1, order)
        base = cell_base[start:start + 256, None]
        out[start:start + 256, :toks.shape[1]] = torch.where(toks >= 0, toks + base, -1).to(torch.int32)
    return out


def selection_mask(tc: torch.Tensor, kv_len: int, base: torch.Tensor) -> torch.Tensor:
    """[T, kv_len] bool over each query's own cache, built the way transformers' indexer builds it."""
    idx = torch.where(tc >= 0, tc.long() - base[:, None], kv_len)
    mask = torch.zeros(tc.shape[0], kv_len + 1, dtype=torch.bool)
    return mask.scatter(-1, idx, True)[:, :kv_len]


class _Attn(torch.nn.Module):
    num_key_value_groups = HQ // HKV
    is_causal = True


def dense_masked(q_bhtd, k_bhcd, v_bhcd, mask_b1tc):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(_Attn(), q_bhtd, k_bhcd, v_bhcd, mask_b1tc, scaling=SCALE)[0]


def gathered_dense(q_thd, k_pool, v_pool, tc):
    idx = tc.clamp(min=0).long()
    ks = k_pool[idx].transpose(1, 2)                                   # [T, Hkv, W, Dh]
    vs = v_pool[idx].transpose(1, 2)
    pad = (tc >= 0)[:, None, None, :]
    return F.scaled_dot_product_attention(q_thd[:, :, None, :], ks, vs, attn_mask=pad, scale=SCALE,
                                          enable_gqa=True)[:, :, 0]


def timeit_many(fn, repeat: int, calls: int = 8) -> float:
    """Seconds per call, each timed sample running ``calls`` calls: short calls on a loaded machine
    are otherwise quantised by the scheduler tick."""
    def run():
        for _ in range(calls):
            fn()
    return timeit(run, repeat=repeat) / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="8192,32768,131072")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--prefill", type=int, default=4096, help="new tokens per prefill block (hebrus op)")
    parser.add_argument("--dense-block", default="4096,4096,32",
                        help="prefill block of the dense masked path, per context (smaller than --prefill: "
                             "the full block is estimated from two sizes)")
    parser.add_argument("--composite-block", type=int, default=32,
                        help="prefill block of the gathered-then-dense composite")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--section-suffix", default="",
                        help="appended to the RESULTS.md section title (a run on another machine)")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="the copy bandwidth in GB/s to divide by, instead of measuring it (so that two runs, "
                             "e.g. with and without THP_MEM_ALLOC_ENABLE, share one limit)")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    dense_blocks = [int(b) for b in args.dense_block.split(",")]
    dense_blocks += [dense_blocks[-1]] * (len(contexts) - len(dense_blocks))
    gen = torch.Generator().manual_seed(0)
    t_start = time.perf_counter()
    bw = args.bandwidth * 1e9 if args.bandwidth else copy_bandwidth()
    rows = []
    notes = []
    headline = {}
    sampled = []                                                            # copy bandwidths next to decode calls

    def report(case, path, seconds, queries, kv_bytes_per_query, selected, base=None, pairs=None):
        """kv_bytes_per_query: K/V bytes this path must read per query; selected: the op's; pairs: the
        (seconds, copy bandwidth) of each timed call (timeit_cold_paired)."""
        per_q = seconds / queries
        bound = selected / bw
        flops = 2 * HQ * (kv_bytes_per_query / row_bytes) * 2 * DH               # q.k and p.v over those rows
        paired = None if pairs is None else statistics.median(t * b / (queries * selected) for t, b in pairs)
        if pairs:
            sampled.extend(b for _, b in pairs)
        rows.append([case, path, f"{seconds * 1e3:,.1f}", f"{per_q * 1e6:,.0f}", f"{kv_bytes_per_query / 1e6:,.2f}",
                     f"{kv_bytes_per_query * queries / seconds / 1e9:.1f}", f"{flops * queries / seconds / 1e9:.1f}",
                     f"{per_q / bound:.1f}x", "-" if paired is None else f"{paired:.1f}x",
                     "" if base is None else f"{base / per_q:.1f}x"])
        return per_q, paired

    for ctx, dense_block in zip(contexts, dense_blocks):
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            el = torch.tensor([], dtype=dtype).element_size()
            row_bytes = HKV * 2 * DH * el                                     # K and V of one token
            shared = ctx > 65536
            B = args.sequences
            caches = 1 if shared else B
            # Token-major cache [seq, position, Hkv, Dh] (what a cell pool holds); the dense paths
            # read it through transposed views, which SDPA handles at contiguous speed.
            k_tok = torch.randn(caches, ctx, HKV, DH, generator=gen).to(dtype)
            v_tok = torch.randn(caches, ctx, HKV, DH, generator=gen).to(dtype)
            k_pool, v_pool = k_tok.view(-1, HKV, DH), v_tok.view(-1, HKV, DH)
            # The dense path gets the layout transformers' cache holds, [seq, Hkv, position, Dh] contiguous.
            k_dense, v_dense = k_tok.transpose(1, 2).contiguous(), v_tok.transpose(1, 2).contiguous()

            # Decode: B sequences, query at position ctx - 1 of each.
            base = (torch.arange(B) % caches) * ctx
            tc = token_cells(torch.full((B,), ctx - 1), base, gen)
            sel_bytes = float((tc >= 0).sum(1).float().mean()) * row_bytes
            q = torch.randn(B, HQ, DH, generator=gen).to(dtype)
            mask = selection_mask(tc, ctx, base)[:, None, None, :]            # [B, 1, 1, ctx]
            k_b = k_dense.expand(B, -1, -1, -1) if shared else k_dense
            v_b = v_dense.expand(B, -1, -1, -1) if shared else v_dense
            case = f"decode {B} seq, ctx {ctx // 1024}K, {dname}"
            # Every decode path is timed call by call from a flushed cache (timeit_cold_paired), as a decode
            # step finds it after the other layers ran: repeating one call back to back would serve
            # the selected rows from the last-level cache where they fit (the 16-core host's 300 MiB).
            # Each timed call is followed by a copy that samples the bandwidth at that moment (see
            # common.copy_sample): the 'x of copy next to it' column divides by that sample.
            t_dense, p_dense = timeit_cold_paired(lambda: dense_masked(q[:, :, None, :], k_b, v_b, mask), args.repeat)
            t_comp, p_comp = timeit_cold_paired(lambda: gathered_dense(q, k_pool, v_pool, tc), args.repeat)
            t_op, p_op = timeit_cold_paired(lambda: ht.qsa_attention(q, k_pool, v_pool, tc, SCALE), 8 * args.repeat)
            flat = tc[tc >= 0].long()
            k_sel, v_sel = k_pool.new_empty((flat.numel(), HKV, DH)), v_pool.new_empty((flat.numel(), HKV, DH))
            t_gather, p_gather = timeit_cold_paired(lambda: (torch.index_select(k_pool, 0, flat, out=k_sel),
                                                             torch.index_select(v_pool, 0, flat, out=v_sel)),
                                                    8 * args.repeat)
            # Reads the same rows and writes almost nothing: the machine's rate for this access pattern.
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), (tc >= 0).sum(1).cumsum(0)[:-1]])
            k_rows, v_rows = k_pool.view(k_pool.shape[0], -1), v_pool.view(v_pool.shape[0], -1)
            t_read, p_read = timeit_cold_paired(lambda: (F.embedding_bag(flat, k_rows, offsets, mode="sum"),
                                                         F.embedding_bag(flat, v_rows, offsets, mode="sum")),
                                                8 * args.repeat)
            # The same arithmetic with every selected row in cache (cells folded into the first 64):
            # the op's compute floor on this machine, which no prefetching can beat.
            tc_hot = torch.where(tc >= 0, tc % 64, -1)
            t_hot = timeit_many(lambda: ht.qsa_attention(q, k_pool[:64], v_pool[:64], tc_hot, SCALE),
                                args.repeat * 3)
            d, _ = report(case, "dense masked SDPA (transformers)", t_dense, B, ctx * row_bytes, sel_bytes,
                          pairs=p_dense)
            report(case, "gathered-then-dense composite", t_comp, B, sel_bytes, sel_bytes, d, p_comp)
            report(case, "(gather only: index_select of the selected rows)", t_gather, B, sel_bytes, sel_bytes, d,
                   p_gather)
            rows[-1][6] = "-"
            _, read_paired = report(case, "(read only: embedding_bag sum of the selected rows)", t_read, B,
                                    sel_bytes, sel_bytes, d, p_read)
            rows[-1][6] = "-"
            report(case, "(arithmetic only: hebrus::qsa_attention, every selected row in cache)", t_hot, B,
                   sel_bytes, sel_bytes, d)
            rows[-1][5] = "-"
            _, op_paired = report(case, "hebrus::qsa_attention", t_op, B, sel_bytes, sel_bytes, d, p_op)
            headline[("decode", ctx, dname)] = (t_dense / t_op, t_op / B / (sel_bytes / bw), op_paired,
                                                read_paired, t_op / t_read, t_hot / B / (sel_bytes / bw))
            del mask, k_b, v_b, k_sel, v_sel

            # Prefill: one sequence, the block of new tokens ends at position ctx - 1.
            block = min(args.prefill, ctx)
            pos = torch.arange(ctx - block, ctx)
            tc = token_cells(pos, torch.zeros(block, dtype=torch.int64), gen)
            q = torch.randn(block, HQ, DH, generator=gen).to(dtype)
            sel_bytes = float((tc >= 0).sum(1).float().mean()) * row_bytes
            case = f"prefill {block} tok, ctx {ctx // 1024}K, {dname}"
            t_op = timeit(lambda: ht.qsa_attention(q, k_pool[:ctx], v_pool[:ctx], tc, SCALE), repeat=1, warmup=0)
            db = min(dense_block, block)
            qd, tcd = q[-db:], tc[-db:]
            mask = selection_mask(tcd, ctx, torch.zeros(db, dtype=torch.int64))[None, None]  # [1, 1, db, ctx]
            dcase = f"prefill {db} tok, ctx {ctx // 1024}K, {dname}"
            def dense_prefill(n, repeat):
                return timeit(lambda: dense_masked(qd[-n:].transpose(0, 1)[None], k_dense[:1], v_dense[:1],
                                                   mask[:, :, -n:]), repeat=repeat, warmup=0)

            if db == block:
                t_dense = est = dense_prefill(db, 1)
            else:
                # Too slow here for the full block: a second, smaller block (medians of 3 each) separates
                # the per-call cost (repeat_kv of the whole cache, the mask) from the per-token cost.
                t_dense = dense_prefill(db, 3)
                t_dense_small = dense_prefill(max(1, db // 4), 3)
                marginal = (t_dense - t_dense_small) / (db - max(1, db // 4)) if db > 1 else t_dense
                fixed = t_dense - db * marginal
                linear = marginal > 0 and fixed >= 0
                est = fixed + block * marginal if linear else t_dense / db * block
            cb = min(args.composite_block, db)
            t_comp = timeit(lambda: gathered_dense(qd[-cb:], k_pool, v_pool, tcd[-cb:]), repeat=1)
            d, _ = report(dcase, "dense masked SDPA (transformers)", t_dense, db, ctx * row_bytes, sel_bytes)
            report(f"prefill {cb} tok, ctx {ctx // 1024}K, {dname}", "gathered-then-dense composite", t_comp, cb,
                   sel_bytes, sel_bytes, d)
            if db < block:
                t_op_small = timeit(lambda: ht.qsa_attention(qd, k_pool[:ctx], v_pool[:ctx], tcd, SCALE),
                                    repeat=args.repeat)
                report(dcase, "hebrus::qsa_attention", t_op_small, db, sel_bytes, sel_bytes, d)
            report(case, "hebrus::qsa_attention", t_op, block, sel_bytes, sel_bytes, est / block)
            headline[("prefill", ctx, dname)] = (est / t_op, None)
            if db < block:
                how = (f"about {fixed:.2f} s per call plus {marginal * 1e3:.1f} ms per token" if linear else
                       f"not a per-call plus per-token cost, so the estimate scales the {db}-token time")
                notes.append(f"ctx {ctx // 1024}K {dname}: dense masked measured on the last {db} and "
                             f"{max(1, db // 4)} of the {block} new tokens (medians of 3; composite: last {cb}): "
                             f"{t_dense:.2f} s and {t_dense_small:.2f} s, {how}; a full {block}-token dense block "
                             f"would take about {est:.0f} s here, against {t_op:.1f} s measured for "
                             f"hebrus::qsa_attention ({est / t_op:.0f}x).")
            del k_tok, v_tok, k_pool, v_pool, k_dense, v_dense, mask, q, qd, tc, tcd
            gc.collect()
            print(f"done ctx {ctx} {dname} at {time.perf_counter() - t_start:.0f} s", flush=True)

    total = time.perf_counter() - t_start
    import transformers

    bw_text = (f"copy bandwidth {bw / 1e9:.1f} GB/s (given with --bandwidth, as measured by the run it is compared "
               f"with)" if args.bandwidth else f"measured copy bandwidth {bw / 1e9:.1f} GB/s ({bandwidth_note()})")
    body = (f"Machine: {machine()}, transformers {transformers.__version__} (the dense path is its "
            f"sdpa_attention_forward); {bw_text}, the 'bandwidth limit' below. Qwen4Exp attention sizes: Hq {HQ}, "
            f"Hkv {HKV}, Dh = Dv = {DH}, W = {W} (512 groups of 4 + tail); scale Dh^-1/2. Decode: "
            f"{args.sequences} sequences x 1 token at the end of the context (at 128K the sequences share one "
            f"cache, see the script's docstring); every decode path is timed one call at a time after a 1 GiB "
            f"read-modify-write has flushed the caches (a decode step finds its rows in DRAM after the other "
            f"layers ran): median of {args.repeat} calls for dense and composite, {8 * args.repeat} for the others "
            f"(the '(arithmetic only)' row alone runs warm, {3 * args.repeat} samples of 8 calls). The op reads "
            f"a token-major cell pool [cells, Hkv, Dh]; the dense path gets transformers' cache layout [seq, Hkv, "
            f"position, Dh], contiguous. Prefill: one sequence, a block of new tokens ending at the context "
            f"length, one run each; the CPU is shared with other jobs, so expect +-30% noise. 'K/V MB/query': "
            f"bytes of keys and values the path must read per query (dense: the whole cache; the others: the "
            f"selected cells only). 'GB/s': those bytes over the time. 'x of BW limit': time per query over "
            f"(selected K/V bytes / copy bandwidth), i.e. how far from reading just the selected bytes at copy "
            f"speed. 'x of copy next to it' (decode): the same ratio for each timed call against a 256 MiB copy "
            f"timed right after it, median over the calls; those copies measured {min(sampled, default=0) / 1e9:.0f}-"
            f"{max(sampled, default=0) / 1e9:.0f} GB/s (median {statistics.median(sampled or [0]) / 1e9:.0f}). "
            f"'GFLOP/s': q.k and p.v over the rows the path reads, 2 flop x {HQ} heads x ({DH} + {DH}) "
            f"multiply-adds per row. Speedup: per-query time against the dense masked path of the same context and "
            f"dtype. Whole run: {total:.0f} s.\n\n")
    body += table(["case", "path", "ms", "us/query", "K/V MB/query", "GB/s", "GFLOP/s", "x of BW limit",
                   "x of copy next to it", "speedup"], rows)
    body += ("\n\nWhat bounds decode: the limit assumes the selected bytes stream at copy speed, but they are "
             "512 B - 1 KiB rows scattered over the cache (each a separate page walk, unless the cache sits on huge pages); the "
             "'(gather only)' row is torch.index_select of exactly the selected rows into preallocated buffers, no "
             "arithmetic; the '(read only)' row is F.embedding_bag(mode='sum') over the same rows, which reads "
             "them in order and writes one row per query: what a plain in-order read of exactly these rows "
             "reaches on this machine, with no arithmetic to overlap. On top of the reads the op does 16 heads x 512 "
             "multiply-adds per selected row: 4 flop per fp32 byte, 8 per bf16 byte, so with half the bytes bf16 "
             f"is the case closest to compute-bound on {torch.get_num_threads()} threads. The '(arithmetic only)' "
             "row runs the op over the same number of selected rows per query, folded into the first 64 cells so "
             "that every read hits the cache: its 'x of BW limit' is how close the op could come to the limit if "
             "the memory traffic cost nothing. benchmarks/gather_floor.c measures the same reads without PyTorch, "
             "bare and with the op's multiply-adds (section 'Decode against the bandwidth limit (issue 6)').")
    if notes:
        body += (f"\n\nWhere a dense masked prefill of {args.prefill} new tokens is too slow to run here (it is "
                 f"compute-bound: {args.prefill} x ctx x 16 heads x 512 multiply-adds, plus repeat_kv copies of "
                 f"the whole cache), the dense and composite rows use a smaller block of the same queries and the "
                 f"speedup of the {args.prefill}-token op row is against an estimate:\n")
        body += "\n".join(f"- {n}" for n in notes)
    dec = [(c, d, v) for (kind, c, d), v in headline.items() if kind == "decode"]
    if dec:
        body += "\n\nDecode summary: " + "; ".join(
            f"{c // 1024}K {d}: {s:.1f}x vs dense, {x:.1f}x of the bandwidth limit, {xp:.1f}x of the copy next "
            f"to each call (the read-only floor: {rp:.1f}x; the arithmetic alone: {a:.1f}x of the limit), "
            f"{r:.1f}x the time of the read-only floor"
            for c, d, (s, x, xp, rp, r, a) in dec) + "."
    pre = [(c, d, v[0]) for (kind, c, d), v in headline.items() if kind == "prefill"]
    if pre:
        body += f"\nPrefill summary ({args.prefill}-token block against dense, measured or estimated): " + "; ".join(
            f"{c // 1024}K {d}: {s:.1f}x vs dense" for c, d, s in pre) + "."
    if not args.no_write:
        thp = os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"
        if thp:
            body = ("Allocator: THP_MEM_ALLOC_ENABLE=1 (PyTorch's CPU allocator backs allocations of 2 MiB and "
                    "more, the K/V cache included, with transparent huge pages; see the README's CPU "
                    "performance notes). Otherwise as the section above.\n\n" + body)
        write_section("QSA sparse attention (issue 6)" + (", THP_MEM_ALLOC_ENABLE=1" if thp else "")
                      + (f", {args.section_suffix}" if args.section_suffix else ""), body)
    print(body)


if __name__ == "__main__":
    main()
