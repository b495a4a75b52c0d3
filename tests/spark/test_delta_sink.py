"""The delta_rs sink: exactly-once Delta writes from Spark with delta-rs, no Delta jars.

Spark tests use the shared ``local[2,3]`` session (a failed task gets two more attempts);
the SIGKILL test runs its first driver in a subprocess (``sink_stream_driver.py``). Every
table is read back with deltalake, Polars and DuckDB, never through the sink itself.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import duckdb
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import sink_stream_driver as DRIVER  # a driver script: tests/spark is on pythonpath
from deltalake import DeltaTable, write_deltalake
from pyspark import TaskContext
from pyspark.errors import AnalysisException, StreamingQueryException
from pyspark.sql import functions as F

from checkpoint import delta_dataset
from checkpoint._layout import filesystem
from stateful_async import ConfigurationError, DeltaSinkError, SinkSchemaMismatchError
from stateful_async.spark import clean_orphan_files, register_delta_sink
from stateful_async.spark._sink_commit import (
    NEW_TABLE_MARK,
    Outcome,
    WritePlan,
    abort_write,
    commit_write,
    plan_write,
)
from stateful_async.spark._sink_files import DataFile, TableStorage, TaskFileWriter, as_file_schema
from stateful_async.spark._sink_options import SinkOptions
from stateful_async.spark._sink_source import (
    DeltaBatchWriter,
    DeltaRsDataSource,
    SinkCommitMessage,
    write_task_files,
)

HERE = Path(__file__).resolve().parent
SOURCE_ARROW = pa.schema(
    [
        ("id", pa.int64()),
        ("name", pa.string()),
        ("amount", pa.float64()),
        ("ts", pa.timestamp("us", tz="UTC")),
    ]
)


# -- helpers -----------------------------------------------------------------------------


def _rows(start: int, count: int) -> pa.Table:
    ids = list(range(start, start + count))
    return pa.table(
        {
            "id": ids,
            "name": [f"name-{i % 97}" if i % 11 else None for i in ids],
            "amount": [i * 0.5 for i in ids],
            "ts": [
                dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc) + dt.timedelta(seconds=i)
                for i in ids
            ],
        },
        schema=SOURCE_ARROW,
    )


def _write_source(directory: Path, files: int, rows_per_file: int) -> list[int]:
    """Parquet input files with consecutive ids, oldest first; returns every id."""
    directory.mkdir(parents=True)
    for n in range(files):
        path = directory / f"part-{n:03d}.parquet"
        pq.write_table(_rows(n * rows_per_file, rows_per_file), path)
        # The file source orders new files by modification time.
        os.utime(path, (1_700_000_000 + n, 1_700_000_000 + n))
    return list(range(files * rows_per_file))


def _ids(table_path: Path) -> list[int]:
    return sorted(
        delta_dataset(DeltaTable(str(table_path))).to_table(columns=["id"]).column("id").to_pylist()
    )


def _assert_exactly_once(table_path: Path, expected_ids: list[int]) -> None:
    """Every expected row once, as read by deltalake, Polars and DuckDB, right schema."""
    table = DeltaTable(str(table_path))
    data = delta_dataset(table).to_table()
    assert sorted(data.column("id").to_pylist()) == sorted(expected_ids)
    assert expected_ids == list(range(len(expected_ids)))  # as _write_source makes them
    assert data.sort_by("id").to_pylist() == _rows(0, len(expected_ids)).to_pylist()
    assert data.schema.field("ts").type == pa.timestamp("us", tz="UTC")
    assert table.count() == len(expected_ids)  # from the numRecords stats alone

    frame = pl.read_delta(str(table_path))
    assert frame.height == len(expected_ids)
    assert frame["id"].n_unique() == len(expected_ids)
    assert dict(frame.schema) == {
        "id": pl.Int64,
        "name": pl.String,
        "amount": pl.Float64,
        "ts": pl.Datetime("us", "UTC"),
    }

    con = duckdb.connect()
    con.register("sink_table", delta_dataset(table))
    n, distinct, total = con.execute(
        "SELECT count(*), count(DISTINCT id), sum(amount) FROM sink_table"
    ).fetchone()
    assert (n, distinct) == (len(expected_ids), len(expected_ids))
    assert total == pytest.approx(sum(i * 0.5 for i in expected_ids))


def _table_files(table_path: Path) -> set[str]:
    """Parquet files on disk under the table, relative to its root."""
    return {
        str(p.relative_to(table_path))
        for p in table_path.rglob("*.parquet")
        if "_delta_log" not in p.parts
    }


def _live_files(table_path: Path) -> set[str]:
    actions = pa.table(DeltaTable(str(table_path)).get_add_actions())
    return {unquote(p) for p in actions.column("path").to_pylist()}


def _poll(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def _delta_version(table_path: Path) -> int:
    """The table's latest version, -1 before its first commit."""
    if not DeltaTable.is_deltatable(str(table_path)):
        return -1
    return DeltaTable(str(table_path)).version()


@pytest.fixture(scope="module")
def sink(spark: Any) -> Any:
    register_delta_sink(spark)
    return spark


# -- fault injection (test-only subclasses, shipped to workers by value) -----------------


class _FaultyWriter(DeltaBatchWriter):
    def __init__(
        self, options: Any, schema: Any, overwrite: bool, fault: str, marker: str | None
    ) -> None:
        super().__init__(options, schema, overwrite)
        self._fault = fault
        self._marker = marker

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkCommitMessage:
        message = super().write(iterator)
        context = TaskContext.get()
        if (
            self._fault == "die-after-write"
            and context.partitionId() == 0
            and context.attemptNumber() == 0
        ):
            assert self._marker is not None
            Path(self._marker).write_text(json.dumps([f.path for f in message.files]))
            os._exit(1)  # the Python worker dies after its Parquet file is complete
        return message

    def commit(self, messages: list[Any]) -> None:
        if self._fault == "fail-before-commit":
            raise RuntimeError("injected failure before the Delta commit")
        super().commit(messages)
        if self._fault == "fail-after-commit":
            raise RuntimeError("injected failure after the Delta commit landed")


class _FaultySink(DeltaRsDataSource):
    @classmethod
    def name(cls) -> str:
        return "delta_rs_faulty"

    def writer(self, schema: Any, overwrite: bool) -> _FaultyWriter:
        options = dict(self.options)
        fault = options.pop("fault")
        marker = options.pop("marker", None)
        return _FaultyWriter(options, schema, overwrite, fault, marker)


@pytest.fixture(scope="module")
def faulty_sink(sink: Any) -> Iterator[Any]:
    from pyspark import cloudpickle

    # Workers cannot import this test module: ship its classes by value.
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    sink.dataSource.register(_FaultySink)
    yield sink
    cloudpickle.unregister_pickle_by_value(module)


# -- 1. streaming: stop, restart, SIGKILL -------------------------------------------------


@pytest.mark.spark
def test_streaming_stopped_midway_and_restarted_writes_every_row_once(
    sink: Any, tmp_path: Path
) -> None:
    source, table, checkpoint = tmp_path / "src", tmp_path / "table", tmp_path / "chk"
    expected = _write_source(source, files=8, rows_per_file=250)

    query = DRIVER.start_query(
        sink, str(source), str(table), str(checkpoint), interval="0.5 seconds"
    )
    try:
        _poll(lambda: _delta_version(table) >= 2, "three committed micro-batches")
    finally:
        query.stop()
    committed = _ids(table)
    assert len(committed) < len(expected), "the query should have been stopped mid-way"
    assert len(set(committed)) == len(committed)

    restarted = DRIVER.start_query(sink, str(source), str(table), str(checkpoint), interval=None)
    restarted.awaitTermination()
    assert restarted.id == query.id  # same checkpoint, same query id, same app id
    _assert_exactly_once(table, expected)
    last_batch = restarted.lastProgress["batchId"]
    assert DeltaTable(str(table)).transaction_version(str(query.id)) == last_batch


@pytest.mark.spark
def test_streaming_driver_killed_with_sigkill_resumes_exactly_once(
    sink: Any, tmp_path: Path
) -> None:
    import psutil

    source, table, checkpoint = tmp_path / "src", tmp_path / "table", tmp_path / "chk"
    expected = _write_source(source, files=12, rows_per_file=200)
    driver = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "sink_stream_driver.py"),
            str(source),
            str(table),
            str(checkpoint),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _poll(
            lambda: _delta_version(table) >= 3 or driver.poll() is not None,
            "the driver to commit four micro-batches",
            timeout=180,
        )
        assert driver.poll() is None, "the driver process exited on its own"
    finally:
        # SIGKILL the driver, its JVM and the JVM's Python workers, by pid.
        descendants = psutil.Process(driver.pid).children(recursive=True)
        driver.kill()
        for process in descendants:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        driver.wait(timeout=60)
        _, alive = psutil.wait_procs(descendants, timeout=60)
        assert alive == [], f"processes survived SIGKILL: {alive}"
    assert driver.returncode == -9
    before = _ids(table)
    assert 0 < len(before) < len(expected), "the kill should land mid-way"
    assert len(set(before)) == len(before)

    restarted = DRIVER.start_query(sink, str(source), str(table), str(checkpoint), interval=None)
    restarted.awaitTermination()
    _assert_exactly_once(table, expected)

    # Files the killed run wrote but never committed are orphans; cleaning removes only them.
    live, on_disk = _live_files(table), _table_files(table)
    orphans = clean_orphan_files(str(table), older_than=dt.timedelta(0))
    assert set(orphans) == on_disk - live
    assert _table_files(table) == live
    _assert_exactly_once(table, expected)


# -- 2. a task that dies after writing its file -----------------------------------------


@pytest.mark.spark
def test_task_dying_after_writing_its_file_is_never_committed(
    faulty_sink: Any, tmp_path: Path
) -> None:
    table, marker = tmp_path / "table", tmp_path / "attempt0-files.json"
    df = faulty_sink.range(0, 3000, numPartitions=3).selectExpr("id", "id * 2 AS doubled")

    (
        df.write.format("delta_rs_faulty")
        .option("fault", "die-after-write")
        .option("marker", str(marker))
        .mode("append")
        .save(str(table))
    )

    dead_files = json.loads(marker.read_text())
    assert dead_files, "attempt 0 of partition 0 wrote a file before dying"
    on_disk = _table_files(table)
    live = _live_files(table)
    assert set(dead_files) <= on_disk  # the dead attempt's file is complete on disk ...
    assert not set(dead_files) & live  # ... but in no Delta version
    data = delta_dataset(DeltaTable(str(table))).to_table()
    assert sorted(data.column("id").to_pylist()) == list(range(3000))
    assert data.column("doubled").to_pylist() == [i * 2 for i in data.column("id").to_pylist()]
    assert DeltaTable(str(table)).version() == 0  # one transaction

    # The maintenance call finds exactly those orphans, and a dry run deletes nothing.
    fresh = clean_orphan_files(str(table))  # default grace period: one hour
    assert fresh == []
    found = clean_orphan_files(str(table), older_than=dt.timedelta(0), dry_run=True)
    assert found == sorted(dead_files)
    assert clean_orphan_files(str(table), older_than=0, dry_run=True) == found  # seconds
    assert clean_orphan_files(str(table), older_than=np.float64(0), dry_run=True) == found
    assert clean_orphan_files(str(table), older_than=3600.0, dry_run=True) == []
    assert set(dead_files) <= _table_files(table)

    # The cleanOrphans option does the same after a later commit (no grace period here).
    (
        faulty_sink.range(3000, 3100, numPartitions=1)
        .selectExpr("id", "id * 2 AS doubled")
        .write.format("delta_rs")
        .option("cleanOrphans", "true")
        .option("orphanRetentionSeconds", "0")
        .mode("append")
        .save(str(table))
    )
    assert not set(dead_files) & _table_files(table)
    assert _table_files(table) == _live_files(table)
    assert _ids(table) == list(range(3100))
    assert clean_orphan_files(str(table), older_than=dt.timedelta(0)) == []


