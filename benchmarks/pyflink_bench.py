"""PyFlink 2.x ``AsyncDataStream.ordered_wait`` on the Spark benchmark's workload.

The same mock service (constant latency, 20 ms, its own process on 127.0.0.1), the same
capacity per subtask (64), the same parallelism (2) and the same enrichment (look up
``id``, emit ``id, name, score, label``) with the same aiohttp client settings. Input is
Flink's ``NumberSequenceSource``; output goes to Flink's ``DiscardingSink`` (the
counterpart of Spark's ``noop`` sink in ``spark_bench.py``).

PyFlink is never a dependency of this project: the script creates its own virtual
environment under a cache directory (``$STATEFUL_ASYNC_BENCH_CACHE``, default
``~/.cache/stateful-async-bench/pyflink-venv``), installs ``apache-flink>=2,<3`` and
``aiohttp`` there with pip (first run only: several hundred MB, pip's progress printed, at
most 30 minutes; ``./dev bench --skip-pyflink`` runs the suite without this part), and runs
the job with that interpreter in a subprocess. If that cannot be done (no Java, pip fails,
the job fails) it prints why and reports ``skipped: <reason>``; a job that ran but did not
enrich every row once (the service's request count, the rows the function saw) reports
``failed: <reason>``. The job runs in a process group of its own (its JVM and Python
workers in it), ended when the job is done, fails or times out, and by the job itself
should this benchmark die first (killed, even with SIGKILL).

Two rates are reported: rows over the job's wall time (mini-cluster start-up, Python
worker start and all), and rows over the steady-state window measured inside the async
function (first call to last completion over both subtasks) — the latter leaves Flink's
start-up out and is the one compared with Spark's warm-session figures.

    python benchmarks/pyflink_bench.py            # 20k rows
    python benchmarks/pyflink_bench.py --quick    # 4k rows
    python benchmarks/pyflink_bench.py --job URL ROWS CAPACITY OUTDIR   # (inside the venv)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from options import output_file, positive_int  # benchmarks/ is on sys.path: these are scripts
from scratch import run_prefix

PYFLINK_REQUIREMENT = "apache-flink>=2,<3"
PARALLELISM = 2
JOB_TIMEOUT_S = 900
PROBE_TIMEOUT_S = 120  # asking the virtual environment's Python for its PyFlink version
INSTALL_TIMEOUT_S = 1800  # pip installing PyFlink (several hundred MB) on first use
SKIP_HINT = "./dev bench --skip-pyflink runs the suite without the PyFlink part"
# Set by _run_job for the job: its stdin is a pipe the benchmark holds, whose end of file
# means the benchmark died (see _stop_with_parent).
STOP_ON_STDIN_EOF = "PYFLINK_BENCH_STOP_ON_STDIN_EOF"


# -- the PyFlink job (runs inside the PyFlink virtual environment) -------------------------


def job(url: str, rows: int, capacity: int, outdir: str) -> None:
    import asyncio  # noqa: F401  (the async function runs on PyFlink's own event loop)

    from pyflink.common import Time, Types, WatermarkStrategy
    from pyflink.datastream import (
        AsyncDataStream,
        AsyncFunction,
        RuntimeContext,
        StreamExecutionEnvironment,
    )
    from pyflink.datastream.connectors.base import Sink
    from pyflink.datastream.connectors.number_seq import NumberSequenceSource
    from pyflink.java_gateway import get_gateway

    class Enrich(AsyncFunction):  # type: ignore[misc]
        """The Spark benchmark's enrichment, as a PyFlink AsyncFunction."""

        def __init__(self, url: str, outdir: str) -> None:
            self.url = url
            self.outdir = outdir

        def open(self, runtime_context: RuntimeContext) -> None:
            self.session: Any = None  # made on PyFlink's event loop, at the first call
            self.subtask = runtime_context.get_index_of_this_subtask()
            self.count = 0
            self.first: float | None = None
            self.last = 0.0

        async def async_invoke(self, value: int) -> list[tuple[int, str, float, str]]:
            import aiohttp

            if self.session is None:
                self.session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=1000),
                    timeout=aiohttp.ClientTimeout(total=None),
                )
            if self.first is None:
                self.first = time.time()
            async with self.session.get(f"{self.url}/enrich", params={"key": str(value)}) as r:
                r.raise_for_status()
                answer = await r.json()
            self.count += 1
            self.last = time.time()
            return [(value, f"user{value}", answer["score"], answer["label"])]

        def close(self) -> None:
            path = os.path.join(self.outdir, f"subtask-{self.subtask}.json")
            with open(path, "w") as handle:
                json.dump({"count": self.count, "first": self.first, "last": self.last}, handle)

    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(PARALLELISM)
    env.set_python_executable(sys.executable)
    source = env.from_source(
        NumberSequenceSource(0, rows - 1), WatermarkStrategy.no_watermarks(), "ids"
    )
    enriched = AsyncDataStream.ordered_wait(
        source,
        Enrich(url, outdir),
        Time.seconds(600),
        capacity=capacity,
        output_type=Types.TUPLE([Types.LONG(), Types.STRING(), Types.DOUBLE(), Types.STRING()]),
    )
    discard = get_gateway().jvm.org.apache.flink.streaming.api.functions.sink.v2.DiscardingSink()
    enriched.sink_to(Sink(discard))
    start = time.perf_counter()
    env.execute("pyflink-async-bench")
    wall = time.perf_counter() - start
    import pyflink

    print(json.dumps({"wall_s": wall, "pyflink_version": pyflink.version.__version__}))


