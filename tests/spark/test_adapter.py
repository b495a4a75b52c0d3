"""ordered_wait / unordered_wait on a real local[2,3] Spark session against the mock
enrichment service on 127.0.0.1."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import errno
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
import pyarrow as pa
import pytest
from pyspark import cloudpickle
from pyspark.sql import Row
from pyspark.sql import functions as F
from pyspark.sql.types import StructType
from task_specs import (  # tests/spark is on pythonpath
    ID_SCHEMA,
    id_task,
    id_task_run,
    run_available_now,
)

from checkpoint import SnapshotStore, UnsupportedTypeError
from stateful_async import (
    AsyncFunction,
    ConfigurationError,
    FunctionNotSerializableError,
    OutputMode,
    ResultSchemaError,
    RetryStrategy,
    Watermark,
)
from stateful_async.chaos import (
    CrashOnElement,
    MockService,
    ServiceConfig,
    ServiceEnrichment,
    ServiceError,
    expected_enrichment,
)
from stateful_async.spark import CheckpointConfig, ordered_wait, unordered_wait

pytestmark = pytest.mark.spark

# Functions defined here travel to executors by value (workers cannot import test modules).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SCHEMA = "id long, name string, score double, label string"
SCHEMA_FIELDS = ("id", "name", "score", "label")
JOB_SCRIPT = Path(__file__).with_name("adapter_job.py")


def reference(i: int) -> dict[str, Any]:
    """What enriching row i must give, computed without the service."""
    answer = expected_enrichment(str(i))
    return {"id": i, "name": f"user{i}", "score": answer["score"], "label": answer["label"]}


def source(spark, rows: int, partitions: int = 2):  # type: ignore[no-untyped-def]
    return spark.range(0, rows, numPartitions=partitions).selectExpr(
        "id", "concat('user', id) as name"
    )


def by_partition(df) -> dict[int, list[dict[str, Any]]]:  # type: ignore[no-untyped-def]
    """Output rows per partition, in the order each task emitted them."""
    out: dict[int, list[dict[str, Any]]] = {}
    for row in df.withColumn("_p", F.spark_partition_id()).collect():
        values = row.asDict()
        out.setdefault(values.pop("_p"), []).append(values)
    return out


def kill_tree(process: subprocess.Popen[str]) -> None:
    """SIGKILL a driver started with ``start_new_session=True`` and everything it started:
    its JVM, PySpark's daemon (which moves itself to its own process group, so killpg alone
    misses it) and the Python workers. They are found by the driver's session, which they
    keep even once the driver has exited and they were re-parented."""
    import psutil

    victims = []
    for candidate in psutil.process_iter():
        try:
            if os.getsid(candidate.pid) == process.pid:
                victims.append(candidate)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            pass
    for victim in victims:
        try:
            victim.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    process.wait(timeout=30)
    psutil.wait_procs(victims, timeout=30)
    assert not any(v.is_running() and v.status() != psutil.STATUS_ZOMBIE for v in victims)


@pytest.fixture(scope="module")
def service():  # type: ignore[no-untyped-def]
    with MockService(ServiceConfig(latency_ms=2)) as svc:
        yield svc


@pytest.fixture(autouse=True)
def fresh_service(service: MockService) -> MockService:
    service.configure(**{k: v for k, v in ServiceConfig(latency_ms=2).__dict__.items()})
    service.reset()
    return service


def resumed(store: SnapshotStore, job: str) -> list[Any]:
    """The checkpoints of a job that a retried task attempt (attempt 1) committed."""
    return [m for m in store.checkpoints(job) if m.properties.get("attempt") == "1"]


def crash_once_and_resume(
    wait: Any,
    df: Any,
    fn: Any,
    schema: str,
    location: Path | str,
    job: str,
    *,
    crash_at: int,
    interval: int,
    capacity: int,
    storage_options: dict[str, str] | None = None,
    **options: Any,
) -> tuple[list[Any], SnapshotStore, Any]:
    """Run ``wait`` (ordered_wait or unordered_wait) over ``df`` with a checkpoint every
    ``interval`` records; the worker dies (os._exit) at row ``crash_at`` on attempt 0 and
    attempt 1 resumes. Returns the output, the store, and the checkpoint attempt 1
    resumed from (asserted: it resumed, from a checkpoint of attempt 0)."""
    config = CheckpointConfig(
        str(location), job, interval_records=interval, retain=100, storage_options=storage_options
    )
    crashing = CrashOnElement(fn, at=[crash_at])
    out = wait(df, crashing, schema, capacity=capacity, checkpoint=config, **options).collect()
    store = SnapshotStore(location, storage_options)
    retried = resumed(store, job)
    assert retried and retried[0].parent is not None, "attempt 1 must have resumed"
    return out, store, retried[0].parent


def partition_ids(rows: int, partitions: int, partition: int) -> range:
    """The ids spark.range(0, rows, numPartitions=partitions) puts in one partition."""
    start = partition * rows // partitions
    return range(start, (partition + 1) * rows // partitions)


# -- results and ordering ------------------------------------------------------------------


def test_ordered_wait_keeps_input_order_and_matches_the_reference(spark, service) -> None:
    service.configure(distribution="uniform", latency_min_ms=0, latency_max_ms=8)
    out = ordered_wait(
        source(spark, 3000, 3), ServiceEnrichment(service.url), SCHEMA, capacity=64, timeout=10.0
    )
    assert out.schema.simpleString() == "struct<id:bigint,name:string,score:double,label:string>"
    parts = by_partition(out)
    assert sorted(parts) == [0, 1, 2]
    for p, rows in parts.items():
        assert rows == [reference(i) for i in partition_ids(3000, 3, p)]
    assert service.stats()["total"] == 3000  # one request per row, no more


def test_unordered_wait_reorders_only_between_watermarks(spark, service) -> None:
    service.configure(distribution="uniform", latency_min_ms=0, latency_max_ms=10)
    df = source(spark, 6000).withColumn("ts", F.col("id"))
    out = unordered_wait(
        df,
        ServiceEnrichment(service.url),
        SCHEMA + ", ts long",
        capacity=128,
        timeout=10.0,
        event_time="ts",
        max_out_of_orderness=0,
    )
    parts = by_partition(out)
    reordered = False
    for p, rows in parts.items():
        ids = list(partition_ids(6000, 2, p))
        assert sorted(r["id"] for r in rows) == ids
        assert all(r == {**reference(r["id"]), "ts": r["id"]} for r in rows)
        # Watermarks follow each chunk of 1024 input rows (event time = id): a result may
        # not leave its chunk's segment, so segment numbers never decrease along the output.
        segments = [(r["id"] - ids[0]) // 1024 for r in rows]
        assert segments == sorted(segments)
        reordered |= [r["id"] for r in rows] != ids
    assert reordered  # and inside segments, completion order really did reorder results


@pytest.mark.parametrize("ts_type", ["bigint", "smallint"])  # every integer type is taken
def test_rows_with_null_or_late_event_times_stay_in_the_segment_they_were_read_in(
    spark, ts_type
) -> None:
    async def echo(row):  # type: ignore[no-untyped-def]
        await asyncio.sleep((row["id"] * 7919 % 10) / 1000)  # completion order != input order
        return [row]

    # event time = id, except: every 7th row has none, and every 500th is far behind (late)
    ts = F.when(F.col("id") % 7 == 3, F.lit(None)).when(F.col("id") % 500 == 499, F.lit(0))
    ts = ts.otherwise(F.col("id")).cast(ts_type)
    df = spark.range(0, 4000, numPartitions=1).withColumn("ts", ts)
    schema = f"id long, ts {ts_type}"
    out = unordered_wait(df, echo, schema, capacity=64, event_time="ts").collect()
    ids = [r.id for r in out]
    assert sorted(ids) == list(range(4000))  # none dropped, none twice
    segments = [i // 1024 for i in ids]  # a watermark follows every chunk of 1024 rows
    assert segments == sorted(segments)
    assert ids != sorted(ids)


def test_unordered_wait_without_event_time_gives_the_same_multiset(spark, service) -> None:
    out = unordered_wait(
        source(spark, 2000), ServiceEnrichment(service.url), SCHEMA, capacity=50, timeout=10.0
    )
    assert sorted(out.collect(), key=lambda r: r.id) == [
        tuple(reference(i).values()) for i in range(2000)
    ]


def test_a_plain_async_def_works_too(spark) -> None:
    async def double(row: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"id": row["id"], "twice": row["id"] * 2}]

    out = ordered_wait(
        spark.range(0, 100, numPartitions=2), double, "id long, twice long", capacity=8
    )
    assert [tuple(r) for r in out.collect()] == [(i, 2 * i) for i in range(100)]


# -- per task: at most capacity in flight, open and close once ------------------------------


class CountsOpenAndClose(ServiceEnrichment):
    """ServiceEnrichment that also requests the key ``open-<partition>`` in every ``open``
    call and ``close-<partition>`` in every ``close`` call (each on a fresh session, so a
    repeated call is counted too): the service's counters show how often each task opened
    and closed its function."""

    async def _mark(self, event: str) -> None:
        import aiohttp
        from pyspark import TaskContext

        context = TaskContext.get()
        assert context is not None, "open/close must run inside a Spark task"
        key = f"{event}-{context.partitionId()}"
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{self.url}/enrich", params={"key": key}) as response:
                response.raise_for_status()

    async def open(self) -> None:
        await super().open()
        await self._mark("open")

    async def close(self) -> None:
        await self._mark("close")
        await super().close()


@pytest.mark.parametrize("wait", [ordered_wait, unordered_wait], ids=["ordered", "unordered"])
@pytest.mark.parametrize(
    "bound", [{"capacity": 3}, {"capacity": 12, "max_in_flight": 3}], ids=["capacity", "max"]
)
def test_each_task_keeps_at_most_capacity_requests_in_flight(spark, service, wait, bound) -> None:
    # 100 ms per request, 150 rows per task: each task is ~5 s at its limit of 3 calls, so
    # the two tasks local[2] runs at once overlap with full pipelines, even when one's Python
    # worker starts seconds after the other's on a loaded machine. With max_in_flight, every
    # 7th request is 300 ms slower: in ordered mode finished results wait behind it in the
    # queue (capacity 12) while the calls stay at 3.
    rows, partitions, calls = 300, 2, 3
    service.configure(
        latency_ms=100, spike_every=7 if "max_in_flight" in bound else 0, spike_ms=300
    )
    out = wait(
        source(spark, rows, partitions),
        ServiceEnrichment(service.url),
        SCHEMA,
        timeout=10.0,
        **bound,
    )
    parts = by_partition(out)
    assert sorted(parts) == [0, 1]
    for p, got in parts.items():
        want = [reference(i) for i in partition_ids(rows, partitions, p)]
        assert (got if wait is ordered_wait else sorted(got, key=lambda r: r["id"])) == want
    stats = service.stats()
    assert stats["total"] == rows and stats["in_flight"] == 0
    # Never more than 3 calls per task, with both tasks running at once ...
    assert stats["peak_in_flight"] <= calls * partitions
    # ... and both tasks really did overlap, each with more than one request in flight.
    assert stats["peak_in_flight"] >= calls + 1


@pytest.mark.parametrize("wait", [ordered_wait, unordered_wait], ids=["ordered", "unordered"])
def test_each_task_opens_and_closes_its_function_once(spark, service, wait) -> None:
    # 3 partitions on 2 cores: the third task runs after another in a reused Python worker.
    rows, partitions = 90, 3
    out = wait(
        source(spark, rows, partitions),
        CountsOpenAndClose(service.url),
        SCHEMA,
        capacity=4,
        timeout=10.0,
    )
    assert sorted(out.collect(), key=lambda r: r.id) == [
        tuple(reference(i).values()) for i in range(rows)
    ]
    counts = service.counts()
    events = {k: n for k, n in counts.items() if not k.isdigit()}
    assert events == {f"{e}-{p}": 1 for e in ("open", "close") for p in range(partitions)}
    assert all(counts[str(i)] == 1 for i in range(rows)) and len(counts) == rows + 6


def test_a_task_reads_no_further_while_spark_does_not_take_its_results() -> None:
    # The task itself, in this process: one input batch of 10,000 rows (Spark's default
    # batch size), 20 results per row, and a consumer that takes one output batch and
    # pauses. The task must stop invoking the function once the output queue is full, not
    # queue every row's results of the batch (200,000 rows) while Spark is busy.
    from stateful_async.spark._task import _MAX_QUEUED_BATCHES, _OUTPUT_ROWS

    async def twenty(row):  # type: ignore[no-untyped-def]
        return [row] * 20

    task = id_task_run(id_task(twenty, capacity=10), 10_000)
    out = task.run()
    taken = next(out).num_rows
    time.sleep(1.5)  # the task runs on while the consumer pauses
    queued = sum(item.num_rows for kind, item in list(task.out.queue) if kind == "batch")
    invoked = task.op.metrics.records_in
    taken += sum(batch.num_rows for batch in out)
    assert taken == 200_000
    # Rows, not batches: the calls in flight when the queue filled up (capacity * 20 rows)
    # end over several flush ticks on a loaded machine, each leaving as a small batch. The
    # bound: the batches that stopped the input, the flush that crossed it (up to two
    # batches) and what was in flight; 200,000 rows without backpressure.
    assert queued <= (_MAX_QUEUED_BATCHES + 2) * _OUTPUT_ROWS + 10 * 20, queued
    assert invoked < 2_000, invoked


def test_results_leave_a_task_in_arrow_batches_of_bounded_size() -> None:
    # A call with many results (and results piling up between two flushes) still leaves
    # in batches of at most _OUTPUT_ROWS rows, as a checkpoint's results do.
    from stateful_async.spark._task import _OUTPUT_ROWS, PartitionTask

    async def many(row):  # type: ignore[no-untyped-def]
        return [row] * 3_000

    def batches() -> Iterator[pa.RecordBatch]:
        yield pa.record_batch([pa.array(range(4), pa.int64())], schema=ID_SCHEMA)

    for wait in (OutputMode.ORDERED, OutputMode.UNORDERED):
        sizes = [batch.num_rows for batch in PartitionTask(id_task(many, wait))(batches())]
        assert sum(sizes) == 12_000
        assert max(sizes) <= _OUTPUT_ROWS, sizes


def test_a_resume_skips_a_large_input_batch_a_chunk_at_a_time(monkeypatch, tmp_path) -> None:
    # A retry skips the input its checkpoint consumed, fingerprinting it: a 5,000-row
    # input batch is turned into Python rows a chunk at a time, as reading it is.
    from checkpoint import InputFingerprint
    from stateful_async.spark._task import _CHUNK_ROWS, TaskIdentity, _TaskRun

    spec = id_task(_same_id, checkpoint=CheckpointConfig(str(tmp_path), "skip"))

    def run(attempt: int) -> int:
        batches = iter([pa.record_batch([pa.array(range(5_000), pa.int64())], schema=ID_SCHEMA)])
        task = _TaskRun(spec, batches, TaskIdentity(0, attempt, "app.stage1", {}))
        return sum(batch.num_rows for batch in task.run())

    assert run(0) == 5_000
    converted: list[int] = []
    update = InputFingerprint.update

    def counted(self, rows):  # type: ignore[no-untyped-def]
        rows = list(rows)
        converted.append(len(rows))
        update(self, rows)

    monkeypatch.setattr(InputFingerprint, "update", counted)
    assert run(1) == 5_000  # re-emitted from the checkpoint, the input skipped
    assert sum(converted) == 5_000 and max(converted) <= _CHUNK_ROWS, converted


# -- crash resume --------------------------------------------------------------------------


@pytest.mark.parametrize("max_in_flight", [None, 10], ids=["capacity", "max_in_flight"])
def test_a_worker_crash_resumes_from_the_checkpoint_exactly_once(
    spark, service, tmp_path, max_in_flight
) -> None:
    # With max_in_flight, every 25th request is 100 ms slower: finished results and elements
    # waiting for a call slot fill the queue behind it, and checkpoints hold both.
    rows, capacity, interval, crash_at = 6000, 50, 500, 2222
    if max_in_flight:
        service.configure(spike_every=25, spike_ms=100)
    config = CheckpointConfig(str(tmp_path), "crash", interval_records=interval, retain=100)
    fn = CrashOnElement(ServiceEnrichment(service.url), at=[crash_at])
    out = ordered_wait(
        source(spark, rows),
        fn,
        SCHEMA,
        capacity=capacity,
        max_in_flight=max_in_flight,
        timeout=30.0,
        checkpoint=config,
    )
    parts = by_partition(out)
    for p, got in parts.items():
        assert got == [reference(i) for i in partition_ids(rows, 2, p)]  # exactly once, in order

    counts = {int(k): v for k, v in service.counts().items()}
    assert set(counts) == set(range(rows))
    repeated = sorted(k for k, n in counts.items() if n > 1)
    assert max(counts.values()) == 2
    assert repeated, "the crash must have cost some repeated requests"
    # Only partition 0 crashed; its repeats are the records in flight at the restored
    # checkpoint or read after it: at most capacity + interval.
    assert all(k in partition_ids(rows, 2, 0) for k in repeated)
    assert len(repeated) <= capacity + interval
    store = SnapshotStore(tmp_path)
    retried = resumed(store, "crash")
    assert retried and all(m.subtask == 0 for m in retried)
    restored_from = retried[0].parent
    assert restored_from is not None
    # A batch run is one stage of one SparkContext (its application id can repeat).
    context = spark.sparkContext
    assert re.fullmatch(
        rf"{re.escape(context.applicationId)}\.{context.startTime}\.stage\d+", restored_from.run_id
    )
    restored = store.load("crash", "enrich", 0, restored_from.checkpoint_id, restored_from.run_id)
    in_flight = {e.value["id"] for e in restored.elements}
    position = restored.metadata.position
    # Exactly those: in flight at the checkpoint, or at/after its position up to the crash.
    assert set(repeated) <= in_flight | set(range(position, crash_at + capacity + 1))
    # (with max_in_flight too: calls start in input order, so every element before the
    # crashing one had been called, whether it waited for a call slot at the checkpoint)
    assert in_flight | {k for k in range(position, crash_at)} <= set(repeated)
    if max_in_flight:
        assert service.stats()["peak_in_flight"] <= 2 * max_in_flight
        assert len(restored.elements) > max_in_flight  # some waited for a slot, or their turn


def test_a_resume_restores_watermarks_and_null_structs_under_not_null_fields(
    spark, tmp_path
) -> None:
    # spark.range's id is NOT NULL, and s is a nullable struct whose field a is NOT NULL.
    # A watermark's stored input, and a null s, are null structs over NOT NULL fields,
    # which Arrow's cast refused to restore: every retry failed with UnsupportedTypeError.
    rows, crash_at, interval = 1000, 555, 50

    async def enrich(row):  # type: ignore[no-untyped-def]
        i = row["id"]
        # completion order != input order; and the last row before each checkpoint is slow,
        # so the watermark after it is still in flight when the checkpoint is taken (with
        # every call done by then, as on a loaded machine, there would be none to restore)
        slow = i % interval == interval - 1
        await asyncio.sleep(0.25 if slow else (i * 7919 % 5) / 1000)
        return [{"id": i, "s": None if i % 2 else {"a": i}}]

    df = spark.range(0, rows, numPartitions=1).withColumn(
        "info",
        F.when(F.col("id") % 3 == 0, F.lit(None)).otherwise(F.struct(F.col("id").alias("a"))),
    )
    assert not df.schema["id"].nullable and not df.schema["info"].dataType["a"].nullable
    out, store, parent = crash_once_and_resume(
        unordered_wait,
        df,
        enrich,
        "id long, s struct<a: bigint not null>",
        tmp_path,
        "wm",
        crash_at=crash_at,
        interval=interval,
        capacity=20,
        event_time="id",
        max_out_of_orderness=5,
    )
    assert sorted((r.id, r.s.a if r.s else None) for r in out) == [
        (i, None if i % 2 else i) for i in range(rows)
    ]
    restored = store.load("wm", "enrich", 0, parent.checkpoint_id, parent.run_id)
    assert any(isinstance(e, Watermark) for e in restored.elements)  # the case at stake


def test_checkpoints_on_s3_resume_a_crashed_task_and_a_new_run(spark, service, s3) -> None:
    # An object store reached only through storage_options (an S3 API server on
    # 127.0.0.1): executors commit there, a retried attempt and the driver list and read it.
    location = f"{s3.bucket()}/checkpoints"
    rows, capacity, interval = 400, 16, 50
    out, store, parent = crash_once_and_resume(
        ordered_wait,
        source(spark, rows),
        ServiceEnrichment(service.url),
        SCHEMA,
        location,
        "on-s3",
        crash_at=130,
        interval=interval,
        capacity=capacity,
        storage_options=s3.options,
    )
    assert sorted((r.asDict() for r in out), key=lambda r: r["id"]) == [
        reference(i) for i in range(rows)
    ]
    assert parent.checkpoint_id >= 2  # attempt 0 committed to S3 before it died
    assert service.stats()["total"] - rows <= capacity + interval
    # a new run resumes from the final checkpoints on S3: every result, no request
    service.reset()
    again = CheckpointConfig(location, "on-s3", restore_from="latest", storage_options=s3.options)
    fn = ServiceEnrichment(service.url)
    rerun = ordered_wait(source(spark, rows), fn, SCHEMA, capacity=capacity, checkpoint=again)
    assert sorted(r.id for r in rerun.collect()) == list(range(rows))
    assert service.stats()["total"] == 0


def test_zoned_timestamps_reach_the_function_in_utc_before_and_after_a_resume(
    spark, tmp_path
) -> None:
    # Spark hands timestamps over in the session's time zone, a checkpoint restores them in
    # UTC: rows re-invoked after a retry gave other results than on the first attempt, and
    # a resume under another session time zone was refused as changed input.
    async def hour(row):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.002)  # keeps rows in flight at every checkpoint
        ts, nested = row["ts"], row["s"]["t"]
        assert nested == ts and nested.utcoffset() == ts.utcoffset(), row
        assert row["s"]["n"] == (None if row["id"] % 2 == 0 else {"z": row["id"]}), row
        return [{"id": row["id"], "seen": f"{ts.hour:02d}h {ts.utcoffset()}"}]

    rows, crash_at = 600, 450
    expected = [(i, f"{i % 24:02d}h 0:00:00") for i in range(rows)]
    previous = spark.conf.get("spark.sql.session.timeZone")
    try:
        spark.conf.set("spark.sql.session.timeZone", "America/Los_Angeles")
        # s: a zoned timestamp beside a null struct over a NOT NULL field, which a plain
        # Arrow cast of s refuses
        df = spark.range(0, rows, numPartitions=1).selectExpr(
            "id",
            "timestamp_seconds(id * 3600) as ts",
            "named_struct('t', timestamp_seconds(id * 3600), 'n', CASE WHEN id % 2 = 0 "
            "THEN NULL ELSE named_struct('z', id) END) AS s",
        )
        out, store, parent = crash_once_and_resume(
            ordered_wait,
            df,
            hour,
            "id long, seen string",
            tmp_path,
            "tz",
            crash_at=crash_at,
            interval=100,
            capacity=20,
        )
        assert [(r.id, r.seen) for r in out] == expected
        assert store.load("tz", "enrich", 0, parent.checkpoint_id, parent.run_id).elements

        spark.conf.set("spark.sql.session.timeZone", "Asia/Tokyo")
        again = CheckpointConfig(str(tmp_path), "tz", retain=100, restore_from="latest")
        out = ordered_wait(df, hour, "id long, seen string", checkpoint=again).collect()
        assert [(r.id, r.seen) for r in out] == expected  # the same input, not a changed one
    finally:
        spark.conf.set("spark.sql.session.timeZone", previous)


def test_a_function_that_changes_its_row_changes_neither_checkpoints_nor_resume(
    spark, tmp_path
) -> None:
    # The function got the very dict the checkpoint saves and the fingerprint hashes: a
    # popped key was re-invoked as missing after a retry, and a key added made the
    # fingerprint of identical input differ, so the resume was refused.
    async def in_place(row):  # type: ignore[no-untyped-def]
        name = row.pop("name")
        row["note"] = "changed"
        await asyncio.sleep(0.005)
        answer = expected_enrichment(str(row["id"]))
        return [{"id": row["id"], "name": name, "score": answer["score"], "label": answer["label"]}]

    rows, crash_at = 1200, 700
    config = CheckpointConfig(str(tmp_path), "inplace", interval_records=200, retain=100)
    fn = CrashOnElement(in_place, at=[crash_at])
    df = source(spark, rows, partitions=1)
    out = ordered_wait(df, fn, SCHEMA, capacity=50, checkpoint=config).collect()
    assert [r.asDict() for r in out] == [reference(i) for i in range(rows)]
    store = SnapshotStore(tmp_path)
    assert resumed(store, "inplace")
    again = CheckpointConfig(str(tmp_path), "inplace", restore_from=2)
    out = ordered_wait(df, in_place, SCHEMA, capacity=50, checkpoint=again).collect()
    assert [r.asDict() for r in out] == [reference(i) for i in range(rows)]


@pytest.mark.parametrize("first", ["ordered_wait", "unordered_wait"])
def test_a_checkpointed_enrichment_chained_after_one_whose_answers_vary_resumes(
    spark, tmp_path, first: str
) -> None:
    # Two checkpointed enrichments in one stage; the first one's service answers differently
    # each time (a fetch time, noise) and its worker dies. The second had consumed (and
    # checkpointed) results the first had emitted but not yet committed; the first's retry
    # called the service again for those and got other answers, so the second's input check
    # refused every retry (InputMismatchError) and the job failed. Results now leave a task
    # only once committed: the second only consumes what a retry re-emits as it is. So
    # does a checkpointed unordered_wait's (whose order varies too: random latency).
    import random

    async def noisy(row):  # type: ignore[no-untyped-def]
        await asyncio.sleep(random.uniform(0.0, 0.04))
        return [{"id": row["id"], "score": random.random(), "pad": "x" * 1000}]

    async def passthrough(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"], "score": row["score"], "pad": row["pad"]}]

    rows, schema = 600, "id long, score double, pad string"
    df = spark.range(0, rows, numPartitions=1)

    def config(operator_id: str) -> CheckpointConfig:
        return CheckpointConfig(
            str(tmp_path), "chain", operator_id=operator_id, interval_records=200, retain=100
        )

    wait = ordered_wait if first == "ordered_wait" else unordered_wait
    inner = wait(
        df, CrashOnElement(noisy, at=[550]), schema, capacity=4, checkpoint=config("inner")
    )
    outer = ordered_wait(inner, passthrough, schema, capacity=8, checkpoint=config("outer"))
    # small Arrow batches: the second enrichment gets the first's results as they come
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    before = spark.conf.get(key)
    spark.conf.set(key, "20")
    try:
        out = outer.collect()
    finally:
        spark.conf.set(key, before)
    assert sorted(r.id for r in out) == list(range(rows))
    store = SnapshotStore(tmp_path)
    # the second attempt resumed both enrichments
    assert {m.operator_id for m in resumed(store, "chain") if m.checkpoint_id > 1} == {
        "inner",
        "outer",
    }


def test_restore_from_checkpoints_another_function_wrote_says_so(spark, tmp_path) -> None:
    # A new run resuming another function's checkpoints re-emits that function's results
    # and calls its own for the rest: it ran without a word.
    async def first(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"], "by": "first"}]

    async def second(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"], "by": "second"}]

    df = spark.range(0, 40, numPartitions=2)
    config = CheckpointConfig(str(tmp_path), "switch", interval_records=10)
    assert ordered_wait(df, first, "id long, by string", checkpoint=config).count() == 40
    again = CheckpointConfig(str(tmp_path), "switch", interval_records=10, restore_from="latest")
    with pytest.warns(
        UserWarning,
        match=r"restore_from='latest': job 'switch' \(operator 'enrich'\) resumes partition"
        r"\(s\) 0-1 from checkpoints function .*first wrote, and this job calls function "
        r".*second\. The results those checkpoints committed are re-emitted as they are",
    ) as said:
        out = ordered_wait(df, second, "id long, by string", checkpoint=again).collect()
    assert [w.filename for w in said] == [__file__]  # points at the user's call
    assert sorted((r.id, r.by) for r in out) == [(i, "first") for i in range(40)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same function resuming: nothing to say
        ordered_wait(df, first, "id long, by string", checkpoint=again).count()
        # a chaos fault around it is the same enrichment (named through __wrapped__)
        faulty = CrashOnElement(first, at=[])
        ordered_wait(df, faulty, "id long, by string", checkpoint=again).count()


def test_a_checkpointed_enrichment_after_unordered_wait_in_one_stage_is_warned_of(
    spark, tmp_path
) -> None:
    # unordered_wait's output order differs between attempts, so a checkpointed enrichment
    # reading it in the same stage cannot resume: every retry fails with InputMismatchError.
    async def f(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"]}]

    config = CheckpointConfig(str(tmp_path), "chained", operator_id="second")
    unordered = unordered_wait(spark.range(0, 20, numPartitions=2), f, "id long")
    with pytest.warns(
        UserWarning,
        match=r"This checkpointed ordered_wait reads the output of an unordered_wait without "
        r"checkpoints in the same Spark stage\..* Give that unordered_wait a checkpoint too "
        r".* use ordered_wait there, sort its output within partitions",
    ) as said:
        chained = ordered_wait(
            unordered.filter("id > 2").select("id"), f, "id long", checkpoint=config
        )
    assert [w.filename for w in said] == [__file__]
    assert chained.count() == 17  # a warning: the failure-free run is right
    with pytest.warns(UserWarning, match="This checkpointed unordered_wait reads the output"):
        unordered_wait(unordered.union(spark.range(3)), f, "id long", checkpoint=config)
    # narrow steps that are no projection: coalesce (a Repartition without shuffle), observe
    for narrow in (unordered.coalesce(1), unordered.observe("seen", F.count(F.lit(1)))):
        with pytest.warns(UserWarning, match="This checkpointed ordered_wait reads the output"):
            ordered_wait(narrow, f, "id long", checkpoint=config)
    stream = spark.readStream.format("rate").load().select(F.col("value").alias("id"))
    with pytest.warns(UserWarning, match="This checkpointed ordered_wait reads the output"):
        ordered_wait(unordered_wait(stream, f, "id long"), f, "id long", checkpoint=config)
    watermarked = unordered_wait(stream, f, "id long").withColumn("at", F.current_timestamp())
    watermarked = watermarked.withWatermark("at", "1 second")
    with pytest.warns(UserWarning, match="This checkpointed ordered_wait reads the output"):
        ordered_wait(
            watermarked, f, "id long", checkpoint=dataclasses.replace(config, operator_id="third")
        )
    ordered = ordered_wait(spark.range(0, 20, numPartitions=2), f, "id long")
    cached = unordered_wait(spark.range(0, 20, numPartitions=2), f, "id long").persist()
    cached.count()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these is warned of
        ordered_wait(ordered, f, "id long", checkpoint=config)  # same order every attempt
        ordered_wait(unordered.sortWithinPartitions("id"), f, "id long", checkpoint=config)
        ordered_wait(unordered.repartition(2), f, "id long", checkpoint=config)  # a shuffle
        ordered_wait(cached, f, "id long", checkpoint=config)  # read from the cache
        ordered_wait(unordered, f, "id long")  # no checkpoint: a retry starts over
        # a checkpointed unordered_wait hands over committed results only, re-emitted
        # in their order by a retry
        first = dataclasses.replace(config, operator_id="first")
        checkpointed = unordered_wait(spark.range(0, 20), f, "id long", checkpoint=first)
        ordered_wait(checkpointed.filter("id > 2"), f, "id long", checkpoint=config)
    cached.unpersist()


def test_checkpoints_name_a_wrapped_function_after_the_function_it_runs() -> None:
    # The name checkpoints record (and resumes compare): ThreadPoolAsyncFunction(f) was
    # "ThreadPoolAsyncFunction" whatever f, and a chaos fault around f was not f. The name
    # recorded before is still taken as the same function (the second).
    from stateful_async import ThreadPoolAsyncFunction
    from stateful_async._function import as_async_function
    from stateful_async.chaos import CrashDuringCommit
    from stateful_async.spark._task import function_names

    def blocking(row):  # type: ignore[no-untyped-def]
        return [row]

    class Own(ThreadPoolAsyncFunction):
        def invoke(self, value):  # type: ignore[no-untyped-def]
            return [value]

    def name(f: Any) -> str:
        return f"{f.__module__}.{f.__qualname__}"

    pool = "stateful_async._function.ThreadPoolAsyncFunction"
    assert function_names(ThreadPoolAsyncFunction(blocking)) == (name(blocking), pool)
    assert function_names(Own()) == (name(Own),)  # a subclass with its own invoke is itself
    wrapped = CrashDuringCommit(CrashOnElement(ThreadPoolAsyncFunction(blocking), at=[]), 1)
    assert function_names(wrapped) == (name(blocking), name(CrashDuringCommit))
    assert function_names(as_async_function(FailsAndFailsToClose())) == (
        name(FailsAndFailsToClose),
    )


def test_a_micro_batch_stopped_before_an_upgrade_resumes_after_it(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The task itself, in this process. Checkpoints of ThreadPoolAsyncFunction(f) written
    # before it was named after f: the replayed batch was refused as another function's.
    import stateful_async.spark._task as task_module
    from stateful_async import ThreadPoolAsyncFunction
    from stateful_async.spark._task import TaskIdentity, _TaskRun

    def blocking(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"]}]

    def attempt(group: str, fail_at: int | None = None) -> list[int]:
        config = CheckpointConfig(str(tmp_path), "stream", interval_records=2)
        spec = id_task(ThreadPoolAsyncFunction(blocking), checkpoint=config)
        properties = {"batch_id": "3", "query_id": "query", "job_group": group}
        identity = TaskIdentity(0, 0, "query.batch3", properties)

        def batches():  # type: ignore[no-untyped-def]
            for i in range(8):
                if i == fail_at:
                    raise RuntimeError("the query stopped")
                yield pa.record_batch([pa.array([i], pa.int64())], schema=ID_SCHEMA)

        return [i for b in _TaskRun(spec, batches(), identity).run() for i in b["id"].to_pylist()]

    with monkeypatch.context() as before_the_upgrade:
        before_the_upgrade.setattr(
            task_module,
            "function_names",
            lambda fn: ("stateful_async._function.ThreadPoolAsyncFunction",),
        )
        with pytest.raises(RuntimeError, match="the query stopped"):
            attempt("run-1", fail_at=5)
    assert attempt("run-2") == list(range(8))
    resumed = SnapshotStore(tmp_path).subtask("stream", "enrich", 0).checkpoints()
    assert [m.checkpoint_id for m in resumed] == [1, 2, 3, 4, 5]  # went on from 2


def test_maps_reach_the_function_as_dicts_before_and_after_a_resume(spark, tmp_path) -> None:
    # pyarrow gives a MAP as a list of (key, value) pairs: "a" in row["m"] was False and
    # row["m"]["a"] a TypeError, where PySpark's own Rows and pandas UDFs give dicts.
    async def look_up(row):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.002)  # keeps rows in flight at every checkpoint
        i, m, s, arr, mm = row["id"], row["m"], row["s"], row["arr"], row["mm"]
        assert m == {"a": i, "b": -i} and "a" in m, row
        assert s == {"x": i, "sm": {"k": "v"}} and arr == [{"c": 1}, None, {}], row
        assert mm == {"outer": {"inner": i}} and row["sk"] == [({"p": 1}, i)], row
        return [{"id": i, "a": m["a"], "inner": mm["outer"]["inner"]}]

    rows, crash_at = 400, 300
    df = spark.range(0, rows, numPartitions=1).selectExpr(
        "id",
        "map('a', id, 'b', -id) AS m",
        "named_struct('x', id, 'sm', map('k', 'v')) AS s",
        "array(map('c', 1), CAST(NULL AS map<string, int>), map()) AS arr",
        "map('outer', map('inner', id)) AS mm",
        "map(named_struct('p', 1), id) AS sk",  # struct keys: a dict cannot hold them
    )
    out, store, parent = crash_once_and_resume(
        ordered_wait,
        df,
        look_up,
        "id long, a long, inner long",
        tmp_path,
        "maps",
        crash_at=crash_at,
        interval=100,
        capacity=20,
    )
    assert [tuple(r) for r in out] == [(i, i, i) for i in range(rows)]
    assert store.load("maps", "enrich", 0, parent.checkpoint_id, parent.run_id).elements

    # the row as given passes through to a MAP result unchanged
    async def same(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"], "m": row["m"]}]

    back = ordered_wait(df.limit(3), same, "id long, m map<string, long>").collect()
    assert [r.m for r in back] == [{"a": i, "b": -i} for i in range(3)]


def test_watermarks_never_go_back_after_a_resume_and_fit_64_bits(spark, tmp_path) -> None:
    # The last watermark generated was not kept once emitted: a resumed attempt generated
    # watermarks from the input after the checkpoint alone, lower than before. And an event
    # time near the smallest 64-bit integer gave a watermark a checkpoint could not store.
    async def enrich(row):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.02)  # a checkpoint's chunk is still in flight, its watermark queued
        return [{"id": row["id"]}]

    rows, crash_at = 800, 450
    low = -(2**63)
    df = spark.range(0, rows, numPartitions=1).selectExpr(
        "id", f"CASE WHEN id = 0 THEN 1000000 WHEN id = 1 THEN {low}L ELSE id END AS t"
    )
    out, store, _ = crash_once_and_resume(
        unordered_wait,
        df,
        enrich,
        "id long",
        tmp_path,
        "wm",
        crash_at=crash_at,
        interval=100,
        capacity=200,
        event_time="t",
    )
    assert sorted(r.id for r in out) == list(range(rows))
    metas = store.checkpoints("wm")
    stored = []
    for meta in metas:
        snapshot = store.load("wm", "enrich", 0, meta.checkpoint_id, meta.run_id)
        stored += [e.timestamp for e in snapshot.elements if isinstance(e, Watermark)]
    assert stored and set(stored) == {999_999}, stored  # never lower than the first
    assert {m.properties.get("watermark") for m in metas} == {"999999"}

    lowest = spark.range(0, 5, numPartitions=1).selectExpr("id", f"{low}L AS t")
    config = CheckpointConfig(str(tmp_path), "low", interval_records=1, retain=100)
    out = unordered_wait(
        lowest, enrich, "id long", capacity=10, checkpoint=config, event_time="t"
    ).collect()
    assert sorted(r.id for r in out) == list(range(5))
    assert {m.properties["watermark"] for m in store.checkpoints("low")} == {str(low)}


@pytest.mark.parametrize(
    "before, after",
    [
        ({"event_time": "ts"}, {"event_time": "id"}),  # microseconds, then the id's units
        ({"event_time": "id"}, {"event_time": "id", "max_out_of_orderness": 100}),
    ],
)
def test_a_resume_with_another_event_time_setting_generates_its_own_watermarks(
    spark, tmp_path, before, after
) -> None:
    # A resumed task carried on from the watermark its checkpoint recorded, whatever the
    # event_time setting: after a job failed with event_time on a timestamp column (its
    # watermarks in microseconds) and resumed with event_time="id", no id ever passed it,
    # so the rest of the partition had no watermark and results crossed every chunk's end;
    # with a larger max_out_of_orderness, the watermarks of two chunks were lost.
    failing = tmp_path / "failing"  # the first run's function fails while this exists
    failing.touch()

    async def enrich(row):  # type: ignore[no-untyped-def]
        if row["id"] == 170 and failing.exists():
            raise RuntimeError("the first run fails here, on every attempt")
        await asyncio.sleep(0.3 if row["id"] % 50 == 49 else 0)  # each chunk's last is slow
        return [{"id": row["id"]}]

    def run(restore_from: str | None, kwargs: dict[str, Any]) -> list[int]:
        df = spark.range(0, 300, numPartitions=1).selectExpr("id", "timestamp_seconds(id) AS ts")
        config = CheckpointConfig(
            str(tmp_path / "ckpt"),
            "switch",
            interval_records=50,
            retain=100,
            restore_from=restore_from,
        )
        out = unordered_wait(df, enrich, "id long", capacity=20, checkpoint=config, **kwargs)
        return [r.id for r in out.collect()]

    with pytest.raises(Exception, match="the first run fails here"):
        run(None, before)
    store = SnapshotStore(tmp_path / "ckpt")
    assert max(m.position for m in store.checkpoints("switch")) == 150
    failing.unlink()
    ids = run("latest", after)
    assert sorted(ids) == list(range(300))
    # A watermark follows each chunk of 50 (its largest id grew): a result never crosses it,
    # so the slow last row of a chunk leaves before every row of the next.
    segments = [i // 50 for i in ids]
    assert segments == sorted(segments), ids[190:230]
    ooo = after.get("max_out_of_orderness", 0)
    latest = store.checkpoints("switch")[-1]
    assert latest.final and latest.properties["watermark"] == str(299 - ooo - 1)


def test_a_checkpoint_written_before_event_time_was_recorded_still_carries_its_watermark(
    spark, tmp_path
) -> None:
    # Checkpoints record event_time and max_out_of_orderness since watermarks are carried on
    # only when both match; one written before (its watermark alone) matched nothing, so a
    # job resumed from it with the same event_time generated watermarks lower than the one
    # it recorded (58999999 after 148999999 here), which the docs say never happens.
    from checkpoint import InputFingerprint
    from stateful_async.spark._adapter import _arrow_schema, _output_struct

    async def enrich(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"]}]

    df = spark.range(0, 300, numPartitions=1).selectExpr(
        "id", "timestamp_seconds(CASE WHEN id < 150 THEN id ELSE id - 140 END) AS ts"
    )
    input_schema = _arrow_schema(df.schema, "input")
    output_schema = _arrow_schema(_output_struct("id long"), "output")
    consumed = pa.Table.from_pandas(df.limit(150).toPandas(), schema=input_schema).to_pylist()
    fingerprint = InputFingerprint()
    fingerprint.update(consumed)
    store = SnapshotStore(tmp_path)
    store.subtask("old", "enrich", 0).commit(  # as the version before wrote it
        "an-earlier-run",
        3,
        [],
        [{"id": i} for i in range(150)],
        input_schema=input_schema,
        output_schema=output_schema,
        position=150,
        fingerprint=fingerprint.hexdigest(),
        properties={"function": f"{__name__}.{enrich.__qualname__}", "watermark": "148999999"},
    )
    config = CheckpointConfig(str(tmp_path), "old", interval_records=50, restore_from="latest")
    out = unordered_wait(df, enrich, "id long", checkpoint=config, event_time="ts").collect()
    assert sorted(r.id for r in out) == list(range(300))
    resumed_ones = [
        m for m in store.checkpoints("old", include_expired=True) if m.run_id != "an-earlier-run"
    ]
    assert [m.position for m in resumed_ones][:3] == [200, 250, 300]
    # no watermark below the recorded one: none for ids 150-249 (event times 10-109 s)
    assert [m.properties["watermark"] for m in resumed_ones][:3] == [
        "148999999",
        "148999999",
        "158999999",
    ]


@pytest.mark.parametrize("event_time", [None, "id"])
def test_interval_seconds_checkpoints_in_the_middle_of_a_slow_chunk(
    spark, tmp_path, event_time
) -> None:
    # 20 ms per call, 4 in flight: ~200 rows/s, so the 400 rows of one Arrow chunk take ~2 s.
    # The time used to be looked at only between chunks: no checkpoint before the last.
    async def slow(row):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.02)
        return [row]

    rows = 400
    config = CheckpointConfig(
        str(tmp_path), "timed", interval_records=10**9, interval_seconds=0.25, retain=100
    )
    kwargs = {"event_time": event_time} if event_time else {}
    out = unordered_wait(
        spark.range(0, rows, numPartitions=1),
        slow,
        "id long",
        capacity=4,
        checkpoint=config,
        **kwargs,
    ).collect()
    assert sorted(r.id for r in out) == list(range(rows))
    positions = sorted(m.position for m in SnapshotStore(tmp_path).checkpoints("timed"))
    assert positions[-1] == rows  # the final checkpoint
    assert len(positions) >= 4, positions  # ~2 s at one per 0.25 s, allowing a slow machine
    # one checkpoint per position, but for the last: a timed one may fall right after the
    # last record was read (calls still in flight), before the final one (none in flight)
    periodic = positions[:-1]
    assert periodic == sorted(set(periodic)), positions
    assert positions.count(rows) <= 2, positions


def test_two_chained_enrichments_sharing_a_checkpoint_config_are_told_so(
    spark, tmp_path, monkeypatch
) -> None:
    # Without distinct operator_ids they write one table: in one stage they are one run and
    # refuse each other's checkpoints; across a shuffle each expires the other's.
    from stateful_async.spark import _adapter

    async def inc(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"] + 1}]

    async def dec(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"] - 1}]

    config = CheckpointConfig(str(tmp_path), "chained", interval_records=50)
    df = spark.range(0, 400, numPartitions=2).selectExpr("nullif(id, -1) AS id")
    first = ordered_wait(df, inc, "id long", checkpoint=config)
    # Refused when the second is declared (it was found by each task attempt, ~9 s later).
    refused = (
        r"This ordered_wait checkpoints as job 'chained', operator 'enrich' at .*, and so does "
        r"the ordered_wait whose output it reads: .* Give each enrichment its own operator_id"
    )
    for upstream in (first, first.repartition(3).filter("id > 0")):
        with pytest.raises(ConfigurationError, match=refused):
            ordered_wait(upstream, dec, "id long", checkpoint=config)
    elsewhere = CheckpointConfig(str(tmp_path / "elsewhere"), "chained", interval_records=50)
    ordered_wait(first, dec, "id long", checkpoint=elsewhere)  # other tables: fine
    # Where the driver cannot read the plan (Spark Connect), the tasks refuse.
    monkeypatch.setattr(_adapter, "_refuse_if_tables_taken_upstream", lambda *args: None)
    out = ordered_wait(first, dec, "id long", checkpoint=config)
    with pytest.raises(Exception, match=r"Two enrichments of one run \(one Spark stage"):
        out.collect()
    monkeypatch.undo()
    # With an operator_id each, the same chain runs.
    second = CheckpointConfig(str(tmp_path), "chained2", interval_records=50, operator_id="dec")
    first = CheckpointConfig(str(tmp_path), "chained2", interval_records=50)
    out = ordered_wait(
        ordered_wait(df, inc, "id long", checkpoint=first), dec, "id long", checkpoint=second
    )
    assert sorted(r.id for r in out.collect()) == list(range(400))


def test_input_columns_with_a_dot_in_their_name_reach_the_function_as_they_are(
    spark, tmp_path
) -> None:
    # mapInArrow resolves its input columns by name and reads `a.b` as a struct field
    # (UNRESOLVED_COLUMN before any job ran); common after flattening JSON. A name with a
    # backtick failed to parse (INVALID_ATTRIBUTE_NAME_SYNTAX); `*` read as a star; two
    # names differing only in case were AMBIGUOUS_REFERENCE.
    async def fn(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"], "x.y": row["a.b"] + row["q`b"], "c": row["s.t"]["c.d"]}]

    df = spark.range(0, 200, numPartitions=2).selectExpr(
        "id",
        "id * 3 AS `a.b`",
        "named_struct('c.d', -id) AS `s.t`",
        "id AS `e.t`",
        "id * 10 AS `q``b`",
    )
    schema = "id long, `x.y` long, c long"
    want = [(i, 13 * i, -i) for i in range(200)]
    out = ordered_wait(df, fn, schema, capacity=4).collect()
    assert [tuple(r) for r in out] == want

    async def seen(row):  # type: ignore[no-untyped-def]
        return [{"names": ",".join(row), "star": row["*"], "upper": row["A"]}]

    odd = spark.range(3).selectExpr("id AS a", "-id AS A", "2 * id AS `*`")
    out = ordered_wait(odd, seen, "names string, star long, upper long").collect()
    assert [tuple(r) for r in out] == [("a,A,*", 2 * i, -i) for i in range(3)]
    # with event time from such a column, and a crash resumed from a checkpoint
    config = CheckpointConfig(str(tmp_path), "dots", interval_records=20)
    crashing = CrashOnElement(fn, at=[150])
    out = unordered_wait(
        df, crashing, schema, capacity=4, event_time="e.t", checkpoint=config
    ).collect()
    assert sorted(tuple(r) for r in out) == want
    store = SnapshotStore(str(tmp_path))
    metas = store.checkpoints("dots", include_expired=True)
    assert any(m.properties["attempt"] == "1" and m.parent is not None for m in metas)
    # the checkpoints know the columns by their own names, not the ones Spark was handed
    assert {m.properties["event_time"] for m in metas} == {"e.t"}
    input_schema, _ = store.subtask("dots", "enrich", 0).schemas()  # type: ignore[misc]
    assert input_schema.names == ["id", "a.b", "s.t", "e.t", "q`b"]


def test_coalesce_after_a_checkpointed_enrichment_is_refused_with_what_to_do(
    spark, tmp_path
) -> None:
    # coalesce(1) computes the enrichment's 4 partitions one after another in one task, all
    # reporting partition 0: the second took the first one's checkpoints as its own and
    # was refused as "not deterministic input" (wrongly blaming a shuffle).
    async def double(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"], "v": 2 * row["id"]}]

    df = spark.range(0, 100, numPartitions=4)
    config = CheckpointConfig(str(tmp_path), "coalesced", interval_records=10)
    enriched = ordered_wait(df, double, "id long, v long", checkpoint=config)
    with pytest.raises(Exception) as info:
        enriched.coalesce(1).collect()
    text = " ".join(str(info.value).split())
    assert (
        "ConfigurationError: Spark is running partition 0 of this checkpointed enrichment" in text
    )
    assert "coalesce() after ordered_wait / unordered_wait does this" in text
    assert "use repartition(n) instead" in text
    # The advice works: repartition instead of coalesce; or coalesce the input first.
    again = CheckpointConfig(str(tmp_path), "repartitioned", interval_records=10)
    out = ordered_wait(df, double, "id long, v long", checkpoint=again).repartition(1)
    assert sorted(r.v for r in out.collect()) == [2 * i for i in range(100)]
    first = CheckpointConfig(str(tmp_path), "coalesced-first", interval_records=10)
    out = ordered_wait(df.coalesce(1), double, "id long, v long", checkpoint=first)
    assert [r.v for r in out.collect()] == [2 * i for i in range(100)]


# -- job resume after the driver is killed -------------------------------------------------


def test_a_killed_job_resumes_with_restore_from(spark, service, tmp_path) -> None:
    rows, capacity, interval = 4000, 10, 250
    location = tmp_path / "ckpt"
    service.configure(latency_ms=15)
    driver = subprocess.Popen(
        [
            sys.executable,
            str(JOB_SCRIPT),
            str(location),
            "resume",
            service.url,
            str(rows),
            str(tmp_path / "never.json"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        store = SnapshotStore(location)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # until both partitions made durable progress
            done = {}
            if location.exists() and (location / "resume").exists():
                for m in store.checkpoints("resume"):
                    done[m.subtask] = done.get(m.subtask, 0) + 1
            if len(done) == 2 and min(done.values()) >= 2:
                break
            assert driver.poll() is None, "the job finished before it could be killed"
            time.sleep(0.1)
        else:
            raise AssertionError("the job made no progress")
    finally:
        kill_tree(driver)
    assert not (tmp_path / "never.json").exists()
    killed = {m.subtask: m for m in store.checkpoints("resume")}  # newest per partition
    assert all(not m.final for m in killed.values())
    before = {int(k): n for k, n in service.counts().items()}

    def resume(restore_from: str | int) -> Any:
        config = CheckpointConfig(
            str(location),
            "resume",
            interval_records=interval,
            retain=100,
            restore_from=restore_from,
        )
        return ordered_wait(
            source(spark, rows),
            ServiceEnrichment(service.url),
            SCHEMA,
            capacity=capacity,
            timeout=30.0,
            checkpoint=config,
        )

    # Resume from the latest checkpoints, in a new application (this test's session).
    service.configure(latency_ms=2)
    service.reset()
    out = resume("latest")
    parts = by_partition(out)
    for p, got in parts.items():
        assert got == [reference(i) for i in partition_ids(rows, 2, p)]
    after = {int(k): n for k, n in service.counts().items()}
    # Exactly the records in flight at each restored checkpoint, and those after it.
    expected_requests: set[int] = set()
    for p, meta in killed.items():
        snapshot = store.load("resume", "enrich", p, meta.checkpoint_id, meta.run_id)
        expected_requests |= {e.value["id"] for e in snapshot.elements}
        expected_requests |= set(partition_ids(rows, 2, p)[meta.position :])
    assert set(after) == expected_requests and max(after.values()) == 1
    repeated = set(after) & set(before)
    assert len(repeated) <= 2 * (capacity + interval)

    # Resume again, from checkpoint 1 of each partition: only what followed it is requested.
    service.reset()
    out = resume(1)
    assert sorted(out.collect()) == sorted(tuple(reference(i).values()) for i in range(rows))
    again = {int(k) for k in service.counts()}
    first = {p: store.load("resume", "enrich", p, 1, killed[p].run_id) for p in (0, 1)}
    assert again == {
        i
        for p, snap in first.items()
        for i in [
            *(e.value["id"] for e in snap.elements),
            *partition_ids(rows, 2, p)[snap.metadata.position :],
        ]
    }

    # Changed input cannot resume these checkpoints: refused with a clear error.
    changed = source(spark, rows).withColumn("name", F.concat(F.col("name"), F.lit("!")))
    config = CheckpointConfig(
        str(location), "resume", interval_records=interval, restore_from="latest"
    )
    refused = (
        "cannot resume from checkpoint .* The input differs.* split into the same partitions.*"
        "a union or a repartition added before the enrichment.* start a new run without"
    )
    with pytest.raises(Exception, match=refused):
        ordered_wait(
            changed,
            ServiceEnrichment(service.url),
            SCHEMA,
            capacity=capacity,
            timeout=30.0,
            checkpoint=config,
        ).collect()


def test_restore_from_without_checkpoints_is_refused_up_front(spark, tmp_path) -> None:
    async def f(row):  # type: ignore[no-untyped-def]
        return [row]

    config = CheckpointConfig(str(tmp_path), "nothing-here", restore_from="latest")
    with pytest.raises(ConfigurationError, match="has no checkpoints at"):
        ordered_wait(spark.range(3), f, "id long", checkpoint=config)

    # A mistyped job_id or operator_id: the error says what the location does hold.
    missing = CheckpointConfig(str(tmp_path / "missing"), "score-users", restore_from="latest")
    with pytest.raises(ConfigurationError, match=r"\(there is nothing at that location\)"):
        ordered_wait(spark.range(3), f, "id long", checkpoint=missing)
    first = CheckpointConfig(str(tmp_path), "score-users")
    assert len(ordered_wait(spark.range(3), f, "id long", checkpoint=first).collect()) == 3
    typo = CheckpointConfig(str(tmp_path), "score-user", restore_from="latest")
    with pytest.raises(ConfigurationError, match=r"; jobs there: 'score-users'\. Check"):
        ordered_wait(spark.range(3), f, "id long", checkpoint=typo)
    other = CheckpointConfig(str(tmp_path), "score-users", restore_from=1, operator_id="enrich2")
    with pytest.raises(ConfigurationError, match=r"\(the job has operator\(s\) 'enrich'\)"):
        ordered_wait(spark.range(3), f, "id long", checkpoint=other)


def test_a_checkpoint_location_the_job_cannot_write_is_refused_up_front(spark, tmp_path) -> None:
    async def f(row):  # type: ignore[no-untyped-def]
        return [row]

    (tmp_path / "a-file").write_text("not a directory")
    for location in (tmp_path / "a-file", tmp_path / "a-file" / "checkpoints"):
        config = CheckpointConfig(str(location), "job")
        with pytest.raises(ConfigurationError, match=r"a-file is a file\. Choose a directory"):
            ordered_wait(spark.range(3), f, "id long", checkpoint=config)
    # Directories the job cannot create or write (root writes nearly everywhere, but not in
    # /proc or /sys): every task attempt failed on them, with delta-rs's message.
    for location, failed in (("/proc/nope/checkpoints", "creating"), ("/sys/fs", "writing to")):
        config = CheckpointConfig(location, "job")
        with pytest.raises(ConfigurationError, match=f"is not writable: {failed} it failed"):
            ordered_wait(spark.range(3), f, "id long", checkpoint=config)
    # A location checked that way is left as it was: the tasks create it.
    new = tmp_path / "new" / "checkpoints"
    ordered_wait(spark.range(3), f, "id long", checkpoint=CheckpointConfig(str(new), "job"))
    assert not (tmp_path / "new").exists()


def test_a_location_the_driver_cannot_reach_is_refused_naming_it(monkeypatch, tmp_path) -> None:
    # Path.exists raises PermissionError under a directory the driver cannot enter (as
    # measured for another user): it escaped as it was.
    from stateful_async.spark._adapter import _check_local_location

    private, exists = tmp_path / "private", Path.exists

    def denied(path: Path) -> bool:
        if private in (path, *path.parents) and path != private:
            raise PermissionError(13, "Permission denied", str(path))
        return exists(path)

    monkeypatch.setattr(Path, "exists", denied)
    with pytest.raises(ConfigurationError, match=r"not writable: reaching it failed \(\[Errno 13"):
        _check_local_location(str(private / "checkpoints"))


def test_the_progress_setting_checked_is_the_one_executors_see() -> None:
    from stateful_async.spark._adapter import _check_progress

    bad = {"STATEFUL_ASYNC_PROGRESS_SECONDS": "soon"}
    _check_progress("5", "local[2]", bad)  # spark.executorEnv wins over the environment
    _check_progress(None, "spark://host:7077", bad)  # a cluster's executors: not this one
    _check_progress(None, "local[2]", {**bad, "STATEFUL_ASYNC_TASK_LOG": "0"})  # not read
    with pytest.raises(ConfigurationError, match="the driver's environment has 'soon'"):
        _check_progress(None, "local[2]", bad)
    with pytest.raises(ConfigurationError, match=r"spark\.executorEnv\.STATEFUL_ASYNC_PROGRESS_"):
        _check_progress("-1", "local[2]", {})


def test_names_differing_only_in_case_are_refused_up_front_with_checkpoints(
    spark, tmp_path
) -> None:
    async def f(row):  # type: ignore[no-untyped-def]
        return [{"x": row["id"], "X": row["ID"]}]

    spark.conf.set("spark.sql.caseSensitive", "true")  # Spark then allows `id` beside `ID`
    try:
        df = spark.createDataFrame([(1, 10), (2, 20)], "id long, ID long")
        # Without checkpoints nothing is stored in Delta, and the names are fine.
        assert ordered_wait(df, f, "x long, X long").collect() == [(1, 10), (2, 20)]
        location = tmp_path / "ckpt"
        config = CheckpointConfig(str(location), "job")
        cases = [
            (df, "x long, y long", r"'input' has fields 'id' and 'ID'"),
            (df.drop("ID"), "x long, X long", r"'result' has fields 'x' and 'X'"),
            (
                df.selectExpr("id", "named_struct('a', 1, 'A', 2) AS s"),
                "x long",
                r"'input\.s' has fields 'a' and 'A'",
            ),
        ]
        for frame, schema, problem in cases:
            with pytest.raises(UnsupportedTypeError, match=problem + ".*differ only in case"):
                ordered_wait(frame, f, schema, checkpoint=config)  # before any task runs
        assert not location.exists()
    finally:
        spark.conf.set("spark.sql.caseSensitive", "false")


def test_a_relative_checkpoint_location_is_taken_from_the_driver_directory_and_home(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert CheckpointConfig("checkpoints", "job").location == str(tmp_path / "checkpoints")
    # ~ was taken as a directory named "~" in the working directory, silently
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert CheckpointConfig("~/chk", "job").location == str(tmp_path / "home" / "chk")
    assert SnapshotStore("~/chk").location == str(tmp_path / "home" / "chk")
    # a space pasted around the location was a directory named "chk " (the sink strips it)
    assert CheckpointConfig(" ~/chk \n", "job").location == str(tmp_path / "home" / "chk")
    with pytest.raises(ConfigurationError, match="location must be a path or URI; got ' '"):
        CheckpointConfig(" ", "job")


def test_file_uris_of_every_spelling_are_the_local_path(tmp_path) -> None:
    # Spark and Hadoop print local paths as file:/abs; that used to become ./file:/abs.
    for uri in (f"file:{tmp_path}", f"file://{tmp_path}", f"file://localhost{tmp_path}"):
        assert CheckpointConfig(uri, "job").location == str(tmp_path)
        assert SnapshotStore(uri).location == str(tmp_path)


def test_ordered_wait_does_not_resume_from_unordered_waits_checkpoints(
    spark, tmp_path, monkeypatch
) -> None:
    # unordered_wait's committed results are in completion order: ordered_wait re-emitting
    # them would break its input order without a word. The other way round is fine.
    async def double(row):  # type: ignore[no-untyped-def]
        if row["id"] % 5 == 0:
            await asyncio.sleep(0.02)  # completes after the rows read behind it
        return [{"id": row["id"], "twice": 2 * row["id"]}]

    df = spark.range(0, 40, numPartitions=2)
    schema = "id long, twice long"
    want = [(i, 2 * i) for i in range(40)]

    def config(job_id, restore_from=None):  # type: ignore[no-untyped-def]
        return CheckpointConfig(
            str(tmp_path), job_id, interval_records=10, restore_from=restore_from
        )

    first = unordered_wait(df, double, schema, capacity=8, checkpoint=config("mixed"))
    assert [(r.id, r.twice) for r in first.collect()] != want  # emitted out of order
    # refused on the driver, before any task runs
    with pytest.raises(
        ConfigurationError,
        match=r"restore_from='latest': job 'mixed' \(operator 'enrich'\) would resume "
        r"partition\(s\) 0-1 from checkpoints that unordered_wait wrote, and this is "
        r"ordered_wait\..* Resume with unordered_wait, or start ordered_wait fresh",
    ):
        ordered_wait(df, double, schema, capacity=8, checkpoint=config("mixed", "latest"))
    # ... and by the task (the checkpoints may change after the driver looked)
    import stateful_async.spark._adapter as adapter

    with monkeypatch.context() as patched:
        patched.setattr(adapter, "_check_order_kept", lambda *args: None)
        late = ordered_wait(df, double, schema, capacity=8, checkpoint=config("mixed", 2))
    with pytest.raises(
        Exception,
        match=r"Partition [01] cannot resume from checkpoint \S+ \(job 'mixed', operator "
        r"'enrich'\): unordered_wait wrote it, and this job runs ordered_wait\.",
    ):
        late.collect()
    # unordered_wait resumes from its own checkpoints and from ordered_wait's
    again = unordered_wait(df, double, schema, capacity=8, checkpoint=config("mixed", "latest"))
    assert sorted((r.id, r.twice) for r in again.collect()) == want
    ordered_wait(df, double, schema, capacity=8, checkpoint=config("in-order")).collect()
    switched = unordered_wait(
        df, double, schema, capacity=8, checkpoint=config("in-order", "latest")
    )
    assert [(r.id, r.twice) for r in switched.collect()] == want  # the order it restored
    # a fresh ordered_wait on another operator_id of the same job is not held back
    fresh = CheckpointConfig(str(tmp_path), "mixed", operator_id="ordered", interval_records=10)
    out = ordered_wait(df, double, schema, capacity=8, checkpoint=fresh).collect()
    assert [(r.id, r.twice) for r in out] == want


def test_restore_from_on_a_streaming_dataframe_is_refused_up_front(spark, tmp_path) -> None:
    async def f(row):  # type: ignore[no-untyped-def]
        return [row]

    (tmp_path / "in").mkdir()
    stream = spark.readStream.schema("id long").json(str(tmp_path / "in"))
    config = CheckpointConfig(str(tmp_path / "ckpt"), "stream", restore_from="latest")
    with pytest.raises(ConfigurationError, match="restore_from='latest' is for batch jobs"):
        ordered_wait(stream, f, "id long", checkpoint=config)
    # without restore_from the same stream is accepted, and enriches
    (tmp_path / "in" / "a.json").write_text('{"id": 1}\n{"id": 2}\n')
    out = ordered_wait(stream, f, "id long", checkpoint=CheckpointConfig(str(tmp_path), "s"))
    assert out.isStreaming and out.schema.simpleString() == "struct<id:bigint>"
    writer = out.writeStream.format("memory").queryName("restore_from_refused")
    run_available_now(writer, tmp_path / "spark")
    assert sorted(r.id for r in spark.table("restore_from_refused").collect()) == [1, 2]


def test_a_partition_whose_restore_point_expired_fails_instead_of_starting_fresh(
    spark, tmp_path, monkeypatch
) -> None:
    async def double(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"], "twice": 2 * row["id"]}]

    # partition 0: 25 rows (checkpoints 1, 2 and the final 3); partition 1: 100 rows
    # (checkpoints 1..10, final 11), of which retain=3 keeps 9, 10 and 11
    df = spark.range(0, 200, numPartitions=2).where("id < 25 or id >= 100")
    schema = "id long, twice long"

    def config(restore_from):  # type: ignore[no-untyped-def]
        return CheckpointConfig(
            str(tmp_path), "expiring", interval_records=10, retain=3, restore_from=restore_from
        )

    assert ordered_wait(df, double, schema, capacity=4, checkpoint=config(None)).count() == 125
    store = SnapshotStore(str(tmp_path))
    live = {
        p: sorted(m.checkpoint_id for m in store.checkpoints("expiring") if m.subtask == p)
        for p in (0, 1)
    }
    assert live == {0: [1, 2, 3], 1: [9, 10, 11]}
    # 3 is restorable in partition 0 (`checkpoints list` shows it) but expired in partition
    # 1: refused on the driver, before any task runs, naming the ids both can resume from
    with pytest.raises(
        ConfigurationError,
        match=r"restore_from=3: 1 partition\(s\) of job 'expiring' have no restorable "
        r"checkpoint with id 3 or lower \(partition 1: 1-3 expired, restorable 9-11\)\..* "
        r"Ids every partition can resume from: 9-11;",
    ):
        ordered_wait(df, double, schema, capacity=4, checkpoint=config(3))
    # ... and the task checks it too (the checkpoints may expire after the driver looked)
    import stateful_async.spark._adapter as adapter

    with monkeypatch.context() as patched:
        patched.setattr(adapter, "_check_every_partition_can_restore", lambda *args: None)
        late = ordered_wait(df, double, schema, capacity=4, checkpoint=config(3))
    with pytest.raises(
        Exception,
        match=r"Partition 1 cannot resume from restore_from=3: its checkpoint\(s\) 1-3 "
        r"have expired .* Restorable ids of this partition: 9-11\.",
    ):
        late.collect()
    # an id both partitions can still restore works
    rows = ordered_wait(df, double, schema, capacity=4, checkpoint=config(11)).collect()
    assert sorted((r.id, r.twice) for r in rows) == [
        (i, 2 * i) for i in [*range(25), *range(100, 200)]
    ]
    # an id no partition reached is refused on the driver, not taken as "latest"
    with pytest.raises(
        ConfigurationError,
        match=r"no partition of job 'expiring' reached checkpoint 12\. Checkpoint ids that "
        r"exist: 1-3, 9-11;",
    ):
        ordered_wait(df, double, schema, capacity=4, checkpoint=config(12))
    # an id below every restorable one says they expired, not that they never existed
    store.expire("expiring", retain=1)
    with pytest.raises(
        ConfigurationError,
        match=r"no restorable checkpoint with id 2 or lower \(checkpoints 1-2 have expired: "
        r"`retain` keeps only the newest of each partition\)\. Restorable checkpoint ids: "
        r"3, 11\.",
    ):
        ordered_wait(df, double, schema, capacity=4, checkpoint=config(2))


# -- timeouts, retries, errors ---------------------------------------------------------------


def test_retries_and_timeouts_against_a_misbehaving_service(spark, service) -> None:
    service.configure(fail_first={"5": 2, "17": 1, "40": 3}, hang_first={"9": 1, "33": 1})
    fn = ServiceEnrichment(service.url, fallback={"score": -1.0, "label": "fallback"})
    retry = RetryStrategy.fixed_delay(4, 0.05, retry_on_exception=(ServiceError,))
    out = ordered_wait(source(spark, 60), fn, SCHEMA, capacity=16, timeout=1.5, retry=retry)
    got = {r.id: r.asDict() for r in out.collect()}
    fallback_keys = {9, 33}  # hung: the timeout handler's fallback decided them
    for i in range(60):
        want = reference(i)
        if i in fallback_keys:
            want = {**want, "score": -1.0, "label": "fallback"}
        assert got[i] == want
    counts = service.counts()
    assert (counts["5"], counts["17"], counts["40"]) == (3, 2, 4)  # failures, then success
    assert (counts["9"], counts["33"]) == (1, 1)  # a hang is no error: the timeout decided
    assert all(counts[str(i)] == 1 for i in range(60) if i not in (5, 17, 40))


def test_no_retry_starts_past_the_timeout_which_covers_all_attempts(spark, service) -> None:
    service.configure(fail_first={"12": 10})  # would succeed at the 11th attempt
    fn = ServiceEnrichment(service.url, fallback={"score": -1.0, "label": "fallback"})
    retry = RetryStrategy.fixed_delay(20, 0.4, retry_on_exception=(ServiceError,))
    out = ordered_wait(source(spark, 20), fn, SCHEMA, capacity=8, timeout=1.0, retry=retry)
    got = {r.id: r.asDict() for r in out.collect()}
    assert got == {
        i: {**reference(i), "score": -1.0, "label": "fallback"} if i == 12 else reference(i)
        for i in range(20)
    }
    counts = service.counts()
    # Attempts start at 0, 0.4 and 0.8 s; the next would start at 1.2 s, past the 1.0 s
    # deadline measured from the first attempt, so it never does: the fallback decides.
    assert 2 <= counts["12"] <= 3
    assert all(counts[str(i)] == 1 for i in range(20) if i != 12)


def test_retries_running_out_fail_the_job_naming_the_row(spark, service) -> None:
    service.configure(fail_first={"7": 1000})
    retry = RetryStrategy.fixed_delay(3, 0.01, retry_on_exception=(ServiceError,))
    with pytest.raises(Exception, match=r"'id': 7.* after 3 attempts: ServiceError"):
        ordered_wait(
            source(spark, 10),
            ServiceEnrichment(service.url),
            SCHEMA,
            capacity=4,
            timeout=10.0,
            retry=retry,
        ).collect()
    # 3 attempts (max_attempts counts them all) in each of Spark's 3 task attempts
    assert service.counts()["7"] == 3 * 3


def _row_seven_again(results: list[Any]) -> bool:  # the rows as returned, nothing of the task's
    return [set(r) for r in results] == [set(SCHEMA_FIELDS)] and results[0]["id"] == 7


class RetriesRowSeven(RetryStrategy):
    """A strategy that decides in its own should_retry_result."""

    def should_retry_result(self, results: Any) -> bool:
        return _row_seven_again(results)


class RowSevenStrategy(RetryStrategy):
    """A strategy with its own __init__ (its fields are not its constructor's arguments)."""

    def __init__(self) -> None:
        super().__init__(3, 0.01, retry_on_result=_row_seven_again)


@pytest.mark.parametrize(
    "retry",
    [
        RetryStrategy.fixed_delay(3, 0.01, retry_on_result=_row_seven_again),
        RetriesRowSeven(3, 0.01),
        RowSevenStrategy(),
    ],
    ids=["predicate", "subclass-method", "subclass-init"],
)
def test_a_result_predicate_sees_the_result_rows_the_function_returned(
    spark, service, retry
) -> None:
    out = ordered_wait(
        source(spark, 10),
        ServiceEnrichment(service.url),
        SCHEMA,
        capacity=4,
        timeout=10.0,
        retry=retry,
    )
    assert [r.asDict() for r in out.collect()] == [reference(i) for i in range(10)]
    counts = service.counts()
    # row 7's result was rejected on every attempt, so all 3 were made and the last emitted
    assert counts["7"] == 3 and all(counts[str(i)] == 1 for i in range(10) if i != 7)


def test_a_timeout_without_fallback_fails_the_job_naming_the_row(spark, service) -> None:
    service.configure(hang_first={"3": 100})  # hangs on every attempt of every task retry
    with pytest.raises(Exception, match=r"did not complete within the 0.5 s timeout .*'id': 3"):
        ordered_wait(
            source(spark, 10),
            ServiceEnrichment(service.url),
            SCHEMA,
            capacity=4,
            timeout=timedelta(seconds=0.5),
        ).collect()


def test_a_failing_function_is_reported_with_the_input_row_and_the_line_that_raised(
    spark,
) -> None:
    async def enrich(row):  # type: ignore[no-untyped-def]
        scores = {0: 1.0, 1: 2.0, 2: 3.0, 4: 5.0}
        return [{"id": row["id"], "score": scores[row["id"]]}]

    with pytest.raises(Exception) as info:
        ordered_wait(spark.range(0, 5, numPartitions=1), enrich, "id long, score double").collect()
    message = str(info.value)
    assert re.search(
        r"The async function failed for input row \{'id': 3\} \(record 3 of partition 0\) "
        r"after 1 attempt: KeyError: 3 \(raised at .*test_adapter\.py:\d+, in enrich\)\.",
        message,
    ), message
    assert "StreamRecord" not in message


@pytest.mark.parametrize("fails", ["raises", "returns a wrong result"])
def test_an_error_shows_the_input_row_as_the_function_got_it(fails: str) -> None:
    # The task itself, in this process. Maps reach the function as dicts, but the row an
    # error named showed them as pyarrow gives them, lists of pairs: [('a', 1)].
    from stateful_async import OutputMode
    from stateful_async._function import as_async_function
    from stateful_async.spark._task import TaskIdentity, TaskSpec, _TaskRun

    async def enrich(row):  # type: ignore[no-untyped-def]
        assert row["m"] == {"a": 1} and row["s"]["inner"] == {"b": [2]}
        if fails == "raises":
            raise ValueError("no such user")
        return [{"id": row["id"], "extra": 1}]

    inputs = pa.schema(
        [
            ("id", pa.int64()),
            ("m", pa.map_(pa.string(), pa.int64())),
            ("s", pa.struct([("inner", pa.map_(pa.string(), pa.list_(pa.int64())))])),
            ("k", pa.map_(pa.struct([("p", pa.int64())]), pa.int64())),  # keys no dict holds
            ("e", pa.map_(pa.string(), pa.int64())),
        ]
    )
    spec = TaskSpec(
        as_async_function(enrich), OutputMode.ORDERED, 4, None, None, inputs, ID_SCHEMA,
        None, 0, None, "app",
    )  # fmt: skip
    batch = pa.record_batch(
        [[7], [[("a", 1)]], [{"inner": [("b", [2])]}], [[({"p": 1}, 3)]], [[]]], schema=inputs
    )
    with pytest.raises(Exception) as info:
        list(_TaskRun(spec, iter([batch]), TaskIdentity(0, 0, "app.stage1", {})).run())
    shown = "{'id': 7, 'm': {'a': 1}, 's': {'inner': {'b': [2]}}, 'k': [({'p': 1}, 3)], 'e': {}}"
    assert f"input row {shown}" in str(info.value), str(info.value)


def test_a_dataframe_returned_as_results_is_refused_naming_the_input_row() -> None:
    # Iterated, a DataFrame gives its column labels: the error said "returned a str result",
    # which the function never did. An async def and a wrapped blocking function alike, a
    # pandas and a polars DataFrame. (The message had two parentheticals in a row, and
    # "returned DataFrame", which reads as a Spark one.)
    import pandas as pd
    import polars as pl

    from stateful_async import InvalidResultError, ThreadPoolAsyncFunction
    from stateful_async.spark._task import PartitionTask

    for make, library, rows in (
        (pd.DataFrame, "pandas", "df.to_dict('records')"),
        (pl.DataFrame, "polars", "df.to_dicts()"),
    ):

        async def frame(row, make=make):  # type: ignore[no-untyped-def]
            return make([row])

        def blocking_frame(row, make=make):  # type: ignore[no-untyped-def]
            return make([row])

        for fn in (frame, ThreadPoolAsyncFunction(blocking_frame)):
            # one row: of two, either call (on its own thread) could fail the task first
            batches = iter([pa.record_batch([pa.array([7], pa.int64())], schema=ID_SCHEMA)])
            with pytest.raises(InvalidResultError) as info:
                list(PartitionTask(id_task(fn))(batches))
            assert str(info.value) == (
                f"The async function returned a {library} DataFrame for input row {{'id': 7}} "
                "(record 0 of partition 0); it must return a list of result rows (dicts): "
                f"[row] for one result, [] for none, and {rows} for the rows of a {library} "
                "DataFrame df."
            )


class FailsAndFailsToClose(AsyncFunction):
    """Fails on row 3, and its close() fails too (as a client broken by the same cause)."""

    async def async_invoke(self, row):  # type: ignore[no-untyped-def]
        if row["id"] == 3:
            raise ConnectionResetError("connection reset by peer")
        return [row]

    async def close(self) -> None:
        raise RuntimeError("cannot close a broken connection")


def test_a_close_that_raises_after_a_failure_does_not_hide_it(spark) -> None:
    with pytest.raises(Exception) as info:
        ordered_wait(
            spark.range(0, 5, numPartitions=1), FailsAndFailsToClose(), "id long"
        ).collect()
    assert re.search(
        r"The async function failed for input row \{'id': 3\} \(record 3 of partition 0\) after "
        r"1 attempt: ConnectionResetError: connection reset by peer",
        str(info.value),
    ), str(info.value)


def test_the_close_error_a_failed_task_logs_has_its_traceback(capsys) -> None:
    # The task itself, in this process (an executor's stderr does not reach the test).

    with pytest.raises(Exception, match="connection reset by peer"):
        list(id_task_run(id_task(FailsAndFailsToClose(), capacity=2), 5).run())
    logged = capsys.readouterr().err
    assert re.search(
        r"partition 0 attempt 0: the function's close\(\) raised RuntimeError: cannot close a "
        r"broken connection, after the task had failed with AsyncFunctionError, which the task "
        r"reports\. close\(\)'s traceback:\nTraceback \(most recent call last\):\n(.|\n)*"
        r"test_adapter\.py\", line \d+, in close\n",
        logged,
    ), logged
    # and, as a task that succeeds, one line saying what the attempt did before it failed
    assert re.search(
        r"^stateful-async: partition 0 attempt 0, run app\.stage1, [1-5] records? invoked, "
        r"[0-3] results? emitted, 0 retries, 0 timeouts, [\d.]+ s \(failed: AsyncFunctionError\)$",
        logged,
        re.MULTILINE,
    ), logged


async def _echo_in_5_ms(row):  # type: ignore[no-untyped-def]
    await asyncio.sleep(0.005)
    return [row]


def test_a_task_spark_stops_reading_early_logs_that_it_stopped_not_that_it_failed(
    capsys,
) -> None:
    # show(), take() and limit(n) stop reading a task's rows: its loop is cancelled, which
    # is no failure of the task, and its line says so (it read "(failed: CancelledError)").

    rows = id_task_run(id_task(_echo_in_5_ms), 5000).run()
    assert next(rows).num_rows > 0
    rows.close()  # what Spark does when it wants no more
    logged = capsys.readouterr().err
    assert re.search(
        r"^stateful-async: partition 0 attempt 0, run app\.stage1, [\d,]+ records? invoked, "
        r"[\d,]+ results? emitted, 0 retries, 0 timeouts, [\d.]+ s "
        r"\(stopped: Spark read no further\)$",
        logged,
        re.MULTILINE,
    ), logged
    assert "failed" not in logged


class _BlocksInAThread(AsyncFunction):
    """Row 2's call blocks in the loop's default executor until ``release`` is set (a
    blocking client with no timeout of its own); row 3 fails if ``fail`` is set."""

    def __init__(self, release: threading.Event, fail: bool = False) -> None:
        self.release, self.fail = release, fail

    async def async_invoke(self, row):  # type: ignore[no-untyped-def]
        if row["id"] == 2:
            await asyncio.to_thread(self.release.wait)
        if row["id"] == 3 and self.fail:
            raise ValueError("no such key")
        return [row]

    async def timeout(self, row):  # type: ignore[no-untyped-def]
        return [row]


@pytest.mark.parametrize("fail", [False, True], ids=["task-succeeds", "task-fails"])
def test_a_call_left_blocking_in_a_thread_does_not_hold_the_tasks_end_for_ever(
    fail: bool, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The operator gives up on row 2's call (it times out, or the task fails), but its
    # thread blocks on. asyncio.run waited for it at the task's end, with no limit: the
    # task never ended, a failed one never reported its error. It waits while such calls
    # keep ending, and gives up once none has for _THREAD_CALLS_SECONDS (here 0.5 s).
    from stateful_async.spark import _task

    monkeypatch.setattr(_task, "_THREAD_CALLS_SECONDS", 0.5)
    release = threading.Event()
    unblock = threading.Timer(10, release.set)  # the old code's task ends only then
    unblock.start()
    spec = dataclasses.replace(id_task(_BlocksInAThread(release, fail)), timeout=0.2)
    task = id_task_run(spec, 5)
    try:
        if fail:
            with pytest.raises(Exception, match=r"input row \{'id': 3\}.*no such key"):
                list(task.run())
        else:
            assert [r for b in task.run() for r in b.column("id").to_pylist()] == [0, 1, 2, 3, 4]
        assert not release.is_set()  # ended while the call still blocks
    finally:
        unblock.cancel()
        release.set()
    logged = capsys.readouterr().err
    assert (
        "stateful-async: partition 0 attempt 0: 1 call the function left in the event loop's "
        "default executor (asyncio.to_thread, run_in_executor(None, ...)) still running, "
        "none ended in 0.5 s; the task ends without them, and they go on in their threads. "
        "A call the task gave up on (timed out, or of a failed or stopped task) is not "
        "stopped by that: give blocking calls a timeout of their own.\n"
    ) in logged, logged


def test_the_tasks_end_waits_for_thread_calls_while_they_keep_ending(
    capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Calls the function started in threads and did not await (writes it fires and
    # forgets) are waited for while any ends within _THREAD_CALLS_SECONDS: three of 0.3,
    # 0.6 and 0.9 s all finish, though the last ends past 0.5 s.
    from stateful_async.spark import _task

    monkeypatch.setattr(_task, "_THREAD_CALLS_SECONDS", 0.5)
    written: list[int] = []

    def write(row_id: int) -> None:
        time.sleep(0.3 * (row_id + 1))
        written.append(row_id)

    async def fire_and_forget(row):  # type: ignore[no-untyped-def]
        asyncio.get_running_loop().run_in_executor(None, write, row["id"])
        return [row]

    task = id_task_run(id_task(fire_and_forget), 3)
    assert sum(b.num_rows for b in task.run()) == 3
    assert sorted(written) == [0, 1, 2]
    assert "default executor" not in capsys.readouterr().err


class _SleepsInAThread(AsyncFunction):
    """Each call sleeps 0.3 s in the loop's default executor; a timeout keeps the row."""

    async def async_invoke(self, row):  # type: ignore[no-untyped-def]
        await asyncio.to_thread(time.sleep, 0.3)
        return [row]

    async def timeout(self, row):  # type: ignore[no-untyped-def]
        return [row]


def test_a_thread_call_cancelled_before_it_ran_does_not_hold_the_tasks_end(
    capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 40 calls at once, more than the default executor's threads (at most 32): those still
    # queued when their element times out are cancelled and never run. They were counted
    # as running for ever: the task's end waited _THREAD_CALLS_SECONDS for nothing and
    # said they were left running.
    from stateful_async.spark import _task

    monkeypatch.setattr(_task, "_THREAD_CALLS_SECONDS", 2.0)
    spec = dataclasses.replace(id_task(_SleepsInAThread()), timeout=0.1)
    assert sum(b.num_rows for b in id_task_run(spec, 40).run()) == 40
    logged = capsys.readouterr().err
    assert "default executor" not in logged, logged
    assert re.search(
        r"^stateful-async: partition 0 attempt 0, .* 40 timeouts, [\d.]+ s$", logged, re.M
    ), logged


@pytest.mark.parametrize("fail", [False, True], ids=["task-succeeds", "task-fails"])
def test_a_task_spark_stops_reading_while_it_waits_for_thread_calls_still_logs_its_end(
    fail: bool, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The task has run every row (or failed on the last) and waits at its end for a call
    # row 0 left in a thread, when Spark stops reading (show(), take()). That cancellation
    # was raised out of the wait, in _main's finally: the task's line was lost, and the
    # error it had failed with.
    from stateful_async.spark import _task

    monkeypatch.setattr(_task, "_THREAD_CALLS_SECONDS", 30.0)
    release, waiting = threading.Event(), threading.Event()
    let_end = _task._TaskRun._let_thread_calls_end

    async def let_end_saying_so(self):  # type: ignore[no-untyped-def]
        waiting.set()  # it yields to the loop first in the wait: no cancellation before
        await let_end(self)

    monkeypatch.setattr(_task._TaskRun, "_let_thread_calls_end", let_end_saying_so)

    async def leaves_a_call(row):  # type: ignore[no-untyped-def]
        if row["id"] == 0:
            asyncio.get_running_loop().run_in_executor(None, release.wait)
        if fail and row["id"] == 4999:
            raise ValueError("no such key")
        return [row]

    task = id_task_run(id_task(leaves_a_call), 5000)
    rows = task.run()
    try:
        assert next(rows).num_rows == 1024
        assert waiting.wait(10)  # the task is at its end, waiting for the call
        rows.close()  # what Spark does when it wants no more
    finally:
        release.set()
    ending = r" \(failed: AsyncFunctionError\)" if fail else ""
    results = "4,999" if fail else "5,000"
    logged = capsys.readouterr().err
    assert re.search(
        r"^stateful-async: partition 0 attempt 0, run app\.stage1, 5,000 records invoked, "
        rf"{results} results emitted, 0 retries, 0 timeouts, [\d.]+ s{ending}$",
        logged,
        re.MULTILINE,
    ), logged
    assert "default executor" not in logged, logged


class _WatchesInAThread(AsyncFunction):
    """open() starts a loop of blocking calls in threads (a long poll of a config service,
    each 0.3 s) until ``stop`` is set; close() does not stop it."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop

    async def open(self) -> None:
        async def watch() -> None:
            while not self.stop.is_set():
                await asyncio.to_thread(self.stop.wait, 0.3)

        self.watch = asyncio.create_task(watch())

    async def async_invoke(self, row):  # type: ignore[no-untyped-def]
        return [row]


def test_a_task_left_starting_thread_calls_does_not_hold_the_tasks_end(
    capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    # asyncio.run cancels the tasks left on the loop, then waits for the default executor.
    # The wait for thread calls came before that cancellation: a loop the function left
    # running kept starting calls that each ended within _THREAD_CALLS_SECONDS, and the
    # task never ended. It cancels them first, as asyncio.run does.
    from stateful_async.spark import _task

    monkeypatch.setattr(_task, "_THREAD_CALLS_SECONDS", 2.0)
    stop = threading.Event()
    task = id_task_run(id_task(_WatchesInAThread(stop)), 10)
    rows: list[int] = []
    ran = threading.Thread(target=lambda: rows.extend(b.num_rows for b in task.run()))
    ran.start()
    try:
        ran.join(10)
        assert not ran.is_alive()  # the task ended while the function's loop ran on
    finally:
        stop.set()
        ran.join()
    assert sum(rows) == 10
    logged = capsys.readouterr().err
    assert "default executor" not in logged, logged  # the loop's last call ended
    assert re.search(r"^stateful-async: partition 0 attempt 0, .*, [\d.]+ s$", logged, re.M)


async def _same_id(row):  # type: ignore[no-untyped-def]
    return [row]


def test_a_long_task_logs_its_progress(spark, capsys, monkeypatch, tmp_path) -> None:
    # The task itself, in this process (an executor's stderr does not reach the test): 40
    # rows at 5 ms each, two at a time, take about 0.1 s; a progress line every 0.03 s.
    from stateful_async.spark._task import TaskIdentity, _TaskRun

    schema = pa.schema([("id", pa.int64())])
    config = CheckpointConfig(str(tmp_path / "chk"), "progress", interval_records=10)
    spec = id_task(_echo_in_5_ms, capacity=2, checkpoint=config)

    def run(rows: int, attempt: int = 1, read_seconds: float = 0.0) -> str:
        def batches() -> Iterator[pa.RecordBatch]:  # 4-row batches, each read_seconds late
            for start in range(0, rows, 4):
                time.sleep(read_seconds)
                ids = pa.array(range(start, min(start + 4, rows)), pa.int64())
                yield pa.record_batch([ids], schema=schema)

        identity = TaskIdentity(3, attempt, f"app.stage{rows}", {})
        assert sum(b.num_rows for b in _TaskRun(spec, batches(), identity).run()) == rows
        return capsys.readouterr().err

    def progress(log: str) -> list[str]:
        return [line for line in log.splitlines() if line.endswith("(in progress)")]

    monkeypatch.setenv("STATEFUL_ASYNC_PROGRESS_SECONDS", "0.03")
    lines = progress(run(40))
    assert lines, "no progress line"
    assert re.fullmatch(
        r"stateful-async: partition 3 attempt 1, run app\.stage40, \d+ records? invoked "
        r"\([\d,]+/s lately\), \d+ results? emitted, (1 call|[02] calls) in flight, "
        r"\d+ in the queue, 0 retries, 0 timeouts, "
        r"[\d.]+ s, \d+ checkpoints?(, the last \d+ s ago)? \(in progress\)",
        lines[0],
    ), lines[0]
    counts = [int(re.search(r"(\d+) records? invoked", line).group(1)) for line in lines]  # type: ignore[union-attr]
    assert counts == sorted(counts) and counts[-1] <= 40

    # A retry of the same run resumes from the final checkpoint: it re-reads (slowly) and
    # skips all 40 rows and re-emits their results, and says so while it does.
    lines = progress(run(40, attempt=2, read_seconds=0.02))
    skipped = [
        int(found.group(1))
        for line in lines
        if (found := re.search(r"restored from app\.stage40:\d+ \(.*, (\d+) inputs skipped", line))
    ]
    assert any(0 < n < 40 for n in skipped), lines  # while it skips
    assert skipped == sorted(skipped)

    monkeypatch.setenv("STATEFUL_ASYNC_PROGRESS_SECONDS", "0")
    assert "(in progress)" not in run(41)
    # a bad setting fails the task before it touches the checkpoints (a retry's claim on the
    # run is a commit)
    log_dir = tmp_path / "chk" / "progress"
    versions = sorted(p.name for p in log_dir.rglob("_delta_log/*.json"))
    monkeypatch.setenv("STATEFUL_ASYNC_PROGRESS_SECONDS", "soon")
    with pytest.raises(ConfigurationError, match="PROGRESS_SECONDS must be a number of seconds"):
        run(40, attempt=3)
    assert sorted(p.name for p in log_dir.rglob("_delta_log/*.json")) == versions
    # ... which the driver refuses before any task runs where it can see it (in local mode
    # the tasks' environment is its own): each task attempt failed on it
    with pytest.raises(ConfigurationError, match="the driver's environment has 'soon'"):
        ordered_wait(spark.range(3), _same_id, "id long")


class _StderrThatFails(io.StringIO):
    """An executor's stderr that refuses the task's first ``failures`` lines (OSError: a
    broken pipe or a full disk behind it), and takes the rest."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def write(self, text: str) -> int:
        if text.startswith("stateful-async:") and self.failures > 0:
            self.failures -= 1
            raise OSError(errno.EIO, "Input/output error")
        return super().write(text)


def test_a_progress_line_that_fails_to_print_stops_neither_later_lines_nor_the_task(
    monkeypatch,
) -> None:
    # The task itself, in this process. A progress line that raised ended the progress
    # timer's callback before it set the next one: no progress line after it. And a
    # summary line that raised failed the task, whose every result was computed.

    spec = id_task(_echo_in_5_ms, capacity=2)

    def run(partition: int) -> int:
        return sum(b.num_rows for b in id_task_run(spec, 60, partition).run())

    monkeypatch.setenv("STATEFUL_ASYNC_PROGRESS_SECONDS", "0.02")
    stderr = _StderrThatFails(failures=1)  # the first progress line
    monkeypatch.setattr(sys, "stderr", stderr)
    assert run(0) == 60
    assert stderr.failures == 0  # it did refuse one
    lines = stderr.getvalue().splitlines()
    assert [line for line in lines if line.endswith("(in progress)")], lines  # after it
    assert re.search(
        r"^stateful-async: partition 0 attempt 0, .* 60 records invoked, .* s$", lines[-1]
    )

    closed = io.StringIO()  # a stderr that takes no line at all: each write a ValueError
    closed.close()
    monkeypatch.setattr(sys, "stderr", closed)
    assert run(1) == 60


def test_a_result_missing_a_field_names_it_and_the_input_row(spark) -> None:
    async def incomplete(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"]}]

    with pytest.raises(
        Exception,
        match=r"input row \{'id': 0\} \(record 0 of partition 0\) does not match the output "
        r"schema: missing field\(s\) \['score'\]",
    ):
        ordered_wait(
            spark.range(0, 5, numPartitions=1), incomplete, "id long, score double", capacity=2
        ).collect()


@pytest.mark.parametrize(
    ("result", "schema", "message"),
    [
        ({"id": 0, 1: "x", "z": 2}, "id long", r"unexpected field\(s\) \['z', 1\]"),
        (
            {"id": 0, "st": {"a": 1, 1: "x", "z": 2}},
            "id long, st struct<a: long>",
            r"unexpected field\(s\) \['z', 1\] would be dropped",
        ),
    ],
    ids=["top-level", "nested"],
)
def test_extra_keys_of_mixed_types_are_named(spark, result, schema, message) -> None:
    # sorting keys of mixed types (1 < 'z') raised TypeError in place of the schema error
    async def odd_keys(row):  # type: ignore[no-untyped-def]
        return [result]

    with pytest.raises(Exception, match=message):
        ordered_wait(spark.range(0, 1, numPartitions=1), odd_keys, schema).collect()


@pytest.mark.parametrize(
    ("result", "schema", "message"),
    [
        (
            {"score": "high"},
            "id long, score double",
            r"result field 'score' \(double\) cannot hold 'high' \(str\): a floating-point "
            r"field takes a float \(or an int\), not a str, returned for input row \{'id': 0\} "
            r"\(record 0 of partition 0\)",
        ),
        # pyarrow would silently truncate these: 2.5 into a long is 2
        (
            {"score": 2.5},
            "id long, score long",
            r"result field 'score' \(int64\) cannot hold 2.5 \(float\): an integer field would "
            r"truncate it, returned for input row \{'id': 0\} \(record 0 of partition 0\)",
        ),
        # ... and drop a struct's unknown keys, at any depth
        (
            {"score": {"value": 1, "tags": [{"name": "a", "weight": 1.0}]}},
            "id long, score struct<value: long, tags: array<struct<name: string>>>",
            r"result field 'score.tags\[0\]' \(struct<name: string>\) cannot hold "
            r"\{'name': 'a', 'weight': 1.0\} \(dict\): unexpected field\(s\) \['weight'\] would be "
            r"dropped \(the struct has \['name'\]\), returned for input row \{'id': 0\} "
            r"\(record 0 of partition 0\)",
        ),
        # ... and read an epoch in seconds as microseconds: 1970-01-01 00:28:20
        (
            {"score": 1_700_000_000},
            "id long, score timestamp",
            r"result field 'score' \(timestamp\[us, tz=UTC\]\) cannot hold 1700000000 \(int\): "
            r"a timestamp field would read a number as microseconds since 1970",
        ),
    ],
    ids=["str-for-double", "float-for-long", "extra-nested-key", "epoch-for-timestamp"],
)
def test_a_result_of_the_wrong_type_names_the_field_and_the_input_row(
    spark, result, schema, message
) -> None:
    async def wrong(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"], **result}]

    with pytest.raises(Exception, match=message):
        ordered_wait(spark.range(0, 5, numPartitions=1), wrong, schema, capacity=2).collect()


AB = collections.namedtuple("AB", ["a", "b"])
BA = collections.namedtuple("BA", ["b", "a"])


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"id": 2.0, "st": {"a": 1}}, None),  # whole: no loss; missing "b" is null
        ({"id": 1, "st": (1, 2), "m": [("k", 3)]}, None),
        ({"id": 1, "st": Row(a=1, b=2)}, None),
        ({"id": 1, "st": (1.5, 2)}, r"'st.a' \(int64\) cannot hold 1.5"),  # by position
        ({"id": 1, "st": Row(b=2, a=1)}, r"a Row's fields are taken by position"),
        ({"id": 1, "st": AB(a=1, b=2)}, None),
        # before: stored by position, b's value in a and a's in b
        ({"id": 1, "st": BA(b=2, a=1)}, r"a namedtuple's fields are taken by position"),
        ({"id": 1, "m": [("k", 1), ("j", 2)]}, None),
        # before: a map holding "k" twice (collect() gave one value, m['k'] the other)
        ({"id": 1, "m": [("k", 1), ("k", 2)]}, r"would hold the key 'k' twice"),
        ({"id": 1, "m": [{"key": "k", "value": 1}, {"key": "k", "value": 1}]}, r"key 'k' twice"),
        ({"id": 1, "m": [{"key": "k", "value": 2.5}]}, r"\"m\['k'\]\" \(int64\) cannot hold 2.5"),
        ({"id": 1, "m": [{"key": "k"}]}, None),  # a missing "value" is null, as in a struct
        # before: the extra keys were dropped, silently ({"k": 1})
        (
            {"id": 1, "m": [{"key": "k", "value": 1, "Value": 2}]},
            r"'m' \(map<string, int64>\) cannot hold .*: a map entry \{'key': 'k', 'value': 1, "
            r"'Value': 2\} has unexpected key\(s\) \['Value'\], which would be dropped.*return "
            r"a dict of the map, or its entries as \(key, value\) pairs.*input row \{'id': 0\}",
        ),
        ({"id": 1, "m": ({"key": "k", "value": 1}, {"key": "j", "value": 2, "n": 3})}, r"\['n'\]"),
        ({"id": float("nan")}, r"'id' \(int64\) cannot hold nan"),
    ],
)
def test_result_conversion_refuses_only_what_would_lose_data(value, problem) -> None:
    from stateful_async.spark._results import to_batch

    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("st", pa.struct([("a", pa.int64()), ("b", pa.int64())])),
            ("m", pa.map_(pa.string(), pa.int64())),
        ]
    )
    row = {"st": None, "m": None, **value}
    if problem is None:
        assert to_batch([row], [{"id": 0}], schema).num_rows == 1
    else:
        with pytest.raises(ResultSchemaError, match=problem):
            to_batch([row], [{"id": 0}], schema)


def test_a_map_entry_with_unexpected_keys_is_named_within_bounds() -> None:
    # The entry was written whole into the message: a long value made an error (and a
    # Spark task failure) of 100 KB, where every other value in these errors is cut short
    from stateful_async.spark._results import to_batch

    schema = pa.schema([("m", pa.map_(pa.string(), pa.string()))])
    entry = {"key": "k", "value": "x" * 100_000, "Value": "y"}
    with pytest.raises(ResultSchemaError) as refused:
        to_batch([{"m": [entry]}], [{"id": 0}], schema)
    message = str(refused.value)
    assert "a map entry {'key': 'k', 'value': 'xxx" in message
    assert "has unexpected key(s) ['Value'], which would be dropped" in message
    assert len(message) < 2_000, len(message)


UTC_TS = pa.timestamp("us", tz="UTC")


def _converted(arrow_type: pa.DataType, value: Any, refused: str | None) -> Any:
    """What a result {"r": value} holds once converted to a field r of ``arrow_type``; with
    ``refused``, asserts instead that the conversion is refused with an error matching it
    that names the input row."""
    from stateful_async.spark._results import to_batch

    schema = pa.schema([("r", arrow_type)])
    if refused is None:
        return to_batch([{"r": value}], [{"id": 0}], schema).column(0).to_pylist()[0]
    with pytest.raises(ResultSchemaError, match=refused + r".*input row \{'id': 0\}"):
        to_batch([{"r": value}], [{"id": 0}], schema)
    return None


@pytest.mark.parametrize(
    ("arrow_type", "value", "problem"),
    [
        # pyarrow read these as something else, silently
        (UTC_TS, 1_700_000_000, "would read a number as microseconds since 1970"),  # 1970-01-01
        (UTC_TS, 1.7e9, "would read a number as microseconds since 1970"),
        (UTC_TS, datetime(2024, 1, 1, 12), "a naive datetime does not say which instant"),
        (
            pa.timestamp("us"),
            datetime(2024, 1, 1, 12, tzinfo=ZoneInfo("America/New_York")),
            "a TIMESTAMP_NTZ field holds wall-clock times",
        ),  # was stored as 17:00
        (pa.date32(), 19_000, "would read a number as days since 1970"),
        (pa.date32(), 1.5, "would read a number as days since 1970"),  # 1970-01-02
        (pa.date32(), datetime(2024, 1, 1, 23, 30), "would drop its time of day"),
        (pa.duration("us"), 5, "would read a number as microseconds: return a timedelta"),
        (pa.list_(pa.string()), "tag", r"would split it into its characters"),  # ['t','a','g']
        (pa.list_(pa.int8()), b"ab", r"would split it into its characters \(or bytes\)"),
        (pa.float32(), 1e300, r"a FLOAT field \(32 bits\) would make it infinite"),  # inf
        (pa.struct([("t", UTC_TS)]), {"t": 1_700_000_000}, r"'r.t' \(timestamp"),  # nested
        (pa.map_(pa.string(), pa.list_(pa.string())), {"k": "v"}, r"\"r\['k'\]\""),
        (pa.float64(), True, "a numeric field would take a boolean as 1 or 0"),  # 1.0
        (pa.int64(), np.True_, "a numeric field would take a boolean as 1 or 0"),  # 1
        # pyarrow's own refusal escaped without the field and the row
        (UTC_TS, np.int64(1_700_000_000), r"cannot hold np.int64\(1700000000\) \(int64\)"),
        (pa.duration("us"), np.float64(5), r"cannot hold np.float64\(5.0\) \(float64\)"),
        # what converts as it is
        (UTC_TS, datetime(2024, 1, 1, 12, tzinfo=timezone.utc), None),
        (pa.timestamp("us"), datetime(2024, 1, 1, 12), None),
        (pa.date32(), date(2024, 1, 1), None),
        (pa.date32(), datetime(2024, 1, 1), None),  # midnight: nothing dropped
        (pa.duration("us"), timedelta(seconds=5), None),
        (pa.list_(pa.string()), ("a", "b"), None),
        (pa.float32(), 0.1, None),
        (pa.float32(), float("inf"), None),
        (pa.float64(), np.float32(1.5), None),
        (pa.int64(), np.int64(2), None),
    ],
)
def test_result_conversion_refuses_what_pyarrow_would_read_as_something_else(
    arrow_type, value, problem
) -> None:
    _converted(arrow_type, value, problem)


def test_a_numpy_timedelta64_in_an_interval_field_is_not_taken_for_a_number() -> None:
    # np.timedelta64 is a numpy integer (numbers.Integral): it was refused as "a number"
    # ("return a timedelta"), though pyarrow converts one in microseconds as it is.
    from stateful_async.spark._results import to_batch

    schema = pa.schema([("r", pa.duration("us"))])
    batch = to_batch([{"r": np.timedelta64(5, "us")}], [{"id": 0}], schema)
    assert batch.column(0).to_pylist() == [timedelta(microseconds=5)]
    # one pyarrow cannot convert is still refused naming the field and the row
    with pytest.raises(ResultSchemaError, match=r"'r' \(duration\[us\]\).*input row \{'id': 0\}"):
        to_batch([{"r": np.timedelta64(5, "ns")}], [{"id": 0}], schema)


@pytest.mark.parametrize(
    ("arrow_type", "value", "problem"),
    [
        # pyarrow's words: "object of type <class 'datetime.date'> cannot be converted to int"
        (UTC_TS, date(2024, 1, 1), r"takes a datetime, not a date: return one, e.g. "
         r"datetime.combine\(value, time\(\), tzinfo=timezone.utc\), or declare the field DATE"),
        (pa.list_(pa.timestamp("us")), [date(2024, 1, 1)],
         r"'r\[0\]'.*not a date: return one, e.g. datetime.combine\(value, time\(\)\), or"),
        (UTC_TS, datetime(2024, 1, 1).time(), "takes a datetime, not a time of day: combine it"),
        (UTC_TS, "2024-01-01T00:00:00Z", r"not text: parse it first, e.g. "
         r"datetime.fromisoformat\(value\) \(with its UTC offset"),
        (pa.date32(), "2024-01-01", r"takes a date, not text: .* date.fromisoformat\(value\)"),
        # "int() argument must be ... not 'datetime.date'", in any unit, and 'NoneType' for NaT
        (pa.date32(), np.datetime64("2024-01-01"), r"cannot take a numpy datetime64 for a "
         r"DATE: return a date, e.g. value.astype\('datetime64\[D\]'\).item\(\)"),
        (pa.list_(pa.date32()), np.array(["2024-01-01T10"], dtype="datetime64[s]"),
         r"'r\[0\]'.*\.tolist\(\) for a numpy array"),
        (pa.date32(), np.datetime64("NaT", "D"), "NaT is not a date: return None"),
    ],
)  # fmt: skip
def test_a_date_or_timestamp_field_says_what_to_return_for_text_or_another_kind_of_time(
    arrow_type, value, problem
) -> None:
    _converted(arrow_type, value, problem)


def test_pandas_nat_in_a_date_field_is_refused_naming_the_field_and_the_row() -> None:
    # pyarrow stores pandas' NaT in a DATE as 0001-01-01; the time-of-day check then failed
    # the task with a bare "ValueError: NaTType does not support time", naming neither.
    import pandas as pd

    from stateful_async.spark._results import to_batch

    schema = pa.schema([("r", pa.date32())])
    with pytest.raises(ResultSchemaError, match=r"'r' \(date32\[day\]\) cannot hold NaT.*None"):
        to_batch([{"r": pd.NaT}], [{"id": 0}], schema)
    midnight = to_batch([{"r": pd.Timestamp("2024-01-01")}], [{"id": 0}], schema)
    assert midnight.column(0).to_pylist() == [date(2024, 1, 1)]


@pytest.mark.parametrize("arrow_type", [UTC_TS, pa.timestamp("us"), pa.duration("us")])
def test_pandas_nat_in_a_time_field_is_refused_saying_to_return_none(arrow_type) -> None:
    # refused by pyarrow ("NaTType does not support utcoffset"), with the advice to return
    # values of the declared types, which NaT (pandas' missing value) already looks like
    import pandas as pd

    from stateful_async.spark._results import to_batch

    with pytest.raises(
        ResultSchemaError,
        match=r"cannot hold NaT \(NaTType\): NaT is pandas' missing time: return None for a "
        r"missing value, returned for input row \{'id': 0\}",
    ):
        to_batch([{"r": pd.NaT}], [{"id": 0}], pa.schema([("r", arrow_type)]))


@pytest.mark.parametrize(
    ("arrow_type", "value", "problem"),
    [
        # pyarrow dropped the nanoseconds silently (...00.000001234 became ...00.000001)
        (UTC_TS, "2024-01-01 00:00:00.000001234+00:00", r"would drop its 234 nanoseconds"),
        (pa.timestamp("us"), "2024-01-01 00:00:00.000000001", r"would drop its 1 nanoseconds"),
        (pa.date32(), "2024-01-01 00:00:00.000000001", "would drop its time of day"),
        (pa.duration("us"), "1234ns", r"would drop its 234 nanoseconds"),
        (pa.list_(UTC_TS), ["2024-01-01 00:00:00.000000999+00:00"], r"'r\[0\]' \(timestamp"),
        # whole microseconds convert as they are
        (UTC_TS, "2024-01-01 00:00:00.000001+00:00", None),
        (pa.timestamp("us"), "2024-01-01 00:00:00.000001", None),
        (pa.date32(), "2024-01-01", None),
        (pa.duration("us"), "1us", None),
    ],
)
def test_pandas_nanoseconds_are_refused_where_spark_holds_microseconds(
    arrow_type, value, problem
) -> None:
    import pandas as pd

    from stateful_async.spark._results import to_batch

    def pandas(text: Any) -> Any:
        if isinstance(text, list):
            return [pandas(item) for item in text]
        return pd.Timedelta(text) if text.endswith("s") else pd.Timestamp(text)

    schema = pa.schema([("r", arrow_type)])
    row = {"r": pandas(value)}
    if problem is None:
        [converted] = to_batch([row], [{"id": 0}], schema).column(0).to_pylist()
        assert converted == (row["r"].date() if pa.types.is_date(arrow_type) else row["r"])
    else:
        with pytest.raises(ResultSchemaError, match=problem + r".*input row \{'id': 0\}"):
            to_batch([row], [{"id": 0}], schema)


@pytest.mark.parametrize("unit", ["s", "ms"])
def test_a_pandas_timedelta_in_seconds_or_milliseconds_is_not_taken_as_0(unit) -> None:
    # pyarrow read one as 0 in an interval field, silently, whatever its value: it takes
    # the fields datetime.timedelta holds, which pandas leaves at 0 in these units (the
    # difference of two pandas Timestamps in milliseconds is one)
    import pandas as pd

    day = pd.Timedelta("1 day 00:00:01").as_unit(unit)
    refused = (
        rf"'r' \(duration\[us\]\) cannot hold .*\(Timedelta\): pyarrow would read a pandas "
        rf"Timedelta in {unit} \(its unit '{unit}'\) as 0: convert it first, e.g. "
        r"value.as_unit\('us'\) or value.to_pytimedelta\(\)"
    )
    _converted(pa.duration("us"), day, refused)
    spans = pd.Series([day]).astype(f"timedelta64[{unit}]")  # in an array field: its values
    _converted(pa.list_(pa.duration("us")), spans, r"'r\[0\]' \(duration\[us\]\).*as 0")
    # what the advice gives converts as it is, as do pandas' units below milliseconds
    expected = timedelta(days=1, seconds=1)
    assert _converted(pa.duration("us"), day.as_unit("us"), None) == expected
    assert _converted(pa.duration("us"), day.to_pytimedelta(), None) == expected
    assert _converted(pa.duration("us"), day.as_unit("ns"), None) == expected


@pytest.mark.parametrize("unit", ["s", "ms"])
def test_a_zero_pandas_timedelta_in_seconds_or_milliseconds_is_taken(unit) -> None:
    # pyarrow reads a Timedelta in these units as 0, which is right for one that is 0
    # (end - start of two equal second-resolution Timestamps): nothing to refuse
    import pandas as pd

    zero = pd.Timedelta(0).as_unit(unit)
    assert zero.unit == unit
    assert _converted(pa.duration("us"), zero, None) == timedelta(0)
    spans = pd.Series([zero, zero]).astype(f"timedelta64[{unit}]")
    assert _converted(pa.list_(pa.duration("us")), spans, None) == [timedelta(0)] * 2
    # a non-zero one among them is still refused
    mixed = pd.Series([zero, pd.Timedelta(seconds=1)]).astype(f"timedelta64[{unit}]")
    _converted(pa.list_(pa.duration("us")), mixed, r"'r\[1\]' \(duration\[us\]\).*as 0")


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        # pyarrow made these 0.0 (or -0.0), silently
        (1e-50, r"would round it to 0.0"),
        (-1e-50, r"would round it to -0.0"),
        (np.float64(1e-46), r"would round it to 0.0"),
        # ... or a subnormal float32 that keeps few of its digits (1.401298464324817e-45)
        (1e-45, r"would round it to 1.401298464324817e-45"),
        (1e-40, r"would round it to 9.99994610111476e-41"),
        ([1.0, 1e-50], r"'r\[1\]' \(float\) cannot hold 1e-50"),  # in an array
        # what a FLOAT holds as it is, or with its usual rounding
        (0.0, None),
        (-0.0, None),
        (0.1, None),
        (1.2e-38, None),  # just above the smallest normal float32
        (float(np.float32(1e-40)), None),  # a subnormal float32 itself: nothing to lose
        (np.float32(1e-45), None),
        (float("nan"), None),
    ],
)
def test_a_float_field_refuses_a_number_too_small_for_32_bits(value, problem) -> None:
    arrow_type = pa.list_(pa.float32()) if isinstance(value, list) else pa.float32()
    _converted(arrow_type, value, problem)


