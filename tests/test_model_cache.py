"""ModelCache: handles shared by both holders, atomic lifecycle (PLE first), chunk steps in one
transaction, rewind via PLE snapshots, saved state (SPEC §4, §5)."""

import collections
import copy
import hashlib
import random
import re
import struct

import pytest
import torch

import hebrus_torch as ht
from hebrus_torch import model_cache
from hebrus_torch.errors import CorruptStateError, HebrusError, HoleError, NonSuccessorError, StaleHandleError
from hebrus_torch.qsa.cache import QSACache
from hebrus_torch.state import blob as blob_mod
from hebrus_torch.state.handles import MAX_GENERATION

from hf_models import modeling, tiny_config  # skips without transformers

LAYER_TYPES = ["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = tiny_config(num_hidden_layers=4, layer_types=LAYER_TYPES, ple_layer_ids=[1, 3])
    m = modeling.Qwen4ExpForCausalLM(cfg).eval()
    for layer in m.model.layers:
        if layer.ple is not None:
            torch.nn.init.normal_(layer.ple.conv1d.weight)
        if layer.layer_type == "indexed_attention":
            torch.nn.init.normal_(layer.self_attn.indexer.k_layernorm.weight, std=0.1)
    return m


class Tables:
    """Per-token inputs, so the same token stream gives the same layer inputs however it is cut."""

    def __init__(self, mc, seed=0):
        g = torch.Generator().manual_seed(seed)
        vocab = mc.ple.vocab_size
        self.x = torch.randn(vocab, mc.ple.channels, generator=g)
        d = mc.qsa.head_dim if hasattr(mc.qsa, "head_dim") else 16
        self.keys = torch.randn(vocab, d, generator=g)
        self.q = torch.randn(vocab, 2, d, generator=g)


def make_cache(model, **kw):
    return ht.ModelCache.from_transformers(model, capacity_tokens=256, max_sequences=4, **kw)


def run_chunk(mc, tables, rows, fail_after_layer=None, first_positions=None):
    """Every layer of the model over one packed chunk; returns {layer: (ids, y) or plan}."""
    batch = ht.Batch.pack(rows, first_positions=first_positions)
    out = {}
    with mc.transaction(batch) as step:
        for li in range(len(LAYER_TYPES)):
            if li in mc.ple.layer_ids:
                out[("ids", li)] = step.ple_ngram_ids(li)
                out[("y", li)] = step.ple_conv(li, tables.x[batch.tokens])
            if li in mc.qsa.layer_ids:
                step.qsa_write(li, tables.keys[batch.tokens])
                out[("plan", li)] = step.qsa_select(li, tables.q[batch.tokens])
            if fail_after_layer == li:
                raise RuntimeError(f"injected failure after layer {li}")
    return out


def digests(mc):
    """The cache's digest and both holders': equal before and after a refused call."""
    return mc.digest(), mc.ple.digest(), mc.qsa.digest()


def feed(mc, tables, seq, tokens, cuts):
    outs, start = [], 0
    for stop in list(cuts) + [len(tokens)]:
        if stop > start:
            outs.append(run_chunk(mc, tables, {seq: tokens[start:stop]}))
            start = stop
    return outs


def test_from_transformers_wires_both_holders(model):
    mc = make_cache(model)
    assert mc.ple.layer_ids == [0, 2] and mc.qsa.layer_ids == [1, 3]
    assert mc.top_k == model.config.indexer_budget // model.config.indexer_compress_ratio
    a = mc.new_sequence()
    mc.ple.snapshot(a)
    assert mc.qsa.run(a)[1] == 0


def test_holders_plain_attributes_are_never_module_members(model):
    """The bookkeeping names each holder sets without nn.Module's checks (``_PLAIN_ATTRS``, state/plain_attrs.py)
    are never its parameters, buffers or submodules, before or after a step, and land in its ``__dict__``; any other
    name still takes nn.Module's path (a buffer set anew stays a buffer)."""
    mc = ht.ModelCache.from_transformers(model, capacity_tokens=256, max_sequences=4)
    tables = Tables(mc)
    a = mc.new_sequence()
    holders = (mc, mc.qsa, mc.ple, mc.gdn) if mc.gdn is not None else (mc, mc.qsa, mc.ple)
    for when in ("built", "after a step"):
        for holder in holders:
            assert holder._PLAIN_ATTRS, type(holder).__name__
            for name in holder._PLAIN_ATTRS:
                assert name not in holder._parameters and name not in holder._buffers \
                    and name not in holder._modules, (when, type(holder).__name__, name)
        run_chunk(mc, tables, {a: [5, 6, 7]})
    assert "_txn_depth_owner" in mc.qsa.__dict__ and "_backup" in mc.__dict__
    keys = mc.qsa.keys.clone()
    mc.qsa.keys = keys
    assert mc.qsa._buffers["keys"] is keys and "keys" not in mc.qsa.__dict__


def test_chunk_invariance_across_holders(model):
    tokens = torch.randint(0, 50, (30,), generator=torch.Generator().manual_seed(1))
    tokens[[0, 9, 10]] = 3
    cuts = {"one shot": [], "1/2/1": [], "random": sorted(random.Random(2).sample(range(1, 30), 7))}
    pos, pattern = 0, [1, 2, 1]
    while pos < 30:
        pos += pattern[len(cuts["1/2/1"]) % 3]
        cuts["1/2/1"].append(pos)
    results = {}
    for name, c in cuts.items():
        mc = make_cache(model)
        tables = Tables(mc)
        seq = mc.new_sequence()
        outs = feed(mc, tables, seq, tokens, c)
        sel = {li: torch.cat([o[("plan", li)].selected_groups for o in outs]) for li in mc.qsa.layer_ids}
        ys = {li: torch.cat([o[("y", li)] for o in outs]) for li in mc.ple.layer_ids}
        results[name] = (mc.digest(), sel, ys)
    base = results["one shot"]
    for name, (digest, sel, ys) in results.items():
        assert digest == base[0], name
        for li in sel:
            assert torch.equal(sel[li], base[1][li]), name
        for li in ys:
            assert torch.equal(ys[li], base[2][li]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_random_packed_chunks_give_each_sequence_its_solo_results(model, dtype):
    """SPEC §5.1 for the whole cache, in every dtype: three sequences prefilled in random packed chunks (random
    subsets, random lengths, empty rows) get, token for token, the ids, conv outputs and selections of each
    sequence alone in one shot, bitwise, and the same per-sequence state digests."""
    cast = copy.deepcopy(model).to(dtype)
    lengths = (26, 13, 31)
    g = torch.Generator().manual_seed(7)
    streams = [torch.randint(0, 50, (n,), generator=g) for n in lengths]
    streams[0][[0, 11]] = cast.config.eos_token_id
    streams[2][[5, 6, 30]] = cast.config.eos_token_id

    def tables_for(mc):
        t = Tables(mc)
        t.x, t.keys, t.q = t.x.to(dtype), t.keys.to(dtype), t.q.to(dtype)
        return t

    def collect(out, batch_rows, into):
        for (kind, li), value in out.items():
            if kind == "plan":
                for row, seq in enumerate(batch_rows):
                    own = value.q_rows == row
                    into[(seq, li, "groups")].append(value.selected_groups[own])
                    into[(seq, li, "positions")].append(value.token_positions[own])
            else:
                for seq, part in zip(batch_rows, value.split([n for n in batch_rows.values()])):
                    into[(seq, li, kind)].append(part)

    solo = {}
    for i, tokens in enumerate(streams):
        mc = make_cache(cast)
        seq = mc.new_sequence()
        got = collections.defaultdict(list)
        collect(run_chunk(mc, tables_for(mc), {seq: tokens}), {seq: len(tokens)}, got)
        solo[i] = ({k[1:]: torch.cat(v) for k, v in got.items()}, mc.ple.digest(seq), mc.qsa.digest(seq))

    mc = make_cache(cast)
    tables = tables_for(mc)
    seqs = [mc.new_sequence() for _ in streams]
    done = [0] * len(streams)
    got = collections.defaultdict(list)
    rng = random.Random(8)
    while any(d < len(t) for d, t in zip(done, streams)):
        rows = {}
        for i in rng.sample(range(len(streams)), rng.randint(1, len(streams))):
            n = rng.randint(0, min(7, len(streams[i]) - done[i]))
            rows[seqs[i]] = streams[i][done[i]:done[i] + n]
            done[i] += n
        if sum(len(r) for r in rows.values()) == 0:
            continue
        collect(run_chunk(mc, tables, rows), {s: len(r) for s, r in rows.items()}, got)
    for i, seq in enumerate(seqs):
        want, ple_digest, qsa_digest = solo[i]
        assert sorted({kind for _, kind in want}) == ["groups", "ids", "positions", "y"]
        for key, value in want.items():
            assert torch.equal(torch.cat(got[(seq, *key)]), value), (i, key)
        assert mc.ple.digest(seq) == ple_digest and mc.qsa.digest(seq) == qsa_digest, i


def hf_ple_outputs(model, layer_idx, tokens, x):
    """Row ids and conv output of one decoder layer's transformers PLE modules over a whole fresh sequence."""
    ple = model.model.layers[layer_idx].ple
    captured = []
    hook = ple.ple_embedding.ngram_embedding.register_forward_pre_hook(lambda mod, args: captured.append(args[0]))
    try:
        with torch.no_grad():
            ple.ple_embedding(tokens[None], None)
            y = ple._short_conv(x[None], None)[0]
    finally:
        hook.remove()
    return captured[0][0], y


def test_chunked_ple_outputs_match_transformers_and_the_unchunked_ops(model):
    """SPEC §2, §5.1, §5.5: every layer's row ids and conv outputs of a packed, chunked prefill through the
    ModelCache equal transformers' modules over each whole sequence (ids exact, fp32 within 1e-5) and, bitwise,
    the ops over the unchunked batch from the fresh state (history all EOS, zero tails)."""
    mc = make_cache(model)
    tables = Tables(mc)
    eos = model.config.eos_token_id
    g = torch.Generator().manual_seed(5)
    streams = {mc.new_sequence(): torch.randint(0, 50, (23,), generator=g),
               mc.new_sequence(): torch.randint(0, 50, (17,), generator=g)}
    a, b = streams
    streams[a][[0, 6, 7, 15]] = eos
    streams[b][[4, 16]] = eos
    got = {(s, li, kind): [] for s in streams for li in mc.ple.layer_ids for kind in ("ids", "y")}
    done = dict.fromkeys(streams, 0)
    for lens in ({a: 1, b: 4}, {a: 3, b: 0}, {a: 4, b: 2}, {a: 15, b: 11}):
        out = run_chunk(mc, tables, {s: streams[s][done[s]:done[s] + n] for s, n in lens.items()})
        for (kind, li), value in out.items():
            if kind in ("ids", "y"):
                for s, part in zip(lens, value.split(list(lens.values()))):
                    got[(s, li, kind)].append(part)
        done = {s: done[s] + n for s, n in lens.items()}
    tokens = torch.cat(list(streams.values()))
    cu = torch.tensor([0, 23, 40], dtype=torch.int32)
    fresh_history = torch.full((2, mc.ple.ngram_size - 1), eos)
    zero_tails = torch.zeros(2, mc.ple.state_len, mc.ple.channels)
    for k, li in enumerate(mc.ple.layer_ids):
        emb, conv = model.model.layers[li].ple.ple_embedding, model.model.layers[li].ple.conv1d
        want_ids, history = ht.ple_ngram_ids(tokens, cu, fresh_history, emb.layer_multipliers,
                                             emb.ngram_heads_vocab_sizes, emb.ngram_heads_offsets, eos,
                                             mc.ple.vocab_size)
        want_y, tails = ht.ple_conv(tables.x[tokens], conv.weight.detach().squeeze(1), cu, zero_tails,
                                    conv.dilation[0], "silu")
        for row, s in enumerate(streams):
            ids, y = torch.cat(got[(s, li, "ids")]), torch.cat(got[(s, li, "y")])
            hf_ids, hf_y = hf_ple_outputs(model, li, streams[s], tables.x[streams[s]])
            assert torch.equal(ids, hf_ids), (s, li)
            torch.testing.assert_close(y, hf_y, atol=1e-5, rtol=1e-5)
            assert torch.equal(ids, want_ids[cu[row]:cu[row + 1]]), (s, li)
            assert torch.equal(y, want_y[cu[row]:cu[row + 1]]), (s, li)
            snap = mc.ple.snapshot(s)
            assert torch.equal(snap.history[k], history[row]) and torch.equal(snap.conv_tails[k], tails[row]), (s, li)


def test_failure_in_a_late_layer_publishes_nothing(model):
    mc = make_cache(model)
    tables = Tables(mc)
    a, b = mc.new_sequence(), mc.new_sequence()
    run_chunk(mc, tables, {a: torch.tensor([5, 6, 7, 8, 9])})
    before = mc.digest()
    with pytest.raises(RuntimeError, match="injected"):
        run_chunk(mc, tables, {a: torch.tensor([1, 2]), b: torch.tensor([4, 4, 4])}, fail_after_layer=3)
    assert mc.digest() == before
    assert mc.qsa.run(a) == (0, 5) and mc.qsa.run(b)[1] == 0


def test_isolation_untouched_sequence_bitwise_unchanged(model):
    mc = make_cache(model)
    tables = Tables(mc)
    a, b, c = mc.new_sequence(), mc.new_sequence(), mc.new_sequence()
    run_chunk(mc, tables, {c: torch.arange(10, 19)})
    c_ple, c_qsa = mc.ple.digest(c), mc.qsa.digest(c)
    out = run_chunk(mc, tables, {a: torch.arange(20, 33), b: torch.arange(1, 8)})
    solo = make_cache(model)
    s = solo.new_sequence()
    alone = run_chunk(solo, Tables(solo), {s: torch.arange(20, 33)})
    for li in mc.qsa.layer_ids:
        assert torch.equal(out[("plan", li)].selected_groups[:13], alone[("plan", li)].selected_groups)
    assert mc.ple.digest(a) == solo.ple.digest(s) and mc.qsa.digest(a) == solo.qsa.digest(s)
    assert mc.ple.digest(c) == c_ple and mc.qsa.digest(c) == c_qsa


def test_rewind_needs_a_snapshot_and_restores_both(model):
    mc = make_cache(model)
    tables = Tables(mc)
    a = mc.new_sequence()
    tokens = torch.randint(0, 50, (20,), generator=torch.Generator().manual_seed(4))
    feed(mc, tables, a, tokens[:12], [])
    before = mc.digest()
    with pytest.raises(HebrusError, match="snapshot"):
        mc.rewind(a, 8)
    assert mc.digest() == before
    mc.checkpoint(a)                      # at position 12
    at_12 = mc.digest()
    feed(mc, tables, a, tokens[12:], [3])
    mc.rewind(a, 12)
    assert mc.digest() == at_12
    mc.rewind(a, 0)                        # dropping everything clears PLE too
    fresh = make_cache(model)
    fresh.new_sequence()
    assert mc.ple.digest(a) == fresh.ple.digest(fresh.slots.live_handles()[0])
    assert mc.qsa.run(a)[1] == 0


def test_keep_snapshots_allows_rewind_to_last_chunk(model):
    mc = make_cache(model, keep_snapshots=2)
    tables = Tables(mc)
    a = mc.new_sequence()
    feed(mc, tables, a, torch.arange(1, 11), [])
    at_10 = mc.digest()
    feed(mc, tables, a, torch.arange(11, 14), [])
    mc.rewind(a, 10)
    assert mc.digest() == at_10


@pytest.mark.parametrize("p1", [-1, 20, 1000], ids=["to the end", "to the frontier", "past the frontier"])
def test_removing_a_suffix_needs_a_snapshot_and_then_equals_a_prefill_to_p(model, p1):
    """SPEC §4: remove(seq, p, end) is a partial rewind; without a PLE snapshot at p it refuses and changes nothing."""
    tokens = torch.randint(0, 50, (20,), generator=torch.Generator().manual_seed(6))
    mc = make_cache(model)
    tables = Tables(mc)
    a = mc.new_sequence()
    feed(mc, tables, a, tokens[:8], [3])
    mc.checkpoint(a)
    feed(mc, tables, a, tokens[8:], [13])
    before = digests(mc)
    with pytest.raises(HebrusError, match=r"to position 5 needs a PLE snapshot at 5 .*snapshots kept at \[8\]"):
        mc.remove(a, 5, p1)
    assert digests(mc) == before
    assert mc.qsa.run(a) == (0, 20)
    assert mc.ple.slots.live_handles() == mc.qsa.slots.live_handles() == mc.slots.live_handles() == [a]
    mc.remove(a, 8, p1)
    assert mc.qsa.run(a) == (0, 8)
    prefilled = make_cache(model)
    s = prefilled.new_sequence()
    feed(prefilled, Tables(prefilled), s, tokens[:8], [])
    assert digests(mc) == digests(prefilled)


@pytest.mark.parametrize("inside", ["rewind to 0", "remove all", "shift", "a chunk that evicts it"])
def test_rolled_back_transaction_restores_the_ple_snapshots(model, inside):
    """The snapshots are no part of digest(): after a rollback, rewinding to the checkpoint must still work."""
    mc = make_cache(model, keep_snapshots=1)
    tables = Tables(mc)
    a = mc.new_sequence()
    feed(mc, tables, a, torch.arange(1, 9), [])
    mc.checkpoint(a)
    at_8 = mc.digest()
    feed(mc, tables, a, torch.arange(9, 13), [])
    before = mc.digest()

    def failing(change):
        def run():
            with mc.transaction():
                change()
                raise RuntimeError("injected failure after the snapshot was dropped or moved")
        return run

    actions = {
        "rewind to 0": failing(lambda: mc.rewind(a, 0)),
        "remove all": failing(lambda: mc.remove(a, 0, -1)),
        "shift": failing(lambda: mc.shift(a, 0, -1, 5)),
        "a chunk that evicts it": lambda: run_chunk(mc, tables, {a: [13, 14]}, fail_after_layer=0),
    }
    with pytest.raises(RuntimeError, match="injected"):
        actions[inside]()
    assert mc.digest() == before
    mc.rewind(a, 8)
    assert mc.digest() == at_8


def test_lifecycle_forwarded_atomically(model):
    mc = make_cache(model)
    tables = Tables(mc)
    a = mc.new_sequence()
    feed(mc, tables, a, torch.arange(1, 17), [])
    f = mc.fork(a)
    assert mc.ple.digest(f) == mc.ple.digest(a) and mc.qsa.digest(f) == mc.qsa.digest(a)
    before = mc.digest()
    with pytest.raises(HoleError):
        mc.remove(a, 4, 8)                  # a middle range is a hole
    with pytest.raises(HoleError):
        mc.shift(a, 0, 8, 5)                # only whole-run shifts
    assert mc.digest() == before
    mc.remove(a, 0, 4)                      # prefix: groups re-anchored at 4
    assert mc.qsa.run(a) == (4, 12)
    mc.shift(a, 4, -1, 10)
    assert mc.qsa.run(a) == (14, 12)
    with pytest.raises(NonSuccessorError):
        run_chunk(mc, tables, {a: torch.tensor([1])}, first_positions={a: 40})
    b = mc.new_sequence()
    mc.copy(f, b)
    assert mc.qsa.digest(b) == mc.qsa.digest(f)
    mc.keep(b)
    assert [h.slot for h in mc.slots.live_handles()] == [b.slot]
    with pytest.raises(StaleHandleError):
        mc.free(a)
    r = mc.reset(b)
    assert r.generation == b.generation + 1 and mc.qsa.run(r)[1] == 0
    with pytest.raises(StaleHandleError):
        mc.rewind(b, 0)


def test_save_free_restore_roundtrip_and_corruption(model):
    mc = make_cache(model)
    tables = Tables(mc)
    b = mc.new_sequence()
    feed(mc, tables, b, torch.arange(3, 26), [7])
    ple_d, qsa_d = mc.ple.digest(b), mc.qsa.digest(b)
    data = mc.save(b)
    mc.free(b)
    before = mc.digest()
    for bad, reason in ((data[:-1], "checksum mismatch"), (data[:40], "truncated: 40 bytes"),
                        (data[:20] + bytes([data[20] ^ 1]) + data[21:], "checksum mismatch")):
        with pytest.raises(CorruptStateError, match=reason):
            mc.restore(bad)
        assert mc.digest() == before
    b2 = mc.restore(data)
    assert mc.ple.digest(b2) == ple_d and mc.qsa.digest(b2) == qsa_d
    out = run_chunk(mc, tables, {b2: torch.tensor([30])})
    assert out[("plan", 1)].positions.tolist() == [23]


def with_format_version(data, version):
    """A blob re-stamped with another format version and its sha256 recomputed: consistent, of another version."""
    body = bytearray(data[:-32])
    struct.pack_into("<I", body, len(blob_mod.MAGIC), version)
    return bytes(body) + hashlib.sha256(body).digest()


@pytest.mark.parametrize("part", ["ModelCache", "ple", "qsa"])
@pytest.mark.parametrize("version", [blob_mod.FORMAT_VERSION + 1, 0])
def test_restore_refuses_another_format_version_with_a_valid_checksum(model, part, version):
    mc = make_cache(model)
    a = mc.new_sequence()
    feed(mc, Tables(mc), a, torch.arange(3, 12), [])
    data = mc.save(a)
    if part == "ModelCache":
        bad = with_format_version(data, version)
    else:
        meta, parts = blob_mod.unpack(data, "hebrus_torch.ModelCache")
        stamped = with_format_version(parts[part].numpy().tobytes(), version)
        parts[part] = torch.frombuffer(bytearray(stamped), dtype=torch.uint8)
        bad = blob_mod.pack("hebrus_torch.ModelCache", meta, parts)
    before = (*digests(mc), mc.slots.live_handles())
    with pytest.raises(CorruptStateError,
                       match=rf"blob has format version {version}; this build reads {blob_mod.FORMAT_VERSION}"):
        mc.restore(bad)
    assert (*digests(mc), mc.slots.live_handles()) == before
    assert mc.ple.digest(mc.restore(data)) == mc.ple.digest(a)


@pytest.mark.parametrize("slot_now", ["free", "live again"])
def test_restore_into_a_stale_handle_is_refused_and_changes_nothing(model, slot_now):
    mc = make_cache(model)
    a = mc.new_sequence()
    feed(mc, Tables(mc), a, torch.arange(3, 12), [])
    data = mc.save(a)
    stale = mc.new_sequence()
    mc.free(stale)
    if slot_now == "live again":
        assert mc.new_sequence() == ht.SeqHandle(stale.slot, stale.generation + 1)
    before = (*digests(mc), mc.slots.live_handles())
    with pytest.raises(StaleHandleError, match=re.escape(f"{stale} is older")):
        mc.restore(data, stale)
    assert (*digests(mc), mc.slots.live_handles()) == before
    assert mc.ple.slots.live_handles() == mc.qsa.slots.live_handles() == mc.slots.live_handles()


def test_saved_sequence_restores_into_a_cache_of_another_slot_count(model):
    mc = make_cache(model)
    a = mc.new_sequence()
    feed(mc, Tables(mc), a, torch.arange(3, 14), [5])
    other = ht.ModelCache.from_transformers(model, capacity_tokens=128, max_sequences=7)
    b = other.restore(mc.save(a))
    assert other.ple.digest(b) == mc.ple.digest(a) and other.qsa.digest(b) == mc.qsa.digest(a)


def test_state_dict_roundtrip_and_validation(model):
    mc = make_cache(model)
    tables = Tables(mc)
    a = mc.new_sequence()
    feed(mc, tables, a, torch.arange(1, 14), [])
    sd = mc.state_dict()
    other = make_cache(model)
    other.load_state_dict(sd)
    assert other.digest() == mc.digest()
    run_chunk(other, Tables(other), {a: torch.tensor([7, 8])})  # the handle is valid in the copy
    before = other.digest()
    bad = dict(sd)
    key = next(k for k in sd if k.startswith("ple.conv_state"))
    bad[key] = sd[key].clone() + 1
    with pytest.raises(CorruptStateError, match="PLEState: checksum mismatch"):
        other.load_state_dict(bad)
    table = {"generation": [0] * 4, "live": [False] * 4}
    bad = dict(sd, _extra_state=dict(sd["_extra_state"], **table))
    with pytest.raises(CorruptStateError, match="checksum"):
        other.load_state_dict(bad)
    bad = dict(sd, _extra_state=dict(sd["_extra_state"], **table, checksum=mc._table_checksum(
        **table, origin=sd["_extra_state"]["origin"])))
    with pytest.raises(CorruptStateError, match="disagrees"):
        other.load_state_dict(bad)
    assert other.digest() == before


def test_load_that_fails_while_re_pooling_publishes_nothing(model, monkeypatch):
    """The QSA cache re-derives its pooled groups on load; that ran after PLE had published its part."""
    mc = make_cache(model)
    a = mc.new_sequence()
    feed(mc, Tables(mc), a, torch.arange(1, 11), [])
    sd = mc.state_dict()
    target = make_cache(model)
    b, c = target.new_sequence(), target.new_sequence()
    feed(target, Tables(target), b, torch.arange(3, 9), [])
    before = digests(target)

    def interrupted(*args, **kwargs):
        raise RuntimeError("injected failure while re-pooling")

    monkeypatch.setattr(target.qsa, "_pool", interrupted)
    with pytest.raises(RuntimeError, match="injected"):
        target.load_state_dict(sd)
    monkeypatch.undo()
    assert digests(target) == before
    target.free(c)
    target.load_state_dict(sd)
    assert target.digest() == mc.digest()


@pytest.mark.parametrize("table", [
    {"generation": ["x", 0, 0, 0]},                       # not an integer
    {"generation": [-7, 0, 0, 0]},                        # negative
    {"generation": [True, 0, 0, 0]},                      # a bool is not a generation
    {"live": [1, 0, 0, 0]},                               # an int is not a live flag
    {"generation": [0, 0, 0]},                            # wrong length
])
def test_state_dict_handle_table_is_validated_before_anything_changes(model, table):
    mc = make_cache(model)
    a = mc.new_sequence()
    feed(mc, Tables(mc), a, torch.arange(1, 8), [])
    sd = mc.state_dict()
    other = make_cache(model)
    b = other.new_sequence()
    feed(other, Tables(other), b, torch.arange(3, 6), [])
    before = digests(other)
    generation, live = [table.get(k, sd["_extra_state"][k]) for k in ("generation", "live")]
    bad = dict(sd, _extra_state=dict(sd["_extra_state"], generation=generation, live=live,
                                     checksum=mc._table_checksum(generation, live, sd["_extra_state"]["origin"])))
    with pytest.raises(CorruptStateError, match="handle table"):
        other.load_state_dict(bad)
    assert digests(other) == before


def with_generation(mc, sd, slot, generation):
    """``sd`` with one slot's generation set in the handle table and in both holders, every checksum
    recomputed: a consistent tamper (the sha256s are no signatures)."""
    sd = dict(sd)
    for name in ("ple", "qsa"):
        gen = sd[f"{name}.generation"].clone()
        gen[slot] = generation
        sd[f"{name}.generation"] = gen
    sd["ple._extra_state"] = dict(sd["ple._extra_state"], checksum=blob_mod.digest_of(
        [(n, sd[f"ple.{n}"]) for n in ht.PLEState._STATE_NAMES]))
    qsa = {k[4:]: v for k, v in sd.items() if k.startswith("qsa.") and k != "qsa._extra_state"}
    sd["qsa._extra_state"] = dict(sd["qsa._extra_state"], checksum=QSACache._checksum(qsa))
    table = {"generation": list(sd["_extra_state"]["generation"]), "live": sd["_extra_state"]["live"]}
    table["generation"][slot] = generation
    sd["_extra_state"] = dict(sd["_extra_state"], **table,
                              checksum=mc._table_checksum(**table, origin=sd["_extra_state"]["origin"]))
    return sd


def test_generations_are_bounded_so_no_bump_overflows(model):
    mc = make_cache(model)
    a = mc.new_sequence()
    feed(mc, Tables(mc), a, torch.arange(1, 8), [])
    data = mc.save(a)
    before = digests(mc)
    for g in (2**63 - 1, MAX_GENERATION):
        with pytest.raises(HebrusError, match=r"2\*\*62 - 1"):
            mc.restore(data, ht.SeqHandle(1, g))
        assert digests(mc) == before
    last = mc.restore(data, ht.SeqHandle(1, MAX_GENERATION - 1))
    with pytest.raises(HebrusError, match=r"2\*\*62 - 1"):
        mc.reset(last)
    mc.free(last)                                       # slot 1 is retired at the largest generation
    assert mc.new_sequence() == ht.SeqHandle(2, 0)
    sd = mc.state_dict()
    other = make_cache(model)
    other.load_state_dict(sd)
    assert other.digest() == mc.digest()
    before = digests(other)
    for slot, g in ((0, 2**63 - 1), (1, MAX_GENERATION + 1), (2, MAX_GENERATION)):    # slots 0 and 2 are live
        with pytest.raises(CorruptStateError, match=r"2\*\*62 - 1"):
            other.load_state_dict(with_generation(mc, sd, slot, g))
        assert digests(other) == before
    other.load_state_dict(with_generation(mc, sd, 3, 5))   # a consistent tamper within the bound loads


class _Runtime(torch.nn.Module):
    """A user's module that holds a ModelCache, saved and loaded through torch's recursion."""

    def __init__(self, cache):
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)
        self.cache = cache


def test_state_dict_through_a_parent_module(model):
    mc = make_cache(model)
    a = mc.new_sequence()
    feed(mc, Tables(mc), a, torch.arange(1, 11), [])
    sd = _Runtime(mc).state_dict()
    assert "cache._extra_state" in sd and "cache.qsa._extra_state" in sd and "cache.ple.history" in sd
    target = _Runtime(make_cache(model))
    target.load_state_dict(sd)
    assert target.cache.digest() == mc.digest()
    run_chunk(target.cache, Tables(target.cache), {a: torch.tensor([4, 5])})   # handles carry over
    before = digests(target.cache)
    for key, tamper, reason in (("cache.ple.history", lambda t: t.clone().fill_(10**6), "PLEState: checksum"),
                                ("cache.ple.live", lambda t: ~t, "PLEState: checksum"),
                                ("cache.qsa.keys", lambda t: t + 1, "QSACache.load_state_dict: checksum")):
        bad = dict(sd)
        bad[key] = tamper(sd[key])
        with pytest.raises(CorruptStateError, match=reason):
            target.load_state_dict(bad)
        assert digests(target.cache) == before


def test_a_cache_with_an_owner_refuses_every_load_and_keeps_its_state(model):
    """``ModelCache.owner`` (an Engine sets it): load_state_dict, directly or through a parent module, and
    publish_state_dict are refused naming the owner, with nothing changed; without an owner the same state loads."""
    mc = make_cache(model)
    a = mc.new_sequence()
    feed(mc, Tables(mc), a, torch.arange(1, 11), [])
    sd, parent_sd = mc.state_dict(), _Runtime(mc).state_dict()
    target = _Runtime(make_cache(model))
    b = target.cache.new_sequence()
    feed(target.cache, Tables(target.cache), b, torch.arange(3, 9), [])
    before = target.cache.digest()
    target.cache.owner = "a test's runtime"
    for load in (lambda: target.cache.load_state_dict(sd), lambda: target.load_state_dict(parent_sd),
                 lambda: target.cache.publish_state_dict(sd)):
        with pytest.raises(HebrusError, match="run by a test's runtime"):
            load()
        assert target.cache.digest() == before
    target.cache.owner = None
    target.cache.load_state_dict(sd)
    assert target.cache.digest() == mc.digest()


def test_unexpected_keys_are_refused_with_strict(model):
    mc = make_cache(model)
    a = mc.new_sequence()
    feed(mc, Tables(mc), a, torch.arange(1, 11), [])
    sd = mc.state_dict()
    target = make_cache(model)
    b = target.new_sequence()
    feed(target, Tables(target), b, torch.arange(3, 6), [])
    before = digests(target)
    for extra in ({"bogus": torch.zeros(3)}, {"ple.conv_statee": torch.zeros(3)}, {"qsa.typo": torch.zeros(1)}):
        with pytest.raises(CorruptStateError, match=rf"unexpected key\(s\) \['{next(iter(extra))}'\]"):
            target.load_state_dict(dict(sd, **extra))
        assert digests(target) == before
        parent_sd = {f"cache.{k}": v for k, v in dict(sd, **extra).items()}
        with pytest.raises(CorruptStateError, match="unexpected key"):   # torch passes strict=True to every child
            _Runtime(target).load_state_dict(dict(_Runtime(mc).state_dict(), **parent_sd), strict=False)
        assert digests(target) == before
    with pytest.raises(CorruptStateError, match="version"):
        target.load_state_dict(dict(sd, _extra_state=dict(sd["_extra_state"], version=True)))
    result = target.load_state_dict(dict(sd, bogus=torch.zeros(3), **{"ple.typo": torch.zeros(1)}), strict=False)
    assert result.unexpected_keys == ["bogus", "ple.typo"] and target.digest() == mc.digest()


def test_casts_are_refused_for_both_holders_before_either_moves(model):
    mc = make_cache(model)
    a = mc.new_sequence()
    feed(mc, Tables(mc), a, torch.arange(1, 9), [])
    before = digests(mc)
    for cast in (lambda: mc.double(), lambda: mc.to(torch.float64)):
        with pytest.raises(HebrusError, match="cannot cast"):
            cast()
        assert digests(mc) == before
        assert mc.ple.conv_state.dtype == mc.qsa.keys.dtype == torch.float32
    with ht.transaction(mc.qsa):                  # only the QSA cache is in a transaction: PLE must not move either
        with pytest.raises(HebrusError, match="inside a transaction"):
            mc.half()
        assert mc.ple.conv_state.dtype == torch.float32
    with pytest.raises(HebrusError, match="inside a transaction"):
        with mc.transaction():
            mc.half()
    assert digests(mc) == before
    mc.half()
    assert mc.ple.conv_state.dtype == mc.qsa.keys.dtype == torch.float16


def test_transaction_over_a_model_cache_covers_both_holders(model):
    mc = make_cache(model)
    a = mc.new_sequence()
    feed(mc, Tables(mc), a, torch.arange(1, 7), [])
    before = digests(mc)
    with pytest.raises(RuntimeError, match="injected"):
        with ht.transaction(mc):
            mc.new_sequence()
            mc.rewind(a, 0)
            raise RuntimeError("injected")
    assert digests(mc) == before
    with pytest.raises(HebrusError, match="already inside a transaction"):
        with ht.transaction(mc.qsa):
            with ht.transaction(mc):
                pass
    assert mc.new_sequence() == ht.SeqHandle(1, 0)


def test_failed_lifecycle_op_inside_a_transaction_changes_nothing(model):
    """Each lifecycle op is atomic on its own, also inside a larger block that goes on and commits."""
    mc = make_cache(model)
    a = mc.new_sequence()
    feed(mc, Tables(mc), a, torch.arange(1, 7), [])
    blob = mc.save(a)
    other_config = ht.ModelCache.from_transformers(model, capacity_tokens=256, max_sequences=4, with_kv=True)
    foreign = other_config.save(other_config.new_sequence())      # QSA part configured differently
    before = digests(mc)
    with mc.transaction():
        with pytest.raises(CorruptStateError, match="QSACache.restore: blob was saved by a cache configured"):
            mc.restore(foreign)            # the PLE part is fine and restores first; the QSA part refuses
        assert digests(mc) == before
        with pytest.raises(HebrusError, match="needs a PLE snapshot"):
            mc.rewind(a, 3)
        b = mc.restore(blob)
    assert mc.ple.slots.live_handles() == mc.qsa.slots.live_handles() == mc.slots.live_handles() == [a, b]
    assert mc.ple.digest(b) == mc.ple.digest(a) and mc.qsa.digest(b) == mc.qsa.digest(a)


def test_commit_that_cannot_complete_rolls_back_every_holder(model, monkeypatch):
    """Pooling the chunk's last groups happens at commit; if it fails there, nothing is published."""
    mc = make_cache(model)
    tables = Tables(mc)
    a = mc.new_sequence()
    feed(mc, tables, a, torch.arange(1, 6), [])
    before = digests(mc)

    def refuse(*args, **kwargs):
        raise HoleError("injected refusal of the pooling kernel")

    batch = ht.Batch.pack({a: torch.arange(6, 12)})
    with pytest.raises(HoleError, match="injected"):
        with mc.transaction(batch) as step:
            for li in mc.ple.layer_ids:
                step.ple_ngram_ids(li)
                step.ple_conv(li, tables.x[batch.tokens])
            monkeypatch.setattr(mc.qsa, "_pool", refuse)   # the groups stay pending: keys never written
    assert digests(mc) == before


def test_a_commit_that_raises_ends_every_transaction(model, monkeypatch):
    """A publish that fails anyway (a device error in a holder's commit) ended only the failing holder's
    transaction: the QSA cache stayed inside one for good and the PLE state was half published. (PLE's
    ops now update its pool in place, so its commit has no copies left to fail: the failure is
    injected into the commit itself.)"""
    mc = make_cache(model)
    tables = Tables(mc)
    a = mc.new_sequence()
    feed(mc, tables, a, torch.arange(1, 6), [])
    before = digests(mc)

    def failing():
        raise torch.OutOfMemoryError("injected failure while PLE publishes")

    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        with mc.transaction(ht.Batch.pack({a: torch.arange(6, 12)})) as step:
            for li in mc.ple.layer_ids:
                step.ple_ngram_ids(li)
                step.ple_conv(li, tables.x[step.batch.tokens])
            for li in mc.qsa.layer_ids:
                step.qsa_write(li, tables.keys[step.batch.tokens])
            b = mc.new_sequence()
            monkeypatch.setattr(mc.ple, "_txn_commit", failing)
    monkeypatch.undo()
    assert not (mc.in_transaction or mc.ple.in_transaction or mc.qsa.in_transaction)
    assert digests(mc) == before
    with pytest.raises(StaleHandleError):
        mc.free(b)
    # Should the QSA commit raise after PLE's has published, PLE's is undone too (commits stay undoable
    # until every holder has committed).
    monkeypatch.setattr(mc.qsa, "_txn_commit", lambda: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected"):
        with mc.transaction(ht.Batch.pack({a: torch.arange(6, 12)})) as step:
            for li in mc.ple.layer_ids:
                step.ple_ngram_ids(li)
                step.ple_conv(li, tables.x[step.batch.tokens])
            mc.new_sequence()
    monkeypatch.undo()
    assert not (mc.in_transaction or mc.ple.in_transaction or mc.qsa.in_transaction)
    assert digests(mc) == before
    run_chunk(mc, tables, {a: torch.tensor([6, 7])})
    assert mc.new_sequence() == ht.SeqHandle(1, 0)


def test_shift_that_misses_the_run_keeps_snapshot_labels(model):
    mc = make_cache(model)
    tables = Tables(mc)
    a = mc.new_sequence()
    run_chunk(mc, tables, {a: [5, 6, 7, 8]})
    mc.checkpoint(a)                                  # snapshot labelled 4
    run_chunk(mc, tables, {a: [9, 10, 11, 12]})
    mc.shift(a, 100, 200, 4)                          # [100, 200) misses the run [0, 8): nothing moves
    assert mc.qsa.run(a) == (0, 8)
    run_chunk(mc, tables, {a: [13, 14, 15, 16]})
    with pytest.raises(HebrusError, match="snapshots kept at \\[4\\]"):
        mc.rewind(a, 8)
    mc.shift(a, 0, -1, 10)                            # the whole run moves: so does the label
    mc.rewind(a, 14)
    assert mc.qsa.run(a) == (10, 4)
    assert mc.ple.snapshot(a).history[:, -2:].tolist() == [[7, 8]] * len(mc.ple.layer_ids)


def test_qsa_select_without_a_top_k_is_refused(model):
    mc = make_cache(model)
    mc = ht.ModelCache(qsa=mc.qsa, ple=mc.ple)        # no top_k
    a = mc.new_sequence()
    tables = Tables(mc)
    batch = ht.Batch.pack({a: torch.arange(1, 5)})
    with pytest.raises(HebrusError, match="pass top_k"):
        with mc.transaction(batch) as step:
            step.qsa_write(1, tables.keys[batch.tokens])
            step.qsa_select(1, tables.q[batch.tokens])
    assert mc.qsa.run(a) == (0, 0)


def test_stale_handle_in_batch_changes_nothing(model):
    mc = make_cache(model)
    tables = Tables(mc)
    a, b = mc.new_sequence(), mc.new_sequence()
    mc.free(b)
    before = mc.digest()
    with pytest.raises(StaleHandleError):
        run_chunk(mc, tables, {a: torch.tensor([1, 2]), b: torch.tensor([3])})
    assert mc.digest() == before


def test_batch_from_rows_packs_parallel_lists_and_refuses_a_sequence_listed_twice(model):
    """The runner's rows are parallel lists; packing them as a mapping kept one row of a sequence listed
    twice (issue 33). ``Batch.from_rows`` refuses that, naming the sequence and its rows."""
    mc = make_cache(model)
    a, b = mc.new_sequence(), mc.new_sequence()
    batch = ht.Batch.from_rows([a, b], [[5, 6, 7], torch.tensor([8])], [0, 4])
    want = ht.Batch.pack({a: [5, 6, 7], b: [8]}, first_positions={a: 0, b: 4})
    assert batch.seqs == want.seqs and batch.first_positions == want.first_positions == [0, 4]
    assert torch.equal(batch.tokens, want.tokens) and torch.equal(batch.cu_seqlens, want.cu_seqlens)
    assert ht.Batch.from_rows([a], [[1]]).first_positions == [None]
    with pytest.raises(model_cache.DuplicateSequenceError,
                       match=re.escape(f"Batch.from_rows: a sequence appears twice in one batch: {b} (rows 1 and 2)")):
        ht.Batch.from_rows([a, b, b], [[1], [2], [3]], [0, 0, 1])
    with pytest.raises(HebrusError, match="2 sequences, 1 rows"):
        ht.Batch.from_rows([a, b], [[1]])


def test_a_one_row_batch_holds_its_own_tokens(model):
    """A batch's tokens are its own whatever the row was given as: a one-row batch from a list (taken as made from it)
    or from a tensor (copied) is not changed by the caller changing its row afterwards; int64, as for several rows."""
    mc = make_cache(model)
    a = mc.new_sequence()
    row, row32, listed = torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7], dtype=torch.int32), [5, 6, 7]
    batches = ht.Batch.pack({a: row}), ht.Batch.pack({a: row32}), ht.Batch.from_rows([a], [listed])
    row[0], row32[0], listed[0] = 9, 9, 9
    for batch in batches:
        assert batch.tokens.dtype == torch.int64 and batch.tokens.tolist() == [5, 6, 7]
    for bad in ([5.5], [2 ** 70], [True], [5, "6"]):
        with pytest.raises(HebrusError, match="must be integers"):
            ht.Batch.from_rows([a], [bad])


