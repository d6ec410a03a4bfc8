"""The slot-indexed PLE ops (issue 19): hebrus::ple_conv_slots and hebrus::ple_ngram_ids_slots read
and write a state pool in place by slot id. Bits equal the gather -> op -> scatter path on every
backend (CPU kernel, reference); untouched slots stay bitwise; duplicate or out-of-range slots are
refused before anything is written; opcheck; torch.compile(fullgraph=True)."""

import pytest
import torch

import hebrus_torch as ht
from hebrus_torch import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def pack(lengths, channels, dtype, gen):
    x = torch.randn(sum(lengths), channels, generator=gen).to(dtype)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return x, cu


def hash_params(n, h, gen):
    mult = torch.randint(1, 1 << 40, (n,), generator=gen) * 2 + 1
    sizes = torch.randint(50, 400, ((n - 1) * h,), generator=gen)
    offs = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)[:-1]])
    return mult, sizes, offs


CONV_CASES = [  # channels, width, dilation, activation, lengths (decode, prefill, empty rows, n >= L and < L)
    (40, 4, 3, "silu", [1] * 6),
    (33, 4, 3, "silu", [3, 0, 12, 1, 9]),
    (16, 3, 2, "none", [5, 0, 0, 2]),
    (24, 1, 1, "silu", [2, 3]),
    (1030, 4, 3, "silu", [1, 50, 2]),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(CONV_CASES)))
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_conv_slots_equals_gather_op_scatter(device, dtype, case, impl):
    channels, width, dilation, act, lengths = CONV_CASES[case]
    gen = torch.Generator().manual_seed(case)
    pool_slots, state_len = len(lengths) + 5, (width - 1) * dilation
    x, cu = pack(lengths, channels, dtype, gen)
    weight = torch.randn(channels, width, generator=gen).to(dtype)
    pool = torch.randn(pool_slots, state_len, channels, generator=gen).to(dtype)
    slots = torch.randperm(pool_slots, generator=gen)[: len(lengths)].to(torch.int32)
    x, cu, weight, pool, slots = (t.to(device) for t in (x, cu, weight, pool, slots))
    conv = ht.ple_conv if impl == "kernel" else reference.ple_conv
    conv_slots = ht.ple.ops.ple_conv_slots if impl == "kernel" else reference.ple_conv_slots
    want_pool = pool.clone()
    want_y, new_state = conv(x, weight, cu, want_pool.index_select(0, slots.long()), dilation, act)
    want_pool.index_copy_(0, slots.long(), new_state)
    got_pool = pool.clone()
    got_y = conv_slots(x, weight, cu, got_pool, slots, dilation, act)
    assert got_y.dtype == dtype and torch.equal(got_y, want_y)
    assert torch.equal(got_pool, want_pool)           # slots' tails updated, every other slot bitwise kept


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_slots_kernel_equals_reference(dtype):
    channels, width, dilation, act, lengths = CONV_CASES[1]
    gen = torch.Generator().manual_seed(7)
    x, cu = pack(lengths, channels, dtype, gen)
    weight = torch.randn(channels, width, generator=gen).to(dtype)
    pool = torch.randn(9, (width - 1) * dilation, channels, generator=gen).to(dtype)
    slots = torch.tensor([8, 0, 3, 5, 1], dtype=torch.int32)
    a, b = pool.clone(), pool.clone()
    ya = ht.ple.ops.ple_conv_slots(x, weight, cu, a, slots, dilation, act)
    yb = reference.ple_conv_slots(x, weight, cu, b, slots, dilation, act)
    assert torch.equal(ya, yb) and torch.equal(a, b)


