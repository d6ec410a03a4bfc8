"""The gated delta rule in the chunked (WY) form, aligned to absolute positions: the reference of
``hebrus::gdn_chunk_delta_rule_slots``.

The recurrent form (:mod:`.delta_rule`) costs ``~3 Dk Dv`` dependent multiply-adds per token and head
and runs one token after another. The chunked form (Yang et al., "Gated Delta Networks";
flash-linear-attention's ``chunk_gated_delta_rule``; transformers' ``torch_chunk_gated_delta_rule``)
processes C = 64 tokens at once with small matrix products, which is what a prefill wants.

**Alignment.** Its rounding differs from the recurrent form's, so to keep a sequence's results a
function of its tokens alone (SPEC §5.1), chunks are fixed by *absolute* position: the chunk of
position p is ``[C*floor(p/C), C*floor(p/C) + C)``. Within one call, a row's tokens at positions
``start_pos[b] + i`` fall into pieces: the part of a chunk the call covers whole runs the chunked
form; the part of a chunk the call covers only partly (a row that starts or ends inside a chunk)
runs the recurrent form, with exactly the arithmetic of ``gdn_delta_rule``. A caller that cuts a
stream only at multiples of C (and at its end) therefore gets the same bits however it cut.

**One chunk** (per value head, fp32; q, k l2-normalised when asked, q scaled, GQA heads repeated,
state S [Dk, Dv] at the chunk's start; G_i = g_0 + ... + g_i in order)::

    L[i, j]  = (beta_i k_i . k_j) exp(G_i - G_j)      for j < i, else 0
    T        = (I + L)^-1                              (unit lower triangular)
    U        = T (beta * V)                           [C, Dv]
    W        = T (beta * exp(G) * K)                  [C, Dk]
    V'       = U - W S                                (the chunk's "new values")
    A[i, j]  = (q_i . k_j) exp(G_i - G_j)             for j <= i, else 0
    O        = (exp(G) * Q) S + A V'
    S       <- exp(G_last) S + (exp(G_last - G) * K)^T V'

This equals the recurrent rule in exact arithmetic; in fp32 the two differ by rounding (measured in
tests/test_gdn_chunked.py).
"""

from __future__ import annotations

import torch

from .. import _validate
from ..errors import translated
from .delta_rule import prepared_qk, recurrent_delta_rule

CHUNK = 64


