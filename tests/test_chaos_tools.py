"""The chaos tools that need no Spark: fault wrappers on real snapshot stores, and the
driver-process bookkeeping on real child processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from checkpoint import SnapshotStore, SubtaskLog, _faults
from stateful_async import ConfigurationError, StreamRecord
from stateful_async.chaos import (
    ClusterError,
    CrashDuringCommit,
    DriverProcess,
    LocalCluster,
    _cluster,
)

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
    assert pq.read_table(orphan).column("checkpoint_id").to_pylist()[0] == 1
    # ... not under a directory named after the URI's scheme, relative to the cwd.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


def test_crash_during_commit_refuses_a_remote_checkpoint_location() -> None:
    fault = CrashDuringCommit(enrich, checkpoint_id=1)
    asyncio.run(fault.open())
    try:
        log = SubtaskLog("s3://bucket/checkpoints/job/op/subtask=0", "job", "op", 0)
        with pytest.raises(
            ConfigurationError,
            match=r"CrashDuringCommit writes its orphan Parquet file on the local file system, "
            r"but checkpoint run:1 goes to s3://bucket/checkpoints/job/op/subtask=0\. Use a "
            r"local checkpoint location",
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
        assert driver.kill() == [child.pid]  # ... and ended
        assert gone(child.pid)
        assert driver.pids() == []
    finally:
        if not gone(child.pid):
            child.kill()  # the process this test started, by pid, whatever the outcome


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
