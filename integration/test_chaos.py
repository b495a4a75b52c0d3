"""Chaos scenarios on a real Spark standalone cluster (a master and two workers on
127.0.0.1), the real mock service and real Delta tables.

Every scenario runs the reference job (``python -m stateful_async.chaos.job``: 4000 rows
in two partitions, enriched with checkpoints every 250 records, written through the
exactly-once ``delta_rs`` sink; scenario 8 runs it as a Structured Streaming query,
``integration/stream_job.py``), injects one failure, and then proves:

* the output table equals the failure-free run's output row by row: no row lost, none
  duplicated (and, for ``ordered_wait``, each task's file in input order);
* the service saw every row, and repeated requests only within the documented bound
  (``capacity + interval`` per failed task attempt), usually exactly the set the restored
  checkpoint predicts;
* the snapshot store holds no partial or duplicate checkpoint;
* the fault really happened (a failed attempt with the expected error, the killed pids
  gone, the orphan file of the crashed commit on disk, ...).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

import stateful_async
import stateful_async.chaos as chaos_api
from checkpoint import CheckpointMetadata, SnapshotStore
from stateful_async.chaos import (
    FALLBACK,
    ChaosCheckError,
    ClusterError,
    JobOptions,
    JobReport,
    StoreCheck,
    TaskAttempt,
    check_snapshot_store,
    compare_outputs,
    expected_output,
    partition_ids,
    read_table_rows,
    request_repeats,
    wait_until,
)
from stateful_async.chaos.cluster import main as cluster_main
from stateful_async.spark import clean_orphan_files

if TYPE_CHECKING:
    from conftest import Chaos, Reference

# Every scenario runs with the reference run's parameters (conftest.Chaos.options):
# options.rows rows in options.partitions partitions, options.capacity requests in flight,
# a checkpoint every options.interval records. options.retry_bound = capacity + interval is
# the documented bound on repeated requests per failed task attempt.


# -- shared checks ---------------------------------------------------------------------------


def ids_of(options: JobOptions, partition: int) -> range:
    return partition_ids(options.rows, options.partitions, partition)


def check_output(
    chaos: Chaos,
    scenario: str,
    options: JobOptions,
    expected: list[dict[str, Any]],
    extra_requests: int,
    bound: int | None,
    recovery: float | None,
    note: str = "",
) -> StoreCheck:
    """The common verdict: output equal to ``expected`` row by row (recorded in the
    summary table first, so a failure still shows its numbers), task files in input order
    for ordered runs, and a whole snapshot store whose final checkpoints restore every
    partition's output."""
    rows = read_table_rows(options.output)
    diff = compare_outputs(expected, rows)
    chaos.record(scenario, len(diff.lost), diff.duplicates, extra_requests, bound, recovery, note)
    assert diff.exact, f"the output differs from the failure-free run: {diff}"
    assert rows == expected  # row by row
    partitions = range(options.partitions)
    table = DeltaTable(options.output)
    files = [
        pq.read_table(uri, columns=["id"]).column("id").to_pylist() for uri in table.file_uris()
    ]
    if options.mode == "ordered":  # one file per task, its rows in input order
        assert sorted(files) == [list(ids_of(options, p)) for p in partitions]
    else:
        assert sorted(sorted(f) for f in files) == [list(ids_of(options, p)) for p in partitions]
    store = check_snapshot_store(options.checkpoint, options.job_id)
    assert sorted(store.finals) == list(partitions)
    assert store.final_results == {p: len(ids_of(options, p)) for p in partitions}
    return store


def gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped by its parent counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def request_counts(chaos: Chaos) -> dict[int, int]:
    return {int(k): n for k, n in chaos.service.counts().items()}


def failed_write_attempts(report: JobReport) -> list[TaskAttempt]:
    return report.failed_attempts()


def first_checkpoint(
    metas: list[CheckpointMetadata], partition: int, attempt: int
) -> CheckpointMetadata:
    mine = [m for m in metas if m.subtask == partition and m.properties["attempt"] == str(attempt)]
    assert mine, f"no checkpoint of partition {partition} by attempt {attempt}"
    return min(mine, key=lambda m: m.created_at)


def restored_from(options: JobOptions, meta: CheckpointMetadata) -> Any:
    """The checkpoint ``meta``'s attempt resumed from (its parent), loaded."""
    assert meta.parent is not None, f"{meta.ref} did not resume from a checkpoint"
    return SnapshotStore(options.checkpoint).load(
        options.job_id, "enrich", meta.subtask, meta.parent.checkpoint_id, meta.parent.run_id
    )


