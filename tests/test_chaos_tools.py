"""The chaos tools that need no Spark: fault wrappers on real snapshot stores, and the
driver-process bookkeeping on real child processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from checkpoint import SnapshotStore, SubtaskLog, _faults
from stateful_async import AsyncFunction, ConfigurationError, StreamRecord
from stateful_async.chaos import (
    ChaosCheckError,
    ClusterError,
    CrashDuringCommit,
    CrashOnElement,
    DelayCommit,
    DriverProcess,
    FaultSpec,
    JobOptions,
    JobReport,
    LocalCluster,
    TaskAttempt,
    ZombieCommit,
    _cluster,
    _job,
    check_snapshot_store,
    compare_outputs,
    read_table_rows,
    to_argv,
)
from stateful_async.chaos import cluster as cluster_module
from stateful_async.chaos._job import main as job_main
from stateful_async.chaos._job import parse_args
from stateful_async.chaos.cluster import main as cluster_main

SCHEMA = pa.schema([("id", pa.int64())])


async def enrich(row: dict) -> list[dict]:
    return [row]


def commit(log: SubtaskLog, checkpoint_id: int) -> None:
    log.commit(
        "run",
        checkpoint_id,
        [StreamRecord({"id": 7}, 0)],
        [{"id": checkpoint_id}],
        input_schema=SCHEMA,
        output_schema=SCHEMA,
        position=checkpoint_id,
    )


# A process that commits checkpoint 1 through a log at a file: URI, with CrashDuringCommit
# armed for it (outside Spark it counts as attempt 0 of partition 0): the process dies.
CRASH_AT_A_FILE_URI = textwrap.dedent(
    """
    import asyncio, sys
    sys.path.insert(0, sys.argv[2])
    from checkpoint import SubtaskLog
    from stateful_async.chaos import CrashDuringCommit
    from test_chaos_tools import commit, enrich

    fault = CrashDuringCommit(enrich, checkpoint_id=1)
    asyncio.run(fault.open())
    commit(SubtaskLog(sys.argv[1], "job", "op", 0), 1)
    print("committed")  # never reached: the commit kills the process
    """
)


def test_crash_during_commit_leaves_its_orphan_file_in_a_file_uri_tables_directory(
    tmp_path: Path,
) -> None:
    table = tmp_path / "checkpoints" / "job" / "op" / "subtask=0"
    crashed = subprocess.run(
        [sys.executable, "-c", CRASH_AT_A_FILE_URI, f"file://{table}", str(Path(__file__).parent)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert crashed.returncode == 1, crashed.stderr
    assert "committed" not in crashed.stdout
    # The orphan lies in the table's directory, and the Delta log never took it ...
    [orphan] = table.glob("part-00000-*-c000.snappy.parquet")
    assert not (table / "_delta_log").exists()
    # (ParquetFile: pyarrow 18's read_table takes subtask=0 in the path for a partition)
    assert pq.ParquetFile(orphan).read().column("checkpoint_id").to_pylist()[0] == 1
    # ... not under a directory named after the URI's scheme, relative to the cwd.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


def test_crash_during_commit_refuses_a_remote_checkpoint_location(s3) -> None:
    fault = CrashDuringCommit(enrich, checkpoint_id=1)
    asyncio.run(fault.open())
    try:
        log = SnapshotStore(f"{s3.bucket()}/checkpoints", s3.options).subtask("job", "op", 0)
        with pytest.raises(
            ConfigurationError,
            match=r"CrashDuringCommit writes its orphan Parquet file on the local file system, "
            r"but checkpoint run:1 goes to s3://bucket\d+/checkpoints/job/op/subtask=0+\. Use "
            r"a local checkpoint location",
        ):
            commit(log, 1)
    finally:
        asyncio.run(fault.close())
    assert not _faults._hooks  # close() removed the hook


def test_crash_during_commit_lets_other_checkpoints_through(tmp_path: Path) -> None:
    fault = CrashDuringCommit(enrich, checkpoint_id=2)
    asyncio.run(fault.open())
    try:
        log = SnapshotStore(tmp_path).subtask("job", "op", 0)
        commit(log, 1)  # not the armed id: committed as usual, the process lives on
    finally:
        asyncio.run(fault.close())
    assert [m.checkpoint_id for m in log.checkpoints()] == [1]


# A driver that starts a long-lived child, prints its pid and exits at once, leaving the
# child running (re-parented, still in the driver's session).
LEAVES_A_CHILD = textwrap.dedent(
    """
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(child.pid, flush=True)
    """
)


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its parent counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_driver_that_exited_still_accounts_for_the_processes_it_left(tmp_path: Path) -> None:
    driver = DriverProcess([sys.executable, "-c", LEAVES_A_CHILD], log_dir=tmp_path)
    assert driver.wait(timeout=60) == 0
    child = psutil.Process(int(driver.stdout().split()[0]))
    try:
        assert not gone(child.pid) and child.ppid() != driver.pid  # orphaned, running
        assert driver.pids() == [child.pid]  # the leak is seen ...
        assert driver._watchdog is not None  # (still guarded, should this process die)
        assert driver.kill() == [child.pid]  # ... and ended
        assert driver._watchdog is None  # nothing left to guard
        assert gone(child.pid)
        assert driver.pids() == []
    finally:
        if not gone(child.pid):
            child.kill()  # the process this test started, by pid, whatever the outcome


@pytest.mark.parametrize("argv", ["python -c pass", [], b"python"])
def test_a_driver_argv_that_is_no_list_of_arguments_is_refused(tmp_path: Path, argv: Any) -> None:
    # before: a str ran its first letter ('p': FileNotFoundError), [] raised IndexError
    with pytest.raises(ClusterError, match="the program and its arguments as a list"):
        DriverProcess(argv, log_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written


def test_a_driver_log_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    # before: a bare FileExistsError from mkdir
    (tmp_path / "logs").write_text("")
    with pytest.raises(ClusterError, match="log_dir .* is a file, not a directory"):
        DriverProcess([sys.executable, "-c", "pass"], log_dir=tmp_path / "logs")


def test_killing_a_running_driver_kills_the_processes_it_started(tmp_path: Path) -> None:
    code = LEAVES_A_CHILD + "import time; time.sleep(300)\n"  # ... and the driver runs on
    driver = DriverProcess([sys.executable, "-c", code], log_dir=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not driver.stdout().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(driver.stdout().split()[0])
        assert driver.pids() == sorted([driver.pid, child])
        assert driver.kill() == sorted([driver.pid, child])
        assert driver.returncode == -9 and gone(child)
        assert driver.pids() == []
    finally:
        driver.kill()


def test_a_session_whose_driver_pid_was_reused_is_not_the_driver_s(tmp_path: Path) -> None:
    # Before, once a driver's session had emptied and its pid named a new session leader
    # (another driver, a cluster daemon), the old driver's pids(), kill() and its watchdog
    # at the test process's exit took that session for the driver's and SIGKILLed it.
    leader = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        started = psutil.Process(leader.pid).create_time()
        old_driver = _cluster.ProcessRecord(leader.pid, started - 5)  # its pid, reused
        assert _cluster._session_processes(old_driver) == []
        _cluster._kill_for_dead_owner(old_driver.pid, old_driver.create_time)
        assert leader.poll() is None
    finally:
        leader.kill()
        leader.wait()


def test_a_driver_s_watchdog_leaves_once_its_session_is_gone(tmp_path: Path) -> None:
    # Before, a watchdog kept by wait() (the driver's JVM still shutting down) stayed until
    # the test process exited, and then killed whatever session the driver's pid named.
    code = LEAVES_A_CHILD.replace("time.sleep(300)", "time.sleep(2)")
    driver = DriverProcess([sys.executable, "-c", code], log_dir=tmp_path)
    try:
        assert driver.wait(timeout=60) == 0
        watchdog = driver._watchdog
        assert watchdog is not None  # the child runs on for a while
        _cluster.wait_until(
            lambda: watchdog.poll() is not None, 30, "The watchdog outlived the session"
        )
        assert watchdog.returncode == 0 and driver.pids() == []
    finally:
        driver.kill()
    assert driver._watchdog is None


# A test process that starts a driver (which starts a child and sleeps), prints the
# driver's pid and the child's, and then sleeps until it is killed.
OWNS_A_DRIVER = textwrap.dedent(
    """
    import sys, time
    from stateful_async.chaos import DriverProcess
    driver = DriverProcess(
        [sys.executable, "-c", sys.argv[2] + "import time; time.sleep(300)\\n"],
        log_dir=sys.argv[1],
    )
    while not driver.stdout().strip():
        time.sleep(0.05)
    print(driver.pid, driver.stdout().split()[0], flush=True)
    time.sleep(300)
    """
)


def test_a_driver_whose_test_process_was_killed_is_killed_with_what_it_started(
    tmp_path: Path,
) -> None:
    # Before, a test process SIGKILLed (a timeout's kill -9, an OOM kill) left its driver
    # running its Spark job, with the driver's JVM and Python workers, for ever. Its
    # watchdog now holds a pipe from the test process and kills the driver's session.
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNS_A_DRIVER, str(tmp_path), LEAVES_A_CHILD],
        stdout=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        assert owner.stdout is not None
        pids = [int(pid) for pid in owner.stdout.readline().split()]
        assert len(pids) == 2 and not any(gone(pid) for pid in pids)
        owner.kill()
        assert owner.wait(timeout=30) == -9
        _cluster.wait_until(
            lambda: all(gone(pid) for pid in pids), 60, "The driver outlived its test process"
        )
    finally:
        owner.kill()
        owner.wait(timeout=30)
        for pid in pids:  # the processes this test started, by pid, had nothing killed them
            if not gone(pid):
                psutil.Process(pid).kill()


def test_a_cluster_whose_start_failed_leaves_no_directory_or_exit_hook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Spark installation without bin/spark-class: the master cannot even be launched.
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))
    hooks: list[object] = []
    monkeypatch.setattr(_cluster.atexit, "register", hooks.append)
    monkeypatch.setattr(_cluster.atexit, "unregister", hooks.remove)
    cluster = LocalCluster(1)
    with pytest.raises(ClusterError, match="Cannot start the Spark master with .*spark-class"):
        cluster.start()
    assert cluster.base_dir is not None and not cluster.base_dir.exists()  # its temp dir
    assert hooks == []
    assert cluster.stop() == []  # and stopping again does nothing


def fake_spark_class(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    """A Spark installation whose bin/spark-class runs the shell ``script``."""
    spark = tmp_path / "spark"
    (spark / "bin").mkdir(parents=True)
    (spark / "bin" / "spark-class").write_text(f"#!/bin/sh\n{script}\n")
    (spark / "bin" / "spark-class").chmod(0o755)
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(spark))


def test_a_failed_start_shows_only_what_its_own_daemons_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, the message quoted the end of every log in the directory, which every run
    # there appends to: an earlier cluster's worker logs, and its master's last lines.
    fake_spark_class(tmp_path, monkeypatch, "echo 'this run: no Java here'; exit 1")
    logs = tmp_path / "cluster" / "logs"
    logs.mkdir(parents=True)
    for name in ("master", "worker-0", "worker-1"):
        (logs / f"{name}.log").write_text(f"{name} of an earlier run\n")
    cluster = LocalCluster(2, base_dir=tmp_path / "cluster", stop_at_exit=False)
    with pytest.raises(ClusterError) as info:
        cluster.start()
    assert re.fullmatch(
        # (exited "at once" if it has already when its launch is checked)
        rf"The Spark master (\(pid \d+\) )?exited (at once )?with code 1\. Daemon logs:\n"
        rf"--- {re.escape(str(logs / 'master.log'))} ---\nthis run: no Java here",
        str(info.value),
    ), str(info.value)


def test_a_daemon_that_died_of_an_exception_is_shown_with_the_exception_not_its_frames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, the message quoted the log's last 15 lines: with daemon_memory="3m", 15 of
    # the 30 stack frames below "java.lang.OutOfMemoryError: Java heap space", not it.
    frames = "; ".join(f"echo '\tat java.base/Frame{i}.load(Frame.java:{i})'" for i in range(30))
    fake_spark_class(
        tmp_path,
        monkeypatch,
        "echo 'Error: A JNI error has occurred'; "
        "echo 'Exception in thread \"main\" java.lang.OutOfMemoryError: Java heap space'; "
        f"{frames}; echo '\t... 12 more'; exit 1",
    )
    with pytest.raises(ClusterError) as info:
        LocalCluster(1, base_dir=tmp_path / "cluster", stop_at_exit=False).start()
    assert str(info.value).endswith(
        "master.log ---\nError: A JNI error has occurred\n"
        'Exception in thread "main" java.lang.OutOfMemoryError: Java heap space'
    ), str(info.value)


def test_a_second_start_in_the_same_directory_while_one_is_starting_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, both starts found no state file and both launched a cluster; the second's
    # state file replaced the first's, so `cluster stop` never stopped the first's daemons.
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))
    starting = threading.Event()
    release = threading.Event()
    masters: list[str] = []

    def fake_start_master(self: LocalCluster, deadline: float) -> None:
        # stands for launching the master (no Spark here): the first start stays in it
        # until the test lets it go, then fails as a master that exits would
        masters.append(threading.current_thread().name)
        if len(masters) == 1:
            starting.set()
            release.wait(timeout=60)
        raise ClusterError("no master in this test")

    monkeypatch.setattr(LocalCluster, "_start_master", fake_start_master)
    state = tmp_path / "cluster"
    first_error: list[BaseException] = []

    def first_start() -> None:
        try:
            LocalCluster(1, base_dir=state, stop_at_exit=False).start()
        except BaseException as exc:
            first_error.append(exc)

    first = threading.Thread(target=first_start, name="first")
    first.start()
    try:
        assert starting.wait(timeout=60)
        with pytest.raises(
            ClusterError,
            match=rf"Another process \(pid {os.getpid()}\) is starting a cluster or a worker "
            rf"in {re.escape(str(state))} right now .*Wait until it is done and see what runs",
        ):
            LocalCluster(1, base_dir=state, stop_at_exit=False).start()
        assert masters == ["first"]  # the second launched nothing
    finally:
        release.set()
        first.join(timeout=60)
    assert [str(e) for e in first_error] == ["no master in this test"]
    # the lock went with the first start: a start now gets as far as its master
    with pytest.raises(ClusterError, match="no master in this test"):
        LocalCluster(1, base_dir=state, stop_at_exit=False).start()
    assert masters == ["first", "MainThread"]
    assert not (state / "cluster.json").exists()


def test_a_worker_is_not_started_again_while_another_start_holds_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, two `start-worker 1` at once both found worker 1 dead and both launched one;
    # the state file kept the second, and `cluster stop` left the first running.
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))  # no spark-class
    state = tmp_path / "cluster"
    (state / "logs").mkdir(parents=True)
    with a_recorded_daemon(state):  # the master runs; worker 0 does not
        cluster = LocalCluster.attach(state)
        holder = LocalCluster.attach(state)._lock_start()  # another start-worker, mid-way
        try:
            with pytest.raises(
                ClusterError,
                match=rf"Another process \(pid {os.getpid()}\) is starting a cluster or a "
                rf"worker in {re.escape(str(state))} right now",
            ):
                cluster.start_worker(0)
        finally:
            holder.close()
        # once it is done, the worker is launched (and here fails: there is no spark-class)
        with pytest.raises(ClusterError, match="Cannot start the Spark worker-0 with"):
            cluster.start_worker(0)


def test_a_worker_is_not_started_in_a_cluster_whose_master_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, start_worker launched a worker JVM that could never register (no master to
    # register with) and only then failed, saying the master was not running but not what to
    # do; the worker ran on meanwhile, retrying for minutes a master that was gone.
    launched: list[int] = []
    monkeypatch.setattr(LocalCluster, "_launch_worker", lambda self, index: launched.append(index))
    dead = {"pid": exited_pid(), "create_time": 0.0}  # names no live process
    (tmp_path / "logs").mkdir()
    (tmp_path / "cluster.json").write_text(json.dumps(recorded_cluster(dead, dead)))
    cluster = LocalCluster.attach(tmp_path)
    started = time.monotonic()
    with pytest.raises(ClusterError) as refused:
        cluster.start_worker(0, timeout=60)
    assert time.monotonic() - started < 10
    assert str(refused.value).startswith(
        f"Cannot start worker 0: the Spark master (pid {dead['pid']}) is not running. No "
        "worker can join a cluster whose master is gone: stop the cluster (python -m "
        f"stateful_async.chaos.cluster stop --dir {tmp_path}) and start a new one. Daemon logs:"
    )
    assert launched == []


def test_a_stop_waits_for_a_start_holding_the_directory_then_stops_what_it_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, a stop during a start killed what the state file named and removed it at
    # once; the start then recorded its cluster again, and nothing stopped its daemons.
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))
    dead = {"pid": exited_pid(), "create_time": 0.0}
    state = tmp_path / "cluster"
    state.mkdir()
    (state / "cluster.json").write_text(json.dumps(recorded_cluster(dead, dead)))
    holder = LocalCluster.attach(state)._lock_start()  # a start, mid-way
    cluster = LocalCluster.attach(state)  # read before the start is done
    stopped: list[int] = []
    waited: list[str] = []
    stopping = threading.Thread(
        target=lambda: stopped.extend(cluster.stop(timeout=10, wait=60, on_wait=waited.append))
    )
    started = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stopping.start()
        time.sleep(1.0)
        assert stopping.is_alive() and (state / "cluster.json").exists()
        assert waited == [str(os.getpid())]
        # the start records the worker it launched meanwhile, and is done
        live = {"pid": started.pid, "create_time": psutil.Process(started.pid).create_time()}
        (state / "cluster.json").write_text(json.dumps(recorded_cluster(dead, live)))
        holder.close()
        stopping.join(timeout=60)
        assert not stopping.is_alive()
        assert stopped == [started.pid]  # what the start recorded, not what attach() read
        assert started.wait(timeout=30) is not None
        assert not (state / "cluster.json").exists()
    finally:
        holder.close()
        started.kill()
        started.wait(timeout=30)


def test_a_stop_while_a_start_holds_the_directory_too_long_stops_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))
    record_dead_cluster(tmp_path)
    holder = LocalCluster.attach(tmp_path)._lock_start()  # a start that goes on
    try:
        with pytest.raises(
            ClusterError,
            match=rf"A start of a cluster or a worker in {re.escape(str(tmp_path))} is still "
            rf"running in another process \(pid {os.getpid()}\) after 0.3 s .*so nothing was "
            r"stopped.*Run stop again once it is done",
        ):
            LocalCluster.attach(tmp_path).stop(wait=0.3)
        assert (tmp_path / "cluster.json").exists()
        # the command line says it waits, and then the same
        assert cluster_main(["stop", "--wait", "0.3", "--dir", str(tmp_path)]) == 1
        err = capsys.readouterr().err
        assert f"waiting for the start running in {tmp_path} (pid {os.getpid()})" in err
        assert "is still running in another process" in err
        assert (tmp_path / "cluster.json").exists()
    finally:
        holder.close()
    assert cluster_main(["stop", "--dir", str(tmp_path)]) == 0, capsys.readouterr().err
    assert not (tmp_path / "cluster.json").exists()


def test_cluster_stop_holds_the_directory_from_its_wait_until_it_has_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, 'cluster stop' waited for a running start, let the lock go, read cluster.json
    # and had stop() wait again: a start begun in between was waited for a second time
    # (up to twice --wait in all), and could record a cluster the stop did not read.
    import fcntl

    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))
    record_dead_cluster(tmp_path)
    attach = LocalCluster.attach.__func__  # type: ignore[attr-defined]
    lock_free: list[bool] = []  # at each attach(): could a start take the lock?

    def attach_seeing_the_lock(cls: type[LocalCluster], base_dir: Path) -> LocalCluster:
        with open(base_dir / "cluster.lock", "a+") as other:
            try:
                fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                lock_free.append(True)
            except BlockingIOError:
                lock_free.append(False)
        return attach(cls, base_dir)  # type: ignore[no-any-return]

    monkeypatch.setattr(LocalCluster, "attach", classmethod(attach_seeing_the_lock))
    assert cluster_main(["stop", "--wait", "5", "--dir", str(tmp_path)]) == 0
    assert "stopped 0 processes" in capsys.readouterr().out
    # the first read (for the cluster's settings) comes before the wait; the one whose
    # cluster is stopped comes after it, with the lock held, as the stop itself
    assert lock_free == [True, False]
    assert not (tmp_path / "cluster.json").exists()


def test_a_start_or_a_stop_finding_a_stop_at_work_says_it_is_a_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # cluster.lock named a stop's pid alone, as a start's: a start refused while a stop ran
    # said another process "is starting a cluster", and a stop waiting for it called it a
    # start that "would be recorded again after the stop".
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))
    record_dead_cluster(tmp_path)
    refused: list[str] = []
    stop_locked = LocalCluster._stop_locked

    def start_during_the_stop(self: LocalCluster, timeout: float) -> list[int]:
        with pytest.raises(ClusterError) as info:
            LocalCluster(1, base_dir=tmp_path, stop_at_exit=False).start()
        refused.append(str(info.value))
        return stop_locked(self, timeout)

    monkeypatch.setattr(LocalCluster, "_stop_locked", start_during_the_stop)
    assert cluster_main(["stop", "--dir", str(tmp_path)]) == 0
    assert refused == [
        f"Another process (pid {os.getpid()}) is stopping the cluster in {tmp_path} right "
        f"now ({tmp_path / 'cluster.lock'} is locked). Wait until it is done and see what "
        f"runs (python -m stateful_async.chaos.cluster status --dir {tmp_path}), or use "
        "another directory."
    ]
    monkeypatch.undo()

    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))
    record_dead_cluster(tmp_path)
    holder = LocalCluster.attach(tmp_path)._lock_start(wait=0)  # a stop that goes on
    try:
        assert cluster_main(["stop", "--wait", "0.3", "--dir", str(tmp_path)]) == 1
    finally:
        holder.close()
    err = capsys.readouterr().err
    assert f"waiting for the stop running in {tmp_path} (pid {os.getpid()}) to be done" in err
    assert (
        f"error: A stop of the cluster in {tmp_path} is still running in another process "
        f"(pid {os.getpid()}) after 0.3 s ({tmp_path / 'cluster.lock'} is locked). Wait until "
        f"it is done and see what runs (python -m stateful_async.chaos.cluster status --dir "
        f"{tmp_path}).\n"
    ) in err
    assert (tmp_path / "cluster.json").exists()  # this stop stopped nothing


def usage_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The message the cluster command exits with, status 2 (argparse's), for ``args``."""
    with pytest.raises(SystemExit) as info:
        cluster_main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    prefix = f"python -m stateful_async.chaos.cluster {args[0]}: error: "
    assert prefix in err and err.endswith("\n"), err
    return err[err.rindex(prefix) + len(prefix) : -1]


