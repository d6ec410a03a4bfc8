"""What torch's MPS backend does with each ATen op, read from the installed torch's native_functions.yaml
(``hebrus_torch._mps_ops``), and how the emulator counts it: one dispatch for an op with an MPS kernel,
the ops and host reads of its composite for one without (``_grouped_mm``: a read of the offsets and one
``mm`` per group), a "no_kernel" report for an op MPS cannot run."""

from __future__ import annotations

import textwrap

import pytest
import torch

from hebrus_torch import _emulate, _mps_ops

aten = torch.ops.aten


def test_the_installed_torch_says_which_ops_have_mps_kernels():
    kinds = _mps_ops.op_kinds()
    assert len(kinds) > 2000                                   # every op of the file
    assert _mps_ops.mps_kind(aten.mm.default) == _mps_ops.KERNEL
    assert _mps_ops.mps_kind(aten.add.Tensor) == _mps_ops.KERNEL       # structured: its add.out has MPS
    assert _mps_ops.mps_kind(aten._grouped_mm.default) == _mps_ops.COMPOSITE
    assert _mps_ops.mps_kind(aten.take.default) == _mps_ops.NO_KERNEL
    assert _mps_ops.mps_kind(aten.heaviside.default) == _mps_ops.NO_KERNEL   # its out= has CPU and CUDA only
    assert _mps_ops.mps_kind(aten.rms_norm.default) == _mps_ops.IMPLICIT
    assert _mps_ops.mps_kind(torch.ops.hebrus.gdn_delta_rule.default) == _mps_ops.UNLISTED


def test_the_rules_on_a_small_file(tmp_path):
    path = tmp_path / "native_functions.yaml"
    path.write_text(textwrap.dedent("""\
        - func: own(Tensor self) -> Tensor
          dispatch:
            CPU, CUDA, MPS: own_kernel
        - func: comp(Tensor self) -> Tensor
          dispatch:
            CompositeExplicitAutograd: comp
          autogen: comp.out
        - func: comp_nf(Tensor self) -> Tensor
          dispatch:
            CompositeExplicitAutogradNonFunctional: comp_nf
        - func: implicit(Tensor self) -> Tensor
        - func: cpu_only(Tensor self) -> Tensor
          dispatch:
            CPU, CUDA: cpu_only
            SparseMPS: sparse_only_on_mps
        - func: both(Tensor self) -> Tensor
          dispatch:
            CompositeExplicitAutograd: both
            MPS: both_mps
        - func: st.out(Tensor self, *, Tensor(a!) out) -> Tensor(a!)
          structured: True
          dispatch:
            CPU: st_out
            MPS: st_out_mps
        - func: st(Tensor self) -> Tensor
          structured_delegate: st.out
          dispatch:
            SparseCPU: st_sparse
        - func: st_cpu.out(Tensor self, *, Tensor(a!) out) -> Tensor(a!)
          structured: True
          dispatch:
            CPU: st_cpu_out
        - func: st_cpu(Tensor self) -> Tensor
          structured_delegate: st_cpu.out
        """))
    kinds = _mps_ops.op_kinds(str(path))
    assert kinds == {
        "own": "kernel", "comp": "composite", "comp.out": "composite", "comp_nf": "composite",
        "implicit": "implicit", "cpu_only": "no_kernel", "both": "kernel", "st.out": "kernel", "st": "kernel",
        "st_cpu.out": "no_kernel", "st_cpu": "no_kernel"}


def _grouped_inputs(dev, groups: int = 3):
    a = torch.randn(2 * groups, 8, device=dev)
    b = torch.randn(groups, 8, 8, device=dev)
    offs = torch.arange(2, 2 * groups + 1, 2, dtype=torch.int32, device=dev)
    return a, b, offs


@pytest.mark.parametrize("groups", [2, 5])
def test_grouped_mm_counts_its_host_read_and_one_mm_per_group(groups):
    seen: list[tuple[str, str]] = []
    with torch.no_grad(), _emulate.emulate("mps") as dev:
        a, b, offs = _grouped_inputs(dev, groups)
        with _emulate.observe(lambda kind, name: seen.append((kind, name))):
            out = torch._grouped_mm(a, b, offs)
        ref = torch._grouped_mm(a.inner, b.inner, offs.inner)
    assert isinstance(out, _emulate.EmulatedTensor) and torch.equal(out.inner, ref)
    assert seen[0] == ("composite", "_grouped_mm")
    assert [n for k, n in seen if k == "sync"] == ["to_cpu"]                 # the offsets, read on the host
    assert ("composite_sync", "_grouped_mm") in seen
    assert [n for k, n in seen if k == "dispatch"] == ["mm"] * groups


def test_an_op_without_an_mps_kernel_is_reported():
    seen: list[tuple[str, str]] = []
    with torch.no_grad(), _emulate.emulate("mps") as dev:
        x = torch.arange(6.0, device=dev)
        idx = torch.tensor([5, 0], device=dev)
        with _emulate.observe(lambda kind, name: seen.append((kind, name))):
            y = torch.take(x, idx)
            z = x * 2
        assert y.tolist() == [5.0, 0.0] and z.device.type == "mps"
    assert ("no_kernel", "take") in seen and ("no_kernel", "mul") not in [(k, n) for k, n in seen]
    assert ("dispatch", "mul") in seen


def test_composites_without_reads_count_the_kernels_they_run():
    """``clone`` and ``stack`` are composites on MPS (an allocation and a copy; a cat): one kernel each,
    no read; ``copy_``'s composite is MPS's copy kernel."""
    seen: list[tuple[str, str]] = []
    with torch.no_grad(), _emulate.emulate("mps") as dev:
        x = torch.randn(4, 3, device=dev)
        with _emulate.observe(lambda kind, name: seen.append((kind, name))):
            c = x.clone()
            s = torch.stack([x, x])
            c.copy_(x * 3)
        assert torch.equal(c.inner, x.inner * 3) and torch.equal(s.inner, torch.stack([x.inner, x.inner]))
    assert [n for k, n in seen if k == "dispatch"] == ["copy", "cat", "mul", "copy"]
    assert ("composite", "clone") in seen and ("composite", "stack") in seen
    assert not [k for k, _ in seen if k in ("sync", "composite_sync", "no_kernel")]


def test_a_composite_that_fails_leaves_the_counting_intact():
    """An error of any class inside a composite's decomposition leaves later ops reported (the reports
    a composite makes are held until it finishes)."""
    seen: list[tuple[str, str]] = []

    def failing():
        raise ValueError("the composite failed")

    with torch.no_grad(), _emulate.emulate("mps") as dev:
        a = torch.randn(4, 8, device=dev)
        with _emulate.observe(lambda kind, name: seen.append((kind, name))):
            with pytest.raises(ValueError, match="the composite failed"):
                _emulate._decompose(aten.clone.default, _mps_ops.COMPOSITE, (a,), {}, "clone", failing)
            a * 2
    assert seen == [("dispatch", "mul")]