@pytest.mark.parametrize("arrow_type", [pa.float64(), pa.float32()])
def test_a_numpy_uint64_beyond_int64_is_not_wrapped_to_a_negative_number(arrow_type) -> None:
    # pyarrow took np.uint64(2**64 - 1) for a DOUBLE or a FLOAT as -1.0, silently (it reads
    # the unsigned number as a signed 64-bit one), also from a numpy array in an array field
    from stateful_async.spark._results import to_batch

    def convert(value: Any, element_type: pa.DataType) -> pa.RecordBatch:
        return to_batch([{"r": value}], [{"id": 0}], pa.schema([("r", element_type)]))

    for value, element_type, where in [
        (np.uint64(2**64 - 1), arrow_type, "'r'"),
        (np.uint64(2**64 - 2**20), arrow_type, "'r'"),  # -1048576.0
        (np.array([1, 2**64 - 1], dtype=np.uint64), pa.list_(arrow_type), r"'r\[1\]'"),
    ]:
        with pytest.raises(
            ResultSchemaError,
            match=where + r".* would wrap it to a negative number.*float\(value\).*\{'id': 0\}",
        ):
            convert(value, element_type)
    # below 2**63 they convert as they are, and float() of one beyond does
    assert convert(np.uint64(5), arrow_type).column(0).to_pylist() == [5.0]
    assert convert(float(np.uint64(2**64 - 1)), arrow_type).column(0).to_pylist() == [2.0**64]