def record_dead_cluster(state: Path, **settings: Any) -> None:
    """Write ``state``/cluster.json for a cluster whose master and worker have exited, with
    ``settings`` in place of the recorded ones."""
    dead = {"pid": exited_pid(), "create_time": 0.0}
    recorded = recorded_cluster(dead, dead)
    recorded["settings"].update(settings)
    (state / "cluster.json").write_text(json.dumps(recorded))


def hold_as_a_start(state: Path, gives_up_at: float) -> Any:
    """cluster.lock held as a start does, naming this pid and the time it gives up by."""
    holder = LocalCluster.attach(state)._lock_start()
    holder.seek(0)
    holder.truncate()
    holder.write(f"{os.getpid()} {gives_up_at:.3f}")
    holder.flush()
    return holder


def stop_command_failing(state: Path, holder: Any, capsys: pytest.CaptureFixture[str]) -> str:
    """Run `cluster stop --dir state` while ``holder`` holds the lock; assert it exits 1
    (within 20 s), release the lock, and return what it wrote to stderr."""
    codes: list[int] = []
    stopping = threading.Thread(
        target=lambda: codes.append(cluster_main(["stop", "--dir", str(state)])), daemon=True
    )
    try:
        stopping.start()
        stopping.join(timeout=20)
        assert codes == [1]
    finally:
        holder.close()
    return capsys.readouterr().err


