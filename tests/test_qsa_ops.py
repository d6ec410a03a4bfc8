"""hebrus::qsa_pool and hebrus::qsa_select (SPEC §3, §5).

Parity with transformers' Qwen4ExpTextQSAIndexer inside a tiny model (prefill and decode, left
padding), the native kernel against the reference, the tie rule, query independence (of the
kernel and of the reference itself, near ties included), the reference's score order, holes,
opcheck, torch.compile and every kind of bad input.
"""

from __future__ import annotations

import math
import platform
import re

import pytest
import torch

import hebrus_torch as ht
from hebrus_torch import errors, reference
from hebrus_torch._extension import has_native_kernel

from conftest import ATOL, RTOL

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# The CPU kernel sums the RMSNorm squares in the order of ATen's x86 reduction, so there its pooled
# keys equal the reference's bit for bit; other CPUs agree within rounding.
BITWISE_POOL = platform.machine().lower() in ("x86_64", "amd64")
native_cpu = pytest.mark.skipif(not (has_native_kernel("qsa_pool", "cpu") and has_native_kernel("qsa_select", "cpu")),
                                reason="needs the compiled CPU kernels")


# ----------------------------------------------------------------------------------------------
# helpers


def inv_freq_for(half: int, theta: float = 10000.0) -> torch.Tensor:
    """Default RoPE inverse frequencies for a rotary part of 2*half dims."""
    return 1.0 / (theta ** (torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half)))


def pool_case(groups: int, gen: torch.Generator, *, r: int = 4, dim: int = 32, half: int = 8,
              dtype=torch.float32, first_pos: int = 0, spare: int = 5, device="cpu") -> list:
    """Raw keys in shuffled cells; group g holds positions first_pos + r*g .. + r-1 (a valid run)."""
    cells = groups * r + spare
    keys = torch.randn(cells, dim, generator=gen).to(dtype)
    perm = torch.randperm(cells, generator=gen)
    cell_pos = torch.empty(cells, dtype=torch.int64)
    cell_pos[perm] = first_pos + torch.arange(cells)  # cell perm[i] holds position first_pos + i
    group_pos = first_pos + r * torch.arange(groups)
    member = (group_pos[:, None] - first_pos + torch.arange(r)[None, :]).reshape(-1)
    group_cells = perm[member].view(groups, r).to(torch.int32)
    weight = torch.randn(dim, generator=gen) * 0.3
    args = [keys, cell_pos, group_cells, group_pos, weight, 1e-6, inv_freq_for(half)]
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def select_case(batch: int, max_groups: int, tq: int, hq: int, dim: int, gen: torch.Generator, *,
                dtype=torch.float32, device="cpu") -> list:
    """Ragged sequences whose groups sit at scattered pooled rows; queries with 0..n visible groups."""
    rows = batch * max_groups + 3
    pooled = torch.randn(rows, dim, generator=gen).to(dtype)
    lengths = torch.randint(0, max_groups + 1, (batch,), generator=gen)
    lengths[0] = max_groups
    perm = torch.randperm(rows, generator=gen)
    seq_groups = torch.full((batch, max_groups), -1, dtype=torch.int32)
    for b in range(batch):
        seq_groups[b, : lengths[b]] = perm[b * max_groups: b * max_groups + int(lengths[b])].to(torch.int32)
    q = torch.randn(tq, hq, dim, generator=gen).to(dtype)
    q_row = torch.randint(0, batch, (tq,), generator=gen).to(torch.int32)
    q_groups = (torch.rand(tq, generator=gen) * (lengths[q_row.long()] + 1)).floor().to(torch.int32)
    q_groups[0] = 0
    if tq > 1:
        q_row[1], q_groups[1] = 0, max_groups
    args = [q, pooled, seq_groups, q_row, q_groups]
    return [a.to(device) for a in args]


def assert_pool_equal(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if exact:
        assert torch.equal(got.cpu(), want.cpu()), (got.float() - want.float()).abs().max()
    else:
        torch.testing.assert_close(got.cpu(), want.cpu(), atol=ATOL[want.dtype], rtol=RTOL[want.dtype])


def brute_force_select(q, pooled, seq_groups, q_row, q_groups, top_k) -> torch.Tensor:
    """Per-query loop in float64 with an explicit (score desc, index asc) sort: a second oracle."""
    out = torch.full((q.shape[0], top_k), -1, dtype=torch.int32)
    for t in range(q.shape[0]):
        n = int(q_groups[t])
        keys = pooled.double()[seq_groups[int(q_row[t]), :n].long()]
        scores = torch.relu(q[t].double() @ keys.T).sum(0) / math.sqrt(q.shape[2])
        order = sorted(range(n), key=lambda g: (-float(scores[g]), g))[:top_k]
        out[t, : len(order)] = torch.tensor(sorted(order), dtype=torch.int32)
    return out


# ----------------------------------------------------------------------------------------------
# hand-checked cases


def test_pool_tiny_hand_checked():
    # One group of r=2 cells holding [1, 3] and [3, 5] -> mean [2, 4]; rms = sqrt(10); w = 0, so the
    # normed key is [2, 4] / sqrt(10); rotary part of 2 dims at position 0 is the identity.
    keys = torch.tensor([[3.0, 5.0], [9.0, 9.0], [1.0, 3.0]])
    out = ht.qsa_pool(keys, torch.tensor([8, 0, 7]), torch.tensor([[2, 0]], dtype=torch.int32),
                      torch.tensor([7]), torch.zeros(2), 0.0, torch.tensor([0.0]))
    torch.testing.assert_close(out, torch.tensor([[2.0, 4.0]]) / math.sqrt(10.0), atol=1e-6, rtol=0)


def test_pool_hand_checked_norm_weight_and_rope(device):
    # r = 4, D = 6, rotary part R = 4. Both groups' raw keys average (in fp32) to m = [1, 2, 2, 4, 2, 1]:
    # rms(m) = sqrt(30 / 6) = sqrt(5) over all D dims. (1 + w) = [1.5, 0.5, 2, 1, 3, 0], so the normed
    # key is s * [1.5, 1, 4, 4, 6, 0] with s = 1 / sqrt(5 + eps); eps = 3 is large so that the mean is seen
    # (RMSNorm of the sum 4m would give m / sqrt(5 + eps / 16)). RoPE (rotate-half: dim i pairs with
    # i + 2 on the first 4 dims, angle pos * inv_freq[i % 2]) at the group's FIRST position, 6 for group 0:
    # angles (pi/2, pi/4), so [a0, a1, a2, a3] -> [-a2, (a1 - a3)/sqrt2, a0, (a3 + a1)/sqrt2]; dims 4, 5 pass.
    m = torch.tensor([1.0, 2, 2, 4, 2, 1])
    d = torch.tensor([[1.0, -1, 0.5, 2, 0, -3], [-1.0, 1, -0.5, 0, 4, 1], [2.0, 0, 1, -2, -4, 1],
                      [-2.0, 0, -1, 0, 0, 1]])                     # each column sums to 0
    cell_pos = torch.tensor([9, 14, 6, 11, 8, 10, 13, 7, 12])
    keys = torch.full((9, 6), 99.0)                               # cell 1 (position 14) is in no group
    for cell, pos in enumerate(cell_pos.tolist()):
        if pos < 14:
            keys[cell] = m + (d[pos - 6] if pos < 10 else d[13 - pos])
    group_cells = torch.tensor([[2, 7, 4, 0], [5, 3, 8, 6]], dtype=torch.int32)   # positions 6..9, 10..13
    w = torch.tensor([0.5, -0.5, 1.0, 0.0, 2.0, -1.0])
    eps = 3.0
    inv_freq = torch.tensor([math.pi / 12, math.pi / 24])
    args = [t.to(device) for t in (keys, cell_pos, group_cells, torch.tensor([6, 10]), w)] + [eps, inv_freq.to(device)]
    s, r2 = 1.0 / math.sqrt(5.0 + eps), math.sqrt(2.0)
    a = [1.5 * s, 1.0 * s, 4.0 * s, 4.0 * s]
    group0 = [-a[2], (a[1] - a[3]) / r2, a[0], (a[3] + a[1]) / r2, 6 * s, 0.0]
    t0, t1 = 10 * math.pi / 12, 10 * math.pi / 24                 # group 1 starts at position 10
    group1 = [a[0] * math.cos(t0) - a[2] * math.sin(t0), a[1] * math.cos(t1) - a[3] * math.sin(t1),
              a[2] * math.cos(t0) + a[0] * math.sin(t0), a[3] * math.cos(t1) + a[1] * math.sin(t1), 6 * s, 0.0]
    want = torch.tensor([group0, group1])
    for pool in (ht.qsa_pool, reference.qsa_pool):
        got = pool(*args)
        assert got.dtype == torch.float32 and got.shape == (2, 6)
        torch.testing.assert_close(got.cpu(), want, atol=2e-6, rtol=0)


def test_select_tiny_hand_checked():
    # D = 4, sqrt(D) = 2; one head. Scores of the 5 groups: relu(q.k)/2 = [1, 0, 3, 3, 2].
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])
    pooled = torch.tensor([[2.0, 1, 1, 1], [-4.0, 1, 1, 1], [6.0, 0, 0, 0], [6.0, 9, 9, 9], [4.0, 0, 0, 0], [99.0, 0, 0, 0]])
    seq_groups = torch.tensor([[0, 1, 2, 3, 4]], dtype=torch.int32)
    row = torch.tensor([0], dtype=torch.int32)
    pick = lambda n, k: ht.qsa_select(q, pooled, seq_groups, row, torch.tensor([n], dtype=torch.int32), k)
    assert pick(5, 2).tolist() == [[2, 3]]            # tie 3 == 3 -> both; ascending
    assert pick(5, 3).tolist() == [[2, 3, 4]]
    assert pick(5, 1).tolist() == [[2]]               # tie broken by the lower group index
    assert pick(2, 1).tolist() == [[0]]               # only 2 groups visible
    assert pick(5, 7).tolist() == [[0, 1, 2, 3, 4, -1, -1]]
    assert pick(0, 2).tolist() == [[-1, -1]]


