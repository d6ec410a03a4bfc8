"""The quantization-quality metrics and the in-memory quantize-dequantize of a model's weights
(hebrus_torch/quality.py, issue 36; benchmarks/bench_quant_quality.py uses them)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from hebrus_torch.errors import HebrusError
from hebrus_torch.moe.quantize import dequantize, quantize
from hebrus_torch.quality import fake_quantize_, next_token_kl, select_weights, top1_agreement


def test_kl_of_identical_distributions_is_zero():
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0)) * 4
    kl = next_token_kl(logits, logits.clone())
    assert kl.shape == (3, 5) and kl.dtype == torch.float32
    assert torch.equal(kl, torch.zeros(3, 5))
    assert torch.allclose(next_token_kl(logits, logits + 7.0), torch.zeros(3, 5), atol=1e-6)   # softmax shift


def test_kl_of_a_known_pair_is_the_closed_form():
    p, q = [0.5, 0.25, 0.25], [0.25, 0.25, 0.5]
    kl = next_token_kl(torch.tensor(p).log(), torch.tensor(q).log())
    expected = sum(a * math.log(a / b) for a, b in zip(p, q))            # 0.25 ln 2
    assert kl.item() == pytest.approx(expected, abs=1e-6)
    reverse = next_token_kl(torch.tensor(q).log(), torch.tensor(p).log())
    assert reverse.item() == pytest.approx(sum(b * math.log(b / a) for a, b in zip(p, q)), abs=1e-6)
    half = next_token_kl(torch.tensor([[0.0, 0.0], [0.0, 0.0]]), torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]]))
    assert half.tolist() == pytest.approx([0.0, 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)], abs=1e-6)


def test_kl_is_computed_in_fp32_and_nonnegative():
    g = torch.Generator().manual_seed(1)
    ref, other = torch.randn(64, 50, generator=g), torch.randn(64, 50, generator=g)
    kl = next_token_kl(ref.to(torch.bfloat16), other.to(torch.bfloat16))
    assert kl.dtype == torch.float32 and bool((kl > 0).all())


def test_top1_agreement_counts_positions():
    ref = torch.eye(4)                                   # argmax 0, 1, 2, 3
    model = torch.eye(4)
    model[2] = torch.tensor([1.0, 0.0, 0.5, 0.0])        # argmax 0 instead of 2
    assert top1_agreement(ref, model) == 0.75
    assert top1_agreement(ref, ref) == 1.0
    assert top1_agreement(ref[None], (-ref)[None]) == 0.0


@pytest.mark.parametrize("fn", (next_token_kl, top1_agreement))
def test_metrics_refuse_mismatched_logits(fn):
    with pytest.raises(HebrusError, match="one shape"):
        fn(torch.zeros(3, 5), torch.zeros(3, 6))


def _round_trip(bits: int, group: int):
    return lambda w: dequantize(*quantize(w, bits, group), bits, group) if w.shape[-1] % group == 0 else None


@pytest.fixture(scope="module")
def tiny():
    from hf_models import random_model

    # experts 32 wide (groups of 32 fit); the GDN's out_proj reads 2 x 8 = 16 values (no group of 32 fits it)
    return random_model(0, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def _layer_suffixes(names):
    return {re.sub(r"^model\.(layers\.\d+\.)?", "", n) for n in names}


def test_weight_sets_select_the_projections_and_experts_only(tiny):
    routed = _layer_suffixes(select_weights(tiny, ["routed_experts"]))
    shared = _layer_suffixes(select_weights(tiny, ["shared_expert"]))
    projections = _layer_suffixes(select_weights(tiny, ["projections"]))
    assert routed == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    assert shared == {f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")}
    hc = {f"{owner}.{w}.weight" for owner in ("attn_hyper_connection", "mlp_hyper_connection")
          for w in ("input_mix_weight_down", "input_mix_weight_up", "block_inject_weight")}
    hc |= {f"hyper_connection_mixer.{w}.weight" for w in ("input_mix_weight_down", "input_mix_weight_up")}
    assert projections == hc | {f"linear_attn.{p}.weight" for p in ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                     "in_proj_a", "out_proj")} | {
        f"self_attn.{p}_proj.weight" for p in "qkvo"} | {"self_attn.indexer.index_qk_proj.weight"}
    with pytest.raises(HebrusError, match="unknown weight set"):
        select_weights(tiny, ["experts"])


def test_fake_quantize_changes_only_the_chosen_weights(tiny):
    import copy

    model = copy.deepcopy(tiny)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    chosen = select_weights(model, ["routed_experts", "shared_expert", "projections"])
    status = fake_quantize_(model, ["routed_experts", "shared_expert", "projections"], _round_trip(4, 32))
    after = model.state_dict()
    assert set(status) == set(chosen)
    for name, tensor in after.items():
        if name in status and status[name] == "quantized":
            expected = dequantize(*quantize(before[name], 4, 32), 4, 32)
            assert torch.equal(tensor, expected), name
            assert not torch.equal(tensor, before[name]), name
        else:                                    # norms, router, embeddings, lm_head, PLE, kept weights
            assert torch.equal(tensor, before[name]), name
    kept = {n for n, s in status.items() if s == "kept"}
    assert kept == {n for n, p in chosen.items() if p.shape[-1] % 32}
    assert any(n.endswith("linear_attn.out_proj.weight") for n in kept)
    untouched = [n for n in after if n.endswith(("mlp.gate.weight", "norm.weight", "shared_expert_gate.weight",
                                                  "embed_tokens.weight"))] + ["lm_head.weight"]
    assert untouched and all(n not in status for n in untouched)


def test_fake_quantize_refuses_a_wrong_shape_and_writes_nothing(tiny):
    import copy

    model = copy.deepcopy(tiny)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def bad(w):
        calls.append(w.shape)
        return torch.zeros(w.shape) if len(calls) < 3 else torch.zeros(1)

    with pytest.raises(HebrusError, match="round trip of"):
        fake_quantize_(model, ["routed_experts"], bad)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
