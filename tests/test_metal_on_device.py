"""The MPS kernels on a real Apple GPU (device="mps"): what the Linux emulator cannot show.

Skipped unless torch.backends.mps.is_available() and the extension was built with its MPS kernels
(macOS; .github/workflows/macos.yml runs it). Checks the glue end to end: the native MPS kernel is
registered, results match the reference computed on the CPU, tensors with a storage offset and
non-contiguous tensors are read correctly, values checked inside the kernels are reported through
the stream's error buffer and raised (torch.AcceleratorError) at the next synchronization, and
chunk invariance holds bitwise on the device.
"""

from __future__ import annotations

import pytest
import torch

import hebrus_torch
from hebrus_torch import reference
from hebrus_torch._extension import has_native_kernel
from hebrus_torch.errors import HebrusError

HAS_MPS = torch.backends.mps.is_available()
pytestmark = [pytest.mark.metal, pytest.mark.mps,
              pytest.mark.skipif(not HAS_MPS, reason="needs an Apple GPU (torch.backends.mps.is_available())")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OPS = ("ple_ngram_ids", "ple_conv", "ple_ngram_ids_slots", "ple_conv_slots", "qsa_pool", "qsa_select",
       "qsa_attention", "gdn_delta_rule", "gdn_delta_rule_slots", "gdn_chunk_delta_rule_slots")


def mps(*tensors):
    return [t.to("mps") for t in tensors]


def test_native_kernels_registered():
    missing = [op for op in OPS if not has_native_kernel(op, "mps")]
    assert not missing, f"no MPS kernel for {missing}: was the extension built on macOS with MPS?"


def conv_inputs(dtype, lengths=(0, 5, 1, 13, 0, 7), channels=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), channels, generator=g).to(dtype)
    w = (torch.randn(channels, 4, generator=g) / 4).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    state = torch.randn(len(lengths), 9, channels, generator=g).to(dtype)
    return x, w, cu, state


@pytest.mark.parametrize("dtype", DTYPES)
def test_ple_conv_matches_reference(dtype):
    x, w, cu, state = conv_inputs(dtype)
    y, new_state = hebrus_torch.ple_conv(*mps(x, w, cu, state), 3, "silu")
    y_ref, state_ref = reference.ple_conv(x, w, cu, state, 3, "silu")
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(y.cpu().float(), y_ref.float(), atol=tol, rtol=tol)
    assert torch.equal(new_state.cpu(), state_ref)


