"""unshard: turn distributed-training checkpoints into Hugging Face model directories.

>>> import unshard
>>> report = unshard.merge("policy.pt", "out", base="base-model")   # doctest: +SKIP

The same engine as the ``unshard`` command (installed with this package): it reads
torch.save files, torch.distributed.checkpoint directories and per-rank files
without executing their pickles, and writes sharded safetensors, index, config and
tokenizer files in bounded memory. Functions: :func:`merge`, :func:`inspect`,
:func:`verify`, :func:`diff`; errors derive from :class:`UnshardError`.
"""

from ._api import diff, inspect, merge, verify
from ._errors import (
    Cancelled,
    DtypeOverflow,
    DuplicateName,
    InvalidOption,
    NonFinite,
    OutputError,
    OutputExists,
    ShapeMismatch,
    StrictMismatch,
    UnknownTensor,
    UnreadableCheckpoint,
    UnsafePickle,
    WrongInput,
    PlanError,
    AdapterError,
    UnsafePickleWarning,
    UnshardError,
    UnshardWarning,
    VerificationFailed,
)
from ._reports import (
    DiffReport,
    InspectReport,
    MergeReport,
    MergeWarning,
    PartReport,
    Report,
    UnsafeCall,
    VerifyReport,
)
from ._unshard import __version__

__all__ = [
    "__version__",
    "merge",
    "inspect",
    "verify",
    "diff",
    "Report",
    "MergeReport",
    "PartReport",
    "VerifyReport",
    "DiffReport",
    "InspectReport",
    "MergeWarning",
    "UnsafeCall",
    "UnshardError",
    "UnreadableCheckpoint",
    "UnknownTensor",
    "ShapeMismatch",
    "DuplicateName",
    "DtypeOverflow",
    "StrictMismatch",
    "NonFinite",
    "OutputExists",
    "OutputError",
    "VerificationFailed",
    "InvalidOption",
    "Cancelled",
    "UnsafePickle",
    "WrongInput",
    "PlanError",
    "AdapterError",
    "UnshardWarning",
    "UnsafePickleWarning",
]