def in_flight_ids(snapshot: Any) -> set[int]:
    return {e.value["id"] for e in snapshot.elements}


def assert_repeated(repeated: set[int], expected: set[int], unsent: set[int]) -> None:
    """Rows requested twice are exactly ``expected``, less rows whose first request the
    dead attempt had started but not yet sent (a subset of ``unsent``, the rows that could
    have been in flight at the crash)."""
    assert repeated <= expected, f"repeated beyond the bound: {sorted(repeated - expected)}"
    missing = expected - repeated
    not_in_flight = sorted(missing - unsent)
    assert not not_in_flight, f"not repeated, yet not in flight at the crash: {not_in_flight}"


def resumed_partition(store: StoreCheck, partition: int) -> CheckpointMetadata:
    """Attempt 1's first checkpoint of ``partition``: proof it resumed (it has a parent
    written by attempt 0), not restarted."""
    first = first_checkpoint(store.checkpoints, partition, 1)
    assert first.parent is not None and first.parent.run_id == first.run_id
    parent = next(m for m in store.checkpoints if m.ref == first.parent)
    assert parent.properties["attempt"] == "0"
    return first


# -- 1. Python worker crash ------------------------------------------------------------------


@pytest.mark.cluster
def test_1_python_worker_crash_mid_partition(chaos: Chaos, reference: Reference) -> None:
    crash_at = 1111  # in partition 0
    options = chaos.options(
        "worker-crash", faults=(chaos_api.FaultSpec.parse(f"crash-at={crash_at}"),)
    )
    report = chaos.run(options)

    [failed] = failed_write_attempts(report)
    assert (failed.partition, failed.attempt) == (0, 0)
    assert "Python worker exited unexpectedly (crashed)" in (failed.error or "")
    assert any(t.partition == 0 and t.attempt == 1 and t.status == "SUCCESS" for t in report.tasks)

    counts = request_counts(chaos)
    repeats = request_repeats({str(k): n for k, n in counts.items()})
    store_metas = SnapshotStore(options.checkpoint).checkpoints(options.job_id)
    resumed = first_checkpoint(store_metas, 0, 1)
    recovery = resumed.created_at.timestamp() - (failed.launch_time + (failed.duration or 0))
    store = check_output(
        chaos,
        "1. Python worker crash (crash-at row 1111)",
        options,
        reference.rows,
        sum(counts.values()) - options.rows,
        options.retry_bound,
        recovery,
    )
    resumed_partition(store, 0)
    assert not [m for m in store.checkpoints if m.subtask == 1 and m.properties["attempt"] != "0"]
    # The retried task said so in its executor's log.
    log = chaos.cluster.executor_log(report.app_id)
    assert re.search(r"stateful-async: partition 0 attempt 1, .* restored from .*:4 \(", log)

    # Every row requested; repeated exactly: the restored checkpoint's in-flight rows and
    # the rows the crashed attempt read after it, up to the crash (row 1111 was never sent).
    assert set(counts) == set(range(options.rows)) and max(counts.values()) == 2
    snapshot = restored_from(options, resumed)
    assert_repeated(
        {int(k) for k in repeats},
        in_flight_ids(snapshot) | set(range(snapshot.metadata.position, crash_at)),
        unsent=set(range(crash_at - options.capacity, crash_at)),
    )
    assert counts[crash_at] == 1
    assert len(repeats) <= options.retry_bound


# -- 2. executor JVM killed (unordered_wait) -------------------------------------------------


@pytest.mark.cluster
def test_2_executor_jvm_sigkilled_mid_job_unordered(chaos: Chaos, reference: Reference) -> None:
    chaos.service.configure(latency_ms=chaos.slow_latency_ms)
    options = chaos.options("executor-kill", mode="unordered")
    driver = chaos.start(options)
    app_id = chaos.app_id(driver)
    chaos.wait_for_progress(driver, options)
    killed_at = time.time()
    _, failed = kill_an_executor_and_finish(chaos, driver, options, app_id)
    partition = failed.partition
    title = "2. executor JVM SIGKILLed (unordered_wait)"
    check_killed_partition_resumed(chaos, options, reference, partition, killed_at, title)