def test_conv_slots_decode_chunk_invariant(device):
    """A stream fed token by token through the pool equals one shot (and the pool's bytes too)."""
    gen = torch.Generator().manual_seed(3)
    channels, n = 20, 11
    x = torch.randn(n, channels, generator=gen).to(device)
    weight = torch.randn(channels, 4, generator=gen).to(device)
    pools = [torch.zeros(3, 9, channels, device=device) for _ in range(2)]
    slot = torch.tensor([2], dtype=torch.int32, device=device)
    one = ht.ple.ops.ple_conv_slots(x, weight, torch.tensor([0, n], dtype=torch.int32, device=device), pools[0],
                                    slot, 3, "silu")
    steps = [ht.ple.ops.ple_conv_slots(x[t:t + 1], weight, torch.tensor([0, 1], dtype=torch.int32, device=device),
                                       pools[1], slot, 3, "silu") for t in range(n)]
    assert torch.equal(torch.cat(steps), one) and torch.equal(pools[0], pools[1])


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_ngram_ids_slots_equals_gather_op_scatter(device, impl):
    gen = torch.Generator().manual_seed(5)
    vocab, eos = 50, 3
    mult, sizes, offs = (t.to(device) for t in hash_params(3, 4, gen))
    lengths = [1, 0, 6, 2, 1]
    tokens = torch.randint(0, vocab, (sum(lengths),), generator=gen)
    tokens[::4] = eos
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    pool = torch.randint(0, vocab, (8, 2), generator=gen)
    pool[1] = eos
    slots = torch.tensor([6, 1, 0, 4, 7], dtype=torch.int32)
    tokens, cu, pool, slots = (t.to(device) for t in (tokens, cu, pool, slots))
    ids_fn = ht.ple_ngram_ids if impl == "kernel" else reference.ple_ngram_ids
    slots_fn = ht.ple.ops.ple_ngram_ids_slots if impl == "kernel" else reference.ple_ngram_ids_slots
    want_pool = pool.clone()
    want, new_h = ids_fn(tokens, cu, want_pool.index_select(0, slots.long()), mult, sizes, offs, eos, vocab)
    want_pool.index_copy_(0, slots.long(), new_h)
    got_pool = pool.clone()
    got = slots_fn(tokens, cu, got_pool, slots, mult, sizes, offs, eos, vocab)
    assert torch.equal(got, want) and torch.equal(got_pool, want_pool)


def conv_args(device="cpu"):
    gen = torch.Generator().manual_seed(0)
    return dict(x=torch.randn(3, 8, generator=gen).to(device), weight=torch.randn(8, 4, generator=gen).to(device),
                cu_seqlens=torch.tensor([0, 1, 3], dtype=torch.int32, device=device),
                state_pool=torch.randn(4, 9, 8, generator=gen).to(device),
                slots=torch.tensor([2, 0], dtype=torch.int32, device=device), dilation=3, activation="silu")


def ids_args(device="cpu"):
    gen = torch.Generator().manual_seed(0)
    mult, sizes, offs = hash_params(3, 2, gen)
    return dict(tokens=torch.tensor([1, 2, 3], device=device),
                cu_seqlens=torch.tensor([0, 1, 3], dtype=torch.int32, device=device),
                history_pool=torch.randint(0, 10, (4, 2), generator=gen).to(device),
                slots=torch.tensor([2, 0], dtype=torch.int32, device=device),
                multipliers=mult.to(device), vocab_sizes=sizes.to(device), offsets=offs.to(device), eos=0, vocab=10)


BAD_SLOTS = [([1, 1], r"slot 1 appears twice in one batch \(rows 0 and 1\)"),
             ([0, 4], r"slots\[1\] = 4 is outside \[0, S=4\)"),
             ([-1, 0], r"slots\[0\] = -1 is outside \[0, S=4\)")]


@pytest.mark.parametrize("bad,message", BAD_SLOTS)
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_bad_slots_are_refused_and_nothing_is_written(device, bad, message, impl):
    for op, args, pool_name in (("ple_conv_slots", conv_args(device), "state_pool"),
                                ("ple_ngram_ids_slots", ids_args(device), "history_pool")):
        args["slots"] = torch.tensor(bad, dtype=torch.int32, device=device)
        before = args[pool_name].clone()
        fn = getattr(ht.ple.ops, op) if impl == "kernel" else getattr(reference, op)
        with pytest.raises(ht.HebrusError, match=rf"hebrus::{op}: {message}"):
            fn(**args)
        assert torch.equal(args[pool_name], before)


