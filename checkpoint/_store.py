"""The Delta snapshot store: operator snapshots as Arrow rows in Delta tables.

A checkpoint of one subtask is one Delta commit (an append) to the subtask's own table,
holding three kinds of rows:

* one ``checkpoint`` row: the metadata (position, fingerprint, counts, parent, ...);
* one ``record`` or ``watermark`` row per queue entry in flight, in queue order, with the
  input row as a native struct column ``input`` (the input schema);
* one ``result`` row per result emitted since the parent checkpoint, as a native struct
  column ``result`` (the output schema).

Every row carries job id, operator id, run id, subtask and checkpoint id, so the table can
be queried with any Delta reader (delta-rs, DuckDB, Polars, Spark with Delta).

Each checkpoint is complete on its own: it is the operator's whole state at its barrier
(the operator's state is cleared and every in-flight element written, never a delta on
the previous one), so any retained checkpoint restores by itself. Only results are
incremental; restoring collects them along the checkpoint's chain of parents.

Guarantees:

* **Atomic**: one checkpoint becomes visible in exactly one Delta commit, or not at all; a
  crash at any point leaves earlier checkpoints intact (at worst, orphan Parquet files).
* **Idempotent**: the commit carries a Delta app transaction, app id = the run, version =
  the checkpoint id. The committed version is read from, and the rows written against, the
  same table snapshot, so an equal or older id (a zombie or speculative attempt
  committing late) is refused, and of two attempts racing on one id exactly one lands.
* **Fenced**: an attempt that resumes a run first claims it (a second app transaction,
  version = a number that grows with every takeover): commits and expiries of attempts
  with an older claim are refused or skipped, even when they are ahead of it.

A run's app transactions (its fences) are stamped by each of its writes; Delta drops them
``_TRANSACTION_RETENTION`` after the last (``_TABLE_CONFIGURATION``).
"""

from __future__ import annotations

import base64
import json
import math
import os
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import (
    CommitFailedError,
    DeltaError,
    SchemaMismatchError,
    TableNotFoundError,
)

from stateful_async import StreamElement, StreamRecord, Watermark
from stateful_async import __version__ as library_version
from stateful_async._exceptions import as_int, as_seconds, id_ranges, numpy_kind

from . import _faults, _layout
from ._exceptions import (
    CheckpointConflictError,
    CheckpointError,
    CheckpointLocationError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    SchemaChangedError,
    UnsupportedTypeError,
)
from ._model import CheckpointMetadata, CheckpointRef, RestorePoint, Snapshot
from ._types import from_storage, storage_type, to_storage

KIND_CHECKPOINT = "checkpoint"
KIND_RECORD = "record"
KIND_WATERMARK = "watermark"
KIND_RESULT = "result"

# The original Arrow schemas live in the table description (JSON): delta-rs 1.6 refuses
# custom table properties, and the description is set once, at creation.
_DESCRIPTION_KEY = "stateful_async"
_LAYOUT_VERSION = 1

_KEY_FIELDS = [
    pa.field("job_id", pa.string()),
    pa.field("operator_id", pa.string()),
    pa.field("run_id", pa.string()),
    pa.field("subtask", pa.int32()),
    pa.field("checkpoint_id", pa.int64()),
    pa.field("kind", pa.string()),
    pa.field("seq", pa.int64()),
    pa.field("input_seq", pa.int64()),
    pa.field("timestamp", pa.int64()),
]
_META_FIELDS = [
    pa.field("parent_run_id", pa.string()),
    pa.field("parent_checkpoint_id", pa.int64()),
    pa.field("position", pa.int64()),
    pa.field("fingerprint", pa.string()),
    pa.field("in_flight", pa.int64()),
    pa.field("result_count", pa.int64()),
    pa.field("final", pa.bool_()),
    pa.field("expired", pa.bool_()),
    pa.field("created_at", pa.timestamp("us", tz="UTC")),
    pa.field("library_version", pa.string()),
    pa.field("properties", pa.string()),
]
_META_COLUMNS = [f.name for f in _KEY_FIELDS] + [f.name for f in _META_FIELDS]

# delta-rs retries a commit that lost to a concurrent append on another app id; a subtask's
# table has one committer at a time, so this only matters for zombies and maintenance.
_COMMIT_RETRIES = 100
# A checkpoint table is only ever read at its latest version (no time travel), and a job
# that checkpoints often commits to it often (a streaming query: every micro-batch is a run,
# with at least one commit per partition). Every commit file in the Delta log slows down
# the next commits (benchmarks/checkpoint_bench.py, "log files"): keep an hour of them, not
# Delta's default 30 days, dropped as delta-rs writes its log checkpoints (every 100
# commits). What an hour costs: a writer whose snapshot is older than an hour and than the
# newest log checkpoint fails, writing nothing ("Invalid table version"); the store reads
# the table afresh before each commit, and an expiry takes seconds.
#
# Every run leaves two or three Delta app transactions (its newest checkpoint id, its
# claim, who claimed it) in every table it wrote, and a streaming query makes a run per
# micro-batch: kept for ever, a query with a micro-batch every 10 s leaves the ids of
# 260,000 runs a month in each partition's table, and every open and lookup reads them
# all. Each write of a run stamps the ids it carries, and Delta drops an id a day after its
# last stamp: a run's fences hold while any attempt of it writes, and for a day after, far
# longer than a cancelled attempt lives on. A run whose ids expired is claimed afresh when
# it resumes, with a claim above any it had (``claim``), so its earlier attempts are fenced
# off again.
_TRANSACTION_RETENTION = "interval 1 day"
_TABLE_CONFIGURATION = {
    "delta.logRetentionDuration": "interval 1 hour",
    "delta.enableExpiredLogCleanup": "true",
    "delta.setTransactionRetentionDuration": _TRANSACTION_RETENTION,
}
_EXPIRE_TRIES = 10  # an expiry reads every checkpoint again on each try
_READ_TRIES = 10  # a read whose files a concurrent expiry vacuumed reads the newer table again
_REOPEN_VERSIONS = 100  # a table object is opened afresh after this many versions (_open)
_RESTORE_GROUP_ROWS = 100_000  # results a resuming task reads (and holds) at a time
# above this many bytes of results, a group's checkpoints are put in order one at a time
_RESTORE_GROUP_BYTES = 1 << 30

# Rows per batch of the stream that ``expire`` rewrites.
_EXPIRE_BATCH_ROWS = 8192
# Subtask tables a job-wide listing or expiry works on at once (each a few requests on an
# object store, a few milliseconds of file reads on local disk).
_LISTING_THREADS = 8
#: how old a data file no Delta version names must be before ``remove_orphans`` deletes
#: it: a commit logs its file seconds after writing it
ORPHAN_GRACE = timedelta(hours=24)
_MAX_GRACE_HOURS = 1_000_000  # delta-rs's vacuum panics on hours past its time range
_T = TypeVar("_T")
_INT32_MAX = 2**31 - 1  # subtasks are int32
_INT64_MAX = 2**63 - 1  # checkpoint ids, positions, sequence numbers and timestamps are int64
# Scans that pass over every file of a table read one fragment and one batch at a time: the
# default read-ahead holds several files' worth in memory.
_SEQUENTIAL = {"batch_readahead": 1, "fragment_readahead": 1}


def _schema_to_text(schema: pa.Schema) -> str:
    return base64.b64encode(schema.serialize().to_pybytes()).decode("ascii")


def _schema_from_text(text: str) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


def _table_schema(input_schema: pa.Schema, output_schema: pa.Schema) -> pa.Schema:
    return pa.schema(
        _KEY_FIELDS
        + _META_FIELDS
        + [
            pa.field("input", storage_type(pa.struct(list(input_schema)), "input")),
            pa.field("result", storage_type(pa.struct(list(output_schema)), "result")),
        ]
    )


def _sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _text(name: str) -> pc.Expression:
    """A string column of a checkpoint table, for a scan's filter. delta-rs rewrites the
    files that its update and delete (a user's, or an expiry of an earlier version) keep
    rows of with string_view columns, which pyarrow's filters cannot compare with a string
    ("no kernel matching input types (string, string_view)"): the cast to the table's own
    type makes every file comparable; a scan casts the columns it returns itself. The cast
    hides the column from the Delta statistics' pruning of the files (pyarrow prunes by a
    bare column only): reads still skip files by their ``checkpoint_id``, never cast."""
    return pc.field(name).cast(pa.string())


def _refs_predicate(refs: Iterable[CheckpointRef]) -> str:
    by_run: dict[str, list[int]] = {}
    for ref in refs:
        by_run.setdefault(ref.run_id, []).append(ref.checkpoint_id)
    return " OR ".join(
        f"(run_id = {_sql_string(run)} AND checkpoint_id IN ({', '.join(map(str, sorted(ids)))}))"
        for run, ids in sorted(by_run.items())
    )


def _refs_filter(refs: Iterable[CheckpointRef]) -> pc.Expression:
    by_run: dict[str, list[int]] = {}
    for ref in refs:
        by_run.setdefault(ref.run_id, []).append(ref.checkpoint_id)
    expression: pc.Expression | None = None
    for run, ids in by_run.items():
        term = (_text("run_id") == run) & pc.field("checkpoint_id").isin(ids)
        expression = term if expression is None else expression | term
    assert expression is not None
    return expression


def _metadata_from_row(row: dict[str, Any]) -> CheckpointMetadata:
    parent = None
    if row["parent_run_id"] is not None:
        parent = CheckpointRef(row["parent_run_id"], int(row["parent_checkpoint_id"]))
    return CheckpointMetadata(
        job_id=row["job_id"],
        operator_id=row["operator_id"],
        run_id=row["run_id"],
        subtask=int(row["subtask"]),
        checkpoint_id=int(row["checkpoint_id"]),
        parent=parent,
        position=int(row["position"]),
        fingerprint=row["fingerprint"] or "",
        in_flight=int(row["in_flight"]),
        result_count=int(row["result_count"]),
        final=bool(row["final"]),
        expired=bool(row["expired"]),
        created_at=row["created_at"],
        library_version=row["library_version"] or "",
        properties=json.loads(row["properties"] or "{}"),
    )


def _describe_refs(metas: Sequence[CheckpointMetadata]) -> str:
    if not metas:
        return "none"
    by_run: dict[str, list[int]] = {}
    for m in metas:
        by_run.setdefault(m.run_id, []).append(m.checkpoint_id)
    return "; ".join(f"run {run}: {id_ranges(ids)}" for run, ids in by_run.items())


@dataclass
class ExpireReport:
    """What ``expire`` did: checkpoints whose state was dropped (``expired``: their results
    stay, later checkpoints need them) and checkpoints removed entirely (``deleted``)."""

    expired: list[CheckpointRef] = field(default_factory=list)
    deleted: list[CheckpointRef] = field(default_factory=list)
    files_removed: int = 0


def _app_id(run_id: str) -> str:
    """The Delta app transaction whose version is a run's newest checkpoint id."""
    return f"stateful-async:{run_id}"


def _lost_race(error: CommitFailedError) -> bool:
    """delta-rs refused a commit because another one wrote the same app transaction first
    (the same checkpoint id, or a claim on the run)."""
    return "Concurrent transaction" in str(error)


def _stale_read(error: CommitFailedError) -> bool:
    """delta-rs refused a commit because another one changed the files it read (an expiry
    that rewrote or deleted some, or an append under an expiry): nothing was written, and
    the same change made from a fresh snapshot may land."""
    return "a concurrent transaction" in str(error)