@pytest.mark.parametrize(
    ("arrow_type", "value", "problem"),
    [
        # pyarrow stored a str's UTF-8 bytes, silently: base64 or hex text stayed text
        (pa.binary(), "aGVsbG8=", r"'r' \(binary\) cannot hold 'aGVsbG8=' \(str\): a BINARY"),
        (pa.binary(), np.str_("é"), r"cannot hold np.str_\('é'\) \(str_\): a BINARY"),
        (pa.list_(pa.binary()), [b"a", "b"], r"'r\[1\]' \(binary\) cannot hold 'b'"),
        (pa.list_(pa.binary()), np.array(["é"]), r"'r\[0\]' \(binary\)"),  # numpy's <U1
        (pa.struct([("b", pa.binary())]), {"b": "x"}, r"'r.b' \(binary\)"),
        (pa.map_(pa.binary(), pa.int64()), {"k": 1}, r"'r{key}' \(binary\)"),
        # bytes, and what holds them, convert as they are
        (pa.binary(), b"\xff\x00", None),
        (pa.binary(), bytearray(b"ab"), None),
        (pa.binary(), memoryview(b"ab"), None),
        (pa.binary(), np.bytes_(b"ab"), None),
        (pa.list_(pa.binary()), [b"a", None], None),
        (pa.string(), "é", None),
    ],
)
def test_a_binary_field_refuses_a_str_as_spark_does(arrow_type, value, problem) -> None:
    _converted(arrow_type, value, problem and problem + r".*value.encode\(\)")