# ----------------------------------------------------------------------------------------------
# parity with transformers 5.23.0


@pytest.fixture(scope="module")
def hf():
    return pytest.importorskip("hf_models", reason="needs transformers==5.23.0")


HF_CONFIGS = {
    # R = D = 16, r = 4, top_k = 2
    "full_rope": dict(indexer_n_heads=2, indexer_head_dim=16, head_dim=16, indexer_budget=8),
    # partial rotary: R = 8 < D = 32, Hq = 4, top_k = 4
    "partial_rope": dict(indexer_n_heads=4, indexer_head_dim=32, head_dim=16, indexer_budget=16,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    # one query head, R = 8 < D = 24, r = 3, top_k = 3, large theta
    "r3": dict(indexer_n_heads=1, indexer_head_dim=24, head_dim=8, indexer_budget=9, indexer_compress_ratio=3,
               rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}


def hf_indexer_model(hf, name: str, seed: int):
    config = hf.tiny_indexer_config(**HF_CONFIGS[name])
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = hf.modeling.Qwen4ExpTextModel(config).eval()
    indexer = model.layers[1].self_attn.indexer
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms are zero-initialised and the projection is tiny: randomise them
        for norm in (indexer.q_layernorm, indexer.k_layernorm):
            norm.weight.copy_(torch.randn(norm.weight.shape, generator=gen) * 0.5)
        indexer.index_qk_proj.weight.copy_(torch.randn(indexer.index_qk_proj.weight.shape, generator=gen) * 0.3)
    calls: list = []
    indexer.register_forward_hook(lambda mod, args, out: calls.append((args, out)))
    return model, indexer, calls


def token_mask(selected: torch.Tensor, n_groups: torch.Tensor, p0: torch.Tensor, kv: int, r: int) -> torch.Tensor:
    """[B, S, K] token mask of the selected groups (-1 padded [B, S, k]) plus each query's raw tail."""
    batch, seq = n_groups.shape
    j = torch.arange(kv)
    qpos = kv - seq + torch.arange(seq)
    visible = (j[None, None, :] >= p0[:, None, None]) & (j[None, None, :] <= qpos[None, :, None])
    max_g = kv // r + 1
    onehot = torch.zeros(batch, seq, max_g + 1, dtype=torch.bool)
    onehot.scatter_(2, torch.where(selected >= 0, selected, max_g).long(), True)
    onehot[..., max_g] = False                                                         # the -1 padding
    token_group = (j[None, :] - p0[:, None]).clamp(min=0) // r                         # [B, K]
    in_group = torch.gather(onehot, 2, token_group.clamp(max=max_g)[:, None, :].expand(batch, seq, kv))
    in_tail = token_group[:, None, :] >= n_groups[:, :, None]
    return visible & (in_group | in_tail)


def hebrus_selection(hf, indexer, inv_freq, hidden_states, position_embeddings, attention_mask, raw_keys, positions,
                     device):
    """The indexer's selection rebuilt from qsa_pool + qsa_select, and transformers' scores.

    raw_keys: [B, K, D] every raw key of the call's KV range; positions: [B, K] their positions.
    Returns (selected [B, S, top_k], n_groups [B, S], p0 [B], hf_scores {(b, s): Tensor[n]}).
    """
    batch, seq, _ = hidden_states.shape
    kv = raw_keys.shape[1]
    r, dim, hq = indexer.compress_ratio, indexer.index_head_dim, indexer.index_n_heads
    cos, sin = position_embeddings
    assert 2 * inv_freq.shape[0] == cos.shape[-1]
    with torch.no_grad():  # q exactly as the indexer's forward builds it
        q = indexer.index_qk_proj(hidden_states)[..., : hq * dim].reshape(batch, seq, hq, dim)
        q = hf.modeling.apply_rotary_pos_emb(indexer.q_layernorm(q), cos=cos[:, -seq:], sin=sin[:, -seq:],
                                             unsqueeze_dim=2)
    visible = attention_mask[:, 0] if attention_mask.dtype == torch.bool else attention_mask[:, 0] == 0
    # Every row is one contiguous run starting at its first visible token: query i sees [p0, i].
    p0 = visible.any(dim=1).float().argmax(dim=1)                                      # [B]
    qpos = kv - seq + torch.arange(seq)                                                # kv index of each query
    j = torch.arange(kv)
    expected = (j[None, None, :] >= p0[:, None, None]) & (j[None, None, :] <= qpos[None, :, None])
    assert torch.equal(visible, expected), "the model's mask is not one run per row"
    n_groups = ((qpos[None, :] - p0[:, None] + 1).clamp(min=0)) // r                   # [B, S]
    groups_per_row = (kv - p0) // r
    max_g = int(groups_per_row.max())
    group_cells, group_pos, seq_groups = [], [], torch.full((batch, max(max_g, 1)), -1, dtype=torch.int32)
    for b in range(batch):
        g = torch.arange(int(groups_per_row[b]))
        starts = p0[b] + r * g
        group_cells.append(b * kv + starts[:, None] + torch.arange(r)[None, :])
        group_pos.append(positions[b, starts])
        seq_groups[b, : g.numel()] = (sum(int(x) for x in groups_per_row[:b]) + g).to(torch.int32)
    pooled = ht.qsa_pool(raw_keys.reshape(batch * kv, dim).to(device), positions.reshape(-1).to(device),
                         torch.cat(group_cells).to(torch.int32).to(device), torch.cat(group_pos).to(device),
                         indexer.k_layernorm.weight.detach().to(device), indexer.k_layernorm.eps, inv_freq.to(device))
    q_row = torch.arange(batch).repeat_interleave(seq).to(torch.int32)
    selected = ht.qsa_select(q.reshape(batch * seq, hq, dim).to(device), pooled, seq_groups.to(device),
                             q_row.to(device), n_groups.reshape(-1).to(torch.int32).to(device),
                             indexer.block_topk).cpu().view(batch, seq, -1)
    # transformers' scores, with the very expressions of Qwen4ExpTextQSAIndexer.forward
    hf_scores = {}
    with torch.no_grad():
        for b in range(batch):
            for s in range(seq):
                n = int(n_groups[b, s])
                if n == 0:
                    continue
                block_token_indices = p0[b] + torch.arange(n * r).view(n, r)
                key_groups = raw_keys[b].index_select(0, block_token_indices.flatten()).view(n, r, dim)
                pooled_keys = indexer.k_layernorm(key_groups.float().mean(dim=1).to(raw_keys.dtype))
                group_starts = block_token_indices[:, 0]
                block_key_states = hf.modeling.apply_rotary_pos_emb(
                    pooled_keys.unsqueeze(1), cos=cos[b].index_select(0, group_starts),
                    sin=sin[b].index_select(0, group_starts)).squeeze(1)
                scores = torch.matmul(q[b, s].float(), block_key_states.float().transpose(-1, -2)).transpose(-1, -2)
                hf_scores[b, s] = torch.relu(scores).sum(dim=-1) / math.sqrt(dim)
    return selected, n_groups, p0, hf_scores


@pytest.mark.hf
@pytest.mark.parametrize("name", list(HF_CONFIGS))
@pytest.mark.parametrize("prefill, pad, offset", [(7, 2, 0), (30, 5, 0), (41, 3, 4093)])
def test_selection_matches_transformers(hf, device, name, prefill, pad, offset):
    """Prefill + 3 decode steps, row 1 left padded; positions as generate() builds them (+offset).

    Exact ties are frequent (relu makes every group whose heads all score negative exactly 0) and
    transformers breaks them with torch.topk, whose order among equal values is unspecified; SPEC
    breaks them by the lower group index. So: our selection must equal SPEC's rule applied to
    transformers' own scores, transformers' mask must be "its groups + tail", and the two group sets
    may differ only by groups tied at the k-th score. Without such a tie the masks are identical.
    """
    model, indexer, calls = hf_indexer_model(hf, name, seed=prefill + pad)
    inv_freq = model.rotary_emb.inv_freq
    gen = torch.Generator().manual_seed(prefill)
    batch, r, top_k = 2, indexer.compress_ratio, indexer.block_topk
    ids = torch.randint(4, model.config.vocab_size, (batch, prefill), generator=gen)
    attn = torch.ones(batch, prefill, dtype=torch.long)
    attn[1, :pad] = 0
    pos = offset + (attn.cumsum(-1) - 1).masked_fill(attn == 0, 1)
    all_pos, raw = pos, []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
        for _ in range(3):
            ids = torch.randint(4, model.config.vocab_size, (batch, 1), generator=gen)
            attn = torch.cat([attn, torch.ones(batch, 1, dtype=torch.long)], dim=1)
            pos = all_pos[:, -1:] + 1
            all_pos = torch.cat([all_pos, pos], dim=1)
            out = model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=out.past_key_values,
                        use_cache=True)
    assert len(calls) == 4
    exact_queries = tied_queries = dropping_queries = 0
    for (hidden, pe, mask, _), hf_mask in calls:
        with torch.no_grad():
            raw.append(indexer.index_qk_proj(hidden)[..., indexer.index_n_heads * indexer.index_head_dim:])
        keys = torch.cat(raw, dim=1)
        kv, seq = keys.shape[1], hidden.shape[1]
        selected, n_groups, p0, hf_scores = hebrus_selection(hf, indexer, inv_freq, hidden, pe, mask, keys,
                                                             all_pos[:, :kv], device)
        hf_mask = hf_mask[:, 0]
        assert hf_mask.shape == (batch, seq, kv)
        hf_selected = torch.full_like(selected, -1)
        for b in range(batch):
            for s in range(seq):
                n = int(n_groups[b, s])
                if n == 0:
                    continue
                starts = p0[b] + r * torch.arange(n)
                hf_groups = torch.nonzero(hf_mask[b, s, starts]).flatten()
                hf_selected[b, s, : hf_groups.numel()] = hf_groups.to(torch.int32)
                scores = hf_scores[b, s]
                rule = sorted(sorted(range(n), key=lambda g: (-float(scores[g]), g))[:top_k])
                assert selected[b, s, : len(rule)].tolist() == rule, (b, s, scores)
                assert hf_groups.numel() == len(rule)
                kth = torch.sort(scores, descending=True).values[len(rule) - 1]
                differ = set(rule) ^ set(hf_groups.tolist())
                assert all(float(scores[g]) == float(kth) for g in differ), (b, s, differ, scores)
                exact_queries += not differ
                tied_queries += bool(differ)
                dropping_queries += n > top_k
        assert torch.equal(token_mask(hf_selected, n_groups, p0, kv, r), hf_mask)  # groups + tail, nothing else
        if all(bool(torch.equal(selected[b, s], hf_selected[b, s])) for b in range(batch) for s in range(seq)):
            assert torch.equal(token_mask(selected, n_groups, p0, kv, r), hf_mask)
    assert exact_queries > tied_queries
    if prefill + 3 >= indexer.token_budget + r:  # the longer cases must rank, not just keep everything
        assert dropping_queries > 0


@pytest.mark.hf
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", ["full_rope", "partial_rope"])
def test_pool_matches_transformers_expression(hf, device, dtype, name):
    """Pooled keys vs the indexer's own expression (mean, k_layernorm, apply_rotary_pos_emb)."""
    config = hf.tiny_indexer_config(**HF_CONFIGS[name])
    rope = hf.modeling.Qwen4ExpTextRotaryEmbedding(config)
    r, dim = config.indexer_compress_ratio, config.indexer_head_dim
    gen = torch.Generator().manual_seed(3)
    norm = hf.modeling.Qwen4ExpTextRMSNorm(dim, eps=config.rms_norm_eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=gen) * 0.5)
    norm = norm.to(dtype)  # as in a model loaded in dtype: the weight too
    length, first = 4 * r * 5 + 2, 3
    positions = 2000 + torch.arange(length)
    raw = (torch.randn(length, dim, generator=gen) * 2).to(dtype)
    n_groups = (length - first) // r
    block_token_indices = first + torch.arange(n_groups * r).view(n_groups, r)
    with torch.no_grad():
        key_groups = raw.index_select(0, block_token_indices.flatten()).view(n_groups, r, dim)
        pooled = norm(key_groups.float().mean(dim=1).to(dtype))
        cos, sin = rope(raw[None], positions[None])
        starts = block_token_indices[:, 0]
        want = hf.modeling.apply_rotary_pos_emb(pooled.unsqueeze(1), cos=cos[0].index_select(0, starts),
                                                sin=sin[0].index_select(0, starts)).squeeze(1)
    got = ht.qsa_pool(raw.to(device), positions.to(device), block_token_indices.to(torch.int32).to(device),
                      positions[starts].to(device), norm.weight.detach().to(device), norm.eps,
                      rope.inv_freq.to(device))
    exact = device == "cpu" and BITWISE_POOL
    assert_pool_equal(got, want, exact=exact)
    if dtype == torch.float32:
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------------
# native kernel vs reference


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("dim, half", [(16, 8), (128, 32), (256, 128), (40, 0), (24, 4)])
@pytest.mark.parametrize("r", [1, 3, 4])
def test_pool_matches_reference(device, dtype, dim, half, r):
    gen = torch.Generator().manual_seed(dim * 7 + r)
    args = pool_case(37, gen, r=r, dim=dim, half=half, dtype=dtype, first_pos=r * 1000 + 1, device=device)
    args[4] = args[4].to(torch.bfloat16 if dtype == torch.float16 else args[4].dtype)  # weight of another dtype
    got = torch.ops.hebrus.qsa_pool(*args)
    want = reference.qsa_pool(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    assert_pool_equal(got, want, exact=device == "cpu" and BITWISE_POOL)


def test_pool_empty_and_strided(device):
    gen = torch.Generator().manual_seed(1)
    keys, cell_pos, group_cells, group_pos, w, eps, inv = pool_case(9, gen, dim=32, device=device)
    empty = ht.qsa_pool(keys, cell_pos, group_cells[:0], group_pos[:0], w, eps, inv)
    assert empty.shape == (0, 32) and empty.dtype == keys.dtype
    wide = torch.randn(keys.shape[0], 64, generator=gen).to(device)
    wide[:, ::2] = keys                               # a non-contiguous keys view
    got = ht.qsa_pool(wide[:, ::2], cell_pos, group_cells.t().contiguous().t(), group_pos, w, eps, inv)
    assert torch.equal(got, ht.qsa_pool(keys, cell_pos, group_cells, group_pos, w, eps, inv))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("dim", [16, 20, 128, 256])  # 20: not a multiple of the 8-wide transpose
@pytest.mark.parametrize("hq", [1, 4])
def test_select_matches_reference(device, dtype, dim, hq):
    gen = torch.Generator().manual_seed(dim + hq)
    args = select_case(3, 90, 64, hq, dim, gen, dtype=dtype, device=device)
    cpu_args = [a.cpu() for a in args]
    for top_k in (1, 5, 40, 200):  # 200 > every sequence's group count
        got = torch.ops.hebrus.qsa_select(*args, top_k)
        assert got.dtype == torch.int32 and got.shape == (64, top_k)
        want = reference.qsa_select(*cpu_args, top_k)
        assert torch.equal(got.cpu(), want), (got.cpu() != want).any(1).nonzero().flatten()
    if dtype == torch.float32 and dim == 16:
        assert torch.equal(torch.ops.hebrus.qsa_select(*args, 5).cpu(), brute_force_select(*cpu_args, 5))


def test_select_mixed_dtypes(device):
    gen = torch.Generator().manual_seed(14)
    q, pooled, seq_groups, q_row, q_groups = select_case(2, 70, 30, 4, 64, gen)
    for q_dtype, p_dtype in ((torch.float32, torch.bfloat16), (torch.float16, torch.float32)):
        args = (q.to(q_dtype), pooled.to(p_dtype), seq_groups, q_row, q_groups)
        got = ht.qsa_select(*[a.to(device) for a in args], 9).cpu()
        assert torch.equal(got, reference.qsa_select(*args, 9))


def test_select_output_properties(device):
    gen = torch.Generator().manual_seed(5)
    q, pooled, seq_groups, q_row, q_groups = select_case(4, 50, 80, 4, 32, gen, device=device)
    top_k = 7
    out = ht.qsa_select(q, pooled, seq_groups, q_row, q_groups, top_k).cpu()
    n = q_groups.cpu().long()
    kept = torch.minimum(n, torch.tensor(top_k))
    assert torch.equal((out >= 0).sum(1), kept)                          # min(top_k, n) groups, then -1
    for t in range(out.shape[0]):
        row = out[t, : int(kept[t])]
        assert torch.equal(row, torch.sort(row).values) and row.unique().numel() == row.numel()
        assert bool((row < n[t]).all()) and bool((out[t, int(kept[t]):] == -1).all())
    assert bool((out[n.cpu() == 0] == -1).all())


def test_select_decode_split_matches_reference(device):
    """One query over many groups: the CPU kernel splits the range over threads and merges."""
    gen = torch.Generator().manual_seed(11)
    groups = 5000
    pooled = torch.randn(groups + 2, 64, generator=gen)
    seq_groups = torch.randperm(groups + 2, generator=gen)[:groups].to(torch.int32)[None]
    q = torch.randn(3, 4, 64, generator=gen)
    q_row = torch.zeros(3, dtype=torch.int32)
    q_groups = torch.tensor([groups, groups - 1, 2500], dtype=torch.int32)
    args = [a.to(device) for a in (q, pooled, seq_groups, q_row, q_groups)]
    for top_k in (16, 512):
        want = reference.qsa_select(q, pooled, seq_groups, q_row, q_groups, top_k)
        assert torch.equal(ht.qsa_select(*args, top_k).cpu(), want)
        assert torch.equal(ht.qsa_select(*[a[:1] if i != 1 and i != 2 else a for i, a in enumerate(args)],
                                         top_k).cpu(), want[:1])


# ----------------------------------------------------------------------------------------------
# tie rule, NaN, independence


def test_select_ties_lower_index_wins(device):
    # Pooled rows take 3 distinct values; equal rows give bitwise-equal scores, so the order of
    # the kept groups is decided by the group index alone.
    gen = torch.Generator().manual_seed(2)
    groups, dim, hq = 3000, 32, 2
    level = torch.randint(0, 3, (groups,), generator=gen)
    pooled = (level.float() + 1.0)[:, None] * torch.ones(groups, dim)
    q = torch.ones(4, hq, dim)
    seq_groups = torch.arange(groups, dtype=torch.int32)[None]
    q_row = torch.zeros(4, dtype=torch.int32)
    q_groups = torch.tensor([groups, 1000, 37, 2999], dtype=torch.int32)
    args = [a.to(device) for a in (q, pooled, seq_groups, q_row, q_groups)]
    for top_k in (1, 10, 500, 1500):
        got = ht.qsa_select(*args, top_k).cpu()
        for t in range(4):
            n = int(q_groups[t])
            order = sorted(range(n), key=lambda g: (-int(level[g]), g))[:top_k]
            want = sorted(order) + [-1] * (top_k - len(order))
            assert got[t].tolist() == want
        assert torch.equal(got, reference.qsa_select(q, pooled, seq_groups, q_row, q_groups, top_k))
    # All groups tie: the first top_k groups.
    flat = ht.qsa_select(args[0], torch.ones(groups, dim, device=device), *args[2:], 6).cpu()
    assert flat.tolist() == [list(range(6))] * 4


def test_select_nan_ranks_first_like_torch_sort(device):
    gen = torch.Generator().manual_seed(4)
    q, pooled, seq_groups, q_row, q_groups = select_case(2, 40, 20, 2, 16, gen)
    pooled[seq_groups[0, 7]] = float("nan")
    pooled[seq_groups[0, 3]] = float("nan")
    want = reference.qsa_select(q, pooled, seq_groups, q_row, q_groups, 4)
    got = ht.qsa_select(*[a.to(device) for a in (q, pooled, seq_groups, q_row, q_groups)], 4).cpu()
    assert torch.equal(got, want)
    sees = (q_row == 0) & (q_groups > 7)
    assert bool(sees.any()) and bool((got[sees] == 7).any(1).all()) and bool((got[sees] == 3).any(1).all())


def test_select_query_independent_of_batch(device):
    gen = torch.Generator().manual_seed(9)
    tq, groups, top_k = 96, 2600, 24
    pooled = torch.randn(2 * groups, 64, generator=gen)
    seq_groups = torch.stack([torch.arange(groups), groups + torch.randperm(groups, generator=gen)]).to(torch.int32)
    q = torch.randn(tq, 4, 64, generator=gen)
    q_row = (torch.arange(tq) % 3 == 0).to(torch.int32)                 # interleaved sequences
    q_groups = torch.randint(0, groups + 1, (tq,), generator=gen).to(torch.int32)
    q_groups[:40] = torch.arange(2560, 2600)                            # a prefill-like run
    dev = lambda *ts: [t.to(device) for t in ts]
    full = ht.qsa_select(*dev(q, pooled, seq_groups, q_row, q_groups), top_k).cpu()
    for m in (1, 17, 64):                                              # prefixes
        assert torch.equal(ht.qsa_select(*dev(q[:m], pooled, seq_groups, q_row[:m], q_groups[:m]), top_k).cpu(),
                           full[:m])
    for t in (0, 5, 41, tq - 1):                                       # one query alone (split path)
        alone = ht.qsa_select(*dev(q[t:t + 1], pooled, seq_groups, q_row[t:t + 1], q_groups[t:t + 1]), top_k)
        assert torch.equal(alone.cpu(), full[t:t + 1])
    perm = torch.randperm(tq, generator=gen)
    shuffled = ht.qsa_select(*dev(q[perm], pooled, seq_groups, q_row[perm], q_groups[perm]), top_k).cpu()
    assert torch.equal(shuffled, full[perm])
    # other queries' data changes nothing
    q2 = q.clone()
    q2[1::2] = torch.randn(q2[1::2].shape, generator=gen)
    other = ht.qsa_select(*dev(q2, pooled, seq_groups, q_row, q_groups), top_k).cpu()
    assert torch.equal(other[0::2], full[0::2])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ht.qsa_select(*dev(q, pooled, seq_groups, q_row, q_groups), top_k).cpu(), full)
    finally:
        torch.set_num_threads(threads)


