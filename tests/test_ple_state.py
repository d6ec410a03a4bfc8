"""PLEState: chunk invariance, isolation, EOS, transactions, lifecycle, saved state (SPEC §4, §5)."""

import hashlib
import json
import random
import struct

import pytest
import torch

import hebrus_torch as ht
from hebrus_torch.errors import CorruptStateError, HebrusError, StaleHandleError
from hebrus_torch.state import blob as blob_mod
from hebrus_torch.state.handles import MAX_GENERATION

VOCAB, EOS, CHANNELS, LAYERS = 40, 2, 24, 2


def make_state(device="cpu", dtype=torch.float32, max_sequences=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [ht.PLEHashParams(torch.randint(1, 1 << 40, (3,), generator=g) * 2 + 1,
                               torch.tensor([101, 103, 107, 109, 113, 127, 131, 137])[: 2 * 2 + 2 * 2],
                               torch.arange(8) * 200)
              for _ in range(LAYERS)]
    weights = [torch.randn(CHANNELS, 4, generator=g).to(dtype) for _ in range(LAYERS)]
    return ht.PLEState(LAYERS, CHANNELS, vocab_size=VOCAB, eos_token_id=EOS, ngram_size=3, conv_kernel_size=4,
                       max_sequences=max_sequences, dtype=dtype, device=device,
                       hash_params=params, conv_weights=[w.to(device) for w in weights])


def stream(n, seed, eos_every=7):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, VOCAB, (n,), generator=g)
    toks[::eos_every] = EOS
    return toks


def run_chunk(state, seqs, token_rows, x_rows, device):
    """One packed chunk through every layer; returns per-layer (ids, y) split per row."""
    cu = torch.tensor([0] + list(torch.tensor([len(t) for t in token_rows]).cumsum(0)), dtype=torch.int32,
                      device=device)
    tokens = torch.cat(token_rows).to(device)
    x = torch.cat(x_rows).to(device)
    outs = []
    with ht.transaction(state):
        for layer in range(state.num_layers):
            ids = state.ngram_ids(layer, seqs, tokens, cu)
            y = state.conv(layer, seqs, x * (layer + 1), cu)
            outs.append((ids, y))
    return outs


def feed(state, seq, tokens, x, cuts, device):
    """Feed one sequence in chunks ending at ``cuts``; returns concatenated ids and y per layer."""
    ids = [[] for _ in range(state.num_layers)]
    ys = [[] for _ in range(state.num_layers)]
    start = 0
    for stop in list(cuts) + [len(tokens)]:
        if stop <= start:
            continue
        for layer, (i, y) in enumerate(run_chunk(state, [seq], [tokens[start:stop]], [x[start:stop]], device)):
            ids[layer].append(i)
            ys[layer].append(y)
        start = stop
    return [torch.cat(i) for i in ids], [torch.cat(y) for y in ys]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_chunk_invariance_bitwise(device, dtype):
    n = 23
    tokens = stream(n, 1)
    x = torch.randn(n, CHANNELS, generator=torch.Generator().manual_seed(2)).to(dtype)
    rng = random.Random(3)
    plans = {"one_shot": [], "1/2/1": [], "random": sorted(rng.sample(range(1, n), 6))}
    pattern, pos = [1, 2, 1], 0
    while pos < n:
        pos += pattern[len(plans["1/2/1"]) % 3]
        plans["1/2/1"].append(min(pos, n))
    results = {}
    for name, cuts in plans.items():
        state = make_state(device, dtype)
        seq = state.new_sequence()
        ids, ys = feed(state, seq, tokens, x, cuts, device)
        results[name] = (ids, ys, state.digest(), state.snapshot(seq))
    base = results["one_shot"]
    for name, (ids, ys, digest, snap) in results.items():
        for layer in range(LAYERS):
            assert torch.equal(ids[layer], base[0][layer]), name
            assert torch.equal(ys[layer], base[1][layer]), name
        assert torch.equal(snap.history, base[3].history) and torch.equal(snap.conv_tails, base[3].conv_tails), name
        assert digest == base[2], name


