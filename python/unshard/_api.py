"""The Python API: thin wrappers over the extension module.

Work runs in Rust with the GIL released. The calling thread wakes a few times a
second to deliver progress and to notice Ctrl-C: ``KeyboardInterrupt`` cancels the
running job, which removes everything it staged, and is then raised as usual.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable, Dict, Iterable, Optional, Union

from . import _unshard as _native
from ._errors import _emit_warnings, _from_native
from ._reports import DiffReport, InspectReport, MergeReport, PartReport, VerifyReport

PathLike = Union[str, "os.PathLike[str]"]
ProgressArg = Union[bool, Callable[[int, int], Any], None]


def _path(p: PathLike, what: str) -> str:
    try:
        return os.fspath(p)
    except TypeError:
        raise TypeError(f"{what} must be a str or os.PathLike, not {type(p).__name__}") from None


class _TqdmProgress:
    """Feeds a tqdm bar (created on the first report, when the total is known)."""

    def __init__(self, tqdm_cls: Any, desc: str):
        self._cls = tqdm_cls
        self._desc = desc
        self._bar: Any = None

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            self._bar = self._cls(
                total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=self._desc
            )
        if self._bar.total != total:
            self._bar.total = total
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


class _LineProgress:
    """Plain lines on stderr, one per tenth of the work (and the last): for logs and
    notebooks, where a bar redrawn in place would print a line per update."""

    def __init__(self, desc: str, stream: Any):
        self._desc = desc
        self._stream = stream
        self._next = 0
        self._started = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if total <= 0:
            return
        pct = min(100, done * 100 // total)
        if pct < self._next:
            return
        self._next = pct // 10 * 10 + 10
        secs = time.monotonic() - self._started
        print(f"unshard: {self._desc} {pct}% ({_human(done)} of {_human(total)}, {secs:.0f} s)",
              file=self._stream, flush=True)

    def close(self) -> None:
        pass


class _TtyBar:
    """A bar redrawn in place on a terminal's stderr."""

    WIDTH = 30

    def __init__(self, desc: str, stream: Any):
        self._desc = desc
        self._stream = stream
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        if total <= 0:
            return
        frac = min(1.0, done / total)
        fill = int(frac * self.WIDTH)
        bar = "#" * fill + "-" * (self.WIDTH - fill)
        self._stream.write(f"\r{self._desc} [{bar}] {frac * 100:3.0f}% {_human(done)}/{_human(total)}")
        self._stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self._stream.write("\n")
            self._stream.flush()


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _progress_callback(progress: ProgressArg, desc: str) -> Optional[Callable[[int, int], Any]]:
    if progress is None or progress is False:
        return None
    if progress is True:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            stream = sys.stderr
            if stream is None:
                return None
            return _TtyBar(desc, stream) if _is_tty(stream) else _LineProgress(desc, stream)
        return _TqdmProgress(tqdm, desc)
    if callable(progress):
        return progress
    raise TypeError("progress must be True, False, None or a callable(done_bytes, total_bytes)")


def _run(fn: Callable[..., str], *args: Any, progress: ProgressArg = False, desc: str = "unshard") -> Dict[str, Any]:
    callback = _progress_callback(progress, desc)
    try:
        out = fn(*args, callback)
    except _native.NativeError as e:
        kind, message, hint = e.args
        raise _from_native(kind, message, hint) from None
    finally:
        close = getattr(callback, "close", None)
        if close is not None:
            close()
    return json.loads(out)