@pytest.mark.spark
def test_abort_keeps_a_landed_commit_and_deletes_one_that_did_not_land(
    faulty_sink: Any, tmp_path: Path
) -> None:
    table = tmp_path / "table"
    df = faulty_sink.range(0, 1000, numPartitions=2).selectExpr("id")

    # commit() lands, then raises: Spark calls abort(), which must keep the files.
    with pytest.raises(AnalysisException) as landed:
        df.write.format("delta_rs_faulty").option("fault", "fail-after-commit").mode("append").save(
            str(table)
        )
    assert "injected failure after the Delta commit landed" in str(landed.value)
    assert _ids(table) == list(range(1000))
    assert _table_files(table) == _live_files(table)  # abort deleted nothing
    assert delta_dataset(DeltaTable(str(table))).to_table().num_rows == 1000  # files readable

    # commit() fails before committing: abort() deletes the write's files.
    with pytest.raises(AnalysisException) as failed:
        faulty_sink.range(5000, 6000, numPartitions=2).selectExpr("id").write.format(
            "delta_rs_faulty"
        ).option("fault", "fail-before-commit").mode("append").save(str(table))
    assert "injected failure before the Delta commit" in str(failed.value)
    assert _ids(table) == list(range(1000))
    assert _table_files(table) == _live_files(table)  # no orphan left behind


# -- 3. a replayed batch id ----------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.parametrize("txn_app_id", [None, "enrich"], ids=["query-id", "txnAppId"])
def test_replayed_batch_is_refused_without_duplicates(
    sink: Any, tmp_path: Path, txn_app_id: str | None
) -> None:
    # With txnAppId, the refusal also asks which query committed the batch: the same one
    # (Spark keeps the query id across restarts from a checkpoint), so it is a replay.
    source, table, checkpoint = tmp_path / "src", tmp_path / "table", tmp_path / "chk"
    options = {} if txn_app_id is None else {"txnAppId": txn_app_id}
    expected = _write_source(source, files=3, rows_per_file=300)
    first = DRIVER.start_query(
        sink, str(source), str(table), str(checkpoint), interval=None, **options
    )
    first.awaitTermination()
    _assert_exactly_once(table, expected)
    last = max(int(p.name) for p in (checkpoint / "commits").iterdir() if p.name.isdigit())
    version_before = DeltaTable(str(table)).version()
    assert DeltaTable(str(table)).transaction_version(txn_app_id or str(first.id)) == last

    # Forget that the last batch was committed: Spark replays it with the same batch id.
    (checkpoint / "commits" / str(last)).unlink()
    crc = checkpoint / "commits" / f".{last}.crc"
    if crc.exists():
        crc.unlink()
    replay = DRIVER.start_query(
        sink, str(source), str(table), str(checkpoint), interval=None, **options
    )
    replay.awaitTermination()
    assert replay.id == first.id

    assert (checkpoint / "commits" / str(last)).exists()  # Spark did run the batch again
    assert DeltaTable(str(table)).version() == version_before  # ... and nothing was committed
    _assert_exactly_once(table, expected)
    assert _table_files(table) == _live_files(table)  # the replay's files were removed


@pytest.mark.spark
def test_a_new_query_given_another_querys_txn_app_id_fails_instead_of_losing_rows(
    sink: Any, tmp_path: Path
) -> None:
    source, table = tmp_path / "src", tmp_path / "table"
    expected = _write_source(source, files=3, rows_per_file=100)
    first = DRIVER.start_query(
        sink, str(source), str(table), str(tmp_path / "chk1"), interval=None, txnAppId="enrich"
    )
    first.awaitTermination()
    _assert_exactly_once(table, expected)
    assert DeltaTable(str(table)).transaction_version("enrich") == 2

    # A second query (its own checkpoint, so its own query id and batch ids from 0) with
    # the same txnAppId: each of its batches was refused as a replay, its rows lost.
    second = DRIVER.start_query(
        sink, str(source), str(table), str(tmp_path / "chk2"), interval=None, txnAppId="enrich"
    )
    with pytest.raises(StreamingQueryException) as failure:
        second.awaitTermination()
    assert re.search(
        rf"already holds batch 2 of app id 'enrich', committed by another streaming query "
        rf"\({first.id}\); this query \({second.id}\) is at batch 0, so its batches would be "
        r"refused as replays",
        str(failure.value),
    ), str(failure.value)
    assert DeltaTable(str(table)).version() == 2
    _assert_exactly_once(table, expected)
    assert _table_files(table) == _live_files(table)  # the failed batch's files were removed


@pytest.mark.spark
@pytest.mark.parametrize("history", ["kept", "cleaned up"])
def test_foreach_batch_writes_of_a_query_restarted_from_a_new_checkpoint_fail_not_vanish(
    sink: Any, tmp_path: Path, history: str
) -> None:
    # The documented foreachBatch pattern (a fixed txnAppId, txnVersion = batch id). A
    # query restarted from a new checkpoint location starts its batch ids at 0: its writes
    # were refused as replays of the first query's batches, its rows silently dropped.
    # Which query committed a batch was then read from the last 1,000 commits' info only:
    # once the log was cleaned up (or 1,000 other commits later) the rows were dropped.
    from pyspark.sql.utils import CapturedException

    source, table = tmp_path / "src", tmp_path / "table"
    expected = _write_source(source, files=3, rows_per_file=100)

    def each_batch(batch_df: Any, batch_id: int) -> None:
        (
            batch_df.write.format("delta_rs")
            .mode("append")
            .option("txnAppId", "enrich-orders")
            .option("txnVersion", batch_id)
            .save(str(table))
        )

    def run(checkpoint: Path) -> Any:
        return (
            sink.readStream.schema(DRIVER.SOURCE_SCHEMA)
            .option("maxFilesPerTrigger", 1)
            .parquet(str(source))
            .writeStream.foreachBatch(each_batch)
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )

    first = run(tmp_path / "chk1")
    first.awaitTermination()
    _assert_exactly_once(table, expected)
    assert DeltaTable(str(table)).transaction_version("enrich-orders") == 2
    named = rf" \({first.id}\)"
    if history == "cleaned up":
        _forget_history(table)
        named = ""  # its commits are gone from the log: the query is not named
    version = DeltaTable(str(table)).version()
    second = run(tmp_path / "chk2")
    with pytest.raises(CapturedException) as failure:
        second.awaitTermination()
    assert re.search(
        rf"already holds batch 2 of app id 'enrich-orders', committed by another streaming "
        rf"query{named}; this query \({second.id}\) is at batch 0",
        str(failure.value),
    ), str(failure.value)
    assert DeltaTable(str(table)).version() == version
    _assert_exactly_once(table, expected)
    assert _table_files(table) == _live_files(table)  # the failed batch's files were removed


@pytest.mark.parametrize("change", ["created meanwhile", "schema replaced meanwhile"])
def test_a_table_made_not_null_while_a_write_ran_refuses_its_commit(
    tmp_path: Path, change: str
) -> None:
    # NOT NULL flags were read when the write was planned, and its tasks checked nulls
    # against those: a table created (or its schema replaced) meanwhile with NOT NULL
    # fields took the write's nulls, and with a nested one delta-rs could no longer read it.
    table = tmp_path / "table"
    key = pa.struct([("p", pa.int64())])
    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("s", pa.struct([("a", pa.int64())])),
            ("mk", pa.map_(key, pa.int64())),
            ("tags", pa.list_(pa.struct([("q", pa.int64())]))),
            ("mv", pa.map_(pa.string(), pa.int64())),
        ]
    )
    strict = pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False),
            pa.field("s", pa.struct([pa.field("a", pa.int64(), nullable=False)])),
            # a field inside a map's key (it was not looked at)
            ("mk", pa.map_(pa.struct([pa.field("p", pa.int64(), nullable=False)]), pa.int64())),
            # list elements and map values, named as the checks before the job name them
            pa.field(
                "tags",
                pa.list_(
                    pa.field(
                        "element",
                        pa.struct([pa.field("q", pa.int64(), nullable=False)]),
                        nullable=False,
                    )
                ),
            ),
            ("mv", pa.map_(pa.string(), pa.field("value", pa.int64(), nullable=False))),
        ]
    )
    if change == "schema replaced meanwhile":
        write_deltalake(
            str(table),
            pa.table(
                {"id": [0], "s": [{"a": 0}], "mk": [None], "tags": [None], "mv": [None]},
                schema=schema,
            ),
        )
    opts = _unit_options(table)
    plan = plan_write(opts, schema)
    data = pa.table(
        {
            "id": [1, None],
            "s": [{"a": None}, None],
            "mk": [[({"p": None}, 1)], None],
            "tags": [[None, {"q": None}], None],
            "mv": [[("k", None)], None],
        },
        schema=schema,
    )
    message = write_task_files(
        opts, plan, iter(data.to_batches()), partition_id=0, attempt=0, batch_id=0,
        query_id="q",
    )  # fmt: skip
    write_deltalake(
        str(table), pa.table(
            {"id": [7], "s": [{"a": 7}], "mk": [None], "tags": [None], "mv": [None]},
            schema=strict,
        ),
        mode="overwrite", schema_mode="overwrite",
    )  # fmt: skip
    before = DeltaTable(str(table)).version()
    with pytest.raises(
        SinkSchemaMismatchError,
        match=r"declares 'id', 's\.a', 'mk\{key\}\.p', the elements of 'tags', 'tags\[\]\.q', "
        r"the values of 'mv' NOT NULL, which it did not when this write was planned",
    ):
        commit_write(opts, plan, list(message.files), mode="append", app_id="q", version=0)
    assert DeltaTable(str(table)).version() == before
    assert DeltaTable(str(table)).to_pyarrow_table().to_pylist() == [
        {"id": 7, "s": {"a": 7}, "mk": None, "tags": None, "mv": None}
    ]