def test_ple_conv_storage_offset_and_strides():
    x, w, cu, state = conv_inputs(torch.float32)
    base = torch.randn(x.shape[0] + 3, x.shape[1]).to("mps")
    base[3:] = x.to("mps")
    x_offset = base[3:]  # contiguous, storage offset 3 rows
    w_t = w.t().contiguous().to("mps").t()  # non-contiguous view
    y, new_state = hebrus_torch.ple_conv(x_offset, w_t, cu.to("mps"), state.to("mps"), 3, "none")
    y_ref, state_ref = reference.ple_conv(x, w, cu, state, 3, "none")
    torch.testing.assert_close(y.cpu(), y_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(new_state.cpu(), state_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ple_conv_chunk_invariance_on_device(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 16, generator=g).to(dtype).to("mps")
    w = torch.randn(16, 4, generator=g).to(dtype).to("mps")
    state0 = torch.zeros(1, 9, 16, dtype=dtype, device="mps")
    whole, s_whole = hebrus_torch.ple_conv(x, w, torch.tensor([0, 12], dtype=torch.int32, device="mps"), state0)
    parts, state = [], state0
    for a, b in ((0, 1), (1, 3), (3, 4), (4, 12)):
        cu = torch.tensor([0, b - a], dtype=torch.int32, device="mps")
        y, state = hebrus_torch.ple_conv(x[a:b], w, cu, state)
        parts.append(y)
    assert torch.equal(torch.cat(parts).cpu(), whole.cpu()) and torch.equal(state.cpu(), s_whole.cpu())


def ngram_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = (0, 6, 1, 17, 3)
    tokens = torch.randint(0, 50, (sum(lengths),), generator=g)
    tokens[torch.rand(tokens.shape, generator=g) < 0.2] = 7
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    history = torch.randint(0, 50, (len(lengths), 2), generator=g)
    mult = torch.randint(1, 1 << 40, (3,), generator=g)
    sizes = torch.randint(1000, 100000, (16,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)[:-1]]) + 50
    return tokens, cu, history, mult, sizes, offsets


def test_ple_ngram_ids_matches_reference_exactly():
    args = ngram_inputs()
    got = hebrus_torch.ple_ngram_ids(*mps(*args), 7, 50)
    want = reference.ple_ngram_ids(*args, 7, 50)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_ple_ngram_ids_bad_token_raises():
    tokens, *rest = ngram_inputs()
    tokens[4] = 50
    # Reported through the stream's error buffer: the op returns at once, the next synchronization raises.
    hebrus_torch.ple_ngram_ids(*mps(tokens, *rest), 7, 50)
    with pytest.raises(torch.AcceleratorError, match=r"tokens\[4\] = 50 is outside \[0, vocab=50\)"):
        torch.mps.synchronize()
    torch.mps.synchronize()  # the error was consumed


@pytest.mark.parametrize("dtype", DTYPES)
def test_ple_conv_slots_updates_the_pool_in_place(dtype):
    x, w, cu, _ = conv_inputs(dtype)
    g = torch.Generator().manual_seed(4)
    pool = torch.randn(9, 9, x.shape[1], generator=g).to(dtype)
    slots = torch.tensor([8, 0, 3, 5, 1, 7], dtype=torch.int32)
    want_pool = pool.clone()
    want_y = hebrus_torch.ple.ops.ple_conv_slots(x, w, cu, want_pool, slots, 3, "silu")  # the CPU kernel
    got_pool = pool.to("mps")
    y = hebrus_torch.ple.ops.ple_conv_slots(*mps(x, w, cu), got_pool, slots.to("mps"), 3, "silu")
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(y.cpu().float(), want_y.float(), atol=tol, rtol=tol)
    assert torch.equal(got_pool.cpu(), want_pool)  # tails bitwise, rows 2, 4, 6 untouched


def test_ple_conv_slots_duplicate_slot_raises_at_synchronize():
    x, w, cu, _ = conv_inputs(torch.float32)
    pool = torch.zeros(9, 9, x.shape[1], device="mps")
    slots = torch.tensor([8, 0, 3, 0, 1, 7], dtype=torch.int32, device="mps")
    hebrus_torch.ple.ops.ple_conv_slots(*mps(x, w, cu), pool, slots, 3, "silu")
    with pytest.raises(torch.AcceleratorError, match=r"slot 0 appears twice in one batch \(rows 1 and 3\)"):
        torch.mps.synchronize()
    torch.mps.synchronize()


def test_ple_ngram_ids_slots_match_the_cpu_kernel():
    tokens, cu, history, mult, sizes, offsets = ngram_inputs()
    pool = torch.cat([history, torch.full((3, 2), 7)])[torch.tensor([5, 0, 7, 1, 2, 3, 4, 6])]
    slots = torch.tensor([1, 3, 4, 5, 0], dtype=torch.int32)
    want_pool = pool.clone()
    want = hebrus_torch.ple.ops.ple_ngram_ids_slots(tokens, cu, want_pool, slots, mult, sizes, offsets, 7, 50)
    got_pool = pool.to("mps")
    got = hebrus_torch.ple.ops.ple_ngram_ids_slots(*mps(tokens, cu), got_pool, *mps(slots, mult, sizes, offsets), 7,
                                                   50)
    assert torch.equal(got.cpu(), want) and torch.equal(got_pool.cpu(), want_pool)


def pool_inputs(dtype, groups=9, r=4, dim=128, rot=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    cells = groups * r + 3
    keys = torch.randn(cells, dim, generator=g).to(dtype)
    perm = torch.randperm(cells, generator=g)
    cell_pos = torch.empty(cells, dtype=torch.int64)
    cell_pos[perm] = torch.arange(cells) + 40
    group_pos = torch.arange(groups) * r + 40
    group_cells = perm[(group_pos - 40)[:, None] + torch.arange(r)].to(torch.int32)
    weight = (torch.randn(dim, generator=g) * 0.1).to(dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
    return keys, cell_pos, group_cells, group_pos, weight, 1e-6, inv_freq


@pytest.mark.parametrize("dtype", DTYPES)
def test_qsa_pool_matches_reference(dtype):
    keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq = pool_inputs(dtype)
    got = hebrus_torch.qsa_pool(*mps(keys, cell_pos, group_cells, group_pos, weight), eps, inv_freq.to("mps"))
    want = reference.qsa_pool(keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


def test_qsa_pool_hole_raises_from_the_kernel():
    keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq = pool_inputs(torch.float16)
    cell_pos[group_cells[4, 1]] += 100
    pooled = hebrus_torch.qsa_pool(*mps(keys, cell_pos, group_cells, group_pos, weight), eps, inv_freq.to("mps"))
    with pytest.raises(torch.AcceleratorError, match="hebrus::qsa_pool: group 4 .* member 1 "):
        torch.mps.synchronize()


def select_inputs(dtype, tq=13, hq=4, dim=32, batch=3, max_groups=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = batch * max_groups
    pooled = torch.randint(-2, 3, (rows, dim), generator=g).to(dtype)  # exact scores: bitwise selections
    q = torch.randint(-1, 2, (tq, hq, dim), generator=g).to(dtype)
    seq_groups = torch.randperm(rows, generator=g).view(batch, max_groups).to(torch.int32)
    q_row = torch.randint(0, batch, (tq,), generator=g).to(torch.int32)
    q_groups = torch.randint(0, max_groups + 1, (tq,), generator=g).to(torch.int32)
    return q, pooled, seq_groups, q_row, q_groups


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k", [1, 16, 300])
def test_qsa_select_matches_reference_exactly(dtype, top_k):
    args = select_inputs(dtype, seed=top_k)
    got = hebrus_torch.qsa_select(*mps(*args), top_k)
    assert torch.equal(got.cpu(), reference.qsa_select(*args, top_k))


def test_qsa_select_independent_of_batching_on_device():
    q, pooled, seq_groups, q_row, q_groups = mps(*select_inputs(torch.bfloat16, seed=5))
    whole = hebrus_torch.qsa_select(q, pooled, seq_groups, q_row, q_groups, 9)
    parts = [hebrus_torch.qsa_select(q[a:b], pooled, seq_groups, q_row[a:b], q_groups[a:b], 9)
             for a, b in ((0, 1), (1, 3), (3, 4), (4, 13))]
    assert torch.equal(torch.cat(parts).cpu(), whole.cpu())


def attention_inputs(dtype, tq=7, hq=8, hkv=2, dh=64, dv=48, cells=300, width=90, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, hq, dh, generator=g).to(dtype)
    k = torch.randn(cells, hkv, dh, generator=g).to(dtype)
    v = torch.randn(cells, hkv, dv, generator=g).to(dtype)
    tc = torch.randint(-2 ** 31, 0, (tq, width), generator=g, dtype=torch.int32)  # padding anywhere
    for t in range(tq):
        n = int(torch.randint(1, width + 1, (1,), generator=g))
        slots = torch.randperm(width, generator=g)[:n]
        tc[t, slots] = torch.randperm(cells, generator=g)[:n].to(torch.int32)
    return q, k, v, tc, dh ** -0.5


ATTENTION_SHAPES = {  # tq, hq, hkv, dh, dv, cells, width
    "gqa-8-2": (7, 8, 2, 64, 48, 300, 90),
    "gqa-4-1": (5, 4, 1, 128, 128, 200, 70),
    "rep-12": (3, 12, 1, 16, 80, 64, 65),
    "qwen4exp": (4, 16, 2, 256, 256, 3000, 2051),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
def test_qsa_attention_matches_reference(dtype, shape):
    q, k, v, tc, scale = attention_inputs(dtype, *ATTENTION_SHAPES[shape])
    got = hebrus_torch.qsa_attention(*mps(q, k, v, tc), scale)
    want = reference.qsa_attention(q, k, v, tc, scale)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert got.device.type == "mps" and got.dtype == dtype
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


def test_qsa_attention_storage_offset_and_strides():
    q, k, v, tc, scale = attention_inputs(torch.float32)
    kv = torch.cat([k, v], 2).to("mps")  # fused K/V plane: k and v are strided views
    k_view, v_view = kv[..., :k.shape[2]], kv[..., k.shape[2]:]
    base = torch.randn(q.shape[0] + 2, *q.shape[1:]).to("mps")
    base[2:] = q.to("mps")
    got = hebrus_torch.qsa_attention(base[2:], k_view, v_view, tc.to("mps"), scale)
    torch.testing.assert_close(got.cpu(), reference.qsa_attention(q, k, v, tc, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qsa_attention_reads_cache_row_views(dtype):
    # What the transformers drop-in passes: rows of a [B, Hkv, cells, D] cache transposed to
    # [cells, Hkv, D] (strides (D, cells * D, 1), a storage offset), read in place through strides;
    # bitwise the output of the same values passed contiguous.
    q, k, v, tc, scale = attention_inputs(dtype, dv=64)
    cache = torch.full((3, 2, k.shape[1], k.shape[0] + 4, k.shape[2]), float("nan"), dtype=dtype)
    cache[1, 0, :, 4:] = k.transpose(0, 1)
    cache[1, 1, :, 4:] = v.transpose(0, 1)
    cache = cache.to("mps")
    k_view, v_view = cache[1, 0, :, 4:].transpose(0, 1), cache[1, 1, :, 4:].transpose(0, 1)
    q, k, v, tc = mps(q, k, v, tc)
    got = hebrus_torch.qsa_attention(q, k_view, v_view, tc, scale)
    assert torch.equal(got.cpu(), hebrus_torch.qsa_attention(q, k, v, tc, scale).cpu())


@pytest.mark.parametrize("dtype", DTYPES)
def test_qsa_attention_batch_independence_on_device(dtype):
    *tensors, scale = attention_inputs(dtype, seed=3)
    q, k, v, tc = mps(*tensors)
    whole = hebrus_torch.qsa_attention(q, k, v, tc, scale)
    parts = [hebrus_torch.qsa_attention(q[a:b], k, v, tc[a:b], scale) for a, b in ((0, 1), (1, 4), (4, 7))]
    assert torch.equal(torch.cat(parts).cpu(), whole.cpu())
    assert torch.equal(hebrus_torch.qsa_attention(q, k, v, tc, scale).cpu(), whole.cpu())  # repeated run


@pytest.mark.parametrize("where", ["cell", "empty"])
def test_qsa_attention_bad_cells_raise_from_the_kernel(where):
    q, k, v, tc, scale = attention_inputs(torch.float16)
    if where == "cell":
        tc[4, 17] = k.shape[0]
        pattern = rf"query 4 selects cell {k.shape[0]} \(token_cells\[4, 17\]\), outside \[0, cells={k.shape[0]}\)"
    else:
        tc[2] = -1
        pattern = r"query 2 selects no cell"
    hebrus_torch.qsa_attention(*mps(q, k, v, tc), scale)
    with pytest.raises(torch.AcceleratorError, match=r"hebrus::qsa_attention: " + pattern):
        torch.mps.synchronize()


def test_qsa_attention_head_dim_limit():
    q, k, v, tc, scale = attention_inputs(torch.float32, dv=320)
    with pytest.raises(HebrusError, match="head dims up to 256"):
        hebrus_torch.qsa_attention(*mps(q, k, v, tc), scale)


# ---- gdn_delta_rule / gdn_delta_rule_slots ------------------------------------------------------------

def gdn_inputs(dtype, lengths=(3, 0, 10, 1), hk=2, hv=4, dk=128, dv=128, pool_slots=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    return dict(q=torch.randn(T, hk, dk, generator=g).to(dtype), k=torch.randn(T, hk, dk, generator=g).to(dtype),
                v=torch.randn(T, hv, dv, generator=g).to(dtype), g=(-torch.rand(T, hv, generator=g) * 0.5).to(dtype),
                beta=torch.rand(T, hv, generator=g).to(dtype),
                cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
                state_pool=torch.randn(pool_slots, hv, dk, dv, generator=g) * 0.3,
                slots=torch.tensor([6, 0, 3, 2], dtype=torch.int32)[: len(lengths)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_delta_rule_slots_matches_the_cpu_kernel(dtype):
    a = gdn_inputs(dtype)
    want_pool = a["state_pool"].clone()
    want = hebrus_torch.gdn.gated_delta_rule_slots(**{**a, "state_pool": want_pool})  # the CPU kernel
    got_pool = a["state_pool"].to("mps")
    got = hebrus_torch.gdn.gated_delta_rule_slots(**{**{k: t.to("mps") for k, t in a.items()}, "state_pool": got_pool})
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got_pool.cpu(), want_pool, atol=2e-5, rtol=2e-5)
    for s in (1, 4, 5):  # untouched slots
        assert torch.equal(got_pool[s].cpu(), a["state_pool"][s])


def test_gdn_delta_rule_chunk_invariance_on_device():
    a = {k: t.to("mps") for k, t in gdn_inputs(torch.bfloat16, lengths=(19,), hk=2, hv=4, dk=128, dv=64).items()}
    one = a["state_pool"].clone()
    out_one = hebrus_torch.gdn.gated_delta_rule_slots(**{**a, "state_pool": one})
    pool = a["state_pool"].clone()
    outs = []
    for lo, hi in ((0, 1), (1, 3), (3, 4), (4, 11), (11, 19)):
        part = {k: a[k][lo:hi] for k in ("q", "k", "v", "g", "beta")}
        cu = torch.tensor([0, hi - lo], dtype=torch.int32, device="mps")
        outs.append(hebrus_torch.gdn.gated_delta_rule_slots(**part, cu_seqlens=cu, state_pool=pool, slots=a["slots"]))
    assert torch.equal(torch.cat(outs).cpu(), out_one.cpu()) and torch.equal(pool.cpu(), one.cpu())


def test_gdn_delta_rule_slots_duplicate_slot_raises_at_synchronize():
    a = {k: t.to("mps") for k, t in gdn_inputs(torch.float32, dk=16, dv=8).items()}
    a["slots"] = torch.tensor([6, 0, 3, 0], dtype=torch.int32, device="mps")
    hebrus_torch.gdn.gated_delta_rule_slots(**a)
    with pytest.raises(torch.AcceleratorError, match=r"slot 0 appears twice in one batch \(rows 1 and 3\)"):
        torch.mps.synchronize()
    torch.mps.synchronize()


# ---- moe_experts, moe_experts_quantized, quantized_linear: both paths (issue 36) ---------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_experts_both_paths_match_the_cpu_op_and_each_other(dtype):
    """40 rows x top 2 over 8 experts take the grouped path, a row alone the decode path: the rows agree
    bitwise on the device, and with the CPU kernel within one rounding of x's dtype."""
    from test_moe_experts import REL_TOL, make_inputs

    args = make_inputs(40, 96, 48, 8, 2, dtype, seed=36)
    whole = hebrus_torch.moe_experts(*mps(*args)).cpu()
    for t in (0, 17, 39):
        one = hebrus_torch.moe_experts(*mps(args[0][t:t + 1], args[1][t:t + 1], args[2][t:t + 1], *args[3:]))
        assert torch.equal(one.cpu()[0], whole[t])
    want = hebrus_torch.moe_experts(*args)
    assert (whole.float() - want.float()).abs().max().item() <= REL_TOL[dtype] * want.float().abs().max().item()


def test_moe_experts_quantized_and_linear_both_paths_on_device():
    from test_moe_quantized import quantized_inputs
    from test_quantized_linear import linear_inputs

    x, ids, w, *rest = quantized_inputs(24, 128, 64, 6, 2, torch.bfloat16, 4, 64, seed=3)
    whole = hebrus_torch.moe_experts_quantized(*mps(x, ids, w, *rest[:6]), *rest[6:]).cpu()
    one = hebrus_torch.moe_experts_quantized(*mps(x[5:6], ids[5:6], w[5:6], *rest[:6]), *rest[6:]).cpu()
    assert torch.equal(one[0], whole[5])
    x, *rest = linear_inputs(20, 256, 37, torch.float16, 8, 32, seed=4)
    whole = hebrus_torch.quantized_linear(*mps(x, *rest[:3]), *rest[3:]).cpu()
    assert torch.equal(hebrus_torch.quantized_linear(*mps(x[7:8], *rest[:3]), *rest[3:]).cpu()[0], whole[7])


# ---- moe_shared_expert_quantized (issue 37) -----------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
def test_moe_shared_expert_quantized_on_device(bits):
    """The quantized shared expert's two launches: within roundings of the CPU kernel (the modules' bits), and a
    row alone gives that row of the whole launch, bitwise."""
    from moe_fused_cases import quantized_shared_args

    args = quantized_shared_args(9, 128, 64, torch.bfloat16, bits, 64, seed=bits)
    tensors, scalars = args[:12], args[12:]
    whole = hebrus_torch.moe_shared_expert_quantized(*mps(*tensors), *scalars).cpu()
    want = hebrus_torch.moe_shared_expert_quantized(*args)
    torch.testing.assert_close(whole.float(), want.float(), atol=3e-2, rtol=3e-2)   # (silu, sums in another order)
    one = hebrus_torch.moe_shared_expert_quantized(*mps(tensors[0][4:5], tensors[1][4:5], *tensors[2:11],
                                                        tensors[11][4:5]), *scalars).cpu()
    assert torch.equal(one[0], whole[4])