def _description(input_schema: pa.Schema, output_schema: pa.Schema) -> str:
    """The table description: where the Arrow schemas of a subtask's checkpoints live."""
    return json.dumps(
        {
            _DESCRIPTION_KEY: {
                "layout": _LAYOUT_VERSION,
                "input_schema": _schema_to_text(input_schema),
                "output_schema": _schema_to_text(output_schema),
            }
        }
    )


_TICK = timedelta(microseconds=1)  # the smallest step of a checkpoint's created_at
_STATS_PRECISION = timedelta(milliseconds=1)  # of timestamps in Delta file statistics


def newest_restorable(
    metas: Sequence[CheckpointMetadata], run_id: str | None = None, max_id: int | None = None
) -> CheckpointMetadata | None:
    """Of one subtask's checkpoints (``metas``: all of them, expired ones included, oldest
    first as ``SubtaskLog.checkpoints`` lists them), the one ``SubtaskLog.latest`` resumes
    from; see there."""
    candidates = [
        m
        for m in metas
        if not m.expired
        and (run_id is None or m.run_id == run_id)
        and (max_id is None or m.checkpoint_id <= max_id)
    ]
    if run_id is not None:
        candidates.sort(key=lambda m: m.checkpoint_id)
    # Newest first, skipping any whose chain is broken (an ancestor deleted while it was
    # committed: see chain()), which could never be restored.
    intact = _intact_chains(candidates, {m.ref: m for m in metas})
    return next((m for m in reversed(candidates) if intact[m.ref]), None)


def _intact_chains(
    metas: Sequence[CheckpointMetadata], by_ref: dict[CheckpointRef, CheckpointMetadata]
) -> dict[CheckpointRef, bool]:
    """For every checkpoint, whether each one it follows still exists: each chain is
    walked once, however many checkpoints share it."""
    intact: dict[CheckpointRef, bool] = {}
    for meta in metas:
        path: list[CheckpointRef] = []
        on_path: set[CheckpointRef] = set()
        current = meta
        while True:
            if current.ref in intact:
                result = intact[current.ref]
                break
            if current.ref in on_path:  # a loop: never restorable
                result = False
                break
            path.append(current.ref)
            on_path.add(current.ref)
            if current.parent is None:  # the run's first checkpoint
                result = True
                break
            parent = by_ref.get(current.parent)
            if parent is None:  # deleted
                result = False
                break
            current = parent
        for ref in path:
            intact[ref] = result
    return intact


class _StaleSnapshot(Exception):
    """An expiry worked from a table snapshot that another writer has since changed."""


def _vacuumed_under_us(error: Exception) -> bool:
    """A read of a snapshot whose files another expiry has just vacuumed."""
    text = str(error)
    return isinstance(error, FileNotFoundError) or (
        "Failed to fetch metadata for file" in text or "No such file or directory" in text
    )


def _transaction(app_id: str, version: int) -> Transaction:
    """An app transaction stamped now: Delta drops it ``_TRANSACTION_RETENTION`` after
    the last write that carried it."""
    return Transaction(app_id, version, last_updated=int(time.time() * 1000))


def _claim_app_id(run_id: str) -> str:
    """The Delta app transaction whose version is the newest claim on a run (``claim``)."""
    return f"stateful-async-claim:{run_id}"


def _claimer_app_id(run_id: str, owner: str) -> str:
    """The Delta app transaction whose version is the newest claim ``owner`` made on a run.

    The owner is what follows the id's last ':', whatever the run id holds; an owner that
    holds a ':' itself is named otherwise (as JSON), or run 'a' claimed by 'b:c' and run
    'a:b' claimed by 'c' would share one id: ``claimed_by`` said 'c' had claimed 'a:b'."""
    if ":" not in owner:
        return f"stateful-async-claimed-by:{run_id}:{owner}"
    return "stateful-async-claimed-by-json:" + json.dumps([run_id, owner])


def _schema_differences(old: pa.Schema, new: pa.Schema) -> list[str]:
    """What changed between two schemas, one phrase per field."""

    def kind(field: pa.Field) -> str:
        return f"{field.type}{'' if field.nullable else ' NOT NULL'}"

    def change(name: str, was: pa.Field, now: pa.Field) -> str:
        if was.type.equals(now.type) and was.nullable != now.nullable:
            return f"{name!r} ({was.type}) was " + (
                "nullable, is now NOT NULL" if was.nullable else "NOT NULL, is now nullable"
            )
        return f"{name!r} was {kind(was)}, is now {kind(now)}"

    before = {f.name: f for f in old}
    after = {f.name: f for f in new}
    changes = [
        f"{name!r} ({kind(field)}) is gone"
        if name not in after
        else change(name, field, after[name])
        for name, field in before.items()
        if name not in after or not field.equals(after[name])
    ]
    changes += [f"{name!r} ({kind(f)}) is new" for name, f in after.items() if name not in before]
    return changes or [f"the field order changed from {old.names} to {new.names}"]