def row_pieces(start: int, length: int, chunk: int = CHUNK) -> list[tuple[int, int, bool]]:
    """Split one row's tokens (positions ``[start, start + length)``) into ``(offset, n, chunked)``
    pieces in order: whole aligned chunks are chunked, the partial chunks at either end are not."""
    pieces: list[tuple[int, int, bool]] = []
    p, end = start, start + length
    while p < end:
        chunk_end = (p // chunk + 1) * chunk
        n = min(chunk_end, end) - p
        pieces.append((p - start, n, p % chunk == 0 and n == chunk))
        p += n
    return pieces


def _prepare(q, k, v, g, beta, use_qk_l2norm: bool, scale: float):
    """fp32 q, k (as :func:`.delta_rule.prepared_qk`), v, g, beta."""
    qf, kf = prepared_qk(q, k, v.shape[1], use_qk_l2norm, scale)
    return qf, kf, v.float(), g.float(), beta.float()


def chunk_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> torch.Tensor:
    """One whole chunk for a batch of (row, head) items, all fp32 and already prepared.

    Shapes: q, k [N, C, Dk]; v [N, C, Dv]; g, beta [N, C]; state [N, Dk, Dv] (updated in place).
    Returns out [N, C, Dv].
    """
    C = q.shape[1]
    G = torch.cumsum(g, dim=1)                                        # [N, C]
    diff = G[:, :, None] - G[:, None, :]                              # G_i - G_j
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = lower.clone().fill_diagonal_(False)
    decay = torch.where(lower, diff, torch.zeros((), device=q.device)).exp() * lower
    kb = k * beta[..., None]
    L = (kb @ k.transpose(1, 2)) * decay * strict
    eye = torch.eye(C, dtype=q.dtype, device=q.device).expand_as(L)
    T = torch.linalg.solve_triangular(eye + L, eye, upper=False, unitriangular=True)
    U = T @ (v * beta[..., None])
    W = T @ (kb * G.exp()[..., None])
    v_new = U - W @ state
    A = (q @ k.transpose(1, 2)) * decay
    out = (q * G.exp()[..., None]) @ state + A @ v_new
    last = G[:, -1]
    state.mul_(last.exp()[:, None, None])
    state.add_((k * (last[:, None] - G).exp()[..., None]).transpose(1, 2) @ v_new)
    return out


def chunk_delta_rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, cu: list[int], start_pos: list[int], state_pool: torch.Tensor,
                               slots: list[int], use_qk_l2norm: bool, scale: float,
                               chunk: int = CHUNK) -> torch.Tensor:
    """Reference of ``hebrus::gdn_chunk_delta_rule_slots`` (checked arguments, host lists).

    Shapes: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; ``cu`` the B+1 row boundaries;
    ``start_pos[b]`` the absolute position of row b's first token; ``state_pool`` [S, Hv, Dk, Dv]
    float32, row b's state at ``slots[b]`` (updated in place). Returns out [T, Hv, Dv] in v's dtype.

    Per row the pieces of :func:`row_pieces` run in order; each phase (the leading partial chunk,
    then the i-th whole chunk of every row, then the trailing partial chunk) is batched over rows.
    """
    T, hv, dv = v.shape
    dk = q.shape[2]
    dev = v.device
    out = torch.zeros((T, hv, dv), dtype=torch.float32, device=dev)
    B = len(cu) - 1
    pieces = [row_pieces(start_pos[b], cu[b + 1] - cu[b], chunk) for b in range(B)]
    with torch.no_grad():
        states = state_pool[torch.tensor(slots, dtype=torch.long, device=dev)] if B else state_pool[:0]
        qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, use_qk_l2norm, scale)

        def recurrent_phase(select) -> None:
            rows, idx, sub_cu = [], [], [0]
            for b in range(B):
                piece = select(pieces[b])
                if piece is None:
                    continue
                off, n, _ = piece
                rows.append(b)
                idx.extend(range(cu[b] + off, cu[b] + off + n))
                sub_cu.append(sub_cu[-1] + n)
            if not rows:
                return
            ix = torch.tensor(idx, dtype=torch.long, device=dev)
            rix = torch.tensor(rows, dtype=torch.long, device=dev)
            sub_state = states[rix].contiguous()
            o = recurrent_delta_rule(q[ix], k[ix], v[ix], g[ix], beta[ix], sub_cu, sub_state, use_qk_l2norm, scale)
            states[rix] = sub_state
            out[ix] = o.float()

        def head(ps):
            return ps[0] if ps and not ps[0][2] else None

        def tail(ps):
            return ps[-1] if len(ps) > 1 and not ps[-1][2] else None

        recurrent_phase(head)
        whole = [[p for p in ps if p[2]] for ps in pieces]
        for i in range(max((len(w) for w in whole), default=0)):
            rows = [b for b in range(B) if i < len(whole[b])]
            firsts = [cu[b] + whole[b][i][0] for b in rows]
            ix = (torch.tensor(firsts, dtype=torch.long, device=dev)[:, None]
                  + torch.arange(chunk, device=dev)[None, :])                       # [R, C]
            rix = torch.tensor(rows, dtype=torch.long, device=dev)
            R = len(rows)

            def heads_first(x):          # [R, C, Hv, D] -> [R*Hv, C, D]
                return x.transpose(1, 2).reshape(R * hv, chunk, *x.shape[3:])

            st = states[rix].reshape(R * hv, dk, dv)
            o = chunk_step(heads_first(qf[ix]), heads_first(kf[ix]), heads_first(vf[ix]),
                           heads_first(gf[ix][..., None]).squeeze(-1), heads_first(bf[ix][..., None]).squeeze(-1), st)
            states[rix] = st.reshape(R, hv, dk, dv)
            out[ix] = o.reshape(R, hv, chunk, dv).transpose(1, 2)
        recurrent_phase(tail)
        if B:
            state_pool[torch.tensor(slots, dtype=torch.long, device=dev)] = states
    return out.to(v.dtype)


def chunk_gated_delta_rule_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, cu_seqlens: torch.Tensor, start_pos: torch.Tensor,
                                 state_pool: torch.Tensor, slots: torch.Tensor, *, use_qk_l2norm: bool = True,
                                 scale: float | None = None) -> torch.Tensor:
    """The gated delta rule of packed rows in the chunked form (``hebrus::gdn_chunk_delta_rule_slots``).

    Row b's tokens are at absolute positions ``start_pos[b] + i``; the whole aligned chunks of
    :data:`CHUNK` positions they cover run the WY form, the partial chunks at the row's ends the
    recurrent form with exactly ``gated_delta_rule``'s arithmetic (see the module docstring). Row b's
    state is read from and written back to ``state_pool[slots[b]]`` in place.

    Args:
        q, k: Tensor[T, Hk, Dk]; v: Tensor[T, Hv, Dv]; g, beta: Tensor[T, Hv] (float32, float16 or bfloat16;
            q and k one dtype).
        cu_seqlens: Tensor[B+1] int32, row boundaries.
        start_pos: Tensor[B] int64 (>= 0), the absolute position of each row's first token.
        state_pool: Tensor[S, Hv, Dk, Dv] float32, contiguous (mutated: the rows of ``slots``).
        slots: Tensor[B] int32, distinct, in [0, S).
        scale: query scale, default ``Dk ** -0.5``.

    Returns:
        out: Tensor[T, Hv, Dv] in v's dtype. Every check runs before anything is written. Inference only.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5 if isinstance(q, torch.Tensor) and q.dim() >= 1 and q.shape[-1] else 1.0
    with torch.no_grad(), translated():
        return torch.ops.hebrus.gdn_chunk_delta_rule_slots.default(q, k, v, g, beta, cu_seqlens, start_pos,
                                                                   state_pool, slots, float(scale),
                                                                   bool(use_qk_l2norm))


@torch.library.register_fake("hebrus::gdn_chunk_delta_rule_slots")
def _gdn_chunk_delta_rule_slots_fake(q, k, v, g, beta, cu_seqlens, start_pos, state_pool, slots, scale,
                                     use_qk_l2norm):
    _validate.gdn_chunk_delta_rule_slots(q, k, v, g, beta, cu_seqlens, start_pos, state_pool, slots)
    return v.new_empty(v.shape)
