"""Exceptions raised by ``checkpoint``.

Every error here is a ``CheckpointError``, itself a ``stateful_async.StatefulAsyncError``.
Errors from deltalake and pyarrow are translated at this boundary and chained
(``raise ... from exc``).

Hierarchy::

    StatefulAsyncError
    └── CheckpointError
        ├── CheckpointLocationError              the location is missing or unreadable
        ├── CheckpointNotFoundError  (KeyError)  no such job / checkpoint id (lists the ids)
        ├── CheckpointConflictError              a checkpoint id at or below the committed one:
        │                                        a zombie or a racing attempt; nothing written
        ├── UnsupportedTypeError     (TypeError) a type or value Delta cannot hold losslessly
        ├── SchemaChangedError       (ValueError) the input/output schema differs from the one
        │                                        the job's checkpoints were written with
        └── CorruptCheckpointError               stored rows contradict their metadata
"""

from __future__ import annotations

from stateful_async import StatefulAsyncError


class CheckpointError(StatefulAsyncError):
    """Base class of every error raised by the checkpoint package."""


class CheckpointLocationError(CheckpointError):
    """The checkpoint location does not exist, or cannot be read."""


class CheckpointNotFoundError(CheckpointError, KeyError):
    """The requested job or checkpoint does not exist (never written, or expired)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class CheckpointConflictError(CheckpointError):
    """A commit was refused because an equal or newer checkpoint id is already committed for
    the same (job, operator, run, subtask): a zombie or speculative attempt committing late,
    or two attempts racing on one id. Nothing was written."""


class UnsupportedTypeError(CheckpointError, TypeError):
    """A column type (or value) cannot be stored in Delta without losing information."""


class SchemaChangedError(CheckpointError, ValueError):
    """The schema differs from the one this job's checkpoints were written with."""


class CorruptCheckpointError(CheckpointError):
    """Stored checkpoint rows do not match their own metadata."""