class SubtaskLog:
    """The checkpoints of one (job, operator, subtask): one Delta table.

    Keep one ``SubtaskLog`` per task and commit through it: it holds the Delta table
    snapshot that commits are checked and written against.
    """

    def __init__(
        self,
        uri: str,
        job_id: str,
        operator_id: str,
        subtask: int,
        storage_options: dict[str, str] | None = None,
    ) -> None:
        self.uri = uri
        self.job_id = job_id
        self.operator_id = operator_id
        self.subtask = subtask
        self._storage_options = storage_options
        self._table: DeltaTable | None = None
        self._opened_at = 0  # the version self._table was opened at
        self._schemas: tuple[pa.Schema, pa.Schema] | None = None
        # (table version, metadata of every checkpoint at that version): reading metadata
        # scans every row of the table (whose results grow with the input), so it is read
        # once, then kept current by this log's own commits and expiries.
        self._metadata: tuple[int, list[CheckpointMetadata]] | None = None
        self._actions: tuple[int, pa.Table] | None = None  # get_add_actions, by version
        # run id -> this attempt's claim on the run (see ``claim``); 0 if it never claimed
        self._claims: dict[str, int] = {}
        # run id -> the owner this attempt's claim on it named, if it named one
        self._owners: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"SubtaskLog({self.uri!r})"

    # -- reading ------------------------------------------------------------------------

    def exists(self) -> bool:
        return self._open() is not None

    def schemas(self) -> tuple[pa.Schema, pa.Schema] | None:
        """The (input, output) Arrow schemas this subtask's checkpoints were written with."""
        if self._schemas is not None:
            return self._schemas
        table = self._open()
        if table is None:
            return None
        try:
            info = json.loads(table.metadata().description or "{}")[_DESCRIPTION_KEY]
            self._schemas = (
                _schema_from_text(info["input_schema"]),
                _schema_from_text(info["output_schema"]),
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise CorruptCheckpointError(
                f"{self.uri} is a Delta table but not a stateful-async checkpoint table (its "
                "description does not hold the snapshot schemas). Point the store at a "
                "checkpoint location."
            ) from exc
        return self._schemas

    def checkpoints(self, include_expired: bool = True) -> list[CheckpointMetadata]:
        """Every checkpoint of this subtask, oldest first."""
        include_expired = _flag(include_expired, "include_expired")
        table = self._open(refresh=True)
        if table is None:
            return []
        self.schemas()  # a Delta table that is not a checkpoint table is named as such
        version = table.version()
        if self._metadata is None or self._metadata[0] != version:
            # Every row of the table is scanned for one row per checkpoint.
            rows = self._read(
                table, _text("kind") == KIND_CHECKPOINT, _META_COLUMNS, sequential=True
            )
            metas = [_metadata_from_row(row) for row in rows.to_pylist()]
            metas.sort(key=lambda m: (m.created_at, m.checkpoint_id))
            self._metadata = (version, metas)
        return [m for m in self._metadata[1] if include_expired or not m.expired]

    def latest(
        self, run_id: str | None = None, max_id: int | None = None
    ) -> CheckpointMetadata | None:
        """The newest restorable checkpoint, optionally of one run and with id <= max_id.

        Within a run, newest means the highest id; across runs, the most recently created.
        """
        if run_id is not None:
            _run_id(run_id)
        if max_id is not None:
            max_id = _checkpoint_id(max_id, "max_id")
        return newest_restorable(self.checkpoints(), run_id, max_id)

    def last_committed_id(self, run_id: str) -> int | None:
        """The highest checkpoint id ``run_id`` committed to this subtask, as its Delta app
        transaction records it: also when those checkpoints are gone (expired by another
        run of the job, deleted by hand) or unrestorable, and until the id itself expires
        (``_TRANSACTION_RETENTION`` after the run's last write). A retry numbers its
        checkpoints above it, or its commits would be refused as late ones."""
        app_id = _app_id(_run_id(run_id))
        table = self._open(refresh=True)
        return None if table is None else table.transaction_version(app_id)

    def sizes(self) -> dict[CheckpointRef, int]:
        """Bytes of the Parquet files that hold one checkpoint each, by checkpoint (read
        from the Delta log's file statistics, without opening the files). Files that
        ``expire`` rewrote hold several checkpoints' results and are not counted."""
        table = self._open(refresh=True)
        if table is None:
            return {}
        actions = self._add_actions(table)
        sizes: dict[CheckpointRef, int] = {}
        columns = [
            "size_bytes",
            "min.run_id",
            "max.run_id",
            "min.checkpoint_id",
            "max.checkpoint_id",
        ]
        if not set(columns) <= set(actions.column_names):
            return sizes
        for size, run_lo, run_hi, id_lo, id_hi in zip(
            *(actions.column(c).to_pylist() for c in columns), strict=True
        ):
            if run_lo is not None and run_lo == run_hi and id_lo == id_hi:
                ref = CheckpointRef(run_lo, int(id_lo))
                sizes[ref] = sizes.get(ref, 0) + int(size)
        return sizes

    def find(self, checkpoint_id: int, run_id: str | None = None) -> CheckpointMetadata:
        """The restorable checkpoint with this id (of ``run_id``, or the newest such whose
        chain is intact, if one is)."""
        checkpoint_id = _checkpoint_id(checkpoint_id)
        if run_id is not None:
            _run_id(run_id)
        metas = self.checkpoints()
        matches = [
            m
            for m in metas
            if m.checkpoint_id == checkpoint_id and (run_id is None or m.run_id == run_id)
        ]
        live = [m for m in matches if not m.expired]
        if live:
            intact = _intact_chains(live, {m.ref: m for m in metas})
            return next((m for m in reversed(live) if intact[m.ref]), live[-1])
        where = f"job {self.job_id!r}, operator {self.operator_id!r}, subtask {self.subtask}"
        if run_id is not None:
            where += f", run {run_id!r}"
        available = [m for m in metas if not m.expired]
        if matches:
            raise CheckpointNotFoundError(
                f"Checkpoint {checkpoint_id} of {where} has expired (retention removed its "
                f"state). Checkpoints that can be restored: {_describe_refs(available)}."
            )
        raise CheckpointNotFoundError(
            f"There is no checkpoint {checkpoint_id} of {where} at {self.uri}. Checkpoints "
            f"that exist: {_describe_refs(available)}."
        )

    def load(
        self, checkpoint_id: int, run_id: str | None = None, *, results: bool = True
    ) -> Snapshot:
        """One checkpoint: its in-flight elements and the results it committed. With
        ``results=False`` only the elements are read (``results`` is empty): for a caller
        that reads the results along the chain with ``chain_results``."""
        results = _flag(results, "results")
        meta = self.find(checkpoint_id, run_id)
        table = self._open()
        assert table is not None
        input_schema, output_schema = self.schemas()  # type: ignore[misc]
        kinds = (
            _text("kind") != KIND_CHECKPOINT
            if results
            else _text("kind").isin([KIND_RECORD, KIND_WATERMARK])
        )
        rows = self._read(
            table,
            (_text("run_id") == meta.run_id)
            & (pc.field("checkpoint_id") == meta.checkpoint_id)
            & kinds,
            None,
            refs=[meta.ref],
            state=True,
        )
        elements, seqs = self._elements(rows, input_schema, meta)
        if not results:
            return Snapshot(meta, elements, seqs, output_schema.empty_table(), [])
        stored, timestamps = self._results(rows, output_schema)
        if len(stored) != meta.result_count:
            raise CorruptCheckpointError(
                f"Checkpoint {meta.ref} of subtask {self.subtask} records {meta.result_count} "
                f"results but {len(stored)} are stored."
            )
        return Snapshot(meta, elements, seqs, stored, timestamps)

    def chain(
        self,
        meta: CheckpointMetadata,
        by_ref: dict[CheckpointRef, CheckpointMetadata] | None = None,
    ) -> list[CheckpointMetadata]:
        """``meta`` and its ancestors, oldest first."""
        if not isinstance(meta, CheckpointMetadata):  # failed with a bare AttributeError
            raise CheckpointError(
                "meta must be a CheckpointMetadata (as checkpoints(), find() or latest() "
                f"return); got {meta!r}."
            )
        if by_ref is None:
            by_ref = {m.ref: m for m in self.checkpoints()}
        chain = [meta]
        seen = {meta.ref}
        current = meta
        while current.parent is not None:
            parent = by_ref.get(current.parent)
            if parent is None:
                raise CorruptCheckpointError(
                    f"Checkpoint {current.ref} of subtask {self.subtask} follows {current.parent}, "
                    "which is missing: its results cannot be restored. It was deleted by hand, "
                    "or by the retention of another run of this job sharing the table (before "
                    "commits checked that their parent exists); the next expiry deletes "
                    f"{meta.ref} too."
                )
            if parent.ref in seen:
                raise CorruptCheckpointError(
                    f"Checkpoint chain of {meta.ref} loops at {parent.ref}."
                )
            seen.add(parent.ref)
            chain.append(parent)
            current = parent
        chain.reverse()
        return chain

    def restore(self, checkpoint_id: int, run_id: str | None = None) -> RestorePoint:
        """What a subtask resumes from: the checkpoint's in-flight elements, and every result
        committed along its chain, in commit order (all in memory; a task streams them with
        ``chain_results`` instead)."""
        snapshot = self.load(checkpoint_id, run_id, results=False)
        parts = list(self.chain_results(snapshot.metadata))
        return RestorePoint(
            snapshot.metadata,
            snapshot.elements,
            snapshot.input_seqs,
            pa.concat_tables([p for p, _ in parts]) if parts else snapshot.results,
            [t for _, stamps in parts for t in stamps.to_pylist()],
        )

    def chain_results(
        self, meta: CheckpointMetadata, max_rows: int = _RESTORE_GROUP_ROWS
    ) -> Iterator[tuple[pa.Table, pa.ChunkedArray]]:
        """The results committed along ``meta``'s chain, in commit order, with their
        timestamps (an int64 array, null where none): one table per group of consecutive
        checkpoints holding at most ``max_rows`` results (or one checkpoint that holds
        more), so a resuming task holds one group at a time rather than its partition's
        whole output so far."""
        # a string was taken while the chain had one checkpoint, and failed with a bare
        # TypeError once it had two
        max_rows = _integer(max_rows, "max_rows", 0)
        chain = self.chain(meta)
        table = self._open()
        assert table is not None
        _, output_schema = self.schemas()  # type: ignore[misc]
        group: list[CheckpointMetadata] = []
        size = 0
        for i, m in enumerate(chain):
            group.append(m)
            size += m.result_count
            last = i == len(chain) - 1
            if not last and size + chain[i + 1].result_count <= max_rows:
                continue
            if size:  # the table as of now: a read that lost its files brought it forward
                yield from self._group_results(self._open() or table, group, size, output_schema)
            group, size = [], 0

    def _group_results(
        self,
        table: DeltaTable,
        group: list[CheckpointMetadata],
        expected: int,
        output_schema: pa.Schema,
    ) -> Iterator[tuple[pa.Table, pa.ChunkedArray]]:
        rows = self._read(
            table,
            (_text("kind") == KIND_RESULT) & _refs_filter(m.ref for m in group),
            ["run_id", "checkpoint_id", "seq", "timestamp", "result"],
            refs=[m.ref for m in group],
        )
        yield from self._in_order(rows, group, expected, output_schema)

    def _in_order(
        self,
        rows: pa.Table,
        group: list[CheckpointMetadata],
        expected: int,
        output_schema: pa.Schema,
    ) -> Iterator[tuple[pa.Table, pa.ChunkedArray]]:
        """``group``'s results (``rows``) in commit order. Large results (long texts, say)
        are put in order in halves of the group, down to one checkpoint if need be: Arrow
        sorts a column by concatenating it, and a string column's 32-bit offsets end at
        2 GiB (a checkpoint's own results are below that: its commit made sure)."""
        if len(group) == 1 or rows.column("result").nbytes <= _RESTORE_GROUP_BYTES:
            yield self._ordered_results(rows, group, expected, output_schema)
            return
        half = len(group) // 2
        for part in (group[:half], group[half:]):
            mine = rows.filter(_refs_filter(m.ref for m in part))
            yield from self._in_order(mine, part, sum(m.result_count for m in part), output_schema)

    def _ordered_results(
        self,
        rows: pa.Table,
        group: list[CheckpointMetadata],
        expected: int,
        output_schema: pa.Schema,
    ) -> tuple[pa.Table, pa.ChunkedArray]:
        order = {m.ref: i for i, m in enumerate(group)}
        position = [
            order[CheckpointRef(r, c)]
            for r, c in zip(
                rows.column("run_id").to_pylist(),
                rows.column("checkpoint_id").to_pylist(),
                strict=True,
            )
        ]
        rows = rows.append_column("_order", pa.array(position, pa.int64()))
        rows = rows.sort_by([("_order", "ascending"), ("seq", "ascending")])
        results = _struct_to_table(rows.column("result"), output_schema)
        if len(results) != expected:
            raise CorruptCheckpointError(
                f"Checkpoints {group[0].ref}..{group[-1].ref} of subtask {self.subtask} "
                f"record {expected} results but {len(results)} are stored."
            )
        return results, rows.column("timestamp")

    # -- writing ------------------------------------------------------------------------

    def commit(
        self,
        run_id: str,
        checkpoint_id: int,
        elements: Sequence[StreamElement],
        results: pa.Table | pa.RecordBatch | Sequence[dict[str, Any]] | None = None,
        *,
        input_schema: pa.Schema,
        output_schema: pa.Schema,
        position: int,
        fingerprint: str = "",
        parent: CheckpointRef | None = None,
        input_seqs: Sequence[int | None] | None = None,
        result_timestamps: Sequence[int | None] | None = None,
        final: bool = False,
        properties: dict[str, str] | None = None,
    ) -> CheckpointMetadata:
        """Commit one checkpoint atomically: ``elements`` (the operator's snapshot, in queue
        order; record values are dicts of ``input_schema``) and ``results`` (rows of
        ``output_schema`` emitted since ``parent``: a pyarrow Table or RecordBatch, dicts,
        or None for none).

        ``checkpoint_id`` (>= 1) and ``position`` (>= 0) are integers, numpy's too (stored,
        and returned in the metadata, as Python ints). ``properties`` (free-form labels, such
        as the task attempt that wrote the checkpoint) map strings to strings; other keys or
        values are refused. ``fingerprint`` is a string (``InputFingerprint.hexdigest()``
        of the input consumed, or the default ``""``: none recorded), never None. ``parent``
        is a ``CheckpointRef`` (the ``.ref`` of the checkpoint this one follows) or None;
        ``final`` a bool (numpy's too).

        Raises ``CheckpointConflictError`` (and writes nothing) if this run already
        committed ``checkpoint_id`` or a later one.
        """
        checkpoint_id, position = _check_commit_args(
            run_id, checkpoint_id, position, elements, input_seqs
        )
        labels = _checked_properties(properties)
        parent = _checked_parent(parent)
        if not isinstance(fingerprint, str):
            # A None was stored as null and read back as "": the checkpoint then seemed to
            # record an empty fingerprint, which no input has.
            raise CheckpointError(
                f'fingerprint must be a string (InputFingerprint.hexdigest(), or "" when none '
                f"is recorded); got {fingerprint!r}."
            )
        final = _flag(final, "final")
        _check_schema_args(input_schema, output_schema)
        result_table = _as_result_table(results, output_schema)
        if result_timestamps is not None and len(result_timestamps) != result_table.num_rows:
            raise CheckpointError(
                f"result_timestamps has {len(result_timestamps)} entries for "
                f"{result_table.num_rows} results."
            )
        created_at = datetime.now(timezone.utc)
        table = self._open(refresh=True)
        if table is not None and (newest := self._newest_stamp(table)) is not None:
            # Never before a checkpoint already written, whatever this machine's clock says:
            # "latest" across runs and retention order a subtask's checkpoints by created_at,
            # and the order must be the order they were written in. An attempt or a run on a
            # machine whose clock is behind would otherwise make its checkpoints look older
            # than ones written before them (by its own run: retention deleted the newest;
            # by a run it rolled back from: "latest" went back to that run's abandoned line).
            created_at = max(created_at, newest + _TICK)
        checked_at = None  # the table version at which the parent was last seen
        if parent is not None:
            self._parent(table, parent, run_id, checkpoint_id)
            checked_at = table.version() if table is not None else None
        meta = CheckpointMetadata(
            job_id=self.job_id,
            operator_id=self.operator_id,
            run_id=run_id,
            subtask=self.subtask,
            checkpoint_id=checkpoint_id,
            parent=parent,
            position=position,
            fingerprint=fingerprint,
            in_flight=len(elements),
            result_count=result_table.num_rows,
            final=final,
            expired=False,
            created_at=created_at,
            library_version=library_version,
            properties=labels,
        )
        data = _checkpoint_rows(
            meta, elements, input_seqs, result_table, result_timestamps, input_schema, output_schema
        )
        app_id = _app_id(run_id)
        properties_for_commit = CommitProperties(
            app_transactions=[_transaction(app_id, checkpoint_id), *self._fences(run_id)],
            max_commit_retries=_COMMIT_RETRIES,
            custom_metadata={"stateful_async.checkpoint": str(meta.ref)},
        )
        _faults.fire("before_delta_commit", log=self, meta=meta, data=data)
        reset = False  # rewrite an emptied table for other schemas instead of appending
        for tries_left in reversed(range(_COMMIT_RETRIES)):
            table = self._open(refresh=True)
            if table is None:
                if self._create(data, input_schema, output_schema, properties_for_commit):
                    self._metadata = (0, [meta])  # version 0 holds this checkpoint alone
                    return meta
                table = self._open(refresh=True)  # another attempt created it first
                assert table is not None
            reset = self._check_schemas(input_schema, output_schema) or reset
            if parent is not None and table.version() != checked_at:
                # the table moved since: is the parent still there, at the version written on?
                self._parent(table, parent, run_id, checkpoint_id)
                checked_at = table.version()
            if (claimed := self._taken_over(table, run_id)) is not None:
                raise CheckpointConflictError(
                    f"Checkpoint {checkpoint_id} of run {run_id!r}, subtask {self.subtask} was "
                    f"refused: a later attempt of that run has taken it over (claim {claimed}; "
                    f"this attempt's is {self._claims.get(run_id, 0)}). This is a zombie or "
                    "speculative attempt committing late; its snapshot is discarded."
                )
            committed = table.transaction_version(app_id)
            if committed is not None and committed >= checkpoint_id:
                raise CheckpointConflictError(
                    f"Checkpoint {checkpoint_id} of run {run_id!r}, subtask {self.subtask} was "
                    f"refused: checkpoint {committed} of that run is already committed. This "
                    "is a zombie or speculative attempt committing late; its snapshot is "
                    "discarded."
                )
            try:
                # The same table object that answered transaction_version(): a racing commit
                # of the same app id makes this one fail instead of landing twice.
                if reset:
                    self._reset(table, data, input_schema, output_schema, properties_for_commit)
                else:
                    write_deltalake(
                        table, data, mode="append", commit_properties=properties_for_commit
                    )
            except SchemaMismatchError as exc:
                if reset or self.checkpoints():
                    raise CheckpointError(
                        f"Committing checkpoint {meta.ref} to {self.uri} failed: {exc}"
                    ) from exc
                reset = True  # a reset stopped between its two commits: finish it
                continue
            except CommitFailedError as exc:
                if _lost_race(exc):
                    raise CheckpointConflictError(
                        f"Checkpoint {checkpoint_id} of run {run_id!r}, subtask {self.subtask} "
                        "lost a race with another attempt of that run (committing the same "
                        "checkpoint, or taking the run over); that attempt's commit stands "
                        "and this one wrote nothing."
                    ) from exc
                if _stale_read(exc) and tries_left:
                    continue  # an expiry landed since the refresh: check again and retry
                raise CheckpointError(f"Committing checkpoint {meta.ref} failed: {exc}") from exc
            except (OSError, ValueError, TypeError) as exc:
                raise CheckpointError(
                    f"Committing checkpoint {meta.ref} to {self.uri} failed: {exc}"
                ) from exc
            except DeltaError as exc:
                # delta-rs also fails after its commit landed (a post-commit step: writing a
                # log checkpoint, cleaning up expired log files)
                raise CheckpointError(
                    f"Committing checkpoint {meta.ref} to {self.uri} failed: {exc}. The "
                    "commit may have landed before the failure; either way the table is "
                    "consistent, and a retried attempt resumes from the newest checkpoint "
                    "it holds."
                ) from exc
            cached = self._metadata
            if cached is not None and table.version() == cached[0] + 1:
                self._metadata = (cached[0] + 1, [*cached[1], meta])  # nobody else committed
            return meta
        raise AssertionError("unreachable: the last try returns or raises")

    def _parent(
        self, table: DeltaTable | None, parent: CheckpointRef, run_id: str, checkpoint_id: int
    ) -> CheckpointMetadata:
        """The metadata of the checkpoint a new one follows, in ``table``; refused if it is
        gone: its results are part of the new one's chain, which could then never be
        restored."""
        cached = self._metadata
        if table is not None and cached is not None and cached[0] == table.version():
            found = next((m for m in cached[1] if m.ref == parent), None)
        elif table is not None:
            found = self._find(table, parent)
        else:
            found = None
        if found is None:
            raise CheckpointNotFoundError(
                f"Checkpoint {checkpoint_id} of run {run_id!r}, subtask {self.subtask} was "
                f"refused: the checkpoint it follows, {parent}, has been deleted: by the "
                "retention of another run of this job sharing the table (runs of one job_id "
                "that execute at the same time share each partition's table, and retain keeps "
                "the newest checkpoints of any run), or by `stateful-async checkpoints expire` "
                "while this job ran. Nothing was written; a retried attempt starts the "
                "partition over. Give runs that overlap distinct job_ids, and expire a job's "
                "checkpoints only while it is not running."
            )
        return found

    def _add_actions(self, table: DeltaTable) -> pa.Table:
        """The Delta log's add actions (data files and their statistics) of ``table``'s
        version, read once per version: a commit's stamp and parent lookup both need them."""
        version = table.version()
        if self._actions is None or self._actions[0] != version:
            self._actions = (version, pa.table(table.get_add_actions(flatten=True)))
        return self._actions[1]

    def _newest_stamp(self, table: DeltaTable) -> datetime | None:
        """The latest created_at of the checkpoints in ``table``, or a bound at most 1 ms
        above it: from the metadata read last if the table has not moved since, else from
        the file statistics in the Delta log (which hold timestamps cut to milliseconds)
        rather than by reading every checkpoint's row."""
        cached = self._metadata
        if cached is not None and cached[0] == table.version():
            return max((m.created_at for m in cached[1]), default=None)
        actions = self._add_actions(table)
        if "max.created_at" not in actions.column_names:  # written without statistics
            return max((m.created_at for m in self.checkpoints()), default=None)
        newest = pc.max(actions.column("max.created_at")).as_py()
        if newest is None:
            return None
        return newest.astimezone(timezone.utc) + _STATS_PRECISION

    def _find(self, table: DeltaTable, ref: CheckpointRef) -> CheckpointMetadata | None:
        """One checkpoint's metadata, reading only the files whose statistics (in the Delta
        log) may hold its row: reading every checkpoint's metadata scans the whole table,
        and even building a dataset of all its files costs time in proportion to them."""
        actions = self._add_actions(table)
        bounds = ["min.run_id", "max.run_id", "min.checkpoint_id", "max.checkpoint_id"]
        if set(bounds) <= set(actions.column_names):
            low_run, high_run, low_id, high_id = (actions.column(c) for c in bounds)
            may_hold = pc.and_(
                pc.and_(pc.less_equal(low_run, ref.run_id), pc.greater_equal(high_run, ref.run_id)),
                pc.and_(
                    pc.less_equal(low_id, ref.checkpoint_id),
                    pc.greater_equal(high_id, ref.checkpoint_id),
                ),
            )
            actions = actions.filter(pc.fill_null(may_hold, True))  # no statistics: read it
        paths = [unquote(p) for p in actions.column("path").to_pylist()]
        if not paths:
            return None
        wanted = (
            (_text("kind") == KIND_CHECKPOINT)
            & (_text("run_id") == ref.run_id)
            & (pc.field("checkpoint_id") == ref.checkpoint_id)
        )
        try:
            rows = _layout.files_dataset(table, paths, self._storage_options).to_table(
                filter=wanted, columns=_META_COLUMNS
            )
        except Exception as exc:
            if _vacuumed_under_us(exc):
                return None  # its file was just expired and vacuumed
            raise CheckpointError(f"Cannot read checkpoint table {self.uri}: {exc}") from exc
        return _metadata_from_row(rows.to_pylist()[0]) if rows.num_rows else None

    def claim(self, run_id: str, owner: str | None = None, *, force: bool = False) -> int | None:
        """Take ``run_id`` over from the attempts before this one, which may still be
        running (a cancelled task's Python worker lives on for a while; a speculative copy
        runs beside the original): from now on their commits of this run are refused, so a
        zombie that is ahead cannot make this attempt's next checkpoint look late.

        Call it before reading the run's restore point: a commit that lands before the claim
        is seen by that read, one after it is refused. One empty Delta commit, made only if
        the run has committed something (otherwise there is nothing to take over); returns
        the claim, or None. ``owner`` (a name of the attempt, unique among every attempt
        that may ever claim the run) is recorded with the claim: ``claimed_by`` reads it.
        ``force`` claims even a run whose app transactions show nothing of it: one seen to
        have a checkpoint (``take_over``) whose ids expired (no attempt wrote for
        ``_TRANSACTION_RETENTION``), or whose first commit landed after this look.
        """
        app_id, claim_app = _app_id(_run_id(run_id)), _claim_app_id(run_id)
        force = _flag(force, "force")
        if owner is not None:
            _owner(owner)
        for _ in range(_COMMIT_RETRIES):
            table = self._open(refresh=True)
            if table is None:
                return None
            current = table.transaction_version(claim_app)
            if current is None and not force and table.transaction_version(app_id) is None:
                return None
            # After the run's ids expired (force), count on from the table's version: no
            # earlier claim, each made in a commit of its own, can be above it.
            claim = current + 1 if current is not None else table.version() + 1
            read_version = table.version()
            try:
                write_deltalake(
                    table,
                    _layout.delta_dataset(table, self._storage_options).schema.empty_table(),
                    mode="append",
                    commit_properties=CommitProperties(
                        app_transactions=[_transaction(claim_app, claim)]
                        + (
                            []
                            if owner is None
                            else [_transaction(_claimer_app_id(run_id, owner), claim)]
                        ),
                        custom_metadata={"stateful_async.claim": f"{run_id}#{claim}"},
                    ),
                )
            except (CommitFailedError, OSError, ValueError, TypeError) as exc:
                if isinstance(exc, CommitFailedError) and (_lost_race(exc) or _stale_read(exc)):
                    continue  # a commit of this run (or an expiry) landed: claim after it
                raise CheckpointError(
                    f"Claiming run {run_id!r} in {self.uri} failed: {exc}"
                ) from exc
            self._claims[run_id] = claim
            if owner is None:
                self._owners.pop(run_id, None)
            else:
                self._owners[run_id] = owner
            cached = self._metadata
            if (
                cached is not None
                and cached[0] == read_version
                and table.version() == read_version + 1
            ):
                self._metadata = (read_version + 1, cached[1])  # the claim adds no rows
            return claim
        raise CheckpointConflictError(
            f"Could not take over run {run_id!r} of subtask {self.subtask}: another attempt "
            f"committed to it each of {_COMMIT_RETRIES} times this attempt tried."
        )

    def _fences(self, run_id: str) -> list[Transaction]:
        """What every write of this attempt to ``run_id`` carries: its claim (0 if it never
        claimed), so that a claim racing with the write makes one of the two fail, and the
        owner the claim named; stamped now, so that they outlive the run's last write by
        ``_TRANSACTION_RETENTION``."""
        claim = self._claims.get(run_id, 0)
        owner = self._owners.get(run_id)
        fences = [_transaction(_claim_app_id(run_id), claim)]
        if owner is not None:
            fences.append(_transaction(_claimer_app_id(run_id, owner), claim))
        return fences

    def _taken_over(self, table: DeltaTable, run_id: str) -> int | None:
        """The later claim that took ``run_id`` over from this attempt, if one did."""
        claimed = table.transaction_version(_claim_app_id(run_id))
        return claimed if claimed is not None and claimed > self._claims.get(run_id, 0) else None

    def take_over(
        self, run_id: str, owner: str | None = None
    ) -> tuple[int | None, CheckpointMetadata | None]:
        """Claim ``run_id`` (see ``claim``) and return the claim and the run's newest
        restorable checkpoint, which no earlier attempt can supersede any more. If the run
        had nothing to claim but a checkpoint of it lands before the read (an earlier
        attempt's first commit), claim again and read again."""
        claim = self.claim(run_id, owner)
        latest = self.latest(run_id=run_id)
        if claim is None and latest is not None:
            # A commit landed after the claim looked (or the run's app transactions have
            # expired): claim it now that it has a checkpoint, and read after that claim.
            claim = self.claim(run_id, owner, force=True)
            latest = self.latest(run_id=run_id)
        return claim, latest

    def claimed_by(self, run_id: str, owner: str) -> bool:
        """Whether ``owner`` made the newest claim on ``run_id``."""
        _run_id(run_id)
        _owner(owner)
        table = self._open(refresh=True)
        if table is None:
            return False
        newest = table.transaction_version(_claim_app_id(run_id))
        return (
            newest is not None
            and table.transaction_version(_claimer_app_id(run_id, owner)) == newest
        )

    def expire(self, retain: int, vacuum: bool = True, run_id: str | None = None) -> ExpireReport:
        """Keep the ``retain`` newest checkpoints of this subtask restorable; drop the rest.

        The state of older checkpoints is removed; their results are kept as long as a
        retained checkpoint's chain needs them; everything else is deleted. One Delta
        commit; then, with ``vacuum`` (True or False, numpy's bool too), the files it
        removed are deleted from storage.

        An attempt of a run passes ``run_id``: once a later attempt has taken the run over
        (``claim``), or while it does, this attempt expires nothing (the other one now
        keeps the table), so it cannot delete files the other is restoring from. Its
        ``vacuum`` deletes just the files its own commit removed; without ``run_id`` the
        table is vacuumed, which also deletes those an ``expire(vacuum=False)``, or a task
        killed between its expiry's commit and the deletion, left behind.
        """
        retain = _integer(retain, "retain", 0)
        vacuum = _flag(vacuum, "vacuum")
        if run_id is not None:
            _run_id(run_id)
        for tries_left in reversed(range(_EXPIRE_TRIES)):
            try:
                return self._expire(retain, vacuum, run_id)
            except _StaleSnapshot as stale:
                if not tries_left:
                    raise CheckpointError(
                        f"Expiring checkpoints in {self.uri} failed: {stale.__cause__}. Each of "
                        f"{_EXPIRE_TRIES} tries lost to another writer of the table (a running "
                        "task of this job, or another expiry). The table is unchanged; expire "
                        "again when the job is idle."
                    ) from stale.__cause__
        raise AssertionError("unreachable")

    def _expire(self, retain: int, vacuum: bool, run_id: str | None) -> ExpireReport:
        report = ExpireReport()
        metas = self.checkpoints()
        if not metas:
            return report
        assert self._metadata is not None
        read_version = self._metadata[0]
        # A checkpoint whose chain is broken (an ancestor deleted: by hand, or by another
        # run's retention before the parent check existed) can never be restored: it is
        # neither kept nor keeps anything, so it is deleted.
        by_ref = {m.ref: m for m in metas}
        intact = _intact_chains(metas, by_ref)
        live = [m for m in metas if not m.expired and intact[m.ref]]
        keep = live[-retain:] if retain else []  # all of them when there are fewer
        needed: set[CheckpointRef] = set()
        for meta in keep:
            needed.update(m.ref for m in self.chain(meta, by_ref))
        keep_refs = {m.ref for m in keep}
        to_expire = [m.ref for m in live if m.ref not in keep_refs and m.ref in needed]
        to_delete = [m.ref for m in metas if m.ref not in needed]
        if not to_expire and not to_delete:
            if vacuum and run_id is None:
                report.files_removed = self._vacuum_leftovers()
            return report
        table = self._open(refresh=True)
        assert table is not None
        if run_id is not None and self._taken_over(table, run_id) is not None:
            return report  # taken over: expiry is the new attempt's to do
        properties = CommitProperties(
            app_transactions=self._fences(run_id) if run_id is not None else None,
            max_commit_retries=_COMMIT_RETRIES,
        )
        predicate = _refs_predicate(to_expire + to_delete)
        before = table.version()
        try:
            if to_expire:
                # The rows that survive (the results and metadata row of each expired
                # checkpoint, the latter flagged ``expired``) are selected and flagged by
                # the scan itself and streamed into the rewrite: its memory is a few
                # batches, not every touched row (results are most of a checkpoint).
                write_deltalake(
                    table,
                    self._expired_rows(table, to_expire),
                    mode="overwrite",
                    predicate=predicate,
                    commit_properties=properties,
                )
            else:
                # Not table.delete(): delta-rs rewrites a file it keeps some rows of with
                # string_view columns, which pyarrow's dataset filters cannot compare with a
                # string ("no kernel matching input types (string, string_view)"): every
                # later read of the table failed. An overwrite of the rows with none writes
                # the kept rows in the table's own types (the schema from the table's
                # description: building a dataset of every file for it took 5x the delete).
                input_schema, output_schema = self.schemas()  # type: ignore[misc]
                write_deltalake(
                    table,
                    _table_schema(input_schema, output_schema).empty_table(),
                    mode="overwrite",
                    predicate=predicate,
                    commit_properties=properties,
                )
            rewritten = table.version()
            if vacuum and run_id is not None and rewritten > before:
                # A task's expiry, after every final checkpoint (each micro-batch of a
                # stream): a vacuum would list the whole directory and log two more
                # commits each time.
                report.files_removed = len(
                    _layout.delete_removed_files(self.uri, self._storage_options, rewritten)
                )
            elif vacuum:
                try:
                    report.files_removed = len(self._vacuum(table, 0))
                except CommitFailedError:
                    # The vacuum logs commits of its own, which a running task's commit
                    # landing meanwhile can refuse; the rewrite stands (trying it again
                    # would find nothing to do): delete the files it replaced, as a task's
                    # expiry does.
                    if rewritten > before:
                        report.files_removed = len(
                            _layout.delete_removed_files(self.uri, self._storage_options, rewritten)
                        )
        except CheckpointError:
            raise
        except CommitFailedError as exc:
            if run_id is not None and _lost_race(exc):
                return ExpireReport()  # another attempt is taking the run over: leave it be
            if _stale_read(exc):
                raise _StaleSnapshot() from exc  # a checkpoint landed meanwhile: read again
            raise CheckpointError(
                f"Expiring checkpoints in {self.uri} failed: {exc}. The table is unchanged; "
                "expiring again is safe."
            ) from exc
        except Exception as exc:  # the rewrite's stream raises whatever its scan raises
            if _vacuumed_under_us(exc):
                raise _StaleSnapshot() from exc  # another expiry's vacuum: read again
            raise CheckpointError(
                f"Expiring checkpoints in {self.uri} failed: {exc}. The table is unchanged "
                "unless a Delta commit was logged; expiring again is safe."
            ) from exc
        if rewritten == read_version + 1:
            # Nobody else committed: the metadata after the rewrite is known without
            # reading the table again (a read opens every data file, and the results of
            # every checkpoint ever taken stay in the table).
            expired, deleted = set(to_expire), set(to_delete)
            self._metadata = (
                self._data_version(table, rewritten),
                [
                    replace(m, expired=True) if m.ref in expired else m
                    for m in metas
                    if m.ref not in deleted
                ],
            )
        report.expired = to_expire
        report.deleted = to_delete
        return report

    def remove_orphans(self, older_than: timedelta | float = ORPHAN_GRACE) -> list[str]:
        """Delete the files of this subtask's table directory that its Delta table does not
        use and that were written more than ``older_than`` (a timedelta, or seconds) ago
        (names starting with ``_`` or ``.`` aside: the Delta log; where the table has no log
        yet, only ``*.parquet`` files); return their names, sorted.

        Most are orphans: files of commits that never completed (their task was killed
        between writing the file and logging it, or a newer attempt had taken the run
        over), which no version of the log names and ``expire`` never deletes. The rest are
        files an ``expire(vacuum=False)`` removed from the table.

        ``older_than`` is the grace period: a newer file may belong to a commit still
        running. delta-rs counts it in whole hours, so it is rounded up to the next hour.
        Keep it longer than your slowest commit (the default, a day, is far longer); 0
        deletes the file of a commit in progress, which then logs a file that is gone: its
        table can no longer be read, so use 0 only while no job runs. A file
        that a commit logs while this looks (a running task's checkpoint) is kept: the
        table is read again after the listing. Nothing is logged to the table, so a running
        job's commits cannot make this fail.
        """
        hours = grace_hours(older_than)
        options = self._storage_options
        try:
            table = self._open(refresh=True)
            if table is None:  # the first commit never landed: no file is the table's
                candidates = _layout.stale_files(self.uri, options, hours * 3600)
            else:
                # Listed, not deleted: delta-rs's vacuum would delete what the snapshot read
                # before its listing does not name, and log two commits, which a running
                # job's expiry landing meanwhile makes fail.
                candidates = table.vacuum(
                    retention_hours=hours,
                    enforce_retention_duration=False,
                    dry_run=True,
                    full=True,
                )
            # Read after the listing: a file a commit logged meanwhile (a running task's
            # checkpoint) is the table's, and stays.
            newest = self._open(refresh=True)
            in_use = set() if newest is None else _layout.table_files(newest)
            removed = _layout.delete_files(
                self.uri, options, [c for c in map(unquote, candidates) if c not in in_use]
            )
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"Removing orphan files of checkpoint table {self.uri} failed: {exc}. The "
                "checkpoints are unchanged (any file already deleted was one no checkpoint "
                "uses); run it again once the storage is reachable."
            ) from exc
        removed = [os.path.basename(name) for name in removed]
        return sorted(removed)

    # -- internals ----------------------------------------------------------------------

    def _vacuum_leftovers(self) -> int:
        """An expiry with nothing new to expire still deletes what an earlier one left (an
        ``expire(vacuum=False)``, or a process killed between its commit and its vacuum):
        a dry run first, so that a table with nothing left logs no vacuum commits."""
        table = self._open(refresh=True)
        assert table is not None
        there = _layout.data_files(table.table_uri, self._storage_options)
        listed = table.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=True)
        if there is not None and not there.intersection(os.path.basename(f) for f in listed):
            return 0
        try:
            return len(self._vacuum(table, 0, there=there))
        except CommitFailedError:
            return 0  # a task's commit landed meanwhile: the next expiry deletes them

    def _vacuum(
        self, table: DeltaTable, hours: int, full: bool = False, there: set[str] | None = None
    ) -> list[str]:
        """Vacuum ``table`` (files it no longer uses, ``hours`` old; with ``full``, files no
        version of its log names too); the names of the files it deleted. delta-rs also
        lists the files whose removal is still in the log that an earlier vacuum deleted:
        only those that were there (``there``, the table's files if the caller listed them
        just before) count."""
        if there is None:
            there = _layout.data_files(table.table_uri, self._storage_options)
        listed = table.vacuum(
            retention_hours=hours, enforce_retention_duration=False, dry_run=False, full=full
        )
        names = [os.path.basename(f) for f in listed]
        return names if there is None else [name for name in names if name in there]

    def _open(self, refresh: bool = False) -> DeltaTable | None:
        """The table (None if there is none yet); ``refresh`` brings it to its newest
        version. A DeltaTable object brought forward commit by commit gets slower and bigger
        with each (benchmarks/checkpoint_bench.py, "long task"): after ``_REOPEN_VERSIONS``
        versions a fresh object starts again from the newest Delta log checkpoint."""
        if self._table is not None:
            if not refresh:
                return self._table
            try:
                self._table.update_incremental()
            except Exception as exc:
                raise CheckpointError(f"Cannot read checkpoint table {self.uri}: {exc}") from exc
            if self._table.version() - self._opened_at < _REOPEN_VERSIONS:
                return self._table
        try:
            self._table = DeltaTable(self.uri, storage_options=self._storage_options)
        except TableNotFoundError:
            return None
        except Exception as exc:
            raise CheckpointLocationError(
                f"Cannot open checkpoint table {self.uri}: {exc}"
            ) from exc
        self._opened_at = self._table.version()
        return self._table

    def _expired_rows(
        self, table: DeltaTable, refs: Sequence[CheckpointRef]
    ) -> pa.RecordBatchReader:
        """The rows of ``refs`` that expiring keeps, metadata rows flagged ``expired``, as a
        stream of small batches."""
        dataset = _layout.delta_dataset(table, self._storage_options)
        is_meta = _text("kind") == KIND_CHECKPOINT
        columns = {
            name: pc.if_else(is_meta, True, pc.field(name)) if name == "expired" else pc.field(name)
            for name in dataset.schema.names
        }
        try:
            return dataset.scanner(
                columns=columns,
                filter=_refs_filter(refs) & _text("kind").isin([KIND_RESULT, KIND_CHECKPOINT]),
                batch_size=_EXPIRE_BATCH_ROWS,
                use_threads=False,
                **_SEQUENTIAL,
            ).to_reader()
        except Exception as exc:
            raise CheckpointError(f"Cannot read checkpoint table {self.uri}: {exc}") from exc

    @staticmethod
    def _data_version(table: DeltaTable, version: int) -> int:
        """The table's version if every commit after ``version`` is vacuum bookkeeping (no
        data changes); otherwise ``version``, which makes the next read start over."""
        newer = table.version() - version
        if not 0 < newer <= 2:  # vacuum logs a start and an end commit
            return version
        try:
            history = table.history(limit=newer)
        except Exception:
            return version
        if len(history) == newer and all(
            entry.get("version", -1) > version
            and entry.get("operation") in ("VACUUM START", "VACUUM END")
            for entry in history
        ):
            return table.version()
        return version

    def _create(
        self,
        data: pa.Table,
        input_schema: pa.Schema,
        output_schema: pa.Schema,
        commit_properties: CommitProperties,
    ) -> bool:
        """Create the table with the first checkpoint in its first commit; False if another
        attempt created it meanwhile.

        Never retried: deltalake would land a create that lost the race for version 0 as
        version 1 without checking its app transactions, so two attempts of one run racing
        on an empty partition would both commit checkpoint 1 (and no resume could read
        their mixed rows). The loser returns False and goes the way of every append, whose
        app transaction refuses it."""
        once = CommitProperties(
            app_transactions=commit_properties.app_transactions,
            max_commit_retries=0,
            custom_metadata=commit_properties.custom_metadata,
        )
        try:
            write_deltalake(
                self.uri,
                data,
                mode="error",
                description=_description(input_schema, output_schema),
                configuration=_TABLE_CONFIGURATION,
                storage_options=self._storage_options,
                commit_properties=once,
                name=f"{self.job_id}/{self.operator_id}/subtask={self.subtask:05d}",
            )
        except CommitFailedError:
            return False
        except Exception as exc:
            if "already exists" in str(exc).lower() or "version 0" in str(exc).lower():
                return False
            raise CheckpointError(f"Cannot create checkpoint table {self.uri}: {exc}") from exc
        self._table = None
        return True

    def _reset(
        self,
        table: DeltaTable,
        data: pa.Table,
        input_schema: pa.Schema,
        output_schema: pa.Schema,
        commit_properties: CommitProperties,
    ) -> None:
        """Give a table whose checkpoints were all deleted other schemas, with ``data`` as
        its only rows. Two commits, description first: a crash between them leaves a table
        with no checkpoints, the new description and the old columns, which the next commit
        finds (its append fails on the columns) and resets again."""
        description = _description(input_schema, output_schema)
        if table.metadata().description != description:
            table.alter.set_table_description(description)
            table.update_incremental()
        self._schemas = None
        write_deltalake(
            table,
            data,
            mode="overwrite",
            schema_mode="overwrite",
            commit_properties=commit_properties,
        )

    def check_schemas(self, input_schema: pa.Schema, output_schema: pa.Schema) -> None:
        """Raise ``SchemaChangedError`` if this subtask's checkpoints were written with other
        schemas; a subtask without checkpoints (none yet, or all deleted) accepts any."""
        _check_schema_args(input_schema, output_schema)
        self._check_schemas(input_schema, output_schema)

    def _check_schemas(self, input_schema: pa.Schema, output_schema: pa.Schema) -> bool:
        """``check_schemas``; True if the table holds other schemas but no checkpoints
        (emptied by ``expire --retain 0``), so its next commit must reset it."""
        stored = self.schemas()
        if stored is None or (stored[0].equals(input_schema) and stored[1].equals(output_schema)):
            return False
        if not self.checkpoints():
            return True
        what, old, new = (
            ("input", stored[0], input_schema)
            if not stored[0].equals(input_schema)
            else ("output", stored[1], output_schema)
        )
        location = self.uri.rsplit("/", 3)[0]
        raise SchemaChangedError(
            f"The {what} schema differs from the one the checkpoints of job "
            f"{self.job_id!r} (operator {self.operator_id!r}) at {self.uri} were "
            f"written with: {'; '.join(_schema_differences(old, new))}. Checkpoints "
            "of one job keep the schemas they were written with (a retried task, a "
            "restarted streaming query or restore_from can resume them). Two enrichments "
            "in one job (one chained after the other, say) each need their own "
            "operator_id. Otherwise use a new job_id (or operator_id), or delete every "
            "checkpoint of this job, results included, "
            "with: stateful-async checkpoints "
            f"expire {shlex.quote(location)} --job {self.job_id} --retain 0"
        )

    def _read(
        self,
        table: DeltaTable,
        expression: pc.Expression | None,
        columns: list[str] | None,
        sequential: bool = False,
        refs: Sequence[CheckpointRef] = (),
        state: bool = False,
    ) -> pa.Table:
        """The rows of ``table`` that match ``expression``.

        A running job's expiry rewrites files and vacuums the old ones at once, so a read
        of an older snapshot can find a file gone: the read starts again on the newest
        version, where the rows it wants (those of ``refs``, and with ``state`` their
        in-flight elements too) are in the files that replaced it, unless that expiry
        deleted them, which is said so."""
        for tries_left in reversed(range(_READ_TRIES)):
            read_version = table.version()
            try:
                return _layout.delta_dataset(table, self._storage_options).to_table(
                    filter=expression, columns=columns, **(_SEQUENTIAL if sequential else {})
                )
            except Exception as exc:
                failure = exc
                if not _vacuumed_under_us(exc):
                    raise CheckpointError(
                        f"Cannot read checkpoint table {self.uri}: {exc}"
                    ) from exc
            fresh = self._open(refresh=True)
            assert fresh is not None
            if fresh.version() == read_version:  # nobody expired: the file is just gone
                raise CheckpointError(
                    f"Cannot read checkpoint table {self.uri}: {failure}. Its newest version "
                    "names a data file that is not there (deleted by hand, by a storage "
                    "lifecycle rule, or as an orphan with no grace period, `checkpoints expire "
                    "--orphans-older-than 0`, while a task was committing it?): the checkpoints "
                    "in it cannot be read. Restore the file, or delete the subtask's "
                    "checkpoints (its table directory) to start it over."
                ) from failure
            if not tries_left:
                raise CheckpointError(
                    f"Cannot read checkpoint table {self.uri}: {failure}. Each of "
                    f"{_READ_TRIES} reads lost its files to an expiry of a running job (it "
                    "rewrites the table as it goes); read again, or while the job is idle."
                ) from failure
            table = fresh
            if refs:
                self._require_present(refs, state)
        raise AssertionError("unreachable")

    def _require_present(self, refs: Sequence[CheckpointRef], state: bool) -> None:
        """Raise ``CheckpointNotFoundError`` unless each of ``refs`` is still in the table
        (and, with ``state``, not expired): a concurrent expiry may have removed it."""
        now = {m.ref: m for m in self.checkpoints()}
        gone = [r for r in refs if r not in now or (state and now[r].expired)]
        if gone:
            raise CheckpointNotFoundError(
                f"Checkpoint {gone[0]} of subtask {self.subtask} at {self.uri} was "
                f"{'expired' if gone[0] in now else 'deleted'} while it was being read, by "
                "the retention of a job still writing this table (or an expire). Restore a "
                f"newer checkpoint: {_describe_refs([m for m in now.values() if not m.expired])}."
            )

    def _elements(
        self, rows: pa.Table, input_schema: pa.Schema, meta: CheckpointMetadata
    ) -> tuple[list[StreamElement], list[int | None]]:
        kinds = rows.column("kind")
        mask = pc.or_(pc.equal(kinds, KIND_RECORD), pc.equal(kinds, KIND_WATERMARK))
        part = rows.filter(mask).sort_by("seq")
        if part.num_rows != meta.in_flight:
            raise CorruptCheckpointError(
                f"Checkpoint {meta.ref} of subtask {self.subtask} records {meta.in_flight} "
                f"in-flight elements but {part.num_rows} are stored."
            )
        values = from_storage(
            part.column("input").combine_chunks(), pa.struct(list(input_schema))
        ).to_pylist()
        elements: list[StreamElement] = []
        for kind, value, timestamp in zip(
            part.column("kind").to_pylist(),
            values,
            part.column("timestamp").to_pylist(),
            strict=True,
        ):
            if kind == KIND_WATERMARK:
                elements.append(Watermark(timestamp))
            else:
                elements.append(StreamRecord(value, timestamp))
        return elements, part.column("input_seq").to_pylist()

    def _results(
        self, rows: pa.Table, output_schema: pa.Schema
    ) -> tuple[pa.Table, list[int | None]]:
        part = rows.filter(pc.equal(rows.column("kind"), KIND_RESULT)).sort_by("seq")
        return _struct_to_table(part.column("result"), output_schema), part.column(
            "timestamp"
        ).to_pylist()


