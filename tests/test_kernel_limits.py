"""The native kernels' size limits are written once for C++/Metal (mps_kernels/hebrus_params.h) and once for
Python (hebrus_torch._limits, which the drop-in reads to fall back): the two must agree, and the CPU
kernels must refuse exactly past them."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import hebrus_torch as ht
from hebrus_torch import _limits
from hebrus_torch._extension import has_native_kernel

HEADER = pathlib.Path(__file__).resolve().parents[1] / "mps_kernels" / "hebrus_params.h"


def header_limits() -> dict[str, int]:
    found = dict(re.findall(r"^#define HEBRUS_(\w+_MAX_\w+)\s+(\d+)", HEADER.read_text(), re.M))
    return {name: int(value) for name, value in found.items()}


def test_python_limits_are_the_headers():
    header = header_limits()
    assert header == {"CPU_MAX_HEAD_DIM": _limits.CPU_MAX_HEAD_DIM, "CPU_MAX_QUERY_HEADS": _limits.CPU_MAX_QUERY_HEADS,
                      "CPU_MAX_TOP_K": _limits.CPU_MAX_TOP_K, "MPS_MAX_KEEP": _limits.MPS_MAX_KEEP,
                      "MPS_ATTN_MAX_DIM": _limits.MPS_ATTN_MAX_DIM, "MPS_GDN_MAX_KEY_DIM": _limits.MPS_GDN_MAX_KEY_DIM,
                      "MPS_GDN_CHUNK_MAX_KEY_DIM": _limits.MPS_GDN_CHUNK_MAX_KEY_DIM}
    launch = (HEADER.parent / "hebrus_launch.h").read_text()     # the Metal variants take theirs from the header
    assert "#define HEBRUS_QSA_SELECT_K2048_KMAX HEBRUS_MPS_MAX_KEEP" in launch
    assert "#define HEBRUS_QSA_ATTN_MAX_DIM HEBRUS_MPS_ATTN_MAX_DIM" in launch
    assert "key_dim > HEBRUS_MPS_GDN_MAX_KEY_DIM" in launch
    assert "#define HEBRUS_GDN_CHUNK_MAX_DK HEBRUS_MPS_GDN_CHUNK_MAX_KEY_DIM" in launch


@pytest.mark.skipif(not has_native_kernel("qsa_select", "cpu"), reason="no native CPU kernel")
@pytest.mark.parametrize("what", ["dim", "heads", "top_k"])
def test_cpu_kernel_refuses_exactly_past_the_limit(what):
    limit = _limits.INDEXER_LIMITS["cpu"][what]

    def call(value):
        dim, heads, top_k = 8, 2, 2
        if what == "dim":
            dim = value
        elif what == "heads":
            heads = value
        else:
            top_k = value
        q = torch.randn(1, heads, dim)
        pooled = torch.randn(3, dim)
        seq_groups = torch.tensor([[0, 1, 2]], dtype=torch.int32)
        return ht.qsa_select(q, pooled, seq_groups, torch.zeros(1, dtype=torch.int32),
                             torch.tensor([3], dtype=torch.int32), top_k)

    call(limit)
    with pytest.raises(ht.HebrusError, match=f"at most {limit} on CPU, got {limit + 1}"):
        call(limit + 1)
