"""hebrus::gdn_chunk_delta_rule_slots on a real Apple GPU (device="mps"): what the emulator cannot show.

Skipped unless MPS is available and the extension registers the op's MPS kernel (macOS build with
the op's schema). Against ``chunk_delta_rule_reference`` on the CPU at Dk = Dv = 128 with
Hv / Hk = 2, bitwise invariance under cuts at multiples of 64 on the device, and a bad slot raised
at the next synchronization with the pool left as it was.
"""

from __future__ import annotations

import pytest
import torch

from hebrus_torch._extension import has_native_kernel
from hebrus_torch.gdn.chunked import chunk_delta_rule_reference

OP = "gdn_chunk_delta_rule_slots"


def _registered() -> bool:
    try:
        return has_native_kernel(OP, "mps")
    except RuntimeError:  # the op's schema is not in this build
        return False


HAS_MPS = torch.backends.mps.is_available()
pytestmark = [pytest.mark.metal, pytest.mark.mps,
              pytest.mark.skipif(not HAS_MPS, reason="needs an Apple GPU"),
              pytest.mark.skipif(HAS_MPS and not _registered(), reason=f"no MPS kernel for hebrus::{OP}")]

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def inputs(lengths, starts, dtype, hk=2, hv=4, dk=128, dv=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, B = sum(lengths), len(lengths)
    q, k = torch.randn(T, hk, dk, generator=g).to(dtype), torch.randn(T, hk, dk, generator=g).to(dtype)
    v = torch.randn(T, hv, dv, generator=g).to(dtype)
    gate = (-torch.rand(T, hv, generator=g) * 0.3).to(dtype)
    beta = torch.rand(T, hv, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pool = torch.randn(B + 2, hv, dk, dv, generator=g) * 0.2
    slots = torch.arange(B, dtype=torch.int32).flip(0) + 1
    return q, k, v, gate, beta, cu, torch.tensor(starts, dtype=torch.int64), pool, slots


def run_mps(q, k, v, g, beta, cu, sp, pool, slots):
    dev = [t.to("mps") for t in (q, k, v, g, beta, cu, sp, pool, slots)]
    out = torch.ops.hebrus.gdn_chunk_delta_rule_slots(*dev, q.shape[2] ** -0.5, True)
    return out.cpu(), dev[7].cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_reference(dtype):
    args = inputs([130, 70, 0, 1], [0, 57, 3, 64], dtype)
    out, pool = run_mps(*args)
    want_pool = args[7].clone()
    want = chunk_delta_rule_reference(*args[:5], args[5].tolist(), args[6].tolist(), want_pool, args[8].tolist(),
                                      True, args[0].shape[2] ** -0.5)
    tol = TOL[dtype] * max(1.0, float(want.float().abs().max()))
    torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=tol)
    torch.testing.assert_close(pool, want_pool, rtol=0, atol=1e-5 * max(1.0, float(want_pool.abs().max())))


def test_aligned_cuts_are_bitwise_on_device():
    q, k, v, g, beta, _, _, pool, _ = inputs([200], [5], torch.float32, seed=1)
    slot = torch.tensor([1], dtype=torch.int32)
    whole = run_mps(q, k, v, g, beta, torch.tensor([0, 200], dtype=torch.int32), torch.tensor([5]), pool, slot)
    state, parts = pool, []
    for lo, hi in ((0, 59), (59, 187), (187, 200)):  # absolute cuts at 64 and 192
        o, state = run_mps(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi],
                           torch.tensor([0, hi - lo], dtype=torch.int32), torch.tensor([5 + lo]), state, slot)
        parts.append(o)
    assert torch.equal(torch.cat(parts), whole[0]) and torch.equal(state, whole[1])


def test_bad_slot_raises_at_synchronize():
    q, k, v, g, beta, cu, sp, pool, slots = inputs([3, 2], [0, 0], torch.float32, dk=8, dv=8)
    slots = torch.tensor([1, 9], dtype=torch.int32)
    dev_pool = pool.to("mps")
    with pytest.raises(torch.AcceleratorError, match=r"slots\[1\] = 9 is outside"):
        torch.ops.hebrus.gdn_chunk_delta_rule_slots(*[t.to("mps") for t in (q, k, v, g, beta, cu, sp)], dev_pool,
                                                    slots.to("mps"), 0.3, True)
        torch.mps.synchronize()
    after = dev_pool.cpu()
    assert torch.equal(after[[0, 2, 3]], pool[[0, 2, 3]])  # nothing written but row 0's slot (1)
