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


# Tolerances against the fp32-accumulating reference, per dtype.
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
