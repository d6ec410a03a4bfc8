"""Gated-delta-net benchmarks, one function per comparison (more rows may be added as functions).

``holder_delta_rule_rows``: GDNState.delta_rule as it is (hebrus::gdn_delta_rule_slots on the holder's
pool in place, the undo entry copied first, inside a transaction as the engine runs a step) against
what it did before issue 25 (gather the rows' states, hebrus::gdn_delta_rule on the gathered copy, stage
it, commit with index_copy_ after copying the rows it replaces for an undo), side by side in one run, and
the op alone on a private contiguous state (no holder, no copies) as the floor. Decode (B rows x 1
token) and a prefill (1 row x T tokens), Hv value heads, Dk = Dv, on CPU with cold caches before each
timed call (a decode step finds its layer's states in DRAM).

Run: python benchmarks/bench_gdn.py [--repeat 5] [--write]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hebrus_torch as ht  # noqa: E402
from common import machine, table, timeit, write_section  # noqa: E402
from hebrus_torch.gdn import gated_delta_rule  # noqa: E402

SECTION = "GDNState.delta_rule: in-place slot op vs gather / op / scatter (issue 25)"


def step_inputs(T: int, hk: int, hv: int, dk: int, dv: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, hk, dk, generator=g)
    k = torch.randn(T, hk, dk, generator=g)
    v = torch.randn(T, hv, dv, generator=g)
    gate = -torch.rand(T, hv, generator=g)
    beta = torch.rand(T, hv, generator=g)
    return q, k, v, gate, beta


def holder_delta_rule_rows(B: int, tokens: int, *, hk: int, hv: int, dk: int, repeat: int) -> list[list[str]]:
    """The three paths at B rows x `tokens` tokens each; the pool holds 2B + 1 sequences, the rows' slots
    drawn at random (not the first B)."""
    dv = dk
    pool_size = 2 * B + 1
    state = ht.GDNState(1, num_key_heads=hk, num_value_heads=hv, key_head_dim=dk, value_head_dim=dv,
                        conv_kernel_size=4, max_sequences=pool_size)
    handles = [state.new_sequence() for _ in range(pool_size)]
    state.recurrent_state.copy_(torch.randn(state.recurrent_state.shape) * 0.3)
    order = torch.randperm(pool_size, generator=torch.Generator().manual_seed(1))[:B].tolist()
    seqs = [handles[i] for i in order]
    q, k, v, gate, beta = step_inputs(B * tokens, hk, hv, dk, dv)
    cu = torch.arange(0, B * tokens + 1, tokens, dtype=torch.int32)
    pool = state.recurrent_state[0]
    index = torch.tensor([h.slot for h in seqs], dtype=torch.int64)
    private = pool.index_select(0, index)

    def before():
        # What GDNState.delta_rule + the commit did before issue 25, without their Python bookkeeping.
        gathered = pool.index_select(0, index)                                 # _gather
        out, new = gated_delta_rule(q, k, v, gate, beta, cu, gathered, inplace=True)
        replaced = pool.index_select(0, index)                                 # _txn_prepare: kept for an undo
        pool.index_copy_(0, index, new)                                        # _txn_commit
        del replaced
        return out

    def holder():
        with ht.transaction(state):
            return state.delta_rule(0, seqs, cu, q, k, v, gate, beta)

    def op_alone():
        return gated_delta_rule(q, k, v, gate, beta, cu, private, inplace=True)[0]

    case = f"{B} row{'s' if B > 1 else ''} x {tokens} tok"
    t_before = timeit(before, repeat=repeat, cold=True)
    t_holder = timeit(holder, repeat=repeat, cold=True)
    t_op = timeit(op_alone, repeat=repeat, cold=True)
    state_mib = B * hv * dk * dv * 4 / (1 << 20)
    return [[case, f"{state_mib:.1f}", f"{t_before * 1e3:.2f}", f"{t_holder * 1e3:.2f}", f"{t_op * 1e3:.2f}",
             f"{t_before / t_holder:.2f}x", f"{t_op / t_holder:.2f}"]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--heads", type=int, default=8, help="Hv (value heads)")
    parser.add_argument("--key-heads", type=int, default=4, help="Hk")
    parser.add_argument("--dim", type=int, default=128, help="Dk = Dv")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--write", action="store_true", help="write the section into benchmarks/RESULTS.md")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for B in (1, 8, 64):
        rows += holder_delta_rule_rows(B, 1, hk=args.key_heads, hv=args.heads, dk=args.dim, repeat=args.repeat)
    rows += holder_delta_rule_rows(1, args.prefill, hk=args.key_heads, hv=args.heads, dk=args.dim, repeat=args.repeat)
    headers = ["case", "state MiB", "before: gather, op, staged, index_copy_ (ms)",
               "GDNState.delta_rule in a transaction (ms)", "op alone (ms)", "before / holder", "op / holder"]
    body = (f"Machine: {machine()}. CPU, fp32 state, Hv = {args.heads}, Hk = {args.key_heads}, Dk = Dv = {args.dim}; "
            f"median of {args.repeat} calls, each after a 1 GiB cache flush (benchmarks/common.py flush_caches); "
            "the pool holds 2B + 1 sequences, the rows' slots drawn at random. 'before' is the pre-issue-25 "
            "path without its Python bookkeeping; the holder row includes its transaction, its undo copy "
            "(logged before the in-place write) and its checks; 'op alone' is hebrus::gdn_delta_rule on a "
            "private contiguous state. Run: `python benchmarks/bench_gdn.py --write`.\n\n"
            + table(headers, rows))
    print(body)
    if args.write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
