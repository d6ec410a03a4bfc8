"""The hebrus ops run through the Metal emulator, launched exactly as the MPS glue launches them.

Every decision of the glue (host checks, empty shapes, kernel name and variant, bound tensors in
order, error-buffer and parameter-block indices, parameter bytes, dispatch) is made by
``csrc/mps/hebrus_glue.h``, the header the ``.mm`` files call; :func:`glue` builds it for Linux
(``tests/metal/glue_abi.cpp``, called with DeviceType::CPU) and this module only runs the launches
it returns: tensors are bound as the glue's ``setArg(idx, tensor)`` binds them (the span of storage
from the tensor's first element, :func:`bound_view`), outputs the kernel writes start as poison (NaN
for floats, 0x7F7F... for integers) so an element the kernel forgets to write shows, and the error
buffer is one per emulated stream, as PyTorch's MPSStream has (``c10::metal::ErrorMessages``).
A buffer the glue marks ``in_place`` (a state pool the slot ops read and update) is the caller's
tensor itself, bound with its contents; like every buffer it is copied into guard-paged memory for
the launch and back, so an access past either end of the pool still stops the launch.

Errors, as on MPS: metadata errors raise from the glue before any launch (``HebrusError``); value
errors found by a kernel are written to the stream's error buffer and raised by :func:`synchronize`
as ``torch.AcceleratorError`` with the first message, like MPSStream::checkLastError. Each op
synchronizes before returning unless called with ``sync=False``.

Keyword arguments select the emulator's schedule (``sched``, ``seed``), the guard-page side
(``guard``), worker threads (``workers``) and the host compiler of the kernels (``cxx``, g++ by
default; clang++-19 also works); ``contract`` builds the kernels with -ffp-contract=off (default) or
fast.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

import msl_emu
from hebrus_torch import errors

KERNEL_DIR = msl_emu.KERNEL_DIR
CSRC = os.path.join(msl_emu.REPO, "csrc")
ERROR_MESSAGE_COUNT = 30
ERROR_MESSAGE_SIZE = 512  # c10::metal::ErrorMessage: file[128], func[128], message[250], 2 bytes padding, line


@functools.cache
def glue():
    """csrc/mps/hebrus_glue.h built for Linux (tests/metal/glue_abi.cpp), cached under build/metal_emu/."""
    from torch.utils import cpp_extension

    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "glue_abi.cpp")
    build = os.path.join(msl_emu.BUILD_DIR, "glue")
    os.makedirs(build, exist_ok=True)
    return cpp_extension.load(name="hebrus_glue_abi", sources=[src], build_directory=build,
                              extra_include_paths=[CSRC, os.path.join(CSRC, "mps"), KERNEL_DIR],
                              extra_cflags=["-O1", "-DHEBRUS_METAL_BFLOAT=1"], verbose=False)


class Stream:
    """The emulated MPS stream's error buffer (c10::metal::ErrorMessages: count, then 30 messages)."""

    def __init__(self):
        self.buffer = torch.zeros(glue().error_buffer_bytes(), dtype=torch.uint8)

    def count(self) -> int:
        return int(self.buffer[:4].view(torch.int32)[0])

    def messages(self) -> list[str]:
        out = []
        for i in range(min(self.count(), ERROR_MESSAGE_COUNT)):
            base = 4 + i * ERROR_MESSAGE_SIZE + 256
            raw = bytes(self.buffer[base:base + 250].tolist())
            out.append(raw.split(b"\0", 1)[0].decode())
        return out

    def check_last_error(self):
        """MPSStream::checkLastError: raise the first message and reset the count."""
        msgs = self.messages()
        self.last = msgs  # every message of the last synchronization (tests: the reference's is among them)
        self.buffer[:4] = 0
        if msgs:
            raise torch.AcceleratorError(msgs[0])


STREAM = Stream.__new__(Stream)
STREAM.buffer = None
STREAM.last = []
ASYNC_ERROR = torch.AcceleratorError  # what MPSStream raises at synchronization