def test_a_start_writes_in_its_lock_the_time_it_gives_up_by(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, the lock named the start's pid alone, so a stop waiting for it could only
    # assume the default --timeout (180 s): it gave up on a longer start while it ran.
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))
    seen: list[str] = []

    def fake_start_master(self: LocalCluster, deadline: float) -> None:
        seen.append((tmp_path / "cluster.lock").read_text())
        raise ClusterError("no master in this test")

    monkeypatch.setattr(LocalCluster, "_start_master", fake_start_master)
    before = time.time()
    with pytest.raises(ClusterError, match="no master in this test"):
        LocalCluster(1, base_dir=tmp_path, startup_timeout=600, stop_at_exit=False).start()
    pid, gives_up_at = seen[0].split()
    assert pid == str(os.getpid())
    assert before + 600 - 0.001 <= float(gives_up_at) <= time.time() + 600  # (to the ms)


def test_a_stop_waits_for_a_start_as_long_as_the_start_says_it_may_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, the stop waited its own startup_timeout plus timeout (here 0.5 s), and gave
    # up on a start that says it goes on for 2 s more.
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))
    record_dead_cluster(tmp_path)
    holder = hold_as_a_start(tmp_path, time.time() + 2.0)
    cluster = LocalCluster.attach(tmp_path)
    cluster.startup_timeout = 0.2
    outcome: list[Any] = []

    def stop() -> None:
        try:
            outcome.append(cluster.stop(timeout=0.3))
        except ClusterError as exc:
            outcome.append(exc)

    stopping = threading.Thread(target=stop, daemon=True)
    try:
        stopping.start()
        time.sleep(1.2)
        assert stopping.is_alive(), outcome  # still waiting for the start
        holder.close()
        stopping.join(timeout=30)
        assert outcome == [[]]  # then stopped (nothing ran)
        assert not (tmp_path / "cluster.json").exists()
    finally:
        holder.close()


def test_a_stop_gives_up_on_a_start_past_the_time_it_said_it_would_give_up_by(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A start 60 s past its own time (hung): `cluster stop` waited 195 s for it whatever
    # the start's --timeout; now 15 s past that time at most (here: not at all).
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))
    record_dead_cluster(tmp_path)
    holder = hold_as_a_start(tmp_path, time.time() - 60)
    err = stop_command_failing(tmp_path, holder, capsys)
    assert (
        f"is still running in another process (pid {os.getpid()}) after 0 s, 60 s past the "
        "time it said it would give up by" in err
    ), err
    assert (tmp_path / "cluster.json").exists()  # nothing stopped


def test_the_stop_command_waits_for_a_start_naming_no_time_as_the_cluster_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, 'cluster stop' waited a fixed 195 s (180 + 15) for a lock naming no time to
    # give up by (an older version's start, or another stop) before reading cluster.json,
    # whatever startup_timeout the cluster recorded; stop() waits that timeout + 15 s.
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))
    monkeypatch.setattr(cluster_module, "_STOP_MARGIN", 0.5)  # stop()'s timeout, not 15 s
    record_dead_cluster(tmp_path, startup_timeout=1.0)
    holder = LocalCluster.attach(tmp_path)._lock_start()  # names its pid alone
    err = stop_command_failing(tmp_path, holder, capsys)
    assert f"is still running in another process (pid {os.getpid()}) after 1.5 s" in err, err
    assert (tmp_path / "cluster.json").exists()  # nothing stopped


def test_a_stop_reads_a_lock_once_more_before_giving_up_on_the_time_it_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A start that has just taken the lock has not yet written its own pid and time over
    # its predecessor's: the stop gave up at once on that old time, naming the old pid.
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))
    record_dead_cluster(tmp_path)
    holder = hold_as_a_start(tmp_path, time.time() - 60)  # the predecessor's, 60 s ago
    cluster = LocalCluster.attach(tmp_path)
    polls: list[float] = []

    def poll(seconds: float) -> None:  # the new start writes, then is done
        polls.append(seconds)
        if len(polls) == 1:
            holder.seek(0)
            holder.truncate()
            holder.write(f"{os.getpid()} {time.time() + 5:.3f}")
            holder.flush()
        else:
            holder.close()

    class PollingTime:  # the time module as _cluster sees it, but for its sleep
        sleep = staticmethod(poll)

        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

    monkeypatch.setattr(_cluster, "time", PollingTime())
    try:
        assert cluster.stop(timeout=0.3) == []  # waited, then stopped (nothing ran)
    finally:
        monkeypatch.undo()
        holder.close()
    assert len(polls) == 2, polls
    assert not (tmp_path / "cluster.json").exists()


WAIT_FORM = (
    "{name} must be a finite number of seconds, 0 or more, the time to wait for a start "
    "running in the cluster's directory to be done; got {value}. Leave it out to wait as "
    "long as that start may take."
)
STOP_TIMEOUT_FORM = (
    "timeout must be a finite number of seconds above 0, the time the processes get to exit "
    "after SIGTERM, then SIGKILL; got {value}."
)


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_stop_wait_no_stop_can_wait_for_is_refused_before_anything_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    # Before, 'cluster stop --wait nan' failed at once "after nan s", a negative --wait
    # waited not at all, and stop(wait=...) took them alike.
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))
    record_dead_cluster(tmp_path)
    assert usage_error(["stop", "--dir", str(tmp_path), "--wait", value], capsys) == (
        WAIT_FORM.format(name="--wait", value=float(value))
    )
    cluster = LocalCluster.attach(tmp_path)
    for bad in (float(value), "30", True):
        with pytest.raises(ClusterError) as refused:
            cluster.stop(wait=bad)  # type: ignore[arg-type]
        assert str(refused.value) == WAIT_FORM.format(name="wait", value=repr(bad))
    for bad in (0, -1.0, math.nan, math.inf):
        with pytest.raises(ClusterError) as refused:
            cluster.stop(timeout=bad)
        assert str(refused.value) == STOP_TIMEOUT_FORM.format(value=repr(bad))
    assert (tmp_path / "cluster.json").exists()  # nothing stopped
    assert cluster.stop(wait=0) == []  # no start runs: 0 is no wait at all
    assert not (tmp_path / "cluster.json").exists()


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, "30", True])
def test_a_fault_timeout_no_kill_or_start_can_wait_for_is_refused_before_anything_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: Any
) -> None:
    # Before, kill_worker(0, timeout=nan) SIGKILLed the worker, then waited a NaN time for
    # it; start_worker(0, timeout=0) took startup_timeout; a negative timeout, no time at all.
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        record = {"pid": worker.pid, "create_time": psutil.Process(worker.pid).create_time()}
        dead = {"pid": exited_pid(), "create_time": 0.0}
        (tmp_path / "cluster.json").write_text(json.dumps(recorded_cluster(dead, record)))
        cluster = LocalCluster.attach(tmp_path)
        for call, purpose in [
            (cluster.kill_executor, "the time the executor gets to exit after SIGKILL"),
            (
                lambda timeout: cluster.kill_worker(0, timeout=timeout),
                "the time the worker and what it launched get to exit after SIGKILL",
            ),
            (
                lambda timeout: cluster.start_worker(0, timeout=timeout),
                "the time the worker gets to start",
            ),
        ]:
            with pytest.raises(ClusterError) as refused:
                call(timeout=value)
            assert str(refused.value) == (
                f"timeout must be a finite number of seconds above 0, {purpose}; got {value!r}."
            )
        assert worker.poll() is None  # not killed
        assert not (tmp_path / "cluster.lock").exists()  # nor locked by a start
    finally:
        worker.kill()
        worker.wait(timeout=30)


WAIT_FOR_WORKERS_FORM = (
    "count must be a whole number from 1 to the cluster's number of workers, 1, the workers "
    "to wait for; got {value}."
)


def test_a_wait_for_workers_or_apps_that_cannot_end_is_refused_before_anything_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, wait_for_workers(1, timeout=0) silently took startup_timeout, a negative,
    # NaN or infinite timeout (and wait_for_no_active_apps's) was waited as given, and a
    # count of 0, of more workers than the cluster has or True was not checked.
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))
    record_dead_cluster(tmp_path)
    cluster = LocalCluster.attach(tmp_path)
    cluster.startup_timeout = 42.0
    waits: list[float] = []

    def wait_until(condition: Any, timeout: float, message: str, interval: float = 0.1) -> None:
        waits.append(timeout)

    monkeypatch.setattr(_cluster, "wait_until", wait_until)
    for bad in (0, -1.0, math.nan, math.inf, "30", True):
        with pytest.raises(ClusterError) as refused:
            cluster.wait_for_workers(1, timeout=bad)
        assert str(refused.value) == (
            "timeout must be a finite number of seconds above 0, the time the workers get to "
            f"register; got {bad!r}."
        )
        with pytest.raises(ClusterError) as refused:
            cluster.wait_for_no_active_apps(timeout=bad)
        assert str(refused.value) == (
            "timeout must be a finite number of seconds above 0, the time the master gets to "
            f"end its applications; got {bad!r}."
        )
    for bad in (0, -1, True, 1.0, "1"):
        with pytest.raises(ClusterError) as refused:
            cluster.wait_for_workers(bad)  # type: ignore[arg-type]
        assert str(refused.value) == WAIT_FOR_WORKERS_FORM.format(value=repr(bad))
    with pytest.raises(ClusterError) as refused:
        cluster.wait_for_workers(2)
    assert str(refused.value) == (
        WAIT_FOR_WORKERS_FORM.format(value=2) + " For more workers, start a cluster with more."
    )
    assert waits == []  # nothing waited
    cluster.wait_for_workers(1)  # None: startup_timeout
    cluster.wait_for_workers(1, timeout=5)
    cluster.wait_for_no_active_apps()
    assert waits == [42.0, 5.0, 60.0]