@pytest.mark.parametrize(
    ("arrow_type", "value", "problem"),
    [
        # pyarrow decoded bytes that are UTF-8 and refused the others: a job passed on some
        # rows and failed on others, or stored binary data as text
        (pa.string(), b"abc", r"'r' \(string\) cannot hold b'abc' \(bytes\): a STRING field"),
        (pa.string(), b"\xff", r"'r' \(string\) cannot hold b'\\xff' \(bytes\): a STRING"),
        (pa.large_string(), bytearray(b"ab"), r"'r' \(large_string\) cannot hold"),
        (pa.string(), memoryview(b"ab"), r"\(memoryview\): a STRING field"),
        (pa.list_(pa.string()), ["a", b"b"], r"'r\[1\]' \(string\) cannot hold b'b'"),
        (pa.list_(pa.string()), np.array([b"a"]), r"'r\[0\]' \(string\)"),  # numpy's |S1
        (pa.struct([("s", pa.string())]), {"s": b"x"}, r"'r.s' \(string\)"),
        (pa.map_(pa.string(), pa.string()), {"k": b"v"}, r"\"r\['k'\]\" \(string\)"),
        (pa.map_(pa.string(), pa.int64()), {b"k": 1}, r"'r{key}' \(string\)"),
        # text converts as it is
        (pa.string(), "é", None),
        (pa.string(), np.str_("é"), None),
        (pa.list_(pa.string()), ["a", None], None),
        (pa.map_(pa.string(), pa.string()), {"k": "v"}, None),
    ],
)
def test_a_string_field_refuses_bytes_even_when_they_are_utf8(arrow_type, value, problem) -> None:
    _converted(arrow_type, value, problem and problem + r".*value.decode\(\).*BINARY")


