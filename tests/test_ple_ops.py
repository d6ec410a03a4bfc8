"""hebrus::ple_ngram_ids, hebrus::ple_conv (SPEC §2, §5) and its out-variant hebrus::ple_conv_into.

Parity with transformers' Qwen4ExpTextNGramEmbedding / Qwen4ExpTextPLELayer, the native kernel
against the reference, chunk invariance, row isolation, the EOS rule, opcheck, torch.compile and
every kind of bad input.
"""

from __future__ import annotations

import random

import pytest
import torch

import hebrus_torch as ht
from hebrus_torch import reference
from hebrus_torch._extension import has_native_kernel
from hebrus_torch.errors import HebrusError

from conftest import ATOL, RTOL, assert_mixed_devices_rejected, assert_rejected, with_changes

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# helpers


def pack(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate per-row streams and build int32 cu_seqlens."""
    lengths = torch.tensor([0] + [r.shape[0] for r in rows])
    cu = torch.cumsum(lengths, 0).to(torch.int32)
    return torch.cat(rows, 0), cu.to(rows[0].device)


def split_rows(packed: torch.Tensor, cu: torch.Tensor) -> list[torch.Tensor]:
    cu = cu.tolist()
    return [packed[cu[i]:cu[i + 1]] for i in range(len(cu) - 1)]


def hash_params(n: int, heads_per_order: int, gen: torch.Generator, huge: bool = False):
    """Random multipliers / head sizes / offsets; ``huge`` multipliers overflow int64 products."""
    heads = (n - 1) * heads_per_order
    if huge:
        mult = torch.randint(-(1 << 62), 1 << 62, (n,), generator=gen) * 2 + 1
    else:
        mult = torch.randint(1, 1 << 40, (n,), generator=gen) * 2 + 1
    sizes = torch.randint(50, 3000, (heads,), generator=gen)
    offsets = torch.cumsum(sizes, 0) - sizes
    return mult, sizes, offsets


def random_tokens(length: int, vocab: int, eos: int, gen: torch.Generator, eos_rate: float = 0.2) -> torch.Tensor:
    tok = torch.randint(0, vocab, (length,), generator=gen)
    tok[torch.rand(length, generator=gen) < eos_rate] = eos
    return tok


def random_partition(length: int, rng: random.Random) -> list[int]:
    cuts = sorted(rng.randint(0, length) for _ in range(rng.randint(0, 5)))
    return [b - a for a, b in zip([0] + cuts, cuts + [length])]


def run_ids_chunked(streams, chunk_lens, history, params, eos, vocab):
    """Feed per-row streams through ple_ngram_ids in steps; chunk_lens[step][row] tokens per row."""
    pos = [0] * len(streams)
    out = [[] for _ in streams]
    for lens in chunk_lens:
        pieces = [s[p:p + n] for s, p, n in zip(streams, pos, lens)]
        tokens, cu = pack(pieces)
        ids, history = ht.ple_ngram_ids(tokens, cu, history, *params, eos, vocab)
        for row, part in enumerate(split_rows(ids, cu)):
            out[row].append(part)
        pos = [p + n for p, n in zip(pos, lens)]
    return [torch.cat(o, 0) for o in out], history


def run_conv_chunked(streams, chunk_lens, weight, state, dilation, activation):
    pos = [0] * len(streams)
    out = [[] for _ in streams]
    for lens in chunk_lens:
        x, cu = pack([s[p:p + n] for s, p, n in zip(streams, pos, lens)])
        y, state = ht.ple_conv(x, weight, cu, state, dilation, activation)
        for row, part in enumerate(split_rows(y, cu)):
            out[row].append(part)
        pos = [p + n for p, n in zip(pos, lens)]
    return [torch.cat(o, 0) for o in out], state


def chunk_schedules(lengths: list[int], rng: random.Random) -> dict[str, list[list[int]]]:
    """One shot, 1/2/1-token chunks and random (per-row different, sometimes empty) partitions."""
    one_two_one = []
    pattern = [1, 2, 1]
    done = [0] * len(lengths)
    i = 0
    while any(d < n for d, n in zip(done, lengths)):
        step = [min(pattern[i % 3], n - d) for d, n in zip(done, lengths)]
        one_two_one.append(step)
        done = [d + s for d, s in zip(done, step)]
        i += 1
    parts = [random_partition(n, rng) for n in lengths]
    depth = max(len(p) for p in parts)
    randomised = [[p[j] if j < len(p) else 0 for p in parts] for j in range(depth)]
    schedules = {"one_shot": [list(lengths)], "1/2/1": one_two_one, "random": randomised}
    for name, steps in schedules.items():    # every schedule feeds each row's whole stream, in order
        assert all(len(step) == len(lengths) and min(step, default=0) >= 0 for step in steps), name
        assert [sum(step[row] for step in steps) for row in range(len(lengths))] == list(lengths), name
    return schedules


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.cpu().float(), want.cpu().float(), atol=ATOL[dtype], rtol=RTOL[dtype])


# ----------------------------------------------------------------------------------------------
# build


def test_native_cpu_kernels_are_registered():
    assert has_native_kernel("ple_ngram_ids", "cpu")
    assert has_native_kernel("ple_conv", "cpu")


# ----------------------------------------------------------------------------------------------
# hand-checked cases


def test_ngram_ids_hand_checked(device):
    # N=2, H=1, eos=0. Token 5 sees E: (5*3 ^ 0*5) % 11 = 4 -> 104; token 7 sees 5: (21 ^ 25) % 11 = 1 -> 101.
    ids, hist = ht.ple_ngram_ids(torch.tensor([5, 7], device=device),
                                 torch.tensor([0, 2], dtype=torch.int32, device=device),
                                 torch.tensor([[0]], device=device), torch.tensor([3, 5], device=device),
                                 torch.tensor([11], device=device), torch.tensor([100], device=device), 0, 10)
    assert ids.cpu().tolist() == [[104], [101]]
    assert hist.cpu().tolist() == [[7]]


def test_conv_hand_checked(device):
    x = torch.tensor([[1.0], [2.0], [3.0]], device=device)
    w = torch.tensor([[0.5, 2.0]], device=device)
    y, st = ht.ple_conv(x, w, torch.tensor([0, 3], dtype=torch.int32, device=device),
                        torch.tensor([[[10.0]]], device=device), 1, "none")
    assert y.cpu().flatten().tolist() == [7.0, 4.5, 7.0]
    assert st.cpu().flatten().tolist() == [3.0]


# ----------------------------------------------------------------------------------------------
# parity with transformers 5.23.0


@pytest.fixture(scope="module")
def hf():
    return pytest.importorskip("hf_models", reason="needs transformers==5.23.0")


def random_hf_config(hf, rng: random.Random):
    n = rng.choice([2, 3, 4])
    h = rng.randint(1, 3)
    vocab = rng.randint(12, 80)
    return hf.tiny_config(
        vocab_size=vocab, ngram_size=n, heads_per_ngram=h, ple_embed_dim=(n - 1) * h * 2,
        ple_conv_kernel_size=rng.choice([2, 3, 4]), eos_token_id=rng.randrange(vocab),
        ngram_vocab_size_base=rng.randint(100, 5000), seed=rng.randint(0, 10**6), hc_count=rng.choice([2, 3]),
    )


def hf_ple_layer(hf, config, ple_layer_index: int, gen: torch.Generator):
    # PLE layer i sits on decoder layer i (config.ple_layer_ids are 1-based: [1, 2]).
    layer = hf.modeling.Qwen4ExpTextPLELayer(config, ple_layer_index, ple_layer_index)
    with torch.no_grad():  # conv1d is zero-initialised by the model; randomise it
        layer.conv1d.weight.copy_(torch.randn(layer.conv1d.weight.shape, generator=gen) * 0.5)
    captured: list[torch.Tensor] = []
    layer.ple_embedding.ngram_embedding.register_forward_pre_hook(lambda mod, args: captured.append(args[0]))
    return layer, captured


def ids_params(emb, device):
    return tuple(b.to(device) for b in (emb.layer_multipliers, emb.ngram_heads_vocab_sizes, emb.ngram_heads_offsets))


def hf_token_batch(config, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    eos = config.eos_token_id
    tok = torch.stack([random_tokens(length, config.vocab_size, eos, gen, 0.15) for _ in range(batch)])
    tok[0, 0] = eos                      # EOS first
    tok[1, -1] = eos                     # EOS last
    tok[batch - 1, 3:5] = eos            # adjacent EOS
    return tok


@pytest.mark.hf
@pytest.mark.parametrize("seed", range(4))
def test_ngram_ids_match_transformers(hf, device, seed):
    from transformers.cache_utils import DynamicCache

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    config = random_hf_config(hf, rng)
    ple_index = rng.randint(0, 1)
    layer, captured = hf_ple_layer(hf, config, ple_index, gen)
    emb = layer.ple_embedding
    batch, length = 3, 13
    tok = hf_token_batch(config, batch, length, gen)
    params = ids_params(emb, device)
    eos, vocab, ctx = config.eos_token_id, config.vocab_size, config.ngram_size - 1
    fresh = torch.full((batch, ctx), eos, device=device)

    emb(tok, None)
    want = captured.pop()                                         # [B, T, heads]
    got, hist = ht.ple_ngram_ids(tok.reshape(-1).to(device), pack([t for t in tok])[1].to(device), fresh,
                                 *params, eos, vocab)
    assert torch.equal(got.cpu(), want.reshape(batch * length, -1))

    # Chunked through transformers' cache (chunks shorter than the history included) vs our carried history.
    cache = DynamicCache(config=config)
    history = fresh
    start = 0
    for size in [1, ctx - 1 if ctx > 1 else 1, 2, 1, 5, length]:
        end = min(length, start + size)
        if end == start:
            break
        emb(tok[:, start:end], cache)
        want = captured.pop()
        chunk = tok[:, start:end]
        got, history = ht.ple_ngram_ids(chunk.reshape(-1).to(device), pack([c for c in chunk])[1].to(device),
                                        history, *params, eos, vocab)
        assert torch.equal(got.cpu(), want.reshape(-1, want.shape[-1])), (start, end)
        start = end
    assert torch.equal(history.cpu(), cache.layers[emb.layer_idx].conv_states[2])
    assert torch.equal(history.cpu(), hist.cpu())


@pytest.mark.hf
@pytest.mark.parametrize("seed", range(3))
def test_conv_matches_transformers(hf, device, seed):
    from transformers.cache_utils import DynamicCache

    rng, gen = random.Random(100 + seed), torch.Generator().manual_seed(100 + seed)
    config = random_hf_config(hf, rng)
    layer, _ = hf_ple_layer(hf, config, 0, gen)
    batch, length = 2, 11
    channels = layer.conv1d.weight.shape[0]
    dilation, state_len = config.ngram_size, layer.short_conv_state_len
    weight = layer.conv1d.weight.detach().squeeze(1).to(device)
    x = torch.randn(batch, length, channels, generator=gen)
    zero = torch.zeros(batch, state_len, channels, device=device)
    cu = pack([r for r in x])[1].to(device)

    with torch.no_grad():
        want = layer._short_conv(x, None)
    got, _ = ht.ple_conv(x.reshape(-1, channels).to(device), weight, cu, zero, dilation, "silu")
    assert_close(got, want.reshape(-1, channels), torch.float32)

    cache = DynamicCache(config=config)
    state, start = zero, 0
    for size in [1, 2, 1, 4, length]:
        end = min(length, start + size)
        if end == start:
            break
        with torch.no_grad():
            want = layer._short_conv(x[:, start:end], cache)
        chunk = x[:, start:end]
        got, state = ht.ple_conv(chunk.reshape(-1, channels).to(device), weight, pack([c for c in chunk])[1].to(device),
                                 state, dilation, "silu")
        assert_close(got, want.reshape(-1, channels), torch.float32)
        start = end
    assert torch.equal(state.cpu(), cache.layers[layer.layer_idx].conv_states[1].transpose(1, 2))


# ----------------------------------------------------------------------------------------------
# native kernel vs reference


@pytest.mark.parametrize("huge", [False, True], ids=["plain", "wrapping-products"])
@pytest.mark.parametrize("n,h", [(2, 1), (3, 8), (4, 3)])
def test_ngram_ids_kernel_vs_reference(device, n, h, huge):
    gen = torch.Generator().manual_seed(n * 10 + h + huge)
    vocab, eos = 41, 7
    params = hash_params(n, h, gen, huge)
    lengths = [0, 5, 1, 0, 33, 2, 17, 0]
    tokens, cu = pack([random_tokens(m, vocab, eos, gen, 0.25) for m in lengths])
    history = torch.randint(0, vocab, (len(lengths), n - 1), generator=gen)
    history[1, -1] = eos
    want = reference.ple_ngram_ids(tokens, cu, history, *params, eos, vocab)
    d = lambda t: t.to(device)  # noqa: E731
    got = ht.ple_ngram_ids(d(tokens), d(cu), d(history), *map(d, params), eos, vocab)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    # Strided views of every input.
    wide_tok = torch.stack([tokens, torch.zeros_like(tokens)], 1)
    wide_cu = torch.stack([cu, torch.zeros_like(cu)], 1)
    hist_t = history.t().contiguous().t()
    wide_params = [torch.stack([p, p], 1)[:, 0] for p in params]
    got = ht.ple_ngram_ids(d(wide_tok)[:, 0], d(wide_cu)[:, 0], d(hist_t), *map(d, wide_params), eos, vocab)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.parametrize("h", [1, 8, 11])
@pytest.mark.parametrize("sizes_kind", ["extremes", "below-2^30", "huge"])
def test_ngram_ids_kernel_vs_reference_divisors(device, h, sizes_kind):
    # The CPU kernel has an exact double-arithmetic remainder for divisors below 2^30 and int64
    # division otherwise; both must equal torch.remainder for every int64 mix, any heads per order.
    gen = torch.Generator().manual_seed(h)
    n, vocab, eos = 3, 1000, 3
    heads = (n - 1) * h
    pool = {"extremes": [1, 2, 3, 7, 97, (1 << 30) - 1, (1 << 30) - 35, (1 << 29) + 11],
            "below-2^30": [(1 << 30) - 1 - i for i in range(5)] + [99991, 20_000_003, 1],
            "huge": [1 << 30, (1 << 62) + 5, (1 << 63) - 1, 3, (1 << 40) + 1, 5, 12345, 2]}[sizes_kind]
    sizes = torch.tensor([pool[i % len(pool)] for i in range(heads)])
    offsets = torch.randint(-(1 << 40), 1 << 40, (heads,), generator=gen)
    mult = torch.tensor([(1 << 62) + 1, -(1 << 61) - 3, (1 << 63) - 25])
    tokens, cu = pack([random_tokens(m, vocab, eos, gen, 0.1) for m in (40, 0, 9)])
    tokens[:4] = torch.tensor([0, vocab - 1, 1, vocab - 2])
    history = torch.randint(0, vocab, (3, n - 1), generator=gen)
    want = reference.ple_ngram_ids(tokens, cu, history, mult, sizes, offsets, eos, vocab)
    d = lambda t: t.to(device)  # noqa: E731
    got = ht.ple_ngram_ids(d(tokens), d(cu), d(history), d(mult), d(sizes), d(offsets), eos, vocab)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.parametrize("activation", ["none", "silu"])
@pytest.mark.parametrize("channels", [31, 32, 33])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_conv_kernel_vs_reference(device, dtype, channels, activation):
    gen = torch.Generator().manual_seed(channels)
    lengths = [0, 7, 1, 0, 12, 3, 0, 101]  # 101: several token tiles and 4-token groups of the CPU kernel
    for width in (1, 2, 4):
        for dilation in (1, 3):
            state_len = (width - 1) * dilation
            x, cu = pack([torch.randn(m, channels, generator=gen).to(dtype) for m in lengths])
            weight = torch.randn(channels, width, generator=gen).to(dtype)
            state = torch.randn(len(lengths), state_len, channels, generator=gen).to(dtype)
            want_y, want_s = reference.ple_conv(x, weight, cu, state, dilation, activation)
            got_y, got_s = ht.ple_conv(x.to(device), weight.to(device), cu.to(device), state.to(device),
                                       dilation, activation)
            assert got_y.dtype == dtype and got_s.dtype == dtype
            assert torch.equal(got_s.cpu(), want_s)
            if device == "cpu":
                # Same fp32 products and sums in the same order, the kernel's SiLU, one cast: bitwise.
                assert torch.equal(got_y, want_y), (width, dilation)
            else:
                assert_close(got_y, want_y, dtype)


def conv_pointwise(x: torch.Tensor, scale: float, activation: str, width: int = 1) -> torch.Tensor:
    """ple_conv with weights (0, ..., 0, scale): y = act(scale * x) elementwise, x any shape.

    width > 1 multiplies the previous tokens by 0, so x must be finite there.
    """
    channels = 256
    flat = torch.cat([x.reshape(-1), x.new_zeros((-x.numel()) % channels)]).view(-1, channels)
    weight = torch.zeros(channels, width, dtype=x.dtype)
    weight[:, -1] = scale
    cu = torch.tensor([0, flat.shape[0]], dtype=torch.int32)
    y, _ = ht.ple_conv(flat, weight, cu, torch.zeros(1, width - 1, channels, dtype=x.dtype), 1, activation)
    return y.reshape(-1)[: x.numel()].view(x.shape)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_conv_cpu_every_16_bit_value(dtype):
    # The CPU kernel widens and narrows fp16/bf16 with its own branch-free code: every bit pattern
    # must round-trip, and products must round like torch's conversion (ties, subnormals, overflow).
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    nan = torch.isnan(x)
    same = conv_pointwise(x, 1.0, "none")
    assert torch.equal(same[~nan], x[~nan]) and torch.isnan(same[nan]).all()
    for scale in (0.3, 3.0, 1e-3, 1.0 + 2.0 ** -9):
        w = torch.tensor(scale, dtype=dtype).float()
        want = (0.0 + x.float() * w).to(dtype)  # the kernel's sum starts at +0, as the reference's
        got = conv_pointwise(x, scale, "none")
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)), scale


def test_conv_cpu_silu_accuracy_and_specials():
    # Vectorised SiLU with its own exp: within a few ulp of the exact value over the whole range,
    # and expf's behaviour at the ends: silu(-large) = -0, silu(+inf) = inf, silu(nan) = nan.
    x = torch.cat([torch.linspace(-110, 110, 200_001), torch.randn(100_000) * 4,
                   torch.tensor([89.0, 88.72, 88.7, -87.0, -87.5, -88.72, -88.8, 1e-40, -1e-40, 1e30, -1e30])])
    got = conv_pointwise(x, 1.0, "silu").double()
    exact = torch.nn.functional.silu(x.double())
    ulp = (torch.nextafter(exact.float().abs(), torch.tensor(float("inf"))) - exact.float().abs()).double()
    finite_exp = x > -88.72
    assert ((got - exact).abs() <= 3 * ulp)[finite_exp].all()
    # Below x = -88.72, exp(-x) overflows and x / (1 + exp(-x)) is -0, as with expf.
    assert (got[x < -88.73] == 0).all() and torch.signbit(got[x < -88.73]).all()
    # Qwen4Exp's width 4 has its own loop: same bits.
    assert torch.equal(conv_pointwise(x, 1.0, "silu", width=4).double(), got)
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), -100.0, -1e30, 100.0, 0.0])
    got = conv_pointwise(specials, 1.0, "silu")
    assert got[0] == float("inf") and torch.isnan(got[1]) and torch.isnan(got[2])
    assert got[3] == 0 and torch.signbit(got[3]) and got[4] == 0 and torch.signbit(got[4])
    assert got[5] == 100.0 and got[6] == 0


def test_reference_silu_conv_is_the_kernels_and_chunk_invariant():
    """The reference is the conv of every device without a native kernel: its SiLU replays the CPU
    kernel's arithmetic, so it gives the kernel's bits (torch's silu would take another exp on its
    vector body than on its scalar tail, making a token's bits depend on where the batch was cut)."""
    x = torch.cat([torch.linspace(-110, 110, 20_001), torch.randn(20_000) * 30,
                   torch.tensor([float("inf"), float("-inf"), float("nan"), 89.0, 88.72, -87.5, -88.72, 1e-40,
                                 -1e-40, 3e38, -3e38, 0.0, -0.0])])
    flat = x.view(-1, 1)
    cu = torch.tensor([0, flat.shape[0]], dtype=torch.int32)
    args = (flat, torch.ones(1, 1), cu, torch.zeros(1, 0, 1), 1, "silu")
    want, got = ht.ple_conv(*args)[0], reference.ple_conv(*args)[0]
    assert torch.equal(want.view(torch.int32), got.view(torch.int32))
    gen = torch.Generator().manual_seed(12)
    stream = torch.randn(1357, 7, generator=gen) * 3
    weight = torch.randn(7, 4, generator=gen)
    state0 = torch.randn(1, 9, 7, generator=gen)
    one = reference.ple_conv(stream, weight, torch.tensor([0, 1357], dtype=torch.int32), state0, 3, "silu")[0]
    assert torch.equal(one, ht.ple_conv(stream, weight, torch.tensor([0, 1357], dtype=torch.int32), state0, 3,
                                        "silu")[0])
    rng = random.Random(12)
    parts, state, at = [], state0, 0
    while at < 1357:
        n = min(rng.choice([1, 1, 2, 5, 17, 64]), 1357 - at)
        y, state = reference.ple_conv(stream[at:at + n], weight, torch.tensor([0, n], dtype=torch.int32), state, 3,
                                      "silu")
        parts.append(y)
        at += n
    assert torch.equal(torch.cat(parts), one)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_conv_strided_inputs(device, dtype):
    gen = torch.Generator().manual_seed(3)
    channels, width, dilation = 33, 4, 3
    lengths = [4, 0, 9]
    x, cu = pack([torch.randn(m, channels, generator=gen).to(dtype) for m in lengths])
    weight = torch.randn(channels, width, generator=gen).to(dtype)
    state = torch.randn(len(lengths), (width - 1) * dilation, channels, generator=gen).to(dtype)
    want = reference.ple_conv(x, weight, cu, state, dilation, "silu")
    d = lambda t: t.to(device)  # noqa: E731
    x_s = d(torch.stack([x, -x], 2))[..., 0]                     # channel stride 2
    w_s = d(weight.t().contiguous()).t()                          # transposed
    st_s = d(state.transpose(1, 2).contiguous()).transpose(1, 2)  # channel-major state
    cu_s = d(torch.stack([cu, cu], 1))[:, 1]
    assert not (x_s.is_contiguous() or w_s.is_contiguous() or st_s.is_contiguous() or cu_s.is_contiguous())
    got = ht.ple_conv(x_s, w_s, cu_s, st_s, dilation, "silu")
    assert_close(got[0], want[0], dtype)
    assert torch.equal(got[1].cpu(), want[1])


def test_empty_batch_and_empty_rows(device):
    gen = torch.Generator().manual_seed(5)
    params = [p.to(device) for p in hash_params(3, 2, gen)]
    cu0 = torch.zeros(1, dtype=torch.int32, device=device)
    ids, hist = ht.ple_ngram_ids(torch.zeros(0, dtype=torch.long, device=device), cu0,
                                 torch.zeros(0, 2, dtype=torch.long, device=device), *params, 1, 10)
    assert ids.shape == (0, 4) and hist.shape == (0, 2)
    y, st = ht.ple_conv(torch.zeros(0, 8, device=device), torch.ones(8, 3, device=device), cu0,
                        torch.zeros(0, 4, 8, device=device), 2, "silu")
    assert y.shape == (0, 8) and st.shape == (0, 4, 8)
    # Rows with no tokens pass their state and history through unchanged.
    cu = torch.zeros(4, dtype=torch.int32, device=device)
    history = torch.randint(0, 10, (3, 2), generator=gen).to(device)
    state = torch.randn(3, 4, 8, generator=gen).to(device)
    assert torch.equal(ht.ple_ngram_ids(torch.zeros(0, dtype=torch.long, device=device), cu, history,
                                        *params, 1, 10)[1], history)
    assert torch.equal(ht.ple_conv(torch.zeros(0, 8, device=device), torch.ones(8, 3, device=device), cu,
                                   state, 2, "none")[1], state)


# ----------------------------------------------------------------------------------------------
# chunk invariance, isolation, EOS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", range(3))
def test_chunk_invariance(device, seed, dtype):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    n, vocab, eos = rng.choice([2, 3, 4]), 30, 4
    params = [p.to(device) for p in hash_params(n, 3, gen)]
    width, dilation, channels = rng.choice([1, 2, 4]), rng.choice([1, 3]), 33
    lengths = [rng.randint(0, 25) for _ in range(4)] + [0]
    streams = [random_tokens(m, vocab, eos, gen, 0.2).to(device) for m in lengths]
    xs = [torch.randn(m, channels, generator=gen).to(dtype).to(device) for m in lengths]
    weight = torch.randn(channels, width, generator=gen).to(dtype).to(device)
    history0 = torch.randint(0, vocab, (len(lengths), n - 1), generator=gen).to(device)
    state0 = torch.randn(len(lengths), (width - 1) * dilation, channels, generator=gen).to(dtype).to(device)

    results = {}
    for name, schedule in chunk_schedules(lengths, rng).items():
        ids, hist = run_ids_chunked(streams, schedule, history0, params, eos, vocab)
        ys, state = run_conv_chunked(xs, schedule, weight, state0, dilation, "silu")
        results[name] = (ids, hist, ys, state)
    base = results.pop("one_shot")
    for name, (ids, hist, ys, state) in results.items():
        assert all(torch.equal(a, b) for a, b in zip(ids, base[0])), name
        assert torch.equal(hist, base[1]), name
        assert all(torch.equal(a, b) for a, b in zip(ys, base[2])), name
        assert torch.equal(state, base[3]), name


def test_thread_count_invariance():
    # at::parallel_for splits tokens differently with 1 and 2 threads; the bits must not change.
    gen = torch.Generator().manual_seed(4)
    params = hash_params(3, 8, gen)
    tokens, cu = pack([random_tokens(m, 100, 3, gen) for m in (3000, 0, 1777)])
    history = torch.randint(0, 100, (3, 2), generator=gen)
    x = torch.randn(tokens.shape[0], 64, generator=gen)
    weight, state = torch.randn(64, 4, generator=gen), torch.randn(3, 9, 64, generator=gen)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            results.append((*ht.ple_ngram_ids(tokens, cu, history, *params, 3, 100),
                            *ht.ple_conv(x, weight, cu, state, 3, "silu")))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_row_isolation(device):
    gen = torch.Generator().manual_seed(11)
    n, vocab, eos, channels, width, dilation = 3, 25, 2, 33, 4, 3
    params = [p.to(device) for p in hash_params(n, 4, gen)]
    lengths = [6, 0, 19, 1, 8]
    streams = [random_tokens(m, vocab, eos, gen).to(device) for m in lengths]
    xs = [torch.randn(m, channels, generator=gen).to(device) for m in lengths]
    weight = torch.randn(channels, width, generator=gen).to(device)
    history = torch.randint(0, vocab, (len(lengths), n - 1), generator=gen).to(device)
    state = torch.randn(len(lengths), (width - 1) * dilation, channels, generator=gen).to(device)

    tokens, cu = pack(streams)
    ids, new_hist = ht.ple_ngram_ids(tokens, cu, history, *params, eos, vocab)
    y, new_state = ht.ple_conv(pack(xs)[0], weight, cu, state, dilation, "silu")
    ids_rows, y_rows = split_rows(ids, cu), split_rows(y, cu)
    for row in range(len(lengths)):
        one_cu = torch.tensor([0, lengths[row]], dtype=torch.int32, device=device)
        ids1, hist1 = ht.ple_ngram_ids(streams[row], one_cu, history[row:row + 1], *params, eos, vocab)
        y1, st1 = ht.ple_conv(xs[row], weight, one_cu, state[row:row + 1], dilation, "silu")
        assert torch.equal(ids1, ids_rows[row]) and torch.equal(hist1[0], new_hist[row])
        assert torch.equal(y1, y_rows[row]) and torch.equal(st1[0], new_state[row])
    # Reversed row order: every row still gets the same bits.
    perm = list(reversed(range(len(lengths))))
    tokens_r, cu_r = pack([streams[i] for i in perm])
    ids_r, hist_r = ht.ple_ngram_ids(tokens_r, cu_r, history[perm], *params, eos, vocab)
    y_r, st_r = ht.ple_conv(pack([xs[i] for i in perm])[0], weight, cu_r, state[perm], dilation, "silu")
    for j, i in enumerate(perm):
        assert torch.equal(split_rows(ids_r, cu_r)[j], ids_rows[i]) and torch.equal(hist_r[j], new_hist[i])
        assert torch.equal(split_rows(y_r, cu_r)[j], y_rows[i]) and torch.equal(st_r[j], new_state[i])


@pytest.mark.parametrize("n", [2, 3, 4])
def test_eos_rule(device, n):
    gen = torch.Generator().manual_seed(n)
    vocab, eos = 20, 9
    params = [p.to(device) for p in hash_params(n, 2, gen)]
    prefix = torch.tensor([1, 2, 3, 4, 5])[: n + 1]
    suffix = torch.tensor([6, 7, 8, 1, 2, 3])
    stream = torch.cat([prefix, torch.tensor([eos]), suffix]).to(device)
    history = torch.randint(0, vocab, (1, n - 1), generator=gen).to(device)
    cu = torch.tensor([0, stream.shape[0]], dtype=torch.int32, device=device)
    ids, hist = ht.ple_ngram_ids(stream, cu, history, *params, eos, vocab)
    fresh = torch.full((1, n - 1), eos, device=device)
    cu_s = torch.tensor([0, suffix.shape[0]], dtype=torch.int32, device=device)
    ids_fresh, _ = ht.ple_ngram_ids(suffix.to(device), cu_s, fresh, *params, eos, vocab)
    assert torch.equal(ids[-suffix.shape[0]:], ids_fresh)
    # The history is raw: a chunk ending at EOS carries the EOS, and the next chunk still resets.
    ids_a, hist_a = ht.ple_ngram_ids(stream[: n + 2], torch.tensor([0, n + 2], dtype=torch.int32, device=device),
                                     history, *params, eos, vocab)
    assert int(hist_a[0, -1]) == eos
    ids_b, hist_b = ht.ple_ngram_ids(stream[n + 2:], cu_s, hist_a, *params, eos, vocab)
    assert torch.equal(ids_b, ids_fresh) and torch.equal(hist_b, hist)
    # Without the EOS the suffix ids do see the prefix (the rule is not vacuous).
    no_eos = torch.cat([prefix, suffix]).to(device)
    ids_no, _ = ht.ple_ngram_ids(no_eos, torch.tensor([0, no_eos.shape[0]], dtype=torch.int32, device=device),
                                 history, *params, eos, vocab)
    assert not torch.equal(ids_no[-suffix.shape[0]:], ids_fresh)


EOS_OUTSIDE = {"vocab+100000": lambda vocab: vocab + 100000, "negative": lambda vocab: -1,
               "int64-min": lambda vocab: -(1 << 63), "int64-max": lambda vocab: (1 << 63) - 1}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kind", EOS_OUTSIDE)
def test_eos_outside_vocabulary(device, n, kind):
    """SPEC §2: eos is any int64 (transformers' generation tests set eos = vocab + 100000), only compared
    with token ids: a fresh history [eos]*(N-1) is accepted, kernel == reference, and the ids equal those of
    a hand-built z = history ++ tokens hash (no token equals eos, so only the fresh history reads it)."""
    gen = torch.Generator().manual_seed(n)
    vocab = 20
    eos = EOS_OUTSIDE[kind](vocab)
    mult, sizes, offsets = hash_params(n, 2, gen, huge=True)
    params = [p.to(device) for p in (mult, sizes, offsets)]
    tokens, cu = pack([torch.randint(0, vocab, (m,), generator=gen) for m in (7, 0, 1, 5)])
    history = torch.full((4, n - 1), eos)
    history[3, -1] = 4                                           # a carried history: eos then a token
    want = reference.ple_ngram_ids(tokens, cu, history, mult, sizes, offsets, eos, vocab)
    got = ht.ple_ngram_ids(tokens.to(device), cu.to(device), history.to(device), *params, eos, vocab)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    # By hand: z = history ++ tokens per row; shift k reads z[i-k] unless an eos is among z[i-k .. i-1].
    rows = []
    for b in range(4):
        z = history[b].tolist() + tokens[int(cu[b]):int(cu[b + 1])].tolist()
        for i in range(n - 1, len(z)):
            h = sizes.shape[0] // (n - 1)
            row = []
            mixed = _wrap64(z[i] * int(mult[0]))
            for k in range(1, n):
                s_k = eos if any(v == eos for v in z[i - k:i]) else z[i - k]
                mixed = _wrap64(mixed ^ _wrap64(s_k * int(mult[k])))
                row += [mixed % int(sizes[j]) + int(offsets[j]) for j in range((k - 1) * h, k * h)]
            rows.append(row)
    assert torch.equal(got[0].cpu(), torch.tensor(rows, dtype=torch.int64).reshape(-1, sizes.shape[0]))


def _wrap64(v: int) -> int:
    """Python int -> int64 two's complement (torch's int64 mul/xor wrap)."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


@pytest.mark.hf
@pytest.mark.parametrize("kind", ["vocab+100000", "negative"])
def test_eos_outside_vocabulary_matches_transformers(hf, device, kind):
    """transformers' NGramEmbedding with an eos outside the vocabulary (its generation tests' setting):
    row ids exact, fresh and chunked through its cache."""
    from transformers.cache_utils import DynamicCache

    gen = torch.Generator().manual_seed(5)
    config = hf.tiny_config(vocab_size=40, ngram_size=3, heads_per_ngram=2, ple_embed_dim=8)
    config.eos_token_id = EOS_OUTSIDE[kind](config.vocab_size)
    layer, captured = hf_ple_layer(hf, config, 0, gen)
    emb = layer.ple_embedding
    assert int(emb.eos_token_id) == config.eos_token_id
    tok = torch.randint(0, config.vocab_size, (2, 9), generator=gen)
    params = ids_params(emb, device)
    eos, vocab = config.eos_token_id, config.vocab_size
    fresh = torch.full((2, 2), eos, device=device)
    emb(tok, None)
    want = captured.pop()
    got, _ = ht.ple_ngram_ids(tok.reshape(-1).to(device), pack(list(tok))[1].to(device), fresh, *params, eos, vocab)
    assert torch.equal(got.cpu(), want.reshape(-1, want.shape[-1]))
    cache, history = DynamicCache(config=config), fresh
    for start, end in ((0, 1), (1, 4), (4, 9)):
        emb(tok[:, start:end], cache)
        want = captured.pop()
        chunk = tok[:, start:end]
        got, history = ht.ple_ngram_ids(chunk.reshape(-1).to(device), pack(list(chunk))[1].to(device), history,
                                        *params, eos, vocab)
        assert torch.equal(got.cpu(), want.reshape(-1, want.shape[-1])), (start, end)
    assert torch.equal(history.cpu(), cache.layers[emb.layer_idx].conv_states[2])


def test_conv_new_state_is_the_last_inputs_and_carries_on(device):
    # The conv never sees token ids, so it cannot reset at an EOS (SPEC §5.3's "the conv tail carries
    # across EOS" is the holders' to keep: tests/test_ple_state.py checks PLEState's tail after an EOS).
    # What the op owes: its new state is exactly the last L inputs, oldest first, zero-filled while the
    # row has seen fewer than L; fed back, it continues the one-shot outputs, which a zero state does not.
    gen = torch.Generator().manual_seed(2)
    channels, width, dilation = 16, 4, 3
    x = torch.randn(20, channels, generator=gen).to(device)
    weight = torch.randn(channels, width, generator=gen).to(device)
    zero = torch.zeros(1, (width - 1) * dilation, channels, device=device)
    cu = lambda m: torch.tensor([0, m], dtype=torch.int32, device=device)  # noqa: E731
    y_all, _ = ht.ple_conv(x, weight, cu(20), zero, dilation, "silu")
    _, short = ht.ple_conv(x[:5], weight, cu(5), zero, dilation, "silu")
    assert torch.equal(short[0], torch.cat([zero[0, :4], x[:5]]))
    _, st = ht.ple_conv(x[5:11], weight, cu(6), short, dilation, "silu")
    assert torch.equal(st[0], x[2:11])
    y_rest, _ = ht.ple_conv(x[11:], weight, cu(9), st, dilation, "silu")
    y_reset, _ = ht.ple_conv(x[11:], weight, cu(9), zero, dilation, "silu")
    assert torch.equal(y_rest, y_all[11:])
    assert not torch.equal(y_reset, y_all[11:])


# ----------------------------------------------------------------------------------------------
# opcheck and torch.compile


def ids_samples():
    gen = torch.Generator().manual_seed(0)
    for n, h, lengths in [(3, 8, [3, 0, 5]), (2, 1, [1]), (4, 2, [0, 0]), (3, 2, [10, 1, 1, 4])]:
        params = hash_params(n, h, gen)
        tokens, cu = pack([random_tokens(m, 30, 1, gen) for m in lengths])
        history = torch.randint(0, 30, (len(lengths), n - 1), generator=gen)
        yield (tokens, cu, history, *params, 1, 30)


def conv_samples():
    gen = torch.Generator().manual_seed(1)
    for dtype, channels, width, dilation, act, lengths in [
        (torch.float32, 32, 4, 3, "silu", [3, 0, 5]), (torch.float16, 33, 1, 1, "none", [2]),
        (torch.bfloat16, 31, 2, 3, "silu", [0, 0]), (torch.float32, 8, 3, 2, "none", [9, 1, 4]),
    ]:
        x, cu = pack([torch.randn(m, channels, generator=gen).to(dtype) for m in lengths])
        yield (x, torch.randn(channels, width, generator=gen).to(dtype), cu,
               torch.randn(len(lengths), (width - 1) * dilation, channels, generator=gen).to(dtype), dilation, act)


def test_opcheck(device):
    def to_dev(args):
        return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)

    for args in ids_samples():
        torch.library.opcheck(torch.ops.hebrus.ple_ngram_ids.default, to_dev(args))
    for args in conv_samples():
        torch.library.opcheck(torch.ops.hebrus.ple_conv.default, to_dev(args))


def test_opcheck_transposed_inputs(device):
    x = torch.randn(8, 5, device=device).t()
    weight = torch.randn(3, 8, device=device).t()
    state = torch.randn(2, 8, 4, device=device).transpose(1, 2)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.hebrus.ple_conv.default, (x, weight, cu, state, 2, "silu"))
    history = torch.randint(0, 30, (2, 2), device=device).t()
    params = [p.to(device) for p in hash_params(3, 2, torch.Generator().manual_seed(0))]
    torch.library.opcheck(torch.ops.hebrus.ple_ngram_ids.default,
                          (torch.randint(0, 30, (5,), device=device), cu, history, *params, 1, 30))


def test_compile_chunked_loop_matches_eager(device):
    gen = torch.Generator().manual_seed(9)
    n, vocab, eos, channels, width, dilation = 3, 30, 2, 32, 4, 3
    params = [p.to(device) for p in hash_params(n, 4, gen)]
    weight = torch.randn(channels, width, generator=gen).to(device)
    chunks = []
    for lengths in ([5, 0, 3], [1, 2, 1], [4, 4, 0]):
        tokens, cu = pack([random_tokens(m, vocab, eos, gen) for m in lengths])
        chunks.append((tokens.to(device), cu.to(device),
                       torch.randn(tokens.shape[0], channels, generator=gen).to(device)))
    history0 = torch.full((3, n - 1), eos, device=device)
    state0 = torch.zeros(3, (width - 1) * dilation, channels, device=device)

    def loop(history, state):
        outs = []
        for tokens, cu, x in chunks:
            ids, history = ht.ple_ngram_ids(tokens, cu, history, *params, eos, vocab)
            y, state = ht.ple_conv(x, weight, cu, state, dilation, "silu")
            outs += [ids, y]
        return outs, history, state

    torch._dynamo.reset()
    try:
        compiled = torch.compile(loop, fullgraph=True)(history0, state0)
    finally:
        torch._dynamo.reset()
    eager = loop(history0, state0)
    assert all(torch.equal(a, b) for a, b in zip(compiled[0], eager[0]))
    assert torch.equal(compiled[1], eager[1]) and torch.equal(compiled[2], eager[2])


# ----------------------------------------------------------------------------------------------
# bad input: the wrapper raises HebrusError; the CPU kernel called directly raises a tagged ValueError


def good_ids_args(device="cpu"):
    d = lambda t: t.to(device)  # noqa: E731
    return dict(tokens=d(torch.tensor([1, 2, 3, 4, 5])), cu_seqlens=d(torch.tensor([0, 2, 5], dtype=torch.int32)),
                history=d(torch.tensor([[0, 0], [6, 7]])), multipliers=d(torch.tensor([3, 5, 7])),
                vocab_sizes=d(torch.tensor([11, 13, 17, 19])), offsets=d(torch.tensor([0, 11, 24, 41])),
                eos=0, vocab=10)


def good_conv_args(device="cpu"):
    d = lambda t: t.to(device)  # noqa: E731
    return dict(x=d(torch.randn(5, 4)), weight=d(torch.randn(4, 3)),
                cu_seqlens=d(torch.tensor([0, 2, 5], dtype=torch.int32)),
                state=d(torch.randn(2, 4, 4)), dilation=2, activation="silu")


BAD_IDS = {
    "tokens-dtype": (dict(tokens=torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32)),
                     r"tokens must have dtype torch\.int64"),
    "tokens-2d": (dict(tokens=torch.tensor([[1, 2, 3, 4, 5]])), r"tokens must be 1-D"),
    "history-dtype": (dict(history=torch.tensor([[0.0, 0.0], [6.0, 7.0]])), r"history must have dtype"),
    "history-shape": (dict(history=torch.tensor([[0, 0, 0], [6, 7, 8]])),
                      r"history must have shape \(B, N-1\) = \(2, 2\)"),
    "history-rows": (dict(history=torch.tensor([[0, 0]])), r"history must have shape"),
    "multipliers-short": (dict(multipliers=torch.tensor([3])), r"multipliers must have N >= 2"),
    "vocab-sizes-count": (dict(vocab_sizes=torch.tensor([11, 13, 17])), r"vocab_sizes must have \(N-1\)\*H entries"),
    "offsets-count": (dict(offsets=torch.tensor([0, 11])), r"offsets must have 4 entries"),
    "cu-dtype": (dict(cu_seqlens=torch.tensor([0, 2, 5])), r"cu_seqlens must have dtype torch\.int32"),
    "cu-2d": (dict(cu_seqlens=torch.tensor([[0, 2, 5]], dtype=torch.int32)), r"cu_seqlens must be 1-D"),
    "cu-empty": (dict(cu_seqlens=torch.zeros(0, dtype=torch.int32)), r"B\+1 >= 1"),
    "cu-start": (dict(cu_seqlens=torch.tensor([1, 2, 5], dtype=torch.int32)),
                 r"must start at 0 and end at T = 5, got 1"),
    "cu-end-short": (dict(cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32)), r"end at T = 5, got 0 \.\. 4"),
    "cu-end-long": (dict(cu_seqlens=torch.tensor([0, 2, 6], dtype=torch.int32)), r"end at T = 5, got 0 \.\. 6"),
    "cu-decreasing": (dict(cu_seqlens=torch.tensor([0, 4, 2, 5], dtype=torch.int32),
                           history=torch.zeros(3, 2, dtype=torch.long)), r"non-decreasing; row 1"),
    "token-negative": (dict(tokens=torch.tensor([1, 2, -1, 4, 5])), r"tokens\[2\] = -1 is outside \[0, vocab=10\)"),
    "token-vocab": (dict(tokens=torch.tensor([1, 2, 3, 4, 10])), r"tokens\[4\] = 10 is outside"),
    "history-negative": (dict(history=torch.tensor([[0, 0], [6, -3]])), r"history\[1, 1\] = -3 is outside"),
    "history-vocab": (dict(history=torch.tensor([[10, 0], [6, 7]])), r"history\[0, 0\] = 10 is outside"),
    # eos may lie outside the vocabulary (SPEC §2), but a token equal to it is still outside, and a history
    # id outside the vocabulary must be that eos.
    "token-is-outside-eos": (dict(eos=10, tokens=torch.tensor([1, 2, 10, 4, 5])),
                             r"tokens\[2\] = 10 is outside \[0, vocab=10\)"),
    "history-outside-not-eos": (dict(eos=10, history=torch.tensor([[10, 10], [6, 11]])),
                                r"history\[1, 1\] = 11 is outside \[0, vocab=10\) and is not eos"),
    "vocab-zero": (dict(vocab=0), r"vocab must be positive"),
    "head-size-zero": (dict(vocab_sizes=torch.tensor([11, 0, 17, 19])), r"vocab_sizes\[1\] must be positive, got 0"),
}

BAD_CONV = {
    "x-1d": (dict(x=torch.randn(5)), r"x must be 2-D, got shape \(5,\)"),
    "x-dtype": (dict(x=torch.randn(5, 4, dtype=torch.float64)), r"x must have dtype"),
    "x-int": (dict(x=torch.ones(5, 4, dtype=torch.int64)), r"x must have dtype"),
    "weight-dtype": (dict(weight=torch.randn(4, 3, dtype=torch.float16)),
                     r"weight dtype torch\.float16 must match x dtype"),
    "state-dtype": (dict(state=torch.randn(2, 4, 4, dtype=torch.bfloat16)), r"state dtype torch\.bfloat16 must match"),
    "weight-1d": (dict(weight=torch.randn(4)), r"weight must be 2-D"),
    "weight-channels": (dict(weight=torch.randn(5, 3)), r"weight must have shape \(C, K\) with C = 4"),
    "weight-width-0": (dict(weight=torch.randn(4, 0)), r"weight must have shape \(C, K\) with C = 4 and K >= 1"),
    "state-2d": (dict(state=torch.randn(2, 4)), r"state must be 3-D"),
    "state-len": (dict(state=torch.randn(2, 3, 4)),
                  r"state must have shape \(B, \(K-1\)\*dilation, C\) = \(2, 4, 4\), got \(2, 3, 4\)"),
    "state-batch": (dict(state=torch.randn(3, 4, 4)), r"state must have shape .* got \(3, 4, 4\)"),
    "state-channels": (dict(state=torch.randn(2, 4, 5)), r"state must have shape .* got \(2, 4, 5\)"),
    "cu-dtype": (dict(cu_seqlens=torch.tensor([0, 2, 5])), r"cu_seqlens must have dtype torch\.int32"),
    "cu-2d": (dict(cu_seqlens=torch.tensor([[0, 2, 5]], dtype=torch.int32)), r"cu_seqlens must be 1-D"),
    "cu-empty": (dict(cu_seqlens=torch.zeros(0, dtype=torch.int32)), r"B\+1 >= 1"),
    "cu-start": (dict(cu_seqlens=torch.tensor([-1, 2, 5], dtype=torch.int32)), r"start at 0 and end at T = 5, got -1"),
    "cu-end": (dict(cu_seqlens=torch.tensor([0, 2, 3], dtype=torch.int32)), r"end at T = 5, got 0 \.\. 3"),
    "cu-decreasing": (dict(cu_seqlens=torch.tensor([0, 3, 1, 5], dtype=torch.int32), state=torch.randn(3, 4, 4)),
                      r"non-decreasing; row 1 has cu_seqlens\[1\] = 3 > cu_seqlens\[2\] = 1"),
    "dilation-0": (dict(dilation=0), r"dilation must be >= 1, got 0"),
    "dilation-negative": (dict(dilation=-2), r"dilation must be >= 1, got -2"),
    "activation": (dict(activation="relu"), r"activation must be one of \('silu', 'none'\), got 'relu'"),
}


@pytest.mark.parametrize("case", BAD_IDS)
def test_ngram_ids_bad_input(device, case):
    changes, pattern = BAD_IDS[case]
    assert_rejected("ple_ngram_ids", with_changes(good_ids_args(device), changes, device), pattern, device)


@pytest.mark.parametrize("case", BAD_CONV)
def test_conv_bad_input(device, case):
    changes, pattern = BAD_CONV[case]
    assert_rejected("ple_conv", with_changes(good_conv_args(device), changes, device), pattern, device)


@pytest.mark.parametrize("name", ["x", "weight", "cu_seqlens", "state"])
def test_conv_mismatched_devices(name):
    assert_mixed_devices_rejected("ple_conv", good_conv_args(), name)


@pytest.mark.parametrize("name", ["tokens", "history", "vocab_sizes"])
def test_ngram_ids_mismatched_devices(name):
    assert_mixed_devices_rejected("ple_ngram_ids", good_ids_args(), name)


# ----------------------------------------------------------------------------------------------
# ple_conv_into: ple_conv written into caller-owned buffers (ht.ple_conv(..., out=(y, new_state)))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_conv_into_matches_conv(device, dtype):
    gen = torch.Generator().manual_seed(5)
    for lengths, channels, width, dilation, activation in [
        ([0, 7, 1, 0, 101], 33, 4, 3, "silu"), ([5], 16, 2, 1, "none"), ([0, 0], 8, 4, 3, "silu"),
    ]:
        x, cu = pack([torch.randn(m, channels, generator=gen).to(dtype) for m in lengths])
        weight = torch.randn(channels, width, generator=gen).to(dtype)
        state = torch.randn(len(lengths), (width - 1) * dilation, channels, generator=gen).to(dtype)
        args = [t.to(device) for t in (x, weight, cu, state)]
        want = ht.ple_conv(*args, dilation, activation)
        y = torch.full_like(args[0], float("nan"))
        new_state = torch.full_like(args[3], float("nan"))
        got = ht.ple_conv(*args, dilation, activation, out=(y, new_state))
        assert got[0] is y and got[1] is new_state
        assert torch.equal(y, want[0]) and torch.equal(new_state, want[1])
        # The reference out-variant is the reference functional, copied.
        ref_y, ref_state = torch.empty_like(x), torch.empty_like(state)
        reference.ple_conv_into(x, weight, cu, state, dilation, activation, ref_y, ref_state)
        want_ref = reference.ple_conv(x, weight, cu, state, dilation, activation)
        assert torch.equal(ref_y, want_ref[0]) and torch.equal(ref_state, want_ref[1])


def test_conv_into_reused_buffers_across_chunks(device):
    # A chunked loop writing every chunk into the same two buffers gives the one-shot result.
    gen = torch.Generator().manual_seed(6)
    channels, width, dilation = 24, 4, 3
    stream = torch.randn(40, channels, generator=gen).to(device)
    weight = torch.randn(channels, width, generator=gen).to(device)
    state0 = torch.zeros(1, (width - 1) * dilation, channels, device=device)
    cu_full = torch.tensor([0, 40], dtype=torch.int32, device=device)
    want_y, want_state = ht.ple_conv(stream, weight, cu_full, state0, dilation, "silu")
    y_buf = torch.empty(8, channels, device=device)
    state_bufs = [torch.empty_like(state0), torch.empty_like(state0)]  # ping-pong: state in, new_state out
    state, ys = state0, []
    for i, start in enumerate(range(0, 40, 8)):
        cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
        y, state = ht.ple_conv(stream[start:start + 8], weight, cu, state, dilation, "silu",
                               out=(y_buf, state_bufs[i % 2]))
        ys.append(y.clone())
    assert torch.equal(torch.cat(ys), want_y) and torch.equal(state, want_state)


def conv_into_args(device="cpu"):
    args = good_conv_args(device)
    args["y"] = torch.zeros_like(args["x"])
    args["new_state"] = torch.zeros_like(args["state"])
    return args


def conv_into(y, new_state, **inputs):
    """ple_conv_into through its wrapper, ht.ple_conv(..., out=(y, new_state))."""
    return ht.ple_conv(**inputs, out=(y, new_state))


@pytest.mark.parametrize("case", BAD_CONV)
def test_conv_into_bad_input(device, case):
    changes, pattern = BAD_CONV[case]
    args = with_changes(conv_into_args(device), changes, device)
    if "x" in changes and changes["x"].dim() == 2:
        args["y"] = torch.zeros_like(args["x"])
    if "state" in changes and changes["state"].dim() == 3:
        args["new_state"] = torch.zeros_like(args["state"])
    assert_rejected("ple_conv_into", args, pattern, device, wrapper=conv_into)


BAD_CONV_OUTS = {
    "y-shape": (lambda a: dict(y=torch.zeros(5, 5)), r"y must have the shape and dtype of x, \(5, 4\) torch\.float32"),
    "y-dtype": (lambda a: dict(y=torch.zeros(5, 4, dtype=torch.float16)), r"got \(5, 4\) torch\.float16"),
    "y-strided": (lambda a: dict(y=torch.zeros(4, 5).t()), r"y and new_state must be contiguous"),
    "new-state-shape": (lambda a: dict(new_state=torch.zeros(2, 3, 4)),
                        r"new_state must have the shape and dtype of state, \(2, 4, 4\)"),
    "new-state-dtype": (lambda a: dict(new_state=torch.zeros(2, 4, 4, dtype=torch.bfloat16)),
                        r"new_state must have the shape and dtype"),
    "new-state-strided": (lambda a: dict(new_state=torch.zeros(2, 4, 4).transpose(1, 2)),
                          r"y and new_state must be contiguous"),
    "y-is-x": (lambda a: dict(y=a["x"]), r"y shares memory with x"),
    "y-inside-x": (lambda a: y_inside_x(a["x"].device), r"y shares memory with x"),
    "y-overlaps-state": (lambda a: dict(y=a["state"].view(-1)[:20].view(5, 4)), r"y shares memory with state"),
    "new-state-is-state": (lambda a: dict(new_state=a["state"]), r"new_state shares memory with state"),
    "new-state-overlaps-y": (lambda a: overlapping_outs(a["x"].device), r"y shares memory with new_state"),
}


def y_inside_x(device) -> dict:
    base = torch.randn(10, 4, device=device)
    return dict(x=base[:5], y=base[3:8])


def overlapping_outs(device) -> dict:
    flat = torch.zeros(40, device=device)
    return dict(y=flat[:20].view(5, 4), new_state=flat[8:40].view(2, 4, 4))


@pytest.mark.parametrize("case", BAD_CONV_OUTS)
def test_conv_into_bad_outputs(device, case):
    make, pattern = BAD_CONV_OUTS[case]
    args = conv_into_args(device)
    # Overlapping views are built on the device; .to(device) moves only the plain wrong-shape buffers.
    args.update({k: v.to(device) for k, v in make(args).items()})
    assert_rejected("ple_conv_into", args, pattern, device, wrapper=conv_into)


def test_conv_into_disjoint_views_of_one_buffer(device):
    # Outputs may share a storage as long as their bytes do not overlap.
    args = good_conv_args(device)
    flat = torch.zeros(52, device=device)
    y, new_state = flat[:20].view(5, 4), flat[20:].view(2, 4, 4)
    ht.ple_conv(**args, out=(y, new_state))
    want = ht.ple_conv(**args)
    assert torch.equal(y, want[0]) and torch.equal(new_state, want[1])


def test_conv_into_strided_inputs(device):
    # Inputs that are views (a column slice of a fused projection, an expanded state, a strided
    # cu_seqlens) share no memory with the outputs: accepted, as by ple_conv.
    gen = torch.Generator().manual_seed(13)
    fused = torch.randn(9, 2 * 6, generator=gen).to(device)
    x = fused[:, :6]
    weight = torch.randn(6, 4, generator=gen).to(device)
    cu = torch.tensor([0, 0, 4, 4, 9, 9], dtype=torch.int32, device=device)[::2]
    state = torch.randn(1, 9, 6, generator=gen).to(device).expand(2, 9, 6)
    want = ht.ple_conv(x, weight, cu, state, 3, "silu")
    y, new_state = torch.empty(9, 6, device=device), torch.empty(2, 9, 6, device=device)
    ht.ple_conv(x, weight, cu, state, 3, "silu", out=(y, new_state))
    assert torch.equal(y, want[0]) and torch.equal(new_state, want[1])
    overlapping = fused.view(-1)[:54].view(9, 6)                   # contiguous, over x's bytes
    before = fused.clone()
    with pytest.raises(HebrusError, match="shares memory with x"):
        ht.ple_conv(x, weight, cu, state, 3, "silu", out=(overlapping, new_state))
    assert torch.equal(fused, before)


@pytest.mark.parametrize("name", ["x", "state", "y", "new_state"])
def test_conv_into_mismatched_devices(name):
    assert_mixed_devices_rejected("ple_conv_into", conv_into_args(), name, wrapper=conv_into)


def test_conv_into_opcheck(device):
    for x, weight, cu, state, dilation, act in conv_samples():
        args = tuple(t.to(device) for t in (x, weight, cu, state))
        outs = (torch.empty_like(args[0]), torch.empty_like(args[3]))
        torch.library.opcheck(torch.ops.hebrus.ple_conv_into.default, (*args, dilation, act, *outs))


def test_conv_into_compiled_loop_matches_eager(device):
    gen = torch.Generator().manual_seed(10)
    channels, width, dilation = 32, 4, 3
    weight = torch.randn(channels, width, generator=gen).to(device)
    chunks = []
    for lengths in ([5, 0, 3], [1, 2, 1], [4, 4, 0]):
        x, cu = pack([torch.randn(m, channels, generator=gen) for m in lengths])
        chunks.append((x.to(device), cu.to(device)))
    state0 = torch.randn(3, (width - 1) * dilation, channels, generator=gen).to(device)

    proj = torch.randn(channels, 16, generator=gen).to(device)

    # Each chunk's y is consumed (projected, as the model does) before the next chunk overwrites the
    # buffer. (A bare y.clone() in its place is a known inductor reinplacing bug in torch 2.13: the
    # clone is dropped as a no-op, see the README.)
    def loop(state, y_buf, state_bufs):
        outs = []
        for i, (x, cu) in enumerate(chunks):
            y, state = ht.ple_conv(x, weight, cu, state, dilation, "silu",
                                   out=(y_buf[: x.shape[0]], state_bufs[i % 2]))
            outs.append(y @ proj)
        return outs, state

    def buffers():
        return torch.empty(8, channels, device=device), [torch.empty_like(state0), torch.empty_like(state0)]

    torch._dynamo.reset()
    try:
        compiled = torch.compile(loop, fullgraph=True)(state0, *buffers())
    finally:
        torch._dynamo.reset()
    eager = loop(state0, *buffers())
    assert all(torch.equal(a, b) for a, b in zip(compiled[0], eager[0]))
    assert torch.equal(compiled[1], eager[1])
