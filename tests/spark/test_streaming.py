"""Structured Streaming: a file source through ordered_wait into the exactly-once Delta
sink; the query is interrupted in the middle of a micro-batch and restarted from its
checkpoint location — stopped in-process, and killed with its driver (SIGKILL)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import enrich_stream_driver as DRIVER  # a driver script: tests/spark is on pythonpath
import pytest
from deltalake import DeltaTable
from pyspark.errors import StreamingQueryException
from task_specs import id_task, run_available_now  # tests/spark is on pythonpath

from checkpoint import CheckpointMetadata, SnapshotStore, delta_dataset
from stateful_async.chaos import DriverProcess, MockService, ServiceConfig, expected_enrichment
from stateful_async.spark import register_delta_sink

pytestmark = pytest.mark.spark

HERE = Path(__file__).parent
FILES, ROWS_PER_FILE = 4, 300


def reference(i: int) -> tuple:
    answer = expected_enrichment(str(i))
    return (i, f"user{i}", answer["score"], answer["label"])


def write_source(source: Path) -> None:
    source.mkdir()
    for f in range(FILES):
        with open(source / f"part-{f}.json", "w") as handle:
            for i in range(f * ROWS_PER_FILE, (f + 1) * ROWS_PER_FILE):
                handle.write(json.dumps({"id": i, "name": f"user{i}"}) + "\n")


def wait_mid_batch(snapshots: Path, alive: Callable[[], bool]) -> CheckpointMetadata:
    """Wait until one micro-batch has finished and the next has committed at least two
    checkpoints but not its final one; returns the latter's newest checkpoint."""
    store = SnapshotStore(snapshots)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert alive(), "the query stopped on its own"
        if (snapshots / "stream").exists():
            metas = store.checkpoints("stream")
            finished = {m.run_id for m in metas if m.final}
            started = [m for m in metas if m.run_id not in finished and m.checkpoint_id >= 2]
            if finished and started:
                return started[-1]
        time.sleep(0.05)
    raise AssertionError("the query never reached the middle of its second batch")


def restart_and_check(
    spark: Any,
    args: tuple[str, ...],
    service: MockService,
    interrupted: CheckpointMetadata,
    interrupted_at: datetime,
) -> None:
    """Restart the query from its checkpoint location (the interrupted batch runs again),
    run it to the end of its input, and check what it wrote and how it resumed."""
    query = DRIVER.start_query(spark, *args)
    query.processAllAvailable()
    query.stop()
    table, snapshots, query_id = Path(args[1]), Path(args[3]), query.id
    rows = delta_dataset(DeltaTable(str(table))).to_table().to_pylist()
    got = sorted((r["id"], r["name"], r["score"], r["label"]) for r in rows)
    assert got == [reference(i) for i in range(FILES * ROWS_PER_FILE)]  # each exactly once

    # The re-run batch resumed from the interrupted attempt's checkpoints: its requests
    # repeated only what was in flight at the restored checkpoint or read after it.
    counts = service.counts()
    assert all(counts[str(i)] >= 1 for i in range(FILES * ROWS_PER_FILE))
    repeated = [k for k in counts if counts[k] > 1]
    assert all(counts[k] <= 2 for k in counts)
    assert len(repeated) <= DRIVER.CAPACITY + DRIVER.INTERVAL

    store = SnapshotStore(snapshots)
    run = [m for m in store.checkpoints("stream") if m.run_id == interrupted.run_id]
    finals = [m for m in run if m.final]
    assert len(finals) == 1
    chain = store.subtask("stream", "enrich", finals[0].subtask).chain(finals[0])
    assert interrupted.ref in {m.ref for m in chain}  # resumed, not restarted
    assert any(m.created_at < interrupted_at for m in chain[:-1])
    assert chain[-1].created_at > interrupted_at
    assert [m.checkpoint_id for m in chain] == list(range(1, len(chain) + 1))
    # A micro-batch's run is keyed by the query id and the batch id (both survive a
    # restart from the checkpoint location), and its checkpoints record them.
    batch_id = interrupted.run_id.rsplit(".batch", 1)[1]
    assert interrupted.run_id == f"{query_id}.batch{batch_id}"
    assert {(m.properties["query_id"], m.properties["batch_id"]) for m in chain} == {
        (query_id, batch_id)
    }


