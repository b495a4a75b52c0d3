"""``LocalCluster`` itself on real Spark daemons: workers restarted after kills."""

from __future__ import annotations

import time

import pytest

from stateful_async.chaos import LocalCluster


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