def reported() -> list[str]:
    """Every message the kernels reported before the last synchronization that raised."""
    return list(STREAM.last)


def stream() -> Stream:
    if STREAM.buffer is None:
        STREAM.buffer = torch.zeros(glue().error_buffer_bytes(), dtype=torch.uint8)
    return STREAM


def synchronize():
    """torch.mps.synchronize(): raises the first value error a kernel reported since the last one."""
    stream().check_last_error()


# ---- the launch plans alone (plan_abi.cpp over mps_kernels/hebrus_launch.h) -------------------------

METAL_TYPE = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat", torch.int64: "long"}
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
        raise errors.HebrusError(f"hebrus::{op} on MPS: {out.error.decode()}")
    return out


def kernel_name(op: str, variant: str, dtype: torch.dtype) -> str:
    buf = ctypes.create_string_buffer(128)
    plan_library().hebrus_emu_kernel_name(op.encode(), variant.encode(), METAL_TYPE[dtype].encode(), buf, len(buf))
    return buf.value.decode()


@functools.cache


@functools.cache
def module(stem: str, cxx: str = "g++", contract: str = "off") -> msl_emu.Module:
    # -mfma: without it x86-64 has no FMA instruction and -ffp-contract=fast would change nothing.
    fma = ("-mfma",) if contract == "fast" and os.uname().machine == "x86_64" else ()
    # -O2: g++ contracts only from -O2 on (its widening_mul pass), so the =fast build is built there.
    return msl_emu.build(os.path.join(KERNEL_DIR, stem + ".metal"), cxx=cxx, opt="-O2" if contract == "fast" else "-O1",
                         extra=(f"-ffp-contract={contract}", *fma))


def poisoned(shape, dtype) -> torch.Tensor:
    return poison_(torch.empty(shape, dtype=dtype))


def poison_(t: torch.Tensor) -> torch.Tensor:
    if t.numel():
        t.view(torch.uint8).fill_(0xFF if t.dtype.is_floating_point else 0x7F)
    return t


# stem -> msl_emu.Module used instead of the built mps_kernels/<stem>.metal (mutation tests).
OVERRIDE: dict[str, msl_emu.Module] = {}


def run(op: str, *args, sync: bool = True, cxx: str = "g++", contract: str = "off", **emu):
    """Call the glue's hebrus::glue::<op> and run its launches; returns its outputs."""
    with errors.translated():
        launches, outputs = getattr(glue(), op)(*args)
    for launch in launches:
        if not launch["threads"]:
            continue
        for t, written, in_place in zip(launch["tensors"], launch["written"], launch["in_place"]):
            if written and not in_place:  # an in-place pool is an input too: its contents stay
                poison_(t)
        buffers = [bound_view(t) for t in launch["tensors"]]
        slots = {launch["error_index"]: stream().buffer, launch["params_index"]: launch["params"]}
        for i in sorted(slots):
            assert i == len(buffers), "the error buffer and the parameter block follow the tensors"
            buffers.append(slots[i])
        mod = OVERRIDE.get(launch["stem"]) or module(launch["stem"], cxx, contract)
        mod.dispatch(launch["kernel"], buffers, grid=(launch["threads"],), tg=(launch["group"],), **emu)
    if sync:
        synchronize()
    return outputs


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


# ---- the ops -----------------------------------------------------------------------------------------

def ple_conv(x, weight, cu_seqlens, state, dilation, activation, **emu):
    y, new_state = run("ple_conv", x, weight, cu_seqlens, state, dilation, activation, **emu)
    return y, new_state


def ple_ngram_ids(tokens, cu_seqlens, history, multipliers, vocab_sizes, offsets, eos, vocab, **emu):
    row_ids, new_history = run("ple_ngram_ids", tokens, cu_seqlens, history, multipliers, vocab_sizes, offsets, eos,
                               vocab, **emu)
    return row_ids, new_history


