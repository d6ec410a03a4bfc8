"""The hyper-connections of Qwen4Exp's decoder layers with fused hebrus ops (issue 37)."""

from .ops import hc_post_combine, hc_premix, hc_premix_quantized, hc_rms_norm
from .premix import hyper_premix, post_combine

__all__ = ["hc_rms_norm", "hc_premix", "hc_premix_quantized", "hc_post_combine", "hyper_premix", "post_combine"]