def test_bad_metadata_is_refused(device):
    args = conv_args(device)
    args["slots"] = args["slots"].long()
    with pytest.raises(ht.HebrusError, match=r"hebrus::ple_conv_slots: slots must have dtype torch.int32"):
        ht.ple.ops.ple_conv_slots(**args)
    args = conv_args(device)
    args["slots"] = args["slots"][:1]
    with pytest.raises(ht.HebrusError, match=r"slots must have one entry per row \(B = 2\), got 1"):
        ht.ple.ops.ple_conv_slots(**args)
    args = conv_args(device)
    args["state_pool"] = args["state_pool"].transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ht.HebrusError, match=r"state_pool must be contiguous"):
        ht.ple.ops.ple_conv_slots(**args)
    args = conv_args(device)
    args["state_pool"] = torch.randn(4, 8, 8, device=device)
    with pytest.raises(ht.HebrusError, match=r"state_pool must have shape \(S, \(K-1\)\*dilation, C\) = \(S, 9, 8\)"):
        ht.ple.ops.ple_conv_slots(**args)
    args = ids_args(device)
    args["history_pool"] = torch.zeros(4, 3, dtype=torch.int64, device=device)
    with pytest.raises(ht.HebrusError, match=r"history_pool must have shape \(S, N-1\) = \(S, 2\)"):
        ht.ple.ops.ple_ngram_ids_slots(**args)
    # The pool may not alias an input it is read from while written.
    args = conv_args(device)
    args["x"] = args["state_pool"][0, :3]
    with pytest.raises(ht.HebrusError, match=r"state_pool shares memory with x"):
        ht.ple.ops.ple_conv_slots(**args)


def test_history_out_of_range_is_refused(device):
    args = ids_args(device)
    args["history_pool"][2, 1] = 99
    before = args["history_pool"].clone()
    with pytest.raises(ht.HebrusError, match=r"hebrus::ple_ngram_ids_slots: .*99 .*outside \[0, vocab=10\)"):
        ht.ple.ops.ple_ngram_ids_slots(**args)
    assert torch.equal(args["history_pool"], before)


def test_opcheck(device):
    torch.library.opcheck(torch.ops.hebrus.ple_conv_slots.default, tuple(conv_args(device).values()))
    torch.library.opcheck(torch.ops.hebrus.ple_ngram_ids_slots.default, tuple(ids_args(device).values()))
    for dtype in (torch.float16, torch.bfloat16):
        args = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                for k, v in conv_args(device).items()}
        torch.library.opcheck(torch.ops.hebrus.ple_conv_slots.default, tuple(args.values()))


def test_compile_decode_loop_matches_eager(device):
    gen = torch.Generator().manual_seed(2)
    channels, vocab, eos = 16, 30, 2
    weight = torch.randn(channels, 4, generator=gen).to(device)
    mult, sizes, offs = (t.to(device) for t in hash_params(3, 2, gen))
    slots = torch.tensor([3, 0, 5], dtype=torch.int32, device=device)
    cu = torch.arange(4, dtype=torch.int32, device=device)
    steps = [(torch.randint(0, vocab, (3,), generator=gen).to(device),
              torch.randn(3, channels, generator=gen).to(device)) for _ in range(4)]

    def loop(history_pool, state_pool):
        outs = []
        for tokens, x in steps:
            outs.append(ht.ple.ops.ple_ngram_ids_slots(tokens, cu, history_pool, slots, mult, sizes, offs, eos, vocab))
            outs.append(ht.ple.ops.ple_conv_slots(x, weight, cu, state_pool, slots, 3, "silu"))
        return outs

    pools = [(torch.full((6, 2), eos, device=device), torch.randn(6, 9, channels, generator=gen).to(device))]
    pools.append(tuple(p.clone() for p in pools[0]))
    torch._dynamo.reset()
    try:
        compiled = torch.compile(loop, fullgraph=True)(*pools[0])
    finally:
        torch._dynamo.reset()
    eager = loop(*pools[1])
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
    assert torch.equal(pools[0][0], pools[1][0]) and torch.equal(pools[0][1], pools[1][1])


def test_version_counter_is_bumped():
    args = conv_args()
    version = args["state_pool"]._version
    ht.ple.ops.ple_conv_slots(**args)
    assert args["state_pool"]._version > version