@pytest.mark.spark
def test_a_table_made_not_null_while_a_micro_batch_ran_refuses_its_commit(
    sink: Any, tmp_path: Path
) -> None:
    # Spark builds a streaming writer again in the commit worker, which planned from the
    # table as it was by then, NOT NULL flags included: the check saw no change, the
    # commit landed the batch's null in 's.a' and delta-rs could no longer read the table.
    source, table, marker = tmp_path / "src", tmp_path / "table", tmp_path / "overwritten"
    schema = pa.schema([("id", pa.int64()), ("s", pa.struct([("a", pa.int64())]))])
    strict = pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False),
            pa.field("s", pa.struct([pa.field("a", pa.int64(), nullable=False)])),
        ]
    )
    source.mkdir()
    for n, row in enumerate([{"id": 1, "s": {"a": 1}}, {"id": 2, "s": {"a": None}}]):
        pq.write_table(pa.Table.from_pylist([row], schema=schema), source / f"{n}.parquet")
        os.utime(source / f"{n}.parquet", (1_700_000_000 + n, 1_700_000_000 + n))

    def another_writer_meanwhile(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        # In micro-batch 1's task: after the batch was planned, before the sink writes it.
        batch_id = TaskContext.get().getLocalProperty("streaming.sql.batchId")
        if batch_id == "1" and not marker.exists():
            marker.touch()
            replacement = pa.table({"id": [7], "s": [{"a": 7}]}, schema=strict)
            write_deltalake(str(table), replacement, mode="overwrite", schema_mode="overwrite")
        yield from batches

    stream = sink.readStream.schema("id long, s struct<a: long>")
    stream = stream.option("maxFilesPerTrigger", 1).parquet(str(source))
    query = (
        stream.mapInArrow(another_writer_meanwhile, stream.schema)
        .writeStream.format("delta_rs")
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(availableNow=True)
        .start(str(table))
    )
    with pytest.raises(StreamingQueryException) as failure:
        query.awaitTermination()
    text = str(failure.value)
    assert "SinkSchemaMismatchError" in text, text
    assert re.search(
        r"declares 'id', 's\.a' NOT NULL, which it did not when this write was planned", text
    ), text
    assert marker.exists()
    assert DeltaTable(str(table)).version() == 1  # batch 0, then the other writer's overwrite
    assert DeltaTable(str(table)).to_pyarrow_table().to_pylist() == [{"id": 7, "s": {"a": 7}}]
    assert clean_orphan_files(str(table), older_than=0, dry_run=True) == []  # files removed


def test_a_commit_refuses_messages_of_tasks_that_wrote_by_different_plans(
    tmp_path: Path,
) -> None:
    from pyspark.sql.types import LongType, StructField, StructType

    table = tmp_path / "table"
    write_deltalake(str(table), pa.table({"id": [0]}))
    options = {"path": str(table)}
    writer = DeltaBatchWriter(options, StructType([StructField("id", LongType())]), False)
    opts = SinkOptions.parse(options, streaming=False)
    plans = [
        plan_write(opts, pa.schema([("id", pa.int64())])),
        WritePlan(pa.schema([pa.field("id", pa.int64(), nullable=False)]), ()),
    ]
    messages = [
        write_task_files(
            opts,
            plan,
            iter([pa.record_batch({"id": [n]})]),
            partition_id=n,
            attempt=0,
            batch_id=None,
            query_id=None,
        )  # fmt: skip
        for n, plan in enumerate(plans)
    ]
    assert [m.plan for m in messages] == plans
    with pytest.raises(DeltaSinkError, match="wrote their files by different plans"):
        writer.commit(messages)
    assert DeltaTable(str(table)).version() == 0


def _forget_history(table: Path) -> None:
    """Clean the table's log up to a new checkpoint: ``history()`` then holds its last
    version only, as a table whose log retention has passed."""
    DeltaTable(str(table)).alter.set_table_properties(
        {"delta.logRetentionDuration": "interval 0 seconds"}
    )
    current = DeltaTable(str(table))
    current.create_checkpoint()
    current.cleanup_metadata()
    assert [e["version"] for e in DeltaTable(str(table)).history()] == [current.version()]


def _unit_options(table: Path, **extra: str) -> SinkOptions:
    return SinkOptions.parse({"path": str(table), **extra}, streaming=True)


def _unit_write(opts: SinkOptions, start: int, count: int, batch_id: int) -> list[DataFile]:
    plan = plan_write(opts, SOURCE_ARROW)
    message = write_task_files(
        opts,
        plan,
        iter(_rows(start, count).to_batches()),
        partition_id=0,
        attempt=0,
        batch_id=batch_id,
        query_id="query-1",
    )
    assert message.batch_id == batch_id
    return list(message.files)


def test_commit_refuses_versions_at_or_below_the_recorded_one(tmp_path: Path) -> None:
    table = tmp_path / "table"
    opts = _unit_options(table)
    plan = plan_write(opts, SOURCE_ARROW)

    files = _unit_write(opts, 0, 100, batch_id=3)
    assert (
        commit_write(opts, plan, files, mode="append", app_id="q", version=3) is Outcome.COMMITTED
    )
    # The same commit retried (same files) is recognised as landed, and keeps its files.
    assert (
        commit_write(opts, plan, files, mode="append", app_id="q", version=3) is Outcome.COMMITTED
    )
    assert {f.path for f in files} <= _table_files(table)

    for version in (3, 2):
        replay = _unit_write(opts, 0, 100, batch_id=version)
        outcome = commit_write(opts, plan, replay, mode="append", app_id="q", version=version)
        assert outcome is Outcome.REFUSED
        assert not {f.path for f in replay} & _table_files(table)  # refused files deleted
    assert DeltaTable(str(table)).version() == 0
    assert _ids(table) == list(range(100))

    newer = _unit_write(opts, 100, 50, batch_id=4)
    assert (
        commit_write(opts, plan, newer, mode="append", app_id="q", version=4) is Outcome.COMMITTED
    )
    assert DeltaTable(str(table)).transaction_version("q") == 4
    assert _ids(table) == list(range(150))


def test_a_refused_version_is_a_replay_only_for_the_query_that_committed_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    table = tmp_path / "table"
    opts = _unit_options(table, txnAppId="shared")
    plan = plan_write(opts, SOURCE_ARROW)

    def commit(start: int, version: int, query_id: str | None) -> Outcome:
        files = _unit_write(opts, start, 10, batch_id=version)
        return commit_write(
            opts, plan, files, mode="append", app_id="shared", version=version, query_id=query_id
        )

    assert commit(0, 3, "query-1") is Outcome.COMMITTED
    assert commit(0, 3, "query-1") is Outcome.REFUSED  # the same query's replay
    assert "(a replayed batch of this query)" in caplog.text
    caplog.clear()
    # No query to tell (foreachBatch under Spark Connect, say): refused, as a replay would
    # be, and the warning says the query could not be checked (it claimed "a replay").
    assert commit(0, 2, None) is Outcome.REFUSED
    assert "could not check which query committed that version" in caplog.text
    assert "give each checkpoint location its own txnAppId" in caplog.text
    with pytest.raises(DeltaSinkError, match=r"committed by another streaming query \(query-1\)"):
        commit(0, 0, "query-2")
    assert commit(10, 4, "query-2") is Outcome.COMMITTED  # a later version is not a replay
    with pytest.raises(DeltaSinkError, match=r"another streaming query \(query-2\)"):
        commit(20, 4, "query-1")
    assert DeltaTable(str(table)).transaction_version("shared") == 4
    assert _ids(table) == list(range(20))


def test_a_new_query_is_told_from_a_replay_after_the_history_is_cleaned_up(
    tmp_path: Path,
) -> None:
    # Which query committed a version was read from the last 1,000 commits' info only: past
    # them, or once the log was cleaned up, a new query's batches were refused as replays.
    table = tmp_path / "table"
    opts = _unit_options(table, txnAppId="shared")
    plan = plan_write(opts, SOURCE_ARROW)

    def commit(start: int, version: int, query_id: str) -> Outcome:
        files = _unit_write(opts, start, 10, batch_id=version)
        return commit_write(
            opts, plan, files, mode="append", app_id="shared", version=version, query_id=query_id
        )

    assert commit(0, 0, "query-1") is Outcome.COMMITTED
    assert commit(10, 1, "query-1") is Outcome.COMMITTED
    _forget_history(table)
    assert commit(10, 1, "query-1") is Outcome.REFUSED  # still the same query's replay
    assert commit(0, 0, "query-1") is Outcome.REFUSED
    with pytest.raises(
        DeltaSinkError,
        match=r"holds batch 1 of app id 'shared', committed by another streaming query; "
        r"this query \(query-2\) is at batch 0",
    ):
        commit(20, 0, "query-2")
    # A query that committed under the app id before another one went further.
    assert commit(20, 2, "query-2") is Outcome.COMMITTED
    with pytest.raises(DeltaSinkError, match=r"another streaming query \(query-2\)"):
        commit(30, 2, "query-1")
    current = DeltaTable(str(table))
    assert current.transaction_version("shared") == 2
    assert current.transaction_version("shared@query-1") == 1
    assert current.transaction_version("shared@query-2") == 2
    assert _ids(table) == list(range(30))


def test_versions_committed_before_queries_were_recorded_fall_back_to_the_history(
    tmp_path: Path,
) -> None:
    # A table whose app id was committed as this sink did before it recorded each query's
    # app transaction: only the commit info names the query.
    from deltalake.transaction import CommitProperties, Transaction

    from stateful_async.spark._sink_commit import APP_ID_KEY, QUERY_ID_KEY

    table = tmp_path / "table"
    legacy = CommitProperties(
        custom_metadata={APP_ID_KEY: "shared", QUERY_ID_KEY: "query-1"},
        app_transactions=[Transaction("shared", 3)],
    )
    write_deltalake(str(table), _rows(0, 10), commit_properties=legacy)
    opts = _unit_options(table, txnAppId="shared")
    plan = plan_write(opts, SOURCE_ARROW)

    def commit(version: int, query_id: str) -> Outcome:
        files = _unit_write(opts, 10, 10, batch_id=version)
        return commit_write(
            opts, plan, files, mode="append", app_id="shared", version=version, query_id=query_id
        )

    assert commit(3, "query-1") is Outcome.REFUSED  # the history names this query
    with pytest.raises(DeltaSinkError, match=r"another streaming query \(query-1\)"):
        commit(0, "query-2")
    _forget_history(table)
    assert commit(0, "query-2") is Outcome.REFUSED  # as documented: nothing left to tell
    assert _ids(table) == list(range(10))


def test_abort_deletes_only_files_whose_commit_did_not_land(tmp_path: Path) -> None:
    table = tmp_path / "table"
    opts = _unit_options(table)
    plan = plan_write(opts, SOURCE_ARROW)
    landed = _unit_write(opts, 0, 10, batch_id=0)
    commit_write(opts, plan, landed, mode="append", app_id="q", version=0)
    assert abort_write(opts, landed) == []
    assert {f.path for f in landed} <= _table_files(table)

    lost = _unit_write(opts, 10, 10, batch_id=1)
    assert sorted(abort_write(opts, lost)) == sorted(f.path for f in lost)
    assert _table_files(table) == {f.path for f in landed}
    assert _ids(table) == list(range(10))

    # Commits without commit info (the Delta protocol leaves it optional) are missing from
    # delta-rs's history: after 32 of them, a landed commit was taken for a lost one and
    # its files deleted from under the table.
    version = DeltaTable(str(table)).version()
    for v in range(version + 1, version + 41):
        txn = {"txn": {"appId": "another-writer", "version": v, "lastUpdated": 0}}
        (table / "_delta_log" / f"{v:020d}.json").write_text(json.dumps(txn) + "\n")
    assert abort_write(opts, landed) == []
    assert _ids(table) == list(range(10))


def test_a_commit_that_landed_before_delta_rs_failed_counts_as_committed(tmp_path: Path) -> None:
    # delta-rs writes a log checkpoint after every checkpointInterval commits, and raises if
    # that fails, though the commit is in: the sink reported the write failed ("Spark
    # removes its files", which abort rightly did not), and a re-run wrote the rows twice.
    table = tmp_path / "table"
    write_deltalake(str(table), _rows(0, 10), configuration={"delta.checkpointInterval": "1"})
    (table / "_delta_log" / f"{1:020d}.checkpoint.parquet").mkdir()  # where it goes: taken
    opts = _unit_options(table)
    files = _unit_write(opts, 10, 10, batch_id=0)
    plan = plan_write(opts, SOURCE_ARROW)
    outcome = commit_write(opts, plan, files, mode="append", app_id=None, version=None)
    assert outcome is Outcome.COMMITTED
    assert _ids(table) == list(range(20))


# -- 4. batch append, overwrite, schemas ---------------------------------------------------


@pytest.mark.spark
def test_batch_append_overwrite_and_schema_rules(sink: Any, tmp_path: Path) -> None:
    table = str(tmp_path / "table")
    first = sink.range(0, 1000, numPartitions=2).selectExpr("id", "CAST(id AS STRING) AS label")
    second = sink.range(1000, 1500, numPartitions=2).selectExpr("id", "CAST(id AS STRING) AS label")
    first.write.format("delta_rs").mode("append").save(table)
    second.write.format("delta_rs").mode("append").save(table)
    assert _ids(Path(table)) == list(range(1500))

    replacement = sink.range(7000, 7100, numPartitions=1).selectExpr(
        "id", "CONCAT('r', id) AS label"
    )
    replacement.write.format("delta_rs").mode("overwrite").save(table)
    current = DeltaTable(table)
    assert _ids(Path(table)) == list(range(7000, 7100))
    assert set(delta_dataset(current).to_table().column("label").to_pylist()) == {
        f"r{i}" for i in range(7000, 7100)
    }
    assert current.history(1)[0]["operationParameters"]["mode"] == "Overwrite"
    previous = DeltaTable(table)
    previous.load_as_version(current.version() - 1)
    assert previous.count() == 1500  # time travel still sees the overwritten files

    version = current.version()
    wrong = sink.range(0, 10).selectExpr("CAST(id AS STRING) AS id", "CAST(id AS STRING) AS label")
    with pytest.raises(AnalysisException) as mismatch:
        wrong.write.format("delta_rs").mode("append").save(table)
    text = str(mismatch.value)
    assert "SinkSchemaMismatchError" in text
    assert "the column 'id' is long in the table but string in the data" in text, text
    assert "Select and cast the columns to match the table." in text
    assert "mergeSchema" not in text  # it cannot change a type
    assert DeltaTable(table).version() == version  # nothing committed ...
    assert _table_files(Path(table)) >= _live_files(Path(table))
    assert DeltaTable(table).count() == 100

    extra = sink.range(9000, 9010).selectExpr(
        "id", "CAST(id AS STRING) AS label", "id * 3 AS tripled"
    )
    with pytest.raises(AnalysisException) as refused:
        extra.write.format("delta_rs").mode("append").save(table)
    assert "the data column 'tripled' is not in the table" in str(refused.value)
    assert "or set the option mergeSchema=true to add new columns." in str(refused.value)
    extra.write.format("delta_rs").mode("append").option("mergeSchema", "true").save(table)
    merged = delta_dataset(DeltaTable(table)).to_table().sort_by("id")
    assert merged.schema.names == ["id", "label", "tripled"]
    assert merged.column("tripled").to_pylist() == [None] * 100 + [i * 3 for i in range(9000, 9010)]


def _refusals_with_and_without_merge(table: str, data: pa.Schema) -> set[str]:
    """What the sink's plan of a write of ``data`` to ``table`` is refused with, with
    mergeSchema and without (one message if it says the same either way)."""
    refusals = set()
    for merge in ("false", "true"):
        options = SinkOptions.parse({"path": table, "mergeSchema": merge}, streaming=False)
        with pytest.raises(SinkSchemaMismatchError) as caught:
            plan_write(options, data)
        refusals.add(str(caught.value))
    return refusals


def test_a_column_spelt_in_another_case_is_named_not_offered_to_merge_schema(
    tmp_path: Path,
) -> None:
    # The data's 'ID' was reported as a new column, with the advice to set mergeSchema=true,
    # and with it as the table's 'id' missing from the data: neither says what is wrong.
    table = str(tmp_path / "t")
    write_deltalake(table, pa.table({"id": [1], "label": ["a"]}))
    data = pa.schema([("ID", pa.int64()), ("label", pa.string())])
    assert _refusals_with_and_without_merge(table, data) == {
        f"The data's schema does not match the Delta table at {table}: the table column "
        "'id' is 'ID' in the data (Delta column names are case-insensitive, but a write "
        "must spell them as the table does: rename it with withColumnRenamed('ID', "
        "'id'))."  # ended with 'Select and cast the columns to match the table.' too
    }
    # With a difference a rename does not mend, the advice that mends it follows.
    data = pa.schema([("ID", pa.int64()), ("label", pa.int64())])
    options = SinkOptions.parse({"path": table}, streaming=False)
    with pytest.raises(SinkSchemaMismatchError) as caught:
        plan_write(options, data)
    assert str(caught.value).endswith(
        "withColumnRenamed('ID', 'id')); the column 'label' is string in the table but long "
        "in the data. Select and cast the columns to match the table."
    )
    assert DeltaTable(table).schema().to_arrow().names == ["id", "label"]


def test_a_field_spelt_in_another_case_is_named_not_blamed_on_its_type(tmp_path: Path) -> None:
    # The data's s<name> for the table's s<Name> was reported as 'the column 's' is
    # struct<Name: string> in the table but struct<name: string> in the data', leaving the
    # reader to spot the case, with the advice to cast, which keeps the data's names.
    table = str(tmp_path / "t")

    def struct(*names: str) -> pa.StructType:
        return pa.struct([(name, pa.string()) for name in names])

    write_deltalake(
        table,
        pa.table(
            {
                "s": pa.array([{"Name": "a", "x": "b"}], struct("Name", "x")),
                "l": pa.array([[{"X": "c"}]], pa.list_(struct("X"))),
                "m": pa.array([[({"K": "k"}, {"a": "v"})]], pa.map_(struct("K"), struct("a"))),
            }
        ),
    )

    def renamed(table_path: str, data_path: str, column: str) -> str:
        return (
            f"the table field {table_path!r} is {data_path!r} in the data (Delta field names "
            "are case-insensitive, but a write must spell them as the table does: rebuild the "
            f"column {column!r} with the table's field names, e.g. with named_struct)"
        )

    data = pa.schema(
        [
            ("S", struct("name", "x")),
            ("l", pa.list_(struct("x"))),
            ("m", pa.map_(struct("k"), struct("A"))),
        ]
    )
    assert _refusals_with_and_without_merge(table, data) == {
        f"The data's schema does not match the Delta table at {table}: the table column "
        "'s' is 'S' in the data (Delta column names are case-insensitive, but a write must "
        "spell them as the table does: rename it with withColumnRenamed('S', 's')); "
        + "; ".join(
            [
                renamed("s.Name", "S.name", "S"),
                renamed("l[].X", "l[].x", "l"),
                renamed("m{key}.K", "m{key}.k", "m"),
                renamed("m{}.a", "m{}.A", "m"),
            ]
        )
        + "."
    }
    # A type difference besides is still named, once the names are spelt alike.
    data = pa.schema([("s", pa.struct([("name", pa.string()), ("x", pa.int64())]))])
    with pytest.raises(SinkSchemaMismatchError) as caught:
        plan_write(SinkOptions.parse({"path": table}, streaming=False), data)
    assert str(caught.value) == (
        f"The data's schema does not match the Delta table at {table}: "
        + renamed("s.Name", "s.name", "s")
        + "; the column 's' is struct<Name: string, x: string> in the table but struct<name: "
        "string, x: long> in the data; the table column 'l' is missing from the data; the "
        "table column 'm' is missing from the data. Select and cast the columns to match the "
        "table."
    )


def test_struct_fields_in_another_order_are_named_not_advised_a_cast(tmp_path: Path) -> None:
    # The data's s<b, a> for the table's s<a, b> was refused with 'Select and cast the
    # columns to match the table.': Spark casts a struct by position, so that cast puts b's
    # values into a (or fails on them), and with two fields of one type swaps them silently.
    table = str(tmp_path / "t")
    ab = pa.struct([("a", pa.string()), ("b", pa.int64())])
    row = {"a": "x", "b": 1}
    write_deltalake(
        table, pa.table({"s": pa.array([row], ab), "l": pa.array([[row]], pa.list_(ab))})
    )
    ba = pa.struct([("b", pa.int64()), ("a", pa.string())])
    data = pa.schema([("s", ba), ("l", pa.list_(ba))])
    with pytest.raises(SinkSchemaMismatchError) as caught:
        plan_write(SinkOptions.parse({"path": table}, streaming=False), data)
    advice = (
        " in the data (rebuild it in the table's order, e.g. with named_struct; a cast would "
        "match the fields by position, not by name)"
    )
    assert str(caught.value) == (
        f"The data's schema does not match the Delta table at {table}: the column 's' has the "
        "table's struct fields in another order: struct<a: string, b: long> in the table but "
        f"struct<b: long, a: string>{advice}; the column 'l' has the table's struct fields in "
        "another order: array<struct<a: string, b: long>> in the table but array<struct<b: "
        f"long, a: string>>{advice}."
    )
    # In another order and of another type too: the advice was 'Select and cast', which
    # casts by position.
    other = pa.schema(
        [("s", pa.struct([("b", pa.int32()), ("a", pa.string())])), ("l", data[1].type)]
    )
    with pytest.raises(SinkSchemaMismatchError) as caught:
        plan_write(SinkOptions.parse({"path": table}, streaming=False), other)
    said = str(caught.value)
    assert (
        "the column 's' is struct<a: string, b: long> in the table but struct<b: integer, a: "
        "string> in the data, its struct fields in another order (rebuild it in the table's "
        "order, e.g. with named_struct, casting each field to the table's type; a cast of the "
        "whole column would match the fields by position, not by name)" in said
    )
    assert "Select and cast" not in said


@pytest.mark.spark
def test_idempotent_batch_write_with_txn_options(sink: Any, tmp_path: Path) -> None:
    table = str(tmp_path / "table")
    df = sink.range(0, 200, numPartitions=2)
    for _ in range(2):
        df.write.format("delta_rs").option("txnAppId", "nightly").option("txnVersion", "7").mode(
            "append"
        ).save(table)
    assert _ids(Path(table)) == list(range(200))
    assert DeltaTable(table).transaction_version("nightly") == 7
    assert _table_files(Path(table)) == _live_files(Path(table))

    # A version past Delta's long is refused while planning, before any file is written.
    with pytest.raises(AnalysisException) as too_large:
        df.write.format("delta_rs").option("txnAppId", "nightly").option(
            "txnVersion", str(2**63)
        ).mode("append").save(table)
    assert "ConfigurationError" in str(too_large.value)
    assert "The option txnVersion must be at most 9223372036854775807" in str(too_large.value)
    assert _table_files(Path(table)) == _live_files(Path(table))
    assert DeltaTable(table).version() == 0


@pytest.mark.spark
def test_partitioned_table_and_file_uri(sink: Any, tmp_path: Path) -> None:
    table = tmp_path / "table"
    df = sink.createDataFrame(
        [(1, "fr"), (2, "a b/c%d"), (3, None), (4, "fr"), (5, "x=y")],
        "id long, country string",
    )
    df.write.format("delta_rs").option("partitionBy", "country").mode("append").save(
        table.as_uri()  # file:// goes through delta-rs's object-store file system
    )
    delta = DeltaTable(str(table))
    assert delta.metadata().partition_columns == ["country"]
    rows = sorted(delta_dataset(delta).to_table().to_pylist(), key=lambda r: r["id"])
    assert rows == [
        {"id": 1, "country": "fr"},
        {"id": 2, "country": "a b/c%d"},
        {"id": 3, "country": None},
        {"id": 4, "country": "fr"},
        {"id": 5, "country": "x=y"},
    ]
    assert pl.read_delta(str(table)).filter(pl.col("country") == "fr")["id"].sort().to_list() == [
        1,
        4,
    ]
    assert {
        Path(p).parent.name
        for p in delta.file_uris(file_pruning_predicate=[("country", "=", "a b/c%d")])
    } == {"country=a%20b%2Fc%25d"}

    # A later write follows the table's partitioning; a different one is refused.
    sink.createDataFrame([(6, "de")], "id long, country string").write.format("delta_rs").mode(
        "append"
    ).save(str(table))
    assert DeltaTable(str(table)).count() == 6
    with pytest.raises(AnalysisException) as wrong:
        sink.createDataFrame([(7, "de")], "id long, country string").write.format(
            "delta_rs"
        ).option("partitionBy", "id").mode("append").save(str(table))
    assert "is partitioned by ['country'], but the write is partitioned by ['id']" in str(
        wrong.value
    )
    assert clean_orphan_files(table.as_uri(), older_than=dt.timedelta(0)) == []


def test_a_partition_column_named_in_another_case_is_refused_naming_the_data_s() -> None:
    # It was only "not a column of the data", with the column there in another case.
    from stateful_async.spark._sink_files import check_partition_columns

    schema = pa.schema([("id", pa.int64()), ("Country", pa.string())])
    with pytest.raises(ConfigurationError) as refused:
        check_partition_columns(schema, ("country",))
    assert str(refused.value) == (
        "The partition column 'country' (option partitionBy) is not a column of the data: its "
        "column 'Country' differs only in case, and partition columns are named as the data "
        "spells them (partitionBy=Country)."
    )
    check_partition_columns(schema, ("Country",))  # as the data spells it


def test_a_partition_column_not_in_the_data_is_refused_naming_the_columns_quoted() -> None:
    # "whose columns are id, a,b" read as three columns when a name held a comma
    from stateful_async.spark._sink_files import check_partition_columns

    schema = pa.schema([("id", pa.int64()), ("a,b", pa.string())])
    with pytest.raises(ConfigurationError) as refused:
        check_partition_columns(schema, ("day",))
    assert str(refused.value) == (
        "The partition column 'day' (option partitionBy) is not a column of the data, whose "
        "columns are 'id', 'a,b'."
    )


def test_a_partition_column_whose_name_holds_a_comma_or_outer_spaces_is_refused(
    tmp_path: Path,
) -> None:
    # The option is split at commas and stripped: partitionBy='a,b' for the column 'a,b'
    # created a table partitioned by the columns a and b, without a word.
    for names, option, reads, alias in [
        (["id", "a,b", "a", "b"], "a,b", ["a", "b"], "a_b"),
        (["id", " p"], " p", ["p"], "p"),
    ]:
        schema = pa.schema([(name, pa.string()) for name in names])
        opts = SinkOptions.parse(
            {"path": str(tmp_path / "t"), "partitionBy": option}, streaming=False
        )
        with pytest.raises(ConfigurationError) as refused:
            plan_write(opts, schema)
        assert str(refused.value) == (
            f"The option partitionBy={option!r} cannot name the column {names[1]!r}: the option "
            f"is a comma-separated list of names stripped of spaces (it reads {reads}), so a "
            "name holding a comma or leading or trailing spaces cannot be given in it. Rename "
            f"the column first, e.g. df.withColumnRenamed({names[1]!r}, {alias!r}), then the "
            f"option partitionBy={alias}."
        )
    assert not (tmp_path / "t").exists()
    # Nor is such a column given for a table partitioned by it: the option is left out.
    write_deltalake(tmp_path / "p", pa.table({"id": [1], "a,b": ["x"]}), partition_by=["a,b"])
    schema = pa.schema([("id", pa.int64()), ("a,b", pa.string())])
    opts = SinkOptions.parse({"path": str(tmp_path / "p"), "partitionBy": "a,b"}, streaming=False)
    with pytest.raises(SinkSchemaMismatchError) as refused:
        plan_write(opts, schema)
    assert str(refused.value).endswith(
        "is partitioned by ['a,b'], but the write is partitioned by ['a', 'b']. Leave the "
        "option partitionBy out to follow the table (a name holding a comma or leading or "
        "trailing spaces cannot be given in it)."
    )
    opts = SinkOptions.parse({"path": str(tmp_path / "p")}, streaming=False)
    assert plan_write(opts, schema).partition_by == ("a,b",)
    # names the option can hold are read as before, spaces after the commas too
    schema = pa.schema([("id", pa.int64()), ("p", pa.string()), ("q", pa.string())])
    opts = SinkOptions.parse({"path": str(tmp_path / "t"), "partitionBy": "p, q"}, streaming=False)
    assert plan_write(opts, schema).partition_by == ("p", "q")


@pytest.mark.spark
def test_a_partition_column_inside_a_struct_is_refused_saying_how_to_select_it_up(
    sink: Any, tmp_path: Path
) -> None:
    # It was refused as "not a column of the data", which lists the struct itself.
    df = sink.createDataFrame([(1, ("de",))], "id long, s struct<country: string>")
    table = tmp_path / "table"
    with pytest.raises(AnalysisException) as refused:
        df.write.format("delta_rs").option("partitionBy", "s.country").mode("append").save(
            str(table)
        )
    assert (
        "The partition column 's.country' (option partitionBy) is the field 'country' inside "
        "the struct column 's': nested fields are not supported directly, partitionBy takes "
        "top-level columns. Select it up as a column first, e.g. df.withColumn('country', "
        "F.col('s.country')), then the option partitionBy='country'."
    ) in str(refused.value)
    assert not table.exists()
    # the advice, followed
    df.withColumn("country", F.col("s.country")).write.format("delta_rs").option(
        "partitionBy", "country"
    ).mode("append").save(str(table))
    assert DeltaTable(str(table)).metadata().partition_columns == ["country"]
    # a name that is no field at all is refused as before
    with pytest.raises(AnalysisException, match=r"'s\.city' \(option partitionBy\) is not a "):
        df.write.format("delta_rs").option("partitionBy", "s.city").mode("append").save(
            str(tmp_path / "other")
        )


# -- 5. statistics and file skipping -------------------------------------------------------


def test_partition_columns_may_have_any_name(tmp_path: Path) -> None:
    # The task grouped rows by partition value in a table holding the partition columns
    # and its own "__row" column: a partition column named __row (or __row_list) failed
    # every task attempt with ArrowInvalid 'Multiple matches for FieldRef.Name(__row)'.
    table = tmp_path / "table"
    schema = pa.schema([("id", pa.int64()), ("__row", pa.int32()), ("__row_list", pa.string())])
    opts = SinkOptions.parse(
        {"path": str(table), "partitionBy": "__row,__row_list"}, streaming=False
    )
    plan = plan_write(opts, schema)
    data = pa.table(
        {"id": range(6), "__row": [i % 2 for i in range(6)], "__row_list": ["a", "b", "a"] * 2},
        schema=schema,
    )
    message = write_task_files(
        opts, plan, iter(data.to_batches()), partition_id=0, attempt=0, batch_id=None,
        query_id=None,
    )  # fmt: skip
    assert len(message.files) == 4
    commit_write(opts, plan, list(message.files), mode="append", app_id=None, version=None)
    read = DeltaTable(str(table)).to_pyarrow_table()
    assert sorted(read.to_pylist(), key=lambda r: r["id"]) == data.to_pylist()


@pytest.mark.spark
def test_stats_are_exact_and_skip_files(sink: Any, tmp_path: Path) -> None:
    table = str(tmp_path / "table")
    df = sink.range(0, 20_000, numPartitions=4).selectExpr(
        "id",
        "CASE WHEN id % 5 = 0 THEN NULL ELSE CONCAT('n', id) END AS name",
        "CAST(id AS DOUBLE) / 7 AS ratio",
        "TIMESTAMP_MICROS(1700000000000000 + id * 1001) AS ts",
        "DATE_ADD(DATE'2024-01-01', CAST(id % 400 AS INT)) AS day",
        "NAMED_STRUCT('inner', CASE WHEN id % 3 = 0 THEN NULL ELSE id END) AS nested",
    )
    df.write.format("delta_rs").option("maxRecordsPerFile", "3000").mode("append").save(table)

    delta = DeltaTable(table)
    assert delta.count() == 20_000
    actions = pa.table(delta.get_add_actions(flatten=True)).to_pylist()
    assert len(actions) >= 8  # 4 tasks x 5000 rows, rolled over at 3000 rows
    for action in actions:
        data = pl.read_parquet(Path(table) / action["path"])
        assert action["num_records"] == data.height
        for column in ("id", "name", "ratio", "ts", "day"):
            assert action[f"null_count.{column}"] == data[column].null_count()
            assert action[f"min.{column}"] == data[column].min(), column
            assert action[f"max.{column}"] == data[column].max(), column
        inner = data["nested"].struct.field("inner")
        assert action["null_count.nested.inner"] == inner.null_count()
        assert (action["min.nested.inner"], action["max.nested.inner"]) == (
            inner.min(),
            inner.max(),
        )

    # File skipping: a filtered scan opens only the files whose id range can match.
    threshold = 17_500
    dataset = delta_dataset(delta)
    needed = {a["path"] for a in actions if a["max.id"] >= threshold}
    assert 0 < len(needed) < len(actions)
    scanned = {f.path for f in dataset.get_fragments(filter=ds.field("id") >= threshold)}
    assert scanned == needed  # pyarrow's pruning with the fragments' min/max
    pruned = delta.file_uris(file_pruning_predicate=f"id >= {threshold}")
    assert {str(Path(u).relative_to(table)) for u in pruned} == needed  # delta-rs's own
    assert dataset.to_table(filter=ds.field("id") >= threshold).num_rows == 20_000 - threshold


def test_stats_leave_out_bounds_they_cannot_state_exactly(tmp_path: Path) -> None:
    from stateful_async.spark._sink_files import TableStorage, TaskFileWriter

    schema = pa.schema(
        [
            ("f", pa.float64()),
            ("nan", pa.float64()),
            ("inf", pa.float32()),
            ("zeros", pa.float64()),
            ("long_text", pa.string()),
            ("dec", pa.decimal128(10, 2)),
            ("all_null", pa.int32()),
            ("ntz", pa.timestamp("us")),
            ("items", pa.list_(pa.int64())),
        ]
    )
    data = pa.table(
        {
            "f": [1.5, -2.25, None],
            "nan": [1.0, math.nan, 3.0],
            "inf": pa.array([1.0, math.inf, 0.5], pa.float32()),
            "zeros": [0.0, -0.0, 0.0],
            "long_text": ["z" * 65, "b", None],
            "dec": pa.array([None, None, None], pa.decimal128(10, 2)),
            "all_null": pa.array([None, None, None], pa.int32()),
            "ntz": [dt.datetime(2020, 1, 1, 0, 0, 0, 123456), None, dt.datetime(1999, 12, 31)],
            "items": [[1], None, []],
        },
        schema=schema,
    )
    writer = TaskFileWriter(TableStorage(str(tmp_path)), schema, ())
    for batch in data.to_batches(max_chunksize=2):
        writer.write(batch)
    (written,) = writer.close()
    stats = json.loads(written.stats)
    assert stats["numRecords"] == 3
    assert (stats["minValues"]["f"], stats["maxValues"]["f"]) == (-2.25, 1.5)
    assert "nan" not in stats["minValues"] and "nan" not in stats["maxValues"]
    assert "inf" not in stats["minValues"] and "inf" not in stats["maxValues"]
    assert math.copysign(1, stats["minValues"]["zeros"]) == -1  # -0.0 is in the data
    assert math.copysign(1, stats["maxValues"]["zeros"]) == 1
    assert stats["minValues"]["long_text"] == "b"
    assert "long_text" not in stats["maxValues"]  # 65 characters: no exact short bound
    assert "dec" not in stats["minValues"] and stats["nullCount"]["dec"] == 3
    assert stats["nullCount"]["all_null"] == 3 and "all_null" not in stats["minValues"]
    assert stats["minValues"]["ntz"] == "1999-12-31T00:00:00.000000"
    assert stats["maxValues"]["ntz"] == "2020-01-01T00:00:00.123456"
    assert "items" not in stats["nullCount"]  # no statistics for lists, as in Delta
    assert stats["nullCount"]["f"] == 1
    read_back = pq.read_table(tmp_path / written.path)
    assert read_back.drop_columns(["nan"]).to_pylist() == data.drop_columns(["nan"]).to_pylist()
    assert [math.isnan(v) for v in read_back.column("nan").to_pylist()] == [False, True, False]


# -- options ---------------------------------------------------------------------------------


@pytest.mark.spark
def test_a_column_delta_cannot_hold_is_named_before_anything_is_written(
    sink: Any, tmp_path: Path
) -> None:
    data = sink.sql("SELECT 1 AS id, INTERVAL 1 DAY AS gap, 'x' AS name")
    with pytest.raises(AnalysisException) as caught:
        data.write.format("delta_rs").mode("append").save(str(tmp_path / "t"))
    message = str(caught.value)
    assert (
        "ConfigurationError: The data cannot be stored in a Delta table: the column(s) " in message
    )
    assert "'gap' (duration[us]) have no Delta type" in message  # not delta-rs's Duration(µs)
    assert not (tmp_path / "t").exists()


def test_names_differing_only_in_case_are_named_not_blamed_on_their_types(
    tmp_path: Path,
) -> None:
    # delta-rs refuses them; the sink said to cast 'them' to a Delta type (for a struct,
    # that it had no Delta type), which no cast fixes.
    options = SinkOptions.parse({"path": str(tmp_path / "t")}, streaming=False)
    advice = (
        " differ only in case, and Delta column and field names are case-insensitive. "
        "Rename one of each pair before writing (withColumnRenamed for a column; for a "
        "field, rebuild its struct with named_struct)."
    )
    for schema, pairs in [
        (pa.schema([("a", pa.int64()), ("A", pa.int64())]), "'a' and 'A'"),
        (
            pa.schema(
                [("s", pa.struct([("a", pa.int32()), ("A", pa.int32())])), ("id", pa.int64())]
            ),
            "'s.a' and 's.A'",
        ),
        (
            pa.schema([("l", pa.list_(pa.struct([("x", pa.int32()), ("X", pa.int32())])))]),
            "'l[].x' and 'l[].X'",  # was 'l.x' and 'l.X', as if l were a struct
        ),
        (
            pa.schema(
                [("m", pa.map_(pa.string(), pa.struct([("a", pa.int8()), ("A", pa.int8())])))]
            ),
            "'m{}.a' and 'm{}.A'",
        ),
        (  # in a map's keys (they were skipped: 'have no Delta type', cast an interval...)
            pa.schema(
                [
                    (
                        "m",
                        pa.list_(
                            pa.map_(pa.struct([("k", pa.int32()), ("K", pa.int32())]), pa.int32())
                        ),
                    )
                ]
            ),
            "'m[]{key}.k' and 'm[]{key}.K'",
        ),
    ]:
        with pytest.raises(ConfigurationError) as caught:
            plan_write(options, schema)
        assert str(caught.value) == (f"The data cannot be stored in a Delta table: {pairs}{advice}")
    assert not (tmp_path / "t").exists()


def test_names_given_twice_are_named_not_blamed_on_their_types(tmp_path: Path) -> None:
    # Two 'id' columns (a join on a.id == b.id keeps both) were refused as 'External error:
    # Schema error: Duplicate field name (case-insensitive): 'id'. Cast them to a Delta type
    # before writing (an interval to ...)'; two fields 'a' of one struct as 'the column(s)
    # 's' (struct<a: int32, a: int32>) have no Delta type', which no cast fixes.
    options = SinkOptions.parse({"path": str(tmp_path / "t")}, streaming=False)
    advice = ", and a Delta table holds one per name. Drop or rename the others before writing ("
    join = "after a join on equal columns, join on their names to keep one: a.join(b, {!r})"
    rebuild = "for a field, rebuild its struct with named_struct"
    twice = pa.struct([("a", pa.int32()), ("a", pa.int32())])
    for schema, named, how in [
        (
            pa.schema([("id", pa.int64()), ("v", pa.string()), ("id", pa.int64())]),
            "column named 'id'",
            join.format("id"),
        ),
        (  # the advice names the column given twice, not 'id' whatever it is
            pa.schema([("key", pa.int64()), ("key", pa.int64()), ("s", twice)]),
            "column named 'key' and more than one field named 's.a' in a struct",
            join.format("key") + "; " + rebuild,
        ),
        (  # given twice beside a case twin: named as given twice (it was called a case pair)
            pa.schema([("ID", pa.int64()), ("id", pa.int64()), ("id", pa.int64())]),
            "column named 'id'",
            join.format("id"),
        ),
        (pa.schema([("s", twice), ("id", pa.int64())]), "field named 's.a' in a struct", rebuild),
        (pa.schema([("l", pa.list_(twice))]), "field named 'l[].a' in a struct", rebuild),
    ]:
        with pytest.raises(ConfigurationError) as caught:
            plan_write(options, schema)
        assert str(caught.value) == (
            f"The data cannot be stored in a Delta table: it has more than one {named}{advice}"
            f"{how})."
        )
    assert not (tmp_path / "t").exists()


def test_a_struct_without_fields_is_refused_before_any_task_runs(tmp_path: Path) -> None:
    # delta-rs takes struct<> (Spark's struct()), so the plan passed and every task failed
    # on pyarrow's 'Cannot write struct type 's' with no child field to Parquet', Spark
    # retrying each one.
    options = SinkOptions.parse({"path": str(tmp_path / "t")}, streaming=False)
    for schema, named in [
        (pa.schema([("id", pa.int64()), ("s", pa.struct([]))]), "'s'"),
        (pa.schema([("id", pa.int64()), ("l", pa.list_(pa.struct([])))]), "'l[]'"),
    ]:
        with pytest.raises(ConfigurationError) as caught:
            plan_write(options, schema)
        assert str(caught.value) == (
            f"The data cannot be stored in a Delta table: {named} is a struct with no fields, "
            "which Parquet files cannot hold. Drop it, or give it a field, before writing."
        )
    assert not (tmp_path / "t").exists()


VOID_ADVICE = (
    "no type (void: a bare NULL, such as F.lit(None), has none, nor do the elements of an "
    "empty array() or the keys and values of an empty create_map()), so the table could never "
    "hold a value there. Cast it to the type it stands for before writing (an empty array or "
    "map as a whole), e.g. F.lit(None).cast('string') or F.array().cast('array<string>')."
)


def test_a_column_without_a_type_is_refused_before_it_reaches_the_table(tmp_path: Path) -> None:
    # Spark gives a bare NULL (F.lit(None)) and an empty array() the void type. The sink
    # created the table with a 'void' column, which could then never hold a value: a later
    # write of it as a string was refused as a type change.
    table = tmp_path / "t"
    for schema, named in [
        (pa.schema([("id", pa.int64()), ("n", pa.null())]), "'n' has "),
        (
            pa.schema([("s", pa.struct([("a", pa.null())])), ("l", pa.list_(pa.null()))]),
            "'s.a', 'l[]' have ",
        ),
    ]:
        with pytest.raises(ConfigurationError) as caught:
            plan_write(SinkOptions.parse({"path": str(table)}, streaming=False), schema)
        assert (
            str(caught.value) == f"The data cannot be stored in a Delta table: {named}{VOID_ADVICE}"
        )
    assert not table.exists()
    # Nor does mergeSchema add one; a void column the table already has is written to.
    write_deltalake(table, pa.table({"id": [1], "n": pa.array([None], pa.null())}))
    merge = SinkOptions.parse({"path": str(table), "mergeSchema": "true"}, streaming=False)
    with pytest.raises(ConfigurationError) as caught:
        plan_write(merge, pa.schema([("id", pa.int64()), ("n", pa.null()), ("m", pa.null())]))
    assert str(caught.value) == f"The data cannot be stored in a Delta table: 'm' has {VOID_ADVICE}"
    plan_write(merge, pa.schema([("id", pa.int64()), ("n", pa.null())]))


def test_an_empty_array_or_map_is_refused_naming_it_before_any_task_runs(
    sink: Any, tmp_path: Path
) -> None:
    # Spark types array() as array<void> and create_map() as map<void, void>, both NOT NULL
    # inside, which Arrow cannot hold: pyspark's conversion failed with 'A null type field
    # may not be non-nullable', naming no column ("Cast the unsupported columns").
    from pyspark.sql.types import ArrayType, MapType, NullType, StringType, StructField, StructType

    table = tmp_path / "t"
    df = sink.range(1).select(
        F.array().alias("a"),
        F.struct(F.create_map().alias("m"), F.lit(1).alias("n")).alias("s"),
        F.create_map(F.lit("k"), F.array()).alias("v"),
    )
    with pytest.raises(AnalysisException) as caught:
        df.write.format("delta_rs").mode("append").save(str(table))
    assert (
        "The data cannot be stored in a Delta table: 'a[]', 's.m{key}', 's.m{}', 'v{}[]' have "
        + VOID_ADVICE
    ) in str(caught.value)
    assert not table.exists()  # refused while planning: no task wrote a file
    # So is it in a table that has the column, typed: the message says to cast it.
    typed = sink.range(1).select(F.array().cast("array<string>").alias("a"))
    typed.write.format("delta_rs").mode("append").save(str(table))
    schema = StructType([StructField("a", ArrayType(NullType(), False), False)])
    with pytest.raises(ConfigurationError, match=r"^The data cannot be stored .*: 'a\[\]' has "):
        DeltaBatchWriter({"path": str(table)}, schema, False)
    keys = StructType([StructField("k", MapType(NullType(), StringType()))])
    with pytest.raises(ConfigurationError, match=r"'k\{key\}' has no type"):
        DeltaBatchWriter({"path": str(table)}, keys, False)
    # A bare NULL beside them, which the write would add to the table, is named with them:
    # it was named only by the next write, once they were cast.
    beside = StructType(
        [
            StructField("a", ArrayType(NullType(), False), False),
            StructField("b", ArrayType(NullType(), True), False),
            StructField("n", NullType()),
        ]
    )
    with pytest.raises(
        ConfigurationError, match=r"^The data cannot be stored .*: 'a\[\]', 'b\[\]', 'n' have "
    ):
        DeltaBatchWriter({"path": str(table)}, beside, False)


def test_a_thread_that_registers_the_sink_can_write(sink: Any, tmp_path: Path) -> None:
    # Spark looks Python data sources up in the JVM thread's active session, which another
    # Python thread lacks: its write failed with DATA_SOURCE_NOT_FOUND, registered or not.
    import threading

    outcome: list[Any] = []

    def write() -> None:
        try:
            register_delta_sink(sink)
            sink.range(3).write.format("delta_rs").mode("append").save(str(tmp_path / "t"))
            outcome.append("ok")
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=write)
    thread.start()
    thread.join()
    assert outcome == ["ok"]
    table = delta_dataset(DeltaTable(str(tmp_path / "t"))).to_table(columns=["id"])
    assert sorted(table.column("id").to_pylist()) == [0, 1, 2]


