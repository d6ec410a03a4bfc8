"""CPU cost of the indexed-attention layer's fused ops (issue 37) against the ATen sequences they replace,
at the released checkpoint's attention shapes (REAL_MODEL.md: 24 query heads and 2 KV heads of 256, partial
rotary 0.25 so R = 64; indexer 4 heads of 128; budget 2048 with r = 4, so top_k = 512), one thread, bf16.

* norm + RoPE of one layer: attention's q (a view of q_proj's [q | gate]), k and the indexer's q, as
  ``apply_rotary_pos_emb(Qwen4ExpTextRMSNorm(x))`` with the norm fused (``hc_rms_norm``, what the packed
  forward ran before) against three ``rms_norm_rope`` calls;
* the output gate: ``out * sigmoid(gate)`` on the gate half of q_proj's output made contiguous (what the
  packed forward ran before) against one ``sigmoid_gate``;
* the plan's token cells: ``group_and_tail_offsets`` + the gather ``QSACache.plan`` ran before against one
  ``qsa_token_cells``, for a decode step (one query over a 4,096-token run, 512 of its 1,024 groups
  selected) and a 512-token chunk (queries over the chunk's own run).

Old and new alternate within each repeat; the minimum over repeats is reported (the machine is shared).
Prints markdown rows; writes nothing.

    python benchmarks/bench_qsa_fused.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout's hebrus_torch

from transformers.models.qwen4_exp import modeling_qwen4_exp as modeling  # noqa: E402

from hebrus_torch.hc.premix import fused_norm  # noqa: E402
from hebrus_torch.qsa.ops import qsa_token_cells, rms_norm_rope, sigmoid_gate  # noqa: E402
from hebrus_torch.qsa.runs import group_and_tail_offsets  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, ROT = 24, 2, 256, 64
INDEX_HEADS, INDEX_DIM, TOP_K, R = 4, 128, 512, 4


def norm(dim: int, seed: int) -> torch.nn.Module:
    m = modeling.Qwen4ExpTextRMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        m.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(seed)) * 0.3)
    return m.to(torch.bfloat16)


def rope_case(tokens: int):
    g = torch.Generator().manual_seed(tokens)
    q = torch.randn(tokens, HEADS, 2 * HEAD_DIM, generator=g).to(torch.bfloat16)[..., :HEAD_DIM]
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    iq = torch.randn(tokens, INDEX_HEADS, INDEX_DIM, generator=g).to(torch.bfloat16)
    pos = torch.arange(tokens).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, ROT, 2).float() / ROT))
    cos, sin = torch.cat([pos, pos], -1).cos().to(torch.bfloat16), torch.cat([pos, pos], -1).sin().to(torch.bfloat16)
    norms = (norm(HEAD_DIM, 1), norm(HEAD_DIM, 2), norm(INDEX_DIM, 3))
    rope = modeling.apply_rotary_pos_emb

    def old():
        return [rope(fused_norm(n, x), cos=cos, sin=sin, unsqueeze_dim=1) for n, x in zip(norms, (q, k, iq))]

    def new():
        return [rms_norm_rope(x, n.weight, n.eps, cos, sin) for n, x in zip(norms, (q, k, iq))]

    assert all(torch.equal(a, b) for a, b in zip(old(), new()))
    return old, new


def gate_case(tokens: int):
    g = torch.Generator().manual_seed(tokens)
    out = torch.randn(tokens, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    gate = torch.randn(tokens, HEADS, 2 * HEAD_DIM, generator=g).to(torch.bfloat16)[..., HEAD_DIM:]

    def old():
        return out.reshape(tokens, -1).contiguous() * torch.sigmoid(gate.reshape(tokens, -1))

    def new():
        return sigmoid_gate(out, gate)

    assert torch.equal(old().view(tokens, HEADS, HEAD_DIM), new())
    return old, new


def cells_case(tokens: int, context: int):
    g = torch.Generator().manual_seed(context)
    nvis = torch.arange(context - tokens + 1, context + 1, dtype=torch.int64)
    first = torch.zeros(tokens, dtype=torch.int64)
    cells = torch.cat((torch.randperm(context, generator=g).to(torch.int32), torch.full((1,), -1, dtype=torch.int32)))
    selected = torch.full((tokens, TOP_K), -1, dtype=torch.int32)
    for t in range(tokens):
        groups = int(nvis[t]) // R
        pick = torch.sort(torch.randperm(groups, generator=g)[:TOP_K]).values
        selected[t, :pick.numel()] = pick.to(torch.int32)
    q_groups = (nvis // R).to(torch.int32)

    def old():
        offs = group_and_tail_offsets(selected.to(torch.int64), q_groups, nvis, R)
        at = torch.where(offs >= 0, first[:, None] + offs, context)
        return cells[at], offs

    def new():
        return qsa_token_cells(selected, nvis, first, cells, R)

    a, b = old(), new()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    return old, new


def timed(fn, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cases = [("norm + RoPE of q, k, indexer q", "decode (1 token)", *rope_case(1), 200),
             ("norm + RoPE of q, k, indexer q", "512-token chunk", *rope_case(512), 2),
             ("output gate", "decode (1 token)", *gate_case(1), 200),
             ("output gate", "512-token chunk", *gate_case(512), 5),
             ("token cells of the plan", "decode (1 query, 4,096-token run)", *cells_case(1, 4096), 200),
             ("token cells of the plan", "512-token chunk", *cells_case(512, 512), 2)]
    print(f"load average {os.getloadavg()[0]:.1f} at the start")
    print("| what | step | ATen sequence (before) | fused op (after) |")
    print("|---|---|---:|---:|")
    with torch.no_grad():
        for what, step, old, new, inner in cases:
            best_old = best_new = float("inf")
            for _ in range(args.repeats):
                best_old = min(best_old, timed(old, inner))
                best_new = min(best_new, timed(new, inner))
            unit, scale = ("us", 1e6) if best_old < 1e-3 else ("ms", 1e3)
            print(f"| {what} | {step} | {best_old * scale:.1f} {unit} | {best_new * scale:.1f} {unit} |")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
