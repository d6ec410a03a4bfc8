"""The hyper-connections of Qwen4Exp's decoder layers with fused hebrus ops (issue 37)."""

from .ops import hc_rms_norm
from .premix import hyper_premix

__all__ = ["hc_rms_norm", "hyper_premix"]