def _near_tie_case(gen: torch.Generator, tq: int = 40, groups: int = 300, hq: int = 5, dim: int = 40):
    """Three strong keys, each as 14 exact copies and 6 one-ulp neighbours scattered over the groups.

    Copies must score bitwise equal (so the lower group index wins the tie) and neighbours must
    keep their own order, whatever the other queries of the call: a matmul's blocking changes the
    summation order with the batch and so the last bits of near-tied scores.
    """
    pooled = torch.randn(groups, dim, generator=gen) * 0.3
    base = torch.randn(3, dim, generator=gen) * 3.0
    slots = torch.randperm(groups, generator=gen)[:60].view(3, 20)
    for b in range(3):
        pooled[slots[b, :14]] = base[b]
        pooled[slots[b, 14:16]] = torch.nextafter(base[b], torch.full((dim,), math.inf))   # every dim up
        pooled[slots[b, 16:18]] = torch.nextafter(base[b], torch.full((dim,), -math.inf))  # every dim down
        for i, d in ((18, 0), (19, dim - 1)):                                              # one dim up
            pooled[slots[b, i]] = base[b]
            pooled[slots[b, i], d] = torch.nextafter(base[b, d], torch.tensor(math.inf))
    q = torch.randn(tq, hq, dim, generator=gen)
    seq_groups = torch.randperm(groups + 7, generator=gen)[:groups].to(torch.int32)[None]
    pooled_rows = torch.zeros(groups + 7, dim)
    pooled_rows[seq_groups[0].long()] = pooled
    q_row = torch.zeros(tq, dtype=torch.int32)
    q_groups = torch.full((tq,), groups, dtype=torch.int32)
    q_groups[::4] = torch.randint(60, groups, (len(range(0, tq, 4)),), generator=gen).to(torch.int32)
    return q, pooled_rows, seq_groups, q_row, q_groups, slots


