"""Reports returned by the API: read-only views of the JSON the CLI prints with ``--json``."""

from __future__ import annotations

import json
from typing import Any, Dict


class Report:
    """A report: its fields are attributes (``report.tensors``) and ``to_dict()`` gives them all."""

    __slots__ = ("_data",)

    def __init__(self, data: Dict[str, Any]):
        object.__setattr__(self, "_data", data)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._data[name]
        except KeyError:
            raise AttributeError(
                f"{type(self).__name__} has no field {name!r}; fields: {', '.join(self._data)}"
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __getitem__(self, name: str) -> Any:
        return self._data[name]

    def __contains__(self, name: object) -> bool:
        return name in self._data

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._data))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._data == self._data  # type: ignore[attr-defined]

    def to_dict(self) -> Dict[str, Any]:
        """The report as plain data (a deep copy)."""
        return json.loads(json.dumps(self._data))

    def __repr__(self) -> str:
        keys = ", ".join(self._data)
        return f"{type(self).__name__}({keys})"


class MergeReport(Report):
    """What a merge wrote, renamed, dropped, cast and took from the base."""


class PartReport(Report):
    """What one part of a split merge (``part="I/N"``) wrote, and whether it committed the output."""


class VerifyReport(Report):
    """What ``verify`` checked; ``ok`` is True when the output holds the checkpoint."""

    def __bool__(self) -> bool:
        return bool(self._data.get("ok"))


class DiffReport(Report):
    """Tensor-by-tensor differences between two inputs; ``identical`` when there are none."""

    def __bool__(self) -> bool:
        return bool(self._data.get("identical"))