def ple_conv_slots(x, weight, cu_seqlens, state_pool, slots, dilation, activation, **emu):
    """hebrus::ple_conv_slots: returns y; state_pool's rows at slots are updated in place."""
    return run("ple_conv_slots", x, weight, cu_seqlens, state_pool, slots, dilation, activation, **emu)[0]


def ple_ngram_ids_slots(tokens, cu_seqlens, history_pool, slots, multipliers, vocab_sizes, offsets, eos, vocab,
                        **emu):
    """hebrus::ple_ngram_ids_slots: returns the row ids; history_pool's rows at slots are updated in place."""
    return run("ple_ngram_ids_slots", tokens, cu_seqlens, history_pool, slots, multipliers, vocab_sizes, offsets,
               eos, vocab, **emu)[0]


def qsa_pool(keys, cell_pos, group_cells, group_pos, norm_weight, eps, inv_freq, **emu):
    return run("qsa_pool", keys, cell_pos, group_cells, group_pos, norm_weight, float(eps), inv_freq, **emu)[0]


def qsa_select(q, pooled, seq_groups, q_row, q_groups, top_k, **emu):
    return run("qsa_select", q, pooled, seq_groups, q_row, q_groups, top_k, **emu)[0]


def qsa_attention(q, k, v, token_cells, scale, **emu):
    return run("qsa_attention", q, k, v, token_cells, float(scale), **emu)[0]


def qsa_token_cells(selected, nvis, first, cells, r, **emu):
    """hebrus::qsa_token_cells: returns (token_cells [Tq, W] int32, token_offsets [Tq, W] int64)."""
    out = run("qsa_token_cells", selected, nvis, first, cells, int(r), **emu)
    return out[0], out[1]


def rms_norm_rope(x, weight, eps, cos, sin, **emu):
    """hebrus::rms_norm_rope: returns out [T, H, D]."""
    return run("rms_norm_rope", x, weight, float(eps), cos, sin, **emu)[0]


def sigmoid_gate(x, gate, **emu):
    """hebrus::sigmoid_gate: returns out [T, H, D]."""
    return run("sigmoid_gate", x, gate, **emu)[0]


def gdn_delta_rule(q, k, v, g, beta, cu_seqlens, state, scale, use_qk_l2norm, **emu):
    """hebrus::gdn_delta_rule: returns out in v's dtype; state is updated in place (the glue's
    gdn_result: the fp32 output of a mixed-dtype call narrowed to v's dtype)."""
    out = run("gdn_delta_rule", q, k, v, g, beta, cu_seqlens, state, float(scale), bool(use_qk_l2norm), **emu)[0]
    return out if out.dtype == v.dtype else out.to(v.dtype)


def gdn_delta_rule_slots(q, k, v, g, beta, cu_seqlens, state_pool, slots, scale, use_qk_l2norm, **emu):
    """hebrus::gdn_delta_rule_slots: returns out; state_pool's rows at slots are updated in place."""
    out = run("gdn_delta_rule_slots", q, k, v, g, beta, cu_seqlens, state_pool, slots, float(scale),
              bool(use_qk_l2norm), **emu)[0]
    return out if out.dtype == v.dtype else out.to(v.dtype)



def gdn_chunk_delta_rule_slots(q, k, v, g, beta, cu_seqlens, start_pos, state_pool, slots, scale, use_qk_l2norm,
                               **emu):
    """hebrus::gdn_chunk_delta_rule_slots: returns out; state_pool's rows at slots are updated in place."""
    out = run("gdn_chunk_delta_rule_slots", q, k, v, g, beta, cu_seqlens, start_pos, state_pool, slots, float(scale),
              bool(use_qk_l2norm), **emu)[0]
    return out.to(v.dtype)  # hebrus_glue.h gdn_result: the fp32 output of mixed dtypes narrowed to v's


def moe_experts(x, topk_ids, topk_weights, gate_up, down, **emu):
    """hebrus::moe_experts: returns out [T, H]."""
    return run("moe_experts", x, topk_ids, topk_weights, gate_up, down, **emu)[0]