def kill_an_executor_and_finish(
    chaos: Chaos, driver: Any, options: JobOptions, app_id: str
) -> tuple[JobReport, TaskAttempt]:
    """SIGKILL the application's executor on worker 0, let the job finish at the normal
    latency, and check that the kill failed exactly one task attempt (ExecutorLostFailure)
    and that Spark's next attempt of it, in the same stage, succeeded. Returns the report
    and the failed attempt."""
    executor = chaos.cluster.kill_executor(app_id, worker=0)
    assert gone(executor.pid)
    chaos.service.configure(latency_ms=chaos.latency_ms)
    report = chaos.finish(driver, options)
    [failed] = failed_write_attempts(report)
    assert failed.executor_id == executor.executor_id
    assert "ExecutorLostFailure" in (failed.error or "")
    assert any(
        t.stage_id == failed.stage_id
        and (t.partition, t.attempt, t.status) == (failed.partition, 1, "SUCCESS")
        for t in report.tasks
    )
    return report, failed


def check_killed_partition_resumed(
    chaos: Chaos,
    options: JobOptions,
    reference: Reference,
    partition: int,
    killed_at: float,
    title: str,
) -> None:
    """After a kill at ``killed_at``: the output is exact, ``partition``'s retry resumed from
    attempt 0's checkpoint, and repeated requests stay within what that checkpoint allows."""
    counts = request_counts(chaos)
    store_metas = SnapshotStore(options.checkpoint).checkpoints(options.job_id)
    resumed = first_checkpoint(store_metas, partition, 1)
    store = check_output(
        chaos,
        title,
        options,
        reference.rows,
        sum(counts.values()) - options.rows,
        options.retry_bound,
        resumed.created_at.timestamp() - killed_at,
    )
    resumed_partition(store, partition)
    assert_repeats_bounded_by_restored_checkpoint(
        options, counts, resumed, ids_of(options, partition)
    )


def assert_repeats_bounded_by_restored_checkpoint(
    options: JobOptions, counts: dict[int, int], resumed: CheckpointMetadata, ids: Sequence[int]
) -> None:
    """After a kill at an arbitrary moment: every row requested, repeats only in the failed
    partition (whose input is ``ids``, in order), and only among the restored checkpoint's
    in-flight rows and the at most one interval of input read after it."""
    assert set(counts) == set(range(options.rows)) and max(counts.values()) <= 2
    repeated = {k for k, n in counts.items() if n > 1}
    assert repeated <= set(ids)
    snapshot = restored_from(options, resumed)
    position = snapshot.metadata.position
    read_after = ids[position : position + options.interval]
    assert repeated <= in_flight_ids(snapshot) | set(read_after)
    assert len(repeated) <= options.retry_bound


# -- 3. a whole worker killed ----------------------------------------------------------------


@pytest.mark.cluster
def test_3_whole_worker_sigkilled_mid_job(chaos: Chaos, reference: Reference) -> None:
    cluster = chaos.cluster
    cluster.wait_for_workers(2)
    chaos.service.configure(latency_ms=chaos.slow_latency_ms)
    options = chaos.options("worker-kill")
    driver = chaos.start(options)
    app_id = chaos.app_id(driver)
    chaos.wait_for_progress(driver, options)
    victims = cluster.executors(app_id)
    victim = next(e for e in victims if e.worker == 1)
    worker_pid = cluster.workers[1].pid
    try:
        killed_at = time.time()
        killed = cluster.kill_worker(1)
        assert worker_pid in killed and victim.pid in killed
        assert not cluster.workers[1].record.alive()
        assert [e for e in cluster.executors(app_id) if e.pid == victim.pid] == []
        chaos.service.configure(latency_ms=chaos.latency_ms)
        report = chaos.finish(driver, options)
    finally:
        cluster.start_worker(1)  # the next scenarios get two workers again
    assert len(cluster.alive_workers()) == 2

    [failed] = failed_write_attempts(report)
    assert failed.executor_id == victim.executor_id and failed.host == "localhost"
    assert "ExecutorLostFailure" in (failed.error or "")
    partition = failed.partition
    retried = [t for t in report.tasks if t.partition == partition and t.status == "SUCCESS"]
    assert [t.host for t in retried] == ["127.0.0.1"]  # the surviving worker took over
    check_killed_partition_resumed(
        chaos, options, reference, partition, killed_at, "3. whole worker SIGKILLed"
    )


# -- 4. crash during a snapshot commit -------------------------------------------------------