def test_register_delta_sink_needs_a_session() -> None:
    with pytest.raises(ConfigurationError, match="needs a SparkSession .*; got str"):
        register_delta_sink("spark")


def test_options_are_validated_with_clear_errors() -> None:
    with pytest.raises(ConfigurationError, match="does not know the option.*partitonby"):
        SinkOptions.parse({"path": "/t", "partitonBy": "a"}, streaming=False)
    with pytest.raises(ConfigurationError, match="is relative; give an absolute path"):
        SinkOptions.parse({"path": "relative/table"}, streaming=False)
    # ~ is the driver's home, as for a CheckpointConfig location (it was refused as relative)
    home = SinkOptions.parse({"path": "~/tables/t"}, streaming=False).table_uri
    assert home == os.path.join(os.path.expanduser("~"), "tables", "t")
    with pytest.raises(ConfigurationError, match="needs both txnAppId"):
        SinkOptions.parse({"path": "/t", "txnAppId": "a"}, streaming=False)
    with pytest.raises(ConfigurationError, match="txnVersion applies to batch writes only"):
        SinkOptions.parse({"path": "/t", "txnVersion": "1"}, streaming=True)
    # Spark hands the options over lower-cased; errors spell them as the docs do.
    for key, value, message in [
        ("mergeschema", "yes", "The option mergeSchema must be true or false"),
        ("maxrecordsperfile", "-1", "The option maxRecordsPerFile must be at least 0"),
        ("maxcommitretries", "x", "The option maxCommitRetries must be a whole number"),
        ("orphanretentionseconds", "x", "The option orphanRetentionSeconds must be a number"),
        ("orphanretentionseconds", "-1", "The option orphanRetentionSeconds must be zero or"),
        # delta-rs took these only at commit time, after every file was written, and failed
        # with a bare OverflowError
        ("maxcommitretries", str(2**63), "The option maxCommitRetries must be at most 9223"),
    ]:
        with pytest.raises(ConfigurationError, match=message):
            SinkOptions.parse({"path": "/t", key: value}, streaming=False)
    with pytest.raises(
        ConfigurationError,
        match=r"The option txnVersion must be at most 9223372036854775807 \(2\*\*63 - 1",
    ):
        SinkOptions.parse(
            {"path": "/t", "txnappid": "a", "txnversion": str(2**63)}, streaming=False
        )
    largest = {"txnappid": "a", "txnversion": str(2**63 - 1), "maxcommitretries": str(2**63 - 1)}
    opts = SinkOptions.parse({"path": "/t", **largest}, streaming=False)
    assert (opts.txn_version, opts.max_commit_retries) == (2**63 - 1, 2**63 - 1)
    opts = SinkOptions.parse(
        {"path": "s3://bucket/t/", "Storage.AWS_REGION": "eu-west-1", "partitionBy": "a, b"},
        streaming=True,
    )
    assert opts.table_uri == "s3://bucket/t"
    assert opts.storage_options == {"aws_region": "eu-west-1"}
    assert opts.partition_by == ("a", "b")