def test_kill_executor_kills_only_the_process_it_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before, kill_executor looked the listed pid up again and killed whatever had it: an
    # executor that exited in between, its pid taken by another process, made it kill that.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        started = psutil.Process(other.pid).create_time()
        cluster = LocalCluster(1, stop_at_exit=False)
        gone = _cluster.ExecutorProcess(other.pid, "app-1", "3", 0, started - 5.0)
        monkeypatch.setattr(cluster, "executors", lambda app_id=None: [gone])
        with pytest.raises(ClusterError) as info:
            cluster.kill_executor()
        assert str(info.value) == (
            f"Executor 3 of app-1 (pid {other.pid}, worker 0) exited before it could be "
            "killed; nothing was killed. See which executors run now (cluster.executors(), "
            "or python -m stateful_async.chaos.cluster status) and kill one of them."
        )
        assert other.poll() is None  # the process that took its pid lives on
        listed = _cluster.ExecutorProcess(other.pid, "app-1", "3", 0, started)
        monkeypatch.setattr(cluster, "executors", lambda app_id=None: [listed])
        assert cluster.kill_executor(timeout=30) == listed  # the very process listed: killed
        assert not _cluster.ProcessRecord(other.pid, started).alive()
    finally:
        other.kill()
        other.wait(timeout=30)


def recorded_cluster(master: dict[str, Any], worker: dict[str, Any]) -> dict[str, Any]:
    """A cluster.json as start() writes it: a master and worker 0 with these records."""
    return {
        "master": master,
        "master_port": 3,
        "webui_port": 4,
        "workers": {
            "0": {
                "index": 0,
                "host": "127.0.0.1",
                "port": 1,
                "webui_port": 2,
                "work_dir": "w",
                "record": worker,
            }
        },
        "settings": {
            "workers": 1,
            "cores": 1,
            "memory": "1g",
            "hosts": ["127.0.0.1"],
            "python": sys.executable,
            "daemon_memory": "512m",
        },
    }


def exited_pid() -> int:
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait(timeout=60)
    return exited.pid


@contextlib.contextmanager
def a_recorded_daemon(base_dir: Path) -> Iterator[psutil.Process]:
    """A "daemon" recorded as the master of a cluster in ``base_dir``: a sleep that is not
    a child of this process, as the daemons of a dead owner are not (no zombie waiting to be
    reaped); killed at the end if nothing stopped it."""
    launcher = subprocess.run(
        ["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        check=True,
    )
    daemon = psutil.Process(int(launcher.stdout))
    try:
        record = {"pid": daemon.pid, "create_time": daemon.create_time()}
        gone = {"pid": exited_pid(), "create_time": 0.0}
        (base_dir / "cluster.json").write_text(json.dumps(recorded_cluster(record, gone)))
        yield daemon
    finally:
        if daemon.is_running():
            daemon.kill()


def test_a_cluster_is_stopped_by_its_watchdog_once_its_owner_is_gone_not_before(
    tmp_path: Path,
) -> None:
    # Before, a process that died without stop() (SIGKILL, an unhandled SIGTERM: no atexit)
    # left the daemons running. Its watchdog holds a pipe from it: closed, as the system
    # closes it when its holder dies, before stop() dismissed the watchdog, it stops the
    # cluster. A "daemon" here is a sleep recorded as the master (not a child of this
    # process, as the daemons of a dead owner are not: no zombie waiting to be reaped).
    with a_recorded_daemon(tmp_path) as daemon:
        owner = LocalCluster(1, base_dir=tmp_path, stop_at_exit=False)
        owner._start_watchdog()
        watchdog = owner._watchdog
        owner._dismiss_watchdog()  # what stop() does: the watchdog leaves, stopping nothing
        assert watchdog is not None and watchdog.returncode == 0
        assert daemon.is_running() and (tmp_path / "cluster.json").exists()

        owner._start_watchdog()
        assert owner._watchdog is not None and owner._watchdog.stdin is not None
        owner._watchdog.stdin.close()  # its owner died
        assert owner._watchdog.wait(timeout=60) == 0
        assert not daemon.is_running()
        assert not (tmp_path / "cluster.json").exists()


@contextlib.contextmanager
def a_child_forked_without_exec() -> Iterator[None]:
    """A child of this process, forked without exec (multiprocessing's fork), sleeping
    meanwhile; killed at the end."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(300,))
    child.start()
    try:
        yield
    finally:
        child.kill()
        child.join(timeout=30)


def test_a_cluster_is_stopped_by_its_watchdog_while_a_child_forked_by_its_owner_runs(
    tmp_path: Path,
) -> None:
    # Before, a child forked without exec held the watchdog's pipe open: its owner gone, the
    # cluster ran on until that child exited.
    with a_recorded_daemon(tmp_path) as daemon:
        owner = LocalCluster(1, base_dir=tmp_path, stop_at_exit=False)
        owner._start_watchdog()
        assert owner._watchdog is not None and owner._watchdog.stdin is not None
        with a_child_forked_without_exec():
            owner._watchdog.stdin.close()  # its owner died; its child lives on
            assert owner._watchdog.wait(timeout=60) == 0
            assert not daemon.is_running()


# An owner whose cluster's master is the test's recorded "daemon" (its start's master and
# workers stood in for), forking a child that ends normally, as a child of os.fork() does.
FORKING_OWNER = """\
import os, sys
from pathlib import Path
from stateful_async.chaos import LocalCluster
from stateful_async.chaos._cluster import ProcessRecord

base, daemon = Path(sys.argv[1]), ProcessRecord(int(sys.argv[2]), float(sys.argv[3]))

def start_master(self, deadline):
    self.master = daemon
    self._save()

LocalCluster._start_master = start_master
LocalCluster._launch_worker = lambda self, index: None
LocalCluster._wait_registered = lambda self, indexes, timeout: None
cluster = LocalCluster(1, base_dir=base).start()
child = os.fork()
if child == 0:
    sys.exit(0)  # atexit's functions run in it
os.waitpid(child, 0)
print("child ended", flush=True)
sys.stdin.readline()  # until the test has looked
"""


def test_a_child_forked_by_a_clusters_owner_does_not_stop_it_at_its_exit(tmp_path: Path) -> None:
    # Before, a child forked without exec that ended normally ran the stop() its parent had
    # registered with atexit: it stopped the parent's cluster under it.
    with a_recorded_daemon(tmp_path) as daemon:
        (tmp_path / "cluster.json").unlink()  # the owner's start writes it
        record = [str(daemon.pid), repr(daemon.create_time())]
        owner = subprocess.Popen(
            [sys.executable, "-c", FORKING_OWNER, str(tmp_path), *record],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert owner.stdin is not None and owner.stdout is not None
        try:
            assert owner.stdout.readline() == "child ended\n"
            assert daemon.is_running(), "the forked child's exit stopped its parent's cluster"
        finally:
            owner.stdin.close()  # the owner ends: its own exit stops the cluster
            assert owner.wait(timeout=120) == 0
        daemon.wait(timeout=60)
        assert not daemon.is_running()


def test_a_watchdog_that_cannot_stop_its_cluster_keeps_its_record_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, a stop that failed (processes surviving SIGKILL, a start holding the lock past
    # the wait) was printed to /dev/null, and a temporary directory was removed all the same:
    # cluster.json, the only record of the daemons that ran on, with it.
    from stateful_async.chaos._cluster import _stop_for_dead_owner

    (tmp_path / "cluster.json").write_text("{}")

    def failing_stop(self: LocalCluster, *args: object, **kwargs: object) -> list[int]:
        raise ClusterError("Cluster processes survived SIGKILL: [4242].")

    monkeypatch.setattr(LocalCluster, "attach", classmethod(lambda cls, base_dir: cls(1)))
    monkeypatch.setattr(LocalCluster, "stop", failing_stop)
    _stop_for_dead_owner(str(tmp_path), owned=True)
    assert (tmp_path / "cluster.json").exists()
    assert capsys.readouterr().err == (
        "stateful-async cluster watchdog: Cluster processes survived SIGKILL: [4242].\n"
    )
    # nothing recorded (a failed start stopped what it started): its directory goes
    (tmp_path / "cluster.json").unlink()
    _stop_for_dead_owner(str(tmp_path), owned=True)
    assert not tmp_path.exists()


def test_a_watchdog_logs_to_its_cluster_s_directory(tmp_path: Path) -> None:
    # before: its stderr was /dev/null, so why it stopped nothing was nowhere
    owner = LocalCluster(1, base_dir=tmp_path, stop_at_exit=False)
    owner._start_watchdog()
    assert owner._watchdog is not None and owner._watchdog.stdin is not None
    owner._watchdog.stdin.close()  # its owner died; no cluster.json: nothing to stop
    assert owner._watchdog.wait(timeout=60) == 0
    assert (
        (tmp_path / "logs" / "watchdog.log")
        .read_text()
        .startswith("stateful-async cluster watchdog: ")
    )


def test_a_watchdog_started_from_a_directory_holding_another_stateful_async_stops_its_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, the watchdog (python -c) had the working directory first on its path: a
    # stateful_async there (another checkout or version, here one without the watchdog's
    # function) was imported instead of this one, and the watchdog failed, silently (its
    # stderr is /dev/null), leaving the cluster running.
    elsewhere = tmp_path / "checkout"
    (elsewhere / "stateful_async" / "chaos").mkdir(parents=True)
    for module in ("__init__.py", "chaos/__init__.py", "chaos/_cluster.py"):
        (elsewhere / "stateful_async" / module).write_text("")
    monkeypatch.chdir(elsewhere)
    base_dir = tmp_path / "cluster"
    base_dir.mkdir()
    with a_recorded_daemon(base_dir) as daemon:
        owner = LocalCluster(1, base_dir=base_dir, stop_at_exit=False)
        owner._start_watchdog()
        assert owner._watchdog is not None and owner._watchdog.stdin is not None
        owner._watchdog.stdin.close()  # its owner died
        assert owner._watchdog.wait(timeout=60) == 0
        assert not daemon.is_running()


def test_a_state_file_with_missing_fields_is_refused_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, attach() (so every cluster command but start) failed with a KeyError traceback.
    state = recorded_cluster({"pid": exited_pid()}, {"pid": exited_pid(), "create_time": 0.0})
    del state["settings"]["cores"]
    del state["webui_port"]
    (tmp_path / "cluster.json").write_text(json.dumps(state))
    path = tmp_path / "cluster.json"
    message = (
        f"The cluster state file {path} cannot be used: it lacks master.create_time, "
        "webui_port, settings.cores. It was edited by hand or written by another version of "
        "stateful-async, and the cluster commands need all of it to find and stop the "
        f"cluster's processes. None of the processes it names is running: remove {path}. "
        f"Then start a new cluster (python -m stateful_async.chaos.cluster start --dir "
        f"{tmp_path})."
    )
    with pytest.raises(ClusterError) as info:
        LocalCluster.attach(tmp_path)
    assert str(info.value) == message
    for command in ("status", "stop", "kill-worker 0"):
        assert cluster_main([*command.split(), "--dir", str(tmp_path)]) == 1
        assert capsys.readouterr().err == f"error: {message}\n"  # no traceback
    assert path.exists()  # left for the user to look at


def test_a_state_file_with_wrong_values_is_refused_naming_them_and_its_running_processes(
    tmp_path: Path,
) -> None:
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        record = {"pid": daemon.pid, "create_time": psutil.Process(daemon.pid).create_time()}
        state = recorded_cluster(record, {"pid": daemon.pid})  # no start time
        state["settings"]["cores"] = "two"
        state["workers"]["first"] = {}
        (tmp_path / "cluster.json").write_text(json.dumps(state))
        path = tmp_path / "cluster.json"
        with pytest.raises(ClusterError) as info:
            LocalCluster.attach(tmp_path)
        assert str(info.value) == (
            f"The cluster state file {path} cannot be used: it lacks "
            "workers.0.record.create_time; it has a wrong value for workers.first (not a "
            'worker index), settings.cores ("two"). It was edited by hand or written by '
            "another version of stateful-async, and the cluster commands need all of it to "
            "find and stop the cluster's processes. Processes it names are running: "
            f"{daemon.pid} (the master), {daemon.pid} (worker 0, or another process that "
            "took its pid). Check that each is a Spark daemon of this cluster, stop it by "
            "hand (kill PID) with the executors it launched (their work directories are "
            f"under {tmp_path / 'work'}), then remove {path}. Then start a new cluster "
            f"(python -m stateful_async.chaos.cluster start --dir {tmp_path})."
        )
        assert daemon.poll() is None  # attach() stopped nothing
    finally:
        daemon.kill()
        daemon.wait(timeout=60)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("[]", "it has a wrong value for the file's content (not a JSON object)"),
        (
            json.dumps({**recorded_cluster({"pid": 1}, {}), "master": None, "workers": []}),
            "it has a wrong value for master (not a JSON object), workers (not a JSON object)",
        ),
    ],
    ids=["a list", "null records"],
)
def test_a_state_file_of_the_wrong_shape_is_refused(
    tmp_path: Path, content: str, problem: str
) -> None:
    (tmp_path / "cluster.json").write_text(content)
    with pytest.raises(ClusterError) as info:
        LocalCluster.attach(tmp_path)
    assert str(info.value).startswith(
        f"The cluster state file {tmp_path / 'cluster.json'} cannot be used: {problem}. "
    )
    assert str(info.value).endswith(
        f"None of the processes it names is running: remove {tmp_path / 'cluster.json'}. "
        f"Then start a new cluster (python -m stateful_async.chaos.cluster start --dir "
        f"{tmp_path})."
    )


def test_a_state_file_whose_settings_are_refused_says_so_naming_the_file(
    tmp_path: Path,
) -> None:
    state = recorded_cluster(
        {"pid": exited_pid(), "create_time": 0.0}, {"pid": exited_pid(), "create_time": 0.0}
    )
    state["settings"]["workers"] = 0
    (tmp_path / "cluster.json").write_text(json.dumps(state))
    with pytest.raises(ClusterError) as info:
        LocalCluster.attach(tmp_path)
    assert str(info.value).startswith(
        f"The cluster state file {tmp_path / 'cluster.json'} cannot be used: its settings "
        "are refused (A cluster needs at least one worker: workers must be a whole number "
        "of at least 1; got 0). It was edited"
    )


def test_a_state_file_whose_records_have_fields_this_version_does_not_know_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # attach() checks the fields it needs and ignores others at the top and in settings,
    # but passed each record whole to ProcessRecord / WorkerInfo: a field of another
    # version's made every cluster command fail with a TypeError traceback.
    master, worker = exited_pid(), exited_pid()
    state = recorded_cluster(
        {"pid": master, "create_time": 0.0}, {"pid": worker, "create_time": 0.0}
    )
    state["master"]["role"] = "master"
    state["workers"]["0"]["cores"] = 1
    state["workers"]["0"]["record"]["cmdline"] = ["java"]
    (tmp_path / "cluster.json").write_text(json.dumps(state))
    cluster = LocalCluster.attach(tmp_path)
    assert cluster.master == _cluster.ProcessRecord(master, 0.0)
    assert cluster.workers[0].record == _cluster.ProcessRecord(worker, 0.0)
    assert cluster.workers[0].port == 1
    assert cluster_main(["stop", "--dir", str(tmp_path)]) == 0, capsys.readouterr().err
    assert not (tmp_path / "cluster.json").exists()


@pytest.fixture
def a_running_process() -> Iterator[_cluster.ProcessRecord]:
    """A process that runs (a sleep this test started), named by its record."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        yield _cluster.ProcessRecord.of(process.pid)
    finally:
        process.kill()
        process.wait(timeout=30)


def test_a_cluster_started_with_a_timeout_keeps_it_for_the_commands_that_attach_to_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    a_running_process: _cluster.ProcessRecord,
) -> None:
    # Before, cluster.json did not record startup_timeout, so attach() (every command but
    # start) took the default: 'start-worker' allowed 180 s whatever 'start --timeout' was.
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))
    dead = _cluster.ProcessRecord(exited_pid(), 0.0)
    master = a_running_process  # start-worker refuses a cluster whose master is gone

    def fake_start_master(self: LocalCluster, deadline: float) -> None:
        self.master, self.master_port, self.webui_port = master, 3, 4
        self._save()

    def fake_launch_worker(self: LocalCluster, index: int) -> None:
        self.workers[index] = _cluster.WorkerInfo(index, "127.0.0.1", 1, 2, "w", dead)
        self._save()

    waited: list[float] = []
    monkeypatch.setattr(LocalCluster, "_start_master", fake_start_master)
    monkeypatch.setattr(LocalCluster, "_launch_worker", fake_launch_worker)
    monkeypatch.setattr(
        LocalCluster, "_wait_registered", lambda self, indices, timeout: waited.append(timeout)
    )
    state = tmp_path / "cluster"
    argv = ["--dir", str(state)]
    assert cluster_main(["start", "--workers", "1", "--timeout", "600", *argv]) == 0
    assert json.loads((state / "cluster.json").read_text())["settings"]["startup_timeout"] == 600
    assert LocalCluster.attach(state).startup_timeout == 600.0
    assert cluster_main(["start-worker", "0", *argv]) == 0, capsys.readouterr().err
    assert waited[-1] == 600.0  # the worker got what the cluster's start had, not 180 s
    # a cluster.json of a version that did not record it is read, with the default
    older = recorded_cluster(asdict(dead), asdict(dead))
    assert "startup_timeout" not in older["settings"]
    (state / "cluster.json").write_text(json.dumps(older))
    assert LocalCluster.attach(state).startup_timeout == 180.0
    # and one recorded wrong is refused, as every setting is
    older["settings"]["startup_timeout"] = "600"
    (state / "cluster.json").write_text(json.dumps(older))
    with pytest.raises(ClusterError, match=r'wrong value for settings\.startup_timeout \("600"\)'):
        LocalCluster.attach(state)
    older["settings"]["startup_timeout"] = -1
    (state / "cluster.json").write_text(json.dumps(older))
    with pytest.raises(ClusterError, match="its settings are refused .startup_timeout must be"):
        LocalCluster.attach(state)


