"""PLE benchmarks at Qwen4Exp sizes: hebrus ops vs the transformers-style composite, same run.

Conv: C = 10240 channels, K = 4, dilation 3 (state 9). Hash: N = 3, 16 hash heads.
Cases: prefill of 4096 tokens in one sequence and in 8 packed sequences; decode of 64 sequences x 1
token with state gathered by slot from a pool of 128. The conv prefill also runs through
ple_conv_into (ht.ple_conv(..., out=...)) into output buffers allocated once. Writes the "PLE"
section of RESULTS.md.

On CPU the conv prefill cases run twice: in this process, and in a subprocess with PyTorch's CPU
allocator switched to the other setting of THP_MEM_ALLOC_ENABLE (2 MiB-aligned allocations advised
as transparent huge pages; the variable is read once, before the first allocation, hence the
subprocess). A fresh [T, C] output costs tens of milliseconds of 4 KiB first-touch page faults
under the default allocator, far more than writing it.

    python benchmarks/bench_ple.py [--device cpu] [--tokens 4096] [--channels 10240]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

import hebrus_torch as ht
from hebrus_torch import reference
from common import bandwidth_note, copy_bandwidth, machine, table, timeit, write_section

K, DIL, N, HEADS, VOCAB, EOS = 4, 3, 3, 16, 151_936, 151_645
L = (K - 1) * DIL


def composite_conv(x_bct: torch.Tensor, state_bcl: torch.Tensor, weight_c1k: torch.Tensor):
    """What transformers' Qwen4ExpTextPLELayer._short_conv does: cat state, dilated grouped conv1d, slice."""
    seq_len = x_bct.shape[-1]
    full = torch.cat([state_bcl, x_bct], dim=-1)
    new_state = full[..., -L:]
    y = F.silu(F.conv1d(full[..., -(L + seq_len):], weight_c1k, groups=x_bct.shape[1], dilation=DIL))
    return y, new_state


def transformers_hash(device: str):
    """transformers' Qwen4ExpTextNGramEmbedding with its embedding swapped for the identity on ids."""
    try:
        from transformers.models.qwen4_exp import modeling_qwen4_exp as m
        from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    except ImportError:
        return None, None
    cfg = Qwen4ExpTextConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=32, num_hidden_layers=1, ple_layer_ids=[1], ple_embed_dim=16,
                             eos_token_id=EOS, ngram_vocab_size_base=100_000)
    emb = m.Qwen4ExpTextNGramEmbedding(cfg, 16, 0, 0).to(device)

    class IdsOnly(torch.nn.Module):  # keeps the hash, drops the table lookup
        weight = torch.empty(0, device=device)

        def forward(self, ids):
            return ids

    emb.ngram_embedding = IdsOnly()
    return emb, cfg


THP_VAR = "THP_MEM_ALLOC_ENABLE"


def thp_enabled() -> bool:
    return os.environ.get(THP_VAR, "0") == "1"


def row(case, path, seconds, tokens, nbytes, bw, base=None) -> list[str]:
    gbs = nbytes / seconds / 1e9
    return [case, path, f"{seconds * 1e3:.2f}", f"{tokens / seconds:,.0f}", f"{gbs:.2f}",
            f"{nbytes / bw / seconds:.2f}", "" if base is None else f"{base / seconds:.1f}x"]


