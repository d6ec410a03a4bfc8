"""The gated delta rule over packed variable-length rows, in the recurrent (token-by-token) form:
the wrapper of ``hebrus::gdn_delta_rule`` (CPU kernel: csrc/cpu/gdn_kernels.cpp) and its reference.

transformers' chunked form (``torch_chunk_gated_delta_rule``: chunks of 64, zero padding, a triangular
solve per chunk) gives results that depend on where a stream was cut into steps. This form updates
each row's state one token at a time with elementwise products and sums over ``Dk`` only, vectorised
over the rows of a step: the arithmetic of a row is the same whatever other rows share the step and
however its tokens were cut (SPEC §5.1), so the state and outputs are bitwise chunk-invariant.
"""

from __future__ import annotations

import torch

from .. import _validate
from ..errors import HebrusError, translated
from ..state.host_mirror import host_ints

_OP = "hebrus_torch.gdn.gated_delta_rule"


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x*x) + eps)`` over the last dim (transformers' / FLA's l2norm), in x's dtype."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _check(cond: bool, what: str, prefix: str = _OP) -> None:
    if not cond:
        raise HebrusError(f"{prefix}: {what}")


def _check_inputs(prefix: str, tensors: dict[str, torch.Tensor]) -> tuple[int, int, int, int, int, int]:
    """The checks both ops share (csrc/gdn_checks.h, check_gdn_inputs: same order and messages); returns
    (T, Hk, Dk, Hv, Dv, B)."""
    for name, t in tensors.items():
        _check(isinstance(t, torch.Tensor), f"{name} must be a Tensor, got {type(t).__name__}", prefix)
    devices = {name: t.device for name, t in tensors.items()}
    _check(len(set(devices.values())) == 1, f"all tensors must be on one device, got "
                                            f"{ {n: str(d) for n, d in devices.items()} }", prefix)
    q, k, v, g, beta, cu_seqlens = (tensors[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens"))
    _check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3,
           f"q, k must be [T, Hk, Dk] and v [T, Hv, Dv], got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}",
           prefix)
    T, hk, dk = q.shape
    _, hv, dv = v.shape
    _check(tuple(k.shape) == (T, hk, dk), f"k must have q's shape {[T, hk, dk]}, got {list(k.shape)}", prefix)
    _check(v.shape[0] == T, f"v has {v.shape[0]} tokens, q has {T}", prefix)
    _check(hk >= 1 and dk >= 1 and hv >= 1 and dv >= 1 and hv % hk == 0,
           f"value heads ({hv}) must be a positive multiple of key heads ({hk})", prefix)
    for name, t in (("g", g), ("beta", beta)):
        _check(tuple(t.shape) == (T, hv), f"{name} must be [T, Hv] = {[T, hv]}, got {list(t.shape)}", prefix)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check(t.dtype in (torch.float32, torch.float16, torch.bfloat16),
               f"{name} must be float32, float16 or bfloat16, got {t.dtype}", prefix)
    _check(q.dtype == k.dtype, f"q and k must share a dtype, got {q.dtype} and {k.dtype}", prefix)
    _check(cu_seqlens.dim() == 1 and cu_seqlens.dtype == torch.int32 and cu_seqlens.shape[0] >= 1,
           f"cu_seqlens must be a 1-D int32 tensor of B+1 >= 1 entries, got {list(cu_seqlens.shape)} "
           f"{cu_seqlens.dtype}", prefix)
    return T, hk, dk, hv, dv, cu_seqlens.shape[0] - 1


def check_delta_rule_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          cu_seqlens: torch.Tensor, state: torch.Tensor) -> list[int]:
    """Metadata and cu_seqlens checks (host side, before any work); returns cu_seqlens as a list."""
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "cu_seqlens": cu_seqlens, "state": state}
    T, hk, dk, hv, dv, batch = _check_inputs(_OP, tensors)
    _check(tuple(state.shape) == (batch, hv, dk, dv) and state.dtype == torch.float32,
           f"state must be [B, Hv, Dk, Dv] = {[batch, hv, dk, dv]} float32, got {list(state.shape)} {state.dtype}")
    cu = host_ints(cu_seqlens)   # Batch.pack's host copy: no read back
    _check(cu[0] == 0 and cu[-1] == T and all(a <= b for a, b in zip(cu[:-1], cu[1:])),
           f"cu_seqlens must rise from 0 to T = {T} without decreasing, got {cu}")
    return cu