MEMORY_FORM = (
    "must be a whole number with a unit, k, m, g, t or p (or kb .. pb; in any case), as a "
    "Spark worker reads an amount of memory, such as 512m or 2g; got"
)
BAD_CLUSTER_SETTINGS = [
    (
        "workers",
        0,
        "A cluster needs at least one worker: {name} must be a whole number of at least 1; got 0.",
    ),
    (
        "cores",
        0,
        "Each worker needs at least one core to offer executors: {name} must be a whole number "
        "of at least 1; got 0.",
    ),
    (
        "cores",
        -2,
        "Each worker needs at least one core to offer executors: {name} must be a whole number "
        "of at least 1; got -2.",
    ),
    # a worker counts its cores in 32 bits: past that it printed only its usage and exited
    (
        "cores",
        2**31,
        "{name} must be at most 2147483647, the most cores a Spark worker can count; got "
        "2147483648.",
    ),
    ("memory", "2x", f"{{name}} {MEMORY_FORM} '2x'."),
    ("memory", "2 g", f"{{name}} {MEMORY_FORM} '2 g'."),
    ("memory", "-1g", f"{{name}} {MEMORY_FORM} '-1g'."),
    (
        "memory",
        "1.5g",
        f"{{name}} {MEMORY_FORM} '1.5g'. Spark takes no fractions: use a smaller unit (1536m, "
        "not 1.5g).",
    ),
    (
        "memory",
        "1024",
        "{name} must be at least 1 MiB (1m), the least a Spark worker runs with; got '1024'. "
        "A number without a unit is bytes to Spark: did you mean 1024m?",
    ),
    (
        "memory",
        "0g",
        "{name} must be at least 1 MiB (1m), the least a Spark worker runs with; got '0g'.",
    ),
    (
        "memory",
        "2048t",
        "{name} must be below 2 PiB (2048t), the most a Spark worker can count; got '2048t'.",
    ),
]


@pytest.mark.parametrize(("setting", "value", "message"), BAD_CLUSTER_SETTINGS)
def test_a_cluster_setting_no_worker_can_run_with_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str, value: Any, message: str
) -> None:
    # Before, cores=0 or memory="1.5g" went unchecked onto the worker's command line,
    # found wrong (if at all) only by a worker already launched.
    assert_refused_at_once(tmp_path, monkeypatch, setting, value, message.format(name=setting))


def assert_refused_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str, value: Any, message: str
) -> None:
    """LocalCluster(setting=value) raises ClusterError(message) and makes no directory."""
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))  # no spark-class
    with pytest.raises(ClusterError) as info:
        LocalCluster(**{setting: value}, base_dir=tmp_path / "cluster", stop_at_exit=False)
    assert str(info.value) == message
    assert not (tmp_path / "cluster").exists()


@pytest.mark.parametrize(("setting", "value", "message"), BAD_CLUSTER_SETTINGS)
def test_a_cluster_option_no_worker_can_run_with_is_refused_before_anything_starts(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    setting: str,
    value: Any,
    message: str,
) -> None:
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))  # no spark-class
    state = tmp_path / "cluster"
    assert usage_error(["start", "--dir", str(state), f"--{setting}={value}"], capsys) == (
        message.format(name="--" + setting)
    )
    assert not state.exists()