def test_reference_select_query_independent_of_batch():
    """SPEC §5.1 for the reference itself (the kernel of every device without a native one): a
    query alone and inside a batch of 40 gets bitwise the same scores and selection, near ties
    included, and exact copies of a key break to the lower group index."""
    gen = torch.Generator().manual_seed(31)
    q, pooled, seq_groups, q_row, q_groups, slots = _near_tie_case(gen)
    tq = q.shape[0]
    for top_k in (5, 14, 23, 47):
        full = reference.qsa_select(q, pooled, seq_groups, q_row, q_groups, top_k)
        for t in range(tq):
            alone = reference.qsa_select(q[t:t + 1], pooled, seq_groups, q_row[t:t + 1], q_groups[t:t + 1], top_k)
            assert torch.equal(alone[0], full[t]), (top_k, t, alone[0].tolist(), full[t].tolist())
        for m in (2, 17):
            part = reference.qsa_select(q[:m], pooled, seq_groups, q_row[:m], q_groups[:m], top_k)
            assert torch.equal(part, full[:m]), top_k
        perm = torch.randperm(tq, generator=gen)
        assert torch.equal(reference.qsa_select(q[perm], pooled, seq_groups, q_row[perm], q_groups[perm], top_k),
                           full[perm])
    # The scores themselves: bitwise equal alone and in the batch; copies tie exactly.
    keys = pooled[seq_groups[0].long()]
    scores = reference.qsa_scores(q, keys)
    for t in range(tq):
        assert torch.equal(reference.qsa_scores(q[t:t + 1], keys)[0], scores[t]), t
    assert torch.equal(reference.qsa_scores(q, keys[:77]), scores[:, :77])
    for b in range(3):
        assert bool((scores[:, slots[b, :14]] == scores[:, slots[b, :1]]).all())
    # The selection is SPEC's rule on those scores: higher score first, then the lower group.
    top_k = 14
    full = reference.qsa_select(q, pooled, seq_groups, q_row, q_groups, top_k)
    # Inputs that require grad (a model called outside no_grad) select the same groups.
    grad_args = (q.clone().requires_grad_(), pooled.clone().requires_grad_(), seq_groups, q_row, q_groups)
    assert torch.equal(reference.qsa_select(*grad_args, top_k), full)
    for t in range(tq):
        n, s = int(q_groups[t]), scores[t].tolist()
        assert full[t].tolist() == sorted(sorted(range(n), key=lambda g: (-s[g], g))[:top_k]), t