def test_a_local_table_path_holding_a_percent_escape_is_refused_up_front(
    tmp_path: Path,
) -> None:
    # delta-rs created the table in 'a%20b', then looked for its log in 'a b': the first
    # write succeeded and every later one failed with 'could not read the Delta table ...
    # File not found: .../a b/_delta_log/...'. A file:// URI decodes to the same directory.
    for path, escape in [
        (str(tmp_path / "a%20b"), "%20"),
        (f"file://{tmp_path}/a%2520b", "%20"),
        (str(tmp_path / "x%2Fy" / "t"), "%2F"),
    ]:
        with pytest.raises(ConfigurationError) as caught:
            SinkOptions.parse({"path": path}, streaming=False)
        assert str(caught.value) == (
            f"The table path {path!r} names a local directory whose path holds {escape!r}, "
            "which delta-rs decodes (as an escaped character) when it reads the table, so it "
            "would not find the table it wrote there. Use a directory whose path has no '%' "
            "followed by two hexadecimal digits."
        )
    # '%' without two hex digits, an escape a file:// URI decodes, an object store's key
    for path in [str(tmp_path / "100%"), f"file://{tmp_path}/a%20b", "s3://bucket/a%20b"]:
        assert SinkOptions.parse({"path": path}, streaming=False).table_uri == path