class SnapshotStore:
    """Durable operator snapshots under a checkpoint location (a local path, or an object
    store URI whose credentials go in ``storage_options``, passed through to deltalake).

    Layout: one Delta table per (job, operator, subtask), see ``checkpoint._layout``.
    """

    def __init__(
        self, location: str | os.PathLike[str], storage_options: dict[str, str] | None = None
    ) -> None:
        self.location = _layout.normalize(location)
        _layout.check_storage_options(storage_options)
        self.storage_options = storage_options

    def __repr__(self) -> str:
        return f"SnapshotStore({self.location!r})"

    def subtask(self, job_id: str, operator_id: str, subtask: int) -> SubtaskLog:
        _layout.check_name("job id", job_id)
        _layout.check_name("operator id", operator_id)
        number = as_int(subtask)
        if number is None or not 0 <= number <= _INT32_MAX:
            # stored as int32, as Spark numbers its partitions: a larger one failed its first
            # commit with pyarrow's "Value ... too large to fit in C integer type"
            raise CheckpointError(
                f"subtask must be an integer from 0 to {_INT32_MAX:,}; got {subtask!r}."
            )
        subtask = number
        uri = _layout.subtask_dir(self.location, job_id, operator_id, subtask)
        return SubtaskLog(uri, job_id, operator_id, subtask, self.storage_options)

    # -- listing ------------------------------------------------------------------------

    def jobs(self) -> list[str]:
        """The jobs with checkpoints here. Other directories (``lost+found``, a snapshot
        directory, anything not laid out as ``<job_id>/<operator_id>/subtask=<n>``) are
        not jobs and are left out."""
        self._require_location()
        return [name for name in self._dirs() if self._is_job(name)]

    def operators(self, job_id: str) -> list[str]:
        self._require_job(job_id)
        return list(self._operator_dirs(job_id))

    def _is_job(self, name: str) -> bool:
        """Whether ``name`` holds an operator directory with subtask tables (listing stops
        at the first: on an object store every listing is a request)."""
        try:
            _layout.check_name("job id", name)
        except CheckpointError:
            return False
        return any(self._operator_dirs(name))

    def _operator_dirs(self, job_id: str) -> Iterator[str]:
        """The directories under ``job_id`` that hold subtask tables, listed one by one."""
        for name in self._dirs(job_id):
            if _layout.subtask_numbers(self._dirs(job_id, name)):
                yield name

    def subtasks(self, job_id: str, operator_id: str) -> list[int]:
        """The subtasks (partitions) of an operator of a job that have a table, in order;
        ``CheckpointNotFoundError`` naming the job's operators if it has none there (a
        mistyped operator id gave [], as if the operator had no partitions)."""
        _layout.check_name("operator id", operator_id)
        self._require_job(job_id)
        numbers = _layout.subtask_numbers(self._dirs(job_id, operator_id))
        if not numbers:
            raise self._no_operator(job_id, operator_id, self.operators(job_id))
        return numbers

    def checkpoints(
        self, job_id: str, operator_id: str | None = None, include_expired: bool = False
    ) -> list[CheckpointMetadata]:
        """Every checkpoint of every subtask of a job (optionally one operator), sorted by
        operator, then oldest first (the time each was committed), checkpoint id and
        subtask."""
        _flag(include_expired, "include_expired")  # refused before any table is read
        metas = [
            meta
            for found in self.map_subtasks(
                job_id, operator_id, lambda log: log.checkpoints(include_expired)
            )
            for meta in found
        ]
        metas.sort(key=lambda m: (m.operator_id, m.created_at, m.checkpoint_id, m.subtask))
        return metas

    def read_job(self, job_id: str, operator_id: str | None = None) -> pa.Table:
        """All rows of all checkpoint tables of a job, as one Arrow table (for queries)."""

        def read(log: SubtaskLog) -> pa.Table | None:
            table = log._open()
            return None if table is None else log._read(table, None, None)

        tables = [t for t in self.map_subtasks(job_id, operator_id, read) if t is not None]
        if not tables:
            raise CheckpointNotFoundError(f"Job {job_id!r} has no checkpoints at {self.location}.")
        return pa.concat_tables(tables, promote_options="permissive")

    # -- per checkpoint -----------------------------------------------------------------

    def load(
        self,
        job_id: str,
        operator_id: str,
        subtask: int,
        checkpoint_id: int,
        run_id: str | None = None,
    ) -> Snapshot:
        return self._existing(job_id, operator_id, subtask).load(checkpoint_id, run_id)

    def restore(
        self,
        job_id: str,
        operator_id: str,
        subtask: int,
        checkpoint_id: int,
        run_id: str | None = None,
    ) -> RestorePoint:
        return self._existing(job_id, operator_id, subtask).restore(checkpoint_id, run_id)

    def _existing(self, job_id: str, operator_id: str, subtask: int) -> SubtaskLog:
        """The log of a subtask that has a table; else CheckpointNotFoundError naming the
        job's operators, or the operator's subtasks (rather than "no checkpoint N of
        subtask 5 ... Checkpoints that exist: none" for a job that has checkpoints)."""
        self._require_job(job_id)
        log = self.subtask(job_id, operator_id, subtask)
        if log.exists():
            return log
        operators = self.operators(job_id)  # one listing, for the check and the message
        if operator_id not in operators:
            raise self._no_operator(job_id, operator_id, operators)
        raise CheckpointNotFoundError(
            f"Operator {operator_id!r} of job {job_id!r} has no subtask {log.subtask} at "
            f"{self.location}. Its subtasks: {id_ranges(self.subtasks(job_id, operator_id))}."
        )

    def _no_operator(
        self, job_id: str, operator_id: str, operators: list[str]
    ) -> CheckpointNotFoundError:
        """The error for an ``operator_id`` the job (whose ``operators`` these are) lacks."""
        return CheckpointNotFoundError(
            f"Job {job_id!r} has no operator {operator_id!r} at {self.location}. Its "
            f"operators: {', '.join(operators) if operators else 'none'}."
        )

    def expire(
        self, job_id: str, retain: int, operator_id: str | None = None, vacuum: bool = True
    ) -> ExpireReport:
        """Keep the ``retain`` newest checkpoints of every subtask of the job; see
        ``SubtaskLog.expire``."""
        # refused before any table is touched, or the job looked up
        retain = _integer(retain, "retain", 0)
        _flag(vacuum, "vacuum")
        total = ExpireReport()
        for report in self.map_subtasks(
            job_id, operator_id, lambda log: log.expire(retain, vacuum)
        ):
            total.expired.extend(report.expired)
            total.deleted.extend(report.deleted)
            total.files_removed += report.files_removed
        return total

    def remove_orphans(
        self,
        job_id: str,
        older_than: timedelta | float = ORPHAN_GRACE,
        operator_id: str | None = None,
    ) -> list[str]:
        """``SubtaskLog.remove_orphans`` of every subtask of the job (one operator, or
        all); the files deleted, as ``<operator_id>/subtask=<n>/<name>`` under the job's
        directory, sorted."""
        grace_hours(older_than)  # a bad value is refused before any table is touched
        self._require_job(job_id)

        def remove(log: SubtaskLog) -> list[str]:
            where = f"{log.operator_id}/subtask={log.subtask:05d}"
            return [f"{where}/{name}" for name in log.remove_orphans(older_than)]

        return sorted(p for paths in self.map_subtasks(job_id, operator_id, remove) for p in paths)

    def map_subtasks(
        self, job_id: str, operator_id: str | None, fn: Callable[[SubtaskLog], _T]
    ) -> list[_T]:
        """``fn`` of every subtask table of the job (one operator, or all), in operator and
        subtask order. The tables are independent and each costs a few requests (object
        stores) or file reads: a few threads work on them at once, as delta-rs does its I/O
        without holding the GIL (200 partitions on local disk: listing 1.4x, expiry 1.4x)."""
        # subtasks() refuses an operator id that names no directory (1 failed with a bare
        # TypeError from the path join; "" meant every operator) and a mistyped one, naming
        # the job's operators (expire() reported nothing expired, checkpoints() none)
        logs = [
            self.subtask(job_id, operator, number)
            for operator in ([operator_id] if operator_id is not None else self.operators(job_id))
            for number in self.subtasks(job_id, operator)
        ]
        if len(logs) <= 1:
            return [fn(log) for log in logs]
        with ThreadPoolExecutor(
            max_workers=min(_LISTING_THREADS, len(logs)), thread_name_prefix="checkpoint-scan"
        ) as pool:
            return list(pool.map(fn, logs))

    def _dirs(self, *parts: str) -> list[str]:
        return _layout.list_dirs(self.location, *parts, storage_options=self.storage_options)

    # -- checks -------------------------------------------------------------------------

    def _require_location(self) -> None:
        if not _layout.location_exists(self.location, self.storage_options):
            raise CheckpointLocationError(_layout.missing_location(self.location))

    def _require_job(self, job_id: str) -> None:
        _layout.check_name("job id", job_id)
        self._require_location()
        if not self._is_job(job_id):
            jobs = self.jobs()
            raise CheckpointNotFoundError(
                f"Job {job_id!r} has no checkpoints at {self.location}. Jobs there: "
                f"{', '.join(jobs) if jobs else 'none'}."
            )