HEAP_FORM = (
    "daemon_memory must be a whole number with a unit, k, m, g or t (in any case), as Java "
    "reads a heap size (-Xmx), such as 512m or 1g; got"
)
TIMEOUT_FORM = (
    "{name} must be a finite number of seconds above 0, the time the master and workers get "
    "to start; got {value}."
)


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("daemon_memory", "512mb", f"{HEAP_FORM} '512mb'."),  # Spark's form, not Java's
        ("daemon_memory", "-1g", f"{HEAP_FORM} '-1g'."),
        ("daemon_memory", "lots", f"{HEAP_FORM} 'lots'."),
        ("daemon_memory", "", f"{HEAP_FORM} ''."),
        (
            "daemon_memory",
            "1.5g",
            f"{HEAP_FORM} '1.5g'. Java takes no fractions: use a smaller unit (1536m, not 1.5g).",
        ),
        (
            "daemon_memory",
            512,
            f"{HEAP_FORM} 512. Pass it as a string with its unit: '512m' for 512 MiB.",
        ),
        # no such hint for a number of MiB refused as a heap size in its turn
        ("daemon_memory", 2, f"{HEAP_FORM} 2."),
        ("daemon_memory", 0, f"{HEAP_FORM} 0."),
        ("daemon_memory", -1, f"{HEAP_FORM} -1."),
        (
            "daemon_memory",
            "0m",
            "daemon_memory must be more than 2 MiB (2m), the least heap Java starts with; got "
            "'0m'.",
        ),
        (
            "daemon_memory",
            "512",
            "daemon_memory must be more than 2 MiB (2m), the least heap Java starts with; got "
            "'512'. A number without a unit is bytes to Java: did you mean 512m?",
        ),
        # Java counts a heap size in 64 bits: -Xmx99999999t is an "Invalid maximum heap size"
        (
            "daemon_memory",
            "99999999t",
            "daemon_memory must be below 16 EiB (16777216t), the most heap size Java can "
            "count; got '99999999t'.",
        ),
        (
            "daemon_memory",
            "17179869184g",  # 2**64 bytes
            "daemon_memory must be below 16 EiB (16777216t), the most heap size Java can "
            "count; got '17179869184g'.",
        ),
        # Java reads hex too (-Xmx0x10m is 16 MiB); not taken, but the decimal is given
        ("daemon_memory", "0x10m", f"{HEAP_FORM} '0x10m'. Write it in decimal: 16m for 0x10m."),
        ("daemon_memory", "0X1f4K", f"{HEAP_FORM} '0X1f4K'."),  # 500 KiB: no heap Java takes
        ("startup_timeout", 0, TIMEOUT_FORM.format(name="startup_timeout", value="0")),
        ("startup_timeout", -5.0, TIMEOUT_FORM.format(name="startup_timeout", value="-5.0")),
        ("startup_timeout", math.nan, TIMEOUT_FORM.format(name="startup_timeout", value="nan")),
        ("startup_timeout", math.inf, TIMEOUT_FORM.format(name="startup_timeout", value="inf")),
        ("startup_timeout", "30", TIMEOUT_FORM.format(name="startup_timeout", value="'30'")),
        ("startup_timeout", True, TIMEOUT_FORM.format(name="startup_timeout", value="True")),
    ],
)
def test_a_daemon_memory_or_startup_timeout_no_cluster_starts_with_is_refused_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str, value: Any, message: str
) -> None:
    # Before, neither was checked: the daemons were launched with -Xmx<daemon_memory> (and
    # exited, found wrong only in their logs), a startup_timeout of 0 or below gave the
    # daemons 1 s to start, and NaN or inf waited for ever.
    assert_refused_at_once(tmp_path, monkeypatch, setting, value, message)


def test_a_daemon_memory_is_taken_in_every_form_java_reads() -> None:
    for memory in ("512m", "1G", "3145728", "4096k", "1t", " 1g ", "010m", "17179869183g"):
        cluster = LocalCluster(1, daemon_memory=memory, stop_at_exit=False)
        assert cluster.daemon_memory == memory.strip()
    assert LocalCluster(1, startup_timeout=30, stop_at_exit=False).startup_timeout == 30.0


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_start_timeout_no_cluster_starts_with_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    # Before, 'cluster start --timeout 0' (or -5) launched the master and gave it 1 s to
    # start; --timeout nan or inf waited for ever.
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))  # no spark-class
    state = tmp_path / "cluster"
    assert usage_error(["start", "--dir", str(state), "--timeout", value], capsys) == (
        TIMEOUT_FORM.format(name="--timeout", value=float(value))
    )
    assert not state.exists()


def test_memory_is_taken_in_every_form_a_spark_worker_reads() -> None:
    # Spark's JavaUtils.byteStringAs: digits, then b, k, m, g, t, p (or kb .. pb) in any
    # case, blanks around trimmed; no unit is bytes.
    for memory in ("512m", "2G", "1gb", "1024K", "1048576", "1t", "1Pb", " 2g "):
        cluster = LocalCluster(1, memory=memory, stop_at_exit=False)
        assert cluster.memory == memory.strip()
    # an int has no unit: its likely ones are both offered (before, only '2048g': 2 TiB)
    unit = r"Pass it as a string with its unit: '2048m' for 2048 MiB, '2048g' for 2048 GiB\."
    with pytest.raises(ClusterError, match=unit):
        LocalCluster(1, memory=2048)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("where", "why"),
    [("file", "it is a file, not a directory"), ("file/cluster", "Not a directory")],
)
def test_a_cluster_directory_that_cannot_be_made_is_refused_naming_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    where: str,
    why: str,
) -> None:
    # Before, 'cluster start --dir FILE' (or a path under a file) ended in a traceback of
    # pathlib's FileExistsError or NotADirectoryError.
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(tmp_path))  # no spark-class
    (tmp_path / "file").write_text("not a directory")
    base_dir = tmp_path / where
    message = (
        f"The cluster cannot keep its state in {base_dir}: {why}. Give it a directory it can "
        "create or write in (base_dir, or --dir)."
    )
    with pytest.raises(ClusterError) as info:
        LocalCluster(1, base_dir=base_dir, stop_at_exit=False).start()
    assert str(info.value) == message
    assert cluster_main(["start", "--dir", str(base_dir)]) == 1
    assert capsys.readouterr().err == f"error: {message}\n"
    assert (tmp_path / "file").read_text() == "not a directory"


def test_a_cluster_in_a_relative_directory_gives_its_daemons_its_own_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, `cluster start --dir mycluster` handed the daemons, which run in that
    # directory, relative paths: they read mycluster/mycluster/conf (so not the cluster's
    # log4j2.properties), and workers ran executors in mycluster/mycluster/work, where
    # executor_log() and stop()'s search for a dead worker's executors never looked.
    spark = tmp_path / "spark"
    (spark / "bin").mkdir(parents=True)
    record = tmp_path / "record"
    fake = spark / "bin" / "spark-class"  # says where it runs and its conf dir, and exits
    fake.write_text(f'#!/bin/sh\n{{ pwd; echo "$SPARK_CONF_DIR"; }} > {record}\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setattr(_cluster, "spark_home", lambda: str(spark))
    monkeypatch.chdir(tmp_path)
    cluster = LocalCluster(1, base_dir="mycluster", stop_at_exit=False)
    with pytest.raises(ClusterError, match=r"The Spark master .*exit"):
        cluster.start()
    cwd, conf = record.read_text().splitlines()
    assert Path(cwd) == tmp_path / "mycluster"
    assert Path(cwd, conf) == tmp_path / "mycluster" / "conf"  # as the daemon resolves it
    assert (Path(cwd, conf) / "log4j2.properties").is_file()
    assert cluster.base_dir == tmp_path / "mycluster"  # state named absolutely


# -- the reference job's options and checks ------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("delay-commit=2:-5", "delay-commit's seconds must be a number of seconds >= 0"),
        ("delay-commit=2:nan", "delay-commit's seconds must be a number of seconds >= 0"),
        ("zombie-commit=2,wait=inf", "zombie-commit's wait must be a number of seconds >= 0"),
        ("crash-at=5,attempt=-1", "A fault's attempt is a task attempt number"),
        ("crash-commit=3,partition=-3", "A fault's partitions are partition numbers"),
        ("crash-at=5,attempt=1,attempt=2", "'crash-at=5,attempt=1,attempt=2': attempt is given"),
        ("zombie-commit=2,wait=5,wait=60", "wait is given twice"),
        ("crash-commit=3,wait=5", "unknown setting 'wait'; crash-commit takes attempt, partition"),
        ("crash-at=5,atempt=1", "unknown setting 'atempt'; crash-at takes attempt, partition."),
    ],
)
def test_a_fault_that_would_misfire_or_never_fire_is_refused(fault: str, message: str) -> None:
    # Before, a negative delay made the commit raise instead of waiting, and a negative
    # attempt or partition parsed fine and never fired: the test using it passed for nothing.
    # The last of two attempts (or waits) silently won: the fault hit another attempt than
    # one of them said.
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        FaultSpec.parse(fault)


def test_a_fault_of_a_kind_the_job_does_not_have_is_refused() -> None:
    # Before, FaultSpec("crash_at", 5) was taken, and run as zombie-commit=5.
    with pytest.raises(
        ConfigurationError,
        match=r"Unknown fault kind 'crash_at': use one of crash-at, crash-commit, delay-commit, "
        r"zombie-commit\.",
    ):
        FaultSpec("crash_at", 5)
    # a setting its kind does not take was dropped by wrap(), as the command line refuses it
    with pytest.raises(ConfigurationError, match=r"^A crash-at fault takes no seconds \(only "):
        FaultSpec("crash-at", 5, seconds=3.0)
    with pytest.raises(ConfigurationError, match=r"^A delay-commit fault takes no wait \(only "):
        FaultSpec("delay-commit", 2, seconds=1.0, wait=10.0)
    assert FaultSpec("zombie-commit", 2, wait=10.0).wrap(enrich).max_wait == 10.0


def test_a_fault_takes_spaces_around_its_settings() -> None:
    # before, "attempt = 1" was an "unknown setting 'attempt '"
    assert FaultSpec.parse("crash-at = 5, attempt = 1, partition = 0") == FaultSpec(
        "crash-at", 5, attempt=1, partitions=(0,)
    )
    assert FaultSpec.parse("crash-at=5,partition=0,partition=1").partitions == (0, 1)


def test_the_fault_wrappers_refuse_the_same_settings() -> None:
    with pytest.raises(ConfigurationError, match="DelayCommit's seconds"):
        DelayCommit(enrich, 2, -1.0)
    with pytest.raises(ConfigurationError, match="ZombieCommit's max_wait"):
        ZombieCommit(enrich, 2, max_wait=float("nan"))
    with pytest.raises(ConfigurationError, match="A fault's attempt"):
        CrashOnElement(enrich, at=[1], attempt=-1)


@pytest.mark.parametrize("checkpoint_id", [0, -3, "3", True, 2.0, None])
@pytest.mark.parametrize(
    "make",
    [
        lambda checkpoint_id: CrashDuringCommit(enrich, checkpoint_id),
        lambda checkpoint_id: DelayCommit(enrich, checkpoint_id, 1.0),
        lambda checkpoint_id: ZombieCommit(enrich, checkpoint_id),
    ],
    ids=["CrashDuringCommit", "DelayCommit", "ZombieCommit"],
)
def test_a_commit_fault_aimed_at_an_id_no_checkpoint_has_is_refused(
    make: Any, checkpoint_id: object
) -> None:
    # Before, taken: ids start at 1 and are ints, so the fault never fired (True == 1 did).
    with pytest.raises(
        ConfigurationError,
        match=r"Commit's checkpoint_id is the id of the checkpoint whose commit the fault "
        rf"hits, an integer >= 1 \(a task's checkpoints are numbered from 1\); got "
        rf"{re.escape(repr(checkpoint_id))}\.",
    ):
        make(checkpoint_id)