def _stop_with_parent(outdir: str) -> None:
    """In the job: remove its output directory and end its process group (this process,
    the JVM, the Python workers) once the benchmark that started it is gone. The benchmark
    does both itself when it ends, fails, times out or gets a SIGTERM, but a benchmark
    killed with SIGKILL cannot (no ``finally`` runs); the pipe it holds as the job's stdin
    closes however it dies, as the mock service's does (``--stop-on-stdin-eof``)."""
    if os.environ.get(STOP_ON_STDIN_EOF) != "1" or os.getpgrp() != os.getpid():
        return  # not started by _run_job, in a process group of its own: nothing to watch

    def watch() -> None:
        while os.read(0, 4096):
            pass
        shutil.rmtree(outdir, ignore_errors=True)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="benchmark-watch").start()


# -- the driver side (runs in the project's environment) -----------------------------------


def cache_dir() -> Path:
    root = os.environ.get("STATEFUL_ASYNC_BENCH_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "stateful-async-bench"
    )
    return Path(root)


class Skip(Exception):
    """PyFlink cannot be benchmarked here; the message says why."""


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _probe(python: Path, code: str) -> subprocess.CompletedProcess[str]:
    """``python -c code``; a ``Skip`` if it cannot be run or does not answer in time (an
    import that hangs), rather than an error that fails the part."""
    try:
        return subprocess.run(
            [str(python), "-c", code], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise Skip(
            f"{python} did not answer within {PROBE_TIMEOUT_S} s when asked for its PyFlink "
            f"(remove {python.parent.parent} to have it installed afresh); {SKIP_HINT}"
        ) from None
    except OSError as exc:
        raise Skip(f"cannot run {python}: {exc}; {SKIP_HINT}") from None


def _usable(python: Path) -> str | None:
    """The PyFlink version if ``python`` has PyFlink with a Python ordered_wait and aiohttp."""
    if not python.exists():
        return None
    probe = _probe(
        python,
        "import pyflink, aiohttp; from pyflink.datastream import AsyncDataStream; "
        "assert hasattr(AsyncDataStream, 'ordered_wait'), 'no ordered_wait'; "
        "print(pyflink.version.__version__)",
    )
    return probe.stdout.strip() if probe.returncode == 0 else None


def _pip_install(python: Path, log: Any) -> None:
    """pip installs PyFlink and aiohttp into ``python``'s environment, relaying its progress
    (each package collected, downloaded, installed) to ``log``: the download is several
    hundred MB. A ``Skip`` with pip's last lines if it fails or exceeds INSTALL_TIMEOUT_S."""
    process = subprocess.Popen(
        [str(python), "-m", "pip", "install", "--progress-bar", "off"]
        + [PYFLINK_REQUIREMENT, "aiohttp"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    timed_out = threading.Event()

    def time_out() -> None:
        timed_out.set()
        process.kill()

    timer = threading.Timer(INSTALL_TIMEOUT_S, time_out)
    timer.start()
    tail: list[str] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            line = line.strip()
            if line:
                tail = [*tail[-2:], line]
            if line.startswith(("Collecting", "Downloading", "Installing", "Successfully")):
                log(f"pyflink_bench: pip: {line}")
        process.wait()
    finally:
        timer.cancel()
        if process.poll() is None:  # stopped (Ctrl-C, SIGTERM): so is pip
            process.kill()
            process.wait()
    if process.returncode == 0:
        return
    if timed_out.is_set():
        raise Skip(
            f"installing {PYFLINK_REQUIREMENT} timed out after {INSTALL_TIMEOUT_S} s; {SKIP_HINT}"
        )
    raise Skip(
        f"installing {PYFLINK_REQUIREMENT} failed (pip exit {process.returncode}): "
        f"{' | '.join(tail) or 'no output'}; {SKIP_HINT}"
    )


def ensure_pyflink(log: Any = print) -> Path:
    """The interpreter of a virtual environment with PyFlink 2.x and aiohttp; installs it on
    first use. Raises ``Skip`` with the reason when that is not possible."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        raise Skip("no Java runtime (java not on PATH, JAVA_HOME unset); PyFlink needs Java 11+")
    venv = cache_dir() / "pyflink-venv"
    python = _venv_python(venv)
    if _usable(python):
        return python
    log(
        f"pyflink_bench: installing {PYFLINK_REQUIREMENT} and aiohttp into {venv} with pip "
        f"(first run only: several hundred MB, at most {INSTALL_TIMEOUT_S // 60} min; "
        f"{SKIP_HINT})"
    )
    venv.parent.mkdir(parents=True, exist_ok=True)
    if not python.exists():
        try:
            subprocess.run(
                [sys.executable, "-m", "venv", str(venv)],
                check=True,
                capture_output=True,
                text=True,
                timeout=300,
            )
        except subprocess.CalledProcessError as exc:
            tail = (exc.stderr or exc.stdout or "").strip().splitlines()[-3:]
            raise Skip(f"creating {venv} failed: {' | '.join(tail)}; {SKIP_HINT}") from exc
        except subprocess.TimeoutExpired as exc:
            raise Skip(f"creating {venv} timed out after {exc.timeout} s; {SKIP_HINT}") from exc
    _pip_install(python, log)
    if not _usable(python):
        probe = _probe(
            python,
            "from pyflink.datastream import AsyncDataStream as A; "
            "print(hasattr(A, 'ordered_wait'))",
        )
        raise Skip(
            "the installed PyFlink has no Python AsyncDataStream.ordered_wait "
            f"({(probe.stdout or probe.stderr).strip()[-200:]})"
        )
    return python


class CpuSampler:
    """Samples, every 0.2 s, the CPU time of the job's process tree (client, JVM, Python
    workers) plus the mock service's, so that the CPU spent inside the steady-state window
    can be interpolated: rows per CPU-second is robust to other load on a shared machine."""

    def __init__(self, pid: int, service_pid: int | None) -> None:
        import psutil

        self.psutil = psutil
        self.pid = pid
        self.service_pid = service_pid
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _total(self) -> float:
        total = 0.0
        try:
            root = self.psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except self.psutil.Error:
            procs = []
        if self.service_pid is not None:
            try:
                procs.append(self.psutil.Process(self.service_pid))
            except self.psutil.Error:
                pass
        for proc in procs:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except self.psutil.Error:
                continue
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.samples.append((time.time(), self._total()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> float | None:
        """CPU seconds spent between two wall-clock times (linear interpolation)."""

        def at(t: float) -> float | None:
            for (t0, c0), (t1, c1) in zip(self.samples, self.samples[1:], strict=False):
                if t0 <= t <= t1:
                    return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c0
            return None

        a, b = at(start), at(end)
        return None if a is None or b is None else b - a


def _run_job(
    python: Path, url: str, rows: int, capacity: int, outdir: str, service_pid: int | None
) -> dict[str, Any]:
    job_stdin, held = os.pipe()  # held open while this process lives: _stop_with_parent
    try:
        process = subprocess.Popen(
            [str(python), __file__, "--job", url, str(rows), str(capacity), outdir],
            stdin=job_stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: the JVM and Python workers in it
            env={**os.environ, STOP_ON_STDIN_EOF: "1"},
        )
    except BaseException:
        os.close(held)
        raise
    finally:
        os.close(job_stdin)
    sampler = CpuSampler(process.pid, service_pid)
    try:
        out, err = process.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise Skip(f"the PyFlink job did not finish within {JOB_TIMEOUT_S} s") from None
    finally:
        sampler.stop()
        _stop_group(process.pid)
        os.close(held)
    if process.returncode != 0:
        lines = [line for line in err.strip().splitlines() if line.strip()]
        cause = next(
            (line for line in reversed(lines) if "Error" in line or "Exception" in line),
            lines[-1] if lines else "no output",
        )
        raise Skip(f"the PyFlink job failed (exit {process.returncode}): {cause.strip()[:300]}")
    figures = json.loads(out.strip().splitlines()[-1])
    figures["sampler"] = sampler
    return figures


def _stop_group(pgid: int) -> None:
    """The job's process group is ours (start_new_session): end what is left of it."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(
    quick: bool = False,
    capacity: int = 64,
    latency_ms: float = 20.0,
    rows: int | None = None,
    log: Any = print,
) -> dict[str, Any]:
    rows = rows or (4_000 if quick else 20_000)
    result: dict[str, Any] = {
        "rows": rows,
        "capacity": capacity,
        "latency_ms": latency_ms,
        "parallelism": PARALLELISM,
        "api": "pyflink.datastream.AsyncDataStream.ordered_wait",
    }
    try:
        python = ensure_pyflink(log)
        result["pyflink_version"] = _usable(python)
        from stateful_async.chaos import MockService, ServiceConfig

        with MockService(ServiceConfig(latency_ms=latency_ms)) as service:
            with tempfile.TemporaryDirectory(prefix=run_prefix("pyflink-bench-")) as outdir:
                figures = _run_job(python, service.url, rows, capacity, outdir, service.pid)
                subtasks = [
                    json.loads(p.read_text()) for p in sorted(Path(outdir).glob("subtask-*.json"))
                ]
            counts = service.counts()
    except Skip as exc:
        log(f"pyflink_bench: skipped: {exc}")
        result.update(status="skipped", reason=str(exc))
        return result
    counted = sum(s["count"] for s in subtasks)
    total = sum(counts.values())
    # every input key requested once, none twice and none left out (a duplicate and a
    # missing row would cancel out in the totals)
    wrong = sum(counts.get(str(key), 0) != 1 for key in range(rows)) + sum(
        not key.isdigit() or int(key) >= rows for key in counts
    )
    if wrong or total != rows or counted != rows:  # it ran and measured something else
        result.update(
            status="failed",
            reason=f"the job enriched {counted} rows and the service saw {total} requests "
            f"for {rows} input rows ({wrong} keys not requested exactly once)",
        )
        return result
    start, end = min(s["first"] for s in subtasks), max(s["last"] for s in subtasks)
    window = end - start
    cpu = figures["sampler"].between(start, end)
    result.update(
        cpu_s=cpu,
        rows_per_cpu_s=rows / cpu if cpu else None,
        cores_busy=cpu / window if cpu else None,
    )
    result.update(
        status="ok",
        wall_s=figures["wall_s"],
        window_s=window,
        rows_per_s_wall=rows / figures["wall_s"],
        rows_per_s=rows / window,
        subtasks=len(subtasks),
    )
    return result


def report(result: dict[str, Any]) -> str:
    if result["status"] != "ok":
        return f"PyFlink ordered_wait: {result['status']}: {result['reason']}"
    return (
        f"PyFlink {result['pyflink_version']} {result['api']}, parallelism "
        f"{result['parallelism']}, capacity {result['capacity']}, {result['latency_ms']:g} ms:\n"
        f"  {result['rows']:,} rows, steady state {result['window_s']:.1f} s -> "
        f"{result['rows_per_s']:,.0f} rows/s; job wall {result['wall_s']:.1f} s -> "
        f"{result['rows_per_s_wall']:,.0f} rows/s\n"
        f"  CPU in the steady state (job processes + service): "
        f"{result['cpu_s'] or float('nan'):.1f} s -> {result['rows_per_cpu_s'] or 0:,.0f} rows "
        "per CPU-second"
    )


def _latency_ms(text: str) -> float:
    """The mock service's latency, refused as the service refuses it."""
    from stateful_async import ConfigurationError
    from stateful_async.chaos import ServiceConfig

    try:
        latency = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a number of milliseconds is needed; got {text!r}"
        ) from None
    try:
        return ServiceConfig(latency_ms=latency).latency_ms
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--job":
        _stop_with_parent(sys.argv[5])
        job(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4k rows instead of 20k")
    parser.add_argument("--capacity", type=positive_int, default=64)
    parser.add_argument("--latency-ms", type=_latency_ms, default=20.0)
    parser.add_argument("--rows", type=positive_int, default=None)
    parser.add_argument(
        "--json", metavar="PATH", type=output_file, help="also write the figures as JSON"
    )
    args = parser.parse_args()
    # not at the top: the job's Python has no stateful_async
    from stateful_async._signals import sigterm_unwinds

    # a SIGTERM (kill, a timeout) unwinds as Ctrl-C does: the finally blocks stop what the
    # run started and remove its temporary directories
    with sigterm_unwinds():
        result = run(args.quick, args.capacity, args.latency_ms, args.rows)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(report(result))


if __name__ == "__main__":
    main()