def test_clean_orphan_files_refuses_a_path_without_a_table(tmp_path: Path) -> None:
    (tmp_path / "data.parquet").write_bytes(b"not really parquet")
    with pytest.raises(DeltaSinkError, match="There is no Delta table at .*nothing was deleted"):
        clean_orphan_files(str(tmp_path), older_than=dt.timedelta(0))
    assert (tmp_path / "data.parquet").exists()
    for bad in (dt.timedelta(seconds=-1), -1, "1h", True):
        with pytest.raises(
            ConfigurationError, match="older_than must be a timedelta or a number of seconds"
        ):
            clean_orphan_files(str(tmp_path), older_than=bad)


def test_not_null_column_rejects_nulls_and_the_task_removes_its_files(tmp_path: Path) -> None:
    table = tmp_path / "table"
    DeltaTable.create(
        str(table), pa.schema([pa.field("id", pa.int64(), nullable=False), ("v", pa.string())])
    )
    opts = SinkOptions.parse({"path": str(table)}, streaming=False)
    plan = plan_write(opts, pa.schema([("id", pa.int64()), ("v", pa.string())]))
    good = pa.record_batch({"id": pa.array([1, 2], pa.int64()), "v": ["a", "b"]})
    bad = pa.record_batch({"id": pa.array([3, None], pa.int64()), "v": ["c", "d"]})
    written: list[Path] = []

    def batches() -> Iterator[pa.RecordBatch]:
        yield good
        written.extend(table.rglob("*.parquet"))  # the file of the first batch is open
        yield bad

    with pytest.raises(SinkSchemaMismatchError, match="'id' is NOT NULL in the Delta table"):
        write_task_files(
            opts, plan, batches(), partition_id=0, attempt=0, batch_id=None, query_id=None
        )
    assert len(written) == 1
    assert _table_files(table) == set()  # the failed task deleted the file it had started


