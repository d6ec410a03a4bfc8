"""Gated-delta-net (linear attention) state: conv tails and recurrent states per sequence slot (SPEC §8)."""

from .chunked import chunk_gated_delta_rule_slots
from .delta_rule import gated_delta_rule, gated_delta_rule_slots, l2norm
from .forward import gdn_forward
from .fused import gdn_gated_rms_norm, gdn_gates
from .state import GDNSnapshot, GDNState

__all__ = ["GDNState", "GDNSnapshot", "chunk_gated_delta_rule_slots", "gated_delta_rule", "gated_delta_rule_slots",
           "gdn_forward", "gdn_gated_rms_norm", "gdn_gates", "l2norm"]