def _merge_options(
    base: Optional[PathLike],
    dtype: str,
    max_shard_size: Union[str, int],
    strict: bool,
    key: Optional[str],
    tag: Optional[str],
    rename: Iterable[str],
    force: bool,
    allow_overflow: bool,
    verify: bool,
    fail_on_nonfinite: bool,
    adapter: Optional[str] = None,
    adapter_config: Optional[PathLike] = None,
    no_fuse: bool = False,
    no_manifest: bool = False,
    weights_only: bool = False,
    refuse_unsafe: bool = False,
    part: Optional[str] = None,
    layout: Optional[str] = None,
) -> str:
    if isinstance(rename, str):
        rename = [rename]
    return json.dumps(
        {
            "base": None if base is None else _path(base, "base"),
            "dtype": str(dtype),
            "max_shard_size": str(max_shard_size),
            "strict": bool(strict),
            "key": key,
            "tag": tag,
            "rename": [str(r) for r in rename],
            "force": bool(force),
            "allow_overflow": bool(allow_overflow),
            "verify": bool(verify),
            "fail_on_nonfinite": bool(fail_on_nonfinite),
            "adapter": adapter,
            "adapter_config": None if adapter_config is None else _path(adapter_config, "adapter_config"),
            "no_fuse": bool(no_fuse),
            "no_manifest": bool(no_manifest),
            "weights_only": bool(weights_only),
            "refuse_unsafe": bool(refuse_unsafe),
            "part": None if part is None else str(part),
            "layout": None if layout is None else str(layout),
        }
    )


def merge(
    checkpoint: PathLike,
    output: PathLike,
    *,
    base: Optional[PathLike] = None,
    dtype: str = "auto",
    max_shard_size: Union[str, int] = "5GB",
    strict: bool = False,
    key: Optional[str] = None,
    tag: Optional[str] = None,
    rename: Iterable[str] = (),
    force: bool = False,
    allow_overflow: bool = False,
    verify: bool = False,
    fail_on_nonfinite: bool = False,
    adapter: Optional[str] = None,
    adapter_config: Optional[PathLike] = None,
    no_fuse: bool = False,
    no_manifest: bool = False,
    weights_only: bool = False,
    refuse_unsafe: bool = False,
    part: Optional[str] = None,
    layout: Optional[str] = None,
    progress: ProgressArg = True,
) -> Union[MergeReport, PartReport]:
    """Merge a training checkpoint (onto a base model) into a Hugging Face model directory.

    Same job and options as ``unshard merge``: ``checkpoint`` is a torch.save file, a
    torch.distributed.checkpoint directory, a directory of per-rank files (or any other
    input the CLI reads, DeepSpeed ZeRO folders too: ``tag`` picks a tag other than
    ``latest``'s); ``base`` the Hugging Face directory training started from.
    The output appears complete or not at all. ``progress`` is True (a tqdm bar when
    tqdm is installed; else a bar on a terminal's stderr, or a line per tenth of the
    work where stderr is not a terminal: logs, notebooks), False, or a callable
    ``progress(done_bytes, total_bytes)``.

    A LoRA/DoRA adapter (a peft adapter directory, or a training checkpoint of a
    peft-wrapped model) is fused into ``base``; ``adapter`` picks one of several named
    adapters, ``adapter_config`` gives the ``adapter_config.json`` when it is not
    beside the checkpoint, and ``no_fuse=True`` keeps the base weights and writes the
    adapter beside them. ``no_manifest=True`` leaves out ``unshard.json`` (what the
    merge did: inputs, options, each file's checksum). With no config.json to write (no
    ``base`` and none beside the checkpoint) the merge is refused, as transformers could
    not load its output, unless ``weights_only=True``.

    Warnings (a pickle that would run code under ``torch.load``, NaN or inf values,
    no tokenizer, ...) are emitted with :mod:`warnings` (:class:`UnshardWarning`,
    :class:`UnsafePickleWarning`) and kept in ``report.warnings``, each with its
    ``kind``, ``message``, ``tensor`` and ``file``. ``refuse_unsafe=True`` (or
    ``strict=True``) refuses such a pickle instead, raising :class:`UnsafePickle`.

    ``layout="packed"`` writes a mixture-of-experts model's expert tensors as
    transformers holds them in memory (``model.state_dict()``: each layer's experts
    stacked in one tensor per projection), ``layout="original"`` one tensor per expert as
    ``save_pretrained`` writes them; by default, as the base's files hold them.

    ``part="I/N"`` (or ``"auto"``, from torchrun's or Slurm's environment) writes only
    part I of N of the shards, for a merge split over processes sharing the output's
    filesystem; the last part to finish commits the output. It returns a
    :class:`PartReport`.

    Returns a :class:`MergeReport`; raises :class:`UnshardError` subclasses.
    """
    opts = _merge_options(
        base, dtype, max_shard_size, strict, key, tag, rename, force, allow_overflow, verify, fail_on_nonfinite,
        adapter, adapter_config, no_fuse, no_manifest, weights_only, refuse_unsafe, part, layout,
    )
    data = _run(
        _native.merge,
        _path(checkpoint, "checkpoint"),
        _path(output, "output"),
        opts,
        progress=progress,
        desc="merging",
    )
    if part is not None:
        return PartReport(data)
    _emit_warnings(data.get("warnings", []), stacklevel=2)
    return MergeReport(data)