def test_a_task_writing_many_partition_values_holds_a_bounded_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each open file buffered up to a full row group (128k rows or 64 MiB) before writing:
    # with one file per partition value, a task held all its rows in memory.
    from stateful_async.spark import _sink_files

    budget = 200_000
    monkeypatch.setattr(_sink_files, "TASK_BUFFER_BYTES", budget)
    schema = pa.schema([("key", pa.string()), ("id", pa.int64()), ("text", pa.string())])
    table = tmp_path / "table"
    writer = TaskFileWriter(TableStorage(str(table)), schema, ("key",))
    expected = []
    peak = 0
    for b in range(40):  # 40 batches of 1,000 rows over 50 partition values
        rows = [{"key": f"k{i % 50}", "id": b * 1000 + i, "text": "x" * 100} for i in range(1000)]
        expected.extend(rows)
        writer.write(pa.RecordBatch.from_pylist(rows, schema=schema))
        peak = max(peak, writer.buffered_bytes())
    assert peak <= budget
    files = writer.close()
    assert len(files) == 50 and writer.buffered_bytes() == 0
    got = []
    for f in files:
        part = pq.read_table(table / unquote(f.path))
        assert part.num_rows == f.num_records
        key = f.partition_values["key"]
        got.extend({"key": key, **row} for row in part.to_pylist())
    assert sorted(got, key=lambda r: r["id"]) == expected


def test_not_null_fields_inside_structs_lists_and_maps_reject_nulls(tmp_path: Path) -> None:
    # Only top-level NOT NULL columns were checked: a null in s.a was committed, and the
    # table could no longer be read at all (Arrow refuses nulls in a NOT NULL field).
    inner = pa.struct([pa.field("a", pa.int32(), nullable=False), ("b", pa.string())])
    strict = pa.schema(
        [
            ("id", pa.int64()),
            ("s", inner),
            ("tags", pa.list_(pa.field("item", pa.string(), nullable=False))),
            ("m", pa.map_(pa.string(), pa.field("value", pa.int32(), nullable=False))),
            ("deep", pa.list_(inner)),
            # as Spark gives map(named_struct('p', 1), ...) a key with a NOT NULL field
            ("mk", pa.map_(pa.struct([pa.field("p", pa.int32(), nullable=False)]), pa.int32())),
        ]
    )
    table = tmp_path / "table"
    DeltaTable.create(str(table), strict)
    loose = pa.schema(  # as Spark sends it: everything nullable
        [
            ("id", pa.int64()),
            ("s", pa.struct([("a", pa.int32()), ("b", pa.string())])),
            ("tags", pa.list_(pa.string())),
            ("m", pa.map_(pa.string(), pa.int32())),
            ("deep", pa.list_(pa.struct([("a", pa.int32()), ("b", pa.string())]))),
            ("mk", pa.map_(pa.struct([("p", pa.int32())]), pa.int32())),
        ]
    )
    opts = SinkOptions.parse({"path": str(table)}, streaming=False)
    plan = plan_write(opts, loose)
    ok = {
        "id": 0,
        "s": {"a": 1, "b": None},
        "tags": ["x"],
        "m": [("k", 1)],
        "deep": [{"a": 2}],
        "mk": [({"p": 1}, 1)],
    }

    def write(row: dict[str, Any]) -> Any:
        writer = TaskFileWriter(TableStorage(str(table)), plan.schema, plan.partition_by)
        try:
            writer.write(pa.RecordBatch.from_pylist([ok, row], schema=loose))
        except SinkSchemaMismatchError:
            writer.discard()
            raise
        return commit_write(opts, plan, writer.close(), mode="append", app_id=None, version=None)

    for change, path in [
        ({"s": {"a": None, "b": "x"}}, "s.a"),
        ({"tags": ["y", None]}, "tags[1]"),
        ({"m": [("k", None)]}, "m['k']"),
        ({"deep": [{"a": 1}, {"a": None}]}, "deep[1].a"),
        # inside a map's key: was 'cannot be cast to the planned schema ... Write a
        # DataFrame whose schema does not change during the write'
        ({"mk": [({"p": 2}, 2), ({"p": None}, 3)]}, "mk{key}.p"),
    ]:
        with pytest.raises(SinkSchemaMismatchError, match=re.escape(f"field {path!r} is NOT NULL")):
            write({**ok, "id": 1, **change})
    # Nulls above a NOT NULL field are not nulls in it: a null struct, list or map.
    absent = {"id": 2, "s": None, "tags": None, "m": None, "deep": [None, {"a": 3}], "mk": None}
    assert write(absent) is Outcome.COMMITTED
    rows = DeltaTable(str(table)).to_pyarrow_table().sort_by("id").to_pylist()
    assert [(r["id"], r["s"], r["tags"]) for r in rows] == [
        (0, {"a": 1, "b": None}, ["x"]),
        (2, None, None),
    ]
    # the refused writes removed their files: only the committed one is on disk
    referenced = {os.path.basename(f) for f in DeltaTable(str(table)).file_uris()}
    assert {os.path.basename(f) for f in _table_files(table)} == referenced
    assert len(referenced) == 1  # DeltaTable.create wrote no file; the one write, 2 rows


def test_an_empty_string_for_a_not_null_partition_column_is_refused_in_the_task(
    tmp_path: Path,
) -> None:
    # An empty partition value is stored as null: the files were written and only the
    # commit failed, with a bare ValueError from delta-rs.
    table = str(tmp_path / "table")
    DeltaTable.create(
        table,
        pa.schema([("id", pa.int64()), pa.field("p", pa.string(), nullable=False)]),
        partition_by=["p"],
    )
    data = pa.schema([("id", pa.int64()), ("p", pa.string())])
    opts = SinkOptions.parse({"path": table}, streaming=False)
    plan = plan_write(opts, data)
    writer = TaskFileWriter(TableStorage(table), plan.schema, plan.partition_by)
    writer.write(pa.RecordBatch.from_pylist([{"id": 1, "p": "a"}], schema=data))
    with pytest.raises(
        SinkSchemaMismatchError,
        match=r"column 'p' is NOT NULL .* holds empty strings \(stored as null\)",
    ):
        writer.write(pa.RecordBatch.from_pylist([{"id": 2, "p": ""}], schema=data))
    writer.discard()
    assert _table_files(Path(table)) == set()


def test_a_table_needing_writer_features_delta_rs_lacks_is_refused_as_no_conflict(
    tmp_path: Path,
) -> None:
    # Row tracking (Delta Spark's, or Databricks'): the commit failed with the advice for a
    # concurrent commit, 'restart the query or re-run the write', which fails again.
    from deltalake import TableFeatures

    table = str(tmp_path / "t")
    data = pa.table({"id": [1, 2]})
    write_deltalake(table, data)
    DeltaTable(table).alter.add_feature(
        [TableFeatures.RowTracking], allow_protocol_versions_increase=True
    )
    version = DeltaTable(table).version()
    opts = SinkOptions.parse({"path": table}, streaming=False)
    plan = plan_write(opts, data.schema)
    message = write_task_files(
        opts,
        plan,
        iter(data.to_batches()),
        partition_id=0,
        attempt=0,
        batch_id=None,
        query_id=None,
    )
    with pytest.raises(DeltaSinkError) as caught:
        commit_write(opts, plan, message.files, mode="append", app_id=None, version=None)
    text = str(caught.value)
    assert text.startswith(
        f"The Delta table at {table} needs writer features that delta-rs (deltalake 1.6."
    ), text
    assert "cannot write (Unsupported table features required: [RowTracking])" in text
    assert text.endswith(
        "so the commit of 1 file(s) holding 2 row(s) was refused: nothing was committed "
        "and Spark removes the write's files. Re-running the write or restarting the query "
        "fails the same way: write to this table with Spark and the Delta Lake jars "
        "(delta-spark), or to another table."
    ), text
    assert "concurrent" not in text
    assert DeltaTable(table).version() == version
    assert abort_write(opts, message.files) == [f.path for f in message.files]


def test_tables_with_rules_the_sink_cannot_check_are_refused_before_any_file(
    tmp_path: Path,
) -> None:
    # CHECK constraints were not evaluated: rows breaking them were committed silently.
    data = pa.schema([("id", pa.int64()), ("v", pa.string())])
    checked = str(tmp_path / "checked")
    write_deltalake(checked, pa.table({"id": [1], "v": ["a"]}, schema=data))
    DeltaTable(checked).alter.add_constraint({"id_positive": "id > 0"})
    generated = str(tmp_path / "generated")
    DeltaTable.create(
        generated,
        pa.schema(
            [
                ("id", pa.int64()),
                pa.field("v", pa.string(), metadata={"delta.generationExpression": "'x'"}),
            ]
        ),
    )
    nested = str(tmp_path / "nested")  # an invariant may sit on a field inside a struct
    invariant = json.dumps({"expression": {"expression": "s.a > 0"}})
    DeltaTable.create(
        nested,
        pa.schema(
            [
                ("id", pa.int64()),
                (
                    "s",
                    pa.struct(
                        [pa.field("a", pa.int32(), metadata={"delta.invariants": invariant})]
                    ),
                ),
            ]
        ),
    )
    in_key = str(tmp_path / "in_key")  # ... or inside a map's key (it was not looked at)
    key = pa.struct([pa.field("p", pa.int32(), metadata={"delta.invariants": invariant})])
    DeltaTable.create(in_key, pa.schema([("id", pa.int64()), ("m", pa.map_(key, pa.int32()))]))
    in_list = str(tmp_path / "in_list")  # ... or inside a list's elements
    DeltaTable.create(in_list, pa.schema([("id", pa.int64()), ("l", pa.list_(key))]))
    for table, what in [
        (checked, "the CHECK constraint 'id_positive' (id > 0)"),
        (generated, "a generated column ('v')"),
        (nested, "a column invariant ('s.a')"),
        (in_key, "a column invariant ('m{key}.p')"),
        (in_list, "a column invariant ('l[].p')"),  # was 'l.p', as if l were a struct
    ]:
        opts = SinkOptions.parse({"path": table}, streaming=False)
        with pytest.raises(DeltaSinkError, match=re.escape(f"at {table} has {what}, which")):
            plan_write(opts, data)
    # ... and at commit, should a rule appear after planning
    opts = SinkOptions.parse({"path": checked}, streaming=False)
    plan = WritePlan(as_file_schema(data), ())
    with pytest.raises(DeltaSinkError, match="CHECK constraint 'id_positive'"):
        commit_write(opts, plan, [], mode="append", app_id=None, version=None)
    assert DeltaTable(checked).version() == 1  # the create, the constraint; nothing since

    # An append-only table takes appends, and refuses an overwrite before writing a file.
    append_only = str(tmp_path / "append_only")
    write_deltalake(
        append_only,
        pa.table({"id": [1], "v": ["a"]}, schema=data),
        configuration={"delta.appendOnly": "true"},
    )
    opts = SinkOptions.parse({"path": append_only}, streaming=False)
    assert plan_write(opts, data, mode="append").schema == as_file_schema(data)
    with pytest.raises(DeltaSinkError, match=r"is append-only \(delta.appendOnly=true\)"):
        plan_write(opts, data, mode="overwrite")


