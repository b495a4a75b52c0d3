"""The snapshot store under real processes: SIGKILL mid-commit, concurrent committers, and
two attempts racing on one checkpoint id."""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from checkpoint import SnapshotStore

WRITER = Path(__file__).with_name("checkpoint_writer.py")
JOB, OPERATOR = "job", "enrich"


class Writer:
    """A checkpoint_writer.py process. A thread reads its stdout, so waiting for a line has
    a real deadline even when the process goes quiet."""

    def __init__(self, *args: object) -> None:
        self.stderr = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(
            [sys.executable, str(WRITER), *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def errors(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()

    def wait_for(self, prefix: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} line within {timeout} s") from None
            if line is None:
                code = self.process.wait(timeout=30)
                raise AssertionError(f"writer exited ({code}): {self.errors()}")
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def finish(self, timeout: float = 120) -> list[str]:
        """Wait for the process to end; every line it printed."""
        self.process.wait(timeout=timeout)
        self.reader.join(timeout=30)
        while (line := self.lines.get_nowait() if not self.lines.empty() else None) is not None:
            self.seen.append(line)
        return self.seen

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


@pytest.fixture
def spawn() -> Iterator[Callable[..., Writer]]:
    """Start writers; whatever happens in the test, each is killed (by its pid) at the end."""
    started: list[Writer] = []

    def start(*args: object) -> Writer:
        writer = Writer(*args)
        started.append(writer)
        return writer

    yield start
    for writer in started:
        writer.kill()
        writer.stderr.close()


def test_sigkill_while_committing_never_leaves_a_partial_checkpoint(
    tmp_path: Path, spawn: Callable[..., Writer]
) -> None:
    store = SnapshotStore(tmp_path)
    log = store.subtask(JOB, OPERATOR, 0)
    rng = random.Random(20261122)
    killed_mid_commit = 0
    for _ in range(12):
        writer = spawn("loop", tmp_path, 0, "run", 400)
        writer.wait_for("committed")  # in its commit loop, one checkpoint landed
        time.sleep(rng.uniform(0.0, 0.8))
        os.kill(writer.process.pid, signal.SIGKILL)
        lines = writer.finish(timeout=30)
        last_committed = max(
            (int(line.split()[1]) for line in lines if line.startswith("committed")), default=0
        )
        ids = [m.checkpoint_id for m in log.checkpoints()]
        # Contiguous, each exactly once, and nothing reported committed is missing.
        assert ids == list(range(1, len(ids) + 1)), ids
        assert len(ids) >= last_committed >= 1
        # Every visible checkpoint is complete (load() checks rows against metadata), and the
        # newest restores with its whole chain of results.
        metas = log.checkpoints()
        for meta in metas[-2:]:
            snapshot = log.load(meta.checkpoint_id)
            assert len(snapshot.elements) == meta.in_flight == 404
        restored = log.restore(ids[-1])
        assert restored.results.num_rows == sum(m.result_count for m in metas) == 100 * len(ids)
        if len(ids) >= 2:
            assert log.load(ids[-2]).metadata.checkpoint_id == ids[-2]  # previous one intact
        # Killed after its rows were built and before the commit returned: inside the Delta
        # write and commit (whatever it left on disk is invisible to readers, checked above).
        if lines[-1].startswith("writing"):
            killed_mid_commit += 1
    # The kills really landed inside commits, not only between them.
    assert killed_mid_commit >= 3, killed_mid_commit


def test_eight_processes_commit_fifty_checkpoints_each_exactly_once(
    tmp_path: Path, spawn: Callable[..., Writer]
) -> None:
    writers = [spawn("batch", tmp_path, subtask, "run", 50, 20) for subtask in range(8)]
    for writer in writers:
        writer.finish(timeout=300)
        assert writer.process.returncode == 0, writer.errors()
    store = SnapshotStore(tmp_path)
    assert store.subtasks(JOB, OPERATOR) == list(range(8))
    metas = store.checkpoints(JOB)
    assert len(metas) == 400
    seen = sorted((m.subtask, m.checkpoint_id) for m in metas)
    assert seen == [(s, c) for s in range(8) for c in range(1, 51)]
    table = store.read_job(JOB)
    assert table.num_rows == 400 * (1 + 20 + 5)  # meta + 20 records + 5 results each


def test_a_process_that_restored_a_checkpoint_exits_cleanly(
    tmp_path: Path, spawn: Callable[..., Writer]
) -> None:
    # deltalake's default pyarrow dataset made about one process in two abort at exit
    # ("terminate called without an active exception"); eight clean exits in a row make a
    # regression all but certain to show.
    writer = spawn("batch", tmp_path, 0, "run", 2, 20)
    writer.finish()
    assert writer.process.returncode == 0, writer.errors()
    for _ in range(8):
        reader = spawn("read", tmp_path, "run")
        assert reader.finish() == ["restored 20 52"], reader.errors()
        code = reader.process.returncode
        assert code == 0, f"exit {code} after a restore: {reader.errors()}"


@pytest.mark.parametrize("attempt", range(3))
def test_two_attempts_racing_on_one_checkpoint_id_yield_exactly_one(
    tmp_path: Path, attempt: int, spawn: Callable[..., Writer]
) -> None:
    store = SnapshotStore(tmp_path)
    seed = spawn("batch", tmp_path, 0, "run", 2, 10)  # checkpoints 1 and 2 exist
    seed.finish()
    assert seed.process.returncode == 0, seed.errors()
    go = tmp_path / "go"
    racers = [spawn("race", tmp_path, "run", 3, go) for _ in range(2)]
    for racer in racers:
        racer.wait_for("ready")  # both hold the same table snapshot
    go.touch()
    outcomes = sorted(racer.finish()[-1] for racer in racers)
    assert outcomes[0] == "landed"
    assert outcomes[1].startswith("refused")
    metas = store.subtask(JOB, OPERATOR, 0).checkpoints()
    assert [m.checkpoint_id for m in metas] == [1, 2, 3]
    assert store.load(JOB, OPERATOR, 0, 3).metadata.in_flight == 50