# -- row building --------------------------------------------------------------------------


def grace_hours(older_than: Any) -> int:
    """``older_than`` (a timedelta, or seconds) in whole hours, rounded up (delta-rs's
    vacuum counts whole hours); CheckpointError for a value it cannot take."""
    seconds = as_seconds(older_than)
    if seconds is None or not 0 <= seconds <= _MAX_GRACE_HOURS * 3600:
        raise CheckpointError(
            f"older_than must be a timedelta or a number of seconds, from 0 to "
            f"{_MAX_GRACE_HOURS:,} hours; got {older_than!r}. It is the grace period during "
            "which a file no checkpoint uses yet is kept, as a running commit may still log it."
        )
    return math.ceil(seconds / 3600)


def _checkpoint_id(value: Any, name: str = "checkpoint_id") -> int:
    """A checkpoint id a caller gave, as an int (numpy's integers too); anything else is
    refused: a string '3' matched no checkpoint, and was said to be missing beside the
    list of the ids that exist, 3 among them."""
    return _integer(value, name, 1)


def _integer(value: Any, name: str, minimum: int) -> int:
    """An integer argument a caller gave, as an int (numpy's integers too), at least
    ``minimum``; anything else is refused, naming the argument."""
    number = as_int(value)
    if number is None or number < minimum:
        raise CheckpointError(f"{name} must be an integer >= {minimum}; got {value!r}.")
    return number


