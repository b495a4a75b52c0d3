"""Snapshot store latency: commits, loads, concurrency, long tasks, fences, log files.

    python benchmarks/checkpoint_bench.py           # full run (~10 minutes)
    python benchmarks/checkpoint_bench.py --quick

1. Commit latency of one checkpoint holding 100, 10k and 100k in-flight elements (median
   of several commits), and the latency of loading and restoring it.
2. Commit latency with 1, 8 and 32 processes committing at once, each to its own subtask
   (this store's layout: one Delta table per subtask), against the same processes
   appending to ONE shared Delta table (the layout this store avoids). Committers are paced
   like periodic checkpoints (one every 2 s, 1 s with ``--quick``, random phase), so the figure
   shows commit contention rather than 32 processes sharing 2 CPU cores.
3. A long task: one subtask log committing 1,000 checkpoints in a row (100 in-flight
   elements and 20 results each), in a process of its own: commit latency of the first
   and the last 100, and the process's peak RSS. Once as the store works (its Delta table
   object opened afresh every 100 versions) and once with one object kept for every commit,
   interleaved.
4. Earlier runs' fences: a task starting a new run (taking it over and committing its first
   checkpoint, as a streaming query's task does every micro-batch) on a subtask table that
   holds the app transactions of earlier runs, 8,640 a day (a micro-batch every 10 s): a
   day's (what the store's retention keeps), a month's (what it kept before they expired,
   growing every day), a month's expired, none; and how long opening that table takes.
5. Delta log files: one subtask log committing 3,000 checkpoints as a streaming query's
   tasks do (a new run every 5 checkpoints, retention every 20), in a process of its own:
   commit latency of the first and the last 200, once with every commit file kept (as
   while they are younger than the table's log retention) and once with a retention of
   1 s (older commit files deleted at each Delta log checkpoint, as after the retention).
6. Micro-batches: what one partition's task of a streaming micro-batch spends on the
   store at its end, a final checkpoint (100 results) and the expiry after it (retain 3),
   over a run of micro-batches: the expiry deleting just the files its commit removed (as
   a task's does) against vacuuming the table (as a task's did, and `expire` without a
   run still does), interleaved; medians, and the Delta versions each left.

    python benchmarks/checkpoint_bench.py --micro-batches   # section 6 alone (~1 minute)
    python benchmarks/checkpoint_bench.py --json out.json   # the figures as JSON too
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
from child import child_output  # benchmarks/ is on sys.path: these are scripts
from options import output_file
from peak_rss import peak_rss_mib
from scratch import run_prefix

from checkpoint import SnapshotStore
from stateful_async import StreamRecord, Watermark
from stateful_async._signals import sigterm_unwinds

INPUT = pa.schema(
    [
        ("id", pa.int64()),
        ("user", pa.string()),
        ("amount", pa.float64()),
        ("tags", pa.list_(pa.string())),
    ]
)
OUTPUT = pa.schema([("id", pa.int64()), ("score", pa.float64())])


def elements(count: int) -> list[Any]:
    items: list[Any] = [
        StreamRecord(
            {"id": i, "user": f"user-{i % 997}", "amount": i * 0.25, "tags": ["a", "b"]}, i
        )
        for i in range(count)
    ]
    items.append(Watermark(count))
    return items


def results(count: int) -> pa.Table:
    return pa.table({"id": pa.array(range(count), pa.int64()), "score": pa.array([0.5] * count)})


def _scratch() -> tempfile.TemporaryDirectory[str]:
    """A new temporary directory of this run, named as the other benchmarks' are."""
    return tempfile.TemporaryDirectory(prefix=run_prefix("checkpoint-bench-"))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def sizes(repeat: int, sizes_: list[int]) -> list[dict[str, Any]]:
    # An untimed first write: the process's first Delta write pays delta-rs's one-off
    # start-up (hundreds of ms), which is no table's creation.
    with _scratch() as root:
        SnapshotStore(root).subtask("warm-up", "op", 0).commit(
            "run", 1, elements(10), results(10), input_schema=INPUT, output_schema=OUTPUT,
            position=10,
        )  # fmt: skip
    rows = []
    for size in sizes_:
        with _scratch() as root:
            log = SnapshotStore(root).subtask("bench", "op", 0)
            batch = elements(size)
            commits, loads, restores = [], [], []
            start = time.perf_counter()
            parent = log.commit(
                "run",
                1,
                batch,
                results(min(size, 1000)),
                input_schema=INPUT,
                output_schema=OUTPUT,
                position=size,
            ).ref
            create = time.perf_counter() - start  # the first commit also creates the table
            for ckpt in range(2, repeat + 2):
                start = time.perf_counter()
                parent = log.commit(
                    "run",
                    ckpt,
                    batch,
                    results(min(size, 1000)),
                    input_schema=INPUT,
                    output_schema=OUTPUT,
                    position=ckpt * size,
                    parent=parent,
                ).ref
                commits.append(time.perf_counter() - start)
                fresh = SnapshotStore(root).subtask("bench", "op", 0)
                start = time.perf_counter()
                loaded = fresh.load(ckpt)
                loads.append(time.perf_counter() - start)
                start = time.perf_counter()
                restored = fresh.restore(ckpt)
                restores.append(time.perf_counter() - start)
                # a timing of a wrong answer is no figure
                if len(loaded.elements) != len(batch) or len(restored.elements) != len(batch):
                    raise RuntimeError(f"checkpoint {ckpt} of {size} elements read back wrong")
                if len(restored.results) != ckpt * min(size, 1000):
                    raise RuntimeError(f"checkpoint {ckpt}'s chain restored the wrong results")
            rows.append(
                {
                    "in_flight": size,
                    "first_commit_ms": create * 1000,
                    "commit_ms": statistics.median(commits) * 1000,
                    "load_ms": statistics.median(loads) * 1000,
                    "restore_ms": statistics.median(restores) * 1000,
                }
            )
    return rows


