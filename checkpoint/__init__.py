"""Durable operator snapshots: in-flight elements and results as Arrow rows in Delta tables.

``SnapshotStore(location)`` is the entry point; ``store.subtask(job, operator, n)`` is the
``SubtaskLog`` a task commits through and restores from, one Delta table at
``<location>/<job_id>/<operator_id>/subtask=<nnnnn>``. See ``checkpoint._store`` for the
rows a checkpoint holds and the atomicity and idempotence guarantees, and
docs/checkpointing.md for how Spark jobs use them.

* ``CheckpointMetadata`` is one committed checkpoint (``store.checkpoints(job)`` lists
  them), named by a ``CheckpointRef`` (run and id); ``store.load`` returns a ``Snapshot``
  (one checkpoint's in-flight elements and results), ``store.restore`` a ``RestorePoint``
  (what a task resumes from: the results of the checkpoint's whole chain);
  ``InputFingerprint`` identifies the input a checkpoint consumed.
* ``store.expire`` returns an ``ExpireReport``; ``store.remove_orphans`` deletes files no
  checkpoint uses once older than ``ORPHAN_GRACE`` (a day) unless told otherwise.
* ``storage_type`` / ``storage_schema`` give the type a column is stored as in Delta;
  ``delta_dataset`` reads a Delta table's current files as a pyarrow dataset.
* Errors: ``CheckpointError`` (a ``stateful_async.StatefulAsyncError``) and its
  subclasses ``CheckpointLocationError``, ``CheckpointNotFoundError``,
  ``CheckpointConflictError``, ``UnsupportedTypeError``, ``SchemaChangedError`` and
  ``CorruptCheckpointError``.
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
