"""What a checkpoint is: its metadata, and a loaded snapshot ready to restore from."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Iterable

import pyarrow as pa

from stateful_async import StreamElement, StreamRecord


@dataclass(frozen=True)
class CheckpointRef:
    """Names one checkpoint of a subtask: the run that wrote it and its id in that run."""

    run_id: str
    checkpoint_id: int

    def __str__(self) -> str:
        return f"{self.run_id}:{self.checkpoint_id}"


@dataclass(frozen=True)
class CheckpointMetadata:
    """One committed checkpoint of one subtask.

    ``position`` is the number of input records the subtask had consumed at the barrier;
    ``fingerprint`` identifies that consumed input (``InputFingerprint.hexdigest()``; ``""``
    if the commit recorded none). ``parent`` is the checkpoint this one
    follows (the previous one of the run, or the checkpoint the run was restored from):
    the results of a checkpoint are those emitted since its parent, so restoring needs the
    results of the whole chain. ``final`` marks the checkpoint taken when the subtask's
    input ended; ``expired`` one whose in-flight state retention has removed (only its
    results remain, for later checkpoints that need them).
    """

    job_id: str
    operator_id: str
    run_id: str
    subtask: int
    checkpoint_id: int
    parent: CheckpointRef | None
    position: int
    fingerprint: str
    in_flight: int
    result_count: int
    final: bool
    expired: bool
    created_at: datetime
    library_version: str
    properties: dict[str, str] = field(default_factory=dict)

    @property
    def ref(self) -> CheckpointRef:
        return CheckpointRef(self.run_id, self.checkpoint_id)


@dataclass(frozen=True)
class Snapshot:
    """A loaded checkpoint: what the operator had in flight, and the results it committed.

    ``elements`` are in queue order, as ``AsyncWaitOperator.open(restored=...)`` takes them;
    record values are dicts of the input schema. ``input_seqs`` gives each element's input
    sequence number (None for watermarks, or when it was not recorded). ``results`` holds
    the result rows committed by this checkpoint alone (output schema) and
    ``result_timestamps`` their timestamps.
    """

    metadata: CheckpointMetadata
    elements: list[StreamElement]
    input_seqs: list[int | None]
    results: pa.Table
    result_timestamps: list[int | None]


@dataclass(frozen=True)
class RestorePoint:
    """Everything a subtask needs to resume from a checkpoint.

    ``elements`` go to ``AsyncWaitOperator.open(restored=...)``; ``results`` are every
    result committed along the checkpoint's chain, in commit order (re-emit them, do not
    recompute them); ``position`` input records were consumed (skip them, after checking
    ``fingerprint``).
    """

    metadata: CheckpointMetadata
    elements: list[StreamElement]
    input_seqs: list[int | None]
    results: pa.Table
    result_timestamps: list[int | None]

    @property
    def position(self) -> int:
        return self.metadata.position

    @property
    def fingerprint(self) -> str:
        return self.metadata.fingerprint

    def result_records(self) -> list[StreamRecord[Any]]:
        """The committed results as ``StreamRecord``s (dict values, original timestamps)."""
        return [
            StreamRecord(row, ts)
            for row, ts in zip(self.results.to_pylist(), self.result_timestamps, strict=True)
        ]


class InputFingerprint:
    """A running fingerprint of consumed input rows.

    Order- and content-sensitive, and independent of how rows were batched: rows are fed as
    one byte stream (``repr`` of each row plus a separator) into BLAKE2b, whose result does
    not depend on how the stream was split. Two reads of the same input in the same order
    give the same fingerprint at every position.
    """

    __slots__ = ("_hash", "count")

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=16)
        self.count = 0

    def update(self, rows: Iterable[Any]) -> None:
        self.update_reprs([repr(row) for row in rows])

    def update_reprs(self, reprs: list[str]) -> None:
        """``update`` with the rows' ``repr``s, taken earlier: before anything could
        change the rows."""
        if reprs:
            self._hash.update(("\x1e".join(reprs) + "\x1e").encode())
            self.count += len(reprs)

    def hexdigest(self) -> str:
        """``"<rows>:<hash>"``; the row count is part of it, for readable mismatch errors."""
        return f"{self.count}:{self._hash.hexdigest()}"

    def copy(self) -> InputFingerprint:
        other = InputFingerprint()
        other._hash = self._hash.copy()
        other.count = self.count
        return other
