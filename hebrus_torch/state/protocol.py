"""One state-dict protocol for every state holder (PLEState, GDNState, QSACache, ModelCache, and new ones).

A holder's state dict comes from an untrusted file as easily as from ``state_dict()``: loading it
validates everything first and publishes in two steps, so nothing changes unless all of it is good.

    load_state_dict(sd, strict)      = known_entries -> _validate_state_dict -> _prepare_candidate
                                       -> _swap_state_dict
    check_state_dict(sd)             = _validate_state_dict (nothing changes)
    _prepare_state_dict(sd)          = _validate_state_dict -> _prepare_candidate (nothing published)
    publish_state_dict(sd)           = _prepare_state_dict -> _swap_state_dict

The three steps a holder implements:

* ``_validate_state_dict(sd) -> candidate``: every check of the untrusted entries (keys, format and
  version, config, entry types via :func:`hebrus_torch.state.blob.check_tensors` *before* any read of
  their bytes, shapes, dtypes, checksum, values, handle table), raising ``CorruptStateError``.
* ``_prepare_candidate(candidate) -> prepared``: the fallible work of publishing (allocations, moves to
  the holder's device, derived state) without publishing anything.
* ``_swap_state_dict(prepared)``: reference assignments only; it cannot fail.

A ModelCache loads its holders as one step: it calls each holder's ``check_state_dict`` and
``_prepare_state_dict`` on its part, and only then every ``_swap_state_dict``, so no holder is new while
another is old; afterwards torch's recursion reaches the holders' ``_load_from_state_dict``, which the
``_loaded_by_owner`` flag turns into a no-op.

Saving: a holder implements ``_state_tensors() -> dict[str, Tensor]`` (copies, refusing inside a
transaction when its state is staged) and ``_extra_state_for(tensors) -> dict`` (JSON-like: format,
version, config, a checksum of ``tensors``); the protocol's ``_save_to_state_dict`` writes both under
the module's prefix (``_extra_state`` last), and ``get_extra_state`` returns the metadata.

A holder that keeps each sequence in a slot of per-layer pools (PLEState, GDNState) subclasses
:class:`hebrus_torch.state.slot_pool.SlotPoolHolder`, which implements all of this over the pools it
names. Any other new holder subclasses ``StateDictProtocol`` before ``torch.nn.Module``::

    class NewState(StateDictProtocol, torch.nn.Module, Transactional):
        _STATE_OWNER = "NewState"
        def _state_keys(self): return {"conv", "recurrent", "generation", "live", "_extra_state"}
        def _state_tensors(self): ...
        def _extra_state_for(self, tensors): ...
        def _validate_state_dict(self, sd): ...; return candidate
        def _prepare_candidate(self, candidate): ...; return prepared
        def _swap_state_dict(self, prepared): ...
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..errors import CorruptStateError, HebrusError
from . import blob

__all__ = ["StateDictProtocol"]


class StateDictProtocol:
    """Mixin: ``load_state_dict``/``check_state_dict``/``publish_state_dict``, the nn.Module hooks and
    ``set_extra_state`` of a state holder, over the three steps it implements (see the module docstring).
    List it before ``torch.nn.Module`` among the bases, so that its methods override the Module's."""

    _STATE_OWNER = "holder"

    # ------------------------------------------------------------------ what a holder implements
    def _state_keys(self) -> set[str]:
        """The keys of this holder's state dict (``_extra_state`` included)."""
        raise NotImplementedError

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        """The state dict's tensors (copies)."""
        raise NotImplementedError

    def _extra_state_for(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The JSON-like ``_extra_state`` saved beside ``tensors``."""
        raise NotImplementedError

    def _validate_state_dict(self, state_dict: dict[str, Any]) -> Any:
        """Validate an untrusted state dict completely; return what ``_prepare_candidate`` needs."""
        raise NotImplementedError

    def _prepare_candidate(self, candidate: Any) -> Any:
        """The fallible part of publishing a validated candidate; publishes nothing."""
        return candidate

    def _swap_state_dict(self, prepared: Any) -> None:
        """Publish what ``_prepare_candidate`` built: reference assignments only, nothing that can fail."""
        raise NotImplementedError

    def _as_dict(self, state_dict: Any) -> dict[str, Any]:
        """The state dict as a plain dict (``CorruptStateError`` for anything else). A holder that cannot
        load inside a transaction refuses here."""
        if not isinstance(state_dict, Mapping):
            raise CorruptStateError(f"{self._STATE_OWNER}.load_state_dict: expected a dict, got "
                                    f"{type(state_dict).__name__}")
        return dict(state_dict)

    # ------------------------------------------------------------------ what the protocol provides
    def check_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Everything ``load_state_dict`` (strict) validates, without changing anything (CorruptStateError)."""
        self._validate_state_dict(self._as_dict(state_dict))

    def _prepare_state_dict(self, state_dict: Mapping[str, Any]) -> Any:
        """Validate a state dict and build everything its publish needs; publishes nothing."""
        return self._prepare_candidate(self._validate_state_dict(self._as_dict(state_dict)))

    def publish_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Publish a state dict that :meth:`check_state_dict` accepted (validated again; atomic)."""
        self._swap_state_dict(self._prepare_state_dict(state_dict))

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Load a whole-holder state dict, validated completely before anything is published; else
        ``CorruptStateError`` and nothing changes.

        Keys this holder does not save are refused with ``strict=True``; ``strict=False`` leaves them out
        and returns them as ``unexpected_keys``. No key may be missing either way."""
        sd, unexpected = blob.known_entries(f"{self._STATE_OWNER}.load_state_dict", self._as_dict(state_dict),
                                            self._state_keys(), strict)
        self._swap_state_dict(self._prepare_candidate(self._validate_state_dict(sd)))
        return torch.nn.modules.module._IncompatibleKeys([], unexpected)

    def get_extra_state(self) -> dict[str, Any]:
        """JSON-like metadata saved under ``_extra_state``."""
        return self._extra_state_for(self._state_tensors())

    def set_extra_state(self, state: Any) -> None:
        raise HebrusError(f"{self._STATE_OWNER}: load the whole holder with load_state_dict")

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: D401 (nn.Module hook)
        tensors = self._state_tensors()
        for name, t in tensors.items():
            destination[prefix + name] = t
        destination[prefix + "_extra_state"] = self._extra_state_for(tensors)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Loaded as part of a parent module: the same validated, all-or-nothing load (unless a ModelCache
        # over this holder has just loaded it, with everything else, as one step). torch passes strict=True
        # here whatever its caller asked for: keys under our prefix are checked strictly.
        if self.__dict__.pop("_loaded_by_owner", False):
            return
        self.load_state_dict({k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)},
                             strict=True)
