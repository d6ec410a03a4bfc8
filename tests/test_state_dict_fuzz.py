"""Untrusted state dicts and blobs: every malformed input is a CorruptStateError and changes nothing (SPEC §4).

Each entry of each holder's state dict (PLEState, GDNState, QSACache, ModelCache) is replaced in turn by a 0-dim
tensor, a meta tensor of the right shape and dtype, the right shape in a wrong dtype, a sparse tensor and
non-tensor values; the load must refuse it with CorruptStateError before reading the entry's bytes. The
slot-pool holders (PLEState, GDNState: one SlotPoolHolder) also refuse each other's state dicts and blobs.
"""

from __future__ import annotations

import pytest
import torch

import hebrus_torch as ht
from hebrus_torch.errors import CorruptStateError

from hf_models import modeling, tiny_config  # skips without transformers
from test_gdn_state import advance as gdn_advance, make_state as make_gdn
from test_ple_state import make_state, stream as ple_stream
from test_qsa_cache import make_cache as make_qsa, stream as qsa_stream


def _model_cache(max_sequences: int = 3) -> ht.ModelCache:
    torch.manual_seed(0)
    cfg = tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"], ple_layer_ids=[1])
    model = modeling.Qwen4ExpForCausalLM(cfg).eval()
    return ht.ModelCache.from_transformers(model, capacity_tokens=64, max_sequences=max_sequences)


def _fill_model_cache(mc: ht.ModelCache) -> ht.SeqHandle:
    a = mc.new_sequence()
    tokens = torch.arange(3, 12)
    batch = ht.Batch.pack({a: tokens})
    with mc.transaction(batch) as step:
        step.ple_ngram_ids(mc.ple.layer_ids[0])
        step.ple_conv(mc.ple.layer_ids[0], torch.randn(tokens.numel(), mc.ple.channels))
        step.qsa_write(mc.qsa.layer_ids[0], torch.randn(tokens.numel(), mc.qsa.head_dim))
    return a


_HOLDERS: dict | None = None


def _holders():
    """The three holders, built once: a refused load changes nothing, and each test reloads the good state."""
    global _HOLDERS
    if _HOLDERS is None:
        _HOLDERS = _build_holders()
    return _HOLDERS


def _build_holders():
    ple = make_state()
    a = ple.new_sequence()
    tokens = ple_stream(9, seed=3)
    cu = torch.tensor([0, 9], dtype=torch.int32)
    with ht.transaction(ple):
        for layer in range(ple.num_layers):
            ple.ngram_ids(layer, [a], tokens, cu)
            ple.conv(layer, [a], torch.randn(9, ple.channels), cu)
    gdn = make_gdn()
    c = gdn.new_sequence()
    gdn_advance(gdn, c, 5, 1)
    qsa = make_qsa(kv=True)
    b = qsa.new_sequence()
    keys, k, v = qsa_stream(11, kv=True)
    qsa.append(b, keys, first_position=2, k=k, v=v)
    mc = _model_cache()
    _fill_model_cache(mc)
    return {"PLEState": ple, "GDNState": gdn, "QSACache": qsa, "ModelCache": mc}


def _bad_values(t):
    if not isinstance(t, torch.Tensor):
        return {"not a dict": [1, 2], "None": None, "a string": "x"}
    out = {"0-dim": torch.tensor(0, dtype=t.dtype), "meta": torch.empty(t.shape, dtype=t.dtype, device="meta"),
           "wrong dtype": t.to(torch.float64) if t.dtype != torch.float64 else t.to(torch.int64),
           "int": 3, "None": None, "list": t.tolist() if t.numel() < 50 else [0], "string": "tensor"}
    if t.dim() >= 1 and t.dtype != torch.bool:
        out["sparse"] = t.to_sparse()
    return out


CASES = [(holder, key, bad) for holder, h in _holders().items() for key, value in h.state_dict().items()
         for bad in _bad_values(value)]


