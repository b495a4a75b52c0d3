"""The snapshot store under real processes: SIGKILL mid-commit, concurrent committers, and
two attempts racing on one checkpoint id."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoint import SnapshotStore

WRITER = Path(__file__).with_name("checkpoint_writer.py")
JOB, OPERATOR = "job", "enrich"


def spawn(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WRITER), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_line(process: subprocess.Popen[str], prefix: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line.startswith(prefix):
            return line
        if not line and process.poll() is not None:
            raise AssertionError(f"writer exited ({process.returncode}): {process.stderr.read()}")
    raise AssertionError(f"no {prefix!r} line within {timeout} s")


def test_sigkill_while_committing_never_leaves_a_partial_checkpoint(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    rng = random.Random(20261122)
    killed_mid_commit = 0
    for _ in range(12):
        writer = spawn("loop", tmp_path, 0, "run", 400)
        wait_for_line(writer, "begin")  # the writer is in its commit loop
        time.sleep(rng.uniform(0.0, 0.8))
        os.kill(writer.pid, signal.SIGKILL)
        stdout, _ = writer.communicate(timeout=30)
        lines = stdout.split()
        last_committed = max(
            (int(lines[i + 1]) for i, word in enumerate(lines) if word == "committed"), default=0
        )
        if stdout.strip().splitlines()[-1:] and stdout.strip().splitlines()[-1].startswith("begin"):
            killed_mid_commit += 1

        log = store.subtask(JOB, OPERATOR, 0)
        metas = log.checkpoints()
        ids = [m.checkpoint_id for m in metas]
        # Contiguous, each exactly once, and nothing reported committed is missing.
        assert ids == list(range(1, len(ids) + 1)), ids
        assert len(ids) >= last_committed
        # Every visible checkpoint is complete (load() checks rows against metadata), and the
        # newest restores with its whole chain of results.
        for meta in metas[-2:]:
            snapshot = log.load(meta.checkpoint_id)
            assert len(snapshot.elements) == meta.in_flight == 404
        restored = log.restore(ids[-1])
        assert restored.results.num_rows == sum(m.result_count for m in metas) == 100 * len(ids)
        if len(ids) >= 2:
            assert log.load(ids[-2]).metadata.checkpoint_id == ids[-2]  # previous one intact
    # The kills really landed inside commits, not only between them.
    assert killed_mid_commit >= 3, killed_mid_commit


def test_eight_processes_commit_fifty_checkpoints_each_exactly_once(tmp_path: Path) -> None:
    writers = [spawn("batch", tmp_path, subtask, "run", 50, 20) for subtask in range(8)]
    for writer in writers:
        _, stderr = writer.communicate(timeout=300)
        assert writer.returncode == 0, stderr
    store = SnapshotStore(tmp_path)
    assert store.subtasks(JOB, OPERATOR) == list(range(8))
    metas = store.checkpoints(JOB)
    assert len(metas) == 400
    seen = sorted((m.subtask, m.checkpoint_id) for m in metas)
    assert seen == [(s, c) for s in range(8) for c in range(1, 51)]
    table = store.read_job(JOB)
    assert table.num_rows == 400 * (1 + 20 + 5)  # meta + 20 records + 5 results each


def test_a_process_that_restored_a_checkpoint_exits_cleanly(tmp_path: Path) -> None:
    # deltalake's default pyarrow dataset made about one process in two abort at exit
    # ("terminate called without an active exception"); eight clean exits in a row make a
    # regression all but certain to show.
    writer = spawn("batch", tmp_path, 0, "run", 2, 20)
    assert writer.wait(timeout=120) == 0, writer.communicate()[1]
    for _ in range(8):
        reader = spawn("read", tmp_path, "run")
        stdout, stderr = reader.communicate(timeout=120)
        assert stdout.strip() == "restored 20 52", stderr
        assert reader.returncode == 0, f"exit {reader.returncode} after a restore: {stderr}"


@pytest.mark.parametrize("attempt", range(3))
def test_two_attempts_racing_on_one_checkpoint_id_yield_exactly_one(
    tmp_path: Path, attempt: int
) -> None:
    store = SnapshotStore(tmp_path)
    seed = spawn("batch", tmp_path, 0, "run", 2, 10)  # checkpoints 1 and 2 exist
    assert seed.wait(timeout=120) == 0
    go = tmp_path / "go"
    racers = [spawn("race", tmp_path, "run", 3, go) for _ in range(2)]
    for racer in racers:
        wait_for_line(racer, "ready")  # both hold the same table snapshot
    go.touch()
    outcomes = sorted(racer.communicate(timeout=120)[0].strip() for racer in racers)
    assert outcomes[0] == "landed"
    assert outcomes[1].startswith("refused")
    metas = store.subtask(JOB, OPERATOR, 0).checkpoints()
    assert [m.checkpoint_id for m in metas] == [1, 2, 3]
    assert store.load(JOB, OPERATOR, 0, 3).metadata.in_flight == 50