def conv_prefill_rows(dev: str, T: int, C: int, repeat: int, bw: float, with_reference: bool) -> list[list[str]]:
    """Conv prefill cases under this process's CPU allocator setting."""
    torch.manual_seed(0)
    allocator = f"{THP_VAR}=1" if thp_enabled() else "default allocator"
    rows = []
    weight = torch.randn(C, K, device=dev)
    w_c1k = weight[:, None, :].contiguous()
    for batch in (1, 8):
        per = T // batch
        x = torch.randn(T, C, device=dev)
        state = torch.randn(batch, L, C, device=dev)
        cu = torch.arange(0, T + 1, per, dtype=torch.int32, device=dev)
        x_bct = x.view(batch, per, C).transpose(1, 2).contiguous()
        s_bcl = state.transpose(1, 2).contiguous()
        nbytes = 2 * T * C * 4 + 2 * batch * L * C * 4
        case = f"conv prefill {T} tok, {batch} seq" + (f", {allocator}" if dev == "cpu" else "")
        t_comp = timeit(lambda: composite_conv(x_bct, s_bcl, w_c1k), dev, repeat, cold=True)
        rows.append(row(case, "composite (transformers conv1d)", t_comp, T, nbytes, bw))
        # The floor of any op that returns a fresh [T, C] tensor here: allocate and write it once.
        t_floor = timeit(lambda: x.clone(), dev, repeat, cold=True)
        rows.append(row(case, "floor: x.clone() (fresh output)", t_floor, T, nbytes, bw, t_comp))
        if with_reference:
            t_ref = timeit(lambda: reference.ple_conv(x, weight, cu, state, DIL, "silu"), dev, repeat, cold=True)
            rows.append(row(case, "hebrus reference (torch)", t_ref, T, nbytes, bw, t_comp))
        t_op = timeit(lambda: ht.ple_conv(x, weight, cu, state, DIL, "silu"), dev, repeat, cold=True)
        rows.append(row(case, "hebrus::ple_conv", t_op, T, nbytes, bw, t_comp))
        # The out-variant into buffers a prefill loop keeps from call to call: no fresh output.
        outs = (torch.empty_like(x), torch.empty_like(state))
        t_into = timeit(lambda: ht.ple_conv(x, weight, cu, state, DIL, "silu", out=outs), dev, repeat, cold=True)
        rows.append(row(case, "hebrus::ple_conv_into (reused output buffers)", t_into, T, nbytes, bw, t_comp))
        del outs
    return rows


def holder_decode_rows(dev: str, C: int, B: int, pool: int, repeat: int, bw: float) -> list[list[str]]:
    """PLEState.conv at decode (B sequences x 1 token, slots drawn from a pool), fp32 and bf16: the holder
    as it is (hebrus::ple_conv_slots in place, the undo log keeping the one tail entry per row a decode
    drops) against what it did before issue 19 (gather the tails, ple_conv, stage the new ones, commit
    with index_copy_ after copying the rows it replaces for an undo) and the composite."""
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        esize = torch.finfo(dtype).bits // 8
        weight = torch.randn(C, K, device=dev).to(dtype)
        w_c1k = weight[:, None, :].contiguous()
        x = torch.randn(B, C, device=dev).to(dtype)
        cu = torch.arange(B + 1, dtype=torch.int32, device=dev)
        ple = ht.PLEState(1, C, vocab_size=VOCAB, eos_token_id=EOS, max_sequences=pool, device=dev, dtype=dtype,
                          conv_weights=[weight])
        handles = [ple.new_sequence() for _ in range(pool)]
        ple.conv_state.copy_(torch.randn(ple.conv_state.shape, device=dev).to(dtype))
        slots = torch.randperm(pool, device=dev)[:B]
        chosen = [handles[i] for i in slots.tolist()]
        tails = ple.conv_state[0]

        def composite():
            s = tails.index_select(0, slots).transpose(1, 2)
            y, new = composite_conv(x[:, :, None], s, w_c1k)
            tails.index_copy_(0, slots, new.transpose(1, 2))
            return y

        def before():
            # What PLEState.conv did before issue 19, without its Python bookkeeping.
            gathered = tails.index_select(0, slots)
            y, new = ht.ple_conv(x, weight, cu, gathered, DIL, "silu")
            replaced = tails.index_select(0, slots)           # _txn_prepare: kept to undo the commit
            tails.index_copy_(0, slots, new)                  # _txn_commit
            del replaced
            return y

        def holder():
            with ht.transaction(ple):
                return ple.conv(0, chosen, x, cu)

        nbytes = 2 * B * C * esize + 2 * B * L * C * esize
        case = f"holder decode {B} seq x 1 tok, {str(dtype).replace('torch.', '')}"
        t_comp = timeit(composite, dev, repeat, cold=True)
        out.append(row(case, "composite (gather, cat, conv1d, scatter)", t_comp, B, nbytes, bw))
        out.append(row(case, "before: gather, ple_conv, staged, index_copy_ commit",
                       timeit(before, dev, repeat, cold=True), B, nbytes, bw, t_comp))
        out.append(row(case, "PLEState.conv in a transaction (ple_conv_slots in place)",
                       timeit(holder, dev, repeat, cold=True), B, nbytes, bw, t_comp))
    return out


