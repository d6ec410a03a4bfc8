"""The CPU kernels of the quantized ops (csrc/cpu/moe_kernels.cpp) give the folded dot product's exact bits
(docs/quantization.md: per lane of 16 the group's qx = fma(q, x, qx) and x summed in ascending order, acc + (qx * s + xs * b),
then reduce_lanes' pairwise tree) however the rows come: alone, in tiles of up to 4 rows of x against 4 weight rows,
in a short last tile (weight rows or rows of x), for every bit width, group size and dtype, and on every CPU
capability (AVX-512's table lookup of 4-bit codes, AVX2's 8-lane registers, the portable code)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import hebrus_torch
from hebrus_torch.moe.quantize import quantize, unpack
from test_moe_quantized import quantized_inputs
from test_quantized_linear import assert_same_bits_on_every_capability, linear_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LANES = 16


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c rounded once to fp32 (std::fma's bits) for fp32 tensors: the product is exact in fp64, the fp64 sum
    is corrected where its own rounding lands on a halfway point between two floats (the double rounding that
    ``(a * b + c).float()`` in fp64 alone would get wrong)."""
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    bp = s - cd
    err = (cd - (s - bp)) + (p - bp)                      # s + err == p + c exactly (TwoSum)
    r = s.float()
    d = s - r.double()
    other = torch.nextafter(r, torch.where(d > 0, torch.tensor(float("inf")), torch.tensor(float("-inf"))))
    halfway = (d != 0) & (other.double() - s == d)
    return torch.where(halfway & (err != 0) & ((err > 0) == (d > 0)), other, r)


def folded_bits(x: torch.Tensor, wq: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group: int,
                bits: int) -> torch.Tensor:
    """x [T, in] @ W.T in the kernels' exact order, one fp32 operation at a time (torch's elementwise ops round
    each to fp32), rounded to x's dtype: [T, out]."""
    rows, n = x.shape
    out_dim = wq.shape[0]
    chunks = group // LANES
    xv = x.float().reshape(rows, n // group, chunks, LANES)
    qv = unpack(wq, bits).float().reshape(out_dim, n // group, chunks, LANES)
    s, b = scales.float(), biases.float()
    acc = torch.zeros(rows, out_dim, LANES)
    for g in range(n // group):
        qx = torch.zeros(rows, out_dim, LANES)
        xs = torch.zeros(rows, LANES)
        for c in range(chunks):
            qx = fma32(qv[None, :, g, c].expand_as(qx), xv[:, None, g, c].expand_as(qx), qx)
            xs = xs + xv[:, g, c]
        acc = acc + (qx * s[None, :, g, None] + xs[:, None, :] * b[None, :, g, None])
    r = acc[..., :8] + acc[..., 8:]
    r = r[..., :4] + r[..., 4:]
    r = r[..., :2] + r[..., 2:]
    return (r[..., 0] + r[..., 1]).to(x.dtype)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128)])
def test_quantized_linear_is_the_folded_order_bit_for_bit(dtype, bits, group):
    """9 rows (tiles of 4, 4, 1) against 70 outputs (a block of 64, then 6: a full tile and a short one)."""
    x, wq, s, b, _, _ = linear_inputs(9, 256, 70, dtype, bits, group, seed=bits * group + 1)
    assert torch.equal(hebrus_torch.quantized_linear(x, wq, s, b, group, bits), folded_bits(x, wq, s, b, group, bits))


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, 64)])
@pytest.mark.parametrize("rows", (1, 2, 3, 5, 7))
def test_quantized_linear_short_tiles(bits, group, rows):
    """Odd row counts (a tile of 2 or 1 after tiles of 4) and out dims 1..5 (one short tile of weight rows)."""
    for out_dim in (1, 2, 3, 5):
        x, wq, s, b, _, _ = linear_inputs(rows, 128, out_dim, torch.bfloat16, bits, group, seed=rows * 10 + out_dim)
        assert torch.equal(hebrus_torch.quantized_linear(x, wq, s, b, group, bits),
                           folded_bits(x, wq, s, b, group, bits)), out_dim