@pytest.mark.parametrize(
    ("arrow_type", "value", "problem"),
    [
        # pyarrow's "Value -129 too large to fit in C integer type", naming the whole struct
        (pa.int8(), -129, r"'r' \(int8\) cannot hold -129 \(int\): a TINYINT field holds "),
        (pa.int32(), 2**31, r"an INT field holds whole numbers from -2147483648 to 2147483647"),
        (pa.int16(), np.int64(40_000), r"a SMALLINT field .*\(INT, BIGINT\)"),
        (pa.int64(), 2**63, r"a BIGINT field .*declare the field DECIMAL\(38,0\)"),
        (pa.int8(), 300.0, r"cannot hold 300.0 \(float\): a TINYINT field"),
        (pa.struct([("l", pa.list_(pa.int8()))]), {"l": [1, 300]}, r"'r.l\[1\]' \(int8\)"),
        (pa.map_(pa.int8(), pa.int8()), {1: 2, 300: 3}, r"'r{key}' \(int8\) cannot hold 300"),
        (pa.map_(pa.string(), pa.int8()), {"k": 300}, r"\"r\['k'\]\" \(int8\) cannot hold 300"),
        (pa.int8(), 127, None),
        (pa.int8(), np.int64(-128), None),
    ],
)
def test_an_integer_beyond_its_fields_range_is_named_with_the_range(
    arrow_type, value, problem
) -> None:
    _converted(arrow_type, value, problem)