def test_step_attention_reads_only_selected_cells(model):
    mc = make_cache(model, with_kv=True)
    g = torch.Generator().manual_seed(7)
    a, b = mc.new_sequence(), mc.new_sequence()
    hkv, dh = model.config.num_key_value_heads, model.config.head_dim
    tables = Tables(mc)
    kv_table = torch.randn(50, 2, hkv, dh, generator=g)
    q_main = torch.randn(50, model.config.num_attention_heads, dh, generator=g)
    li = mc.qsa.layer_ids[0]
    for rows in ({a: torch.randint(0, 50, (23,), generator=g), b: torch.randint(0, 50, (9,), generator=g)},
                 {a: torch.randint(0, 50, (2,), generator=g)}):
        batch = ht.Batch.pack(rows)
        with mc.transaction(batch) as step:
            step.qsa_write(li, tables.keys[batch.tokens], kv_table[batch.tokens, 0], kv_table[batch.tokens, 1])
            plan = step.qsa_select(li, tables.q[batch.tokens])
            out = step.qsa_attention(li, q_main[batch.tokens], plan)
            # Dense attention over every cell with the plan's mask, as transformers computes it.
            layer = mc.qsa.layer_index(li)
            k, v = mc.qsa.k_cache[layer], mc.qsa.v_cache[layer]
            key_cells = torch.arange(k.shape[0])
            mask = plan.mask(key_cells)
            rep = q_main.shape[1] // hkv
            kk = k.repeat_interleave(rep, dim=1).transpose(0, 1)
            vv = v.repeat_interleave(rep, dim=1).transpose(0, 1)
            dense = torch.nn.functional.scaled_dot_product_attention(
                q_main[batch.tokens].transpose(0, 1)[None], kk[None], vv[None], attn_mask=mask[None, None])
            torch.testing.assert_close(out, dense[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    # Sparsity happened: some query saw fewer cells than its sequence holds.
    assert bool((plan.token_cells >= 0).sum(1).lt(mc.qsa.run(a)[1]).all())


def test_rewind_after_a_restart_uses_no_snapshot_of_the_old_stream(model):
    mc = make_cache(model)
    tables = Tables(mc)
    a = mc.new_sequence()
    run_chunk(mc, tables, {a: [5]})
    mc.checkpoint(a)                                   # labelled 1, in the stream [5]
    mc.remove(a, 0, -1)                                # everything goes, PLE state too
    run_chunk(mc, tables, {a: [7]})
    run_chunk(mc, tables, {a: [8]})
    before = mc.digest()
    with pytest.raises(HebrusError, match="snapshots kept at \\[\\]"):
        mc.rewind(a, 1)                                # position 1 of the new stream [7, 8]: no snapshot
    assert mc.digest() == before
    mc.checkpoint(a)
    run_chunk(mc, tables, {a: [9]})
    mc.rewind(a, 0)                                    # back to nothing, then a restart at position 4
    run_chunk(mc, tables, {a: [11, 12]}, first_positions={a: 4})
    with pytest.raises(HebrusError, match="snapshots kept at \\[\\]"):
        mc.rewind(a, 5)


def test_state_dict_is_a_copy_and_refused_inside_a_transaction(model):
    mc = make_cache(model)
    tables = Tables(mc)
    a = mc.new_sequence()
    feed(mc, tables, a, torch.arange(1, 7), [])
    sd, before = mc.state_dict(), mc.digest()
    run_chunk(mc, tables, {a: torch.tensor([7, 8, 9])})     # the kept state dict does not follow
    mc.load_state_dict(sd)
    assert mc.digest() == before
    with mc.transaction(ht.Batch.pack({a: torch.tensor([4])})) as step:
        for holder in (mc, mc.ple, mc.qsa):
            with pytest.raises(HebrusError, match="inside a transaction"):
                holder.state_dict()
        for li in mc.ple.layer_ids:
            step.ple_ngram_ids(li)


@pytest.mark.parametrize("case", ["rewind None", "remove float", "shift None", "restore seq", "transaction",
                                  "pack None", "pack floats", "layer str", "conv None", "write None",
                                  "select None", "top_k str", "attention plan"])
def test_wrong_argument_types_are_hebrus_errors(model, case):
    mc = make_cache(model, with_kv=True)
    tables = Tables(mc)
    a = mc.new_sequence()
    kv = mc.qsa.kv_heads, mc.qsa.kv_head_dim
    with mc.transaction(ht.Batch.pack({a: [3, 4, 5, 6, 7]})) as st:
        for li in mc.ple.layer_ids:
            st.ple_ngram_ids(li)
        st.qsa_write(1, tables.keys[:5], torch.randn(5, *kv), torch.randn(5, *kv))
    blob = mc.save(a)
    before = mc.digest()

    def step(fn):
        with mc.transaction(ht.Batch.pack({a: [1, 2]})) as st:
            fn(st)

    def write(st):
        st.qsa_write(1, tables.keys[:2], torch.randn(2, *kv), torch.randn(2, *kv))

    calls = {
        "rewind None": lambda: mc.rewind(a, None),
        "remove float": lambda: mc.remove(a, 0, 2.5),
        "shift None": lambda: mc.shift(a, 0, -1, None),
        "restore seq": lambda: mc.restore(blob, 5),
        "transaction": lambda: mc.transaction(5).__enter__(),
        "pack None": lambda: ht.Batch.pack({a: None}),
        "pack floats": lambda: ht.Batch.pack({a: [1.5, 2.0]}),
        "layer str": lambda: step(lambda st: st.ple_ngram_ids("0")),
        "conv None": lambda: step(lambda st: st.ple_conv(0, None)),
        "write None": lambda: step(lambda st: st.qsa_write(1, None)),
        "select None": lambda: step(lambda st: (write(st), st.qsa_select(1, None))),
        "top_k str": lambda: step(lambda st: (write(st), st.qsa_select(1, tables.q[:2], "2"))),
        "attention plan": lambda: step(lambda st: st.qsa_attention(1, torch.randn(2, 4, kv[1]), None)),
    }
    with pytest.raises(HebrusError):
        calls[case]()
    assert mc.digest() == before


def test_restore_takes_either_argument_order(model):
    mc = make_cache(model)
    a = mc.new_sequence()
    feed(mc, Tables(mc), a, torch.arange(1, 9), [])
    blob = mc.save(a)
    b = mc.new_sequence()
    mc.free(b)
    free = ht.SeqHandle(b.slot, b.generation + 1)
    assert mc.restore(free, blob) == free                       # SPEC §4: restore(seq, bytes)
    assert mc.ple.digest(free) == mc.ple.digest(a) and mc.qsa.digest(free) == mc.qsa.digest(a)
    c = mc.restore(blob)                                        # SPEC's example: restore(blob)
    assert mc.qsa.digest(c) == mc.qsa.digest(a)


# ------------------------------------------------------------------------------------------------
# PLE origin (SPEC §4): where a sequence's PLE state was fresh
# ------------------------------------------------------------------------------------------------

def ple_outputs(out):
    return {k: v for k, v in out.items() if k[0] in ("ids", "y")}


def assert_same_outputs(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("how", ["remove a prefix", "window eviction"])
def test_rewind_to_a_moved_p0_keeps_the_ple_state(model, how):
    """After a prefix removal or a window eviction p0 > 0, but the PLE state at p0 is not fresh: a rewind there
    restores the snapshot taken there (or is refused without one); replaying then gives the same outputs."""
    tokens = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(11))
    mc = make_cache(model, window=12) if how == "window eviction" else make_cache(model)
    tables = Tables(mc)
    a = mc.new_sequence()
    feed(mc, tables, a, tokens[:8], [3])
    mc.checkpoint(a)                                   # at 8
    first = run_chunk(mc, tables, {a: tokens[8:16]})
    if how == "remove a prefix":
        mc.remove(a, 0, 8)
    p0 = mc.qsa.run(a)[0]
    assert mc.qsa.run(a) == ((8, 8) if how == "remove a prefix" else (4, 12))
    if p0 != 8:
        before = digests(mc)
        with pytest.raises(HebrusError, match=f"needs a PLE snapshot at {p0}"):
            mc.rewind(a, p0)
        assert digests(mc) == before
    mc.rewind(a, 8)
    again = run_chunk(mc, tables, {a: tokens[8:16]})
    assert_same_outputs(ple_outputs(again), ple_outputs(first))


def test_rewind_to_p0_after_a_prefix_removal_is_refused_without_a_snapshot(model):
    tokens = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(12))
    mc = make_cache(model)
    tables = Tables(mc)
    a = mc.new_sequence()
    feed(mc, tables, a, tokens, [])
    mc.remove(a, 0, 8)
    before = digests(mc)
    with pytest.raises(HebrusError, match="needs a PLE snapshot at 8"):
        mc.rewind(a, 8)                                # not the origin (0): the PLE state at 8 is not fresh
    assert digests(mc) == before and mc.qsa.run(a) == (8, 8)
    mc.rewind(a, 0)                                    # the origin: everything goes, PLE fresh again
    fresh = make_cache(model)
    f = fresh.new_sequence()
    assert mc.ple.digest(a) == fresh.ple.digest(f) and mc.qsa.run(a)[1] == 0


def test_rewind_after_a_window_eviction_replays_the_same_outputs(model):
    tokens = torch.randint(0, 50, (24,), generator=torch.Generator().manual_seed(13))
    mc = make_cache(model, window=12)
    tables = Tables(mc)
    a = mc.new_sequence()
    feed(mc, tables, a, tokens[:12], [5])
    run_chunk(mc, tables, {a: tokens[12:16]})           # evicts [0, 4)
    assert mc.qsa.run(a) == (4, 12)
    before = digests(mc)
    with pytest.raises(HebrusError, match="needs a PLE snapshot at 4"):
        mc.rewind(a, 4)
    assert digests(mc) == before
    mc.checkpoint(a)                                   # at 16
    first = run_chunk(mc, tables, {a: tokens[16:20]})
    mc.rewind(a, 16)
    again = run_chunk(mc, tables, {a: tokens[16:20]})
    assert_same_outputs(ple_outputs(first), ple_outputs(again))


def test_a_checkpoint_of_an_empty_sequence_is_not_a_snapshot_of_a_later_position(model):
    """remove(a, -1, -1); checkpoint(a); a chunk starting at 7; rewind(a, 10): the checkpoint was taken on a fresh
    sequence, not at position 10, so the rewind needs a real snapshot at 10."""
    mc = make_cache(model)
    tables = Tables(mc)
    a = mc.new_sequence()
    run_chunk(mc, tables, {a: [5, 6, 7, 8]}, first_positions={a: 10})
    mc.remove(a, -1, -1)
    mc.checkpoint(a)
    run_chunk(mc, tables, {a: [1, 2, 3, 4, 5, 6]}, first_positions={a: 7})
    assert mc.qsa.run(a) == (7, 6)
    before = digests(mc)
    with pytest.raises(HebrusError, match="needs a PLE snapshot at 10"):
        mc.rewind(a, 10)
    assert digests(mc) == before
    mc.rewind(a, 7)                                    # the origin of this stream
    assert mc.qsa.run(a)[1] == 0


def test_the_ple_origin_is_saved_restored_loaded_and_digested(model):
    tokens = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(14))
    mc = make_cache(model)
    tables = Tables(mc)
    a = mc.new_sequence()
    feed(mc, tables, a, tokens, [])
    mc.remove(a, 0, 8)
    # save / restore: the restored sequence's PLE state is still not fresh at 8
    other = make_cache(model)
    b = other.restore(mc.save(a))
    with pytest.raises(HebrusError, match="needs a PLE snapshot at 8"):
        other.rewind(b, 8)
    # state_dict / load_state_dict
    sd = mc.state_dict()
    loaded = make_cache(model)
    loaded.load_state_dict(sd)
    assert loaded.digest() == mc.digest()
    with pytest.raises(HebrusError, match="needs a PLE snapshot at 8"):
        loaded.rewind(a, 8)
    # digest covers it: the same state with another origin digests differently
    extra = sd["_extra_state"]
    origin = list(extra["origin"])
    assert origin[a.slot] == 0
    origin[a.slot] = 8
    tampered = dict(sd, _extra_state=dict(extra, origin=origin, checksum=mc._table_checksum(
        extra["generation"], extra["live"], origin)))
    moved = make_cache(model)
    moved.load_state_dict(tampered)
    assert moved.digest() != mc.digest()
    moved.rewind(a, 8)                                 # there, 8 is the origin: the rewind clears
    assert moved.qsa.run(a)[1] == 0
    # a tampered origin without a recomputed checksum is refused
    with pytest.raises(CorruptStateError, match="checksum"):
        make_cache(model).load_state_dict(dict(sd, _extra_state=dict(extra, origin=origin)))