@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32)])
def test_quantized_linear_chunk_invariance(bits, group):
    """13 rows cut into consecutive pieces of every size 1..13: each row's bits are those of the whole batch."""
    x, *rest = linear_inputs(13, 192, 37, torch.bfloat16, bits, group, seed=bits)
    whole = hebrus_torch.quantized_linear(x, *rest)
    for size in range(1, 14):
        parts = [hebrus_torch.quantized_linear(x[t:t + size], *rest) for t in range(0, 13, size)]
        assert torch.equal(torch.cat(parts), whole), size


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128)])
def test_moe_chunk_invariance(bits, group):
    """11 rows over 3 experts (each expert about 7 pairs: tiles of 4, 2 and 1 rows of x in both passes) cut into
    pieces of several sizes: the same bits."""
    x, ids, w, *rest = quantized_inputs(11, 128, 128, 3, 2, torch.bfloat16, bits, group, seed=bits + group)
    whole = hebrus_torch.moe_experts_quantized(x, ids, w, *rest)
    for size in (1, 2, 3, 4, 5, 6, 11):
        parts = [hebrus_torch.moe_experts_quantized(x[t:t + size], ids[t:t + size], w[t:t + size], *rest)
                 for t in range(0, 11, size)]
        assert torch.equal(torch.cat(parts), whole), size


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 64), (8, 128)])
def test_quantized_linear_rows_alone_and_in_batches_of_7_8_64(bits, group):
    """64 rows, alone (each chunk of codes unpacked in registers), in batches of 7 and 8 and all together (each
    tile's codes widened once into scratch, then read by row tiles of 4, 2 and 1): every row the folded order's
    bits whichever way it comes."""
    x, wq, s, b, _, _ = linear_inputs(64, 256, 22, torch.bfloat16, bits, group, seed=bits + group)
    whole = hebrus_torch.quantized_linear(x, wq, s, b, group, bits)
    assert torch.equal(whole, folded_bits(x, wq, s, b, group, bits))
    for size in (1, 7, 8):
        parts = [hebrus_torch.quantized_linear(x[t:t + size], wq, s, b, group, bits) for t in range(0, 64, size)]
        assert torch.equal(torch.cat(parts), whole), size


@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32)])
def test_moe_rows_alone_and_in_batches_of_7_8_64(bits, group):
    """64 rows over 4 experts, top 2 (about 32 pairs an expert at 64 rows, 3-4 at 7 or 8, 0-2 alone: the codes
    unpacked in registers or widened once per tile): each row's bits the same in every cut."""
    x, ids, w, *rest = quantized_inputs(64, 128, 128, 4, 2, torch.bfloat16, bits, group, seed=7 * bits + group)
    whole = hebrus_torch.moe_experts_quantized(x, ids, w, *rest)
    for size in (1, 7, 8):
        parts = [hebrus_torch.moe_experts_quantized(x[t:t + size], ids[t:t + size], w[t:t + size], *rest)
                 for t in range(0, 64, size)]
        assert torch.equal(torch.cat(parts), whole), size


_CAPABILITY_SCRIPT = """
import sys, torch, hebrus_torch
sys.path.insert(0, sys.argv[2])
from test_moe_quantized import quantized_inputs
outs = {}
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for bits, group in ((4, 32), (4, 128), (8, 64)):
        for rows in (1, 6, 24):
            args = quantized_inputs(rows, 128, 128, 3, 2, dtype, bits, group, seed=rows + bits)
            outs[f"{dtype} {bits} {rows}"] = hebrus_torch.moe_experts_quantized(*args)
torch.save(outs, sys.argv[1])
"""


def test_moe_every_cpu_capability_gives_the_same_bits(tmp_path):
    assert_same_bits_on_every_capability(tmp_path, _CAPABILITY_SCRIPT, os.path.join(ROOT, "tests"))


