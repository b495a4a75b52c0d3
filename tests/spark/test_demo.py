"""The README's main job: `stateful-async demo`, run as a user runs it."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deltalake import DeltaTable

from checkpoint import delta_dataset

pytestmark = pytest.mark.spark


def test_the_demo_crashes_a_task_recovers_and_reports_exactly_once(tmp_path: Path) -> None:
    script = shutil.which("stateful-async") or str(Path(sys.executable).with_name("stateful-async"))
    result = subprocess.run(
        # a relative --workdir, from tmp_path (it crashed the sink, which takes absolute
        # paths), with a space (Spark did not start: its Java options were split there)
        [script, "demo", "--rows", "4000", "--latency-ms", "2", "--workdir", "demo run"],
        capture_output=True,
        text=True,
        timeout=600,
        env={"COLUMNS": "80", "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"},
        cwd=tmp_path,
    )
    output = result.stdout
    assert result.returncode == 0, output + result.stderr
    # a command to paste whole, however narrow the terminal
    assert f"Look inside: stateful-async checkpoints list '{tmp_path}/demo run/checkpoints'\n" in (
        output
    )
    flat = " ".join(re.sub(r"[│┌┐└┘├┤─┬┴┼]", " ", output).split())  # the table's cells, unwrapped
    assert "exactly-once" in output and "held: every record's result exactly once" in output
    crash = re.search(
        r"partition 0 died at record ([\d,]+) \(attempt 0\); attempt 1 resumed from "
        r"checkpoint (\d+)",
        flat,
    )
    assert crash, output
    again = re.search(
        r"([\d,]+) records re-requested after the crash \(bound: capacity \+ "
        r"interval = ([\d,]+)\)",
        flat,
    )
    assert again, output
    repeated, bound = (int(g.replace(",", "")) for g in again.groups())
    assert 0 < repeated <= bound
    # The job's counts, on the driver: the resumed task re-emitted what its checkpoint
    # held, so results + re-emitted = the 4,000 rows written.
    counts = re.search(
        r"2 tasks finished: ([\d,]+) records invoked, ([\d,]+) results, 0 retries, 0 timeouts; "
        r"1 resumed: ([\d,]+) results re-emitted from checkpoints, ([\d,]+) in flight "
        r"re-invoked, ([\d,]+) inputs skipped",
        flat,
    )
    assert counts, output
    records, results, restored, in_flight, skipped = (
        int(g.replace(",", "")) for g in counts.groups()
    )
    assert results + restored == 4000
    assert records - in_flight + skipped == 4000
    table = delta_dataset(DeltaTable(str(tmp_path / "demo run" / "enriched"))).to_table()
    assert sorted(table.column("id").to_pylist()) == list(range(4000))
    # Spark's own chatter about the injected crash went to the log, not the terminal.
    assert "Exception" not in output
    assert (tmp_path / "demo run" / "spark.log").exists()
    # Spark read the demo's log configuration (none of its own start-up lines in the log)
    assert "log4j" not in (tmp_path / "demo run" / "spark.log").read_text()


def test_the_demo_refuses_a_workdir_that_holds_a_previous_run(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "stateful_async.cli", "demo", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "already holds a demo run" in result.stdout + result.stderr


def test_a_demo_sent_sigterm_mid_job_stops_spark_and_the_service_and_exits_143(
    tmp_path: Path,
) -> None:
    # before: the SIGTERM left py4j's connection awaiting the job's answer, which
    # spark.stop() then read as its own: a Py4JError traceback ("... does not exist in the
    # JVM") and exit status 1
    demo = subprocess.Popen(
        # 300 ms a request: the job runs for a minute, long after its first checkpoint
        [sys.executable, "-m", "stateful_async.cli", "demo", "--rows", "20000"]
        + ["--latency-ms", "300", "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "checkpoints" / "demo").exists():  # the job runs
            assert demo.poll() is None and time.monotonic() < deadline, demo.communicate()
            time.sleep(0.2)
        children = [int(p) for p in _children(demo.pid)]  # the mock service, the JVM
        demo.send_signal(signal.SIGTERM)
        output, errors = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.communicate()
    assert demo.returncode == 128 + signal.SIGTERM, output + errors
    assert "Traceback" not in errors, errors
    assert len(children) == 2
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_running(pid) for pid in children)


def _children(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