@pytest.mark.cluster
def test_4_crash_during_a_snapshot_commit(chaos: Chaos, reference: Reference) -> None:
    options = chaos.options(
        "commit-crash", faults=(chaos_api.FaultSpec.parse("crash-commit=3,partition=0"),)
    )
    report = chaos.run(options)

    [failed] = failed_write_attempts(report)
    assert (failed.partition, failed.attempt) == (0, 0)
    assert "Python worker exited unexpectedly (crashed)" in (failed.error or "")

    # The crashed commit left its Parquet file in the checkpoint table's directory, and the
    # Delta log never took it: checkpoint 3 of attempt 0 does not exist.
    log = SnapshotStore(options.checkpoint).subtask(options.job_id, "enrich", 0)
    on_disk = {p.name for p in Path(log.uri).glob("*.parquet")}
    referenced = {os.path.basename(f) for f in DeltaTable(log.uri).file_uris()}
    orphans = on_disk - referenced
    assert len(orphans) == 1
    # (ParquetFile: pyarrow 18's read_table takes subtask=0 in the path for a partition)
    orphan = pq.ParquetFile(Path(log.uri) / orphans.pop()).read().to_pylist()
    header = next(r for r in orphan if r["kind"] == "checkpoint")
    assert header["checkpoint_id"] == 3 and json.loads(header["properties"])["attempt"] == "0"
    # The rows in flight when attempt 0 died: the orphan's records.
    in_flight_at_crash = {r["input"]["id"] for r in orphan if r["kind"] == "record"}
    assert 0 < len(in_flight_at_crash) <= options.capacity

    counts = request_counts(chaos)
    store_metas = SnapshotStore(options.checkpoint).checkpoints(options.job_id)
    resumed = first_checkpoint(store_metas, 0, 1)
    store = check_output(
        chaos,
        "4. crash during a snapshot commit",
        options,
        reference.rows,
        sum(counts.values()) - options.rows,
        options.retry_bound,
        resumed.created_at.timestamp() - (failed.launch_time + (failed.duration or 0)),
    )
    resumed_partition(store, 0)
    threes = [m for m in store.checkpoints if m.subtask == 0 and m.checkpoint_id == 3]
    assert [m.properties["attempt"] for m in threes] == ["1"]
    assert resumed.checkpoint_id == 3 and resumed.parent is not None
    assert resumed.parent.checkpoint_id == 2

    # The crash came while input waited for commit 3 (position 750): attempt 1 repeated
    # checkpoint 2's in-flight rows and rows 500..749, except rows whose request attempt 0
    # had queued but not yet sent when the process died (in flight at the crash).
    snapshot = restored_from(options, resumed)
    repeated = {k for k, n in counts.items() if n > 1}
    assert_repeated(
        repeated,
        in_flight_ids(snapshot) | set(range(2 * options.interval, 3 * options.interval)),
        unsent=in_flight_at_crash,
    )
    # Every row requested, none more than twice (one failed attempt), and the extra
    # requests, not only the repeated rows, within capacity + interval.
    assert set(counts) == set(range(options.rows)) and max(counts.values()) == 2
    assert len(repeated) <= options.retry_bound
    assert sum(counts.values()) - options.rows <= options.retry_bound


# -- 5. driver killed, job re-run ------------------------------------------------------------