def test_released_shape_rows_alone_and_in_a_batch():
    """in_proj_qkv's input width (2560) at 4 bits / group 64: rows 0 and 5 of 6 alone equal the batch's."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 2560, generator=gen).bfloat16()
    w = (torch.randn(40, 2560, generator=gen) * 2560 ** -0.5).bfloat16()
    q = quantize(w, 4, 64)
    whole = hebrus_torch.quantized_linear(x, *q, 64, 4)
    assert torch.equal(whole, folded_bits(x, *q, 64, 4))
    for t in (0, 5):
        assert torch.equal(hebrus_torch.quantized_linear(x[t:t + 1], *q, 64, 4)[0], whole[t])


@pytest.mark.parametrize("bits", (4, 8))
def test_the_same_bits_at_every_thread_count(bits):
    """The work units (blocks of outputs, MoE items) are claimed by whichever thread is free
    (csrc/cpu/claim_pool.cpp): 1, 2 and 3 threads give the same bits, for a decode row and a batch."""
    lin = linear_inputs(24, 256, 300, torch.bfloat16, bits, 64, seed=bits)
    moe = quantized_inputs(24, 128, 128, 6, 3, torch.bfloat16, bits, 32, seed=bits)
    threads = torch.get_num_threads()
    outs = {}
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs[n] = [hebrus_torch.quantized_linear(*lin), hebrus_torch.quantized_linear(lin[0][:1], *lin[1:]),
                       hebrus_torch.moe_experts_quantized(*moe)]
    finally:
        torch.set_num_threads(threads)
    for n in (2, 3):
        for got, want in zip(outs[n], outs[1]):
            assert torch.equal(got, want), n


_FORK_SCRIPT = """
import os, sys, torch, hebrus_torch
sys.path.insert(0, sys.argv[1])
from test_quantized_linear import linear_inputs
torch.set_num_threads(2)
args = linear_inputs(8, 256, 300, torch.bfloat16, 4, 64)
want = hebrus_torch.quantized_linear(*args)          # the parent's pool has started its worker
pid = os.fork()
if pid == 0:
    torch.set_num_threads(2)
    os._exit(0 if torch.equal(hebrus_torch.quantized_linear(*args), want) else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_runs_the_ops_with_threads():
    """A child forked after the parent's pool started has none of its workers: it starts its own (no hang)."""
    done = subprocess.run([sys.executable, "-c", _FORK_SCRIPT, os.path.join(ROOT, "tests")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-4000:]


def test_workers_run_under_the_callers_flush_to_zero():
    """torch.set_flush_denormal sets the calling thread's modes only: the pool's workers take the caller's for its
    units, so products in the subnormal range flush alike whichever thread runs a block (2 threads against 1)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2560, generator=gen) * 1e-36
    q = quantize(torch.randn(4096, 2560, generator=gen) * 1e-3, 4, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        hebrus_torch.quantized_linear(x, *q, 64, 4)     # the workers start (a thread starts with its creator's modes)
        assert torch.set_flush_denormal(True)
        torch.set_num_threads(1)
        want = hebrus_torch.quantized_linear(x, *q, 64, 4)
        torch.set_num_threads(2)
        for _ in range(20):
            assert torch.equal(hebrus_torch.quantized_linear(x, *q, 64, 4), want)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    assert not torch.equal(hebrus_torch.quantized_linear(x, *q, 64, 4), want)   # the inputs do reach subnormals


def test_fma32_rounds_once():
    """The reference's fused multiply-add: 130 * (16519105 * 2^-55) + 1 is 1 + 2^-24 + 2^-54, just past the halfway
    point between 1 and 1 + 2^-23; fp64 alone rounds it to the halfway point, which fp32 then rounds to even (1)."""
    a = torch.tensor([130.0, 130.0, 3.0])
    b = torch.tensor([16519105 * 2.0 ** -55, -16519105 * 2.0 ** -55, 0.5])
    c = torch.tensor([1.0, -1.0, 0.25])
    assert fma32(a, b, c).tolist() == [1 + 2.0 ** -23, -(1 + 2.0 ** -23), 1.75]
    assert (a.double() * b.double() + c.double()).float().tolist()[:2] == [1.0, -1.0]