def _flag(value: Any, name: str) -> bool:
    """A True/False argument as a bool (numpy's too); anything else is refused: a string
    "no" is true (``expire(vacuum="no")`` vacuumed), and None was stored as null."""
    if not isinstance(value, bool) and not (numpy_kind(value) == "b" and np.ndim(value) == 0):
        raise CheckpointError(f"{name} must be True or False; got {value!r}.")
    return bool(value)


def _run_id(value: Any, name: str = "run_id") -> str:
    """A run id a caller gave; anything but a non-empty string is refused, as every run id
    is stored as one: ``latest(run_id=1)`` found nothing, ``load`` said run 1 had no such
    checkpoint beside the list of those of run '1', and ``claim(1)`` claimed run '1'."""
    if not isinstance(value, str) or not value:
        raise CheckpointError(f"{name} must be a non-empty string; got {value!r}.")
    return value


def _owner(value: Any) -> str:
    """The ``owner`` of a claim a caller gave; anything but a non-empty string is refused,
    as it is recorded as one: ``claim(run, owner=1)`` was then ``claimed_by(run, "1")``."""
    return _run_id(value, "owner")


def _check_schema_args(input_schema: Any, output_schema: Any) -> None:
    """CheckpointError unless both are ``pyarrow.Schema`` objects (``check_schemas(1, 2)``
    failed with pyarrow's bare "Argument 'other' has incorrect type", or passed on a
    subtask with no table yet)."""
    if not isinstance(input_schema, pa.Schema) or not isinstance(output_schema, pa.Schema):
        raise CheckpointError(
            "input_schema and output_schema must be pyarrow.Schema objects; got "
            f"{type(input_schema).__name__} and {type(output_schema).__name__}."
        )