def test_reference_scores_follow_the_kernel_order():
    """qsa_scores' arithmetic written out one fp32 operation at a time (numpy float32 scalars):
    products rounded, lane j sums dims j mod 16 ascending from 0 (D zero padded to a multiple of
    16), lanes combine j + 8, + 4, + 2, + 1, heads add in order onto 0, then a true division by
    float(sqrt(D)). The CPU kernel (csrc/cpu/qsa_kernels.cpp score_rows) does exactly this."""
    np = pytest.importorskip("numpy")
    gen = torch.Generator().manual_seed(8)
    f32 = np.float32
    for dim, hq in ((5, 2), (16, 1), (37, 3)):
        q = torch.randn(2, hq, dim, generator=gen)
        keys = torch.randn(3, dim, generator=gen)
        got = reference.qsa_scores(q, keys)
        pad = -(-dim // 16) * 16
        qn = np.zeros((2, hq, pad), dtype=f32)
        kn = np.zeros((3, pad), dtype=f32)
        qn[..., :dim], kn[:, :dim] = q.numpy(), keys.numpy()
        for t in range(2):
            for g in range(3):
                total = f32(0)
                for h in range(hq):
                    lanes = [f32(0)] * 16
                    for d in range(pad):
                        lanes[d % 16] = f32(lanes[d % 16] + f32(qn[t, h, d] * kn[g, d]))
                    for width in (8, 4, 2, 1):
                        lanes = [f32(lanes[j] + lanes[j + width]) for j in range(width)]
                    total = f32(total + max(lanes[0], f32(0)))
                want = f32(total / f32(math.sqrt(dim)))
                assert got[t, g].item() == float(want), (dim, hq, t, g)


@native_cpu
def test_reference_select_equals_cpu_kernel_on_random_cases():
    """Same score arithmetic, so the reference and the CPU kernel select the same groups bitwise on
    random inputs: every float dtype, D not a multiple of 16, exact ties (rounded keys, copied rows,
    all-negative queries scoring 0), one-ulp neighbours and NaN keys."""
    gen = torch.Generator().manual_seed(2024)
    for case in range(300):
        dim = (1, 7, 16, 20, 33, 64)[case % 6]
        dtype = FLOATS[case % 3]
        hq = int(torch.randint(1, 7, (1,), generator=gen))
        rows = int(torch.randint(1, 150, (1,), generator=gen))
        max_g = int(torch.randint(1, 120, (1,), generator=gen))
        tq = int(torch.randint(1, 12, (1,), generator=gen))
        top_k = int(torch.randint(1, 30, (1,), generator=gen))
        q = torch.randn(tq, hq, dim, generator=gen)
        if case % 5 == 0:
            q = -q.abs()
        pooled = torch.randn(rows, dim, generator=gen).abs()
        if case % 7 == 0:
            pooled = torch.round(pooled)
        if case % 4 == 1 and rows > 6:
            pooled[3] = pooled[5] = pooled[0]
            pooled[4] = torch.nextafter(pooled[0], torch.full((dim,), math.inf))
        if case % 11 == 0 and rows > 2:
            pooled[1] = math.nan
        q, pooled = q.to(dtype), pooled.to(dtype)
        seq_groups = torch.randint(0, rows, (3, max_g), generator=gen).to(torch.int32)
        q_row = torch.randint(0, 3, (tq,), generator=gen).to(torch.int32)
        q_groups = torch.randint(0, max_g + 1, (tq,), generator=gen).to(torch.int32)
        args = (q, pooled, seq_groups, q_row, q_groups, top_k)
        want = torch.ops.hebrus.qsa_select(*args)
        got = reference.qsa_select(*args)
        assert torch.equal(got, want), (case, (got != want).any(1).nonzero().flatten().tolist())


# ----------------------------------------------------------------------------------------------
# holes


def _hole_case(device):
    gen = torch.Generator().manual_seed(6)
    return pool_case(6, gen, r=4, dim=16, half=4, first_pos=100, device=device)


def test_hole_raises_through_wrapper(device):
    keys, cell_pos, group_cells, group_pos, w, eps, inv = _hole_case(device)
    holed = cell_pos.clone()
    holed[group_cells[3, 2].long()] += 1000                          # group 3 (positions 112..115) loses 114
    holed[group_cells[1, 1].long()] = 9                               # group 1 (104..107) too, earlier
    with pytest.raises(ht.HoleError, match=r"^hebrus::qsa_pool: group 1 starting at position 104 has position 9 "
                                           r"in member 1 where 105 is required"):
        ht.qsa_pool(keys, holed, group_cells, group_pos, w, eps, inv)
    # The same hole from the reference: same class, same message.
    with pytest.raises(ht.HoleError, match=r"group 1 starting at position 104 has position 9 in member 1"):
        reference.qsa_pool(*[a.cpu() if isinstance(a, torch.Tensor) else a
                             for a in (keys, holed, group_cells, group_pos, w, eps, inv)])
    # Member order matters: two members swapped is a hole too.
    swapped = group_cells.clone()
    swapped[4, [0, 1]] = swapped[4, [1, 0]]
    with pytest.raises(ht.HoleError, match=r"group 4 starting at position 116 has position 117 in member 0"):
        ht.qsa_pool(keys, cell_pos, swapped, group_pos, w, eps, inv)
    # A cell listed twice (reused cell) cannot hold two positions.
    twice = group_cells.clone()
    twice[5, 3] = twice[5, 2]
    with pytest.raises(ht.HoleError, match=r"group 5 starting at position 120 has position 122 in member 3 "
                                           r"where 123 is required"):
        ht.qsa_pool(keys, cell_pos, twice, group_pos, w, eps, inv)
    # A wrong anchor position is a hole as well.
    with pytest.raises(ht.HoleError, match=r"group 0 starting at position 101 has position 100 in member 0"):
        ht.qsa_pool(keys, cell_pos, group_cells, group_pos + (torch.arange(6, device=device) == 0).long(), w, eps, inv)


@native_cpu
def test_hole_raises_from_the_cpu_kernel_directly():
    keys, cell_pos, group_cells, group_pos, w, eps, inv = _hole_case("cpu")
    holed = cell_pos.clone()
    holed[group_cells[2, 3].long()] = -5
    with pytest.raises(ValueError, match=re.escape("[HoleError]")) as info:
        torch.ops.hebrus.qsa_pool.default(keys, holed, group_cells, group_pos, w, eps, inv)
    assert not isinstance(info.value, ht.HebrusError)
    mapped = errors.translate(info.value)
    assert type(mapped) is ht.HoleError
    assert str(mapped).startswith("hebrus::qsa_pool: group 2 starting at position 108 has position -5 in member 3 "
                                  "where 111 is required")


def test_out_of_range_cell_index(device):
    keys, cell_pos, group_cells, group_pos, w, eps, inv = _hole_case(device)
    cells = keys.shape[0]
    for bad, g, i in ((cells, 2, 1), (-1, 0, 3)):
        gc = group_cells.clone()
        gc[g, i] = bad
        with pytest.raises(ht.HebrusError, match=rf"group {g} cell {i} = {bad} is outside \[0, {cells}\)") as info:
            ht.qsa_pool(keys, cell_pos, gc, group_pos, w, eps, inv)
        assert not isinstance(info.value, ht.HoleError)


# ----------------------------------------------------------------------------------------------
# opcheck and torch.compile


def _opcheck_samples(device):
    gen = torch.Generator().manual_seed(8)
    pools = [pool_case(5, gen, dim=16, half=4, device=device),
             pool_case(3, gen, r=2, dim=32, half=16, dtype=torch.bfloat16, first_pos=77, device=device),
             pool_case(0, gen, dim=8, half=0, dtype=torch.float16, device=device)]
    selects = [select_case(2, 30, 9, 4, 16, gen, device=device) + [4],
               select_case(3, 12, 5, 1, 32, gen, dtype=torch.float16, device=device) + [40],
               select_case(1, 6, 1, 2, 8, gen, dtype=torch.bfloat16, device=device) + [1]]
    return pools, selects


def test_opcheck(device):
    pools, selects = _opcheck_samples(device)
    for args in pools:
        torch.library.opcheck(torch.ops.hebrus.qsa_pool.default, tuple(args))
    for args in selects:
        torch.library.opcheck(torch.ops.hebrus.qsa_select.default, tuple(args))


def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(12)
    keys, cell_pos, group_cells, group_pos, w, eps, inv = pool_case(40, gen, dim=32, half=8, device=device)
    q = torch.randn(25, 4, 32, generator=gen).to(device)
    seq_groups = torch.stack([torch.arange(40), torch.randperm(40, generator=gen)]).to(torch.int32).to(device)
    q_row = torch.randint(0, 2, (25,), generator=gen).to(torch.int32).to(device)
    q_groups = torch.randint(0, 41, (25,), generator=gen).to(torch.int32).to(device)

    def pool_then_select(keys, cell_pos, group_cells, group_pos, w, inv, q, seq_groups, q_row, q_groups):
        pooled = ht.qsa_pool(keys, cell_pos, group_cells, group_pos, w, 1e-6, inv)
        return pooled, ht.qsa_select(q, pooled, seq_groups, q_row, q_groups, 6)

    args = (keys, cell_pos, group_cells, group_pos, w, inv, q, seq_groups, q_row, q_groups)
    compiled = torch.compile(pool_then_select, fullgraph=True)
    got, want = compiled(*args), pool_then_select(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ----------------------------------------------------------------------------------------------
# bad input


def _pool_good():
    return pool_case(4, torch.Generator().manual_seed(0), dim=32, half=8)


def _select_good():
    return select_case(2, 5, 6, 4, 32, torch.Generator().manual_seed(0)) + [3]


def _set(args, i, value):
    args = list(args)
    args[i] = value
    return args


POOL_BAD = {
    "keys 1-D": (lambda a: _set(a, 0, a[0][:, 0]), r"keys must be 2-D, got shape \(21,\)"),
    "keys int": (lambda a: _set(a, 0, a[0].to(torch.int32)), r"keys must have dtype torch.float32 or torch.float16 or "
                                                              r"torch.bfloat16, got torch.int32"),
    "keys f64": (lambda a: _set(a, 0, a[0].double()), r"keys must have dtype .*, got torch.float64"),
    "cell_pos i32": (lambda a: _set(a, 1, a[1].int()), r"cell_pos must have dtype torch.int64, got torch.int32"),
    "cell_pos 2-D": (lambda a: _set(a, 1, a[1][None]), r"cell_pos must be 1-D, got shape \(1, 21\)"),
    "cell_pos len": (lambda a: _set(a, 1, a[1][:-1]), r"cell_pos must have one entry per cell \(21\), got 20"),
    "group_cells i64": (lambda a: _set(a, 2, a[2].long()), r"group_cells must have dtype torch.int32, got torch.int64"),
    "group_cells 1-D": (lambda a: _set(a, 2, a[2].flatten()), r"group_cells must be 2-D, got shape \(16,\)"),
    "r = 0": (lambda a: _set(a, 2, a[2][:, :0]), r"group_cells must have r >= 1 columns"),
    "group_pos len": (lambda a: _set(a, 3, a[3][:3]), r"group_pos must have one entry per group \(4\), got 3"),
    "group_pos i32": (lambda a: _set(a, 3, a[3].int()), r"group_pos must have dtype torch.int64, got torch.int32"),
    "weight len": (lambda a: _set(a, 4, a[4][:31]), r"norm_weight must have D = 32 entries, got 31"),
    "weight int": (lambda a: _set(a, 4, a[4].long()), r"norm_weight must have dtype .*, got torch.int64"),
    "eps < 0": (lambda a: _set(a, 5, -1.0), r"eps must be >= 0, got -1"),
    "inv_freq f16": (lambda a: _set(a, 6, a[6].half()), r"inv_freq must have dtype torch.float32, got torch.float16"),
    "inv_freq 2-D": (lambda a: _set(a, 6, a[6][None]), r"inv_freq must be 1-D"),
    "rotary > D": (lambda a: _set(a, 6, inv_freq_for(17)), r"rotary dims 2\*17 exceed head dim 32"),
}

POOL_LIMITS = {
    "D > 256": (lambda a: pool_case(2, torch.Generator().manual_seed(0), dim=260, half=8),
                r"head dim D must be at most 256 on CPU, got 260"),
}

SELECT_BAD = {
    "q 2-D": (lambda a: _set(a, 0, a[0][:, 0]), r"q must be 3-D, got shape \(6, 32\)"),
    "q int": (lambda a: _set(a, 0, a[0].long()), r"q must have dtype .*, got torch.int64"),
    "pooled 3-D": (lambda a: _set(a, 1, a[1][None]), r"pooled must be 2-D"),
    "pooled f64": (lambda a: _set(a, 1, a[1].double()), r"pooled must have dtype .*, got torch.float64"),
    "dim mismatch": (lambda a: _set(a, 1, a[1][:, :16]), r"q head dim 32 must equal pooled dim 16"),
    "seq_groups i64": (lambda a: _set(a, 2, a[2].long()), r"seq_groups must have dtype torch.int32, got torch.int64"),
    "seq_groups 1-D": (lambda a: _set(a, 2, a[2][0]), r"seq_groups must be 2-D"),
    "q_row i64": (lambda a: _set(a, 3, a[3].long()), r"q_row must have dtype torch.int32, got torch.int64"),
    "q_groups i64": (lambda a: _set(a, 4, a[4].long()), r"q_groups must have dtype torch.int32, got torch.int64"),
    "q_row len": (lambda a: _set(a, 3, a[3][:5]), r"q_row and q_groups must have Tq = 6 entries, got 5 and 6"),
    "q_groups len": (lambda a: _set(a, 4, a[4][:0]), r"q_row and q_groups must have Tq = 6 entries, got 6 and 0"),
    "top_k 0": (lambda a: _set(a, 5, 0), r"top_k must be in \[1, 2147483647\] \(group indices are int32\), got 0"),
    "top_k < 0": (lambda a: _set(a, 5, -3), r"top_k must be in \[1, 2147483647\].*got -3"),
    "top_k past int32": (lambda a: _set(a, 5, 2**40), r"top_k must be in \[1, 2147483647\].*got 1099511627776"),
    "q_row = B": (lambda a: _set(a, 3, torch.tensor([0, 1, 1, 2, 0, 1], dtype=torch.int32)),
                  r"q_row\[3\] = 2 is outside \[0, B=2\)"),
    "q_row < 0": (lambda a: _set(a, 3, torch.tensor([0, -1, 1, 0, 0, 1], dtype=torch.int32)),
                  r"q_row\[1\] = -1 is outside \[0, B=2\)"),
    "q_groups > maxG": (lambda a: _set(a, 4, torch.tensor([0, 1, 6, 2, 0, 1], dtype=torch.int32)),
                        r"q_groups\[2\] = 6 is outside \[0, maxG=5\]"),
    "q_groups < 0": (lambda a: _set(a, 4, torch.tensor([0, 1, 2, 2, -2, 1], dtype=torch.int32)),
                     r"q_groups\[4\] = -2 is outside \[0, maxG=5\]"),
    "seq_groups entry": (lambda a: _bad_seq_groups(a), r"seq_groups\[1, 2\] = 13 is outside \[0, rows=13\); "
                                                       r"the first 4 groups of row 1 are visible to its queries"),
}

SELECT_LIMITS = {
    "top_k > 4096": (lambda a: _set(a, 5, 4097), r"top_k must be at most 4096 on CPU, got 4097"),
    "Hq > 64": (lambda a: _set(a, 0, torch.randn(6, 65, 32)), r"query heads Hq must be at most 64 on CPU, got 65"),
    "D > 256": (lambda a: _set(_set(a, 0, torch.randn(6, 4, 257)), 1, torch.randn(13, 257)),
                r"head dim D must be at most 256 on CPU, got 257"),
}


def _bad_seq_groups(args):
    args = list(args)
    q_row = torch.tensor([0, 1, 1, 0, 1, 1], dtype=torch.int32)
    q_groups = torch.tensor([5, 2, 4, 1, 0, 3], dtype=torch.int32)
    seq_groups = torch.stack([torch.arange(5), torch.tensor([5, 6, 13, 7, -1])]).to(torch.int32)
    return [args[0], args[1], seq_groups, q_row, q_groups, args[5]]


def _direct_call(op, args):
    try:
        return op(*args)
    except (ValueError, RuntimeError) as exc:
        raise errors.translate(exc) from None


@pytest.mark.parametrize("case", list(POOL_BAD))
def test_pool_bad_input(case):
    make, pattern = POOL_BAD[case]
    args = make(_pool_good())
    with pytest.raises(ht.HebrusError, match=r"^hebrus::qsa_pool: " + pattern):
        ht.qsa_pool(*args)
    with pytest.raises(ht.HebrusError, match=r"^hebrus::qsa_pool: " + pattern):  # the kernel's own checks
        _direct_call(torch.ops.hebrus.qsa_pool.default, args)


@pytest.mark.parametrize("case", list(SELECT_BAD))
def test_select_bad_input(case):
    make, pattern = SELECT_BAD[case]
    args = make(_select_good())
    with pytest.raises(ht.HebrusError, match=r"^hebrus::qsa_select: " + pattern):
        ht.qsa_select(*args)
    with pytest.raises(ht.HebrusError, match=r"^hebrus::qsa_select: " + pattern):
        _direct_call(torch.ops.hebrus.qsa_select.default, args)
    if case in ("q_row = B", "q_row < 0", "q_groups > maxG", "q_groups < 0", "seq_groups entry"):
        with pytest.raises(ht.HebrusError, match=r"^hebrus::qsa_select: " + pattern):  # same words from the spec
            reference.qsa_select(*args)


@native_cpu
@pytest.mark.parametrize("case", list(POOL_LIMITS) + list(SELECT_LIMITS))
def test_cpu_kernel_limits(case):
    if case in POOL_LIMITS:
        make, pattern = POOL_LIMITS[case]
        op, name, args = ht.qsa_pool, "qsa_pool", make(_pool_good())
    else:
        make, pattern = SELECT_LIMITS[case]
        op, name, args = ht.qsa_select, "qsa_select", make(_select_good())
    with pytest.raises(ht.HebrusError, match=rf"^hebrus::{name}: " + pattern):
        op(*args)


def test_select_ignores_groups_no_query_sees():
    # Entries past every query's visible groups are never read, whatever they hold.
    args = _bad_seq_groups(_select_good())
    args[4] = torch.tensor([5, 2, 2, 1, 0, 1], dtype=torch.int32)  # row 1 sees at most 2 groups
    got = ht.qsa_select(*args)
    assert torch.equal(got, reference.qsa_select(*args))


@native_cpu
def test_select_limits_are_accepted_at_the_edge():
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(2, 64, 256, generator=gen)
    pooled = torch.randn(5000, 256, generator=gen)
    seq_groups = torch.randperm(5000, generator=gen).to(torch.int32)[None]
    q_row = torch.zeros(2, dtype=torch.int32)
    q_groups = torch.tensor([5000, 4500], dtype=torch.int32)
    got = ht.qsa_select(q, pooled, seq_groups, q_row, q_groups, 4096)
    assert torch.equal(got, reference.qsa_select(q, pooled, seq_groups, q_row, q_groups, 4096))