def check_delta_rule_slots_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                beta: torch.Tensor, cu_seqlens: torch.Tensor, state_pool: torch.Tensor,
                                slots: torch.Tensor) -> int:
    """Metadata of ``hebrus::gdn_delta_rule_slots`` (csrc/gdn_checks.h: same order and messages; no values
    read, so it runs on fake tensors too); returns S, the pool's slot count."""
    op = "gdn_delta_rule_slots"
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "cu_seqlens": cu_seqlens, "state_pool": state_pool,
               "slots": slots}
    T, hk, dk, hv, dv, batch = _check_inputs(f"hebrus::{op}", tensors)
    _validate._slots(slots, batch, op)
    _validate.check(state_pool.dim() == 4 and tuple(state_pool.shape[1:]) == (hv, dk, dv)
                    and state_pool.dtype == torch.float32, op,
                    f"state_pool must be a [S, Hv, Dk, Dv] = (S, {hv}, {dk}, {dv}) float32 tensor, got "
                    f"{tuple(state_pool.shape)} {state_pool.dtype}")
    _validate._pool_writable(op, state_pool, "state_pool",
                             {"q": q, "k": k, "v": v, "g": g, "beta": beta, "cu_seqlens": cu_seqlens, "slots": slots})
    return state_pool.shape[0]


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     cu_seqlens: torch.Tensor, state: torch.Tensor, *, use_qk_l2norm: bool = True,
                     scale: float | None = None, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule of packed rows from each row's recurrent state (``hebrus::gdn_delta_rule``).

    Per row and token t, in fp32 (q, k l2-normalised when ``use_qk_l2norm``, q scaled by ``scale``,
    default ``Dk ** -0.5``; q and k heads repeated ``Hv // Hk`` times, as transformers does)::

        S = S * exp(g_t)
        delta = (v_t - sum_dk(S * k_t)) * beta_t
        S = S + k_t (outer) delta
        out_t = sum_dk(S * q_t)

    Args:
        q, k: Tensor[T, Hk, Dk]; v: Tensor[T, Hv, Dv]; g, beta: Tensor[T, Hv] (g <= 0, log decay).
        cu_seqlens: Tensor[B+1] int32, row boundaries.
        state: Tensor[B, Hv, Dk, Dv] float32, each row's state before its tokens.
        inplace: update ``state`` (contiguous) in place and return it as new_state (else ``state`` is not
            touched).

    Returns:
        out: Tensor[T, Hv, Dv] in v's dtype; new_state: Tensor[B, Hv, Dk, Dv] float32 (a row of 0 tokens
        passes its state through).

    Runs the CPU kernel on CPU and the reference (:func:`recurrent_delta_rule`) elsewhere. Inference only
    (no autograd through the state updates).
    """
    check_delta_rule_args(q, k, v, g, beta, cu_seqlens, state)
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    if inplace and not state.is_contiguous():
        raise HebrusError(f"{_OP}: inplace needs a contiguous state")
    new_state = state if inplace else state.detach().clone(memory_format=torch.contiguous_format)
    with torch.no_grad(), translated():
        out = torch.ops.hebrus.gdn_delta_rule.default(q, k, v, g, beta, cu_seqlens, new_state, scale,
                                                      bool(use_qk_l2norm))
    return out, new_state


def gated_delta_rule_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           cu_seqlens: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor, *,
                           use_qk_l2norm: bool = True, scale: float | None = None) -> torch.Tensor:
    """:func:`gated_delta_rule` with row b's state read from and written back to ``state_pool[slots[b]]``
    in place (``hebrus::gdn_delta_rule_slots``); see :func:`hebrus_torch.reference.gdn_delta_rule_slots`.

    Shapes: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; cu_seqlens [B+1] int32; state_pool
    [S, Hv, Dk, Dv] float32 (contiguous, mutated: the rows of ``slots``, the others untouched); slots [B]
    int32 (distinct, in [0, S)) -> out [T, Hv, Dv] in v's dtype. Every check is the kernel's (a refused
    call writes nothing); on MPS the value checks (cu_seqlens, slots) are reported at the next
    synchronization. Inference only.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5 if isinstance(q, torch.Tensor) and q.dim() >= 1 and q.shape[-1] else 1.0
    with torch.no_grad(), translated():
        return torch.ops.hebrus.gdn_delta_rule_slots.default(q, k, v, g, beta, cu_seqlens, state_pool, slots,
                                                             float(scale), bool(use_qk_l2norm))


@torch.library.register_fake("hebrus::gdn_delta_rule_slots")
def _gdn_delta_rule_slots_fake(q, k, v, g, beta, cu_seqlens, state_pool, slots, scale, use_qk_l2norm):
    check_delta_rule_slots_args(q, k, v, g, beta, cu_seqlens, state_pool, slots)
    return v.new_empty(v.shape)