def stream_paths(spark: Any, tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    """The source (written), output table, stream checkpoint and snapshot paths of a test
    query through the delta_rs sink."""
    register_delta_sink(spark)
    source, table = tmp_path / "in", tmp_path / "out"
    write_source(source)
    return source, table, tmp_path / "stream", tmp_path / "snapshots"


def stop_mid_batch(spark: Any, args: tuple[str, ...]) -> CheckpointMetadata:
    """Start the query in-process and stop it in the middle of a micro-batch (the running
    batch is cancelled, not committed); the interrupted batch's newest checkpoint."""
    query = DRIVER.start_query(spark, *args)
    try:
        return wait_mid_batch(Path(args[3]), lambda: query.isActive)
    finally:
        query.stop()  # never left running in the shared session


@pytest.mark.parametrize("interrupt", ["stop", "sigkill"])
def test_a_query_interrupted_mid_batch_resumes_and_writes_every_result_once(
    spark, tmp_path, interrupt
) -> None:
    source, table, stream, snapshots = stream_paths(spark, tmp_path)
    with MockService(ServiceConfig(latency_ms=50)) as service:
        args = (str(source), str(table), str(stream), str(snapshots), service.url)
        if interrupt == "stop":
            interrupted = stop_mid_batch(spark, args)
        else:  # the query's own application: its driver, JVM and Python workers, by pid
            driver = DriverProcess(
                [sys.executable, str(HERE / "enrich_stream_driver.py"), *args],
                log_dir=tmp_path / "logs",
            )
            try:
                interrupted = wait_mid_batch(snapshots, driver.running)
            finally:
                killed = driver.kill()
            assert driver.returncode == -9 and len(killed) >= 3
        interrupted_at = datetime.now(timezone.utc)
        written_before = delta_dataset(DeltaTable(str(table))).to_table().num_rows
        assert 0 < written_before < FILES * ROWS_PER_FILE

        restart_and_check(spark, args, service, interrupted, interrupted_at)


def test_a_query_restarted_mid_batch_with_other_code_says_how_to_go_on(spark, tmp_path) -> None:
    # It was refused as two enrichments sharing one run's checkpoints, and every restart
    # replayed the same batch into the same refusal.
    source, table, stream, snapshots = stream_paths(spark, tmp_path)
    with MockService(ServiceConfig(latency_ms=50)) as service:
        args = (str(source), str(table), str(stream), str(snapshots), service.url)
        interrupted = stop_mid_batch(spark, args)
        renamed = DRIVER.renamed_enrichment(service.url)
        restarted = DRIVER.start_query(spark, *args, function=renamed)
        try:
            with pytest.raises(StreamingQueryException) as refused:
                restarted.awaitTermination(240)
        finally:
            restarted.stop()
        text = str(refused.value)
        assert f"found checkpoint {interrupted.run_id}:" in text
        assert "written by function stateful_async.chaos._client.ServiceEnrichment in an " in text
        assert "earlier run of this query; this run calls function " in text
        assert "calls function enrich_stream_driver.RenamedEnrichment." in text
        assert "give it a new operator_id" in text
        # As the message says: with a new operator_id the batch starts over, and the query
        # writes every result once.
        redo = DRIVER.start_query(spark, *args, function=renamed, operator_id="enrich2")
        try:
            redo.processAllAvailable()
        finally:
            redo.stop()
    rows = delta_dataset(DeltaTable(str(table))).to_table().to_pylist()
    got = sorted((r["id"], r["name"], r["score"], r["label"]) for r in rows)
    assert got == [reference(i) for i in range(FILES * ROWS_PER_FILE)]


def test_two_enrichments_sharing_a_checkpoint_in_one_micro_batch_fail_instead_of_mixing(
    spark, tmp_path: Path
) -> None:
    # In foreachBatch every action of a micro-batch shares its run: a second enrichment with
    # the same job_id and operator_id found the first one's final checkpoint and re-emitted
    # its results as its own (299 of 300 rows wrong, no error). It now fails, saying what to
    # change; with distinct operator_ids both are right.
    from stateful_async.spark import CheckpointConfig, ordered_wait

    async def double(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"], "value": 2.0 * row["id"]}]

    async def negate(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"], "value": -1.0 * row["id"]}]

    source = tmp_path / "src"
    source.mkdir()
    (source / "part-0.json").write_text("".join(f'{{"id": {i}}}\n' for i in range(50)))
    stream = spark.readStream.schema("id long").json(str(source))
    outputs: dict[str, list] = {}

    def run(name: str, operator_ids: tuple[str, str]) -> None:
        def each_batch(batch, batch_id):  # type: ignore[no-untyped-def]
            for fn, operator_id in zip((double, negate), operator_ids, strict=True):
                config = CheckpointConfig(
                    str(tmp_path / name), "nightly", operator_id=operator_id, interval_records=20
                )
                rows = ordered_wait(batch, fn, "id long, value double", checkpoint=config)
                outputs[fn.__name__] = sorted((r.id, r.value) for r in rows.collect())

        query = (
            stream.writeStream.foreachBatch(each_batch)
            .option("checkpointLocation", str(tmp_path / f"{name}-query"))
            .trigger(availableNow=True)
            .start()
        )
        try:
            assert query.awaitTermination(240), f"query {name} did not end within 240 s"
        finally:
            query.stop()

    with pytest.raises(Exception, match="written by function .*double; this task runs function"):
        run("shared", ("enrich", "enrich"))
    outputs.clear()
    run("distinct", ("double", "negate"))
    assert outputs == {
        "double": [(i, 2.0 * i) for i in range(50)],
        "negate": [(i, -1.0 * i) for i in range(50)],
    }


def test_restore_from_in_foreach_batch_is_refused_not_resumed_from_the_previous_batch(
    spark, tmp_path: Path
) -> None:
    # foreachBatch's DataFrame is a batch one, so restore_from got through: each micro-batch
    # (a run of its own) resumed the previous batch's final checkpoint, and a batch with the
    # same rows re-emitted the previous batch's results without calling the function.
    from stateful_async import ConfigurationError
    from stateful_async.spark import CheckpointConfig, ordered_wait

    calls: list[int] = []

    async def tag(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"]}]

    source = tmp_path / "src"
    source.mkdir()
    (source / "part-0.json").write_text("".join(f'{{"id": {i}}}\n' for i in range(5)))
    refused: list[str] = []

    def each_batch(batch, batch_id):  # type: ignore[no-untyped-def]
        config = CheckpointConfig(str(tmp_path / "ckpt"), "fb", restore_from="latest")
        try:
            ordered_wait(batch, tag, "id long", checkpoint=config)
        except ConfigurationError as exc:
            refused.append(str(exc))
        calls.append(batch_id)

    stream = spark.readStream.schema("id long").json(str(source))
    run_available_now(stream.writeStream.foreachBatch(each_batch), tmp_path / "query")
    assert calls == [0]
    [text] = refused
    assert "restore_from='latest' is for batch jobs" in text
    assert "foreachBatch's DataFrame of one micro-batch" in text


def test_a_task_of_a_micro_batch_refuses_restore_from(tmp_path: Path) -> None:
    # Where the driver cannot see the micro-batch, the task does, before it reads any
    # checkpoint (a batch of the previous micro-batch's is there to be wrongly resumed).
    import pyarrow as pa

    from stateful_async import ConfigurationError
    from stateful_async.spark import CheckpointConfig
    from stateful_async.spark._task import TaskIdentity, _TaskRun

    async def echo(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"]}]

    schema = pa.schema([("id", pa.int64())])
    location = str(tmp_path / "snapshots")
    properties = {"attempt": "0", "task_attempt_id": "1", "stage": "5", "app_id": "app"}
    properties.update(job_group="run", batch_id="0", query_id="query")

    def batch(number: int, restore_from: str | None) -> list:
        config = CheckpointConfig(location, "stream", interval_records=2, restore_from=restore_from)
        identity = TaskIdentity(
            0, 0, f"query.batch{number}", {**properties, "batch_id": str(number)}
        )
        rows = iter([pa.record_batch([pa.array(range(4), pa.int64())], schema=schema)])
        return list(_TaskRun(id_task(echo, checkpoint=config), rows, identity).run())

    assert sum(b.num_rows for b in batch(0, None)) == 4
    with pytest.raises(ConfigurationError, match="restore_from='latest' is for batch jobs"):
        batch(1, "latest")


def test_an_empty_partition_of_a_micro_batch_commits_no_checkpoint(tmp_path: Path) -> None:
    # Each micro-batch's partitions all committed a final checkpoint and expired, empty
    # ones too: a few Delta commits per partition and trigger that keep nothing (a retry
    # of an empty partition starts as it did). A batch job's empty partition still commits
    # one: restore_from='latest' must find this run's, not an earlier run's.
    import pyarrow as pa

    from checkpoint import SnapshotStore
    from stateful_async import ConfigurationError
    from stateful_async.spark import CheckpointConfig
    from stateful_async.spark._task import TaskIdentity, _TaskRun

    async def echo(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"]}]

    schema = pa.schema([("id", pa.int64())])
    spec = id_task(echo, checkpoint=CheckpointConfig(str(tmp_path), "stream", interval_records=2))
    store = SnapshotStore(tmp_path)

    def run(partition: int, rows: int, streaming: bool, task: str = "") -> int:
        properties = {"attempt": "0", "task_attempt_id": task or str(partition), "stage": "5"}
        properties.update(app_id="app", owner=f"app/start/{task or partition}")
        if streaming:
            properties.update(batch_id="7", query_id="query")
        run_id = "query.batch7" if streaming else "app.start.stage5"
        identity = TaskIdentity(partition, 0, run_id, properties)
        batches = iter([pa.record_batch([pa.array(range(rows), pa.int64())], schema=schema)])
        return sum(b.num_rows for b in _TaskRun(spec, batches, identity).run())

    assert run(0, 0, streaming=True) == 0
    assert run(1, 3, streaming=True) == 3
    assert run(2, 0, streaming=False) == 0
    finals = {(m.subtask, m.run_id) for m in store.checkpoints("stream") if m.final}
    assert finals == {(1, "query.batch7"), (2, "app.start.stage5")}
    assert not store.subtask("stream", "enrich", 0).exists()  # not even a table
    assert run(0, 0, streaming=True, task="10") == 0  # a retry of it: as the first attempt
    # coalesce() after the enrichment: one task computes two of its partitions, which both
    # report the task's partition number; an empty first one no longer leaves a checkpoint
    # that shows it, and the second then resumed from the first's (InputMismatchError on
    # every retry): still refused, saying why
    assert run(3, 0, streaming=True, task="11") == 0
    with pytest.raises(ConfigurationError, match=r"a second time in one task .* coalesce\(\)"):
        run(3, 3, streaming=True, task="11")


def test_another_stage_of_a_micro_batch_is_refused_and_a_restart_resumes(tmp_path: Path) -> None:
    # Two stages of one execution of a micro-batch (the same job group) sharing checkpoints
    # are refused, naming a foreachBatch's own setJobGroup, which makes a restart look like
    # that; a restart (another job group, the query's new run id) resumes.
    import pyarrow as pa

    from checkpoint import CheckpointConflictError
    from stateful_async.spark import CheckpointConfig
    from stateful_async.spark._task import TaskIdentity, _TaskRun

    async def echo(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"]}]

    schema = pa.schema([("id", pa.int64())])
    spec = id_task(echo, checkpoint=CheckpointConfig(str(tmp_path), "stream", interval_records=2))

    def attempt(number: int, stage: int, job_group: str) -> int:
        properties = {"attempt": "0", "task_attempt_id": str(number), "stage": str(stage)}
        properties.update(app_id="app", job_group=job_group, batch_id="3", query_id="query")
        identity = TaskIdentity(0, 0, "query.batch3", properties)
        rows = iter([pa.record_batch([pa.array(range(4), pa.int64())], schema=schema)])
        return sum(b.num_rows for b in _TaskRun(spec, rows, identity).run())

    assert attempt(1, stage=5, job_group="nightly") == 4
    with pytest.raises(CheckpointConflictError) as refused:
        attempt(2, stage=6, job_group="nightly")
    text = str(refused.value)
    assert "written by stage 5 of this same micro-batch execution; this task runs stage 6" in text
    assert "foreachBatch sets its own job group ('nightly')" in text
    assert attempt(3, stage=6, job_group="run-2") == 4  # a restart: re-emits, resumes


def test_a_replayed_micro_batch_split_differently_says_how_to_go_on(tmp_path: Path) -> None:
    # A query restarted mid-batch with another spark.sql.files.maxPartitionBytes (measured:
    # one partition before, two after) re-reads the batch split differently, and partition 0
    # no longer starts with the records its checkpoint consumed. The error told a streaming
    # query to "start a new run without restore_from", which a streaming query refuses, and
    # every restart replayed the batch into the same error. It now names the likely cause
    # and the way on. (The task itself, driven as Spark drives it, with a micro-batch's
    # identity: the split cannot be forced deterministically in a live query.)
    import pyarrow as pa

    from stateful_async import InputMismatchError
    from stateful_async.spark import CheckpointConfig
    from stateful_async.spark._task import TaskIdentity, _TaskRun

    async def echo(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"]}]

    schema = pa.schema([("id", pa.int64())])
    config = CheckpointConfig(str(tmp_path / "snapshots"), "stream", interval_records=2)
    spec = id_task(echo, checkpoint=config)

    def attempt(number: int, rows: int, streaming: bool, job_group: str = "") -> list:
        # a restarted query: another run (job group) of the same query and batch
        properties = {"attempt": "0", "task_attempt_id": str(number), "stage": "5"}
        properties.update(app_id="app", job_group=job_group or f"run-{number}")
        run_id = "query.batch3" if streaming else "app.stage7"
        if streaming:
            properties.update(batch_id="3", query_id="query")
        identity = TaskIdentity(0, 0, run_id, properties)
        batches = iter([pa.record_batch([pa.array(range(rows), pa.int64())], schema=schema)])
        return list(_TaskRun(spec, batches, identity).run())

    assert sum(b.num_rows for b in attempt(1, 6, streaming=True)) == 6
    with pytest.raises(InputMismatchError) as refused:
        attempt(2, 4, streaming=True)  # the replayed batch's partition 0 holds fewer rows
    text = str(refused.value)
    assert "cannot resume from checkpoint query.batch3:4" in text
    assert "restore_from" not in text
    assert "split into partitions differently than before the restart" in text
    assert "give the enrichment a new operator_id" in text

    # Spark's retry of a task of the same execution of the query (same job group) that
    # reads other input: nothing restarted, so the input is not deterministic. It was told
    # the restart's advice (the batch split differently).
    config = CheckpointConfig(str(tmp_path / "retried"), "stream", interval_records=2)
    spec = id_task(echo, checkpoint=config)
    assert sum(b.num_rows for b in attempt(5, 6, streaming=True, job_group="run-5")) == 6
    with pytest.raises(InputMismatchError) as refused:
        attempt(6, 4, streaming=True, job_group="run-5")
    text = str(refused.value)
    assert "This attempt is Spark's retry of a task of the same run" in text
    assert "before the restart" not in text

    # A batch job's retried attempt that reads other input: Spark's retry, not a choice of
    # the user's, so the advice is to make the input deterministic.
    assert sum(b.num_rows for b in attempt(3, 6, streaming=False)) == 6
    with pytest.raises(InputMismatchError) as refused:
        attempt(4, 4, streaming=False)
    text = str(refused.value)
    assert "This attempt is Spark's retry of a task of the same run" in text
    assert "df.sortWithinPartitions(<a unique key>)" in text
    assert "after unordered_wait: ordered_wait there, or write its output out first" in text
    assert "restore_from" not in text


class TaskContextOf:
    """What the task reads of pyspark's TaskContext: one attempt of partition 0 of a
    micro-batch's stage, as a given application and driver run it."""

    def __init__(self, task_attempt_id: int, job_group: str) -> None:
        self.task_attempt_id = task_attempt_id
        self.local = {
            "streaming.sql.batchId": "3",
            "sql.streaming.queryId": "query",
            "spark.jobGroup.id": job_group,
        }

    def partitionId(self) -> int:  # noqa: N802 - TaskContext's names
        return 0

    def attemptNumber(self) -> int:  # noqa: N802
        return 0

    def stageId(self) -> int:  # noqa: N802
        return 5

    def taskAttemptId(self) -> int:  # noqa: N802
        return self.task_attempt_id

    def getLocalProperty(self, key: str) -> str | None:  # noqa: N802
        return self.local.get(key)


def test_a_micro_batch_replayed_by_a_new_application_resumes_though_its_task_ids_repeat(
    tmp_path: Path,
) -> None:
    # Task attempt ids start from 0 in every application. A query killed in a micro-batch
    # and restarted in a new application replays the batch, often as the same task attempt
    # id that wrote the interrupted checkpoints; the check against coalesce() (one task
    # attempt computing a partition twice) compared that id alone, and refused the replay
    # on every restart (with local[N], where tasks are not retried). A helper's review
    # reproduced it with a real query; here the task is driven as Spark drives it.
    import dataclasses

    import pyarrow as pa

    from stateful_async import ConfigurationError
    from stateful_async.spark import CheckpointConfig
    from stateful_async.spark._task import _task_identity, _TaskRun

    async def echo(row):  # type: ignore[no-untyped-def]
        return [{"id": row["id"]}]

    schema = pa.schema([("id", pa.int64())])
    config = CheckpointConfig(str(tmp_path / "snapshots"), "stream", interval_records=2)
    base = id_task(echo, checkpoint=config)

    def batches(killed_after: int | None = None):  # type: ignore[no-untyped-def]
        for start in range(0, 12, 3):
            if killed_after is not None and start >= killed_after:
                raise RuntimeError("the driver was killed")
            yield pa.record_batch([pa.array(range(start, start + 3), pa.int64())], schema=schema)

    def attempt(app: str, started: str, killed_after: int | None = None) -> list[int]:
        spec = dataclasses.replace(base, app_id=app, app_start=started)
        identity = _task_identity(spec, TaskContextOf(0, job_group=f"{app}-{started}"))
        out = _TaskRun(spec, batches(killed_after), identity).run()
        return [i for batch in out for i in batch.column("id").to_pylist()]

    with pytest.raises(RuntimeError, match="the driver was killed"):
        attempt("app-1", "1000", killed_after=6)
    store = SnapshotStore(tmp_path / "snapshots")
    interrupted = store.checkpoints("stream")
    assert interrupted and not any(m.final for m in interrupted)
    # Killed again after a restart in a SparkContext of the same application id (a YARN
    # application attempt; a fixed spark.app.id), started later: it resumed and went on.
    with pytest.raises(RuntimeError, match="the driver was killed"):
        attempt("app-1", "2000", killed_after=9)
    resumed = store.checkpoints("stream")
    assert resumed[-1].checkpoint_id > interrupted[-1].checkpoint_id
    interrupted = resumed
    assert not any(m.final for m in interrupted)
    assert {m.properties["task_attempt_id"] for m in interrupted} == {"0"}

    # A new application runs the batch as task attempt 0 too: it resumes.
    assert attempt("app-2", "3000") == list(range(12))
    final = [m for m in store.checkpoints("stream") if m.final]
    assert len(final) == 1 and final[0].properties["task_attempt_id"] == "0"
    chain = store.subtask("stream", "enrich", 0).chain(final[0])
    assert interrupted[-1].ref in {m.ref for m in chain}  # resumed, not restarted
    assert interrupted[0].ref in {m.ref for m in chain}

    # The very same task attempt computing the partition again is still refused.
    with pytest.raises(ConfigurationError, match="a second time in one task"):
        attempt("app-2", "3000")