def split_packed(t, cu):
    cu = cu.tolist()
    return [t[cu[i]:cu[i + 1]] for i in range(len(cu) - 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_random_prefill_matches_the_ops_on_each_whole_sequence(device, dtype):
    """The holder's row ids, conv outputs, history and tails against the functional ops run once on each
    whole sequence from SPEC §4's fresh state (history [E]*(N-1), zero tails): several sequences prefill
    in random packed chunks (random subsets in random row order, 0-token rows included), so a carried
    history or tail that is dropped, reset, misordered or read from another slot, a wrong activation or
    a flipped kernel changes some token's bits."""
    lengths = [29, 11, 1, 20]
    tokens = [stream(n, 30 + i, eos_every=5 + i) for i, n in enumerate(lengths)]
    gen = torch.Generator().manual_seed(31)
    xs = [(torch.randn(n, CHANNELS, generator=gen) * 2).to(dtype) for n in lengths]
    state = make_state(device, dtype, max_sequences=6)
    state.new_sequence()                                  # slot 0 stays live and untouched
    seqs = [state.new_sequence() for _ in lengths]
    got_ids = [[[] for _ in lengths] for _ in range(LAYERS)]
    got_y = [[[] for _ in lengths] for _ in range(LAYERS)]
    rng, pos, chunks = random.Random(32), [0] * len(lengths), 0
    while any(p < n for p, n in zip(pos, lengths)):
        rows = [i for i in range(len(lengths)) if pos[i] < lengths[i] or rng.random() < 0.2]
        rng.shuffle(rows)
        rows = rows[:rng.randint(1, len(rows))]
        take = [min(rng.choice([0, 1, 1, 2, 3, 4, 7, 10]), lengths[i] - pos[i]) for i in rows]
        outs = run_chunk(state, [seqs[i] for i in rows], [tokens[i][pos[i]:pos[i] + m] for i, m in zip(rows, take)],
                         [xs[i][pos[i]:pos[i] + m] for i, m in zip(rows, take)], device)
        cu = torch.tensor([0] + take).cumsum(0)
        for layer, (ids, y) in enumerate(outs):
            for i, part_ids, part_y in zip(rows, split_packed(ids, cu), split_packed(y, cu)):
                got_ids[layer][i].append(part_ids)
                got_y[layer][i].append(part_y)
        pos = [p + m for p, m in zip(pos, [dict(zip(rows, take)).get(i, 0) for i in range(len(lengths))])]
        chunks += 1
    assert chunks >= 8                                    # many boundaries, not one shot
    for i, n in enumerate(lengths):
        snap = state.snapshot(seqs[i])
        cu = torch.tensor([0, n], dtype=torch.int32, device=device)
        for layer in range(LAYERS):
            p = state.hash_params(layer)
            want_ids, want_history = ht.ple_ngram_ids(tokens[i].to(device), cu,
                                                      torch.full((1, 2), EOS, device=device), p.multipliers,
                                                      p.vocab_sizes, p.offsets, EOS, VOCAB)
            want_y, want_tails = ht.ple_conv(xs[i].to(device) * (layer + 1), state._conv_weights[layer], cu,
                                             torch.zeros(1, 9, CHANNELS, dtype=dtype, device=device), 3, "silu")
            assert torch.equal(torch.cat(got_ids[layer][i]), want_ids), (i, layer)
            assert torch.equal(torch.cat(got_y[layer][i]), want_y), (i, layer)
            assert torch.equal(snap.history[layer], want_history[0]), (i, layer)
            assert torch.equal(snap.conv_tails[layer], want_tails[0]), (i, layer)
            # The state SPEC §2 defines: the last N-1 raw tokens and the last L conv inputs (zeros before the first).
            assert snap.history[layer].tolist() == ([EOS, EOS] + tokens[i].tolist())[-2:]
            padded = torch.cat([torch.zeros(9, CHANNELS, dtype=dtype), xs[i] * (layer + 1)])
            assert torch.equal(snap.conv_tails[layer].cpu(), padded[-9:])
    fresh = make_state(device, dtype)
    assert state.digest(ht.SeqHandle(0, 0)) == fresh.digest(fresh.new_sequence())


def test_digest_covers_free_slots_generations(device):
    """Two holders whose next handles differ (slot 0 free at generation 0 or 1) must not digest alike."""
    fresh, used = make_state(device), make_state(device)
    used.free(used.new_sequence())
    assert fresh.digest() != used.digest()
    assert fresh.new_sequence() != used.new_sequence()
    copy = make_state(device)
    copy.load_state_dict(used.state_dict())
    assert copy.digest() == used.digest()


def test_isolation_and_untouched_slots(device):
    state = make_state(device)
    a, b, c = state.new_sequence(), state.new_sequence(), state.new_sequence()
    feed(state, c, stream(5, 9), torch.randn(5, CHANNELS), [], device)
    c_digest = state.digest(c)
    ta, tb = stream(11, 4), stream(6, 5)
    xa, xb = torch.randn(11, CHANNELS), torch.randn(6, CHANNELS)
    packed = run_chunk(state, [a, b], [ta, tb], [xa, xb], device)
    solo = make_state(device)
    sa = solo.new_sequence()
    alone = run_chunk(solo, [sa], [ta], [xa], device)
    for layer in range(LAYERS):
        assert torch.equal(packed[layer][0][:11], alone[layer][0])
        assert torch.equal(packed[layer][1][:11], alone[layer][1])
    assert state.digest(a) == solo.digest(sa)
    assert state.digest(c) == c_digest


def test_eos_resets_history_not_conv_tail(device):
    state = make_state(device)
    tail = torch.tensor([7, 8, 9, 10, 11])
    prefix = torch.tensor([5, 6, 12, EOS])
    a = state.new_sequence()
    x = torch.randn(11, CHANNELS, generator=torch.Generator().manual_seed(8))
    ids_a, _ = feed(state, a, torch.cat([prefix, tail, torch.tensor([13, 14])]), x, [2, 6], device)
    fresh = make_state(device)
    b = fresh.new_sequence()
    ids_b, _ = feed(fresh, b, torch.cat([tail, torch.tensor([13, 14])]), torch.randn(7, CHANNELS), [], device)
    for layer in range(LAYERS):
        assert torch.equal(ids_a[layer][4:], ids_b[layer])
    # The conv tail carries across EOS: it is exactly the last L = 9 conv inputs of the sequence, oldest
    # first (layer l's input is x * (l + 1) in run_chunk): x[2:11], whose first two are the inputs of the
    # token before the EOS and of the EOS itself (fed in the middle chunk, which runs on past the EOS).
    snap = state.snapshot(a)
    for layer in range(LAYERS):
        assert torch.equal(snap.conv_tails[layer].cpu(), x[-9:] * (layer + 1)), layer
        assert snap.history[layer].tolist() == [13, 14]          # the last N-1 raw tokens


def test_failure_after_some_layers_rolls_back_every_layer(device):
    state = make_state(device)
    a, b = state.new_sequence(), state.new_sequence()
    feed(state, a, stream(6, 1), torch.randn(6, CHANNELS), [], device)
    before = state.digest()
    cu = torch.tensor([0, 3, 5], dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="injected"):
        with ht.transaction(state):
            state.ngram_ids(0, [a, b], stream(5, 2).to(device), cu)
            state.conv(0, [a, b], torch.randn(5, CHANNELS, device=device), cu)
            state.conv(1, [a, b], torch.randn(5, CHANNELS, device=device), cu)
            state.free(b)
            raise RuntimeError("injected failure after two layers")
    assert state.digest() == before
    state.snapshot(b)  # still live


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rollback_restores_every_tail_bit_nan_payloads_included(dtype):
    """The conv undo rebuilt old tails with gather, which turned the NaN payloads of 16-bit tails into
    0xFFFF: a rollback changed their bytes (and the digest)."""
    state = make_state(dtype=dtype)
    a, b = state.new_sequence(), state.new_sequence()
    bits = state.conv_state.view(torch.int16 if dtype != torch.float32 else torch.int32)
    g = torch.Generator().manual_seed(4)
    top = 1 << (8 * bits.element_size() - 1)
    bits.copy_(torch.randint(-top, top, bits.shape, generator=g).to(bits.dtype))  # random bits: NaNs among them
    flat = bits.view(-1)
    flat[::5] = (0x7F800001 if dtype == torch.float32 else 0x7F81) + torch.arange(flat[::5].numel()) % 100
    before, raw = state.digest(), state.conv_state.clone()
    with pytest.raises(RuntimeError, match="injected"):
        with ht.transaction(state):
            for lengths in ([1, 1], [2, 0], [1, 12]):     # drops 1, 2 and all of a tail's L = 9 entries
                cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
                for layer in range(LAYERS):
                    state.conv(layer, [a, b], torch.randn(sum(lengths), CHANNELS).to(dtype), cu)
            raise RuntimeError("injected")
    assert state.digest() == before
    assert torch.equal(state.conv_state.view(bits.dtype), raw.view(bits.dtype))


class _CommitFails(ht.state.Transactional):
    """A holder whose commit raises (a device error where none is expected), committed after PLEState."""

    def _txn_begin(self):
        pass

    def _txn_commit(self):
        raise RuntimeError("injected failure in a later holder's commit")

    def _txn_rollback(self):
        pass


def test_commit_failure_in_a_later_holder_undoes_the_published_chunk(device):
    state = make_state(device)
    a, b = state.new_sequence(), state.new_sequence()
    feed(state, a, stream(6, 1), torch.randn(6, CHANNELS), [], device)
    before = state.digest()
    cu = torch.tensor([0, 3, 5], dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="injected"):
        with ht.transaction(state, _CommitFails()):
            for layer in range(LAYERS):
                state.ngram_ids(layer, [a, b], stream(5, 2).to(device), cu)
                state.conv(layer, [a, b], torch.randn(5, CHANNELS, device=device), cu)
            state.free(state.new_sequence())
    assert state.digest() == before and not state.in_transaction
    feed(state, a, stream(3, 4), torch.randn(3, CHANNELS), [], device)


def test_lifecycle_copy_fork_reset_free(device):
    state = make_state(device)
    a = state.new_sequence()
    feed(state, a, stream(9, 3), torch.randn(9, CHANNELS), [4], device)
    f = state.fork(a)
    assert state.digest(f) == state.digest(a)
    b = state.new_sequence()
    state.copy(a, b)
    assert state.digest(b) == state.digest(a)
    r = state.reset(a)
    assert r.slot == a.slot and r.generation == a.generation + 1
    with pytest.raises(StaleHandleError, match="stale"):
        state.snapshot(a)
    fresh = make_state(device)
    assert state.digest(r) == fresh.digest(fresh.new_sequence())
    state.free(b)
    with pytest.raises(StaleHandleError, match="is stale"):
        state.free(b)
    with pytest.raises(ht.CapacityError):
        for _ in range(5):
            state.new_sequence()


def test_snapshot_restore_for_rewind(device):
    state = make_state(device)
    a = state.new_sequence()
    tokens, x = stream(12, 6), torch.randn(12, CHANNELS)
    feed(state, a, tokens[:7], x[:7], [], device)
    snap = state.snapshot(a, position=7)
    ids1, y1 = feed(state, a, tokens[7:], x[7:], [], device)
    state.restore(a, snap)
    ids2, y2 = feed(state, a, tokens[7:], x[7:], [2], device)
    for layer in range(LAYERS):
        assert torch.equal(ids1[layer], ids2[layer]) and torch.equal(y1[layer], y2[layer])


def test_save_restore_and_corrupt_blobs(device):
    state = make_state(device)
    a, b = state.new_sequence(), state.new_sequence()
    feed(state, a, stream(8, 2), torch.randn(8, CHANNELS), [], device)
    data = state.save(a)
    state.restore(b, data)
    assert state.digest(b) == state.digest(a)
    before = state.digest()
    tampered = bytearray(data)
    tampered[len(tampered) // 2] ^= 0x10
    for bad, pattern in [(data[:-5], "checksum|truncated"), (data[:10], "truncated"), (bytes(tampered), "checksum"),
                         (b"not a blob at all, really not" * 3, "magic")]:
        with pytest.raises(CorruptStateError, match=pattern):
            state.restore(b, bad)
        assert state.digest() == before
    other = ht.PLEState(1, 8, vocab_size=VOCAB, eos_token_id=EOS)
    with pytest.raises(CorruptStateError, match="config"):
        other.restore(other.new_sequence(), data)


_PREFIX = struct.Struct("<8sIQ")


def split_blob(data):
    """(header dict, tensor payload) of a saved blob."""
    _, _, header_len = _PREFIX.unpack_from(data)
    return json.loads(data[_PREFIX.size:_PREFIX.size + header_len]), data[_PREFIX.size + header_len:-32]


def forge(header, payload=b"", version=blob_mod.FORMAT_VERSION):
    """A blob with a valid sha256 around any header: the checksum is no signature, anyone can recompute it."""
    header = header if isinstance(header, bytes) else json.dumps(header).encode()
    body = _PREFIX.pack(blob_mod.MAGIC, version, len(header)) + header + payload
    return body + hashlib.sha256(body).digest()


def test_blob_restores_into_a_holder_of_another_slot_count(device):
    """A sequence's state does not depend on the number of slots; QSACache's blob leaves it out too."""
    small, large = make_state(device, max_sequences=2), make_state(device, max_sequences=8)
    a = small.new_sequence()
    feed(small, a, stream(7, 3), torch.randn(7, CHANNELS), [], device)
    data = small.save(a)
    b = large.new_sequence()
    large.restore(b, data)
    assert large.digest(b) == small.digest(a)
    header, payload = split_blob(data)
    assert "max_sequences" not in header["meta"]
    header["meta"]["max_sequences"] = 2            # as earlier builds saved it: still restorable anywhere
    c = large.new_sequence()
    large.restore(c, forge(header, payload))
    assert large.digest(c) == small.digest(a)
    header["meta"]["max_sequences"] = "2"
    with pytest.raises(CorruptStateError, match="config"):
        large.restore(c, forge(header, payload))


def test_restore_refuses_hostile_headers_with_a_valid_checksum(device):
    """Untrusted blobs: whatever the JSON header holds, a CorruptStateError naming it, and nothing changes."""
    state = make_state(device)
    a, b = state.new_sequence(), state.new_sequence()
    feed(state, a, stream(8, 2), torch.randn(8, CHANNELS), [], device)
    header, payload = split_blob(state.save(a))
    assert state.restore(b, forge(header, payload)) is None          # the forger's own checksum is fine

    def edited(edit):
        h = json.loads(json.dumps(header))
        edit(h)
        return forge(h, payload)

    deep = dict(header, x=json.loads("[" * 40 + "]" * 40))
    bad = {
        "nesting past the recursion limit": (forge(b"[" * 100_000 + b"]" * 100_000), "not valid JSON"),
        "nesting under the recursion limit": (forge(deep, payload), "nests deeper"),
        "an integer of 5000 digits": (forge(b'{"kind": "hebrus_torch.PLEState", "x": ' + b"9" * 5000 + b"}"),
                                      "not valid JSON"),
        "a dtype that is a list": (edited(lambda h: h["tensors"][0].update(dtype=["int64"])), "dtype"),
        "a tensor entry that is a string": (edited(lambda h: h["tensors"].__setitem__(0, "history")), "malformed"),
        "a shape of bools": (edited(lambda h: h["tensors"][0].update(shape=[True, True])), "shape"),
        "an empty shape spanning 2**124 elements": (
            edited(lambda h: h["tensors"][0].update(shape=[0, 2**62, 2**62], nbytes=0)), "shape"),
        "an offset that is a bool": (edited(lambda h: h["tensors"][0].update(offset=False)), "bytes at"),
        "a kind that is a list": (edited(lambda h: h.update(kind=[h["kind"]])), "expected"),
    }
    before = state.digest()
    for name, (data, pattern) in bad.items():
        with pytest.raises(CorruptStateError, match=pattern):
            state.restore(b, data)
        assert state.digest() == before, name
    # JSON true is not the integer 1 of the config: a one-layer holder refuses its own blob with layers = true.
    one = ht.PLEState(1, 8, vocab_size=VOCAB, eos_token_id=EOS)
    s = one.new_sequence()
    header, payload = split_blob(one.save(s))
    assert header["meta"]["layers"] == 1
    header["meta"]["layers"] = True
    with pytest.raises(CorruptStateError, match="config"):
        one.restore(s, forge(header, payload))


def test_restore_refuses_history_ids_out_of_range_and_other_format_versions(device):
    """Checks behind the checksum: a forged blob (valid sha256) with history ids outside [0, vocab) or of
    another format version raises CorruptStateError naming that, and nothing changes."""
    state = make_state(device)
    a, b = state.new_sequence(), state.new_sequence()
    feed(state, a, stream(8, 2), torch.randn(8, CHANNELS), [], device)
    feed(state, b, stream(5, 7), torch.randn(5, CHANNELS), [], device)
    header, payload = split_blob(state.save(a))
    entry = next(e for e in header["tensors"] if e["name"] == "history")
    assert entry["dtype"] == "int64" and entry["shape"] == [LAYERS, 2]

    def with_history(values):
        raw = bytearray(payload)
        raw[entry["offset"]:entry["offset"] + entry["nbytes"]] = struct.pack(f"<{len(values)}q", *values)
        return forge(header, bytes(raw))

    before, b_before = state.digest(), state.digest(b)
    for values in ([VOCAB, 3, 4, 5], [3, 4, 5, -1], [3, 2**62, 4, 5]):
        with pytest.raises(CorruptStateError, match=r"history ids .* outside \[0, 40\)"):
            state.restore(b, with_history(values))
        assert state.digest() == before
    for version in (blob_mod.FORMAT_VERSION + 1, 0):
        with pytest.raises(CorruptStateError, match=f"format version {version}; this build reads "
                                                    f"{blob_mod.FORMAT_VERSION}"):
            state.restore(b, forge(header, payload, version=version))
        assert state.digest() == before
    # A snapshot with an id out of range is refused the same way (a HebrusError: it is no saved state).
    snap = state.snapshot(a)
    bad = ht.PLESnapshot(snap.handle, None, snap.history.clone().fill_(VOCAB), snap.conv_tails)
    with pytest.raises(HebrusError, match=r"history ids .* outside \[0, 40\)"):
        state.restore(b, bad)
    assert state.digest() == before and state.digest(b) == b_before
    # The bounds themselves are valid ids: EOS and vocab - 1 restore, bitwise.
    state.restore(b, with_history([EOS, VOCAB - 1, 0, VOCAB - 1]))
    assert state.snapshot(b).history.tolist() == [[EOS, VOCAB - 1], [0, VOCAB - 1]]


def test_restore_into_a_stale_handle_changes_nothing(device):
    state = make_state(device)
    a, b = state.new_sequence(), state.new_sequence()
    feed(state, a, stream(8, 2), torch.randn(8, CHANNELS), [], device)
    data, snap = state.save(a), state.snapshot(a)
    state.free(b)
    freed = state.digest()
    for source in (data, snap):
        with pytest.raises(StaleHandleError, match="stale"):
            state.restore(b, source)               # b's slot is free
        assert state.digest() == freed
    b2 = state.new_sequence()                      # b's slot again, one generation on
    assert b2.slot == b.slot and b2.generation == b.generation + 1
    feed(state, b2, stream(3, 5), torch.randn(3, CHANNELS), [], device)
    before, b2_before = state.digest(), state.digest(b2)
    for source in (data, snap):
        with pytest.raises(StaleHandleError, match="stale"):
            state.restore(b, source)               # the slot's new owner keeps its state
        assert state.digest() == before and state.digest(b2) == b2_before
    with pytest.raises(StaleHandleError, match="outside"):
        state.restore(ht.SeqHandle(7, 0), data)
    assert state.digest() == before


def test_state_dict_metadata_is_compared_with_exact_types(device):
    state = make_state(device)
    state.new_sequence()
    sd = state.state_dict()
    target = make_state(device)
    before = target.digest()
    extra = sd["_extra_state"]
    for bad in (dict(extra, version=True), dict(extra, config=dict(extra["config"], ngram_size=3.0)),
                dict(extra, config=json.loads("[" * 500 + "]" * 500))):
        with pytest.raises(CorruptStateError, match="version|config"):
            target.load_state_dict(dict(sd, _extra_state=bad))
        assert target.digest() == before
    target.load_state_dict(sd)


def test_state_dict_roundtrip_and_validation(device):
    state = make_state(device)
    a = state.new_sequence()
    feed(state, a, stream(8, 2), torch.randn(8, CHANNELS), [], device)
    sd = state.state_dict()
    copy = make_state(device)
    copy.load_state_dict(sd)
    assert copy.digest() == state.digest()
    assert copy.snapshot(a) is not None  # the handle is valid in the copy
    before = copy.digest()
    bad = dict(sd)
    bad["conv_state"] = sd["conv_state"].clone()
    bad["conv_state"][0, 0, 0, 0] += 1
    with pytest.raises(CorruptStateError, match="checksum"):
        copy.load_state_dict(bad)
    bad = dict(sd)
    bad["history"] = sd["history"][:, :2]
    with pytest.raises(CorruptStateError, match="history"):
        copy.load_state_dict(bad)
    bad = {k: v for k, v in sd.items() if k != "_extra_state"}
    with pytest.raises(CorruptStateError, match="metadata"):
        copy.load_state_dict(bad)
    assert copy.digest() == before


def test_handle_fields_must_be_integers(device):
    """SeqHandle(0, 1.5) was adopted, then stale after a state_dict round trip; str/None gave a bare TypeError."""
    state = make_state(device)
    before = state.digest()
    for slot, generation in ((0, 1.5), (0, "0"), (1.0, 0), (0, None), (True, 0), (0, False), (0, torch.tensor(0.0))):
        with pytest.raises(HebrusError, match=r"SeqHandle\.(slot|generation) must be an integer"):
            state.new_sequence(ht.SeqHandle(slot, generation))
    assert state.digest() == before
    h = state.new_sequence(ht.SeqHandle(torch.tensor(1), torch.tensor(2)))     # integer tensors become ints
    assert h == ht.SeqHandle(1, 2) and type(h.slot) is int and type(h.generation) is int
    copy = make_state(device)
    copy.load_state_dict(state.state_dict())
    copy.free(h)


def resum(sd):
    """A PLEState state dict with its checksum recomputed (a consistent tamper: the sha256 is no signature)."""
    names = ht.PLEState._STATE_NAMES
    return dict(sd, _extra_state=dict(sd["_extra_state"], checksum=blob_mod.digest_of([(n, sd[n]) for n in names])))


def test_generations_are_bounded_so_no_bump_overflows(device):
    """2**63 - 1 fits the int64 buffers but its bump does not: generations stop at 2**62 - 1, where a slot retires."""
    state = make_state(device)
    before = state.digest()
    for g in (2**63 - 1, MAX_GENERATION):
        with pytest.raises(HebrusError, match=r"2\*\*62 - 1"):
            state.new_sequence(ht.SeqHandle(0, g))
        assert state.digest() == before
    last = state.new_sequence(ht.SeqHandle(0, MAX_GENERATION - 1))
    with pytest.raises(HebrusError, match=r"2\*\*62 - 1"):
        state.reset(last)
    state.free(last)                                     # slot 0 is retired at the largest generation
    assert state.new_sequence() == ht.SeqHandle(1, 0)
    sd = state.state_dict()
    copy = make_state(device)
    copy.load_state_dict(sd)
    assert copy.digest() == state.digest() and copy.new_sequence() == ht.SeqHandle(2, 0)
    target = make_state(device)
    before = target.digest()
    for slot, g in ((0, 2**63 - 1), (0, MAX_GENERATION + 1), (1, MAX_GENERATION)):   # slot 1 is live
        gen = sd["generation"].clone()
        gen[slot] = g
        with pytest.raises(CorruptStateError, match=r"2\*\*62 - 1"):
            target.load_state_dict(resum(dict(sd, generation=gen)))
        assert target.digest() == before


class _Runtime(torch.nn.Module):
    def __init__(self, state):
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)
        self.ple = state


def test_state_dict_through_a_parent_module(device):
    state = make_state(device)
    a = state.new_sequence()
    feed(state, a, stream(8, 2), torch.randn(8, CHANNELS), [], device)
    sd = _Runtime(state).state_dict()
    target = _Runtime(make_state(device))
    target.load_state_dict(sd)
    assert target.ple.digest() == state.digest() and target.ple.snapshot(a) is not None
    before = target.ple.digest()
    for key, tamper in (("ple.history", lambda t: t.clone().fill_(VOCAB + 5)), ("ple.live", lambda t: ~t),
                        ("ple.conv_state", lambda t: t + 1)):
        with pytest.raises(CorruptStateError, match="checksum mismatch"):
            target.load_state_dict(dict(sd, **{key: tamper(sd[key])}))
        assert target.ple.digest() == before
        assert target.ple.slots.live.tolist() == target.ple.live.tolist()
    # A consistent tamper (checksum recomputed) gets past the checksum to the checks behind it.
    ple_sd = {k[len("ple."):]: v for k, v in sd.items() if k.startswith("ple.")}
    for tampered, pattern in ((dict(ple_sd, history=ple_sd["history"].clone().fill_(VOCAB + 5)),
                               r"history ids outside \[0, 40\)"),
                              (dict(ple_sd, history=ple_sd["history"].clone().fill_(-1)), r"history ids outside"),
                              (dict(ple_sd, generation=ple_sd["generation"] - 1), "slot table is invalid")):
        with pytest.raises(CorruptStateError, match=pattern):
            target.load_state_dict(dict(sd, **{"ple." + k: v for k, v in resum(tampered).items()}))
        assert target.ple.digest() == before


def test_unexpected_keys_are_refused_with_strict(device):
    state = make_state(device)
    a = state.new_sequence()
    feed(state, a, stream(8, 2), torch.randn(8, CHANNELS), [], device)
    sd = state.state_dict()
    target = make_state(device)
    before = target.digest()
    with pytest.raises(CorruptStateError, match=r"unexpected key\(s\) \['bogus'\]"):
        target.load_state_dict(dict(sd, bogus=torch.zeros(3)))
    assert target.digest() == before
    parent_sd = _Runtime(state).state_dict()
    parent = _Runtime(target)
    with pytest.raises(CorruptStateError, match="conv_statee"):    # torch passes strict=True to every child
        parent.load_state_dict(dict(parent_sd, **{"ple.conv_statee": torch.zeros(3)}), strict=False)
    assert target.digest() == before
    result = target.load_state_dict(dict(sd, bogus=torch.zeros(3)), strict=False)
    assert result.unexpected_keys == ["bogus"] and result.missing_keys == []
    assert target.digest() == state.digest()
    with pytest.raises(CorruptStateError, match="lacks tensor 'live'"):     # nothing may be missing, strict or not
        target.load_state_dict({k: v for k, v in sd.items() if k != "live"}, strict=False)


def test_keep_frees_every_other_sequence(device):
    state = make_state(device)
    a, b, c = state.new_sequence(), state.new_sequence(), state.new_sequence()
    feed(state, b, stream(6, 3), torch.randn(6, CHANNELS), [], device)
    kept = state.digest(b)
    state.keep(b)
    assert state.slots.live_handles() == [b] and state.digest(b) == kept
    for gone in (a, c):
        with pytest.raises(StaleHandleError, match="is stale"):
            state.snapshot(gone)
    before = state.digest()
    with pytest.raises(StaleHandleError, match="is stale"):
        state.keep(a)
    assert state.digest() == before


def test_conv_weight_of_the_wrong_shape_is_refused(device):
    state = make_state(device)
    a = state.new_sequence()
    before = state.digest()
    cu = torch.tensor([0, 3], dtype=torch.int32, device=device)
    for shape in ((CHANNELS, 2, 4), (CHANNELS,), (CHANNELS - 1, 4), (CHANNELS, 3)):
        with pytest.raises(HebrusError, match="weight must be"):
            state.conv(0, [a], torch.randn(3, CHANNELS, device=device), cu, torch.randn(shape, device=device))
    assert state.digest() == before
    state.conv(0, [a], torch.randn(3, CHANNELS, device=device), cu, torch.randn(CHANNELS, 1, 4, device=device))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_conv_input_of_another_dtype_is_refused(device, dtype):
    """fp32 x on a bf16 holder ran in fp32 and rounded the tail at each chunk boundary: chunking changed y.
    x narrower than the state (bf16 x, fp32 state) is held exactly and stays chunk-invariant."""
    state = make_state(device, dtype)
    a = state.new_sequence()
    before = state.digest()
    cu = torch.tensor([0, 3], dtype=torch.int32, device=device)
    wider = {torch.float32: None, torch.float16: torch.float32, torch.bfloat16: torch.float32}[dtype]
    refused = [t for t in (wider, torch.float16 if dtype == torch.bfloat16 else None,
                           torch.bfloat16 if dtype == torch.float16 else None) if t is not None]
    for other in refused:
        with pytest.raises(HebrusError, match=f"x is {other} but the conv state is {dtype}"):
            state.conv(0, [a], torch.randn(3, CHANNELS, device=device, dtype=other), cu)
    with pytest.raises(HebrusError, match="x must be a Tensor"):
        state.conv(0, [a], [[0.0] * CHANNELS] * 3, cu)
    assert state.digest() == before
    state.conv(0, [a], torch.randn(3, CHANNELS, device=device, dtype=dtype), cu)


@pytest.mark.parametrize("narrow", [torch.float16, torch.bfloat16])
def test_conv_input_narrower_than_the_state_is_chunk_invariant(device, narrow):
    x = torch.randn(9, CHANNELS, generator=torch.Generator().manual_seed(4)).to(narrow).to(device)
    outs = []
    for cuts in ([9], [2, 3, 4], [1] * 9):
        state = make_state(device, torch.float32)
        a = state.new_sequence()
        ys, start = [], 0
        for n in cuts:
            with ht.transaction(state):
                ys.append(state.conv(0, [a], x[start:start + n], torch.tensor([0, n], dtype=torch.int32,
                                                                               device=device)))
            start += n
        outs.append((torch.cat(ys), state.snapshot(a).conv_tails))
    for y, tails in outs[1:]:
        assert y.dtype == narrow and torch.equal(y, outs[0][0]) and torch.equal(tails, outs[0][1])


def test_state_keeps_no_autograd_history(device):
    """With weights that require grad (a model's parameters), the op's new tails do too: stored as they
    were, the state chained every chunk's graph into the next one."""
    state = make_state(device)
    state._conv_weights = [w.clone().requires_grad_() for w in state._conv_weights]
    a = state.new_sequence()
    for n in (4, 3):
        run_chunk(state, [a], [stream(n, n)], [torch.randn(n, CHANNELS, requires_grad=True)], device)
        assert not state.conv_state.requires_grad and state.conv_state.grad_fn is None
    state.restore(a, state.snapshot(a))
    assert not state.conv_state.requires_grad


def test_bad_input_changes_nothing(device):
    state = make_state(device)
    a, b = state.new_sequence(), state.new_sequence()
    before = state.digest()
    cu = torch.tensor([0, 2, 4], dtype=torch.int32, device=device)
    with pytest.raises(HebrusError, match="outside"):
        state.ngram_ids(0, [a, b], torch.tensor([1, 2, 3, VOCAB], device=device), cu)
    with pytest.raises(HebrusError, match="twice"):
        state.conv(0, [a, a], torch.randn(4, CHANNELS, device=device), cu)
    with pytest.raises(HebrusError, match="cu_seqlens"):
        state.conv(0, [a], torch.randn(4, CHANNELS, device=device), cu)
    with pytest.raises(HebrusError, match="layer"):
        state.conv(5, [a, b], torch.randn(4, CHANNELS, device=device), cu)
    with pytest.raises(HebrusError, match="C = 24|shape"):
        state.conv(0, [a, b], torch.randn(4, CHANNELS + 1, device=device), cu)
    with pytest.raises(HebrusError, match="already inside"):
        with ht.transaction(state):
            with ht.transaction(state):
                pass
    assert state.digest() == before


def test_to_device_moves_buffers_and_keeps_handles():
    state = make_state("cpu")
    a = state.new_sequence()
    before = state.digest(a)
    assert state.to("cpu") is state and state.digest(a) == before
    half = make_state("cpu")
    half.new_sequence()
    half.to(torch.float16)
    assert half.conv_state.dtype == torch.float16 and half.history.dtype == torch.int64
    assert half.snapshot(a).conv_tails.dtype == torch.float16  # same slot/generation in a fresh holder
    meta = make_state("cpu").to("meta")
    assert meta.conv_state.device.type == "meta" and meta.history.device.type == "meta"
    assert state.digest(a) == before


def test_casts_inside_a_transaction_or_to_unsupported_dtypes_are_refused():
    """A .half() mid-block made the commit fail after the history was published (a half-committed chunk);
    float64 was accepted, then save() failed."""
    state = make_state("cpu")
    a = state.new_sequence()
    feed(state, a, stream(6, 1), torch.randn(6, CHANNELS), [], "cpu")
    before, tails = state.digest(), state.conv_state.clone()
    cu = torch.tensor([0, 3], dtype=torch.int32)
    for cast in (lambda: state.half(), lambda: state.to(torch.bfloat16), lambda: state.to("cpu")):
        with pytest.raises(HebrusError, match="inside a transaction"):
            with ht.transaction(state):
                for layer in range(LAYERS):
                    state.ngram_ids(layer, [a], stream(3, 2), cu)
                    state.conv(layer, [a], torch.randn(3, CHANNELS), cu)
                cast()
        assert state.digest() == before and torch.equal(state.conv_state, tails) and not state.in_transaction
    for cast in (lambda: state.double(), lambda: state.to(torch.float64), lambda: state.type(torch.float16)):
        with pytest.raises(HebrusError, match="cannot cast"):
            cast()
        assert state.digest() == before and state.conv_state.dtype == torch.float32
        assert state.history.dtype == state.generation.dtype == torch.int64 and state.live.dtype == torch.bool
    with pytest.raises(HebrusError, match="float32, float16 or bfloat16"):
        make_state("cpu", dtype=torch.float64)
    state.save(a)


@pytest.mark.parametrize("hook", ["_txn_savepoint", "_reset_staging"])
def test_a_transaction_that_cannot_begin_leaves_the_state_usable(hook):
    state = make_state()
    a = state.new_sequence()
    d = state.digest()
    real = getattr(state, hook)
    armed = {"on": True}

    def failing(*args, **kwargs):
        if armed["on"]:
            armed["on"] = False
            raise MemoryError("injected")
        return real(*args, **kwargs)

    setattr(state, hook, failing)
    with pytest.raises(MemoryError):
        with ht.transaction(state):
            pass
    assert not state.in_transaction and state.digest() == d
    state.load_state_dict(state.state_dict())
    state.to(torch.float16).to(torch.float32)
    assert state.reset(a) == ht.SeqHandle(a.slot, a.generation + 1)


@pytest.mark.parametrize("eos", [10**9, -1])
def test_eos_outside_the_vocabulary_is_accepted_and_survives_save_and_restore(eos):
    """SPEC §2: the EOS id is any int64 (transformers' generation tests use vocab + 100000); a fresh history
    is [eos] * (N-1), and a saved history holding it restores."""
    gen = torch.Generator().manual_seed(0)
    params = [ht.PLEHashParams(torch.randint(1, 1 << 30, (3,), generator=gen) * 2 + 1,
                               torch.randint(50, 60, (16,), generator=gen), torch.arange(16) * 60)]
    state = ht.PLEState(1, 8, vocab_size=32, eos_token_id=eos, max_sequences=2, hash_params=params,
                        conv_weights=[torch.randn(8, 4, generator=gen)])
    a = state.new_sequence()
    tokens = torch.tensor([5, 6], dtype=torch.int64)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    ids = state.ngram_ids(0, [a], tokens, cu)
    ref, _ = ht.ple_ngram_ids(tokens, cu, torch.full((1, 2), eos, dtype=torch.int64), params[0].multipliers,
                              params[0].vocab_sizes, params[0].offsets, eos, 32)
    assert torch.equal(ids, ref)
    b = state.new_sequence()
    blob = state.save(b)                                 # a fresh history: [eos, eos]
    state.restore(a, blob)
    assert state.digest(a) == state.digest(b)


@pytest.mark.parametrize("op_name", ["ple_conv_slots", "ple_ngram_ids_slots"])
@pytest.mark.parametrize("when", ["after_write", "before_write"])
def test_a_fault_around_the_in_place_write_is_undone(op_name, when, monkeypatch):
    """Issue 27: an exception between the slot op's in-place write and the undo record left the pool changed
    after the block raised; a fault before the write must not leave an undo entry that corrupts the rollback
    of the writes that follow it in the same block."""
    from hebrus_torch.ple import ops as ple_ops

    state = make_state()
    seqs = [state.new_sequence() for _ in range(2)]
    rows = [stream(5, 1), stream(3, 2)]
    xs = [torch.randn(5, CHANNELS), torch.randn(3, CHANNELS)]
    run_chunk(state, seqs, rows, xs, "cpu")
    before = state.digest()
    real = getattr(ple_ops, op_name)

    def faulty(*args, **kwargs):
        if when == "before_write":
            raise RuntimeError("injected fault before the write")
        out = real(*args, **kwargs)
        raise KeyboardInterrupt  # after the write, before the holder regains control

    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    tokens, x = torch.cat([stream(4, 3), stream(2, 4)]), torch.randn(6, CHANNELS)
    with pytest.raises((KeyboardInterrupt, ZeroDivisionError)):
        with ht.transaction(state):
            monkeypatch.setattr(ple_ops, op_name, faulty)
            try:
                state.conv(0, seqs, x, cu) if op_name == "ple_conv_slots" else state.ngram_ids(0, seqs, tokens, cu)
            except RuntimeError:
                pass                      # the caller goes on after a refused call ...
            monkeypatch.setattr(ple_ops, op_name, real)
            state.conv(0, seqs, x, cu)    # ... changes more in place ...
            state.ngram_ids(0, seqs, tokens, cu)
            raise ZeroDivisionError       # ... and the block fails
    assert state.digest() == before


def test_conv_call_reads_a_passed_weight_as_it_is_now():
    """conv_call keeps a passed [C, 1, K] weight's [C, K] form between calls (a view): an in-place change of the weight
    reaches the next call through it, and a weight whose data was replaced (``.data =``) or another tensor is formed
    afresh. Each call gives what PLEState.conv gives with the same weight."""
    fast, slow = make_state(), make_state()
    seq_f, seq_s = fast.new_sequence(), slow.new_sequence()
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(CHANNELS, 1, 4, generator=g)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    for step, change in enumerate(["none", "none", "in place", "data", "other", "none"]):
        if change == "in place":
            weight.mul_(-2)
        elif change == "data":
            weight.data = torch.randn(CHANNELS, 1, 4, generator=g)
        elif change == "other":
            weight = torch.randn(CHANNELS, 1, 4, generator=g)
        x = torch.randn(1, CHANNELS, generator=g)
        with torch.no_grad(), ht.transaction(fast):
            y_fast = fast.conv_call(0, [seq_f], cu, torch.float32, weight)(x)
        with torch.no_grad(), ht.transaction(slow):
            y_slow = slow.conv(0, [seq_s], x, cu, weight.clone())
        assert torch.equal(y_fast, y_slow), (step, change)
    assert torch.equal(fast.conv_state, slow.conv_state)
