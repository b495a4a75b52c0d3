"""``LocalCluster`` itself on real Spark daemons: workers restarted after kills, and ports
taken by another process between ``free_port()`` and the daemon's bind."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from stateful_async.chaos import ClusterError, LocalCluster, _cluster


@pytest.mark.cluster
def test_a_worker_started_after_every_worker_was_killed_registers(cluster: LocalCluster) -> None:
    # The session's cluster; both workers are running again when the test ends.
    cluster.wait_for_workers(2)
    try:
        cluster.kill_worker(0)
        cluster.kill_worker(1)
        started = time.monotonic()
        info = cluster.start_worker(0, timeout=30)  # waits for worker 0, not for two workers
        assert time.monotonic() - started < 30
        listed = [w for w in cluster.master_status()["workers"] if w["port"] == info.port]
        assert [w["state"] for w in listed] == ["ALIVE"]
        assert [w["port"] for w in cluster.alive_workers()] == [info.port]
    finally:
        for index in (0, 1):
            if not cluster.workers[index].record.alive():
                cluster.start_worker(index)
    assert len(cluster.alive_workers()) == 2


@pytest.mark.cluster
def test_a_worker_killed_by_another_hand_fails_no_wait_for_the_workers_alive(
    cluster: LocalCluster,
) -> None:
    # A worker SIGKILLed other than through kill_worker() (the OOM killer, os.kill, the CLI's
    # kill-worker from another process). Before, every later wait_for_workers() and
    # start_worker() raised "A Spark daemon (pid N) exited with code -9 while starting".
    cluster.wait_for_workers(2)
    victim = cluster.workers[1]
    try:
        os.kill(victim.pid, signal.SIGKILL)  # a process of the session's cluster, by pid
        _cluster.wait_until(
            lambda: not victim.record.alive(), 30, "The killed worker is still running"
        )
        started = time.monotonic()
        cluster.wait_for_workers(1, timeout=30)  # worker 0 is alive: no error, no wait
        with pytest.raises(ClusterError) as refused:
            cluster.wait_for_workers(2, timeout=30)
        assert time.monotonic() - started < 20  # neither waited out its timeout
        assert str(refused.value) == (
            "Cannot wait for 2 workers: 1 of the cluster's 2 run (0); worker 1 (pid "
            f"{victim.pid}) exited with code -9. Start it again with start_worker(1)."
        )
        info = cluster.start_worker(1, timeout=60)
        assert info.pid != victim.pid and info.record.alive()
    finally:
        if not cluster.workers[1].record.alive():
            cluster.start_worker(1)
    cluster.wait_for_workers(2)
    assert len(cluster.alive_workers()) == 2


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port this test holds (bound and listening) while a cluster starts."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield int(held.getsockname()[1])


def processes_in(directory: Path) -> list[Any]:
    """Live processes running in ``directory`` (the daemons run in the cluster's dir)."""
    found = []
    for process in psutil.process_iter(["cwd", "status"]):
        cwd = process.info["cwd"] or ""
        if process.info["status"] != psutil.STATUS_ZOMBIE and cwd.startswith(str(directory)):
            found.append(process)
    return found


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("taken", "service"),
    [(0, "sparkMaster"), (1, "MasterUI"), (2, "sparkWorker"), (3, "WorkerUI")],
)
def test_a_port_taken_before_its_daemon_binds_it_is_replaced(
    taken_port: int, monkeypatch: pytest.MonkeyPatch, taken: int, service: str
) -> None:
    # free_port() found a port free (the master's, its web UI's, the worker's, its web
    # UI's: the calls in that order), then another process took it before the JVM bound
    # it. The daemon exits at once, and is started again on new ports.
    ports = iter([0] * taken + [taken_port])
    real_free_port = _cluster.free_port
    monkeypatch.setattr(_cluster, "free_port", lambda: next(ports, 0) or real_free_port())
    cluster = LocalCluster(1, startup_timeout=90)
    started = time.monotonic()
    try:
        cluster.start()
        assert time.monotonic() - started < 90
        [worker] = cluster.workers.values()
        used = {cluster.master_port, cluster.webui_port, worker.port, worker.webui_port}
        assert taken_port not in used and len(used) == 4
        assert cluster.master_status()["url"] == cluster.master_url
        assert [w["port"] for w in cluster.alive_workers()] == [worker.port]
        assert cluster.base_dir is not None
        logs = "".join(p.read_text() for p in (cluster.base_dir / "logs").glob("*.log"))
        assert f"Service '{service}' failed after 0 retries (starting from {taken_port})" in logs
    finally:
        cluster.stop()


@pytest.mark.cluster
def test_a_port_that_stays_taken_fails_the_start_quickly_naming_it(
    taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_cluster, "free_port", lambda: taken_port)
    cluster = LocalCluster(1, startup_timeout=90)
    started = time.monotonic()
    with pytest.raises(ClusterError) as raised:
        cluster.start()
    assert time.monotonic() - started < 45  # three launches of a JVM that exits at once
    assert (
        f"The Spark master could not bind port {taken_port} on 127.0.0.1: another process took "
        "it after it was found free. Launched 3 time(s), on new free ports each time. The "
        "daemon said: java.net.BindException: "
    ) in str(raised.value)
    # Nothing left behind: no daemon, no directory.
    assert cluster.base_dir is not None
    assert not cluster.base_dir.exists()
    assert processes_in(cluster.base_dir) == []


@pytest.mark.cluster
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_cluster_whose_process_dies_without_stopping_it_is_stopped(sig: int) -> None:
    # Before, atexit ran for neither a SIGKILL nor a SIGTERM nobody handles: the master and
    # worker (in sessions of their own) ran on, listening, and their temporary directory,
    # the only record of them, stayed with no one knowing its name.
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from stateful_async.chaos import LocalCluster; "
            "c = LocalCluster(1).start(); "
            "print(c.base_dir, c.master.pid, *(w.pid for w in c.workers.values()), flush=True); "
            "time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    base_dir = ""
    try:
        assert owner.stdout is not None
        base_dir, *pids = owner.stdout.readline().split()
        assert len(pids) == 2, "the cluster did not start"
        daemons = [psutil.Process(int(pid)) for pid in pids]
        owner.send_signal(sig)
        assert owner.wait(timeout=30) == -sig
        _, alive = psutil.wait_procs(daemons, timeout=60)
        assert alive == []
        _cluster.wait_until(lambda: not Path(base_dir).exists(), 30, f"{base_dir} was not removed")
    finally:
        owner.kill()
        owner.wait()
        if base_dir and (Path(base_dir) / "cluster.json").exists():  # not stopped: stop it
            LocalCluster.attach(base_dir).stop()
            shutil.rmtree(base_dir)