@torch.library.register_fake("hebrus::gdn_delta_rule")
def _gdn_delta_rule_fake(q, k, v, g, beta, cu_seqlens, state, scale, use_qk_l2norm):
    torch._check(q.dim() == 3 and v.dim() == 3, lambda: f"{_OP}: q must be [T, Hk, Dk] and v [T, Hv, Dv]")
    return v.new_empty(v.shape)


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         cu: list[int], state: torch.Tensor, use_qk_l2norm: bool, scale: float) -> torch.Tensor:
    """The reference of ``hebrus::gdn_delta_rule`` (checked arguments; ``cu``: cu_seqlens as a list):
    updates ``state`` in place and returns out [T, Hv, Dv] in v's dtype."""
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    T, hk, dk = q.shape
    hv, dv = v.shape[1:]
    out = torch.zeros((T, hv, dv), dtype=torch.float32, device=v.device)
    # Rows with tokens, longest first (stable): at token i the rows still running are a prefix of this order.
    rows = sorted((b for b in range(len(lengths)) if lengths[b]), key=lambda b: -lengths[b])
    if not rows:
        return out.to(v.dtype)
    with torch.no_grad():
        _run(q, k, v, g, beta, cu, lengths, rows, state, out, use_qk_l2norm, scale)
    return out.to(v.dtype)


def prepared_qk(q: torch.Tensor, k: torch.Tensor, value_heads: int, use_qk_l2norm: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q, k [T, Hv, Dk] as the rule reads them: l2-normalised when asked, q scaled, the Hk heads
    repeated ``Hv // Hk`` times (as transformers does)."""
    qf, kf = q.float(), k.float()
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = qf * scale
    if value_heads != q.shape[1]:
        qf = qf.repeat_interleave(value_heads // q.shape[1], dim=1)
        kf = kf.repeat_interleave(value_heads // q.shape[1], dim=1)
    return qf, kf


def _run(q, k, v, g, beta, cu, lengths, rows, new_state, out, use_qk_l2norm, scale) -> None:
    T, hk, dk = q.shape
    hv, dv = v.shape[1:]
    dev = q.device
    qf, kf = prepared_qk(q, k, hv, use_qk_l2norm, scale)
    decay = g.float().exp()

    R = len(rows)
    lens = [lengths[b] for b in rows]
    steps = lens[0]
    starts = torch.tensor([cu[b] for b in rows], dtype=torch.int64, device=dev)
    pos = torch.arange(steps, dtype=torch.int64, device=dev)[:, None]
    valid = pos < torch.tensor(lens, dtype=torch.int64, device=dev)[None, :]     # [steps, R]
    index = torch.where(valid, starts[None, :] + pos, 0)                          # packed token of (step, row)
    # Per step, laid out for the updates below (no per-step reshapes): [steps, R, Hv, Dk or 1, 1 or Dv].
    qs = qf[index][..., None].unbind(0)
    ks = kf[index][..., None].unbind(0)
    vs = v.float()[index][:, :, :, None, :].unbind(0)
    ds = decay[index][..., None, None].unbind(0)
    bs = beta.float()[index][..., None, None].unbind(0)
    outp = torch.empty((steps, R, hv, 1, dv), dtype=torch.float32, device=dev)
    os_ = outp.unbind(0)
    # active[i]: how many rows (a prefix) still have a token at step i.
    active, n = [], R
    for i in range(steps):
        while lens[n - 1] <= i:
            n -= 1
        active.append(n)

    in_order = rows == list(range(R))
    s_all = new_state[:R] if in_order else new_state.index_select(0, torch.tensor(rows, dtype=torch.int64, device=dev))
    buf = torch.empty_like(s_all)                      # [R, Hv, Dk, Dv]
    kv_all = torch.empty((R, hv, 1, dv), dtype=torch.float32, device=dev)
    # Elementwise products and sums over Dk only, each an op on whole tensors: a row's bits do not depend
    # on how many rows are active (the sums over dim -2 reduce each output in one fixed order).
    for i in range(steps):
        n = active[i]
        if n == R:
            s, b_, kv, q_t, k_t, v_t, d_t, beta_t, o_t = s_all, buf, kv_all, qs[i], ks[i], vs[i], ds[i], bs[i], os_[i]
        else:
            s, b_, kv = s_all[:n], buf[:n], kv_all[:n]
            q_t, k_t, v_t, d_t, beta_t, o_t = qs[i][:n], ks[i][:n], vs[i][:n], ds[i][:n], bs[i][:n], os_[i][:n]
        s.mul_(d_t)
        torch.mul(s, k_t, out=b_)
        torch.sum(b_, dim=-2, keepdim=True, out=kv)
        torch.sub(v_t, kv, out=kv)
        kv.mul_(beta_t)                                # delta
        torch.mul(k_t, kv, out=b_)
        s.add_(b_)
        torch.mul(s, q_t, out=b_)
        torch.sum(b_, dim=-2, keepdim=True, out=o_t)
    if not in_order:
        new_state.index_copy_(0, torch.tensor(rows, dtype=torch.int64, device=dev), s_all)
    out[index[valid]] = outp.squeeze(3)[valid]
