"""Reports returned by the API: typed, read-only views of the JSON the CLI prints with ``--json``.

Each report class declares its fields (type checkers and IDEs see them); at run time
they are read from the report's data, ``to_dict()`` gives it all as plain data, and
``repr()`` shows what matters at a glance (the output, counts, the verdict).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

try:  # Python >= 3.8
    from typing import TypedDict
except ImportError:  # pragma: no cover
    TypedDict = dict  # type: ignore[misc,assignment]


class MergeWarning(TypedDict):
    """One warning of a merge: ``kind`` is ``unsafe_pickle``, ``non_finite``,
    ``overflow`` or ``merge``; ``tensor`` and ``file`` are None where they do not apply."""

    kind: str
    message: str
    tensor: Optional[str]
    file: Optional[str]


class UnsafeCall(TypedDict):
    """A call an input's pickle would make under ``torch.load`` (unshard ran none of it)."""

    callable: str
    route: str
    offset: int
    entry: str
    verdict: str
    path: str


class NonFiniteCounts(TypedDict):
    """NaN, inf and overflow counts of one written tensor."""

    tensor: str
    nan: int
    inf: int
    overflow: int


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

    def _summary(self) -> str:
        return ", ".join(self._data)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._summary()})"


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


class MergeReport(Report):
    """What a merge wrote, renamed, dropped, cast and took from the base."""

    output: str
    checkpoint_format: str
    checkpoint_key: Optional[str]
    notes: List[str]
    config_from: Optional[str]
    tensors_written: int
    from_checkpoint: int
    from_base: List[str]
    renamed: List[Tuple[str, str]]
    dropped: List[Tuple[str, str]]
    casts: List[Tuple[str, str, int]]
    warnings: List[MergeWarning]
    unsafe_calls: List[UnsafeCall]
    nonfinite: List[NonFiniteCounts]
    files: List[str]
    bytes_written: int
    verified: Optional[Dict[str, Any]]
    seconds: float

    def _summary(self) -> str:
        d = self._data
        return (
            f"output={d.get('output')!r}, {_count(d.get('tensors_written', 0), 'tensor')}, "
            f"{_count(len(d.get('files', [])), 'file')}, {d.get('bytes_written', 0)} bytes, "
            f"{_count(len(d.get('warnings', [])), 'warning')}"
        )


class PartReport(Report):
    """What one part of a split merge (``part="I/N"``) wrote, and whether it committed the output."""

    part: str
    output: str
    shards: List[str]
    total_shards: int
    committed: bool
    waiting_for: List[int]
    plan_hash: str
    staging: str

    def _summary(self) -> str:
        d = self._data
        return (
            f"part={d.get('part')!r}, output={d.get('output')!r}, "
            f"{len(d.get('shards', []))} of {d.get('total_shards')} shards, committed={d.get('committed')}"
        )


class VerifyReport(Report):
    """What ``verify`` checked; ``ok`` is True when the output holds the checkpoint."""

    ok: bool
    dir: str
    against: str
    files: List[str]
    tensors_compared: int
    bytes_compared: int
    files_checksummed: int
    problems: List[Any]
    mismatches: List[Any]
    summary: str
    from_manifest: List[str]
    overridden: List[str]
    checksums_skipped: Optional[str]

    def __bool__(self) -> bool:
        return bool(self._data.get("ok"))

    def _summary(self) -> str:
        d = self._data
        return (
            f"ok={d.get('ok')}, dir={d.get('dir')!r}, {_count(d.get('tensors_compared', 0), 'tensor')} compared, "
            f"{_count(len(d.get('problems', [])) + len(d.get('mismatches', [])), 'problem')}"
        )


class DiffReport(Report):
    """Tensor-by-tensor differences between two inputs; ``identical`` when there are none."""

    identical: bool
    a: Dict[str, Any]
    b: Dict[str, Any]
    only_a: List[str]
    only_b: List[str]
    tensors: List[Dict[str, Any]]

    def __bool__(self) -> bool:
        return bool(self._data.get("identical"))

    def _summary(self) -> str:
        d = self._data
        differing = sum(1 for t in d.get("tensors", []) if not t.get("identical"))
        return (
            f"identical={d.get('identical')}, {_count(len(d.get('tensors', [])), 'tensor')} compared, "
            f"{differing} differing, {len(d.get('only_a', []))} only in a, {len(d.get('only_b', []))} only in b"
        )


class InspectReport(Report):
    """What a checkpoint, safetensors file or model directory holds (``unshard inspect --json``)."""

    format: str
    path: str
    key: Optional[str]
    tensors: List[Dict[str, Any]]
    total_tensors: int
    total_parameters: int
    total_bytes: int
    dtypes: Dict[str, int]
    non_tensor: List[Dict[str, Any]]
    notes: List[str]
    unsafe: List[UnsafeCall]

    def _summary(self) -> str:
        d = self._data
        return (
            f"path={d.get('path')!r}, format={d.get('format')!r}, {_count(d.get('total_tensors', 0), 'tensor')}, "
            f"{d.get('total_parameters', 0)} parameters, {_count(len(d.get('unsafe', [])), 'unsafe call')}"
        )