def test_keys_to_crash_on_are_a_collection() -> None:
    # at="12" crashed on keys "1" and "2". (at=[] is a disarmed wrapper: tests name
    # checkpoints through one.)
    assert CrashOnElement(enrich, at=[]).at == frozenset()
    with pytest.raises(ConfigurationError, match=r"a collection of keys, like \['12'\]"):
        CrashOnElement(enrich, at="12")
    assert CrashOnElement(enrich, at=range(3)).at == {0, 1, 2}
    for at in (5, None):  # before, a bare TypeError: 'int' object is not iterable
        with pytest.raises(ConfigurationError, match=r"a collection of keys, like \["):
            CrashOnElement(enrich, at=at)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"are hashable .*; got \[\[1\]\]"):
        CrashOnElement(enrich, at=[[1]])


class Crashed(Exception):
    pass


def crashing_on(monkeypatch: pytest.MonkeyPatch, **settings: Any) -> CrashOnElement:
    """An armed CrashOnElement (outside Spark: attempt 0) whose os._exit raises Crashed."""

    def exit_(code: int) -> None:
        raise Crashed(code)

    monkeypatch.setattr(os, "_exit", exit_)
    fault = CrashOnElement(enrich, **settings)
    asyncio.run(fault.open())
    return fault


@pytest.mark.parametrize(
    "at, rows, of",
    [
        (
            ["5"],
            [4, 5],
            r"of type str \('5'\), but the rows' 'id' values are of type int, "
            r"such as 4, which never equals them\. Give at the keys as the rows hold them, "
            r"e\.g\. at=\[4\]\.",
        ),
        ([5], ["4", "5"], r"of type int \(5\), .* of type str, such as '4'"),
        ([b"5"], ["5"], r"of type bytes \(b'5'\), .* of type str, such as '5'"),
        ([5], [[4]], r"of type list, such as \[4\], which is not hashable"),
    ],
    ids=["str-keys-int-rows", "int-keys-str-rows", "bytes-keys-str-rows", "unhashable-rows"],
)
def test_a_crash_key_no_row_key_can_equal_is_refused(
    monkeypatch: pytest.MonkeyPatch, at: list[Any], rows: list[Any], of: str
) -> None:
    # Before, the fault never fired (a str "5" never equals the int 5): a chaos test using it
    # passed for the wrong reason.
    fault = crashing_on(monkeypatch, at=at)
    with pytest.raises(ConfigurationError, match=r"^CrashOnElement can never fire: .*" + of):
        for key in rows:
            asyncio.run(fault.async_invoke({"id": key}))


def test_a_crash_key_of_a_type_that_compares_fires(monkeypatch: pytest.MonkeyPatch) -> None:
    fault = crashing_on(monkeypatch, at=[5])
    for key in (None, 4.0, 6):  # a null key, a float, an int: no crash, no error
        assert asyncio.run(fault.async_invoke({"id": key})) == [{"id": key}]
    with pytest.raises(Crashed):
        asyncio.run(fault.async_invoke({"id": 5.0}))
    fault = crashing_on(monkeypatch, at=["a", 5])  # mixed: the str keys are comparable
    assert asyncio.run(fault.async_invoke({"id": "b"})) == [{"id": "b"}]


def test_a_row_without_the_crash_key_field_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before, a bare KeyError: 'id'.
    fault = crashing_on(monkeypatch, at=[5])
    with pytest.raises(
        ConfigurationError,
        match=r"^CrashOnElement's key_field is 'id', but a row it was asked to enrich has no "
        r"such field \(its fields: 'key', 'name'\)\. Pass key_field= the name of the field",
    ):
        asyncio.run(fault.async_invoke({"key": 5, "name": "x"}))
    empty = CrashOnElement(enrich, at=[])  # disarmed everywhere: never looks at the rows
    asyncio.run(empty.open())
    assert asyncio.run(empty.async_invoke({"key": 5})) == [{"key": 5}]


def test_a_crash_key_no_row_key_can_equal_is_refused_on_the_attempts_it_is_not_aimed_at_too() -> (
    None
):
    # Before, only the attempt the fault is aimed at checked the rows: its ConfigurationError
    # failed attempt 0, and Spark's retry, attempt 1, ran without the check and succeeded, so
    # the job passed with one failed attempt, as if the fault had crashed it.
    retry = CrashOnElement(enrich, at=["5"], attempt=1)  # outside Spark: this is attempt 0
    asyncio.run(retry.open())
    with pytest.raises(ConfigurationError, match=r"^CrashOnElement can never fire: .* type int"):
        asyncio.run(retry.async_invoke({"id": 5}))
    missing = CrashOnElement(enrich, at=[5], attempt=1)
    asyncio.run(missing.open())
    with pytest.raises(ConfigurationError, match=r"^CrashOnElement's key_field is 'id', but "):
        asyncio.run(missing.async_invoke({"key": 5}))
    # the first row whose key is not null is checked; after it, the rows go straight through
    fine = CrashOnElement(enrich, at=["5"], attempt=1)
    asyncio.run(fine.open())
    for row in ({"id": None}, {"id": "7"}, {"key": 1}, {"id": 5}):
        assert asyncio.run(fine.async_invoke(row)) == [row]


def test_compare_outputs_names_a_row_without_the_key(tmp_path: Path) -> None:
    # Before, a bare KeyError: 'id' (and a TypeError sorting a None key among ints).
    rows = [{"id": 1, "v": "a"}, {"id": 2, "v": "b"}]
    for expected, actual, which in [
        (rows, [rows[0], {"v": "b"}], "actual"),
        ([*rows, {"key": 3}], rows, "expected"),
    ]:
        with pytest.raises(
            ChaosCheckError,
            match=rf"^A row of the {which} output has no 'id' field \(the key rows are "
            r"matched by\): \{'(v|key)': .*\}\. Pass key= the field that identifies a row",
        ):
            compare_outputs(expected, actual)
    with pytest.raises(ChaosCheckError, match=r"^A row of the actual output has an unhashable"):
        compare_outputs(rows, [{"id": [1]}])
    diff = compare_outputs([*rows, {"id": None}], [{"id": "1"}])
    assert (diff.lost, diff.unexpected) == ([None, 1, 2], ["1"])

    from deltalake import write_deltalake

    write_deltalake(str(tmp_path / "t"), pa.table({"key": [2, 1]}))
    with pytest.raises(ChaosCheckError, match=r"^A row of the Delta table at .* no 'id' field"):
        read_table_rows(str(tmp_path / "t"))
    assert read_table_rows(str(tmp_path / "t"), key="key") == [{"key": 1}, {"key": 2}]