@pytest.mark.parametrize(
    ("arrow_type", "value", "problem"),
    [
        # pyarrow's "Invalid Map: key field cannot contain null values", naming no key
        (
            pa.map_(pa.string(), pa.int64()),
            {"a": 1, None: 2},
            r"'r\{key\}' \(string\) cannot "
            r"hold None \(NoneType\): a map's keys cannot be null .*the entry None: 2 has one",
        ),
        (
            pa.struct([("m", pa.map_(pa.int64(), pa.int64()))]),
            {"m": [(1, 1), (None, 2)]},
            r"'r.m\{key\}' \(int64\) cannot hold None",
        ),
        # pyarrow's words for a nested value it refuses, naming only the top-level field and
        # its whole value: "cannot hold {'a': 1} (dict) ...: Expected bytes, got a 'int' object"
        (
            pa.struct([("a", pa.string())]),
            {"a": 1},
            r"'r.a' \(string\) cannot hold 1 \(int\): a "
            r"STRING field takes a str, not an int, returned",
        ),
        (
            pa.struct([("l", pa.list_(pa.int64()))]),
            {"l": [1, "x"]},
            r"'r.l\[1\]' \(int64\) cannot hold 'x' \(str\): an integer field takes an int, "
            r"not a str",
        ),
        (pa.map_(pa.string(), pa.list_(pa.int64())), {"k": [1, "x"]}, r"\"r\['k'\]\[1\]\""),
        (pa.map_(pa.int64(), pa.int64()), {"a": 1}, r"'r\{key\}' \(int64\) cannot hold 'a'"),
        (pa.list_(pa.struct([("a", pa.int64())])), [{"a": 1}, 5], r"'r\[1\]' \(struct<a"),
        # ... and a top-level one reads alike (it had pyarrow's "Expected bytes, got a 'int'
        # object" and "was not a sequence or recognized null for conversion to list type")
        (
            pa.string(),
            5,
            r"'r' \(string\) cannot hold 5 \(int\): a STRING field takes a str, not an int, "
            r"returned",
        ),
        (
            pa.list_(pa.int64()),
            5,
            r"'r' \(list<item: int64>\) cannot hold 5 \(int\): an "
            "array field takes a list, not an int",
        ),
        # a list is a form a map takes: pyarrow's words say what is wrong with this one
        (
            pa.map_(pa.string(), pa.int64()),
            [("k", 1, 2)],
            r"'r' \(map<string, int64>\) "
            r"cannot hold \[\('k', 1, 2\)\] \(list\): a map field takes a dict or a list of "
            r"\(key, value\) pairs, and Tuple size must be equal to number of struct fields",
        ),
        # a value for a VOID field, declared in the output schema (array<void>): it was
        # "pyarrow refuses it: Invalid null value", no word of the type to declare
        (
            pa.list_(pa.null()),
            ["x"],
            r"'r\[0\]' \(null\) cannot hold 'x' \(str\): a VOID field \(one declared without "
            r"a type\) holds only None: declare the type of its values in the output schema "
            r"instead \(array<string> for array<void>, ...\)",
        ),
        (pa.map_(pa.string(), pa.null()), {"k": 1}, r"\"r\['k'\]\" \(null\) .*: a VOID field"),
        # a None among a map's pairs, at any depth: pyarrow aborted the whole Python process
        # ("Map array child array should have no nulls"), a crashed worker naming no row
        (
            pa.map_(pa.string(), pa.null()),
            [None],
            r"'r' \(map<string, null>\) cannot hold \[None\] \(list\): a map field takes a "
            r"dict or a list of \(key, value\) pairs, and None is no pair: leave it out, or "
            r"give \(key, None\) for a key without a value",
        ),
        (pa.list_(pa.map_(pa.string(), pa.string())), [{}, [("k", "v"), None]], r"'r\[1\]' \(map"),
        (
            pa.map_(pa.string(), pa.struct([("m", pa.map_(pa.int64(), pa.int64()))])),
            {"k": {"m": [None]}},
            r"\"r\['k'\]\.m\" \(map<int64, int64>\) cannot hold \[None\]",
        ),
    ],
)
def test_a_nested_value_pyarrow_refuses_is_named_by_its_path_and_what_its_type_takes(
    arrow_type, value, problem
) -> None:
    _converted(arrow_type, value, problem)


@pytest.mark.parametrize(
    ("arrow_type", "value", "problem"),
    [
        # pyarrow's "Expected integer, got bool" and "Could not convert Decimal('1.5') with
        # type decimal.Decimal: tried to convert to double", which say neither what to return
        # nor what to declare
        (
            pa.int32(),
            True,
            r"'r' \(int32\) cannot hold True \(bool\): an integer field takes "
            r"an int, not a boolean: return int\(value\) for 1 or 0, or declare the field BOOLEAN",
        ),
        (pa.list_(pa.int64()), [1, False], r"'r\[1\]' \(int64\) cannot hold False \(bool\)"),
        (
            pa.float64(),
            Decimal("1.5"),
            r"'r' \(double\) cannot hold Decimal\('1.5'\) "
            r"\(Decimal\): a floating-point field takes a float \(or an int\), not a Decimal: "
            r"return float\(value\) .*or declare the field DECIMAL",
        ),
        (pa.struct([("f", pa.float32())]), {"f": Decimal(2)}, r"'r.f' \(float\) cannot hold"),
        (pa.float64(), 1, None),
    ],
)
def test_a_boolean_for_an_integer_and_a_decimal_for_a_float_are_refused_saying_what_to_do(
    arrow_type, value, problem
) -> None:
    _converted(arrow_type, value, problem)


@pytest.mark.parametrize(
    ("arrow_type", "value", "problem"),
    [
        # pyarrow's words: "Decimal type with precision 31 does not fit into precision
        # inferred from first array element: 38", for a Decimal the field cannot hold
        (pa.decimal128(38, 10), Decimal("1e30"), "holds 28 digit.s. before the point, and "
         r"it has 31: declare fewer places after the point, e.g. DECIMAL\(38,7\)"),
        (pa.decimal128(5, 2), Decimal("12345.1"), "holds 3 digit.s. before the point, and it "
         r"has 5: declare DECIMAL\(7,2\) or wider"),
        (pa.decimal128(5, 2), -1000, r"has 4: declare DECIMAL\(6,2\) or wider"),
        (pa.decimal128(38, 0), 10**39, r"has 40: no DECIMAL holds it .*declare the field DOUBLE"),
        # "Rescaling Decimal value would cause data loss"
        (pa.decimal128(5, 2), Decimal("1.2345"), r"holds 2 digit.s. after the point, and it "
         r"has 4: round it first, e.g. value.quantize\(Decimal\('1e-2'\)\)"),
        (pa.list_(pa.decimal128(5, 2)), [Decimal("1.234")], r"'r\[0\]' .*it has 3: round"),
        # "The string 'NaN' is not a valid decimal128 number", and 'True' for True
        (pa.decimal128(5, 2), Decimal("NaN"), "holds no NaN or infinity: return None"),
        (pa.decimal128(5, 2), True, "takes a Decimal or an int, not a boolean"),
        # "int or Decimal object expected, got float" (or numpy.int64): say how to convert
        (pa.decimal128(5, 2), 1.5, r"not a float .*return Decimal\(str\(value\)\)"),
        (pa.decimal128(5, 2), np.float64(1.5), r"not a float .*or declare the field DOUBLE"),
        (pa.decimal128(5, 2), np.int64(3), r"not a numpy integer: return int\(value\)"),
        # what fits converts as it is, and 0 with any number of places is 0
        (pa.decimal128(5, 2), Decimal("1.200"), None),
        (pa.decimal128(5, 2), Decimal("1E+2"), None),
        (pa.decimal128(5, 2), Decimal("0.00000"), None),
    ],
)  # fmt: skip
def test_a_decimal_field_says_why_it_cannot_hold_a_number(arrow_type, value, problem) -> None:
    named = "" if problem is None or problem.startswith("'r") else r"'r' \(decimal128.*"
    refused = problem and named + problem
    converted = _converted(arrow_type, value, refused)
    assert problem is not None or Decimal(converted) == Decimal(value)


WIDE = Decimal(1934.3561801924002)  # 1934.35618019240018838900141417980194091796875


@pytest.mark.parametrize(
    ("arrow_type", "value", "problem"),
    [
        # pyarrow stored these as 0, silently: it reads a Decimal written with more than 38
        # digits or places wrongly when it does not refuse it
        (pa.decimal128(10, 2), WIDE, r"'r' .*holds 2 digit.s. after the point, and it has 41: "
         r"round it first, e.g. value.quantize\(Decimal\('1e-2'\)\), or declare more places "
         r"\(pyarrow would store 0.00\)"),
        (pa.decimal128(38, 0), Decimal("5E-39"), r"it has 39: .*\(pyarrow would store 0\)"),
        (pa.list_(pa.decimal128(10, 2)), [Decimal("1.5"), None, WIDE],
         r"'r\[2\]' .*\(pyarrow would store 0.00\)"),
        (pa.struct([("a", pa.decimal128(18, 2))]), {"a": WIDE},
         r"'r.a' .*it has 41: round.*store 0.00"),
        # refused with "Rescaling Decimal value would cause data loss", though it is 1
        (pa.decimal128(10, 2), Decimal("1." + "0" * 40), "pyarrow takes no Decimal written "
         "with more than 38 digits or places, and it is written with 41 digits, 40 places: "
         r"round it first, e.g. value.quantize\(Decimal\('1e-2'\)\)"),
        # what pyarrow reads right converts as before
        (pa.decimal128(38, 0), Decimal("12345678901234567890123456789012345678.0"), None),
        (pa.decimal128(5, 2), Decimal("0E-50"), None),
        (pa.list_(pa.decimal128(5, 2)), [Decimal("1.25"), None, 3], None),
    ],
)  # fmt: skip
def test_a_decimal_with_more_than_38_digits_is_not_stored_as_0(arrow_type, value, problem):
    converted = _converted(arrow_type, value, problem)
    if problem is None:
        assert converted == pa.array([value], arrow_type).to_pylist()[0]
        assert str(converted) in ("12345678901234567890123456789012345678", "0.00") or (
            converted == [Decimal("1.25"), None, Decimal("3.00")]
        )


PAIR = pa.struct([("a", pa.int64()), ("b", pa.string())])


@pytest.mark.parametrize(
    ("arrow_type", "value", "problem"),
    [
        # before, pyarrow's words: "was expecting tuple of (key, value) pair"
        (
            PAIR,
            [1, "x"],
            r"'r' .*a STRUCT field takes a dict keyed by its field names \['a', 'b'\]",
        ),
        (PAIR, 5, r"'r' .*a STRUCT field takes a dict keyed by its field names"),
        # before, the dict's keys were iterated and blamed: "'r[0]' ... cannot hold 'a' (str)"
        (
            pa.list_(PAIR),
            {"a": 1},
            r"'r' .*an array field takes a list, not a dict: return \[value\]",
        ),
        (pa.list_(PAIR), [1], r"'r\[0\]' .*a STRUCT field takes a dict"),
        # the forms pyarrow takes convert, and a wrong value in one still gets pyarrow's words
        (PAIR, [("a", 1), ("b", "x")], None),
        (PAIR, (1, "x"), None),
        (pa.list_(PAIR), [{"a": 1}], None),
        (
            PAIR,
            [("a", "bad")],
            r"cannot hold \[\('a', 'bad'\)\] \(list\): .*or a list of "
            r"\(name, value\) pairs, and Could not convert 'bad' with type str: tried to convert "
            "to int64, returned",
        ),
    ],
)
def test_a_struct_or_array_field_says_what_form_it_takes(arrow_type, value, problem) -> None:
    converted = _converted(arrow_type, value, problem)
    if problem is None:
        assert converted == pa.array([value], arrow_type).to_pylist()[0]


def test_a_decimal_that_fits_is_not_blamed_for_a_struct_it_shares_with_a_wrong_value() -> None:
    struct = pa.struct([("a", pa.decimal128(5, 2)), ("b", pa.string())])
    # the field b is named, not a
    _converted(struct, {"a": Decimal("0.00000"), "b": 5}, r"'r.b' \(string\) cannot hold 5")


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        # pyarrow read a number as nanoseconds since midnight, silently: 5 became
        # 00:00:00.000000005, 5.7 too, and 86_400_000_000_000 a TIME past 23:59:59
        (5, "a TIME field would read a number as nanoseconds since midnight"),
        (5.7, "would read a number as nanoseconds"),
        (np.int64(3_600), "would read a number as nanoseconds"),
        (86_400_000_000_000, "would read a number as nanoseconds"),
        (datetime(2024, 1, 1, 1, 2, 3, 4).time(), None),
    ],
)
def test_a_time_field_refuses_a_number(value, problem) -> None:
    refused = problem and r"'r' \(time64\[ns\]\).*" + problem + r".*datetime.time"
    converted = _converted(pa.time64("ns"), value, refused)  # Spark's TIME, as Arrow
    assert converted == (value if problem is None else None)


def test_an_array_field_refuses_a_set_whose_order_is_arbitrary() -> None:
    # pyarrow took a set in its iteration order, silently: for strings it depends on the
    # process's hash seed, so a retried task could store the same result in another order
    words = {"pear", "apple", "fig"}
    refused = (
        r"'r' \(list<item: string>\) cannot hold .* \(set\): an array field holds its "
        r"elements in order, and a set's order is arbitrary.*return sorted\(value\), or "
        r"list\(value\)"
    )
    _converted(pa.list_(pa.string()), words, refused)
    _converted(pa.list_(pa.int64()), {3, 1, 2}, r"'r' \(list<item: int64>\).*order is arbitrary")
    nested = pa.list_(pa.list_(pa.string()))
    _converted(nested, [["a"], {"b", "c"}], r"'r\[1\]' \(list<item: string>\).*order is arbitrary")
    # pyarrow refuses a frozenset itself (not a sequence): the same refusal
    _converted(pa.list_(pa.string()), frozenset(words), refused.replace("(set", "(frozenset"))
    # what the advice returns converts as it is
    assert _converted(pa.list_(pa.string()), sorted(words), None) == ["apple", "fig", "pear"]


@pytest.mark.parametrize(
    ("arrow_type", "value", "where"),
    [
        (pa.list_(pa.list_(pa.int64())), [[1], frozenset({2})], "r[1]"),
        (pa.struct([("a", pa.list_(pa.int64()))]), {"a": frozenset({2})}, "r.a"),
        (pa.struct([("n", pa.int64()), ("a", pa.list_(pa.int64()))]), (1, frozenset({2})), "r.a"),
        (pa.map_(pa.string(), pa.list_(pa.int64())), {"k": frozenset({2})}, "r['k']"),
        (pa.map_(pa.string(), pa.list_(pa.int64())), [("k", frozenset({2}))], "r['k']"),
        (
            pa.list_(pa.struct([("a", pa.list_(pa.list_(pa.int64())))])),
            [{"a": [[1]]}, {"a": [[1], frozenset({2})]}],
            "r[1].a[1]",
        ),
        # a set converts where a frozenset does not: refused as well beside one
        (pa.list_(pa.list_(pa.int64())), [{2}, frozenset({3})], "r[0]"),
    ],
)
def test_a_frozenset_for_an_array_at_any_depth_is_refused_as_a_set_is(
    arrow_type, value, where
) -> None:
    # Only a frozenset given for the whole field had the set's advice: one inside a list,
    # a struct or a map failed with pyarrow's "Could not convert frozenset({2}) with type
    # frozenset: was not a sequence ..." and "Return values of the types the output
    # schema declares".
    from stateful_async.spark._results import to_batch

    with pytest.raises(ResultSchemaError) as refused:
        to_batch([{"r": value}], [{"id": 7}], pa.schema([("r", arrow_type)]))
    found = "set" if where == "r[0]" else "frozenset"
    shown = "{2}" if found == "set" else "frozenset({2})"
    assert str(refused.value) == (
        f"The result field {where!r} (list<item: int64>) cannot hold {shown} ({found}): an "
        "array field holds its elements in order, and a set's order is arbitrary (it can "
        "differ from one process, a retried task, to the next): return sorted(value), or "
        "list(value) if any order will do, returned for input row {'id': 7}. Return values "
        "of the types the output schema declares."
    )
    # sorted, it converts
    fixed = to_batch(
        [{"r": _sorted_sets(value)}], [{"id": 7}], pa.schema([("r", arrow_type)])
    ).column(0)
    assert fixed.to_pylist()[0] is not None


