"""The benchmark suite's own bookkeeping (benchmarks/run_all.py and its parts), without
running a benchmark: a part that failed must fail the run, not leave a report and exit 0."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import types
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import checkpoint_bench  # noqa: E402
import pyflink_bench  # noqa: E402
import run_all  # noqa: E402
import scratch  # noqa: E402
import spark_bench  # noqa: E402

MACHINE = {
    "date": "2026-01-01 00:00 UTC",
    "cpu_model": "test",
    "cpus": 2,
    "memory_gib": 1.0,
    "os": "test",
    "python": "3",
    "pyspark": "4",
    "deltalake": "1",
    "pyarrow": "1",
    "aiohttp": "3",
    "java": "17",
    "commit": "0000000",
    "load_start": [0.0, 0.0, 0.0],
    "load_end": [0.0, 0.0, 0.0],
}


def report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, results: dict[str, Any]) -> None:
    """run_all's main on a saved run (--from-json); matplotlib stubbed: no part has
    figures to plot."""
    matplotlib = types.ModuleType("matplotlib")
    matplotlib.use = lambda backend: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "matplotlib", matplotlib)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", types.ModuleType("matplotlib.pyplot"))
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(results))
    out = tmp_path / "benchmarks.md"
    argv = ["run_all.py", "--from-json", str(saved), "--out", str(out), "--plots", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    run_all.main()


def saved_run(**parts: Any) -> dict[str, Any]:
    results: dict[str, Any] = {
        "quick": True,
        "machine": MACHINE,
        "cleanup": {"started": 3, "still_running": [], "listening": []},
        # parts with figures would need a real run's; these have none
        "operator": {"status": "skipped", "reason": "not run here"},
        "store": {"status": "skipped", "reason": "not run here"},
        "spark": {"status": "skipped", "reason": "not run here"},
        "pyflink": {"status": "skipped", "reason": "--skip-pyflink was given"},
        "sink": {"status": "skipped", "reason": "--skip-sink was given"},
    }
    results.update(parts)
    return results


def test_a_failed_part_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failed = {"status": "failed", "reason": "spark_bench.py failed (exit 1)"}
    with pytest.raises(SystemExit) as exit_:
        report(tmp_path, monkeypatch, saved_run(spark=failed))
    assert exit_.value.code == 1
    text = (tmp_path / "benchmarks.md").read_text()
    assert "_failed: spark_bench.py failed (exit 1)_" in text
    # Its targets are in the Targets table as not measured, not left out of it.
    unmeasured = "not measured: the Spark part failed: spark_bench.py failed (exit 1)"
    for target in ("1.2x the hand-written", "3x PyFlink", "Little's-law", "memory flat"):
        line = rf"\| [^|]*{re.escape(target)}[^|]* \| {re.escape(unmeasured)} \|"
        assert re.search(line, text), target
    assert "not measured: the operator part skipped: not run here" in text
    assert "0 targets met, 0 missed, 7 not measured." in text


def test_a_figure_measured_in_addition_is_not_counted_among_the_targets() -> None:
    # before: the memory-with-checkpoints row, "not a target of the issue" in its section,
    # was a "**missed**" target in the table and the closing note's count (6 met, 2 missed),
    # and dropped out of the count when the Spark part failed
    saved = json.loads((BENCHMARKS.parent / "docs" / "benchmarks" / "results.json").read_text())
    checks = run_all.targets(saved)
    [extra] = [c for c in checks if c["key"] == "memory_ckpt"]
    assert extra["met"] is False and run_all.status(extra) == "over (not a target)"
    [miss] = run_all.missed_targets(checks)
    assert "1.2x the hand-written" in miss["target"]
    closing = run_all.section_closing(checks)
    assert closing.splitlines()[2].startswith(
        "6 targets met, 1 missed; 1 figure measured in addition over its line. "
    )


def test_a_quick_runs_report_names_the_counts_it_ran_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: the labels were the full run's ("capacity x 100", "best of 2", "1, 8 and 32
    # processes", "a micro-batch every 10 s") whatever a --quick run had done
    saved = json.loads((BENCHMARKS.parent / "docs" / "benchmarks" / "results.json").read_text())
    saved["quick"] = True
    for row in saved["operator"]["throughput"]:
        if row["function"] == "sleep20ms":
            row["elements"] = row["capacity"] * 25
    saved["operator"]["repeat"] = 1
    for row in saved["spark"]["slow"]["table"]:
        row["runs_s"] = row["runs_s"][:1]
    for shape in saved["spark"]["latency_variance"]:
        shape["repeat"] = 1
    for row in saved["spark"]["batch_sweep"]:
        for case in ("ordered_wait", "handwritten_asyncio"):
            row[case]["runs_s"] = row[case]["runs_s"][:1]
    saved["pyflink"]["runs"] = 1
    saved["spark"]["throughput_repeat"] = 1
    sc = saved["spark"]["service_checkpoint"]
    sc["runs_s"] = {case: runs[:1] for case, runs in sc["runs_s"].items()}
    store = saved["store"]
    store["concurrency"] = [r for r in store["concurrency"] if r["committers"] in (1, 8)]
    for row in store["fences"]:
        row["earlier_runs"] //= 10
    monkeypatch.setattr(run_all, "make_plots", lambda results, plots: {})
    text = run_all.render(saved, tmp_path, tmp_path)
    assert "`sleep20ms` runs `capacity x 25` elements (about 0.5 s at the" in text
    assert "bound 640 rows/s; each once):" in text
    assert "(table above, its one run against the loop's one;" in text
    assert "PyFlink's steady state, one run)" in text
    assert "the job's wall time is shown too. One run.\n" in text
    assert "commit latency with 1 and 8 processes committing at once" in text
    assert "864 a day (a micro-batch every 100 s)" in text
    assert "best of 2" not in text and "32 processes" not in text
    assert "Rows per case as shown; one run of each case, the cases" in text
    assert "interleaved, one run of each; the function" in text
    assert "smaller batch size ran once, while" in text
    assert "rows (24,000 per task), one run of each, against" in text
    assert not re.search(r"(median|best) of 1\b| 1 runs", text, re.IGNORECASE)
    # the full run's figures still say what that run did
    full = json.loads((BENCHMARKS.parent / "docs" / "benchmarks" / "results.json").read_text())
    text = run_all.render(full, tmp_path, tmp_path)
    assert "`sleep20ms` runs `capacity x 100` elements (about 2 s at the" in text
    assert "bound 640 rows/s; `ordered_wait` best of 2, the others once):" in text
    assert "PyFlink's steady state, best of 2)" in text
    assert "commit latency with 1, 8 and 32 processes" in text
    assert "8,640 a day (a micro-batch every 10 s)" in text


def test_a_missed_checkpoint_target_names_the_tasks_the_run_had(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: "tasks this short (30,000 rows, about 6 s each)" whatever the run's tasks were
    saved = json.loads((BENCHMARKS.parent / "docs" / "benchmarks" / "results.json").read_text())
    sc = saved["spark"]["service_checkpoint"]
    sc["rows"] = 12_000  # a --quick run's
    sc["runs_s"] = {"none": [2.0], "checkpoint": [2.6]}  # 23 % cost: missed
    monkeypatch.setattr(run_all, "make_plots", lambda results, plots: {})
    text = run_all.render(saved, tmp_path, tmp_path)
    assert "weighs on tasks this short (6,000 rows, about 3 s each)" in text


def test_skipped_parts_do_not_fail_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report(tmp_path, monkeypatch, saved_run())  # no SystemExit


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_the_skip_pyflink_help_names_the_cache_in_use(tmp_path: Path) -> None:
    # before: it said ~/.cache/stateful-async-bench/pyflink-venv whatever
    # $STATEFUL_ASYNC_BENCH_CACHE said
    shown = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run_all.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "STATEFUL_ASYNC_BENCH_CACHE": str(tmp_path)},
    ).stdout
    assert f"into{tmp_path}/pyflink-venv:" in "".join(shown.split())  # however it wraps


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("spark_bench.py", ["--capacity", "0"], "--capacity: an integer >= 1 is needed; got '0'"),
        ("spark_bench.py", ["--json", "/nonexistent/out.json"], "does not exist; create it"),
        ("spark_bench.py", ["--json", "/tmp"], "'/tmp' is a directory; give a file name"),
        ("pyflink_bench.py", ["--rows", "0"], "--rows: an integer >= 1 is needed; got '0'"),
        ("pyflink_bench.py", ["--capacity", "-1"], "--capacity: an integer >= 1"),
        ("pyflink_bench.py", ["--latency-ms", "-5"], "latency_ms must be at least 0"),
        ("pyflink_bench.py", ["--json", "/nonexistent/out.json"], "does not exist"),
        ("checkpoint_bench.py", ["--json", "/nonexistent/out.json"], "does not exist"),
        ("operator_bench.py", ["--json", "/nonexistent/out.json"], "does not exist"),
        ("checkpoint_bench.py", ["--json", "/tmp"], "'/tmp' is a directory; give a file name"),
        ("sink_bench.py", ["--rows", "0"], "--rows: an integer >= 1 is needed; got '0'"),
        ("sink_bench.py", ["--partitions", "0"], "--partitions: an integer >= 1"),
        ("run_all.py", ["--from-json", "/nonexistent.json"], "cannot read /nonexistent.json"),
        ("run_all.py", ["--from-json", "{tmp}/broken.json"], "broken.json is not JSON"),
        ("run_all.py", ["--from-json", "{tmp}/other.json"], "other.json holds no run's figures"),
        ("run_all.py", ["--from-json", "{tmp}/run.json", "--out", "{tmp}"], "is a directory"),
        (
            "run_all.py",
            ["--from-json", "{tmp}/run.json", "--json", "{tmp}/again.json"],
            "--json keeps the figures of a run, and --from-json runs nothing: leave --json out",
        ),
    ],
)
def test_a_bad_option_value_is_refused_before_anything_runs(
    tmp_path: Path, script: str, args: list[str], message: str
) -> None:
    """At once, with exit 2 and the option named: not a traceback minutes into a run (a
    capacity the competitors refuse, a --json directory that is not there at the end), and
    not the default instead (--rows 0 ran the full 4M rows)."""
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "other.json").write_text("{}")
    (tmp_path / "run.json").write_text(json.dumps(saved_run()))
    argv = [sys.executable, str(BENCHMARKS / script), *(a.format(tmp=tmp_path) for a in args)]
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # it started a run: stop it as Ctrl-C does
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.communicate(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"{script} {' '.join(args)} started a run instead of refusing the value")
    assert process.returncode == 2, stderr
    assert message in stderr and "Traceback" not in stderr, stderr


def test_the_store_benchmark_writes_its_json_to_the_file_given(tmp_path: Path) -> None:
    # before: checkpoint_bench --json was a flag that printed JSON instead of the table,
    # where spark_bench's and pyflink_bench's --json PATH write a file and print the table
    out = tmp_path / "store.json"
    script = str(BENCHMARKS / "checkpoint_bench.py")
    done = subprocess.run(
        [sys.executable, script, "--micro-batches", "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith("expiry      micro-batches")
    figures = json.loads(out.read_text())
    assert [r["expiry"] for r in figures["micro_batch"]] == ["own files", "vacuum"]
    assert all(r["micro_batches"] == 40 for r in figures["micro_batch"])


def test_sink_output_without_figures_is_a_failed_part(monkeypatch: pytest.MonkeyPatch) -> None:
    def run_script(script: str, args: list[str], relay: str | None = None) -> tuple[int, str, str]:
        return 0, "nothing measured\n", ""

    monkeypatch.setattr(run_all, "run_script", run_script)
    assert run_all.sink_part(quick=True)["status"] == "failed"


# A benchmark script whose finally takes a moment (a work directory removed, Spark stopped).
FAKE_PART = """\
import pathlib, time
from stateful_async._signals import sigterm_unwinds

