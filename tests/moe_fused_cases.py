"""Cases shared by the CPU and the emulator tests of the MoE block's fused ops (issue 37): the bad metadata each
op must refuse with the CPU kernel's message, as functions of valid arguments."""

from __future__ import annotations

# moe_route(router_logits [3, 8], shared_gate_logits [3, 1], top_k): (args without norm_topk_prob, message)
ROUTE_BAD = [
    (lambda l, s: (l[0], s, 2), r"router_logits must be 2-D, got shape"),
    (lambda l, s: (l.long(), s, 2), "router_logits must have dtype"),
    (lambda l, s: (l, s.half(), 2), "shared_gate_logits dtype torch.float16 must match router_logits dtype"),
    (lambda l, s: (l, s[:2], 2), r"shared_gate_logits must have shape \(T, S\) with T = router_logits.shape\[0\] = 3"),
    (lambda l, s: (l, s[0], 2), "shared_gate_logits must be 2-D"),
    (lambda l, s: (l, s, 0), r"top_k must be in \[1, E = 8\], got 0"),
    (lambda l, s: (l, s, 9), r"top_k must be in \[1, E = 8\], got 9"),
]

# moe_shared_expert(x [3, 8], routed [3, 8], gate_proj [6, 8], up_proj [6, 8], down_proj [8, 6], gate [3, 1])
SHARED_BAD = [
    (lambda a: (a[0][0],) + a[1:], r"x must be 2-D, got shape"),
    (lambda a: (a[0].long(),) + a[1:], "x must have dtype"),
    (lambda a: (a[0], a[1].double()) + a[2:], "routed dtype torch.float64 must match x dtype"),
    (lambda a: a[:2] + (a[2][:, :-1],) + a[3:], r"gate_proj must have shape \(6, 8\), got \(6, 7\)"),
    (lambda a: a[:3] + (a[3][:5],) + a[4:], r"up_proj must have shape \(6, 8\), got \(5, 8\)"),
    (lambda a: a[:4] + (a[4].T.contiguous(),) + a[5:], r"down_proj must have shape \(8, 6\), got \(6, 8\)"),
    (lambda a: a[:5] + (a[5][:2],), r"gate must have shape \(3, 1\), got \(2, 1\)"),
    (lambda a: a[:2] + (a[2][:0], a[3][:0], a[4][:, :0]) + a[5:], "gate_proj must have I >= 1 rows"),
]


def quantized_shared_args(rows: int, hidden: int, inter: int, dtype, bits: int, group_size: int, seed: int = 0,
                          k: int = 3) -> tuple:
    """moe_shared_expert_quantized's arguments: x, routed [T, H]; gate_proj, up_proj [I, H] and down_proj [H, I]
    quantized by hebrus_torch.moe.quantize (codes, scales, biases each); the gate as moe_route returns it (column
    k of [T, k + 1]: a strided view); group_size, bits."""
    import torch

    from hebrus_torch.moe.quantize import quantize

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    routed = (torch.randn(rows, hidden, generator=g) * 0.5).to(dtype)
    weights = []
    for out_dim, in_dim in ((inter, hidden), (inter, hidden), (hidden, inter)):
        weights += quantize((torch.randn(out_dim, in_dim, generator=g) / in_dim ** 0.5).to(dtype), bits, group_size)
    gate = torch.rand(rows, k + 1, generator=g).to(dtype)[:, k:]
    return (x, routed, *weights, gate, group_size, bits)


# moe_shared_expert_quantized(x [3, 64], routed [3, 64], gate_proj / up_proj [32, 64] and down_proj [64, 32] at 4 bits
# in groups of 32, gate [3, 1], 32, 4): (a function of the valid arguments, message)
def _with(i, value):
    return lambda a: a[:i] + (value(a[i]),) + a[i + 1:]


SHARED_QUANT_BAD = [
    (_with(13, lambda b: 3), "bits must be 4 or 8, got 3"),
    (_with(12, lambda gs: 48), "group_size must be 32, 64 or 128, got 48"),
    (_with(0, lambda x: x[0]), r"x must be 2-D, got shape"),
    (_with(0, lambda x: x.long()), "x must have dtype"),
    (_with(2, lambda q: q.float()), "gate_proj_q must have dtype torch.int32"),
    (_with(7, lambda b: b.double()), "up_proj_biases dtype torch.float64 must match x dtype"),
    (_with(1, lambda r: r[:, :-1]), r"routed must have shape \(3, 64\), got \(3, 63\)"),
    (_with(5, lambda q: q[:16]), r"up_proj_q must have shape \(32, 8\), got \(16, 8\)"),
    (_with(9, lambda s: s[:, :0]), r"down_proj_scales must have shape \(64, 1\), got \(64, 0\)"),
    (_with(8, lambda q: q.T.contiguous()), r"down_proj_q must have shape \(64, 4\), got \(4, 64\)"),
    (_with(11, lambda g: g[:2]), r"gate must have shape \(3, 1\), got \(2, 1\)"),
    (_with(2, lambda q: q[:0]), "gate_proj_q must have I >= 1 rows"),
    (_with(2, lambda q: q[:16]), "I = gate_proj_q.shape\\[0\\] = 16 must be a multiple of group_size 32"),
    (_with(0, lambda x: x[:, :48]), "H = x.shape\\[1\\] = 48 must be a multiple of group_size 32"),
]