def _sorted_sets(value: Any) -> Any:
    """``value`` with every set in it sorted into a list."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, dict):
        return {k: _sorted_sets(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_sorted_sets(v) for v in value)
    return value


@pytest.mark.parametrize(
    ("zone", "shown", "naive"),
    [
        (timezone.utc, "UTC", ""),
        (timezone(timedelta(hours=5)), "UTC+05:00", ""),
        # Python calls this time naive (a zone gives no UTC offset without a date): it was
        # refused all the same (the zone would be lost) with "return a naive time"
        (
            ZoneInfo("Europe/Paris"),
            "zoneinfo.ZoneInfo(key='Europe/Paris')",
            ", though Python calls this time naive, as a zone gives no UTC offset without a date",
        ),
    ],
)
def test_a_time_field_refuses_a_time_with_a_tzinfo(zone, shown, naive) -> None:
    # pyarrow dropped the tzinfo silently: 12:00+05:00 was stored as 12:00
    from stateful_async.spark._results import to_batch

    zoned = datetime(2024, 1, 1, 12, 0, 1, 5).time().replace(tzinfo=zone)
    assert (zoned.utcoffset() is None) == bool(naive)
    with pytest.raises(ResultSchemaError) as refused:
        to_batch([{"r": zoned}], [{"id": 0}], pa.schema([("r", pa.time64("ns"))]))
    assert str(refused.value) == (
        f"The result field 'r' (time64[ns]) cannot hold {zoned!r} (time): it has a tzinfo "
        f"({shown}) that a TIME field cannot keep (it holds a time of day without a zone, and "
        f"pyarrow would drop the tzinfo{naive}): return a time without a tzinfo "
        "(value.replace(tzinfo=None) keeps its wall-clock time; convert it to the zone you "
        "mean first, through a datetime on its date, if it is another), returned for input "
        "row {'id': 0}. Return values of the types the output schema declares."
    )
    _converted(pa.list_(pa.time64("ns")), [zoned], r"'r\[0\]' \(time64\[ns\]\).*tzinfo")
    # without its tzinfo it converts as it is
    plain = zoned.replace(tzinfo=None)
    assert _converted(pa.time64("ns"), plain, None) == plain


def test_numpy_datetime64_in_a_zoned_timestamp_is_refused_as_a_naive_datetime_is() -> None:
    # numpy's datetime64 has no time zone: one from a numpy array in an array<timestamp>
    # was taken as UTC, silently (a single one pyarrow refuses itself), where a naive
    # datetime is refused as Spark would take it as local time
    from stateful_async.spark._results import to_batch

    stamps = np.array(["2024-01-01T05:00"], dtype="datetime64[us]")
    zoned = pa.schema([("r", pa.list_(UTC_TS))])
    with pytest.raises(
        ResultSchemaError,
        match=r"'r\[0\]' \(timestamp\[us, tz=UTC\]\).*a naive datetime does not say which instant",
    ):
        to_batch([{"r": stamps}], [{"id": 0}], zoned)
    # in a TIMESTAMP_NTZ, a wall-clock time as it is
    wall = to_batch([{"r": stamps}], [{"id": 0}], pa.schema([("r", pa.list_(pa.timestamp("us")))]))
    assert wall.column(0).to_pylist() == [[datetime(2024, 1, 1, 5)]]


@pytest.mark.parametrize("unit", ["D", "s", "ms", "10us", "ns"])
def test_numpy_arrays_of_another_unit_in_timestamp_ntz_or_interval_arrays_are_refused(
    unit: str,
) -> None:
    # pyarrow reads the counts of a numpy datetime64/timedelta64 array inside an array
    # field as counts of the field's microseconds: 2024-01-01 in seconds was stored as
    # 1970-01-01T00:28:24 and pandas' datetime64[ns] out of any date's range, silently
    days = np.array(["2024-01-01"], dtype=f"datetime64[{unit}]")
    _converted(
        pa.list_(pa.timestamp("us")), days, rf"'r\[0\]'.*datetime64\[{unit}\] as a count of us"
    )
    if unit != "D":  # timedelta64[D] is refused by pyarrow itself
        spans = np.array([1], dtype=f"timedelta64[{unit}]")
        _converted(pa.list_(pa.duration("us")), spans, rf"timedelta64\[{unit}\] as a count of us")
    # in microseconds, as they are
    wall = np.array(["2024-01-01T05:00"], dtype="datetime64[us]")
    assert _converted(pa.list_(pa.timestamp("us")), wall, None) == [datetime(2024, 1, 1, 5)]
    spans = np.array([1], dtype="timedelta64[us]")
    assert _converted(pa.list_(pa.duration("us")), spans, None) == [timedelta(microseconds=1)]


def test_plain_numbers_cost_the_result_checks_no_python_call_per_row() -> None:
    # The checks of a LONG and a DOUBLE field ran a Python function for every row (the
    # boolean check added one per DOUBLE field: to_batch went from 0.25 to 0.37 us per row
    # of 'id long, score double, label string'); a column of ints or floats skips them.
    from stateful_async.spark import _results

    # (and a BINARY's check, of a str, for each row of bytes)
    schema = pa.schema(
        [("id", pa.int64()), ("score", pa.float64()), ("label", pa.string()), ("b", pa.binary())]
    )
    rows = [{"id": i, "score": i / 3, "label": str(i), "b": b"%d" % i} for i in range(1000)]
    rows[5]["score"] = None
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event == "call" and frame.f_code.co_filename == _results.__file__

    sys.setprofile(count)
    try:
        batch = _results.to_batch(rows, [{}] * len(rows), schema)
    finally:
        sys.setprofile(None)
    assert batch.num_rows == 1000 and calls < 100, calls  # not one per row
    # a value that is not plain is still checked
    rows[7]["score"] = True
    with pytest.raises(ResultSchemaError, match=r"'score' \(double\) cannot hold True"):
        _results.to_batch(rows, [{}] * len(rows), schema)


def test_a_struct_returned_in_two_forms_in_one_batch_names_the_row() -> None:
    from stateful_async.spark._results import to_batch

    schema = pa.schema([("id", pa.int64()), ("st", pa.struct([("a", pa.int64())]))])
    rows = [{"id": i, "st": {"a": i}} for i in range(5)] + [{"id": 5, "st": (5,)}]
    with pytest.raises(
        ResultSchemaError,
        match=r"'st' \(struct<a: int64>\) cannot hold \(5,\) \(tuple\), returned for input "
        r"row \{'id': 50\}, in the same batch as \{'a': 0\} \(dict\)\. Return each field in "
        r"one form",
    ):
        to_batch(rows, [{"id": 10 * i} for i in range(6)], schema)


NOT_NULL_SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        ("st", pa.struct([pa.field("a", pa.int64(), nullable=False), ("b", pa.int64())])),
        ("l", pa.list_(pa.field("item", pa.int64(), nullable=False))),
        ("m", pa.map_(pa.string(), pa.field("value", pa.int64(), nullable=False))),
        ("sl", pa.list_(pa.struct([pa.field("x", pa.int64(), nullable=False)]))),
        ("mk", pa.map_(pa.struct([pa.field("p", pa.int64(), nullable=False)]), pa.int64())),
    ]
)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({}, None),
        ({"st": None, "l": None, "m": None, "sl": [None]}, None),  # nullable around NOT NULL
        ({"id": None}, r"'id' \(int64\) cannot hold None \(NoneType\): the output schema "),
        ({"st": {"b": 1}}, r"'st.a' \(int64\) cannot hold None"),  # a missing key is null
        ({"st": (None, 1)}, r"'st.a' \(int64\) cannot hold None"),
        ({"l": [4, None]}, r"'l\[1\]' \(int64\) cannot hold None"),
        ({"m": {"k": None}}, r"\"m\['k'\]\" \(int64\) cannot hold None"),
        ({"sl": [{"x": 1}, {}]}, r"'sl\[1\].x' \(int64\) cannot hold None"),
        ({"mk": [({"p": None}, 1)]}, r"'mk\{key\}.p' \(int64\) cannot hold None"),  # was let by
    ],
)
def test_a_null_in_a_not_null_field_is_refused_naming_the_field_and_the_row(value, problem) -> None:
    from stateful_async.spark._results import to_batch

    # the second of three rows carries the value, behind a first row with nested values
    fine = {"id": 1, "st": None, "l": [1, 2], "m": {"a": 1}, "sl": [{"x": 1}], "mk": None}
    rows = [fine, {**fine, "id": 2, **value}, {**fine, "id": 3}]
    sources = [{"id": 10}, {"id": 20}, {"id": 30}]
    if problem is None:
        assert to_batch(rows, sources, NOT_NULL_SCHEMA).num_rows == 3
    else:
        with pytest.raises(ResultSchemaError, match=problem + r".*input row \{'id': 20\}"):
            to_batch(rows, sources, NOT_NULL_SCHEMA)


def test_only_schemas_with_not_null_fields_pay_for_the_null_check() -> None:
    from stateful_async.spark._results import _required_fields

    # Spark's maps have NOT NULL keys (pyarrow refuses a null key itself): no scan for them
    plain = pa.schema([("m", pa.map_(pa.string(), pa.int64())), ("l", pa.list_(pa.int64()))])
    assert _required_fields(plain) == ()
    assert [i for i, _ in _required_fields(NOT_NULL_SCHEMA)] == [0, 1, 2, 3, 4, 5]


def test_a_null_in_a_not_null_output_column_fails_with_the_message_not_a_jvm_trace(
    spark,
) -> None:
    async def no_id(row):  # type: ignore[no-untyped-def]
        return [{"id": None if row["id"] == 3 else row["id"], "label": "x"}]

    with pytest.raises(
        Exception,
        match=r"result field 'id' \(int64\) cannot hold None .*input row \{'id': 3\} "
        r"\(record 3 of partition 0\)",
    ):
        ordered_wait(
            spark.range(0, 5, numPartitions=1), no_id, "id long not null, label string"
        ).collect()


def test_results_of_the_declared_types_pass_unchanged(spark) -> None:
    schema = "id long, score struct<value: long, tags: array<struct<name: string, n: int>>>"

    async def nested(row):  # type: ignore[no-untyped-def]
        # a whole float for a long converts without loss; a nested field left out is null
        value = float(row["id"] * 2)
        return [{"id": row["id"], "score": {"value": value, "tags": [{"name": "t"}]}}]

    rows = ordered_wait(spark.range(0, 3, numPartitions=1), nested, schema, capacity=2).collect()
    assert [r.asDict(recursive=True) for r in rows] == [
        {"id": i, "score": {"value": 2 * i, "tags": [{"name": "t", "n": None}]}} for i in range(3)
    ]


def test_an_unpicklable_function_fails_before_the_job_starts(spark) -> None:
    import threading

    class HoldsALock(ServiceEnrichment):
        def __init__(self) -> None:
            super().__init__("http://127.0.0.1:1")
            self.lock = threading.Lock()

    with pytest.raises(
        FunctionNotSerializableError,
        match=r"cannot pickle '_thread.lock' object\. Create clients .* in AsyncFunction.open",
    ):
        ordered_wait(spark.range(3), HoldsALock(), SCHEMA)


@pytest.mark.parametrize("predicate", ["retry_on_exception", "retry_on_result"])
def test_an_unpicklable_retry_predicate_is_named_instead_of_the_function(
    spark, predicate: str
) -> None:
    import threading

    class Retryable:  # a predicate that holds a lock, as one holding a client would
        def __init__(self) -> None:
            self.lock = threading.Lock()

        def __call__(self, outcome: Any) -> bool:
            return True

    async def enrich(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"]}]

    retry = RetryStrategy.fixed_delay(3, 0.1, **{predicate: Retryable()})
    with pytest.raises(FunctionNotSerializableError) as info:
        ordered_wait(spark.range(3), enrich, "id long", timeout=5, retry=retry)
    message = str(info.value)
    assert message.startswith(
        "The retry strategy cannot be pickled, so Spark cannot send it to the executors: "
        "TypeError: cannot pickle '_thread.lock' object."
    )
    assert "retry_on_exception and retry_on_result" in message
    assert "async function" not in message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schema": "not a schema ("}, "is not a valid DDL string"),
        ({"schema": ""}, "has no fields"),
        ({"schema": StructType([])}, "has no fields"),
        ({"schema": "id long, id string"}, r"names the field\(s\) \['id'\] more than once"),
        (  # every task failed in Arrow: "not all nodes, buffers ... were consumed"
            {"schema": "id long, s array<struct<a: long, a: long>>"},
            r"names the field\(s\) \['s\[\]\.a'\] more than once; a result is a dict, and so",
        ),
        (  # beside a case twin met first it was called the case pair ('s.A' and 's.a')
            {"schema": "id long, s struct<A: long, a: long, a: long>"},
            r"names the field\(s\) \['s\.a'\] more than once",
        ),
        (  # every result failed in the task, over struct<value: binary, metadata: binary>
            {"schema": "id long, v struct<tags: array<variant>>"},
            r"output field 'v.tags\[\]' is a VARIANT.*Return JSON text in a STRING field",
        ),
        (  # the job ran, and the first select("id") failed with AMBIGUOUS_REFERENCE
            {"schema": "id long, ID long"},
            "has the fields 'id' and 'ID', which Spark takes for one column",
        ),
        (  # ... and select("s.a") with AMBIGUOUS_REFERENCE_TO_FIELDS, at any depth
            {"schema": "id long, s array<struct<a: long, A: long>>"},
            r"has the fields 's\[\]\.a' and 's\[\]\.A', which Spark takes for one field",
        ),
        ({"capacity": 0}, "capacity must be an integer >= 1"),
        ({"capacity": 10, "max_in_flight": 20}, r"from 1 to capacity \(10\).*raise capacity too"),
        ({"event_time": "missing"}, "event_time column 'missing' is not in the DataFrame"),
        ({"max_out_of_orderness": 5}, "max_out_of_orderness needs event_time"),
        ({"fn": len}, "is a regular function"),
        (
            {"event_time": "id", "max_out_of_orderness": float("nan")},
            "max_out_of_orderness must be a finite duration >= 0",
        ),
        (
            {"event_time": "ts", "max_out_of_orderness": "5s"},
            "max_out_of_orderness must be a finite duration >= 0",
        ),
        (
            {"event_time": "day", "max_out_of_orderness": timedelta(hours=12)},
            "is a date: max_out_of_orderness must be a whole number of days",
        ),
        (
            {"event_time": "day", "max_out_of_orderness": 1.5},
            "is a date: max_out_of_orderness must be a whole number of days",
        ),
        (
            {"event_time": "day", "max_out_of_orderness": timedelta(days=-3)},
            "max_out_of_orderness must be a finite duration >= 0",
        ),
        ({"event_time": "id", "max_out_of_orderness": timedelta(1)}, "is an integer"),
        (
            {"event_time": "id", "max_out_of_orderness": 2.5},  # was rounded to 2, silently
            "is an integer: max_out_of_orderness must be a whole number of the column's own",
        ),
        (
            {"event_time": "ts", "max_out_of_orderness": timedelta.max},  # failed in the task
            "is beyond what event times can differ by",
        ),
        (
            {"event_time": "id", "max_out_of_orderness": "5"},
            r"a number in the column's units \('id': the column's own units\); got '5'",
        ),
    ],
)
def test_bad_arguments_fail_before_the_job_starts(spark, kwargs, message) -> None:
    async def f(row):  # type: ignore[no-untyped-def]
        return [row]

    df = spark.range(3).select(
        "id", F.current_timestamp().alias("ts"), F.current_date().alias("day")
    )
    args = {"fn": f, "schema": "id long", **kwargs}
    with pytest.raises(ConfigurationError, match=message):
        unordered_wait(df, args.pop("fn"), args.pop("schema"), **args)


def test_a_first_argument_that_is_not_a_spark_dataframe_is_named_in_full() -> None:
    # "got DataFrame" for a pandas one read as a contradiction.
    import pandas as pd

    async def f(row):  # type: ignore[no-untyped-def]
        return [row]

    with pytest.raises(
        ConfigurationError,
        match=r"must be a pyspark DataFrame; got pandas\.core\.frame\.DataFrame: make one "
        r"with spark\.createDataFrame\(\.\.\.\)\.$",
    ):
        ordered_wait(pd.DataFrame({"id": [1]}), f, "id long")
    with pytest.raises(ConfigurationError, match=r"got builtins\.list\.$"):
        unordered_wait([{"id": 1}], f, "id long")


def test_a_variant_input_column_is_refused_asking_for_json_text(spark) -> None:
    # It reached the function as its encoded bytes: {"value": b"...", "metadata": b"..."}.
    async def f(row):  # type: ignore[no-untyped-def]
        return [row]

    df = spark.range(3).select("id", F.parse_json(F.lit('{"a": 1}')).alias("v"))
    with pytest.raises(ConfigurationError, match=r"input field 'v' is a VARIANT.*to_json\(col\)"):
        ordered_wait(df, f, "id long")


def test_an_empty_array_or_map_input_column_is_named_with_the_cast_to_use(spark) -> None:
    # Spark types array() as array<void> and create_map() as map<void, void>, NOT NULL
    # inside: refused with pyspark's "A null type field may not be non-nullable", naming
    # no column.
    async def f(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"]}]

    for column, path in [(F.array(), "'s.a[]'"), (F.create_map(), "'s.a{key}'")]:
        df = spark.range(1).select("id", F.struct(column.alias("a")).alias("s"))
        with pytest.raises(ConfigurationError) as refused:
            ordered_wait(df, f, "id long")
        assert str(refused.value) == (
            f"The input field {path} has no type (void: the elements of an empty array(), the "
            "keys and values of an empty create_map()) and Spark declares it NOT NULL, which "
            "Arrow cannot carry (mapInArrow, which the adapter runs on, needs Arrow-compatible "
            "columns). Cast the empty array or map to the type it stands for first, e.g. "
            "F.array().cast('array<string>')."
        )


def test_ml_vector_fields_are_refused_with_the_array_functions_to_use(spark) -> None:
    # Before, an input vector reached the function as its storage struct ({'type': 1,
    # 'size': None, 'indices': None, 'values': [...]}), and a DenseVector returned for a
    # vector field failed with pyarrow's "was expecting tuple of (key, value) pair".
    from pyspark.ml.functions import array_to_vector, vector_to_array
    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.sql.types import LongType, StructField, StructType

    async def f(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"], "total": float(sum(row["features"]))}]

    df = spark.createDataFrame(
        [(1, Vectors.dense([1.0, 2.0])), (2, Vectors.sparse(3, [2], [4.0]))], ["id", "features"]
    )
    with pytest.raises(
        ConfigurationError,
        match=r"input field 'features' is a user-defined type \(VectorUDT\).*storage type, "
        r"struct<type:tinyint.*select vector_to_array\(col\) AS col first.*or drop the column",
    ):
        ordered_wait(df, f, "id long, total double")
    nested = df.select(F.struct("features").alias("s"))
    with pytest.raises(ConfigurationError, match=r"input field 's.features' is a user-defined"):
        ordered_wait(nested, f, "id long, total double")
    # the advice, followed, works
    as_arrays = df.select("id", vector_to_array("features").alias("features"))
    vectors = StructType([StructField("id", LongType()), StructField("v", VectorUDT())])
    with pytest.raises(
        ConfigurationError,
        match=r"output field 'v' is a user-defined type \(VectorUDT\).*ARRAY<DOUBLE> field "
        r"instead, and array_to_vector\(col\)",
    ):
        ordered_wait(as_arrays, features_as_v, vectors)
    out = ordered_wait(as_arrays, f, "id long, total double").orderBy("id")
    assert [tuple(r) for r in out.collect()] == [(1, 3.0), (2, 4.0)]
    back = ordered_wait(as_arrays, features_as_v, "id long, v array<double>").select(
        "id", array_to_vector("v").alias("v")
    )
    assert sorted((r.id, r.v) for r in back.collect()) == [
        (1, Vectors.dense([1.0, 2.0])),
        (2, Vectors.dense([0.0, 0.0, 4.0])),
    ]


async def features_as_v(row):  # type: ignore[no-untyped-def]
    return [{"id": row["id"], "v": row["features"]}]


def test_char_and_varchar_fields_are_refused_with_the_string_type_to_use(spark) -> None:
    # The refusal said only that Arrow cannot carry VarcharType(5), not what to do instead.
    async def f(row):  # type: ignore[no-untyped-def]
        return [{"out": repr(sorted(row.items()))}]

    spark.conf.set("spark.sql.preserveCharVarcharTypeInfo", "true")  # a table's keep theirs
    try:
        df = spark.sql(
            "SELECT cast('ab' AS varchar(5)) AS v, named_struct('c', cast('x' AS char(3))) AS s"
        )
        cases = [
            (df.drop("s"), "out string", "input field 'v' is a varchar(5)",
             "Cast it to a string first: select cast(`v` AS string) AS `v`."),
            (df.drop("v"), "out string", "input field 's.c' is a char(3)",
             "Cast it to a string first: select cast(`s` AS struct<c:string>) AS `s`."),
            (spark.range(1), "out varchar(10), n long", "output field 'out' is a varchar(10)",
             "Declare it a string instead: `out` string."),
            (spark.range(1), "`o.k` array<char(2)>", "output field 'o.k[]' is a char(2)",
             "Declare it a string instead: `o.k` array<string>."),
        ]  # fmt: skip
        for frame, schema, field, advice in cases:
            with pytest.raises(ConfigurationError) as refused:
                ordered_wait(frame, f, schema)
            text = str(refused.value)
            assert f"The {field}, which Spark cannot hand to Arrow" in text
            assert "a CHAR or VARCHAR is a STRING whose length Spark checks" in text
            assert text.endswith(advice)
        # The advice, followed.
        casted = df.selectExpr("cast(`v` AS string) AS `v`", "cast(`s` AS struct<c:string>) AS `s`")
        assert ordered_wait(casted, f, "`out` string").collect() == [
            ("[('s', {'c': 'x  '}), ('v', 'ab')]",)
        ]
    finally:
        spark.conf.unset("spark.sql.preserveCharVarcharTypeInfo")


def test_the_string_type_to_use_for_a_char_quotes_nested_names_that_need_it() -> None:
    # The advice left nested names bare: cast(`s t` AS struct<a b:string,...>), which
    # Spark cannot parse. (Followed on Spark, the quoted advice casts and declares.)
    from pyspark.sql.types import (
        ArrayType,
        CharType,
        IntegerType,
        MapType,
        StructField,
        StructType,
        VarcharType,
    )

    from stateful_async.spark._adapter import _arrow_schema

    inner = StructType(
        [
            StructField("a b", CharType(3)),
            StructField("c`d", ArrayType(VarcharType(2))),
            StructField("e.f", MapType(VarcharType(2), IntegerType())),
            StructField("plain_1", IntegerType()),
        ]
    )
    quoted = "struct<`a b`:string,`c``d`:array<string>,`e.f`:map<string,int>,plain_1:int>"
    for what, advice in [
        ("input", f"Cast it to a string first: select cast(`s t` AS {quoted}) AS `s t`."),
        ("output", f"Declare it a string instead: `s t` {quoted}."),
    ]:
        with pytest.raises(ConfigurationError) as refused:
            _arrow_schema(StructType([StructField("s t", inner)]), what)
        assert str(refused.value).endswith(advice), str(refused.value)


def test_the_string_type_to_use_for_a_char_output_field_keeps_its_not_nulls() -> None:
    # The advice was built from simpleString, which drops NOT NULL: declared as it said,
    # `s` struct<a:string,b:int>, the field took the nulls the schema refused. (On Spark,
    # the advised DDL string parses with the same NOT NULLs.)
    from pyspark.sql.types import CharType, IntegerType, StructField, StructType

    from stateful_async.spark._adapter import _arrow_schema

    inner = StructType(
        [StructField("a", CharType(3), nullable=False), StructField("b", IntegerType())]
    )
    struct = StructType([StructField("s", inner, nullable=False)])
    with pytest.raises(ConfigurationError) as refused:
        _arrow_schema(struct, "output")
    assert str(refused.value).endswith(
        "Declare it a string instead: `s` struct<a:string NOT NULL,b:int> NOT NULL."
    ), str(refused.value)
    with pytest.raises(ConfigurationError) as refused:  # a cast keeps the column's own
        _arrow_schema(struct, "input")
    assert str(refused.value).endswith("select cast(`s` AS struct<a:string,b:int>) AS `s`.")


def test_types_spark_cannot_hand_to_arrow_are_found_in_map_keys_too() -> None:
    # Map keys were skipped: a CHAR or YEAR-MONTH interval key got the bare "The output
    # schema has a type Arrow cannot carry ([UNSUPPORTED_DATA_TYPE_FOR_ARROW_CONVERSION]
    # VarcharType(3) ...)", and struct keys with names alike in case were not told of.
    from pyspark.sql.types import (
        IntegerType,
        MapType,
        StructField,
        StructType,
        VarcharType,
        YearMonthIntervalType,
    )

    from stateful_async.spark._adapter import _arrow_schema, _names_alike

    def refusal(key_type: Any) -> str:
        struct = StructType([StructField("m", MapType(key_type, IntegerType()))])
        with pytest.raises(ConfigurationError) as refused:
            _arrow_schema(struct, "output")
        return str(refused.value)

    varchar = refusal(VarcharType(3))
    assert varchar.startswith("The output field 'm{key}' is a varchar(3), which Spark cannot")
    assert varchar.endswith("Declare it a string instead: `m` map<string,int>.")
    interval = refusal(YearMonthIntervalType())
    assert interval.startswith("The output field 'm{key}' is an interval year to month")
    assert "transform_keys" in interval
    alike = StructType([StructField("a", IntegerType()), StructField("A", IntegerType())])
    struct = StructType([StructField("m", MapType(alike, IntegerType()))])
    assert _names_alike(struct) == ("m{key}.a", "m{key}.A")


def test_event_time_names_its_column_as_spark_does_ignoring_case(spark, tmp_path) -> None:
    # It was refused as "not in the DataFrame", although Spark resolves "TS" to ts.
    async def f(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"]}]

    df = spark.range(0, 100, numPartitions=2).selectExpr("id", "id AS ts")
    config = CheckpointConfig(str(tmp_path), "cased", interval_records=10)
    out = unordered_wait(df, f, "id long", event_time="TS", checkpoint=config).collect()
    assert sorted(r.id for r in out) == list(range(100))
    metas = SnapshotStore(str(tmp_path)).checkpoints("cased", include_expired=True)
    assert {m.properties["event_time"] for m in metas} == {"ts"}  # the watermarks' column
    both = df.selectExpr("id", "ts", "id AS Ts")
    for name in ("TS", "ts"):
        with pytest.raises(ConfigurationError, match="names the columns 'ts', 'Ts', which"):
            unordered_wait(both, f, "id long", event_time=name)
    spark.conf.set("spark.sql.caseSensitive", "true")
    try:
        with pytest.raises(ConfigurationError, match="event_time column 'TS' is not in the"):
            unordered_wait(df, f, "id long", event_time="TS")
    finally:
        spark.conf.unset("spark.sql.caseSensitive")


def test_a_duration_with_a_part_below_its_intervals_last_field_is_refused() -> None:
    # Arrow carries every DAY-TIME interval as microseconds, and Spark kept a part below an
    # INTERVAL DAY's days as it was: 36 hours was shown and cast as 1 day (to 1 as a bigint)
    # but equalled no INTERVAL '1' DAY and collected as 36 hours, silently
    from pyspark.sql.types import (
        ArrayType,
        DayTimeIntervalType,
        MapType,
        StringType,
        StructField,
        StructType,
    )

    from stateful_async.spark._adapter import _arrow_schema, interval_units
    from stateful_async.spark._results import to_batch

    day, hour, minute, second = (
        DayTimeIntervalType(DayTimeIntervalType.DAY, DayTimeIntervalType.DAY),
        DayTimeIntervalType(DayTimeIntervalType.DAY, DayTimeIntervalType.HOUR),
        DayTimeIntervalType(DayTimeIntervalType.HOUR, DayTimeIntervalType.MINUTE),
        DayTimeIntervalType(DayTimeIntervalType.DAY, DayTimeIntervalType.SECOND),
    )
    struct = StructType(
        [
            StructField("d", day),
            StructField("h", hour),
            StructField("m", minute),
            StructField("s", second),
            StructField("nested", StructType([StructField("l", ArrayType(day))])),
            StructField("by", MapType(StringType(), hour)),
        ]
    )
    schema, units = _arrow_schema(struct, "output"), interval_units(struct)
    assert interval_units(StructType([StructField("s", second)])) is None  # nothing to check

    def convert(**values: Any) -> pa.RecordBatch:
        row = dict.fromkeys(schema.names) | values  # a task's results have every field
        return to_batch([row], [{"id": 0}], schema, units=units)

    odd = timedelta(hours=36, minutes=30, seconds=15, microseconds=7)
    for values, refused in [
        (
            {"d": odd},
            r"'d' \(duration\[us\]\) cannot hold datetime.timedelta\(days=1, seconds=45015, "
            r"microseconds=7\) \(timedelta\): an INTERVAL DAY field holds whole days, and Spark "
            r"would keep its 12:30:15.000007 past them \(showing and casting the value without "
            r"it, comparing it with it\): round it first, e.g. value - value % "
            r"timedelta\(days=1\), or declare the field INTERVAL DAY TO SECOND, returned for "
            r"input row \{'id': 0\}",
        ),
        ({"h": odd}, r"'h' .*INTERVAL DAY TO HOUR field holds whole hours.*its 0:30:15.000007"),
        ({"m": odd}, r"'m' .*whole minutes.*its 0:00:15.000007.*INTERVAL HOUR TO SECOND"),
        ({"h": -timedelta(minutes=1)}, r"'h' .*whole hours.*its 0:59:00 past"),  # floored
        ({"d": np.timedelta64(1, "us")}, r"'d' .*INTERVAL DAY field holds whole days"),
        ({"nested": {"l": [timedelta(days=1), odd]}}, r"'nested.l\[1\]' .*whole days"),
        ({"by": {"k": odd}}, r"\"by\['k'\]\" .*whole hours"),
    ]:
        with pytest.raises(ResultSchemaError, match=refused):
            convert(**values)
    # whole units, and anything in a DAY TO SECOND, convert as they are
    whole = {"d": timedelta(days=-2), "h": timedelta(hours=36), "m": timedelta(minutes=90)}
    batch = convert(**whole, s=odd, nested={"l": [timedelta(days=3)]}, by={"k": timedelta()})
    assert batch.to_pylist()[0] == {
        **whole,
        "s": odd,
        "nested": {"l": [timedelta(days=3)]},
        "by": [("k", timedelta())],
    }


def test_an_interval_day_result_with_hours_fails_the_job_naming_the_field(spark) -> None:
    async def f(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"], "d": timedelta(days=row["id"], hours=row["id"] % 2)}]

    df = spark.range(0, 4, numPartitions=1)
    with pytest.raises(
        Exception,
        match=r"'d' \(duration\[us\]\) cannot hold .*: an INTERVAL DAY field holds whole days"
        r".*input row \{'id': 1\}",
    ):
        ordered_wait(df, f, "id long, d interval day").collect()
    whole = ordered_wait(df.where("id % 2 = 0"), f, "id long, d interval day")
    assert [r.d for r in whole.orderBy("id").collect()] == [timedelta(days=0), timedelta(days=2)]


def test_year_to_month_intervals_are_refused_with_an_expression_to_use(spark) -> None:
    # Spark cannot hand them to Arrow at all; DAY TO SECOND ones go through as durations.
    # The advice was a cast to int, which gives years for an INTERVAL YEAR (3 years became
    # 3 months on the way back), and named no column.
    async def f(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"], "iv": row["iv"] + 1}]

    df = spark.range(3).selectExpr(
        "id", "INTERVAL '3' YEAR AS iv", "named_struct('ym', INTERVAL '14' MONTH) AS s"
    )
    with pytest.raises(ConfigurationError) as refused:
        ordered_wait(df.drop("s"), f, "id long")
    text = str(refused.value)
    assert "The input field 'iv' is an interval year, which Spark cannot hand to Arrow" in text
    advice = "cast(cast(col AS interval year to month) AS int) AS col"
    assert f"Pass it as its number of months instead: select {advice} first" in text
    with pytest.raises(ConfigurationError) as refused:
        ordered_wait(df.drop("iv"), f, "id long")
    text = str(refused.value)
    assert "The input field 's.ym' is an interval month" in text
    assert "AS col first (inside a struct, an array or a map: do it there, with withField," in text
    with pytest.raises(ConfigurationError) as refused:
        ordered_wait(df.select("id"), f, "id long, iv interval year to month")
    text = str(refused.value)
    assert "The output field 'iv' is an interval year to month" in text
    assert (
        "Return its number of months in an INT field instead, and make_ym_interval(0, col)" in text
    )

    # The advice, followed: 3 years in as 36 months, 37 months out as 3 years 1 month.
    months = df.selectExpr("id", advice.replace("col", "iv"))
    out = ordered_wait(months, f, "id long, iv int").selectExpr(
        "cast(make_ym_interval(0, iv) AS string) AS iv"  # PySpark cannot collect the interval
    )
    assert [r.iv for r in out.collect()] == ["INTERVAL '3-1' YEAR TO MONTH"] * 3


def test_an_event_time_in_backticks_is_refused_saying_to_drop_them(spark) -> None:
    # It was refused as "not in the DataFrame", listing the column 'a.b' it meant.
    async def f(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"]}]

    df = spark.range(3).withColumn("a.b", F.col("id"))
    with pytest.raises(ConfigurationError) as refused:
        unordered_wait(df, f, "id long", event_time="`a.b`")
    assert str(refused.value) == (
        "event_time takes a column's name as it is, without Spark's backticks: "
        "event_time='a.b', not '`a.b`'."
    )
    out = unordered_wait(df, f, "id long", event_time="a.b", max_out_of_orderness=1)
    assert sorted(r.id for r in out.collect()) == [0, 1, 2]


def test_an_event_time_inside_a_struct_is_refused_saying_how_to_select_it_up(spark) -> None:
    # It was refused as "not in the DataFrame", listing the columns, the struct among them.
    async def f(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"]}]

    df = spark.range(3).selectExpr("id", "named_struct('ts', id, 'n', named_struct('t', id)) AS s")
    for name, field, column in (("s.ts", "ts", "s.ts"), ("S.N.T", "t", "s.n.t")):  # any case
        with pytest.raises(ConfigurationError) as refused:
            unordered_wait(df, f, "id long", event_time=name)
        assert str(refused.value) == (
            f"event_time {name!r} is the field {field!r} inside the struct column 's': nested "
            "fields are not supported directly, event_time takes top-level columns. Select it "
            f"up as a column first, e.g. df.withColumn({field!r}, F.col({column!r})), then "
            f"event_time={field!r}."
        )
    with pytest.raises(ConfigurationError, match=r"event_time column 's\.x' is not in the"):
        unordered_wait(df, f, "id long", event_time="s.x")  # no such field: as before
    # the advice, followed
    selected = df.withColumn("ts", F.col("s.ts"))
    out = unordered_wait(selected, f, "id long", event_time="ts", max_out_of_orderness=1)
    assert sorted(r.id for r in out.collect()) == [0, 1, 2]


@pytest.mark.parametrize(
    ("columns", "case_sensitive", "alias"),
    [
        (["ts"], False, "s_ts"),  # the field's own name is taken
        (["ts", "s_ts"], False, "s_ts_2"),  # so is the path's: it was proposed all the same
        (["TS", "S_TS", "s_ts_2"], True, "s_ts_3"),  # withColumn would replace 'TS' by 'ts'
        (["id"], True, "ts"),  # free: the field's own, as before
    ],
)
def test_a_nested_field_is_selected_up_under_a_name_no_column_has(
    columns, case_sensitive, alias
) -> None:
    # The advice proposed "_".join(path) when the field's own name was taken, without
    # looking whether that one was (and the field's own name when a column differed from it
    # in case only): following it replaced an existing column.
    from stateful_async.spark._columns import nested_field_advice
    from stateful_async.spark._sink_files import check_partition_columns

    schema = pa.schema(
        [*((c, pa.int64()) for c in columns), ("s", pa.struct([("ts", pa.string())]))]
    )
    advice = nested_field_advice(schema, "s.ts", "event_time", "event_time={}", case_sensitive)
    assert advice == (
        "is the field 'ts' inside the struct column 's': nested fields are not supported "
        "directly, event_time takes top-level columns. Select it up as a column first, e.g. "
        f"df.withColumn({alias!r}, F.col('s.ts')), then event_time={alias!r}."
    )
    with pytest.raises(ConfigurationError) as refused:
        check_partition_columns(schema, ("s.ts",))
    assert f"df.withColumn({alias!r}, F.col('s.ts')), then the option partitionBy={alias!r}." in (
        str(refused.value)
    )
    assert alias.lower() not in {c.lower() for c in columns}


def test_an_event_time_given_as_a_column_is_refused_naming_the_name_to_give(spark) -> None:
    # It failed with a bare "TypeError: unhashable type: 'Column'".
    async def f(row):  # type: ignore[no-untyped-def]
        return [row]

    df = spark.range(3).select("id", F.current_timestamp().alias("ts"))
    with pytest.raises(ConfigurationError, match=r"event_time must be a column name: a str"):
        unordered_wait(df, f, "id long", event_time=F.col("ts"))


def test_max_out_of_orderness_in_numpy_and_pandas_durations_is_read_in_its_units(spark) -> None:
    import pandas as pd

    from stateful_async.spark._adapter import _event_time

    df = spark.range(3).select("id", F.current_timestamp().alias("ts"), F.current_date().alias("d"))
    # numpy counts timedelta64 as an Integral: it was read as a count of the column's units
    assert _event_time(df, "ts", np.timedelta64(5, "s")) == 5_000_000  # microseconds
    assert _event_time(df, "ts", pd.Timedelta("5s").to_timedelta64()) == 5_000_000
    assert _event_time(df, "ts", pd.Timedelta("250ms")) == 250_000
    assert _event_time(df, "d", np.timedelta64(2, "D")) == 2  # days
    assert _event_time(df, "ts", np.int64(5)) == 5_000_000
    with pytest.raises(ConfigurationError, match=r"got np.timedelta64\('NaT'\)"):
        _event_time(df, "ts", np.timedelta64("NaT"))
    with pytest.raises(ConfigurationError, match="is an integer"):
        _event_time(df, "id", np.timedelta64(5, "s"))


def test_max_out_of_orderness_in_numpy_without_a_fixed_unit_is_refused(spark) -> None:
    # Months and years failed with numpy's bare TypeError ("Cannot get a common metadata
    # divisor ..."); a timedelta64 without a unit was read as microseconds (pandas reads it
    # as nanoseconds).
    async def f(row):  # type: ignore[no-untyped-def]
        return [row]

    df = spark.range(3).select("id", F.current_timestamp().alias("ts"), F.current_date().alias("d"))
    for column, given in (("ts", np.timedelta64(1, "M")), ("d", np.timedelta64(1, "Y"))):
        with pytest.raises(
            ConfigurationError, match=r"has no fixed length.*np.timedelta64\(5, 's'\)"
        ):
            unordered_wait(df, f, "id long", event_time=column, max_out_of_orderness=given)
    with pytest.raises(ConfigurationError, match=r"np.timedelta64\(5\) has no fixed length"):
        unordered_wait(df, f, "id long", event_time="ts", max_out_of_orderness=np.timedelta64(5))


def test_the_timeout_handler_gets_the_argument_its_call_got(spark) -> None:
    # Each call got its own copy of the row, so what async_invoke noted in it for its
    # timeout handler was gone there.
    class Noting(AsyncFunction):
        async def async_invoke(self, row):  # type: ignore[no-untyped-def]
            row["note"] = f"started {row['id']}"
            await asyncio.sleep(30)
            return []

        async def timeout(self, row):  # type: ignore[no-untyped-def]
            return [{"id": row["id"], "note": row.get("note")}]

    out = ordered_wait(
        spark.range(0, 6, numPartitions=2), Noting(), "id long, note string", timeout=0.2
    ).collect()
    assert [(r.id, r.note) for r in out] == [(i, f"started {i}") for i in range(6)]


def test_input_columns_named_twice_are_refused_before_the_job(spark) -> None:
    async def f(row):  # type: ignore[no-untyped-def]
        return [row]

    left = spark.range(3).selectExpr("id", "id * 2 AS v")
    joined = left.join(left.selectExpr("id AS k", "v"), left.id == F.col("k"))
    assert joined.columns == ["id", "v", "k", "v"]
    with pytest.raises(ConfigurationError, match="more than one column named 'v'"):
        ordered_wait(joined, f, "id long")


def test_an_input_value_python_cannot_hold_names_its_column_and_record(spark) -> None:
    # 9999-12-31 23:59:59 in New York is in the year 10000 in UTC, where the function gets
    # zoned timestamps: before, every attempt failed with a bare OverflowError.
    async def f(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"]}]

    previous = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    try:
        df = spark.range(0, 5, numPartitions=1).selectExpr(
            "id",
            "IF(id = 3, TIMESTAMP'9999-12-31 23:59:59', TIMESTAMP'2024-01-01') AS valid_to",
        )
        with pytest.raises(
            Exception, match="Input column 'valid_to' of record 3 of partition 0"
        ) as info:
            ordered_wait(df, f, "id long").collect()
        assert "cast the column to timestamp_ntz or a string" in str(info.value)
        ntz = df.withColumn("valid_to", F.col("valid_to").cast("timestamp_ntz"))
        assert ordered_wait(ntz, f, "id long").count() == 5  # the way the error gives
    finally:
        spark.conf.set("spark.sql.session.timeZone", previous)


def test_an_input_without_columns_is_refused_before_the_job(spark) -> None:
    # Spark hands mapInArrow one empty batch for a DataFrame without columns, whatever its
    # row count: before, every row was lost without a word.
    async def f(row):  # type: ignore[no-untyped-def]
        return [{"x": 1}]

    bare = spark.range(0, 5, 1, 1).select()
    assert bare.count() == 5 and bare.columns == []
    for wait in (ordered_wait, unordered_wait):
        with pytest.raises(ConfigurationError, match="The input DataFrame has no columns"):
            wait(bare, f, "x int")
    kept = bare.withColumn("row", F.monotonically_increasing_id())  # the way the error gives
    assert ordered_wait(kept, f, "x int").count() == 5


def test_checkpoint_config_validates_its_fields(tmp_path) -> None:
    with pytest.raises(ConfigurationError, match="interval_records must be an integer >= 1"):
        CheckpointConfig(str(tmp_path), "job", interval_records=0)
    with pytest.raises(ConfigurationError, match="restore_from must be None, 'latest'"):
        CheckpointConfig(str(tmp_path), "job", restore_from="yesterday")
    with pytest.raises(ConfigurationError, match=r"got '3' \(a checkpoint id is an int: restore"):
        CheckpointConfig(str(tmp_path), "job", restore_from="3")  # as argv gives it
    with pytest.raises(ConfigurationError, match="cannot name a checkpoint directory"):
        CheckpointConfig(str(tmp_path), "../up")
    for seconds in ("5", True, float("inf"), float("nan"), 0, -1.0, 10**400):
        with pytest.raises(ConfigurationError, match="interval_seconds must be a number of sec"):
            CheckpointConfig(str(tmp_path), "job", interval_seconds=seconds)
    for options in (["AWS_REGION=x"], {"timeout": 5}):
        with pytest.raises(ConfigurationError, match="storage_options must be a dict of strings"):
            CheckpointConfig(str(tmp_path), "job", storage_options=options)
    for seconds in (2, 0.5, np.int64(30), timedelta(seconds=30)):
        kept = CheckpointConfig(str(tmp_path), "j", interval_seconds=seconds).interval_seconds
        assert kept == (30.0 if isinstance(seconds, timedelta) else float(seconds))
        assert type(kept) is float
    with pytest.raises(ConfigurationError, match="interval_seconds must be a number of sec"):
        CheckpointConfig(str(tmp_path), "job", interval_seconds=timedelta(0))
    # a location is a str or a path (kept as an absolute str)
    assert CheckpointConfig(tmp_path / "c", "j").location == str(tmp_path / "c")
    numpy = CheckpointConfig(
        str(tmp_path), "j", interval_records=np.int64(500), retain=np.uint8(2),
        restore_from=np.int64(7),
    )  # fmt: skip
    assert (numpy.interval_records, numpy.retain, numpy.restore_from) == (500, 2, 7)
    assert {type(numpy.interval_records), type(numpy.retain), type(numpy.restore_from)} == {int}
    for bad in ({"retain": True}, {"restore_from": np.bool_(True)}, {"restore_from": 0}):
        with pytest.raises(ConfigurationError, match="retain must be|restore_from must be"):
            CheckpointConfig(str(tmp_path), "j", **bad)


def test_the_resume_log_counts_re_invoked_records_apart_from_replayed_watermarks(
    tmp_path, capsys
) -> None:
    # The task itself, in this process. The log counted every restored element, watermarks
    # included, as "in flight re-invoked": 2 for one record and one watermark.
    from stateful_async import OutputMode
    from stateful_async.spark._task import TaskIdentity, _TaskRun

    first = [True]

    async def enrich(row):  # type: ignore[no-untyped-def]
        if first[0] and row["id"] == 0:
            await asyncio.sleep(5)  # in flight, behind the watermark, at checkpoint 1
        if first[0] and row["id"] == 6:
            raise ValueError("the first attempt fails after checkpoint 1")
        return [row]

    schema = pa.schema([("id", pa.int64())])
    batches = [pa.record_batch([pa.array(range(8), pa.int64())], schema=schema)]
    config = CheckpointConfig(str(tmp_path), "log", interval_records=4)

    def attempt(fn: Any, number: int) -> list[pa.RecordBatch]:
        spec = id_task(fn, OutputMode.UNORDERED, checkpoint=config, event_time="id")
        identity = TaskIdentity(0, number, "app.stage1", {})
        return list(_TaskRun(spec, iter(batches), identity).run())

    with pytest.raises(Exception, match="the first attempt fails"):
        attempt(enrich, 0)
    capsys.readouterr()
    first[0] = False
    out = attempt(enrich, 1)
    assert sorted(pa.Table.from_batches(out).column("id").to_pylist()) == list(range(8))
    logged = capsys.readouterr().err
    assert "(3 results re-emitted, 1 in flight re-invoked, 1 watermark replayed, 4 inputs " in (
        logged
    ), logged


def test_a_function_that_changes_nested_values_of_its_row_changes_no_checkpoint(
    tmp_path,
) -> None:
    # The task itself, in this process. The function's copy of the row was shallow: a
    # function that appended to a list column or set a struct's field, then awaited,
    # changed the row the checkpoint saved for it, and the resumed attempt called it again
    # with that row: ['a', 'enriched', 'enriched'] instead of ['a', 'enriched'].
    from stateful_async import OutputMode
    from stateful_async._function import as_async_function
    from stateful_async.spark._task import TaskIdentity, TaskSpec, _TaskRun

    async def enrich(row):  # type: ignore[no-untyped-def]
        row["tags"].append("enriched")
        row["s"]["seen"].append(1)
        row["s"]["n"] += 1
        row["m"]["k"].append("v2")
        await asyncio.sleep(0.05)  # in flight at the next checkpoint
        return [{"id": row["id"], "out": f"{row['tags']} {row['s']} {row['m']}"}]

    inputs = pa.schema(
        [
            ("id", pa.int64()),
            ("tags", pa.list_(pa.string())),
            ("s", pa.struct([("n", pa.int64()), ("seen", pa.list_(pa.int64()))])),
            ("m", pa.map_(pa.string(), pa.list_(pa.string()))),
        ]
    )
    outputs = pa.schema([("id", pa.int64()), ("out", pa.string())])
    expected = [
        {"id": i, "out": "['a', 'enriched'] {'n': 1, 'seen': [0, 1]} {'k': ['v', 'v2']}"}
        for i in range(6)
    ]

    def attempt(number: int, fail_at: int | None = None) -> list[dict]:
        config = CheckpointConfig(str(tmp_path), "nested", interval_records=1)
        spec = TaskSpec(
            as_async_function(enrich), OutputMode.ORDERED, 8, None, None, inputs, outputs,
            None, 0, config, "app",
        )  # fmt: skip

        def batches():  # type: ignore[no-untyped-def]
            for i in range(6):
                if i == fail_at:
                    raise RuntimeError("executor lost")
                yield pa.record_batch(
                    [[i], [["a"]], [{"n": 0, "seen": [0]}], [[("k", ["v"])]]], schema=inputs
                )

        identity = TaskIdentity(0, number, "app.stage1", {"owner": f"app/{number}"})
        return [r for b in _TaskRun(spec, batches(), identity).run() for r in b.to_pylist()]

    with pytest.raises(RuntimeError, match="executor lost"):
        attempt(0, fail_at=4)
    assert attempt(1) == expected


@pytest.mark.parametrize("deleted_by", ["another run's retention", "expire --retain 0"])
def test_a_retry_whose_runs_checkpoints_are_gone_starts_over_above_their_ids(
    tmp_path, deleted_by: str
) -> None:
    # The task itself, in this process. A run's checkpoints can go while its attempts are
    # still to come: another run of the job expires them, or a user runs `checkpoints
    # expire --retain 0` before a streaming query replays the batch. The retry restarted at
    # checkpoint 1, which the run's app transaction (at 2) refused, on every retry.
    from checkpoint import SnapshotStore
    from stateful_async.spark._task import TaskIdentity, _TaskRun

    async def echo(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"]}]

    schema = pa.schema([("id", pa.int64())])

    def attempt(run: str, number: int, fail_at: int | None = None, retain: int = 3) -> list[int]:
        config = CheckpointConfig(str(tmp_path), "job", interval_records=2, retain=retain)

        def batches():  # type: ignore[no-untyped-def]
            for i in range(10):
                if i == fail_at:
                    raise RuntimeError("executor lost")
                yield pa.record_batch([pa.array([i], pa.int64())], schema=schema)

        identity = TaskIdentity(0, number, run, {"owner": f"app/{run}/{number}"})
        out = _TaskRun(id_task(echo, checkpoint=config), batches(), identity).run()
        return [i for batch in out for i in batch.column("id").to_pylist()]

    with pytest.raises(RuntimeError, match="executor lost"):
        attempt("app.stage2", 0, fail_at=5)
    log = SnapshotStore(tmp_path).subtask("job", "enrich", 0)
    assert [m.checkpoint_id for m in log.checkpoints()] == [1, 2]
    if deleted_by == "expire --retain 0":
        SnapshotStore(tmp_path).expire("job", 0)
    else:
        assert attempt("app.stage1", 0, retain=1) == list(range(10))
    assert log.latest(run_id="app.stage2") is None  # nothing of the run left to resume
    assert attempt("app.stage2", 1) == list(range(10))  # started over, and landed
    ids = [m.checkpoint_id for m in log.checkpoints() if m.run_id == "app.stage2"]
    assert ids == [3, 4, 5, 6, 7, 8], ids  # above the 2 the run had: 5 and a final one


def test_a_micro_batch_restarted_with_ordered_wait_does_not_resume_unordered_waits_checkpoint(
    tmp_path,
) -> None:
    # The task itself, in this process: a streaming query stopped mid-batch under
    # unordered_wait and restarted with ordered_wait re-runs the batch as the same run.
    from stateful_async import OutputMode
    from stateful_async.spark._task import TaskIdentity, _TaskRun

    async def enrich(row):  # type: ignore[no-untyped-def]
        if row["id"] == 6:
            raise ValueError("the query stops during this batch")
        return [row]

    schema = pa.schema([("id", pa.int64())])
    batches = [pa.record_batch([pa.array(range(8), pa.int64())], schema=schema)]
    config = CheckpointConfig(str(tmp_path), "stream", interval_records=4)
    identity = TaskIdentity(0, 0, "query.batch7", {"batch_id": "7"})

    def run(mode: OutputMode) -> list[pa.RecordBatch]:
        spec = id_task(enrich, mode, checkpoint=config)
        return list(_TaskRun(spec, iter(batches), identity).run())

    with pytest.raises(Exception, match="the query stops during this batch"):
        run(OutputMode.UNORDERED)
    with pytest.raises(
        Exception,
        match=r"Partition 0 cannot resume from checkpoint query\.batch7:\d \(job 'stream', "
        r"operator 'enrich'\): unordered_wait wrote it, and this job runs ordered_wait\..* "
        r"Finish this micro-batch with unordered_wait, then switch",
    ):
        run(OutputMode.ORDERED)


def test_the_drivers_mode_check_judges_the_checkpoint_each_task_would_resume_from(
    tmp_path,
) -> None:
    # A partition resumes from its newest restorable checkpoint, skipping one whose chain is
    # broken; the driver must judge that one, not simply the newest.
    from checkpoint import CheckpointMetadata, CheckpointRef
    from stateful_async.spark._adapter import _check_order_kept, _restore_points

    def judge(metas, config):  # type: ignore[no-untyped-def]
        _check_order_kept(_restore_points(metas, config), config)

    start = datetime(2026, 1, 1, tzinfo=timezone.utc)

    def meta(run, partition, checkpoint_id, parent, mode, second):  # type: ignore[no-untyped-def]
        return CheckpointMetadata(
            "job", "enrich", run, partition, checkpoint_id, parent, checkpoint_id, "", 0, 0,
            False, False, start + timedelta(seconds=second), "test", {"output_mode": mode},
        )  # fmt: skip

    ordered = meta("A", 0, 1, None, "ordered", 0)
    broken = meta("B", 0, 2, CheckpointRef("gone", 1), "unordered", 10)  # parent deleted
    config = CheckpointConfig(str(tmp_path), "job", restore_from="latest")
    judge([broken, ordered], config)  # partition 0 resumes from A:1: accepted
    unordered = meta("B", 1, 1, None, "unordered", 20)
    with pytest.raises(ConfigurationError, match=r"would resume partition\(s\) 1 from"):
        judge([broken, ordered, unordered], config)
    # restore_from=N judges the newest with id N or lower
    judge([ordered, meta("C", 1, 5, None, "unordered", 30)], CheckpointConfig(
        str(tmp_path), "job", restore_from=4
    ))  # fmt: skip


def test_the_adapter_and_the_sink_run_on_spark_connect_batch_and_streaming(tmp_path) -> None:
    # A Spark Connect session has no SparkContext: the adapter read the app id and the
    # master from it, and failed before any job ran. Its own driver process (a local
    # Connect server cannot share a process with the tests' classic session).
    script = Path(__file__).with_name("connect_job.py")
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["session"] == "pyspark.sql.connect.session"
    want = [[i, 2 * i] for i in range(200)]
    assert result["ordered"] == want  # in order, exactly once, after a worker crash
    assert result["unordered"] == want
    resumed = [c for c in result["checkpoints"] if c[1] == "1"]
    assert resumed and all(subtask == 1 for subtask, _, _ in resumed)  # the crashed one
    assert resumed[0][2]  # attempt 1 resumed from attempt 0's checkpoint
    assert result["table"] == list(range(200))  # the replayed write added nothing
    assert result["local_session"].startswith(
        "ConfigurationError: local_session() makes classic SparkSessions, and this process "
        "runs a Spark Connect session"
    )
    # Structured Streaming on Connect: runs keyed by the query id and the batch id (read
    # from TaskContext as on a classic session), a worker crash in batch 1 resumed within
    # the batch, the restarted query went on with batch 2 alone; every row once.
    stream = result["stream"]
    query_id = stream["query_ids"][0]
    assert stream["query_ids"] == [query_id, query_id]  # the same query, restarted
    assert stream["rows"] == [[i, 2 * i] for i in range(300)]
    checkpoints = stream["checkpoints"]
    assert {(c[0], c[1], c[2]) for c in checkpoints} == {
        (f"{query_id}.batch{b}", query_id, str(b)) for b in range(3)
    }
    retried = [c for c in checkpoints if c[3] == "1"]
    assert retried and {c[2] for c in retried} == {"1"}  # the crash was in batch 1
    assert all(parent for *_, parent, _ in retried)  # resumed, not started over
    finals = [c[2] for c in checkpoints if c[5]]
    assert sorted(finals) == ["0", "1", "2"]  # each batch's one partition finished once
    assert result["metrics"].startswith(
        "ConfigurationError: EnrichmentMetrics needs a classic SparkSession: it is a Spark "
        "accumulator, and Spark Connect has none."
    )
    # The driver's checks read the master and spark.executorEnv from the session's conf
    # (no SparkContext): local[2,3] retries, so no warning that tasks never do; a bad
    # progress interval in the environment local-mode tasks inherit is refused up front.
    assert result["warnings"] == []
    assert result["progress"].startswith(
        "ConfigurationError: STATEFUL_ASYNC_PROGRESS_SECONDS must be a number of seconds >= 0 "
        "(0: no progress lines); the driver's environment has 'soon'."
    )
