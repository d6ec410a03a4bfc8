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