@pytest.mark.spark
def test_an_overwrite_of_an_append_only_table_is_refused_with_its_reason(
    sink: Any, tmp_path: Path
) -> None:
    table = str(tmp_path / "append_only")
    write_deltalake(
        table,
        pa.table({"id": pa.array([1], pa.int64())}),
        configuration={"delta.appendOnly": "true"},
    )
    sink.range(2, 4).write.format("delta_rs").mode("append").save(table)
    with pytest.raises(AnalysisException, match=r"is append-only \(delta.appendOnly=true\)"):
        sink.range(5).write.format("delta_rs").mode("overwrite").save(table)
    assert sorted(DeltaTable(table).to_pyarrow_table().column("id").to_pylist()) == [1, 2, 3]
    assert _table_files(Path(table)) == _live_files(Path(table))  # no file was written


@pytest.mark.spark
def test_streaming_schema_mismatch_stops_the_query_with_the_clear_error(
    sink: Any, tmp_path: Path
) -> None:
    source, table, checkpoint = tmp_path / "src", tmp_path / "table", tmp_path / "chk"
    _write_source(source, files=1, rows_per_file=10)
    sink.range(3).selectExpr("CAST(id AS STRING) AS id").write.format("delta_rs").mode(
        "append"
    ).save(str(table))
    query = DRIVER.start_query(sink, str(source), str(table), str(checkpoint), interval=None)
    with pytest.raises(StreamingQueryException) as failure:
        query.awaitTermination()
    text = str(failure.value)
    assert "SinkSchemaMismatchError" in text
    assert "the column 'id' is string in the table but long in the data" in text
    assert DeltaTable(str(table)).count() == 3


@pytest.mark.spark
def test_streaming_complete_mode_replaces_the_table_each_batch(sink: Any, tmp_path: Path) -> None:
    source, table = tmp_path / "src", tmp_path / "table"
    source.mkdir()
    keys = []
    for n in range(3):
        batch_keys = [f"k{(n + i) % 2}" for i in range(5)]
        keys += batch_keys
        pq.write_table(pa.table({"k": batch_keys, "v": list(range(5))}), source / f"{n}.parquet")
        os.utime(source / f"{n}.parquet", (1_700_000_000 + n, 1_700_000_000 + n))
    query = (
        sink.readStream.schema("k string, v long")
        .option("maxFilesPerTrigger", 1)
        .parquet(str(source))
        .groupBy("k")
        .count()
        .writeStream.format("delta_rs")
        .outputMode("complete")
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(availableNow=True)
        .start(str(table))
    )
    query.awaitTermination()
    delta = DeltaTable(str(table))
    assert delta.version() == 2  # one transaction per micro-batch
    expected = {k: keys.count(k) for k in set(keys)}
    assert {r["k"]: r["count"] for r in delta_dataset(delta).to_table().to_pylist()} == expected
    assert delta.count() == len(expected)
    assert delta.transaction_version(str(query.id)) == 2


def test_clean_orphan_files_keeps_every_file_a_retained_version_names(tmp_path: Path) -> None:
    from deltalake import write_deltalake

    table = tmp_path / "table"
    write_deltalake(str(table), _rows(0, 10), mode="append")
    write_deltalake(str(table), _rows(10, 10), mode="append")
    write_deltalake(str(table), _rows(100, 5), mode="overwrite")  # removes two files
    DeltaTable(str(table)).create_checkpoint()  # at version 2
    write_deltalake(str(table), _rows(200, 5), mode="append")
    # Log clean-up: the commits up to the checkpoint go, so the files of versions 0-2 are
    # named only by the checkpoint (live ones as adds, removed ones as tombstones).
    for commit in sorted((table / "_delta_log").glob("*.json"))[:-1]:
        commit.unlink()
    assert [p.name for p in (table / "_delta_log").glob("*.json")] == [f"{3:020d}.json"]
    (table / "part=x").mkdir()
    orphan = table / "part=x" / "part-00000-orphan-c000.snappy.parquet"
    pq.write_table(_rows(0, 1), orphan)
    hidden = table / "_tmp" / "part-00000-hidden.parquet"
    hidden.parent.mkdir()
    pq.write_table(_rows(0, 1), hidden)
    kept = _table_files(table) - {"part=x/part-00000-orphan-c000.snappy.parquet"}

    assert clean_orphan_files(str(table), older_than=dt.timedelta(0), dry_run=True) == [
        "part=x/part-00000-orphan-c000.snappy.parquet"
    ]
    assert clean_orphan_files(str(table), older_than=dt.timedelta(0)) == [
        "part=x/part-00000-orphan-c000.snappy.parquet"
    ]
    assert not orphan.exists()
    assert hidden.exists()  # hidden directories are never touched
    assert _table_files(table) == kept
    assert _ids(table) == list(range(100, 105)) + list(range(200, 205))


def test_clean_orphan_files_leaves_a_delta_table_nested_inside_the_table(tmp_path: Path) -> None:
    # A checkpoint location kept under the output table is a set of Delta tables of its own:
    # their Parquet files are not the outer table's orphans.
    import pyarrow as pa
    from deltalake import write_deltalake

    table = tmp_path / "table"
    write_deltalake(str(table), pa.table({"id": [1, 2]}))
    nested = table / "checkpoints" / "job" / "op" / "subtask=00000"
    write_deltalake(str(nested), pa.table({"kind": ["checkpoint"]}))
    (table / "stray.parquet").write_bytes(b"an orphan of the outer table")
    removed = clean_orphan_files(str(table), older_than=dt.timedelta(0))
    assert removed == ["stray.parquet"]
    assert DeltaTable(str(nested)).to_pyarrow_table().num_rows == 1
    assert DeltaTable(str(table)).to_pyarrow_table().num_rows == 2


def test_a_table_is_not_created_over_parquet_files_its_orphan_clean_up_would_delete(
    tmp_path: Path,
) -> None:
    # before: the sink created the table over a Parquet dataset, and clean_orphan_files (or
    # cleanOrphans) then deleted the dataset's files as orphans no version named
    location = tmp_path / "data"
    (location / "year=2024").mkdir(parents=True)
    pq.write_table(_rows(0, 3), location / "old.parquet")
    pq.write_table(_rows(3, 3), location / "year=2024" / "part-0.parquet")
    before = _table_files(location)
    with pytest.raises(
        ConfigurationError,
        match=r"holds no Delta table but 2 Parquet file\(s\) \(old.parquet, "
        r"year=2024/part-0.parquet\): a table created there .* would delete them\. .*"
        r"convert_to_deltalake",
    ):
        plan_write(_unit_options(location), SOURCE_ARROW)
    assert _table_files(location) == before and not (location / NEW_TABLE_MARK).exists()
    # An overwrite asks for them to be replaced, as a Parquet (or Delta) overwrite does.
    overwrite = SinkOptions.parse({"path": str(location)}, streaming=False)
    plan_write(overwrite, SOURCE_ARROW, mode="overwrite")
    assert (location / NEW_TABLE_MARK).is_file()

    # A new location is marked as the sink's before any file is written, so that the files
    # of a write that failed before its first commit do not keep the next one out.
    fresh = tmp_path / "fresh"
    opts = _unit_options(fresh)
    failed = _unit_write(opts, 0, 10, batch_id=0)  # never committed: its write failed
    assert (fresh / NEW_TABLE_MARK).is_file()
    plan = plan_write(opts, SOURCE_ARROW)
    landed = _unit_write(opts, 0, 10, batch_id=0)
    commit_write(opts, plan, landed, mode="append", app_id="q", version=0)
    removed = clean_orphan_files(str(fresh), older_than=dt.timedelta(0))
    assert removed == sorted(f.path for f in failed)
    assert _ids(fresh) == list(range(10))
    # The first commit removes the mark: it outlived the table (deleted, its location
    # reused) and let a later write create a table over a Parquet dataset put there.
    assert not (fresh / NEW_TABLE_MARK).exists()
    shutil.rmtree(fresh / "_delta_log")
    pq.write_table(_rows(0, 3), fresh / "dataset.parquet")
    with pytest.raises(ConfigurationError, match=r"Parquet file\(s\) \(dataset.parquet, "):
        plan_write(opts, SOURCE_ARROW)
    # Files older than a mark left by an overwrite that failed before its commit were
    # there before it: they are not taken for that write's.
    stale = tmp_path / "stale"
    stale.mkdir()
    pq.write_table(_rows(0, 3), stale / "old.parquet")
    os.utime(stale / "old.parquet", (1, 1))
    plan_write(
        SinkOptions.parse({"path": str(stale)}, streaming=False), SOURCE_ARROW, mode="overwrite"
    )
    with pytest.raises(ConfigurationError, match=r"but 1 Parquet file\(s\) \(old.parquet\)"):
        plan_write(_unit_options(stale), SOURCE_ARROW)


@pytest.mark.spark
def test_the_sink_writes_to_s3_exactly_once_given_storage_options(
    sink: Any, s3: Any, tmp_path: Path
) -> None:
    # An S3 API server on 127.0.0.1, reached only through the storage.* options.
    table = f"{s3.bucket()}/table"
    options = {f"storage.{key}": value for key, value in s3.options.items()}

    def read_ids() -> list[int]:
        dataset = delta_dataset(DeltaTable(table, storage_options=s3.options), s3.options)
        return sorted(dataset.to_table(columns=["id"]).column("id").to_pylist())

    # batch: an idempotent append, run twice, and an overwrite
    df = sink.range(0, 300, numPartitions=3).selectExpr("id", "CAST(id AS STRING) AS label")
    for _ in range(2):
        df.write.format("delta_rs").options(**options).option("txnAppId", "nightly").option(
            "txnVersion", "1"
        ).mode("append").save(table)
    assert read_ids() == list(range(300))
    assert DeltaTable(table, storage_options=s3.options).transaction_version("nightly") == 1
    # streaming: stopped mid-way and restarted, every row once
    source, stream_table = tmp_path / "src", f"{s3.bucket()}/stream"
    expected = _write_source(source, files=6, rows_per_file=100)
    checkpoint = str(tmp_path / "chk")
    query = DRIVER.start_query(
        sink, str(source), stream_table, checkpoint, interval="0.5 seconds", **options
    )
    try:
        _poll(
            lambda: (
                DeltaTable.is_deltatable(stream_table, s3.options)
                and DeltaTable(stream_table, storage_options=s3.options).version() >= 1
            ),
            "two committed micro-batches",
        )
    finally:
        query.stop()
    partial = DeltaTable(stream_table, storage_options=s3.options)
    assert 0 < partial.count() < len(expected), "the query should have been stopped mid-way"
    restarted = DRIVER.start_query(
        sink, str(source), stream_table, checkpoint, interval=None, **options
    )
    restarted.awaitTermination()
    written = DeltaTable(stream_table, storage_options=s3.options)
    ids = delta_dataset(written, s3.options).to_table(columns=["id"]).column("id").to_pylist()
    assert sorted(ids) == expected
    # an orphan (a failed attempt's file) is found and deleted on S3 too
    orphan = "part-orphan.parquet"
    fs, path = filesystem(stream_table, s3.options)
    pq.write_table(_rows(0, 1), f"{path}/{orphan}", filesystem=fs)
    removed = clean_orphan_files(stream_table, older_than=0, storage_options=s3.options)
    # (also any file of a task the stop above cancelled after it had written: an orphan too)
    assert orphan in removed
    live = pa.table(written.get_add_actions()).column("path").to_pylist()
    assert not set(removed) & {unquote(p) for p in live}
    assert (
        sorted(delta_dataset(written, s3.options).to_table().column("id").to_pylist()) == expected
    )