def _committer(
    root: str, layout: str, subtask: int, count: int, period: float, go: str, benchmark: int
) -> None:
    """``benchmark`` is the pid of the benchmark that started it, which makes the go file:
    given, not read with os.getppid() here, which is already 1 (or a subreaper's) if the
    benchmark was killed while this process was starting."""
    from deltalake import write_deltalake

    log = SnapshotStore(root).subtask("bench", "op", subtask)
    batch = elements(100)
    shared = os.path.join(root, "shared")
    # Checkpoint 1 creates the subtask's table before the clock starts: table creation
    # happens once per subtask and is reported by the size benchmark.
    parent = log.commit(
        "run", 1, batch, results(20), input_schema=INPUT, output_schema=OUTPUT, position=100
    ).ref
    print("ready", flush=True)
    while not os.path.exists(go):
        if os.getppid() != benchmark:  # orphaned: the benchmark was killed before "go"
            shutil.rmtree(root, ignore_errors=True)  # its temporary directory, which it left
            sys.exit("checkpoint_bench committer: the benchmark is gone; stopping")
        time.sleep(0.001)
    rng = random.Random(subtask)
    time.sleep(rng.uniform(0, period))
    latencies = []
    next_at = time.monotonic()
    for ckpt in range(2, count + 2):
        start = time.perf_counter()
        if layout == "per-subtask":
            parent = log.commit(
                "run",
                ckpt,
                batch,
                results(20),
                input_schema=INPUT,
                output_schema=OUTPUT,
                position=ckpt * 100,
                parent=parent,
            ).ref
        else:
            write_deltalake(
                shared,
                pa.table(
                    {"subtask": [subtask] * 100, "ckpt": [ckpt] * 100, "payload": ["x" * 40] * 100}
                ),
                mode="append",
            )
        latencies.append(time.perf_counter() - start)
        next_at += period
        time.sleep(max(0.0, next_at - time.monotonic()))
    print(json.dumps(latencies))


def _long_task(root: str, count: int, keep_table: bool) -> None:
    from checkpoint import _store

    if keep_table:
        _store._REOPEN_VERSIONS = 10**9  # type: ignore[attr-defined]
    log = SnapshotStore(root).subtask("bench", "op", 0)
    batch, out = elements(100), results(20)
    parent = None
    latencies = []
    for ckpt in range(1, count + 1):
        start = time.perf_counter()
        meta = log.commit(
            "run", ckpt, batch, out, input_schema=INPUT, output_schema=OUTPUT,
            position=ckpt * 100, parent=parent,
        )  # fmt: skip
        latencies.append(time.perf_counter() - start)
        parent = meta.ref
    print(json.dumps({"latencies": latencies, "peak_rss_mib": peak_rss_mib()}))


def _log_files(root: str, count: int, cleaned: bool) -> None:
    from checkpoint import _store

    retention = "interval 1 second" if cleaned else "interval 1 day"
    _store._TABLE_CONFIGURATION = {  # type: ignore[attr-defined]
        **_store._TABLE_CONFIGURATION,
        "delta.logRetentionDuration": retention,
    }
    log = SnapshotStore(root).subtask("bench", "op", 0)
    batch, out = elements(10), results(2)
    latencies = []
    for ckpt in range(1, count + 1):
        start = time.perf_counter()
        log.commit(
            f"run.{ckpt // 5}", ckpt, batch, out, input_schema=INPUT, output_schema=OUTPUT,
            position=ckpt,
        )  # fmt: skip
        if ckpt % 20 == 0:
            log.expire(2)
        latencies.append(time.perf_counter() - start)
    files = sum(name.endswith(".json") for name in os.listdir(os.path.join(log.uri, "_delta_log")))
    print(json.dumps({"latencies": latencies, "log_files": files}))


