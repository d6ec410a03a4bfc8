"""hebrus_torch.module_calls.linear: a plain nn.Linear runs as F.linear on its own parameters (the module call's
bits), and anything the module call would do besides its forward (hooks, a subclass, an instance forward, a
compiled call) still happens. module_calls.embedding: the same for nn.Embedding and F.embedding."""

from __future__ import annotations

import pytest
import torch

from hebrus_torch.module_calls import embedding, linear, runs_forward_only


def _lin(bias: bool = False) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 5, bias=bias)


@pytest.mark.parametrize("bias", [False, True])
def test_plain_linear_gives_the_module_calls_bits(bias):
    lin = _lin(bias)
    x = torch.randn(3, 8)
    assert runs_forward_only(lin)
    assert torch.equal(linear(lin, x), lin(x))


def test_a_forward_hook_still_runs():
    lin = _lin()
    seen = []
    lin.register_forward_hook(lambda mod, args, out: seen.append(out) or out * 2)
    x = torch.randn(2, 8)
    assert not runs_forward_only(lin)
    out = linear(lin, x)
    assert len(seen) == 1 and torch.equal(out, seen[0] * 2)


def test_a_forward_pre_hook_still_runs():
    lin = _lin()
    lin.register_forward_pre_hook(lambda mod, args: (args[0] * 0,))
    assert torch.equal(linear(lin, torch.randn(2, 8)), lin(torch.zeros(2, 8)))


def test_a_global_forward_hook_still_runs():
    lin = _lin()
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: seen.append(mod))
    try:
        assert not runs_forward_only(lin)
        linear(lin, torch.randn(1, 8))
    finally:
        handle.remove()
    assert seen == [lin]
    assert runs_forward_only(lin)


def test_a_subclass_and_an_instance_forward_are_called():
    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 3

    torch.manual_seed(0)
    sub = Scaled(8, 5, bias=False)
    x = torch.randn(2, 8)
    assert torch.equal(linear(sub, x), torch.nn.functional.linear(x, sub.weight) * 3)

    lin = _lin()
    lin.forward = lambda x: torch.zeros(x.shape[0], 5)
    assert not runs_forward_only(lin)
    assert torch.equal(linear(lin, x), torch.zeros(2, 5))


def test_any_other_module_is_called_as_itself():
    seq = torch.nn.Sequential(_lin(), torch.nn.ReLU())
    x = torch.randn(2, 8)
    assert torch.equal(linear(seq, x), seq(x))


@pytest.mark.parametrize("options", [{}, {"padding_idx": 2}, {"max_norm": 0.5}])
def test_plain_embedding_gives_the_module_calls_bits(options):
    torch.manual_seed(1)
    emb, ids = torch.nn.Embedding(11, 6, **options), torch.tensor([[3, 2], [10, 3]])
    want = torch.nn.Embedding(11, 6, **options)
    want.load_state_dict(emb.state_dict())
    assert torch.equal(embedding(emb, ids), want(ids))
    assert torch.equal(emb.weight, want.weight)         # (max_norm renormalizes the rows read, in place: both did)


def test_an_embedding_with_a_hook_or_of_a_subclass_is_called_as_itself():
    torch.manual_seed(2)
    emb, ids = torch.nn.Embedding(7, 4), torch.tensor([1, 5])
    emb.register_forward_hook(lambda mod, args, out: out + 1)
    assert torch.equal(embedding(emb, ids), emb.weight[ids] + 1)

    class Doubled(torch.nn.Embedding):
        def forward(self, input):
            return super().forward(input) * 2

    doubled = Doubled(7, 4)
    assert torch.equal(embedding(doubled, ids), doubled.weight[ids] * 2)