here = pathlib.Path(__file__).parent
with sigterm_unwinds():
    try:
        (here / "started").touch()
        time.sleep(60)
    finally:
        time.sleep(1)
        (here / "cleaned").touch()
"""

# run_all running one part, with the fake scripts in place of the benchmarks.
PART_DRIVER = """\
import pathlib, sys
sys.path.insert(0, sys.argv[1])
import run_all
from stateful_async._signals import sigterm_unwinds

run_all.HERE = pathlib.Path(sys.argv[2])
with sigterm_unwinds():
    if sys.argv[3] == "sink":
        run_all.sink_part(quick=False)
    else:
        run_all.child_part("spark_bench.py", [], run_all.ProcessWatch())
"""


@pytest.mark.parametrize(
    "part, group", [("sink", False), ("sink", True), ("spark", False), ("spark", True)]
)
def test_a_run_stopped_during_a_part_lets_its_script_clean_up(
    tmp_path: Path, part: str, group: bool
) -> None:
    """before: sink_part's subprocess.run killed sink_bench (SIGKILL) when run_all was
    stopped, before its finally removed its sink-bench-* directory; and after a group's
    SIGTERM, which the script got too, run_all sent it a second one at once, which stopped
    its finally half way."""
    for name in ("sink_bench.py", "spark_bench.py"):
        (tmp_path / name).write_text(FAKE_PART)
    driver = subprocess.Popen(
        [sys.executable, "-c", PART_DRIVER, str(BENCHMARKS), str(tmp_path), part],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists():
            assert time.monotonic() < deadline and driver.poll() is None, "no script started"
            time.sleep(0.1)
        if group:  # as a CI job cancelled, or Ctrl-C: the script gets the signal too
            os.killpg(driver.pid, signal.SIGTERM)
        else:  # kill <run_all's pid>
            driver.send_signal(signal.SIGTERM)
        assert driver.wait(60) == 128 + signal.SIGTERM
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
    assert (tmp_path / "cleaned").exists()


def test_a_pyflink_job_that_lost_rows_is_failed_not_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def job(python: Any, url: str, rows: int, capacity: int, outdir: str, pid: Any) -> Any:
        # the job "ran" without enriching one row (and the service saw no request at all)
        Path(outdir, "subtask-0.json").write_text(
            json.dumps({"count": rows - 1, "first": 0.0, "last": 1.0})
        )
        return {"wall_s": 1.0, "sampler": None}

    monkeypatch.setattr(pyflink_bench, "ensure_pyflink", lambda log: Path(sys.executable))
    monkeypatch.setattr(pyflink_bench, "_usable", lambda python: "2.test")
    monkeypatch.setattr(pyflink_bench, "_run_job", job)
    result = pyflink_bench.run(rows=10, log=lambda message: None)
    assert result["status"] == "failed", result


def test_a_pyflink_job_that_requested_one_key_twice_and_another_never_is_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Sampler:
        def between(self, start: float, end: float) -> float:
            return 1.0

    def job(python: Any, url: str, rows: int, capacity: int, outdir: str, pid: Any) -> Any:
        # as many requests and enriched rows as input rows, but key 0 twice and key 9 never
        for key in [0, *range(rows - 1)]:
            with urllib.request.urlopen(f"{url}/enrich?key={key}") as answer:
                assert answer.status == 200
        Path(outdir, "subtask-0.json").write_text(
            json.dumps({"count": rows, "first": 0.0, "last": 1.0})
        )
        return {"wall_s": 1.0, "sampler": Sampler()}

    monkeypatch.setattr(pyflink_bench, "ensure_pyflink", lambda log: Path(sys.executable))
    monkeypatch.setattr(pyflink_bench, "_usable", lambda python: "2.test")
    monkeypatch.setattr(pyflink_bench, "_run_job", job)
    result = pyflink_bench.run(rows=10, latency_ms=0, log=lambda message: None)
    assert result["status"] == "failed", result
    assert "(2 keys not requested exactly once)" in result["reason"]


def test_a_pyflink_check_that_hangs_is_skipped_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: the check's TimeoutExpired escaped run(): the part "failed" with no reason
    python = tmp_path / "pyflink-venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()

    def hang(args: list[str], **kwargs: Any) -> Any:
        raise subprocess.TimeoutExpired(args, kwargs["timeout"])

    monkeypatch.setattr(pyflink_bench, "cache_dir", lambda: tmp_path)
    monkeypatch.setenv("JAVA_HOME", str(tmp_path))
    monkeypatch.setattr(pyflink_bench.subprocess, "run", hang)
    result = pyflink_bench.run(rows=10, log=lambda message: None)
    assert result["status"] == "skipped", result
    assert result["reason"].startswith(f"{python} did not answer within 120 s"), result
    assert "--skip-pyflink" in result["reason"]


# pip, as the PyFlink virtual environment's Python: an install that fails partway
FAILING_PIP = """\
#!/bin/sh
if [ "$2" = pip ]; then
    echo "Collecting apache-flink<3,>=2"
    echo "  Downloading apache_flink-2.9.tar.gz (1.2 MB)"
    echo "ERROR: No matching distribution found for apache-flink-libraries" >&2
    exit 1