# The decode path of the CPU kernel (every row 0 or 1 token: each row's conv, then its tail update) and,
# on AVX2 CPUs without AVX-512, its hand-written bf16 kernel give the bits of the general path and of the
# portable code, NaN payloads, infinities and subnormals included. Each capability runs in a subprocess,
# because HEBRUS_CPU_CAPABILITY is read once per process.
_DECODE_BITS_SCRIPT = """
import sys, torch, hebrus_torch as ht
gen = torch.Generator().manual_seed(11)
SPECIAL = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, 1e38, -1e38, -0.0, 0.0, 88.0,
                        -88.0, 100.0, -100.0, 3e38, 65504.0, 7e-8])

def special(shape, dtype):
    x = torch.randn(shape, generator=gen) * 4
    flat = x.view(-1)
    at = torch.randperm(flat.numel(), generator=gen)[: flat.numel() // 9]
    flat[at] = SPECIAL[torch.randint(0, len(SPECIAL), (at.numel(),), generator=gen)]
    x = x.to(dtype)
    bits = x.view(torch.int16 if dtype != torch.float32 else torch.int32).view(-1)
    at = torch.randperm(bits.numel(), generator=gen)[: bits.numel() // 50]   # NaNs of every payload and sign
    if dtype == torch.float32:
        nan = 0x7F800001 + torch.randint(0, 1 << 22, (at.numel(),), generator=gen)
        bits[at] = (nan | (torch.randint(0, 2, (at.numel(),), generator=gen) << 31)).to(torch.int32)
    else:
        first = 0x7F81 if dtype == torch.bfloat16 else 0x7C01
        nan = first + torch.randint(0, 126 if dtype == torch.bfloat16 else 1022, (at.numel(),), generator=gen)
        bits[at] = (nan - (torch.randint(0, 2, (at.numel(),), generator=gen) << 16)).to(torch.int16)
    return x

outs = {}
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for channels, width, dilation, act, lengths in [(1031, 4, 3, "silu", [1] * 9), (1000, 4, 3, "none", [1, 0, 1, 1]),
                                                    (37, 4, 3, "silu", [1, 1, 0]), (2100, 4, 3, "silu", [1, 3, 0, 9]),
                                                    (515, 3, 2, "silu", [1, 1]), (700, 5, 4, "none", [1, 1, 1])]:
        x = special((sum(lengths), channels), dtype)
        weight = special((channels, width), dtype)
        pool = special((len(lengths) + 3, (width - 1) * dilation, channels), dtype)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        slots = torch.randperm(len(lengths) + 3, generator=gen)[: len(lengths)].to(torch.int32)
        key = f"{dtype} {channels} {width} {dilation} {act} {lengths}"
        got = pool.clone()
        outs[key + " y"] = ht.ple.ops.ple_conv_slots(x, weight, cu, got, slots, dilation, act)
        outs[key + " pool"] = got
        y, new_state = ht.ple_conv(x, weight, cu, pool.index_select(0, slots.long()), dilation, act)
        want = pool.clone()
        want.index_copy_(0, slots.long(), new_state)
        outs[key + " gathered y"], outs[key + " gathered pool"] = y, want
torch.save(outs, sys.argv[1])
"""


def _bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def test_conv_slots_decode_gives_the_bits_of_every_path_and_capability(tmp_path):
    import os
    import subprocess
    import sys

    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        pass
    capabilities = ["default"] + (["avx2"] if {"avx2", "fma", "f16c"} <= flags else []) + (
        ["avx512"] if "avx512f" in flags else [])
    results = {}
    for capability in capabilities:
        env = {k: v for k, v in os.environ.items() if k != "HEBRUS_CPU_CAPABILITY"}
        env["HEBRUS_CPU_CAPABILITY"] = capability
        out = tmp_path / f"{capability}.pt"
        done = subprocess.run([sys.executable, "-c", _DECODE_BITS_SCRIPT, str(out)], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
        results[capability] = torch.load(out)
    for capability, outs in results.items():
        for key, got in outs.items():
            if "gathered" not in key:   # the slot op equals gather -> ple_conv -> scatter
                head, what = key.rsplit(" ", 1)
                assert torch.equal(_bits(got), _bits(outs[f"{head} gathered {what}"])), (capability, key)
            assert torch.equal(_bits(got), _bits(results["default"][key])), (capability, key)
