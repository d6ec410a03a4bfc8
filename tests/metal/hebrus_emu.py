"""The hebrus ops run through the Metal emulator, launched the way the MPS glue launches them.

Each function mirrors its ``csrc/mps/<op>.mm``: the same metadata checks (``hebrus_torch._validate``),
contiguous inputs (except qsa_attention's k and v, bound in place as the glue binds them: only their
last dim is made contiguous, see :func:`bound_view`), kernel name from
``hebrus::metal::kernel_name``, parameter block and grid from the ``plan_*`` functions of
``mps_kernels/hebrus_launch.h`` (called through ``plan_abi.cpp``), the same buffer order, the
error-slot buffer read back after the launch and raised as the glue raises it (``HebrusError`` /
``HoleError``), and no output returned when a slot is set. Outputs start as poison (NaN for floats,
0x7F7F... for integers) so an element the kernel forgets to write shows.

Keyword arguments select the emulator's schedule (``sched``, ``seed``), the guard-page side
(``guard``), worker threads (``workers``) and the host compiler of the kernels (``cxx``, g++ by
default; clang++-19 also works).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

import msl_emu
from hebrus_torch import _validate, reference
from hebrus_torch.errors import HebrusError, HoleError

KERNEL_DIR = msl_emu.KERNEL_DIR
METAL_TYPE = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat", torch.int64: "long"}
ERR_NONE = -1  # HEBRUS_ERR_NONE read back as int32


class EmuPlan(ctypes.Structure):
    _fields_ = [("threads", ctypes.c_uint64), ("group", ctypes.c_uint64), ("params_size", ctypes.c_uint64),
                ("params", ctypes.c_ubyte * 256), ("variant", ctypes.c_char * 32), ("error", ctypes.c_char * 256)]

    @property
    def params_bytes(self) -> bytes:
        return bytes(self.params[: self.params_size])


@functools.cache
def plan_library() -> ctypes.CDLL:
    src = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "plan_abi.cpp")).read()
    headers = "".join(open(os.path.join(KERNEL_DIR, h)).read() for h in ("hebrus_launch.h", "hebrus_params.h"))
    cmd = ["g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-fvisibility=hidden", "-I", KERNEL_DIR]
    so = msl_emu._compile_cached(src, "plan_abi", cmd, "g++", key_extra=headers)
    return ctypes.CDLL(so)


def plan(op: str, *args) -> EmuPlan:
    lib = plan_library()
    out = EmuPlan()
    fn = getattr(lib, f"hebrus_emu_plan_{op}")
    conv = [ctypes.c_double(a) if isinstance(a, float) else ctypes.c_int64(int(a)) for a in args]
    if op == "ple_conv":
        conv[-1] = ctypes.c_int32(int(args[-1]))
    if fn(*conv, ctypes.byref(out)):
        raise HebrusError(f"hebrus::{op} on MPS: {out.error.decode()}")
    return out


def kernel_name(op: str, variant: str, dtype: torch.dtype) -> str:
    buf = ctypes.create_string_buffer(128)
    plan_library().hebrus_emu_kernel_name(op.encode(), variant.encode(), METAL_TYPE[dtype].encode(), buf, len(buf))
    return buf.value.decode()


@functools.cache
def module(stem: str, cxx: str = "g++") -> msl_emu.Module:
    return msl_emu.build(os.path.join(KERNEL_DIR, stem + ".metal"), cxx=cxx)


def poisoned(shape, dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    t.view(torch.uint8).fill_(0xFF if dtype.is_floating_point else 0x7F)
    return t


def error_slots() -> torch.Tensor:
    return torch.full((plan_library().hebrus_emu_error_slots(),), ERR_NONE, dtype=torch.int32)


def _launch(stem: str, name: str, buffers, p: EmuPlan, cxx: str = "g++", **emu):
    if p.threads:
        module(stem, cxx).dispatch(name, [*buffers, p.params_bytes], grid=(p.threads,), tg=(p.group,), **emu)


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is contiguous (or has at most one element), else a contiguous copy:
    what csrc/mps/qsa_attention.mm (and the CPU kernel) do to k and v before reading them through strides."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def bound_view(t: torch.Tensor) -> torch.Tensor:
    """The buffer the glue's setArg(idx, t) binds for a strided tensor, without copying: a 1-D alias of
    t's storage from t's first element through its last one (the GPU gets the whole MTLBuffer from the
    storage offset on; the emulator binds only the span the view covers, so an access outside it hits
    the guard page). The kernel addresses the elements with t's strides, which go in the parameter
    block. For a contiguous t this is t.view(-1)."""
    if t.numel() == 0:
        return torch.as_strided(t, (0,), (1,))
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return torch.as_strided(t, (span,), (1,))


def _slot(err: torch.Tensor, i: int) -> int | None:
    v = int(err[i]) & 0xFFFFFFFF
    return None if v == 0xFFFFFFFF else v


# ---- ple_conv ---------------------------------------------------------------------------------------

def ple_conv(x, weight, cu_seqlens, state, dilation, activation, **emu):
    _validate.ple_conv(x, weight, cu_seqlens, state, dilation, activation)
    total, channels = x.shape
    batch, width = cu_seqlens.shape[0] - 1, weight.shape[1]
    if batch == 0 or channels == 0:  # nothing for the kernel to check: the glue checks cu_seqlens on the host
        reference.check_cu_seqlens_values(cu_seqlens, total, "ple_conv")
        return x.new_empty(x.shape), state.clone()
    p = plan("ple_conv", total, channels, width, batch, dilation, activation == "silu")
    x, weight, cu, state = (t.contiguous() for t in (x, weight, cu_seqlens, state))
    y, new_state, err = poisoned(x.shape, x.dtype), poisoned(state.shape, x.dtype), error_slots()
    _launch("ple_conv", kernel_name("ple_conv", "", x.dtype), [x, weight, cu, state, y, new_state, err], p, **emu)
    if _slot(err, 0) is not None:
        reference.check_cu_seqlens_values(cu, total, "ple_conv")
        raise AssertionError("kernel reported bad cu_seqlens that the host check accepts")
    return y, new_state


# ---- ple_ngram_ids ----------------------------------------------------------------------------------

def ple_ngram_ids(tokens, cu_seqlens, history, multipliers, vocab_sizes, offsets, eos, vocab, **emu):
    n, heads = _validate.ple_ngram_ids(tokens, cu_seqlens, history, multipliers, vocab_sizes, offsets, eos, vocab)
    op = "ple_ngram_ids"
    total, batch = tokens.shape[0], cu_seqlens.shape[0] - 1
    if batch == 0:  # no row threads: the glue checks cu_seqlens on the host
        reference.check_cu_seqlens_values(cu_seqlens, total, op)
        return tokens.new_empty((0, heads)), history.clone()
    p = plan(op, total, batch, n, heads, eos, vocab)
    tokens, cu, history, multipliers, vocab_sizes, offsets = (
        t.contiguous() for t in (tokens, cu_seqlens, history, multipliers, vocab_sizes, offsets))
    row_ids, new_history, err = poisoned((total, heads), torch.int64), poisoned(history.shape, torch.int64), error_slots()
    _launch(op, kernel_name(op, "", torch.int64), [tokens, cu, history, multipliers, vocab_sizes, offsets, row_ids,
                                                  new_history, err], p, **emu)
    if _slot(err, 0) is not None:
        reference.check_cu_seqlens_values(cu, total, op)
        raise AssertionError("kernel reported bad cu_seqlens that the host check accepts")
    if (t := _slot(err, 1)) is not None:
        raise HebrusError(f"hebrus::{op}: tokens[{t}] = {int(tokens[t])} is outside [0, vocab={vocab})")
    if (i := _slot(err, 2)) is not None:
        b, j = divmod(i, n - 1)
        raise HebrusError(f"hebrus::{op}: history[{b}, {j}] = {int(history[b, j])} is outside [0, vocab={vocab}) "
                          f"and is not eos")
    if (h := _slot(err, 3)) is not None:
        raise HebrusError(f"hebrus::{op}: vocab_sizes[{h}] must be positive, got {int(vocab_sizes[h])}")
    return row_ids, new_history


# ---- qsa_pool ---------------------------------------------------------------------------------------

def qsa_pool(keys, cell_pos, group_cells, group_pos, norm_weight, eps, inv_freq, **emu):
    _validate.qsa_pool(keys, cell_pos, group_cells, group_pos, norm_weight, eps, inv_freq)
    op = "qsa_pool"
    cells, dim = keys.shape
    groups, r = group_cells.shape
    if groups == 0:
        return keys.new_empty((0, dim))
    p = plan(op, cells, dim, groups, r, inv_freq.shape[0], float(eps))
    keys, cell_pos, group_cells, group_pos, inv_freq = (
        t.contiguous() for t in (keys, cell_pos, group_cells, group_pos, inv_freq))
    weight = norm_weight.float().contiguous()  # exact for every float dtype; the kernel reads fp32
    pooled, err = poisoned((groups, dim), keys.dtype), error_slots()
    _launch(op, kernel_name(op, "", keys.dtype), [keys, cell_pos, group_cells, group_pos, weight, inv_freq, pooled,
                                                  err], p, **emu)
    if (k := _slot(err, 0)) is not None:
        g, i = divmod(k, r)
        raise HebrusError(f"hebrus::{op}: group {g} cell {i} = {int(group_cells[g, i])} is outside [0, {cells})")
    if (k := _slot(err, 1)) is not None:
        g, i = divmod(k, r)
        first = int(group_pos[g])
        required = (first + i + 2**63) % 2**64 - 2**63  # int64 arithmetic, as the glue's
        raise HoleError(f"hebrus::{op}: group {g} starting at position {first} has position "
                        f"{int(cell_pos[int(group_cells[g, i])])} in member {i} where {required} is required "
                        f"(a hole inside the run is not padding)")
    return pooled


# ---- qsa_select -------------------------------------------------------------------------------------

def qsa_select(q, pooled, seq_groups, q_row, q_groups, top_k, **emu):
    _validate.qsa_select(q, pooled, seq_groups, q_row, q_groups, top_k)
    op = "qsa_select"
    tq, hq, dim = q.shape
    batch, max_groups = seq_groups.shape
    if tq == 0:
        return torch.full((0, top_k), -1, dtype=torch.int32)
    if q.dtype != pooled.dtype:  # exact: every float dtype embeds in fp32
        q, pooled = q.float(), pooled.float()
    p = plan(op, tq, hq, dim, pooled.shape[0], batch, max_groups, top_k)
    q, pooled, seq_groups, q_row, q_groups = (t.contiguous() for t in (q, pooled, seq_groups, q_row, q_groups))
    out, err = poisoned((tq, top_k), torch.int32), error_slots()
    _launch(op, kernel_name(op, p.variant.decode(), q.dtype), [q, pooled, seq_groups, q_row, q_groups, out, err], p,
            **emu)
    if (t := _slot(err, 0)) is not None:
        raise HebrusError(f"hebrus::{op}: q_row[{t}] = {int(q_row[t])} is outside [0, B={batch})")
    if (t := _slot(err, 1)) is not None:
        raise HebrusError(f"hebrus::{op}: q_groups[{t}] = {int(q_groups[t])} is outside [0, maxG={max_groups}]")
    if (row := _slot(err, 2)) is not None:  # the glue reads the row back to name the entry
        needed = int(q_groups[q_row == row].max())
        entries = seq_groups[row, :needed].long()
        g = int(torch.nonzero((entries < 0) | (entries >= pooled.shape[0]))[0])
        raise HebrusError(f"hebrus::{op}: seq_groups[{row}, {g}] = {int(entries[g])} is outside "
                          f"[0, rows={pooled.shape[0]}); the first {needed} groups of row {row} "
                          f"are visible to its queries")
    return out


# ---- qsa_attention ----------------------------------------------------------------------------------

def qsa_attention(q, k, v, token_cells, scale, **emu):
    _validate.qsa_attention(q, k, v, token_cells, scale)
    op = "qsa_attention"
    tq, hq, dh = q.shape
    cells, hkv, dv = v.shape
    if tq == 0:
        return q.new_empty((0, hq, dv))
    if hq == 0 or dv == 0 or cells == 0:  # nothing to launch: the glue checks token_cells on the host
        reference.check_token_cells_values(token_cells, cells)
        return q.new_empty((tq, hq, dv))
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)  # views stay views: read through their strides
    p = plan(op, tq, hq, hkv, dh, dv, cells, token_cells.shape[1], k.stride(0), k.stride(1), v.stride(0), v.stride(1),
             float(scale))
    q, token_cells = q.contiguous(), token_cells.contiguous()
    out, err = poisoned((tq, hq, dv), q.dtype), error_slots()
    _launch(op, kernel_name(op, p.variant.decode(), q.dtype), [q, bound_view(k), bound_view(v), token_cells, out, err],
            p, **emu)
    width = token_cells.shape[1]
    if (e := _slot(err, 0)) is not None:
        t, i = divmod(e, width)
        raise HebrusError(f"hebrus::{op}: query {t} selects cell {int(token_cells[t, i])} (token_cells[{t}, {i}]), "
                          f"outside [0, cells={cells}); negative entries are padding")
    if (t := _slot(err, 1)) is not None:
        raise HebrusError(f"hebrus::{op}: query {t} selects no cell (every entry of token_cells[{t}] is "
                          f"negative padding); attention over an empty selection is undefined")
    return out