def decode_only(args, dev: str, C: int, bw: float) -> None:
    """The issue-19 rows alone: the op-level decode paths and the holder decode, fp32 and bf16."""
    torch.manual_seed(0)
    B, pool = 64, 128
    weight = torch.randn(C, K, device=dev)
    w_c1k = weight[:, None, :].contiguous()
    slots = torch.randperm(pool, device=dev)[:B]
    x = torch.randn(B, C, device=dev)
    state_pool = torch.randn(pool, L, C, device=dev)
    cu = torch.arange(B + 1, dtype=torch.int32, device=dev)
    slots32 = slots.to(torch.int32)
    repeat = args.repeat * 4
    nbytes = 2 * B * C * 4 + 2 * B * L * C * 4
    case = f"conv decode {B} seq x 1 tok, fp32"

    def composite():
        s = state_pool.index_select(0, slots).transpose(1, 2)
        y, new = composite_conv(x[:, :, None], s, w_c1k)
        state_pool.index_copy_(0, slots, new.transpose(1, 2))
        return y

    def gather_op_scatter():
        y, new = ht.ple_conv(x, weight, cu, state_pool.index_select(0, slots), DIL, "silu")
        state_pool.index_copy_(0, slots, new)
        return y

    t_comp = timeit(composite, dev, repeat, cold=True)
    rows = [row(case, "composite (gather, cat, conv1d, scatter)", t_comp, B, nbytes, bw)]
    rows.append(row(case, "hebrus::ple_conv (gather, op, scatter)", timeit(gather_op_scatter, dev, repeat, cold=True),
                    B, nbytes, bw, t_comp))
    rows.append(row(case, "hebrus::ple_conv_slots (in place by slot)",
                    timeit(lambda: ht.ple.ops.ple_conv_slots(x, weight, cu, state_pool, slots32, DIL, "silu"), dev,
                           repeat, cold=True), B, nbytes, bw, t_comp))
    rows += holder_decode_rows(dev, C, B, pool, repeat, bw)
    bw_after = copy_bandwidth(dev)
    body = (f"Machine: {machine(dev)}; device `{dev}`; measured copy bandwidth {bw / 1e9:.1f} GB/s before and "
            f"{bw_after / 1e9:.1f} GB/s after the rows ({bandwidth_note()}); 'of BW' uses the first. C = {C}, "
            f"K = {K}, dilation {DIL}; 64 sequences x 1 token, slots drawn from a pool of 128; median of {repeat} "
            f"runs, each timed call after a 1 GiB read-modify-write has flushed the caches. GB/s counts the bytes "
            f"the conv must move (x, y, the 64 tails in and out) in the row's dtype; 'of BW' = that over the copy "
            f"bandwidth (1.00 = the bandwidth limit, 0.50 = within 2x of it); speedup against the first row of its "
            f"case. The holder rows run PLEState.conv inside ht.transaction (hebrus::ple_conv_slots in place; its "
            f"undo log also copies the one tail entry per sequence a decode drops, 1/9 of the tails); 'before' is "
            f"what PLEState.conv did before issue 19 (gather, ple_conv, stage, index_copy_ commit after copying "
            f"the replaced rows), without its Python bookkeeping. python benchmarks/bench_ple.py --decode-only\n\n")
    body += table(["case", "path", "ms", "tokens/s", "GB/s", "of BW", "speedup"], rows)
    write_section("PLE holder decode (issue 19)" + (f", {args.section_suffix}" if args.section_suffix else ""), body)
    print(body)