_BLANK_RUN = (
    "It names the run in every listing of checkpoints (run <run_id>: 1-3) and in each "
    "CheckpointRef (<run_id>:<checkpoint_id>)."
)


def _written_run_id(value: Any, name: str = "run_id", why: str = _BLANK_RUN) -> str:
    """A run id a commit writes (its own, or its parent's): ``_run_id``'s, and not blank
    (``why`` says why, and what to do). Refused when written only: reads still take a blank
    id a table may hold from before this check."""
    if not _run_id(value, name).strip():
        raise CheckpointError(f"{name} must hold more than whitespace; got {value!r}. {why}")
    return value


def _check_commit_args(
    run_id: str,
    checkpoint_id: int,
    position: int,
    elements: Sequence[StreamElement],
    input_seqs: Sequence[int | None] | None,
) -> tuple[int, int]:
    """The checkpoint id and position as plain ints (numpy's integers too, as everywhere
    else); CheckpointError for an argument ``commit`` cannot take."""
    _written_run_id(run_id)
    if not isinstance(elements, Sequence):
        raise CheckpointError(
            "elements must be a list of StreamRecord and Watermark elements (the operator's "
            f"snapshot_state()); got {type(elements).__name__}."
        )
    checkpoint_id = _checkpoint_id(checkpoint_id)
    position = _integer(position, "position", 0)
    for name, value in (("checkpoint_id", checkpoint_id), ("position", position)):
        if value > _INT64_MAX:  # pyarrow's bare "Python int too large to convert to C long"
            raise CheckpointError(
                f"{name} must be at most {_INT64_MAX:,}, the largest a checkpoint table's "
                f"64-bit integer column holds; got {value:,}."
            )
    if input_seqs is not None and len(input_seqs) != len(elements):
        raise CheckpointError(
            f"input_seqs has {len(input_seqs)} entries for {len(elements)} elements."
        )
    return checkpoint_id, position