@pytest.mark.cluster
def test_5_driver_killed_then_rerun_from_latest_and_from_a_snapshot_id(
    chaos: Chaos, reference: Reference
) -> None:
    cluster = chaos.cluster
    chaos.service.configure(latency_ms=chaos.slow_latency_ms)
    options = chaos.options("driver-kill")
    driver = chaos.start(options, "killed-driver")
    app_id = chaos.app_id(driver)
    chaos.wait_for_progress(driver, options)
    pids = driver.pids()
    killed_at = time.time()
    killed = driver.kill()
    assert set(pids) <= set(killed) and len(pids) >= 2  # the driver and its JVM
    assert driver.pids() == []
    # The master drops the application and its executors (and their Python workers) exit:
    # nothing of the killed run can still commit a checkpoint.
    cluster.wait_for_no_active_apps(120)
    wait_until(lambda: not cluster.app_processes(app_id), 120, "The killed run's executors live on")
    assert not (Path(options.output) / "_delta_log").exists()  # the sink never committed
    store = SnapshotStore(options.checkpoint)
    latest = {m.subtask: m for m in store.checkpoints(options.job_id)}  # newest per partition
    assert sorted(latest) == list(range(options.partitions))
    assert all(not m.final and m.checkpoint_id >= 2 for m in latest.values())
    before = request_counts(chaos)

    # Re-run, resuming every partition from its latest checkpoint.
    chaos.service.configure(latency_ms=chaos.latency_ms)
    chaos.service.reset()
    rerun = chaos.run(
        chaos.options(
            "driver-kill",
            restore_from="latest",
            report=str(Path(options.report or "").with_name("rerun.json")),
        ),
        "rerun-latest",
    )
    assert rerun.written and not failed_write_attempts(rerun)
    after = request_counts(chaos)
    metas = store.checkpoints(options.job_id)
    resumed = {
        p: min(
            (m for m in metas if m.subtask == p and m.run_id.startswith(rerun.app_id)),
            key=lambda m: m.checkpoint_id,
        )
        for p in range(options.partitions)
    }
    recovery = min(m.created_at.timestamp() for m in resumed.values()) - killed_at
    repeated = set(after) & set(before)
    check_output(
        chaos,
        "5a. driver SIGKILLed, re-run restore_from=latest",
        options,
        reference.rows,
        sum(before.values()) + sum(after.values()) - options.rows,
        options.partitions * options.retry_bound,
        recovery,
        "(incl. new driver)",
    )
    expected_requests: set[int] = set()
    for p, meta in latest.items():
        assert resumed[p].parent == meta.ref  # resumed exactly the killed run's latest
        snapshot = store.load(options.job_id, "enrich", p, meta.checkpoint_id, meta.run_id)
        expected_requests |= in_flight_ids(snapshot) | set(ids_of(options, p)[meta.position :])
    assert set(after) == expected_requests and max(after.values()) == 1
    assert set(before) | set(after) == set(range(options.rows))
    assert len(repeated) <= options.partitions * options.retry_bound

    # Again, from an explicit snapshot id (checkpoint 1 of every partition), into a fresh
    # table: only what followed checkpoint 1 is requested again.
    chaos.service.reset()
    replay_options = chaos.options(
        "driver-kill",
        restore_from=1,
        output=str(Path(options.output).with_name("replay-output")),
        report=str(Path(options.report or "").with_name("replay.json")),
    )
    replay_started = time.time()
    replay = chaos.run(replay_options, "replay-from-1")
    assert replay.written and not failed_write_attempts(replay)
    again = request_counts(chaos)
    firsts = {
        p: store.load(options.job_id, "enrich", p, 1, latest[p].run_id)
        for p in range(options.partitions)
    }
    expected_replay = set().union(
        *(
            in_flight_ids(s) | set(ids_of(options, p)[s.metadata.position :])
            for p, s in firsts.items()
        )
    )
    replay_metas = [
        m for m in store.checkpoints(options.job_id) if m.run_id.startswith(replay.app_id)
    ]
    first_replayed = min(m.created_at.timestamp() for m in replay_metas)
    check_output(
        chaos,
        "5b. re-run again restore_from=1 (explicit id)",
        replay_options,
        reference.rows,
        sum(again.values()),
        len(expected_replay),
        first_replayed - replay_started,
        "(incl. new driver)",
    )
    for p in range(options.partitions):
        first = min((m for m in replay_metas if m.subtask == p), key=lambda m: m.checkpoint_id)
        assert first.parent is not None and first.parent.checkpoint_id == 1
        assert first.parent.run_id == latest[p].run_id
    assert set(again) == expected_replay and max(again.values()) == 1


# -- 6. service faults -----------------------------------------------------------------------


@pytest.mark.cluster
def test_6_service_5xx_bursts_latency_spikes_and_hangs(chaos: Chaos, reference: Reference) -> None:
    hung = {7, 2007}  # the first request of each never answers: the timeout's fallback decides
    burst = 24  # requests 400..423 fail with 503; one row can absorb at most all of them
    chaos.service.configure(
        distribution="uniform",
        latency_min_ms=2,
        latency_max_ms=8,
        spike_every=101,
        spike_ms=300,
        burst_start=400,
        burst_length=burst,
        hang_first={str(k): 1 for k in hung},
    )
    options = chaos.options(
        "service-faults",
        timeout=3.0,
        max_attempts=burst + 1,  # so no row runs out of attempts, however the burst falls
        retry_delay=0.02,
        fallback=True,
    )
    report = chaos.run(options)
    assert not failed_write_attempts(report)  # retries and timeouts handled every fault
    stats = chaos.service.stats()
    counts = request_counts(chaos)
    expected = expected_output(options.rows, fallback_keys=hung)
    assert all(expected[k] == {"id": k, "name": f"user{k}", **FALLBACK} for k in hung)
    check_output(
        chaos,
        "6. service: 5xx burst, latency spikes, hangs",
        options,
        expected,
        sum(counts.values()) - options.rows,
        burst,
        report.seconds - reference.report.seconds,
        "slower",
    )
    # Every injected 5xx was retried once more and nothing else was repeated; hung requests
    # were not retried after the deadline; spikes (300 ms < 3 s timeout) timed nothing out.
    # (A hung request numbered inside the burst window hangs instead of failing.)
    assert stats["hangs"] == len(hung)
    assert burst - len(hung) <= stats["errors"] <= burst
    assert sum(counts.values()) == options.rows + stats["errors"]
    assert all(counts[k] == 1 for k in hung)
    assert set(counts) == set(range(options.rows))
    store = check_snapshot_store(options.checkpoint, options.job_id)
    assert {m.properties["attempt"] for m in store.checkpoints} == {"0"}


