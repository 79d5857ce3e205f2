"""Exceptions raised by unshard's Python API.

Every error carries the message the CLI would print (``str(e)`` / ``e.message``),
the hint (``e.hint``, or ``None``) and a machine-readable ``e.kind``. Catch
:class:`UnshardError` for any of them, or a subclass for one kind.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Type


class UnshardError(Exception):
    """Any error unshard reports: bad input, a failed check, an unwritable output."""

    kind: str = "error"

    def __init__(self, message: str, hint: Optional[str] = None, kind: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        if kind is not None:
            self.kind = kind

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\nhint: {self.hint}"
        return self.message


class UnreadableCheckpoint(UnshardError):
    """The input cannot be read: missing, corrupt, an unknown format, or incomplete."""


class WrongInput(UnreadableCheckpoint):
    """The path is a part of a checkpoint (a ``.metadata`` file, one rank's file) or the
    folder around one, not the checkpoint itself; the hint names what to pass."""


class PlanError(UnshardError):
    """The merge cannot be done as asked: the base cannot be found (a path that does
    not exist, a Hub id not in the local cache), there is no config.json to write (pass
    ``base=``, or ``weights_only=True``), or the checkpoint does not fit the base."""


class AdapterError(UnshardError):
    """A LoRA/DoRA adapter cannot be fused as the keywords stand (``adapter=``,
    ``adapter_config=``, ``base=``, ``no_fuse=``); the hint says which to change."""


class UnknownTensor(UnshardError):
    """Checkpoint tensors that the base model does not have."""


class ShapeMismatch(UnshardError):
    """A checkpoint tensor's shape differs from the base's (or the config's)."""


class DuplicateName(UnshardError):
    """Two tensors end up with the same output name (after renames)."""


class DtypeOverflow(UnshardError):
    """Casting to the output dtype would turn finite values into inf."""


class StrictMismatch(UnshardError):
    """``strict=True`` and the base has tensors the checkpoint lacks."""


class NonFinite(UnshardError):
    """``fail_on_nonfinite=True`` and a tensor holds NaN or inf."""


class OutputExists(UnshardError):
    """The output exists and is not empty, and ``force`` was not given."""


class OutputError(UnshardError):
    """The output cannot be written (permissions, full disk, overlaps an input)."""


class VerificationFailed(UnshardError):
    """The output does not hold what the checkpoint gives."""


class InvalidOption(UnshardError, ValueError):
    """An option's value is not valid (a bad size, dtype or rename pattern)."""


class Cancelled(UnshardError):
    """The work was cancelled."""


class UnsafePickle(UnshardError):
    """``refuse_unsafe=True`` (or ``strict=True``) and an input's pickle would run code
    under ``torch.load`` (unshard ran none of it)."""


class UnshardWarning(UserWarning):
    """A warning from unshard about a merge's inputs or output (also in ``report.warnings``)."""


class UnsafePickleWarning(UnshardWarning):
    """An input's pickle would run code under ``torch.load`` (unshard ran none of it);
    the message names each call."""


_WARNING_BY_KIND: Dict[str, Type[UnshardWarning]] = {
    "unsafe_pickle": UnsafePickleWarning,
}


_BY_KIND: Dict[str, Type[UnshardError]] = {
    "unreadable_checkpoint": UnreadableCheckpoint,
    "unknown_tensor": UnknownTensor,
    "shape_mismatch": ShapeMismatch,
    "duplicate_name": DuplicateName,
    "overflow": DtypeOverflow,
    "strict": StrictMismatch,
    "non_finite": NonFinite,
    "output_exists": OutputExists,
    "output": OutputError,
    "verification_failed": VerificationFailed,
    "usage": InvalidOption,
    "cancelled": Cancelled,
    "unsafe_pickle": UnsafePickle,
    "wrong_input": WrongInput,
    "plan": PlanError,
    "adapter": AdapterError,
}


def _from_native(kind: str, message: str, hint: Optional[str]) -> UnshardError:
    """The exception for an error the extension module reported."""
    cls = _BY_KIND.get(kind, UnshardError)
    return cls(message, hint, kind)


def _emit_warnings(report_warnings: List[Dict[str, Any]], stacklevel: int) -> None:
    """Emits each of a report's warnings with :mod:`warnings` (the same words the CLI prints)."""
    for w in report_warnings:
        category = _WARNING_BY_KIND.get(w.get("kind", ""), UnshardWarning)
        warnings.warn(w["message"], category, stacklevel=stacklevel + 1)