def _checked_parent(parent: Any) -> CheckpointRef | None:
    """A commit's ``parent`` (its checkpoint id as a plain int); anything but a
    ``CheckpointRef`` is refused: a tuple matched no checkpoint, and was said to have been
    deleted by another run's retention."""
    if parent is None:
        return None
    if not isinstance(parent, CheckpointRef):
        raise CheckpointError(
            f"parent must be a CheckpointRef (the .ref of the CheckpointMetadata of the "
            f"checkpoint this one follows, or CheckpointRef(run_id, checkpoint_id)), or None; "
            f"got {parent!r}."
        )
    return CheckpointRef(
        _written_run_id(
            parent.run_id,
            "parent's run_id",
            # A table written before blank run ids were refused may hold one, and reads take
            # it: the checkpoint restores, but nothing can follow it.
            "A checkpoint of a run whose id is blank (written before such ids were refused) "
            "cannot be followed. To go on from it, commit this run's first checkpoint with "
            "parent=None and, as its results, the whole chain's: "
            "restore(checkpoint_id, run_id).results, then those emitted since (a restore of "
            "the new checkpoint re-emits them all).",
        ),
        _checkpoint_id(parent.checkpoint_id, "parent's checkpoint_id"),
    )


def _checked_properties(properties: Any) -> dict[str, str]:
    """A commit's ``properties`` as a dict of strings to strings. Anything else is refused:
    stored as JSON, a number came back as a number but a key as a string, and a value JSON
    cannot hold failed the commit with a bare TypeError."""
    if properties is None:
        return {}
    if not isinstance(properties, Mapping):
        raise CheckpointError(
            f"properties must be a dict of strings to strings, or None; got {properties!r}."
        )
    for key, value in properties.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise CheckpointError(
                f"properties must be a dict of strings to strings, or None; got {key!r}: "
                f"{value!r}. Convert keys and values with str() first: they are stored, and "
                "read back, as strings."
            )
    return dict(properties)


def _int64_array(values: Sequence[int | None], name: str) -> pa.Array:
    """``values`` (a commit's input_seqs or result_timestamps) as an int64 array; a value
    that is not a 64-bit integer is refused naming the argument."""
    try:
        return pa.array(values, pa.int64())
    except (OverflowError, pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
        raise CheckpointError(
            f"{name} must hold integers from {-_INT64_MAX - 1:,} to {_INT64_MAX:,} (a "
            f"checkpoint table's 64-bit integer column) or None: {exc}."
        ) from exc


def _as_result_table(
    results: pa.Table | pa.RecordBatch | Sequence[dict[str, Any]] | None, schema: pa.Schema
) -> pa.Table:
    if results is None:
        return schema.empty_table()
    if isinstance(results, pa.RecordBatch):
        results = pa.Table.from_batches([results])
    if isinstance(results, pa.Table):
        if not results.schema.equals(schema, check_metadata=False):
            try:
                return results.select(schema.names).cast(schema)
            except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise SchemaChangedError(
                    f"The results do not match the output schema: {exc}.\n  results: "
                    f"{results.schema}\n  output schema: {schema}"
                ) from exc
        return results
    # pyarrow takes an iterable of anything: a string became one row of nulls per character
    if isinstance(results, (str, bytes, Mapping)) or not isinstance(results, Iterable):
        raise _not_rows(repr(results))
    rows = list(results)
    for row in rows:
        if not isinstance(row, Mapping):
            raise _not_rows(f"a {type(results).__name__} holding {row!r}")
    try:
        return pa.Table.from_pylist(rows, schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
        raise UnsupportedTypeError(
            f"The results do not fit the output schema {schema}: {exc}"
        ) from exc


def _not_rows(what: str) -> CheckpointError:
    return CheckpointError(
        "results must be a pyarrow Table or RecordBatch, a list of dicts (one per row of the "
        f"output schema), or None; got {what[:200]}."
    )


def _struct_to_table(column: pa.ChunkedArray | pa.Array, schema: pa.Schema) -> pa.Table:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks else pa.array([], column.type)
    restored = from_storage(column, pa.struct(list(schema)))
    if len(restored) == 0:
        return schema.empty_table()
    # from_storage gave the columns ``schema``'s types; the schema itself brings back the
    # field metadata. No cast: Arrow's cast refuses a null struct holding nulls in a NOT
    # NULL child, even where it changes nothing.
    columns = pa.RecordBatch.from_struct_array(restored).columns
    return pa.Table.from_arrays(columns, schema=schema)


def _too_large(meta: CheckpointMetadata, what: str, remedy: str) -> CheckpointError:
    return CheckpointError(
        f"Checkpoint {meta.ref} of subtask {meta.subtask} cannot be committed: its {what} "
        "hold more than 2 GiB in one column, past what an Arrow string or binary column "
        f"holds (32-bit offsets). Give each checkpoint less to hold: {remedy}. Nothing was "
        "written; the previous checkpoint is intact."
    )


def _checkpoint_rows(
    meta: CheckpointMetadata,
    elements: Sequence[StreamElement],
    input_seqs: Sequence[int | None] | None,
    results: pa.Table,
    result_timestamps: Sequence[int | None] | None,
    input_schema: pa.Schema,
    output_schema: pa.Schema,
) -> pa.Table:
    schema = _table_schema(input_schema, output_schema)
    n_el, n_res = len(elements), results.num_rows
    total = 1 + n_el + n_res
    # Rows: the checkpoint's metadata row, one per in-flight element, one per result. The
    # element rows are built from Python values; the result rows (most of a checkpoint)
    # only from Arrow arrays, without a Python object per row.
    kinds: list[str] = [KIND_CHECKPOINT]
    timestamps: list[int | None] = [None]
    values: list[Any] = []
    for element in elements:
        if type(element) is Watermark:
            kinds.append(KIND_WATERMARK)
            values.append(None)
        elif type(element) is StreamRecord:
            kinds.append(KIND_RECORD)
            values.append(element.value)
        else:
            raise CheckpointError(
                "A snapshot holds StreamRecord and Watermark elements; got "
                f"{type(element).__name__}."
            )
        timestamps.append(element.timestamp)

    input_type = pa.struct(list(input_schema))
    try:
        element_inputs = pa.array(values, type=input_type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError) as exc:
        raise UnsupportedTypeError(
            f"An in-flight record does not fit the input schema {input_schema}: {exc}"
        ) from exc
    if isinstance(element_inputs, pa.ChunkedArray):  # what pyarrow does past 2 GiB
        raise _too_large(meta, "in-flight records", "a lower capacity")
    input_storage = schema.field("input").type
    result_storage = schema.field("result").type
    input_column = pa.concat_arrays(
        [
            pa.nulls(1, input_storage),
            to_storage(element_inputs, input_type),
            pa.nulls(n_res, input_storage),
        ]
    )
    try:
        result_struct = pa.StructArray.from_arrays(
            [c.combine_chunks() if c.num_chunks else pa.array([], c.type) for c in results.columns],
            fields=list(output_schema),
        )
    except pa.ArrowInvalid as exc:
        if "overflow" not in str(exc):
            raise
        raise _too_large(
            meta, "results", "checkpoint more often (a lower interval_records or interval_seconds)"
        ) from exc
    result_column = pa.concat_arrays(
        [
            pa.nulls(1 + n_el, result_storage),
            to_storage(result_struct, pa.struct(list(output_schema))),
        ]
    )

    def meta_then_nulls(value: Any, data_type: pa.DataType) -> pa.Array:
        return pa.concat_arrays([pa.array([value], data_type), pa.nulls(total - 1, data_type)])

    def constant(value: Any, data_type: pa.DataType) -> pa.Array:
        return pa.repeat(pa.scalar(value, data_type), total)

    def then_results(head: list[Any], tail: pa.Array, data_type: pa.DataType) -> pa.Array:
        """The metadata and element rows' values, then the result rows' ``tail``."""
        return pa.concat_arrays([pa.array(head, data_type), tail])

    parent = meta.parent
    result_stamps = (
        _int64_array(result_timestamps, "result_timestamps")
        if result_timestamps is not None
        else pa.nulls(n_res, pa.int64())
    )
    columns = {
        "job_id": constant(meta.job_id, pa.string()),
        "operator_id": constant(meta.operator_id, pa.string()),
        "run_id": constant(meta.run_id, pa.string()),
        "subtask": constant(meta.subtask, pa.int32()),
        "checkpoint_id": constant(meta.checkpoint_id, pa.int64()),
        "kind": then_results(kinds, pa.repeat(pa.scalar(KIND_RESULT), n_res), pa.string()),
        "seq": then_results([0, *range(n_el)], pa.array(range(n_res), pa.int64()), pa.int64()),
        "input_seq": pa.concat_arrays(
            [
                pa.nulls(1, pa.int64()),
                _int64_array(input_seqs if input_seqs is not None else [None] * n_el, "input_seqs"),
                pa.nulls(n_res, pa.int64()),
            ]
        ),
        "timestamp": then_results(timestamps, result_stamps, pa.int64()),
        "parent_run_id": meta_then_nulls(parent.run_id if parent else None, pa.string()),
        "parent_checkpoint_id": meta_then_nulls(
            parent.checkpoint_id if parent else None, pa.int64()
        ),
        "position": meta_then_nulls(meta.position, pa.int64()),
        "fingerprint": meta_then_nulls(meta.fingerprint, pa.string()),
        "in_flight": meta_then_nulls(meta.in_flight, pa.int64()),
        "result_count": meta_then_nulls(meta.result_count, pa.int64()),
        "final": meta_then_nulls(meta.final, pa.bool_()),
        "expired": meta_then_nulls(False, pa.bool_()),
        "created_at": meta_then_nulls(meta.created_at, pa.timestamp("us", tz="UTC")),
        "library_version": meta_then_nulls(meta.library_version, pa.string()),
        "properties": meta_then_nulls(json.dumps(meta.properties, sort_keys=True), pa.string()),
        "input": input_column,
        "result": result_column,
    }
    return pa.Table.from_arrays([columns[f.name] for f in schema], schema=schema)
