"""hebrus::moe_experts (issue 36): the CPU kernel against the reference and transformers' grouped_mm
experts, batch independence and determinism, opcheck, torch.compile and every kind of bad input."""

from __future__ import annotations

import pytest
import torch

import hebrus_torch
from hebrus_torch import reference
from hebrus_torch.errors import HebrusError

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Largest error against the reference, relative to the output's largest magnitude: fp32 differs only in
# the summation order of the dot products; fp16/bf16 also round g, u, a, y to the dtype, where one
# order-induced ulp in an intermediate can move the output by about one ulp of the dtype.
# fp32: SPEC §5's 1e-5 (2e-6 held against the reference's matmuls on the Xeon's MKL, not on a Zen 3's: the reference
# sums in MKL's order, which depends on the CPU).
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def make_inputs(rows, hidden, inter, experts, top_k, dtype, *, seed=0, ids_dtype=torch.int64, weights_dtype=None,
                scale=None):
    g = torch.Generator().manual_seed(seed)
    scale = hidden ** -0.5 if scale is None else scale
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * scale).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(rows)] +
                      [torch.zeros(top_k, dtype=torch.int64)])[:rows]
    weights = torch.rand(rows, top_k, generator=g)
    weights = (weights / weights.sum(-1, keepdim=True).clamp(min=1e-6)).to(weights_dtype or dtype)
    return x, ids.to(ids_dtype), weights, gate_up, down