# -- 7. a zombie attempt committing late -----------------------------------------------------


@pytest.mark.cluster
def test_7_zombie_attempt_commits_late_and_is_refused(chaos: Chaos, reference: Reference) -> None:
    # Attempt 0 of partition 0 holds its commit of checkpoint 2; speculation starts attempt
    # 1, which claims the run, resumes checkpoint 1 and commits 2; then the zombie's commit
    # of 2 goes ahead, and is refused: the run is no longer its own.
    options = chaos.options(
        "zombie",
        speculation=True,
        faults=(chaos_api.FaultSpec.parse("zombie-commit=2,partition=0,wait=240"),),
    )
    report = chaos.run(options)

    zombie = next(t for t in report.tasks if t.partition == 0 and t.attempt == 0)
    copy = next(t for t in report.tasks if t.partition == 0 and t.speculative)
    assert zombie.status == "FAILED" and copy.status == "SUCCESS" and copy.attempt == 1
    assert "CheckpointConflictError" in (zombie.error or "")
    assert "was refused: a later attempt of that run has taken it over" in (zombie.error or "")
    assert zombie.host != copy.host

    counts = request_counts(chaos)
    store_metas = SnapshotStore(options.checkpoint).checkpoints(options.job_id)
    resumed = first_checkpoint(store_metas, 0, 1)
    store = check_output(
        chaos,
        "7. zombie attempt commits late (speculation)",
        options,
        reference.rows,
        sum(counts.values()) - options.rows,
        options.retry_bound,
        resumed.created_at.timestamp() - copy.launch_time,
        "(takeover)",
    )
    resumed_partition(store, 0)
    twos = [m for m in store.checkpoints if m.subtask == 0 and m.checkpoint_id == 2]
    assert [m.properties["attempt"] for m in twos] == ["1"]  # the late commit never landed
    assert resumed.checkpoint_id == 2 and resumed.parent is not None
    # The zombie sent rows 0..499 (held at barrier 2); the copy resumed checkpoint 1.
    snapshot = restored_from(options, resumed)
    repeated = {k for k, n in counts.items() if n > 1}
    assert repeated == in_flight_ids(snapshot) | set(range(options.interval, 2 * options.interval))
    # Every row requested, none more than twice (the zombie and the copy), and the extra
    # requests, not only the repeated rows, within capacity + interval.
    assert set(counts) == set(range(options.rows)) and max(counts.values()) == 2
    assert len(repeated) <= options.retry_bound
    assert sum(counts.values()) - options.rows <= options.retry_bound


# -- 8. executor JVM killed mid-micro-batch (Structured Streaming) ---------------------------

STREAM_JOB = Path(__file__).with_name("stream_job.py")
STREAM_FILES = 6  # JSON input files, two per micro-batch: batches 0, 1 and 2
STREAM_FILE_ROWS = 300  # a file is one partition of its micro-batch
STREAM_INTERVAL = 50  # records per checkpoint: six per partition and batch
STREAM_LATENCY_MS = 100.0  # until the kill: ~4 s per partition and batch at capacity 8


def write_stream_input(directory: Path, files: int, rows: int) -> None:
    """``files`` JSON files of ``rows`` rows (``id``, ``name``; file k holds ids
    k*rows .. (k+1)*rows-1 in order), modified a second apart: the file source takes the
    oldest first."""
    directory.mkdir(parents=True)
    first = time.time() - files
    for k in range(files):
        path = directory / f"part-{k:02d}.json"
        lines = (json.dumps({"id": i, "name": f"user{i}"}) for i in range(k * rows, (k + 1) * rows))
        path.write_text("\n".join(lines) + "\n")
        os.utime(path, (first + k, first + k))


def mid_batch(metas: list[CheckpointMetadata], partitions: int, checkpoints: int = 2) -> str | None:
    """A micro-batch after the first in which every partition has committed
    ``checkpoints`` checkpoints and none has finished (its id), if there is one."""
    batches: dict[str, list[CheckpointMetadata]] = {}
    for m in metas:
        batches.setdefault(m.properties["batch_id"], []).append(m)
    for batch, mine in sorted(batches.items(), key=lambda item: int(item[0])):
        counts = [sum(m.subtask == p for m in mine) for p in range(partitions)]
        if int(batch) >= 1 and not any(m.final for m in mine) and min(counts) >= checkpoints:
            return batch
    return None


