"""What every part of the Qwen4Exp drop-in shares: the attribute names it stores on patched modules,
the marker of a method that was not in an instance ``__dict__``, and the lazy import of transformers."""

from __future__ import annotations

_PATCH = "_hebrus_patch"             # per patched module: what to restore
_CTX = "_hebrus_ctx"                 # per text model: the shared call context


_MODELING = None


def _modeling():
    """transformers' Qwen4Exp modeling module (imported on first use: importing hebrus_torch does not need it)."""
    global _MODELING
    if _MODELING is not None:            # (kept: the packed forward asks several times per layer and step)
        return _MODELING
    try:
        from transformers.models.qwen4_exp import modeling_qwen4_exp
    except ImportError as exc:
        raise ImportError("hebrus_torch.integrations.transformers needs transformers with Qwen4Exp "
                          "(transformers==5.23.0: pip install -e .[hf])") from exc
    _MODELING = modeling_qwen4_exp
    return modeling_qwen4_exp


class _Missing:
    """Marks a method that was not in the instance ``__dict__`` before :func:`apply`; one object, which a
    deep copy or a pickle of a patched model keeps (``revert`` tests it by identity)."""

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return "_MISSING"

    def __repr__(self) -> str:
        return "_MISSING"


_MISSING = _Missing()
