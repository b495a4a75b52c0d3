"""The ``delta_rs`` Python data source: Spark's side of the sink (needs PySpark).

Where each piece runs (measured on Spark 4.2, see docs/delta_sink.md):

* ``DeltaRsDataSource.writer``/``streamWriter`` run in a planning Python worker; the writer
  object is pickled to the executors and (batch) to the commit worker. For streaming,
  Spark builds a new writer for every micro-batch and again, from the data source, in the
  commit worker, which so plans again from the table as it is at commit time;
* ``write`` runs in each task on executors and returns a ``SinkCommitMessage`` that carries
  the plan the task wrote by;
* ``commit``/``abort`` run in a separate Python worker spawned by the driver JVM: they know
  only the options, the schema and the messages, and commit by the messages' plan.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import NullType, StructType

from .._exceptions import ConfigurationError, DeltaSinkError
from ._columns import spark_types, void_not_null
from ._sink import FORMAT_NAME
from ._sink_commit import (
    Outcome,
    WritePlan,
    abort_write,
    clean_after_commit,
    commit_write,
    load_table,
    plan_write,
    refuse_void,
)
from ._sink_files import DataFile, TableStorage, TaskFileWriter
from ._sink_options import SinkOptions


@dataclass(frozen=True)
class SinkCommitMessage(WriterCommitMessage):
    """What one successful task wrote, sent by Spark from the executor to ``commit``.

    ``plan`` is the plan the task wrote its files by (file schema with the NOT NULL flags
    its rows were checked against, partition columns): the commit checks the table against
    it, not against a plan of its own, which a streaming commit makes from the table as it
    is by then.
    """

    files: tuple[DataFile, ...]
    plan: WritePlan
    query_id: str | None
    batch_id: int | None
    partition_id: int
    attempt: int


class _DeltaWriter:
    """Shared by the batch and the streaming writer."""

    def __init__(self, options: Any, schema: StructType, overwrite: bool, *, streaming: bool):
        self._options = SinkOptions.parse(options, streaming=streaming)
        self._overwrite = overwrite
        _refuse_void_not_null(self._options, schema)
        try:
            arrow = to_arrow_schema(schema, timezone="UTC")
        except Exception as exc:  # pyspark raises its own errors for unsupported types
            raise ConfigurationError(
                f"The delta_rs sink cannot write the schema {schema.simpleString()}: {exc}. "
                "Cast the unsupported columns to types Delta tables can hold."
            ) from exc
        self._plan = plan_write(self._options, arrow, mode="overwrite" if overwrite else "append")

    def _write_task(self, batches: Iterator[pa.RecordBatch]) -> SinkCommitMessage:
        context = TaskContext.get()
        partition_id = context.partitionId() if context is not None else 0
        attempt = context.attemptNumber() if context is not None else 0
        batch_id = context.getLocalProperty("streaming.sql.batchId") if context else None
        query_id = context.getLocalProperty("sql.streaming.queryId") if context else None
        return write_task_files(
            self._options,
            self._plan,
            batches,
            partition_id=partition_id,
            attempt=attempt,
            batch_id=int(batch_id) if batch_id is not None else None,
            query_id=query_id,
        )

    def _commit(
        self,
        messages: list[WriterCommitMessage | None],
        app_id: str | None,
        version: int | None,
        query_id: str | None = None,
    ) -> Outcome:
        received = _messages(messages, self._options.table_uri)
        # A streaming commit worker builds its writer again, planning from the table as it
        # is now: a table made NOT NULL (or partitioned) meanwhile would look unchanged.
        # The files were laid out and their rows checked by the plan the tasks carried.
        plan = received[0].plan if received else self._plan
        files = [f for m in received for f in m.files]
        outcome = commit_write(
            self._options,
            plan,
            files,
            mode="overwrite" if self._overwrite else "append",
            app_id=app_id,
            version=version,
            query_id=query_id,
        )
        if outcome is Outcome.COMMITTED and self._options.clean_orphans:
            clean_after_commit(self._options)
        return outcome

    def _abort(self, messages: list[WriterCommitMessage | None]) -> None:
        files = [f for m in messages if isinstance(m, SinkCommitMessage) for f in m.files]
        abort_write(self._options, files)


def _refuse_void_not_null(options: SinkOptions, schema: StructType) -> None:
    """Refuse the void types Spark declares NOT NULL in ``schema`` (an empty ``array()``'s
    elements...), which Arrow cannot hold, naming with them the other voids ``plan_write``
    refuses: those in columns the table lacks (every one, for a new table). Named one
    write later, those had the user fix the write twice."""
    required = void_not_null(schema)
    if not required:
        return
    table = load_table(options.table_uri, options.storage_options)
    kept = {f.name for f in table.schema().fields} if table is not None else set()
    refuse_void(
        [
            path
            for column in schema.fields
            for path, kind in spark_types(column.dataType, column.name)
            if isinstance(kind, NullType) and (path in required or column.name not in kept)
        ]
    )


def write_task_files(
    options: SinkOptions,
    plan: WritePlan,
    batches: Iterator[pa.RecordBatch],
    *,
    partition_id: int,
    attempt: int,
    batch_id: int | None,
    query_id: str | None,
) -> SinkCommitMessage:
    """Write one task's batches as Parquet files and describe them for the commit."""
    writer = TaskFileWriter(
        TableStorage(options.table_uri, options.storage_options),
        plan.schema,
        plan.partition_by,
        compression=options.compression,
        max_records_per_file=options.max_records_per_file,
        file_tag=f"{partition_id:05d}",
    )
    try:
        for batch in batches:
            writer.write(batch)
        files = tuple(writer.close())
    except BaseException:
        writer.discard()
        raise
    return SinkCommitMessage(
        files=files,
        plan=plan,
        query_id=query_id,
        batch_id=batch_id,
        partition_id=partition_id,
        attempt=attempt,
    )