@pytest.mark.cluster
def test_8_executor_jvm_sigkilled_mid_micro_batch_streaming(chaos: Chaos) -> None:
    rows = STREAM_FILES * STREAM_FILE_ROWS
    options = chaos.options("stream-executor-kill", rows=rows, interval=STREAM_INTERVAL)
    base = Path(options.output).parent
    write_stream_input(base / "input", STREAM_FILES, STREAM_FILE_ROWS)
    chaos.service.configure(latency_ms=STREAM_LATENCY_MS)
    driver = chaos.start(
        options,
        program=[
            str(STREAM_JOB),
            *("--input", str(base / "input"), "--files-per-trigger", "2"),
            *("--spark-checkpoint", str(base / "query-checkpoint")),
        ],
    )
    app_id = chaos.app_id(driver)
    batch = chaos.wait_for_checkpoints(
        driver, options, lambda metas: mid_batch(metas, options.partitions)
    )
    killed_at = time.time()
    # The kill fails one task attempt of micro-batch `batch`; Spark retries it in the same
    # batch, and the query goes on to the end: one sink commit per micro-batch.
    report, failed = kill_an_executor_and_finish(chaos, driver, options, app_id)
    partition = failed.partition
    assert report.table_version == STREAM_FILES // 2 - 1  # versions 0, 1, 2: no extra commit

    counts = request_counts(chaos)
    metas = SnapshotStore(options.checkpoint).checkpoints(options.job_id)
    resumed = first_checkpoint(metas, partition, 1)
    expected = expected_output(rows)
    actual = read_table_rows(options.output)
    diff = compare_outputs(expected, actual)
    chaos.record(
        "8. streaming: executor SIGKILLed mid-batch",
        len(diff.lost),
        diff.duplicates,
        sum(counts.values()) - rows,
        options.retry_bound,
        resumed.created_at.timestamp() - killed_at,
    )
    assert diff.exact, f"the output differs from the expected one: {diff}"
    assert actual == expected and report.rows_in_table == rows  # row by row
    # One file per micro-batch partition, that is per input file, its rows in input order.
    files = [
        pq.read_table(uri, columns=["id"]).column("id").to_pylist()
        for uri in DeltaTable(options.output).file_uris()
    ]
    assert sorted(files) == [
        list(range(k * STREAM_FILE_ROWS, (k + 1) * STREAM_FILE_ROWS)) for k in range(STREAM_FILES)
    ]
    assert clean_orphan_files(options.output, older_than=0, dry_run=True) == []

    # The snapshot store is whole: every partition of every micro-batch finished, and its
    # final checkpoint restores the whole file.
    store = check_snapshot_store(options.checkpoint, options.job_id)
    finals = [m for m in store.checkpoints if m.final]
    assert sorted((m.properties["batch_id"], m.subtask) for m in finals) == [
        (str(b), p) for b in range(STREAM_FILES // 2) for p in range(options.partitions)
    ]
    killed = next(m for m in finals if (m.properties["batch_id"], m.subtask) == (batch, partition))
    ids = (
        SnapshotStore(options.checkpoint)
        .restore(options.job_id, "enrich", partition, killed.checkpoint_id, killed.run_id)
        .results.column("id")
        .to_pylist()
    )
    assert ids == list(range(ids[0], ids[0] + STREAM_FILE_ROWS))
    # The failed attempt ran in that batch; the retry resumed attempt 0's checkpoint of it.
    stages = {m.properties["stage"] for m in store.checkpoints if m.properties["batch_id"] == batch}
    assert stages == {str(failed.stage_id)}
    assert resumed_partition(store, partition).properties["batch_id"] == batch
    log = chaos.cluster.executor_log(report.app_id)
    assert resumed.parent is not None
    assert re.search(
        rf"stateful-async: partition {partition} attempt 1, run {re.escape(killed.run_id)}, "
        rf".* restored from {re.escape(str(resumed.parent))} \(",
        log,
    )
    assert_repeats_bounded_by_restored_checkpoint(options, counts, resumed, ids)
    assert sum(counts.values()) - rows <= options.retry_bound


# -- the tools themselves --------------------------------------------------------------------


@pytest.mark.cluster
def test_cluster_command_line_reports_and_refuses(
    chaos: Chaos, tmp_path: Path, capsys: Any
) -> None:
    base = chaos.cluster.base_dir
    assert base is not None
    out = subprocess.run(
        [sys.executable, "-m", "stateful_async.chaos.cluster", "--dir", str(base), "status"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    status = json.loads(out)
    assert status["master_url"] == chaos.cluster.master_url
    assert status["alive_workers"] == 2 and status["master_alive"]
    assert {w["pid"] for w in status["workers"].values()} == set(chaos.cluster.worker_pids())

    assert cluster_main(["--dir", str(tmp_path), "stop"]) == 1
    assert f"No cluster is recorded in {tmp_path} " in capsys.readouterr().err
    # --dir after the command, as the messages write it (argparse refused it before)
    assert cluster_main(["stop", "--dir", str(tmp_path)]) == 1
    assert f"No cluster is recorded in {tmp_path} " in capsys.readouterr().err
    with pytest.raises(ClusterError, match=r"Worker 7 is not running; running workers: \[0, 1\]"):
        chaos.cluster.kill_worker(7)  # worker indices, not pids
    # start-worker starts a killed worker again; before, an unknown index added a worker
    with pytest.raises(ClusterError, match="The cluster has no worker 5: its workers are 0, 1"):
        chaos.cluster.start_worker(5)
    assert sorted(chaos.cluster.workers) == [0, 1]
    with pytest.raises(ClusterError, match="No executor to kill"):
        chaos.cluster.kill_executor("app-that-does-not-exist")


@pytest.mark.cluster
def test_cluster_command_line_starts_and_stops_its_own_cluster(tmp_path: Path) -> None:
    base = tmp_path / "cli-cluster"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "stateful_async.chaos.cluster", "--dir", str(base), *args],
            capture_output=True,
            text=True,
            timeout=240,
        )

    def ours() -> list[psutil.Process]:  # JVMs the CLI started: their command lines name base
        found = []
        for process in psutil.process_iter(["cmdline"]):
            if str(base) in " ".join(process.info["cmdline"] or []):
                found.append(process)
        return found

    pids: list[int] = []
    try:
        started = cli("start", "--workers", "1")
        assert started.returncode == 0, started.stderr
        assert re.fullmatch(r"spark://127\.0\.0\.1:\d+\n", started.stdout)
        assert (base / "cluster.json").exists()
        status = json.loads(cli("status").stdout)
        assert status["master_url"] == started.stdout.strip() and status["alive_workers"] == 1
        pids = [status["master_pid"], *(w["pid"] for w in status["workers"].values())]
        assert all(psutil.pid_exists(pid) for pid in pids)
        refused = cli("start")
        assert refused.returncode == 1 and "already describes a cluster" in refused.stderr
    finally:
        stopped = cli("stop")
        left = ours()  # e.g. a start that timed out before it recorded every process
        for process in left:
            process.kill()
    assert not left, f"processes left running after stop: {left}"
    assert stopped.returncode == 0 and stopped.stdout.startswith("stopped ")
    assert all(gone(pid) for pid in pids)
    assert not (base / "cluster.json").exists()
    after = cli("status")
    assert after.returncode == 1 and "No cluster is recorded in" in after.stderr


def test_checks_catch_lost_duplicated_and_changed_rows() -> None:
    expected = expected_output(5)
    actual = [expected[0], expected[1], expected[1], {**expected[2], "score": 0.0}, expected[4]]
    diff = compare_outputs(expected, actual)
    assert (diff.lost, diff.duplicated, diff.mismatched, diff.duplicates) == ([3], [1], [2], 1)
    assert not diff.exact
    assert compare_outputs(expected, list(reversed(expected))).exact
    with pytest.raises(ChaosCheckError, match="Cannot read the Delta table at /nonexistent"):
        read_table_rows("/nonexistent/table")


def test_fault_options_parse_and_refuse_nonsense() -> None:
    spec = chaos_api.FaultSpec.parse("delay-commit=2:1.5,attempt=1,partition=0,partition=3")
    assert (spec.kind, spec.value, spec.seconds, spec.attempt, spec.partitions) == (
        "delay-commit",
        2,
        1.5,
        1,
        (0, 3),
    )
    assert chaos_api.FaultSpec.parse(str(spec)) == spec
    with pytest.raises(stateful_async.ConfigurationError, match="Unknown fault 'explode=1'"):
        chaos_api.FaultSpec.parse("explode=1")
    with pytest.raises(stateful_async.ConfigurationError, match="delay-commit needs ID:SECONDS"):
        chaos_api.FaultSpec.parse("delay-commit=2")


def test_the_chaos_package_exports_what_it_lists() -> None:
    for name in chaos_api.__all__:
        assert hasattr(chaos_api, name), name
    for name in ("LocalCluster", "DriverProcess", "run_job", "session_for", "ZombieCommit"):
        assert name in chaos_api.__all__
    for name in chaos_api.__all__:
        obj = getattr(chaos_api, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, stateful_async.StatefulAsyncError), name