@pytest.mark.parametrize("holder,key,bad", CASES, ids=[f"{h}-{k}-{b}" for h, k, b in CASES])
def test_every_malformed_state_dict_entry_is_refused(holder, key, bad):
    target = _holders()[holder]
    sd = target.state_dict()
    value = _bad_values(sd[key])[bad]
    before = target.digest()
    with pytest.raises(CorruptStateError):
        target.load_state_dict(dict(sd, **{key: value}))
    assert target.digest() == before
    target.load_state_dict(sd)                          # the good one still loads
    assert target.digest() == before


@pytest.mark.parametrize("holder", ["PLEState", "GDNState", "QSACache"])
def test_check_state_dict_refuses_malformed_entries_too(holder):
    target = _holders()[holder]
    sd = target.state_dict()
    for key, value in sd.items():
        for bad, v in _bad_values(value).items():
            with pytest.raises(CorruptStateError):
                target.check_state_dict(dict(sd, **{key: v}))


@pytest.mark.parametrize("holder,other", [("PLEState", "GDNState"), ("GDNState", "PLEState")])
def test_slot_pool_holders_refuse_each_others_state_dicts_and_blobs(holder, other):
    """One SlotPoolHolder validates both: the other's state dict (same keys but one, a different format),
    that state dict with this holder's format claimed, with this holder's entries in the other's metadata,
    and the other's blobs are CorruptStateError, and change nothing."""
    target, source = _holders()[holder], _holders()[other]
    sd, foreign = target.state_dict(), source.state_dict()
    mine = {k: v for k, v in sd.items() if k != "_extra_state"}
    claimed = dict(foreign, _extra_state=dict(foreign["_extra_state"], format=sd["_extra_state"]["format"]))
    mixed = dict(mine, _extra_state=foreign["_extra_state"])
    before = target.digest()
    for bad in (foreign, claimed, mixed):
        for load in (target.load_state_dict, target.check_state_dict,
                     lambda d: target.load_state_dict(d, strict=False)):
            with pytest.raises(CorruptStateError):
                load(bad)
            assert target.digest() == before
    seq = target.slots.live_handles()[0]
    for data in (source.save(source.slots.live_handles()[0]), target.save(seq)[:-1]):
        with pytest.raises(CorruptStateError):
            target.restore(seq, data)
        assert target.digest() == before


def test_a_foreign_blob_into_a_full_model_cache_is_corrupt_not_capacity():
    mc = _model_cache(max_sequences=1)
    _fill_model_cache(mc)
    before = mc.digest()
    other = make_qsa()
    foreign = other.save(other.new_sequence())                     # a QSACache blob, not a ModelCache one
    for data in (foreign, b"junk", mc.save(mc.slots.live_handles()[0])[:-1]):
        with pytest.raises(CorruptStateError):
            mc.restore(data)
        assert mc.digest() == before
    # a well-formed ModelCache blob whose parts are bad is refused before a slot is claimed too
    good = mc.save(mc.slots.live_handles()[0])
    meta, parts = ht.state.blob.unpack(good, "hebrus_torch.ModelCache")
    parts["qsa"] = torch.frombuffer(bytearray(b"junk" * 20), dtype=torch.uint8)
    bad = ht.state.blob.pack("hebrus_torch.ModelCache", meta, parts)
    with pytest.raises(CorruptStateError):
        mc.restore(bad)
    assert mc.digest() == before


def test_model_cache_digest_covers_free_slots_generations():
    """Two caches whose live sequences are equal but whose next handle differs digest differently."""
    mc = _model_cache()
    _fill_model_cache(mc)
    sd = mc.state_dict()
    extra = sd["_extra_state"]
    generation = list(extra["generation"])
    free = extra["live"].index(False)
    generation[free] = 5                                  # the holders' free slot stays at 0: allowed (<= 5)
    tampered = dict(sd, _extra_state=dict(extra, generation=generation, checksum=mc._table_checksum(
        generation, extra["live"], extra["origin"])))
    one, other = _model_cache(), _model_cache()
    one.load_state_dict(sd)
    other.load_state_dict(tampered)
    assert one.ple.digest() == other.ple.digest() and one.qsa.digest() == other.qsa.digest()
    assert one.new_sequence() != other.new_sequence()    # they do differ ...
    one.load_state_dict(sd)
    other.load_state_dict(tampered)
    assert one.digest() != other.digest()                # ... and so do their digests