fi
exit 1  # the check: no PyFlink here
"""


def test_a_pyflink_install_shows_its_progress_and_says_why_it_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: pip ran silent for up to 30 minutes, and a failure did not say how to skip it
    python = tmp_path / "pyflink-venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAILING_PIP)
    python.chmod(0o755)
    monkeypatch.setattr(pyflink_bench, "cache_dir", lambda: tmp_path)
    monkeypatch.setenv("JAVA_HOME", str(tmp_path))
    said: list[str] = []
    result = pyflink_bench.run(rows=10, log=said.append)
    assert said[0].startswith("pyflink_bench: installing apache-flink>=2,<3 and aiohttp into")
    assert "at most 30 min; ./dev bench --skip-pyflink runs the suite without" in said[0]
    assert said[1:3] == [
        "pyflink_bench: pip: Collecting apache-flink<3,>=2",
        "pyflink_bench: pip: Downloading apache_flink-2.9.tar.gz (1.2 MB)",
    ]
    assert result["status"] == "skipped", result
    assert result["reason"] == (
        "installing apache-flink>=2,<3 failed (pip exit 1): Collecting apache-flink<3,>=2 | "
        "Downloading apache_flink-2.9.tar.gz (1.2 MB) | ERROR: No matching distribution found "
        "for apache-flink-libraries; ./dev bench --skip-pyflink runs the suite without the "
        "PyFlink part"
    )


# A PyFlink good enough for the benchmark's check, whose job runs until stopped, with a
# child of its own (as its JVM is): the job's first import (pyflink.common) never returns.
FAKE_PYFLINK = {
    "__init__.py": "from . import version\n",
    "version.py": "__version__ = '2.test'\n",
    "datastream.py": "class AsyncDataStream:\n    ordered_wait = None\n",
    "common.py": """\
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
time.sleep(600)
""",
}


def fake_pyflink_venv(tmp_path: Path) -> dict[str, str]:
    """pyflink_bench's cache with a "virtual environment" whose Python is this one, seeing
    FAKE_PYFLINK; returns the environment to run the benchmark in (its own TMPDIR)."""
    (tmp_path / "fake" / "pyflink").mkdir(parents=True)
    for name, text in FAKE_PYFLINK.items():
        (tmp_path / "fake" / "pyflink" / name).write_text(text)
    python = tmp_path / "cache" / "pyflink-venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    (tmp_path / "tmp").mkdir()
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]),
        "STATEFUL_ASYNC_BENCH_CACHE": str(tmp_path / "cache"),
        "TMPDIR": str(tmp_path / "tmp"),
        "JAVA_HOME": os.environ.get("JAVA_HOME", str(tmp_path)),  # PyFlink's, not needed here
    }


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_pyflink_benchmark_killed_leaves_no_job_running_and_no_directory(
    tmp_path: Path, signum: int
) -> None:
    """before: the job ran in a process group of its own, stopped by the benchmark's
    ``finally``; a benchmark killed (SIGKILL, a SIGTERM) left it running, JVM and all. Then
    it left its pyflink-bench-* directory (SIGTERM ran no ``finally``; nothing removed it
    after a SIGKILL)."""
    script = str(BENCHMARKS / "pyflink_bench.py")
    driver = subprocess.Popen(
        [sys.executable, script, "--rows", "10"], env=fake_pyflink_venv(tmp_path)
    )
    job: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 60
        while len(job) < 2:  # the job and its child
            assert time.monotonic() < deadline, "the fake job did not start"
            time.sleep(0.2)
            job = [p for p in psutil.Process(driver.pid).children(recursive=True) if _is_job(p)]
            job += [child for p in job for child in p.children()]
        assert list((tmp_path / "tmp").iterdir())  # its pyflink-bench-* directory
    finally:
        _stop_expecting_gone(driver, job, signum)
    assert list((tmp_path / "tmp").iterdir()) == []


def _is_job(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return "--job" in proc.cmdline()
    return False


def _stop_expecting_gone(
    driver: subprocess.Popen[Any], procs: list[psutil.Process], signum: int
) -> None:
    """Stops ``driver`` with ``signum`` and asserts ``procs`` (what it started) are gone
    within 30 s; whatever is left of either is killed, pass or fail."""
    try:
        driver.send_signal(signum)
        driver.wait(30)
        deadline = time.monotonic() + 30
        while _running(procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _running(procs) == []
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for proc in _running(procs):
            with contextlib.suppress(psutil.Error):
                proc.kill()


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    running = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):  # gone
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                running.append(proc)
    return running


def test_a_child_that_fails_says_why() -> None:
    """A figure measured in a child process of its own: when the child fails, the error (and
    with it the report's "failed" line) carries the child's own error, not only its exit
    status (CalledProcessError)."""
    import operator_bench

    with pytest.raises(RuntimeError, match="'sideways' is not a valid OutputMode"):
        operator_bench.peak_rss(10, 10, "sideways")
    with pytest.raises(RuntimeError, match="invalid literal for int"):
        checkpoint_bench._in_child("--long-task", "many", "kept")  # type: ignore[arg-type]


def test_a_committer_that_dies_before_ready_leaves_no_committer_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a file where committer 1's table must go: it fails before "ready", committer 0 does not
    (tmp_path / "bench" / "op").mkdir(parents=True)
    (tmp_path / "bench" / "op" / "subtask=00001").touch()
    monkeypatch.setattr(
        checkpoint_bench.tempfile,
        "TemporaryDirectory",
        lambda **_: contextlib.nullcontext(tmp_path),
    )
    try:
        with pytest.raises(RuntimeError, match="subtask=00001"):
            checkpoint_bench.concurrency([2], count=1, period=0.1)
        assert _live_committers() == []  # committer 0 was waiting for a go file never made
    finally:
        for proc in _live_committers():
            with contextlib.suppress(psutil.Error):
                proc.kill()
                proc.wait(10)


def test_a_committer_does_not_load_the_command_line() -> None:
    # before: checkpoint_bench imported the CLI (for its SIGTERM handling) at its top, so that
    # each of up to 32 committer processes loaded Typer and Rich before its first commit
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); import checkpoint_bench; "
            "print(sorted({'typer', 'rich', 'stateful_async.cli'} & sys.modules.keys()))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert loaded.strip() == "[]"


# A store benchmark whose committers are ready and which is killed before it says "go".
COMMITTERS_DRIVER = """\
import sys, time
sys.path.insert(0, sys.argv[1])
import checkpoint_bench

class NeverGo:
    def __init__(self, path): pass
    def touch(self):
        print("ready", flush=True)
        time.sleep(600)

checkpoint_bench.Path = NeverGo
checkpoint_bench.concurrency([2], count=1, period=0.1)
"""


def test_committers_whose_benchmark_was_killed_do_not_wait_for_ever(tmp_path: Path) -> None:
    # before: each polled for the go file every millisecond, for ever (the benchmark that
    # makes it, and removes their directory, was gone); then they left the directory
    driver = subprocess.Popen(
        [sys.executable, "-c", COMMITTERS_DRIVER, str(BENCHMARKS)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    committers: list[psutil.Process] = []
    try:
        assert driver.stdout is not None and driver.stdout.readline() == "ready\n"
        committers = [
            p for p in psutil.Process(driver.pid).children() if "--committer" in p.cmdline()
        ]
        assert len(committers) == 2
    finally:
        _stop_expecting_gone(driver, committers, signal.SIGKILL)
    assert list(tmp_path.iterdir()) == []


def test_a_committer_whose_benchmark_died_while_it_started_stops(tmp_path: Path) -> None:
    # before: it took os.getppid() after its imports as its benchmark's pid; a benchmark
    # killed meanwhile left it the pid of its new parent, so it polled for the go file for
    # ever. Its new parent here is this test, its benchmark a process already gone.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    root = tmp_path / "root"
    root.mkdir()
    committer = subprocess.Popen(
        [
            sys.executable,
            str(BENCHMARKS / "checkpoint_bench.py"),
            "--committer",
            str(root),
            "per-subtask",
            "0",
            "1",
            "0.1",
            str(root / "go"),
            str(gone.pid),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, stderr = committer.communicate(timeout=60)
    finally:
        if committer.poll() is None:
            committer.kill()
            committer.communicate()
    assert "the benchmark is gone; stopping" in stderr
    assert not root.exists()


def test_a_store_benchmark_stopped_with_sigterm_removes_its_directories(tmp_path: Path) -> None:
    # before: a SIGTERM ended it at once, no finally ran: its stores' directories stayed
    driver = subprocess.Popen(
        [sys.executable, str(BENCHMARKS / "checkpoint_bench.py"), "--micro-batches", "--quick"],
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.iterdir()):
            assert time.monotonic() < deadline and driver.poll() is None, "no store was made"
            time.sleep(0.1)
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(60) == 128 + signal.SIGTERM
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert list(tmp_path.iterdir()) == []


def _first_directory_of(args: list[str], tmp: Path) -> tuple[subprocess.Popen[Any], str]:
    """Starts ``python *args`` with ``tmp`` as its TMPDIR; returns it, once it has made a
    directory there named with its pid (as benchmarks/scratch.py names them), and that
    directory's name. (Not any new one: a run killed earlier may have left several.)"""
    driver = subprocess.Popen([sys.executable, *args], env={**os.environ, "TMPDIR": str(tmp)})
    deadline = time.monotonic() + 60
    while True:
        made = [p.name for p in tmp.iterdir() if f"-{driver.pid}-" in p.name]
        if made:
            return driver, made[0]
        if time.monotonic() > deadline or driver.poll() is not None:
            driver.kill()
            driver.wait()
            raise AssertionError(f"no directory named with its pid: {sorted(os.listdir(tmp))}")
        time.sleep(0.05)


def test_a_store_benchmark_names_its_directories_as_the_other_benchmarks_do(
    tmp_path: Path,
) -> None:
    # before: tmpXXXXXXXX, which told no one which program had left it
    args = [str(BENCHMARKS / "checkpoint_bench.py"), "--micro-batches", "--quick"]
    driver, name = _first_directory_of(args, tmp_path)
    driver.kill()
    driver.wait()
    assert name.startswith("checkpoint-bench-"), name


def test_a_benchmark_killed_with_sigkill_has_its_directories_removed_by_its_next_run(
    tmp_path: Path,
) -> None:
    # before: a SIGKILL runs no finally, and nothing removed them later: they stayed
    args = [str(BENCHMARKS / "checkpoint_bench.py"), "--micro-batches", "--quick"]
    killed, left = _first_directory_of(args, tmp_path)
    killed.kill()
    killed.wait()
    assert (tmp_path / left).is_dir()
    # the next run removes what the killed one left before it makes its own
    driver, _ = _first_directory_of(args, tmp_path)
    try:
        assert not [p for p in tmp_path.iterdir() if f"-{killed.pid}-" in p.name]
    finally:
        driver.kill()
        driver.wait()


def test_only_the_directories_of_runs_that_are_gone_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(scratch, "_SWEPT", set())
    gone = 4_194_305  # above any pid Linux gives (pid_max is at most 2**22)
    me, started = os.getpid(), scratch._start_time(os.getpid())
    ns = scratch._namespace()
    assert started and ns  # (Linux's /proc)
    removed = [
        f"x-bench-{ns}-{gone}-0-a",  # its run gone
        f"x-bench-{ns}-{gone}-{started}-b",
        f"x-bench-{ns}-{me}-{started - 1}-c",  # its pid now another process's, started later
    ]
    kept = [
        f"x-bench-{ns}-{me}-{started}-d",  # a live run's
        f"x-bench-{ns}-{me}-0-e",  # its pid alive, its start time unknown
        f"x-bench-{ns + 1}-{gone}-0-f",  # another pid namespace's (a container's): unknowable
        f"y-bench-{ns}-{gone}-0-g",  # another prefix's
        "x-bench-abcdefgh",  # not named by run_prefix
    ]
    for name in removed + kept:
        (tmp_path / name).mkdir()
    (tmp_path / f"x-bench-{ns}-{gone}-0-file").write_text("")  # no directory
    (tmp_path / f"x-bench-{ns}-{gone}-0-link").symlink_to(tmp_path / kept[0])
    kept += [f"x-bench-{ns}-{gone}-0-file", f"x-bench-{ns}-{gone}-0-link"]
    assert scratch.run_prefix("x-bench-") == f"x-bench-{ns}-{me}-{started}-"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


def _live_committers() -> list[psutil.Process]:
    """This process's descendants that are checkpoint_bench committers and still running
    (other tests' descendants may be exiting meanwhile: zombies, or gone, are skipped)."""
    live = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # ZombieProcess, NoSuchProcess, AccessDenied
            if "--committer" in proc.cmdline() and proc.status() != psutil.STATUS_ZOMBIE:
                live.append(proc)
    return live


def test_the_thread_pool_competitor_keeps_one_connection_per_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Like the asyncio competitors' pooled aiohttp connections: a new connection per request
    costs the service and the client a handshake per row that nobody else pays."""
    import http.client

    import pandas as pd

    from stateful_async.chaos import MockService, ServiceConfig, expected_enrichment

    connects = []
    connect = http.client.HTTPConnection.connect

    def counted(self: http.client.HTTPConnection) -> None:
        connects.append(self)
        connect(self)

    frames = [pd.DataFrame({"id": range(start, start + 40)}) for start in (0, 40)]
    with MockService(ServiceConfig(latency_ms=1)) as service:
        monkeypatch.setattr(http.client.HTTPConnection, "connect", counted)
        out = list(spark_bench.ThreadPoolPandas(service.url, 4)(iter(frames)))
        monkeypatch.undo()  # the service's own admin calls are not counted
        assert service.stats()["total"] == 80
    scores = [score for frame in out for score in frame["score"]]
    assert scores == [expected_enrichment(str(i))["score"] for i in range(80)]
    assert 1 <= len(connects) <= 4  # one per thread at most, for the whole task


def test_the_spark_report_tells_the_latency_shapes_and_the_bounded_case_apart() -> None:
    # before: "exponential latency, median 20 ms" (its median is 14 ms: 20 ms is its mean),
    # and two "ordered_wait (capacity 1024)" lines, one of them with max_in_flight 64
    saved = json.loads((BENCHMARKS.parent / "docs" / "benchmarks" / "results.json").read_text())
    lines = spark_bench.report(saved["spark"]).splitlines()
    assert "exponential latency, mean 20 ms" in lines
    assert "lognormal latency, median 20 ms, mean 33 ms" in lines
    wide = [line.split("  ")[0] for line in lines if line.startswith("ordered_wait (capacity 1024")]
    assert (
        wide
        == ["ordered_wait (capacity 1024)", "ordered_wait (capacity 1024, max_in_flight 64)"] * 2
    )


def test_interleaved_cases_take_turns_at_running_first() -> None:
    cases = ("none", "every 10k", "every 1k")
    orders = [spark_bench.rotated(cases, rep) for rep in range(6)]
    assert all(sorted(order) == sorted(cases) for order in orders)
    assert [order[0] for order in orders] == [*cases, *cases]
    assert spark_bench.rotated((), 3) == []


def test_the_long_task_benchmark_compares_a_reopened_table_object_with_a_kept_one() -> None:
    rows = checkpoint_bench.long_task(count=6, repeat=1)
    assert [r["table_object"] for r in rows] == ["reopened", "kept"]
    for r in rows:
        assert r["commits"] == 6 and r["first_ms"] > 0 and r["last_ms"] > 0
        assert r["total_s"] > 0 and r["peak_rss_mib"] > 50
    text = checkpoint_bench.report({"sizes": [], "concurrency": [], "long_task": rows})
    assert text.splitlines()[-2].startswith("reopened ") and " 6 " in text.splitlines()[-1]


def test_the_report_compares_the_long_tasks_table_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def row(variant: str, last_ms: float, total_s: float, rss: float) -> dict[str, Any]:
        return {
            "table_object": variant, "commits": 1000, "first_ms": 20.0, "last_ms": last_ms,
            "total_s": total_s, "peak_rss_mib": rss,
        }  # fmt: skip

    store = {
        "sizes": [],
        "concurrency": [],
        "long_task": [row("reopened", 40.0, 30.0, 250.0), row("kept", 160.0, 100.0, 400.0)],
    }
    report(tmp_path, monkeypatch, saved_run(store=store))
    text = (tmp_path / "benchmarks.md").read_text()
    assert "one subtask log committing 1,000 checkpoints in a row" in text
    assert "| reopened | 20.0 | 40.0 | 30.0 | 250 |" in text
    assert (
        "Reopened against kept: the last 100 commits 0.25x the latency, the whole task 0.30x "
        "the time, peak RSS 0.62x. The last 100 commits still take 2.0x the first 100"
    ) in text


def test_the_fences_benchmark_plants_earlier_runs_and_starts_new_ones(tmp_path: Path) -> None:
    from deltalake import DeltaTable

    from checkpoint import _store

    rows = checkpoint_bench.fences(runs_a_day=3, new_runs=2)
    assert [(r["fences_of"], r["earlier_runs"]) for r in rows] == [
        ("none", 0), ("a day", 3), ("a month", 90), ("a month, expired", 90)
    ]  # fmt: skip
    assert all(r["open_ms"] > 0 and r["new_run_ms"] > 0 for r in rows)
    text = checkpoint_bench.report({"sizes": [], "concurrency": [], "fences": rows})
    assert text.splitlines()[-1].startswith("a month, expired ") and " 90 " in text
    # What each variant plants: unstamped ids stay, ids stamped 8 days ago are dropped.
    now = int(time.time() * 1000)
    for stamp, kept in ((None, True), (now, True), (now - 8 * 86_400_000, False)):
        uri = checkpoint_bench._plant_fences(str(tmp_path / str(stamp)), 30, stamp)
        found = DeltaTable(uri).transaction_version(_store._app_id("query.29"))
        assert found == (1 if kept else None), stamp


def test_the_report_compares_a_days_fences_with_a_months(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def row(variant: str, runs: int, open_ms: float, new_run_ms: float) -> dict[str, Any]:
        return {
            "fences_of": variant, "earlier_runs": runs, "open_ms": open_ms,
            "new_run_ms": new_run_ms,
        }  # fmt: skip

    store = {
        "sizes": [],
        "concurrency": [],
        "fences": [
            row("none", 0, 5.0, 40.0),
            row("a day", 8640, 6.0, 50.0),
            row("a month", 259200, 90.0, 200.0),
            row("a month, expired", 259200, 5.5, 42.0),
        ],  # fmt: skip
    }
    report(tmp_path, monkeypatch, saved_run(store=store))
    text = (tmp_path / "benchmarks.md").read_text()
    assert "holding the app transactions of earlier runs, 8,640 a day" in text
    assert "| a month | 259,200 | 90.0 | 200.0 |" in text
    assert (
        "Against none: a new run takes 1.25x the time with a day's fences, 5.0x with a "
        "month's (opening the table 18.0x), 1.05x with a month's expired."
    ) in text


def test_the_log_files_benchmark_keeps_commit_files_in_one_variant_only() -> None:
    rows = checkpoint_bench.log_files(count=60)
    assert [(r["commit_files"], r["commits"]) for r in rows] == [("kept", 60), ("cleaned", 60)]
    kept, cleaned = rows
    # 60 commits, 3 expiries (an expiry and its vacuum: 3 commit files each), table creation
    assert kept["log_files"] == 69
    assert all(r["first_ms"] > 0 and r["last_ms"] > 0 for r in rows)
    assert cleaned["log_files"] <= kept["log_files"]  # 1 s: only what is older goes
    text = checkpoint_bench.report({"sizes": [], "concurrency": [], "log_files": rows})
    assert text.splitlines()[-1].startswith("cleaned ") and " 60 " in text.splitlines()[-1]


def test_the_micro_batch_benchmark_compares_how_expiries_delete_files() -> None:
    rows = checkpoint_bench.micro_batches(count=12, rounds=1)
    assert [(r["expiry"], r["micro_batches"]) for r in rows] == [
        ("own files", 12),
        ("vacuum", 12),
    ]
    own, vacuum = rows
    # 12 final checkpoints (the first creates the table); from the 4th on, each expires
    # the oldest run: one Delta commit, and a vacuum logs two more
    assert (own["delta_versions"], vacuum["delta_versions"]) == (12 + 9, 12 + 9 * 3)
    assert all(r["commit_ms"] > 0 and r["expire_ms"] > 0 for r in rows)
    text = checkpoint_bench.report({"sizes": [], "concurrency": [], "micro_batch": rows})
    assert text.splitlines()[-1].startswith("vacuum ") and " 12 " in text.splitlines()[-1]


def test_the_report_compares_kept_and_cleaned_commit_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def row(variant: str, files: int, last_ms: float) -> dict[str, Any]:
        return {
            "commit_files": variant, "commits": 3000, "log_files": files, "first_ms": 20.0,
            "last_ms": last_ms,
        }  # fmt: skip

    store = {
        "sizes": [],
        "concurrency": [],
        "log_files": [row("kept", 3485, 50.0), row("cleaned", 53, 25.0)],
    }
    report(tmp_path, monkeypatch, saved_run(store=store))
    text = (tmp_path / "benchmarks.md").read_text()
    assert "one subtask log committing 3,000 checkpoints as a streaming query's" in text
    assert "| kept | 3,485 | 20.0 | 50.0 |" in text
    assert (
        "Kept against cleaned: the last 200 commits 2.0x the latency, with 3,485 commit "
        "files against 53."
    ) in text
    assert "Micro-batches" not in text  # not measured: no section


def test_the_report_compares_how_micro_batch_expiries_delete_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def row(variant: str, expire_ms: float, versions: int) -> dict[str, Any]:
        return {
            "expiry": variant, "micro_batches": 100, "commit_ms": 20.0, "expire_ms": expire_ms,
            "delta_versions": versions,
        }  # fmt: skip

    store = {
        "sizes": [],
        "concurrency": [],
        "micro_batch": [row("own files", 15.0, 197), row("vacuum", 40.0, 391)],
        "micro_batch_note": "*separate measurement*, at abc1234",
    }
    report(tmp_path, monkeypatch, saved_run(store=store))
    text = (tmp_path / "benchmarks.md").read_text()
    assert "over 100 micro-batches (each a run of its own)" in text
    assert "interleaved; *separate measurement*, at abc1234." in text
    assert "| own files | 20.0 | 15.0 | 197 |" in text
    assert (
        "Own files against vacuum: the expiry 0.38x the time, the micro-batch's store work "
        "0.58x, 197 Delta versions against 391."
    ) in text


def test_a_child_process_measures_its_own_peak_rss_not_its_parents() -> None:
    # ru_maxrss in a child started by a big parent reported the parent's peak (vfork): every
    # memory figure measured in a child of run_all was at least run_all's own size.
    import peak_rss

    held = bytearray(400 * 2**20)
    held[:: 2**12] = b"\x01" * len(held[:: 2**12])  # touch every page: resident
    code = "from peak_rss import peak_rss_mib; print(peak_rss_mib())"
    child = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(peak_rss.__file__).parent,
        capture_output=True,
        text=True,
        check=True,
    )
    assert peak_rss.peak_rss_mib() > 400
    assert float(child.stdout) < 100, child.stdout  # a bare interpreter: about 10 MiB
    del held