def assert_close_rel(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    scale = max(want.float().abs().max().item() if want.numel() else 0.0, 1e-6)
    assert err <= REL_TOL[dtype] * scale, f"max error {err} vs scale {scale}"


SHAPES = [  # rows, hidden, inter, experts, top_k
    (1, 64, 32, 4, 2),
    (7, 40, 24, 6, 3),      # H and I not multiples of 16 (zero-padded tails)
    (33, 48, 16, 8, 8),     # every expert hit by many rows
    (5, 31, 17, 3, 1),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(dtype, shape):
    args = make_inputs(*shape, dtype)
    got = hebrus_torch.moe_experts(*args)
    assert_close_rel(got, reference.moe_experts(*args), dtype)


@pytest.mark.parametrize("ids_dtype", (torch.int64, torch.int32))
@pytest.mark.parametrize("weights_dtype", (torch.float32, torch.bfloat16))
def test_id_and_weight_dtypes(ids_dtype, weights_dtype):
    args = make_inputs(6, 48, 32, 5, 2, torch.bfloat16, ids_dtype=ids_dtype, weights_dtype=weights_dtype)
    assert_close_rel(hebrus_torch.moe_experts(*args), reference.moe_experts(*args), torch.bfloat16)


def _reference_unrounded(x, ids, weights, gate_up, down):
    """The experts in float64 with no intermediate rounding (what every implementation approximates)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = gate_up[e].double() @ x[t].double()
            g, u = gu.chunk(2)
            out[t] += float(weights[t, j]) * (down[e].double() @ (torch.nn.functional.silu(g) * u))
    return out


def test_fp32_close_to_exact():
    args = make_inputs(4, 64, 32, 4, 2, torch.float32)
    got = hebrus_torch.moe_experts(*args).double()
    exact = _reference_unrounded(*args)
    assert (got - exact).abs().max().item() < 1e-5 * exact.abs().max().item()


def test_rows_independent_of_batch():
    """A row's output is bitwise the same alone, in any batch, at any position and thread count."""
    x, ids, w, gu, dn = make_inputs(24, 80, 48, 6, 3, torch.bfloat16)
    full = hebrus_torch.moe_experts(x, ids, w, gu, dn)
    for t in (0, 5, 23):
        alone = hebrus_torch.moe_experts(x[t:t + 1], ids[t:t + 1], w[t:t + 1], gu, dn)
        assert torch.equal(alone[0], full[t])
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(3))
    shuffled = hebrus_torch.moe_experts(x[perm], ids[perm], w[perm], gu, dn)
    assert torch.equal(shuffled, full[perm])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(hebrus_torch.moe_experts(x, ids, w, gu, dn), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_pairs_of_an_expert_give_the_tiles_bits(dtype):
    """An expert with fewer pairs than a tile (a decode step's one token) is read several weight rows at a time, the
    others a tile of pairs per row: both give every output the same bits. Odd sizes (intermediate 45, hidden 83)
    reach the loops' last columns, the lone last intermediate and the down rows past a whole four; 1, 2 and 3
    rows alone against the full batch (about 10 pairs per expert)."""
    x, ids, w, gu, dn = make_inputs(20, 83, 45, 4, 2, dtype, seed=7)
    full = hebrus_torch.moe_experts(x, ids, w, gu, dn)
    for a, b in ((0, 1), (3, 5), (17, 20)):
        part = hebrus_torch.moe_experts(x[a:b], ids[a:b], w[a:b], gu, dn)
        assert torch.equal(part, full[a:b])


def test_rows_past_the_first_chunk():
    """The kernel runs rows in chunks of its fp32 scratch (64 MiB): rows of a later chunk give the bits
    they give alone (H 2560, k 10: chunks of about 640 rows)."""
    x, ids, w, gu, dn = make_inputs(700, 2560, 16, 12, 10, torch.bfloat16)
    full = hebrus_torch.moe_experts(x, ids, w, gu, dn)
    for t in (0, 699):
        assert torch.equal(hebrus_torch.moe_experts(x[t:t + 1], ids[t:t + 1], w[t:t + 1], gu, dn)[0], full[t])


def test_transposed_weights_and_noncontiguous_rows():
    x, ids, w, gu, dn = make_inputs(5, 48, 16, 4, 2, torch.float32)
    wide = torch.zeros(5, 96)
    wide[:, ::2] = x
    down_t = dn.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(hebrus_torch.moe_experts(wide[:, ::2], ids, w, gu, down_t),
                       hebrus_torch.moe_experts(x, ids, w, gu, dn))


def test_empty_and_top_k_zero():
    x, ids, w, gu, dn = make_inputs(3, 32, 16, 4, 2, torch.float32)
    assert hebrus_torch.moe_experts(x[:0], ids[:0], w[:0], gu, dn).shape == (0, 32)
    out = hebrus_torch.moe_experts(x, ids[:, :0], w[:, :0], gu, dn)
    assert torch.equal(out, torch.zeros(3, 32))


def test_repeated_expert_counts_twice():
    x, ids, w, gu, dn = make_inputs(2, 32, 16, 4, 2, torch.float32)
    ids = torch.tensor([[1, 1], [2, 2]])
    w = torch.tensor([[0.25, 0.5], [1.0, 1.0]])
    once = hebrus_torch.moe_experts(x, ids[:, :1], torch.ones(2, 1), gu, dn)
    got = hebrus_torch.moe_experts(x, ids, w, gu, dn)
    torch.testing.assert_close(got, once * torch.tensor([[0.75], [2.0]]), rtol=1e-6, atol=1e-6)


# ---- against transformers' experts (the grouped_mm path the model runs) -----------------------------

def _hf_experts(hidden, inter, experts, top_k, dtype, gate_up, down):
    from hf_models import modeling, tiny_config

    config = tiny_config(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                         num_experts_per_tok=top_k)
    config._experts_implementation = "grouped_mm"
    module = modeling.Qwen4ExpTextExperts(config).to(dtype)
    with torch.no_grad():
        module.gate_up_proj.copy_(gate_up)
        module.down_proj.copy_(down)
    return module


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rows", (1, 8))
def test_matches_transformers_at_released_shapes(dtype, rows):
    """hidden 2560, I 640, top 10 (the released layer), 12 experts instead of 512 (memory)."""
    hidden, inter, experts, top_k = 2560, 640, 12, 10
    x, ids, w, gu, dn = make_inputs(rows, hidden, inter, experts, top_k, dtype, seed=rows)
    module = _hf_experts(hidden, inter, experts, top_k, dtype, gu, dn)
    with torch.no_grad():
        want = module(x, ids, w)
    got = hebrus_torch.moe_experts(x, ids, w, gu, dn)
    assert_close_rel(got, want, dtype)
    assert_close_rel(got, reference.moe_experts(x, ids, w, gu, dn), dtype)


# ---- opcheck, compile --------------------------------------------------------------------------------

def sample_inputs():
    for dtype in DTYPES:
        yield make_inputs(5, 48, 24, 4, 2, dtype)
    yield make_inputs(3, 40, 16, 3, 3, torch.float32, ids_dtype=torch.int32, weights_dtype=torch.bfloat16)
    yield make_inputs(0, 32, 16, 3, 2, torch.float32)


@pytest.mark.parametrize("args", list(sample_inputs()))
def test_opcheck(args):
    torch.library.opcheck(torch.ops.hebrus.moe_experts.default, args)


def test_compile_fullgraph():
    args = make_inputs(4, 32, 16, 4, 2, torch.float32)
    fn = torch.compile(hebrus_torch.moe_experts, fullgraph=True, backend="eager")
    assert torch.equal(fn(*args), hebrus_torch.moe_experts(*args))


def test_no_backward():
    x, ids, w, gu, dn = make_inputs(2, 32, 16, 4, 2, torch.float32)
    x.requires_grad_(True)
    with pytest.raises(RuntimeError, match="not implemented"):
        hebrus_torch.moe_experts(x, ids, w, gu, dn).sum().backward()


# ---- bad input: the kernel, the reference and the fake say the same -----------------------------------

def _bad_cases():
    x, ids, w, gu, dn = make_inputs(3, 32, 16, 4, 2, torch.float32)
    yield "x must be 2-D", (x[None], ids, w, gu, dn)
    yield "x must have dtype", (x.double(), ids, w, gu, dn)
    yield "topk_ids must have dtype torch.int64 or torch.int32", (x, ids.float(), w, gu, dn)
    yield "topk_ids must be 2-D", (x, ids[0], w, gu, dn)
    yield "topk_weights must be 2-D", (x, ids, w[0], gu, dn)
    yield "gate_up must be 3-D", (x, ids, w, gu[0], dn)
    yield "gate_up dtype torch.bfloat16 must match x dtype torch.float32", (x, ids, w, gu.bfloat16(), dn)
    yield "down dtype torch.float16 must match x dtype", (x, ids, w, gu, dn.half())
    yield r"topk_ids must have shape \(T, k\) with T = x.shape\[0\] = 3, got \(2, 2\)", (x, ids[:2], w, gu, dn)
    yield r"topk_weights must have the shape of topk_ids \(3, 2\), got \(3, 1\)", (x, ids, w[:, :1], gu, dn)
    yield r"gate_up must have shape \(E, 2 \* I, H\)", (x, ids, w, gu[:, :31], dn)
    yield r"gate_up must have shape \(E, 2 \* I, H\) .* H = x.shape\[1\] = 32", (x, ids, w, gu[:, :, :16], dn)
    yield r"down must have shape \(E, H, I\) = \(4, 32, 16\)", (x, ids, w, gu, dn[:, :, :8])
    yield r"down must have shape \(E, H, I\)", (x, ids, w, gu, dn[:3])


@pytest.mark.parametrize("message,args", list(_bad_cases()))
def test_bad_metadata(message, args):
    with pytest.raises(HebrusError, match="hebrus::moe_experts: " + message):
        hebrus_torch.moe_experts(*args)
    with pytest.raises(HebrusError, match="hebrus::moe_experts: " + message):
        reference.moe_experts(*args)
    fake = [torch.empty(a.shape, dtype=a.dtype, device="meta") for a in args]
    with pytest.raises(HebrusError, match="hebrus::moe_experts: " + message):
        torch.ops.hebrus.moe_experts.default(*fake)


@pytest.mark.parametrize("bad", (4, -1, 1 << 40))
def test_expert_id_out_of_range(bad):
    x, ids, w, gu, dn = make_inputs(3, 32, 16, 4, 2, torch.float32)
    ids = ids.clone()
    ids[2, 1] = bad
    message = rf"hebrus::moe_experts: topk_ids\[2, 1\] = {bad} is not an expert id in \[0, E=4\)"
    with pytest.raises(HebrusError, match=message):
        hebrus_torch.moe_experts(x, ids, w, gu, dn)
    with pytest.raises(HebrusError, match=message):
        reference.moe_experts(x, ids, w, gu, dn)
    if bad < (1 << 31):
        with pytest.raises(HebrusError, match=message):
            hebrus_torch.moe_experts(x, ids.int(), w, gu, dn)

