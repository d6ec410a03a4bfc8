"""The quantizing converter (issue 36, docs/quantization.md): ``python -m hebrus_torch.convert SRC DST --bits
{4,8} --group-size {32,64,128}``. ``rules`` (which weights are quantized), ``writer`` (sharded safetensors
written tensor by tensor), ``core`` (:func:`convert`), ``model`` (:func:`quantize_model`, the same quantization
in memory), ``__main__`` (the command line)."""

from .core import DEFAULT_MAX_SHARD_BYTES, QUANT_METHOD, ConvertError, convert
from .model import quantize_model

__all__ = ["convert", "quantize_model", "ConvertError", "QUANT_METHOD", "DEFAULT_MAX_SHARD_BYTES"]