def _messages(
    messages: list[WriterCommitMessage | None], table_uri: str
) -> list[SinkCommitMessage]:
    received = []
    for message in messages:
        if not isinstance(message, SinkCommitMessage):
            raise DeltaSinkError(
                f"The commit to the Delta table at {table_uri} received "
                f"{type(message).__name__} instead of a delta_rs commit message: a task "
                "result is missing. Nothing was committed; re-run the write."
            )
        received.append(message)
    plans: list[WritePlan] = []
    for message in received:
        if message.plan not in plans:
            plans.append(message.plan)
    if len(plans) > 1:
        partitionings = sorted({p.partition_by for p in plans})
        what = (
            f"partitioned by {partitionings}"
            if len(partitionings) > 1
            else "with different schemas or NOT NULL flags"
        )
        raise DeltaSinkError(
            f"The tasks of one write to {table_uri} wrote their files by different plans "
            f"({what}): the table changed while the write was planned. Nothing was "
            "committed; re-run the write."
        )
    return received


class DeltaBatchWriter(_DeltaWriter, DataSourceArrowWriter):
    """``df.write.format("delta_rs")``: append or overwrite in one Delta commit."""

    def __init__(self, options: Any, schema: StructType, overwrite: bool) -> None:
        super().__init__(options, schema, overwrite, streaming=False)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkCommitMessage:
        return self._write_task(iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        # Inside foreachBatch the tasks carry the streaming query's id: recorded with the
        # commit, it tells a replayed batch from another query's batch of the same
        # txnVersion (a query restarted from a new checkpoint: its batch ids start at 0).
        query_id = _query_id(messages, self._options.table_uri)
        self._commit(messages, self._options.app_id, self._options.txn_version, query_id)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        self._abort(messages)


class DeltaStreamWriter(_DeltaWriter, DataSourceStreamArrowWriter):
    """``df.writeStream.format("delta_rs")``: one Delta commit per micro-batch, carrying the
    app transaction (query id or ``txnAppId``, batch id). Complete mode overwrites."""

    def __init__(self, options: Any, schema: StructType, overwrite: bool) -> None:
        super().__init__(options, schema, overwrite, streaming=True)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkCommitMessage:
        return self._write_task(iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        query_id = _query_id(messages, self._options.table_uri)
        self._commit(messages, self._options.app_id or query_id, batchId, query_id)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        self._abort(messages)


def _query_id(messages: list[WriterCommitMessage | None], table_uri: str) -> str | None:
    """The streaming query id the tasks of a micro-batch read from their TaskContext."""
    ids = {m.query_id for m in messages if isinstance(m, SinkCommitMessage) and m.query_id}
    if len(ids) > 1:
        raise DeltaSinkError(
            f"The tasks of one micro-batch reported different streaming query ids "
            f"({sorted(ids)}); nothing was committed to {table_uri}. Re-run the query; "
            "if it happens again, report it."
        )
    return ids.pop() if ids else None


class DeltaRsDataSource(DataSource):
    """The ``delta_rs`` format: writes Delta tables with delta-rs, no Delta JVM jars."""

    @classmethod
    def name(cls) -> str:
        return FORMAT_NAME

    def writer(self, schema: StructType, overwrite: bool) -> DeltaBatchWriter:
        return DeltaBatchWriter(self.options, schema, overwrite)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DeltaStreamWriter:
        return DeltaStreamWriter(self.options, schema, overwrite)