def micro_batches(count: int, rounds: int) -> list[dict[str, Any]]:
    """Section 6: per micro-batch, the final checkpoint's commit and the expiry after it,
    by how the expiry deletes files (see the module docstring)."""
    measured: dict[str, list[tuple[float, float, int]]] = {"own files": [], "vacuum": []}
    for _ in range(rounds):
        for variant, runs in measured.items():
            with _scratch() as root:
                log = SnapshotStore(root).subtask("bench", "op", 0)
                commits, expiries = [], []
                for batch in range(count):
                    run_id = f"query.batch{batch}"  # each micro-batch is a run of its own
                    start = time.perf_counter()
                    log.commit(
                        run_id, 1, [], results(100), input_schema=INPUT, output_schema=OUTPUT,
                        position=100, final=True,
                    )  # fmt: skip
                    middle = time.perf_counter()
                    log.expire(3, run_id=run_id if variant == "own files" else None)
                    commits.append(middle - start)
                    expiries.append(time.perf_counter() - middle)
                version = log._open(refresh=True).version()  # type: ignore[union-attr]
                skip = min(10, count // 4)  # the table's first ones: nothing to expire yet
                runs.append(
                    (
                        statistics.median(commits[skip:]),
                        statistics.median(expiries[skip:]),
                        version + 1,
                    )
                )
    return [
        {
            "expiry": variant,
            "micro_batches": count,
            "commit_ms": statistics.median(r[0] for r in runs) * 1000,
            "expire_ms": statistics.median(r[1] for r in runs) * 1000,
            "delta_versions": runs[0][2],
        }
        for variant, runs in measured.items()
    ]


def _in_child(part: str, count: int, variant: str) -> dict[str, Any]:
    """What this script prints for ``part`` run in a process of its own, in a fresh
    directory (its peak RSS is its own, and module settings a variant changes stay there)."""
    with _scratch() as root:
        out = child_output([__file__, part, root, str(count), variant])
    return json.loads(out.splitlines()[-1])  # type: ignore[no-any-return]


def log_files(count: int) -> list[dict[str, Any]]:
    """Commit latency with every Delta commit file kept against older ones cleaned."""
    rows = []
    window = min(200, count // 2)
    for variant in ("kept", "cleaned"):
        measured = _in_child("--log-files", count, variant)
        lat = measured["latencies"]
        rows.append(
            {
                "commit_files": variant,
                "commits": count,
                "log_files": measured["log_files"],
                "first_ms": statistics.median(lat[:window]) * 1000,
                "last_ms": statistics.median(lat[-window:]) * 1000,
            }
        )
    return rows


def long_task(count: int, repeat: int) -> list[dict[str, Any]]:
    """Each variant ``repeat`` times, interleaved; the best run of each (least disturbed)."""
    runs: dict[str, list[dict[str, Any]]] = {"reopened": [], "kept": []}
    for _ in range(repeat):
        for variant in runs:
            runs[variant].append(_in_child("--long-task", count, variant))
    rows = []
    window = min(100, count // 2)
    for variant, measured in runs.items():
        best = min(measured, key=lambda m: sum(m["latencies"]))
        lat = best["latencies"]
        rows.append(
            {
                "table_object": variant,
                "commits": count,
                "first_ms": statistics.median(lat[:window]) * 1000,
                "last_ms": statistics.median(lat[-window:]) * 1000,
                "total_s": sum(lat),
                "peak_rss_mib": best["peak_rss_mib"],
            }
        )
    return rows


def _plant_fences(root: str, runs: int, stamp_ms: int | None) -> str:
    """A subtask table with one checkpoint and the fences ``runs`` earlier runs left (their
    checkpoint id and their claim), stamped ``stamp_ms`` (None: unstamped), in a Delta log
    checkpoint as delta-rs writes one every 100 commits. Returns the table's URI."""
    from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

    from checkpoint import _layout, _store

    log = SnapshotStore(root).subtask("bench", "op", 0)
    log.commit(
        "seed", 1, elements(100), results(20), input_schema=INPUT, output_schema=OUTPUT,
        position=100,
    )  # fmt: skip
    for start in range(0, runs, 5_000):
        table = DeltaTable(log.uri)
        fences = []
        for run in range(start, min(runs, start + 5_000)):
            run_id = f"query.{run}"
            fences.append(Transaction(_store._app_id(run_id), 1, stamp_ms))
            fences.append(Transaction(_store._claim_app_id(run_id), 0, stamp_ms))
        write_deltalake(
            table,
            _layout.delta_dataset(table).schema.empty_table(),
            mode="append",
            commit_properties=CommitProperties(app_transactions=fences),
        )
    DeltaTable(log.uri).create_checkpoint()
    return log.uri


def fences(runs_a_day: int, new_runs: int) -> list[dict[str, Any]]:
    """Per variant: the median latency of a new run's take-over and first commit, each by
    a log of its own (a task's), and the median time to open the table. The variants: no
    earlier runs; a day's (what the table holds with the store's retention); a month's,
    live (what the store kept before, growing every day); a month's, expired."""
    from deltalake import DeltaTable

    now = int(time.time() * 1000)
    rows = []
    for variant, planted, stamp in [
        ("none", 0, None),
        ("a day", runs_a_day, now),
        ("a month", 30 * runs_a_day, now),
        ("a month, expired", 30 * runs_a_day, now - 31 * 86_400_000),
    ]:
        with _scratch() as root:
            uri = _plant_fences(root, planted, stamp)
            opens, starts = [], []
            for run in range(new_runs):
                begin = time.perf_counter()
                DeltaTable(uri)
                opens.append(time.perf_counter() - begin)
                log = SnapshotStore(root).subtask("bench", "op", 0)
                begin = time.perf_counter()
                log.take_over(f"new.{run}", owner=f"attempt-{run}")
                log.commit(
                    f"new.{run}", 1, elements(100), results(20), input_schema=INPUT,
                    output_schema=OUTPUT, position=100,
                )  # fmt: skip
                starts.append(time.perf_counter() - begin)
            rows.append(
                {
                    "fences_of": variant,
                    "earlier_runs": planted,
                    "open_ms": statistics.median(opens) * 1000,
                    "new_run_ms": statistics.median(starts) * 1000,
                }
            )
    return rows


def concurrency(committers: list[int], count: int, period: float) -> list[dict[str, Any]]:
    rows = []
    for layout in ("per-subtask", "shared-table"):
        for n in committers:
            with _scratch() as root:
                if layout == "shared-table":  # created up front: creation is not what we time
                    from deltalake import write_deltalake

                    write_deltalake(
                        os.path.join(root, "shared"),
                        pa.table(
                            {
                                "subtask": pa.array([], pa.int64()),
                                "ckpt": pa.array([], pa.int64()),
                                "payload": pa.array([], pa.string()),
                            }
                        ),
                    )
                go = os.path.join(root, "go")
                procs = [
                    subprocess.Popen(
                        [
                            sys.executable,
                            __file__,
                            "--committer",
                            root,
                            layout,
                            str(i),
                            str(count),
                            str(period),
                            go,
                            str(os.getpid()),
                        ],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                    for i in range(n)
                ]
                try:
                    for proc in procs:  # every committer is ready; the go file starts them together
                        assert proc.stdout is not None
                        while proc.stdout.readline().strip() != "ready":
                            if proc.poll() is not None:
                                raise RuntimeError(
                                    proc.stderr.read() if proc.stderr else "committer died"
                                )
                    Path(go).touch()
                    latencies: list[float] = []
                    failures = 0
                    for proc in procs:
                        out, err = proc.communicate(timeout=900)
                        if proc.returncode != 0:
                            failures += 1
                            lines = err.strip().splitlines()
                            sys.stderr.write(
                                f"{layout} committer failed: {lines[-1] if lines else '?'}\n"
                            )
                            continue
                        latencies.extend(json.loads(out.strip().splitlines()[-1]))
                finally:  # a committer left waiting for a go file that never comes
                    for proc in procs:
                        if proc.poll() is None:
                            proc.kill()
                            proc.communicate()
                if failures and layout == "per-subtask":
                    # each commits to a table of its own: a failure is the store's bug, not
                    # contention, and its latencies would be missing from the figures
                    raise RuntimeError(
                        f"{failures} of {n} per-subtask committers failed (see stderr)"
                    )
                rows.append(
                    {
                        "layout": layout,
                        "committers": n,
                        "commits": len(latencies),
                        "failed_processes": failures,
                        "median_ms": statistics.median(latencies) * 1000
                        if latencies
                        else float("nan"),
                        "p95_ms": percentile(latencies, 0.95) * 1000 if latencies else float("nan"),
                    }
                )
    return rows


def run(quick: bool = False) -> dict[str, Any]:
    return {
        "sizes": sizes(2 if quick else 5, [100, 10_000] if quick else [100, 10_000, 100_000]),
        "concurrency": concurrency(
            [1, 8] if quick else [1, 8, 32], 5 if quick else 12, 1.0 if quick else 2.0
        ),
        "long_task": long_task(250 if quick else 1_000, 1 if quick else 2),
        "fences": fences(864 if quick else 8_640, 10 if quick else 30),
        "log_files": log_files(400 if quick else 3_000),
        "micro_batch": micro_batches(40 if quick else 100, 1 if quick else 3),
    }


# Sections 3-6 in the report: key in run()'s result, header, one row's line.
_LATER_SECTIONS: list[tuple[str, str, Callable[[dict[str, Any]], str]]] = [
    (
        "long_task",
        "table object   commits  first 100 ms  last 100 ms  total s  peak RSS MiB",
        lambda r: (
            f"{r['table_object']:<14} {r['commits']:>7,} {r['first_ms']:>13.1f} "
            f"{r['last_ms']:>12.1f} {r['total_s']:>8.1f} {r['peak_rss_mib']:>13.0f}"
        ),
    ),
    (
        "fences",
        "fences of          earlier runs   open ms   new run ms",
        lambda r: (
            f"{r['fences_of']:<17} {r['earlier_runs']:>12,} {r['open_ms']:>9.1f} "
            f"{r['new_run_ms']:>12.1f}"
        ),
    ),
    (
        "log_files",
        "commit files   commits   log files   first 200 ms   last 200 ms",
        lambda r: (
            f"{r['commit_files']:<12} {r['commits']:>9,} {r['log_files']:>11,} "
            f"{r['first_ms']:>14.1f} {r['last_ms']:>13.1f}"
        ),
    ),
    (
        "micro_batch",
        "expiry      micro-batches   commit ms   expire ms   Delta versions",
        lambda r: (
            f"{r['expiry']:<11} {r['micro_batches']:>13,} {r['commit_ms']:>11.1f} "
            f"{r['expire_ms']:>11.1f} {r['delta_versions']:>16,}"
        ),
    ),
]


def _later_sections(result: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for key, header, line in _LATER_SECTIONS:
        if result.get(key):
            lines += ["", header, *(line(r) for r in result[key])]
    return lines


def report(result: dict[str, Any]) -> str:
    lines = ["in-flight   first commit ms   commit ms   load ms   restore ms"]
    for r in result["sizes"]:
        lines.append(
            f"{r['in_flight']:>9,} {r['first_commit_ms']:>17.1f} {r['commit_ms']:>11.1f} "
            f"{r['load_ms']:>9.1f} {r['restore_ms']:>12.1f}"
        )
    lines.append("")
    lines.append("layout          committers  commits  median ms  p95 ms   failed")
    base: dict[str, float] = {}
    for r in result["concurrency"]:
        base.setdefault(r["layout"], r["median_ms"])
        lines.append(
            f"{r['layout']:<15} {r['committers']:>10} {r['commits']:>8} {r['median_ms']:>10.1f} "
            f"{r['p95_ms']:>7.1f} {r['failed_processes']:>8}   "
            f"({r['median_ms'] / base[r['layout']]:.2f}x of 1 committer)"
        )
    return "\n".join(lines + _later_sections(result))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--committer":
        root, layout, subtask, count, period, go, benchmark = sys.argv[2:9]
        _committer(root, layout, int(subtask), int(count), float(period), go, int(benchmark))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--long-task":
        root, count, variant = sys.argv[2:5]
        _long_task(root, int(count), keep_table=variant == "kept")
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--log-files":
        root, count, variant = sys.argv[2:5]
        _log_files(root, int(count), cleaned=variant == "cleaned")
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--json", metavar="PATH", type=output_file, help="also write the figures as JSON"
    )
    parser.add_argument("--micro-batches", action="store_true", help="section 6 alone")
    args = parser.parse_args()
    # a SIGTERM (kill, a timeout) unwinds as Ctrl-C does: the finally blocks stop what the
    # run started and remove its temporary directories
    with sigterm_unwinds():
        if args.micro_batches:
            result = {
                "micro_batch": micro_batches(40 if args.quick else 100, 1 if args.quick else 3)
            }
            text = "\n".join(_later_sections(result)[1:])
        else:
            result = run(quick=args.quick)
            text = report(result)
    if args.json:  # as spark_bench's and pyflink_bench's --json: a file, the table printed
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(text)


if __name__ == "__main__":
    main()