def moe_experts_quantized(x, topk_ids, topk_weights, gate_up_q, gate_up_scales, gate_up_biases, down_q, down_scales,
                          down_biases, group_size, bits, **emu):
    """hebrus::moe_experts_quantized: returns out [T, H]."""
    return run("moe_experts_quantized", x, topk_ids, topk_weights, gate_up_q, gate_up_scales, gate_up_biases, down_q,
               down_scales, down_biases, int(group_size), int(bits), **emu)[0]


def quantized_linear(x, wq, scales, biases, group_size, bits, **emu):
    """hebrus::quantized_linear: returns out [T, out]."""
    return run("quantized_linear", x, wq, scales, biases, int(group_size), int(bits), **emu)[0]


def hc_rms_norm(x, weight, group_size, eps, **emu):
    """hebrus::hc_rms_norm: returns out [T, D]."""
    return run("hc_rms_norm", x, weight, int(group_size), float(eps), **emu)[0]


def gdn_gates(a, b, A_log, dt_bias, **emu):
    """hebrus::gdn_gates: returns (g, beta), both float32 of a's shape."""
    g, beta = run("gdn_gates", a, b, A_log, dt_bias, **emu)
    return g, beta


def gdn_gated_rms_norm(x, gate, weight, eps, activation, **emu):
    """hebrus::gdn_gated_rms_norm: returns out of x's shape and dtype."""
    return run("gdn_gated_rms_norm", x, gate, weight, float(eps), str(activation), **emu)[0]


def hc_premix(h, norm_weight, down, up, inject, hc_count, eps, **emu):
    """hebrus::hc_premix: returns (mixed [T, hidden], weights [T, hc] or [T, 0])."""
    mixed, weights = run("hc_premix", h, norm_weight, down, up, inject, int(hc_count), float(eps), **emu)
    return mixed, weights


def hc_premix_quantized(h, norm_weight, down_q, down_scales, down_biases, up_q, up_scales, up_biases, inject_q,
                        inject_scales, inject_biases, hc_count, eps, group_size, bits, **emu):
    """hebrus::hc_premix_quantized: returns (mixed [T, hidden], weights [T, hc] or [T, 0])."""
    mixed, weights = run("hc_premix_quantized", h, norm_weight, down_q, down_scales, down_biases, up_q, up_scales,
                         up_biases, inject_q, inject_scales, inject_biases, int(hc_count), float(eps), int(group_size),
                         int(bits), **emu)
    return mixed, weights


def hc_post_combine(hyper, out, inject, **emu):
    """hebrus::hc_post_combine: returns [T, hc * hidden]."""
    return run("hc_post_combine", hyper, out, inject, **emu)[0]


def moe_route(router_logits, shared_gate_logits, top_k, norm_topk_prob, **emu):
    """hebrus::moe_route: returns (ids [T, k] int64, weights [T, k + S])."""
    ids, weights = run("moe_route", router_logits, shared_gate_logits, int(top_k), bool(norm_topk_prob), **emu)
    return ids, weights


def moe_shared_expert(x, routed, gate_proj, up_proj, down_proj, gate, **emu):
    """hebrus::moe_shared_expert: returns out [T, H]."""
    return run("moe_shared_expert", x, routed, gate_proj, up_proj, down_proj, gate, **emu)[0]


def moe_shared_expert_quantized(x, routed, gate_proj_q, gate_proj_scales, gate_proj_biases, up_proj_q, up_proj_scales,
                                up_proj_biases, down_proj_q, down_proj_scales, down_proj_biases, gate, group_size, bits,
                                **emu):
    """hebrus::moe_shared_expert_quantized: returns out [T, H]."""
    return run("moe_shared_expert_quantized", x, routed, gate_proj_q, gate_proj_scales, gate_proj_biases, up_proj_q,
               up_proj_scales, up_proj_biases, down_proj_q, down_proj_scales, down_proj_biases, gate, int(group_size),
               int(bits), **emu)[0]


def launches(op: str, *args):
    """The glue's launches of one call, without running them."""
    with errors.translated():
        return getattr(glue(), op)(*args)[0]