def test_the_job_options_survive_the_command_line_exactly(tmp_path: Path) -> None:
    options = JobOptions(
        master="local[2]",
        service_url="http://127.0.0.1:1",
        checkpoint=str(tmp_path / "chk"),
        output=str(tmp_path / "out"),
        timeout=0.1 + 0.2,  # 0.30000000000000004: %g wrote 0.3
        faults=(
            FaultSpec.parse("delay-commit=2:2.5000001,partition=1"),
            FaultSpec.parse("zombie-commit=2,wait=1234567"),  # %g wrote 1.23457e+06
        ),
    )
    assert parse_args(to_argv(options)) == options


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--service-url", "127.0.0.1:8099"],  # before: every task failed 8 times
            "service_url (--service-url): The service URL must be http:// or https://, a host "
            "and, if given, a port (1-65535), such as http://127.0.0.1:8099; got "
            "'127.0.0.1:8099'.",
        ),
        (["--service-url", "http://127.0.0.1:80990"], "got 'http://127.0.0.1:80990'"),
        (["--interval", "0"], "interval (--interval): CheckpointConfig interval_records must"),
        (["--capacity", "0"], "capacity (--capacity): capacity must be an integer >= 1"),
        (["--timeout", "0"], "timeout (--timeout): timeout must be a finite number of seconds"),
        (["--timeout", "-1"], "timeout must be a finite number of seconds > 0; got -1.0"),
        (["--retain", "0"], "retain (--retain): CheckpointConfig retain must be an integer >= 1"),
        (["--max-attempts", "0"], "RetryStrategy max_attempts must be an integer >= 1"),
        (["--retry-delay", "-1"], "retry_delay (--retry-delay): RetryStrategy delay must be >= 0"),
        (["--cores", "0"], "cores (--cores) caps the job's cores: an integer >= 1"),
        (["--txn-version", "-5"], "txn_version (--txn-version): The option txnVersion must be at"),
        (["--restore-from", "-3"], "CheckpointConfig restore_from must be None, 'latest' or a"),
        (["--job-id", "a/b"], "job_id (--job-id): CheckpointConfig: job_id 'a/b' cannot name"),
        (
            ["--rows", "1000", "--fault", "crash-at=1111"],
            "The fault 'crash-at=1111' can never fire: row 1111 is not among the input rows (ids "
            "0-499, 500-999 with --rows 1000 --partitions 2).",
        ),
        (
            ["--rows", "1000", "--fault", "crash-at=600,partition=0"],
            "row 600 is not among the input rows of partition(s) 0 (ids 0-499 with",
        ),
        (
            ["--fault", "crash-commit=2,partition=5"],
            "can never fire: the job has partitions 0 to 1 (--partitions 2), not 5.",
        ),
        (
            ["--fault", "crash-at=7,attempt=8"],
            "can never fire: Spark makes at most 8 attempts of a task, numbered 0 to 7",
        ),
        (
            # 500 rows a partition: checkpoints at 250, 500 and the final one
            ["--rows", "1000", "--interval", "250", "--fault", "crash-commit=4"],
            "The fault 'crash-commit=4' can never fire: the tasks take checkpoints 1 to 3 at most",
        ),
        (
            ["--rows", "1000", "--interval", "100", "--fault", "delay-commit=8:1,partition=1"],
            "the tasks of partition(s) 1 take checkpoints 1 to 6 at most",
        ),
    ],
)
def test_a_job_option_that_cannot_work_is_refused_before_spark_starts(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    options: list[str],
    message: str,
) -> None:
    # Before, each was refused only once the session had started (exit 1, as a failed job),
    # failed obscurely, or ran a job whose fault never fired (max-attempts 0 ran as 1).
    def no_spark(*args: object, **kwargs: object) -> None:
        raise AssertionError("a Spark session was started")

    monkeypatch.setattr(_job, "session_for", no_spark)
    argv = ["--master", "local[2]", "--service-url", "http://127.0.0.1:1"]
    argv += ["--checkpoint", str(tmp_path / "c"), "--output", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as exited:
        job_main([*argv, *options])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_fault_at_the_last_checkpoint_or_in_a_resumed_run_is_taken(tmp_path: Path) -> None:
    def options(fault: str, **changes: Any) -> JobOptions:
        return JobOptions(
            master="local[2]",
            service_url="http://127.0.0.1:1",
            checkpoint=str(tmp_path / "chk"),
            output=str(tmp_path / "out"),
            faults=(FaultSpec.parse(fault),),
            **{"rows": 1000, "interval": 250, **changes},
        )

    # (in Python as on the command line)
    with pytest.raises(ConfigurationError, match=r"Invalid job option interval \(--interval\)"):
        options("crash-at=1", interval=0)
    with pytest.raises(ConfigurationError, match="the tasks take checkpoints 1 to 3 at most"):
        options("zombie-commit=4")

    assert options("crash-commit=3").faults[0].value == 3  # the final checkpoint's id
    assert options("crash-at=999,partition=1").faults[0].value == 999
    # a resumed run numbers its checkpoints on from the store's: no bound is known
    assert options("crash-commit=40", restore_from="latest").restore_from == "latest"
    # a speculative copy takes an attempt number without a failure
    assert options("zombie-commit=2,attempt=9", speculation=True).faults[0].attempt == 9


CRASHED = "org.apache.spark.SparkException: Python worker exited unexpectedly (crashed)."
REFUSED = "checkpoint.CheckpointConflictError: The commit of checkpoint 2 ... was refused"


def attempt(partition: int, number: int, error: str | None = None) -> TaskAttempt:
    return TaskAttempt(
        stage_id=0,
        partition=partition,
        attempt=number,
        status="FAILED" if error else "SUCCESS",
        speculative=False,
        executor_id="driver",
        host="localhost",
        launch_time=0.0,
        duration=1.0,
        error=error,
    )


@pytest.mark.parametrize(
    ("fault", "tasks", "unfired"),
    [
        # the fault's attempt failed as the fault makes it fail: it fired
        ("crash-at=5", [attempt(0, 0, CRASHED), attempt(0, 1), attempt(1, 0)], False),
        ("crash-commit=2,partition=1", [attempt(0, 0), attempt(1, 0, CRASHED)], False),
        ("zombie-commit=2,partition=0", [attempt(0, 0, REFUSED), attempt(0, 1)], False),
        # aimed at an attempt that never ran (attempt 0 did not fail)
        ("crash-at=5,attempt=1", [attempt(0, 0), attempt(1, 0)], True),
        # a crash elsewhere: another partition, another attempt, another failure
        (
            "crash-commit=2,partition=1",
            [attempt(0, 0, CRASHED), attempt(0, 1), attempt(1, 0)],
            True,
        ),
        ("crash-at=5", [attempt(0, 0, "ExecutorLostFailure"), attempt(0, 1), attempt(1, 0)], True),
        ("crash-at=5,attempt=1", [attempt(0, 0, CRASHED), attempt(0, 1), attempt(1, 0)], True),
        ("zombie-commit=2", [attempt(0, 0, CRASHED), attempt(0, 1), attempt(1, 0)], True),
        # a delay whose commit was refused (a newer attempt overtook it)
        ("delay-commit=2:1", [attempt(0, 0, REFUSED), attempt(0, 1)], False),
        # without the status store nothing is known
        ("crash-at=5", [], False),
    ],
)
def test_a_fault_that_no_task_attempt_shows_firing_is_unfired(
    fault: str, tasks: list[TaskAttempt], unfired: bool
) -> None:
    # Before, a fault that was accepted but never fired (its attempt never ran, a resumed
    # run skipped its row) went unnoticed: the job succeeded, and the chaos test with it
    # passed having tested no recovery.
    spec = FaultSpec.parse(fault)
    assert _job.unfired_faults([spec], tasks) == ([spec] if unfired else [])


def committed(partition: int, checkpoint_id: int, number: int) -> Any:
    """A run's checkpoint, as the job reads it back: id, subtask, the attempt that wrote it."""
    return SimpleNamespace(
        checkpoint_id=checkpoint_id, subtask=partition, properties={"attempt": str(number)}
    )


@pytest.mark.parametrize(
    ("commits", "unfired"),
    [
        ([committed(0, 1, 0), committed(0, 2, 0), committed(1, 2, 0)], False),
        ([committed(1, 2, 0)], False),
        ([], True),  # no checkpoint 2: its task never reached it
        ([committed(0, 1, 0), committed(0, 3, 0)], True),
        ([committed(0, 2, 1)], True),  # written by another attempt than the one held
    ],
)
def test_a_delayed_commit_is_unfired_unless_its_attempt_committed_it(
    commits: list[Any], unfired: bool
) -> None:
    # Before, delay-commit was never listed, fired or not: a delay that never happened
    # (its checkpoint never reached, its attempt never run) passed unnoticed.
    spec = FaultSpec.parse("delay-commit=2:1")
    tasks = [attempt(0, 0), attempt(1, 0)]
    assert _job.unfired_faults([spec], tasks, commits) == ([spec] if unfired else [])
    scoped = FaultSpec.parse("delay-commit=2:1,partition=0")
    expected = [scoped] if unfired or commits == [committed(1, 2, 0)] else []
    assert _job.unfired_faults([scoped], tasks, commits) == expected


# partition 0's attempt 0 crashed (and attempt 1 ran), and partition 1's
P0_CRASHED = [attempt(0, 0, CRASHED), attempt(0, 1)]
P1_CRASHED = [attempt(1, 0, CRASHED), attempt(1, 1)]


@pytest.mark.parametrize(
    ("faults", "tasks", "unfired"),
    [
        # one crash of partition 0's attempt 0: rows 10 and 20 cannot both have crashed it
        (["crash-at=10", "crash-at=20"], P0_CRASHED, ["crash-at=20"]),
        (["crash-at=10", "crash-commit=2"], P0_CRASHED, ["crash-commit=2"]),
        # row 150 is partition 1's (200 rows in 2 partitions): partition 0's crash is not its
        (["crash-at=10", "crash-at=150"], [*P0_CRASHED, attempt(1, 0)], ["crash-at=150"]),
        (["crash-at=150"], [*P0_CRASHED, attempt(1, 0)], ["crash-at=150"]),
        # one crash each: both fired, in whatever order they are matched
        (["crash-at=10", "crash-at=150"], P0_CRASHED + P1_CRASHED, []),
        (["crash-commit=2", "crash-at=10"], P0_CRASHED + P1_CRASHED, []),
        (
            ["crash-at=10", "crash-commit=2,attempt=1"],
            [*P0_CRASHED[:1], attempt(0, 1, CRASHED)],
            [],
        ),
    ],
)
def test_one_crash_shows_one_crash_fault_firing(
    faults: list[str], tasks: list[TaskAttempt], unfired: list[str]
) -> None:
    # Before, one crashed attempt counted as the mark of every crash fault aimed at it:
    # crash-at=10 and crash-at=20 (only the first can crash attempt 0), or a crash-at whose
    # row is in the other partition, were counted as fired by the one crash.
    specs = [FaultSpec.parse(f) for f in faults]
    found = _job.unfired_faults(specs, tasks, rows=200, partitions=2)
    assert [str(f) for f in found] == unfired


def test_the_job_warns_of_a_fault_that_never_fired(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Session:
        class sparkContext:
            applicationId = "app-1"

        def stop(self) -> None:
            pass

    def run(spark: Any, options: JobOptions) -> JobReport:
        return JobReport(
            "app-1", options.job_id, "ordered", 10, 2, 0.0, 1.0, 0, True, 10,
            tasks=[attempt(0, 0), attempt(1, 0)],
            unfired_faults=[str(f) for f in _job.unfired_faults(options.faults, [attempt(0, 0)])],
        )  # fmt: skip

    monkeypatch.setattr(_job, "session_for", lambda *args, **kwargs: Session())
    monkeypatch.setattr(_job, "run_job", run)
    report = tmp_path / "run.json"
    argv = ["--master", "local[2,3]", "--service-url", "http://127.0.0.1:1", "--rows", "10"]
    argv += ["--checkpoint", str(tmp_path / "c"), "--output", str(tmp_path / "o")]
    argv += ["--fault", "crash-at=5,attempt=1", "--report", str(report)]
    assert job_main(argv) == 0  # the output is committed and right
    assert (
        "warning: the fault crash-at=5,attempt=1 never fired: no task attempt it is aimed at "
        "shows its mark (a crashed worker, a refused or a held commit), so this run tested no "
        "recovery from it. Aim it at a row or checkpoint the run reaches, and at an attempt "
        "that runs.\n"
    ) in capsys.readouterr().err
    written = JobReport.from_json(report.read_text())
    assert written.unfired_faults == ["crash-at=5,attempt=1"]
    # a report written before the field existed still loads
    old = json.loads(report.read_text())
    del old["unfired_faults"]
    assert JobReport.from_json(json.dumps(old)).unfired_faults == []


def test_a_report_in_a_folder_that_does_not_exist_or_a_folder_is_refused_before_the_job_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_spark(*args: object, **kwargs: object) -> None:
        raise AssertionError("a Spark session was started")

    monkeypatch.setattr(_job, "session_for", no_spark)
    # Before, the job committed its output and then failed writing the report (exit 1).
    # (Checked when the job starts, not by parse_args: options parsed on one machine may
    # run on another, as docker-compose's job does with its /data volume.)
    report = tmp_path / "no-such-folder" / "run.json"
    argv = ["--master", "local[2]", "--service-url", "http://127.0.0.1:1"]
    argv += ["--checkpoint", str(tmp_path / "c"), "--output", str(tmp_path / "o")]
    assert job_main([*argv, "--report", str(report)]) == 2  # before starting Spark
    assert f"the report's folder {report.parent} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (tmp_path / "c").exists()
    # Before, a folder given as the report was found only as the report was written, once
    # the output was committed: "the job failed: IsADirectoryError" (exit 1).
    assert job_main([*argv, "--report", str(tmp_path)]) == 2
    assert (
        f"error: it is a folder: pass --report the path of a file, such as "
        f"{tmp_path / 'run.json'} (got {str(tmp_path)!r})"
    ) in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (tmp_path / "c").exists()


def test_checking_a_store_with_the_wrong_ids_or_location_does_not_pass(tmp_path: Path) -> None:
    commit(SnapshotStore(tmp_path).subtask("job", "op", 0), 1)
    assert len(check_snapshot_store(str(tmp_path), "job", "op").checkpoints) == 1
    # before: an empty StoreCheck, as if the store were clean
    with pytest.raises(
        ChaosCheckError,
        match="Cannot check the snapshot store: Job 'job' has no operator 'other' at .* Its "
        "operators: op",
    ):
        check_snapshot_store(str(tmp_path), "job", "other")
    with pytest.raises(ChaosCheckError, match="Cannot check the snapshot store: Job 'nojob'"):
        check_snapshot_store(str(tmp_path), "nojob", "op")


def test_checking_a_store_whose_data_file_is_gone_fails_with_a_chaos_check_error(
    tmp_path: Path,
) -> None:
    # Before, the listing of the checkpoints raised the store's own CheckpointError, not
    # the ChaosCheckError the check promises.
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    commit(log, 1)
    check_snapshot_store(str(tmp_path), "job", "op")  # whole: it passes
    [data] = (tmp_path / "job" / "op").glob("subtask=*/*.parquet")
    data.unlink()
    with pytest.raises(
        ChaosCheckError,
        match=r"The snapshot store of job 'job' at .* is inconsistent: Cannot read checkpoint "
        r"table .*Its newest version names a data file that is not there",
    ):
        check_snapshot_store(str(tmp_path), "job", "op")


class FailsToOpen(AsyncFunction):
    async def open(self) -> None:
        raise RuntimeError("no connection")

    async def async_invoke(self, row: dict) -> list[dict]:
        return [row]


def test_a_commit_fault_whose_function_fails_to_open_leaves_no_hook_installed() -> None:
    fault = DelayCommit(FailsToOpen(), checkpoint_id=1, seconds=0.0)
    with pytest.raises(RuntimeError, match="no connection"):
        asyncio.run(fault.open())
    assert _faults._hooks == []  # a reused Python worker would carry it into the next task