def conv_prefill_rows_other_allocator(args, bw: float) -> list[list[str]]:
    """The conv prefill cases in a subprocess with THP_MEM_ALLOC_ENABLE flipped."""
    env = dict(os.environ)
    env[THP_VAR] = "0" if thp_enabled() else "1"
    cmd = [sys.executable, os.path.abspath(__file__), "--device", args.device, "--tokens", str(args.tokens),
           "--channels", str(args.channels), "--repeat", str(args.repeat), "--conv-prefill-only", str(bw)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return next(w.strip("[]") for w in f.read().split() if w.startswith("["))
    except (OSError, StopIteration):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--channels", type=int, default=10240)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--section-suffix", default="",
                        help="appended to the RESULTS.md section title (a run on another machine)")
    parser.add_argument("--decode-only", action="store_true",
                        help="only the conv decode and holder decode cases (issue 19), into their own section")
    parser.add_argument("--conv-prefill-only", type=float, default=None, metavar="BW",
                        help=argparse.SUPPRESS)  # subprocess mode: print the conv prefill rows as JSON
    args = parser.parse_args()
    dev, T, C = args.device, args.tokens, args.channels
    if args.conv_prefill_only is not None:
        print(json.dumps(conv_prefill_rows(dev, T, C, args.repeat, args.conv_prefill_only, with_reference=False)))
        return
    torch.manual_seed(0)
    bw = copy_bandwidth(dev)
    if args.decode_only:
        decode_only(args, dev, C, bw)
        return
    rows = conv_prefill_rows(dev, T, C, args.repeat, bw, with_reference=True)
    if dev == "cpu":
        other = conv_prefill_rows_other_allocator(args, bw)
        rows = rows + other if not thp_enabled() else other + rows

    def report(case, path, seconds, tokens, nbytes, base=None):
        rows.append(row(case, path, seconds, tokens, nbytes, bw, base))

    torch.manual_seed(0)
    weight = torch.randn(C, K, device=dev)
    w_c1k = weight[:, None, :].contiguous()

    # Decode: 64 sequences x 1 token, state gathered by slot from a pool of 128 slots.
    B, pool = 64, 128
    slots = torch.randperm(pool, device=dev)[:B]
    x = torch.randn(B, C, device=dev)
    state_pool = torch.randn(pool, L, C, device=dev)
    cu = torch.arange(B + 1, dtype=torch.int32, device=dev)

    def decode_composite():
        s = state_pool.index_select(0, slots).transpose(1, 2)
        y, new = composite_conv(x[:, :, None], s, w_c1k)
        state_pool.index_copy_(0, slots, new.transpose(1, 2))
        return y

    def decode_op():
        y, new = ht.ple_conv(x, weight, cu, state_pool.index_select(0, slots), DIL, "silu")
        state_pool.index_copy_(0, slots, new)
        return y

    slots32 = slots.to(torch.int32)

    def decode_slots():
        return ht.ple.ops.ple_conv_slots(x, weight, cu, state_pool, slots32, DIL, "silu")

    nbytes = 2 * B * C * 4 + 2 * B * L * C * 4
    case = f"conv decode {B} seq x 1 tok"
    t_comp = timeit(decode_composite, dev, args.repeat * 4, cold=True)
    report(case, "composite (gather, cat, conv1d, scatter)", t_comp, B, nbytes)
    report(case, "hebrus::ple_conv (gather, op, scatter)", timeit(decode_op, dev, args.repeat * 4, cold=True), B, nbytes, t_comp)
    report(case, "hebrus::ple_conv_slots (in place by slot)", timeit(decode_slots, dev, args.repeat * 4, cold=True), B, nbytes, t_comp)
    rows.extend(holder_decode_rows(dev, C, B, pool, args.repeat * 4, bw))

    # Hash.
    emb, _ = transformers_hash(dev)
    mult = torch.randint(1, (1 << 62) // VOCAB, (N,), device=dev) | 1
    sizes = torch.randint(20_000_000, 20_100_000, (HEADS,), device=dev)
    offs = torch.arange(HEADS, device=dev) * 20_100_000
    if emb is not None:
        mult, sizes, offs = emb.layer_multipliers, emb.ngram_heads_vocab_sizes, emb.ngram_heads_offsets
    for batch, per in ((1, T), (8, T // 8), (64, 1)):
        tokens = torch.randint(0, VOCAB, (batch * per,), device=dev)
        tokens[::97] = EOS
        cu = torch.arange(0, batch * per + 1, per, dtype=torch.int32, device=dev)
        hist = torch.full((batch, N - 1), EOS, dtype=torch.int64, device=dev)
        nbytes = batch * per * (8 + HEADS * 8)
        case = f"hash {batch} seq x {per} tok"
        base = None
        if emb is not None:
            ids2d = tokens.view(batch, per)
            base = timeit(lambda: emb(ids2d, None), dev, args.repeat, cold=True)
            report(case, "transformers NGramEmbedding hash", base, batch * per, nbytes)
        report(case, "hebrus reference (torch)",
               timeit(lambda: reference.ple_ngram_ids(tokens, cu, hist, mult, sizes, offs, EOS, VOCAB), dev,
                      args.repeat, cold=True), batch * per, nbytes, base)
        report(case, "hebrus::ple_ngram_ids",
               timeit(lambda: ht.ple_ngram_ids(tokens, cu, hist, mult, sizes, offs, EOS, VOCAB), dev,
                      args.repeat, cold=True), batch * per, nbytes, base)

    body = (f"Machine: {machine(dev)}; device `{dev}`; measured copy bandwidth {bw / 1e9:.1f} GB/s "
            f"({bandwidth_note()}). fp32, C = {C}, K = {K}, dilation {DIL}, {HEADS} hash heads; median of "
            f"{args.repeat} runs (decode: {args.repeat * 4}), each timed call after a 1 GiB read-modify-write has "
            f"flushed the caches (in a model step the other layers run in between). GB/s counts the bytes each path must move "
            f"(conv: x, y, state in and out; hash: token ids in, row ids out); 'of BW' = that over the copy "
            f"bandwidth (1.00 = the bandwidth limit, 0.50 = within 2x of it); speedup is against the first row "
            f"of its case. The 'holder decode' rows count the bytes of the conv (x, y, the B tails in and out) in "
            f"their dtype; the holder also copies the one tail entry per sequence a decode drops into its undo log "
            f"(1/L of the tails). The 'floor' row allocates and writes a fresh [T, C] tensor, which every path "
            f"returning a new output pays: first-touch page faults of freshly mmapped memory make that far "
            f"slower than the copy bandwidth suggests under PyTorch's default CPU allocator (4 KiB pages), "
            f"and even on huge pages the kernel zeroes every fresh page before it is written. The "
            f"'ple_conv_into' row writes into output buffers allocated once (ht.ple_conv(..., out=...)), "
            f"as a prefill loop that keeps them from chunk to chunk does: the conv's own cost. "
            f"The conv prefill cases are measured under both allocator settings (the "
            f"'{THP_VAR}=1' rows in a subprocess started with that variable: 2 MiB-aligned "
            f"allocations advised as transparent huge pages, where the kernel's THP mode is 'madvise' or "
            f"'always'; current mode: {thp_mode()}).\n\n")
    body += table(["case", "path", "ms", "tokens/s", "GB/s", "of BW", "speedup"], rows)
    write_section("PLE (issue 2)" + (f", {args.section_suffix}" if args.section_suffix else ""), body)
    print(body)


if __name__ == "__main__":
    main()