def test_rewind_into_a_removed_prefix_restores_the_snapshot_and_continues_there(model):
    tokens = torch.randint(0, 50, (12,), generator=torch.Generator().manual_seed(15))
    mc = make_cache(model)
    tables = Tables(mc)
    a = mc.new_sequence()
    feed(mc, tables, a, tokens[:4], [])
    mc.checkpoint(a)                                   # at 4
    first = run_chunk(mc, tables, {a: tokens[4:12]})
    mc.remove(a, 0, 8)
    assert mc.qsa.run(a) == (8, 4)
    mc.rewind(a, 4)                                    # before the run: everything goes, PLE back at 4
    assert mc.qsa.run(a) == (4, 0)
    again = run_chunk(mc, tables, {a: tokens[4:12]})  # lands at 4 again
    assert again[("plan", 1)].positions.tolist() == list(range(4, 12))
    assert_same_outputs(ple_outputs(again), ple_outputs(first))


def test_an_origin_of_none_for_a_sequence_with_tokens_is_corrupt(model):
    """Issue 27: a blob or state dict saying a sequence that has tokens is fresh (origin None) was accepted, and
    a later rewind to a position without a snapshot then cleared its PLE state as if it were fresh there."""
    from hebrus_torch.model_cache import _KIND
    from hebrus_torch.state import blob

    tokens = torch.randint(0, 50, (12,), generator=torch.Generator().manual_seed(16))
    mc = make_cache(model)
    a = mc.new_sequence()
    feed(mc, Tables(mc), a, tokens, [])
    meta, parts = blob.unpack(mc.save(a), _KIND)
    assert meta["origin"] == 0
    other = make_cache(model)
    before = other.digest()
    with pytest.raises(CorruptStateError, match="origin None.*QSA run holds 12 tokens"):
        other.restore(blob.pack(_KIND, dict(meta, origin=None), parts))
    assert other.digest() == before
    sd = mc.state_dict()
    extra = sd["_extra_state"]
    origin = list(extra["origin"])
    origin[a.slot] = None
    tampered = dict(sd, _extra_state=dict(extra, origin=origin, checksum=mc._table_checksum(
        extra["generation"], extra["live"], origin)))
    with pytest.raises(CorruptStateError, match=f"slot {a.slot} has PLE origin None"):
        other.load_state_dict(tampered)
    assert other.digest() == before
    fresh = make_cache(model)                          # a live sequence with no token yet: None is right
    b = fresh.new_sequence()
    make_cache(model).restore(fresh.save(b))
    make_cache(model).load_state_dict(fresh.state_dict())
