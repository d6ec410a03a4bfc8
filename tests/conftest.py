import pytest
import torch

import hebrus_torch  # noqa: F401  (registers the ops)

HAS_MPS = torch.backends.mps.is_available()
needs_mps = pytest.mark.skipif(not HAS_MPS, reason="needs an Apple GPU (torch.backends.mps.is_available())")

DEVICES = ["cpu", pytest.param("mps", marks=[pytest.mark.mps, needs_mps])]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """cpu always; mps where torch.backends.mps.is_available()."""
    return request.param


@pytest.fixture
def one_thread():
    """One torch thread for the test: a tiny model is thousands of tiny ops, and on a shared 2-core
    machine threads only add synchronisation (and make timings of a whole model swing)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Tolerances against the fp32-accumulating reference, per dtype.
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def with_changes(good: dict, changes: dict, device: str) -> dict:
    """A copy of an op's good keyword arguments with some replaced (tensors moved to ``device``)."""
    args = dict(good)
    args.update({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in changes.items()})
    return args


def assert_mixed_devices_rejected(op: str, args: dict, name: str, wrapper=None) -> None:
    """``args[name]`` moved to the meta device: the wrapper (``hebrus_torch.<op>`` unless given) and
    the raw op (which dispatches to the fake, which validates) both refuse the mix with a HebrusError."""
    args = dict(args)
    args[name] = args[name].to("meta")
    with pytest.raises(hebrus_torch.HebrusError, match=rf"hebrus::{op}: all tensors must be on one device"):
        (wrapper or getattr(hebrus_torch, op))(**args)
    with pytest.raises(hebrus_torch.HebrusError, match=r"all tensors must be on one device"):
        getattr(torch.ops.hebrus, op)(*args.values())


def assert_rejected(op: str, args: dict, pattern: str, device: str, wrapper=None) -> None:
    """Bad input for ``hebrus::<op>``: the wrapper (``hebrus_torch.<op>`` unless given) raises a
    HebrusError naming the op and matching ``pattern`` and leaves every tensor argument unchanged; on
    CPU the C++ kernel called directly raises the tagged ValueError that ``errors.translate`` maps
    back to HebrusError, and changes nothing either."""
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(hebrus_torch.HebrusError, match=f"hebrus::{op}: .*" + pattern):
        (wrapper or getattr(hebrus_torch, op))(**args)
    assert all(torch.equal(args[k], v) for k, v in before.items())
    if device == "cpu":
        with pytest.raises(ValueError, match=rf"\[HebrusError\] hebrus::{op}: .*" + pattern) as info:
            getattr(torch.ops.hebrus, op)(*args.values())
        assert all(torch.equal(args[k], v) for k, v in before.items())
        mapped = hebrus_torch.errors.translate(info.value)
        assert type(mapped) is hebrus_torch.HebrusError and str(mapped).startswith(f"hebrus::{op}: ")