def inspect(
    path: PathLike, *, key: Optional[str] = None, tag: Optional[str] = None, stats: bool = False
) -> InspectReport:
    """What a checkpoint, safetensors file or model directory holds.

    Returns an :class:`InspectReport`: the fields ``unshard inspect --json`` prints
    (format, key, tensors with names, dtypes, shapes and sizes, the non-tensor
    entries, notes, the calls its pickles would run; with ``stats=True`` each
    tensor's mean, std, min, max and non-finite counts); ``to_dict()`` gives them all.
    """
    return InspectReport(_run(_native.inspect, _path(path, "path"), key, tag, bool(stats)))


def verify(
    output: PathLike,
    against: Optional[PathLike] = None,
    *,
    base: Optional[PathLike] = None,
    dtype: str = "auto",
    max_shard_size: Union[str, int] = "5GB",
    strict: bool = False,
    key: Optional[str] = None,
    tag: Optional[str] = None,
    rename: Iterable[str] = (),
    adapter: Optional[str] = None,
    adapter_config: Optional[PathLike] = None,
    no_fuse: bool = False,
    refuse_unsafe: bool = False,
    layout: Optional[str] = None,
    progress: ProgressArg = False,
) -> VerifyReport:
    """Check that ``output`` holds exactly what merging ``against`` with these options gives.

    As ``unshard verify``: when ``output`` holds the ``unshard.json`` its merge wrote,
    ``verify(output)`` needs nothing else (the checkpoint and every option left at its
    default are taken from it; ``report.from_manifest`` lists them), and the files are
    also held to its checksums. Otherwise pass ``against`` and the options the merge
    ran with. Returns a :class:`VerifyReport` whose ``ok`` is False when anything
    differs (it does not raise for a mismatch).
    """
    opts = _merge_options(
        base, dtype, max_shard_size, strict, key, tag, rename, False, False, False, False,
        adapter, adapter_config, no_fuse, refuse_unsafe=refuse_unsafe, layout=layout,
    )
    data = _run(
        _native.verify,
        _path(output, "output"),
        "" if against is None else _path(against, "against"),
        opts,
        progress=progress,
        desc="verifying",
    )
    return VerifyReport(data)


def diff(a: PathLike, b: PathLike, *, refuse_unsafe: bool = False, progress: ProgressArg = False) -> DiffReport:
    """Compare two checkpoints or model directories tensor by tensor.

    Returns a :class:`DiffReport` (``identical`` is True when names, dtypes, shapes
    and values all agree; NaN matches NaN). ``refuse_unsafe=True`` raises
    :class:`UnsafePickle` for an input whose pickle would run code under ``torch.load``.
    """
    data = _run(_native.diff, _path(a, "a"), _path(b, "b"), bool(refuse_unsafe), progress=progress, desc="comparing")
    return DiffReport(data)
