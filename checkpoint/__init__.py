"""Durable operator snapshots: in-flight elements and results as Arrow rows in Delta tables.

``SnapshotStore(location)`` is the entry point; ``store.subtask(job, operator, n)`` is the
``SubtaskLog`` a task commits through and restores from. See ``checkpoint._store`` for the
table layout and the atomicity and idempotence guarantees.
"""

from ._exceptions import (
    CheckpointConflictError,
    CheckpointError,
    CheckpointLocationError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    SchemaChangedError,
    UnsupportedTypeError,
)
from ._layout import delta_dataset
from ._model import (
    CheckpointMetadata,
    CheckpointRef,
    InputFingerprint,
    RestorePoint,
    Snapshot,
)
from ._store import ORPHAN_GRACE, ExpireReport, SnapshotStore, SubtaskLog
from ._types import storage_schema, storage_type

__all__ = [
    "CheckpointConflictError",
    "CheckpointError",
    "CheckpointLocationError",
    "CheckpointMetadata",
    "CheckpointNotFoundError",
    "CheckpointRef",
    "CorruptCheckpointError",
    "ExpireReport",
    "ORPHAN_GRACE",
    "InputFingerprint",
    "RestorePoint",
    "SchemaChangedError",
    "Snapshot",
    "SnapshotStore",
    "SubtaskLog",
    "UnsupportedTypeError",
    "delta_dataset",
    "storage_schema",
    "storage_type",
]
