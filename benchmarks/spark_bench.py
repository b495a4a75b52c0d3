"""Spark end to end: ``ordered_wait`` against what users write instead, one session, one run.

One local Spark session (``local[2,3]``, 2 partitions), one mock enrichment service on
127.0.0.1 (constant latency, 20 ms; 200 ms for the Little's-law case). Every competitor
enriches the same rows (``id``, ``name``) with the service's ``score`` and ``label`` and
writes them to Spark's ``noop`` sink, with the same concurrency per task (``--capacity``,
64 by default, the thread count of the thread-pool competitor):

* ``ordered_wait`` / ``unordered_wait`` — this library (aiohttp client, ``ServiceEnrichment``);
* hand-written asyncio ``mapInArrow`` — the pattern users write: one event loop and one
  aiohttp session per task; each Arrow batch is gathered (a semaphore bounds the requests
  in flight), then the next batch is read, so in-flight requests fall to zero at every
  batch boundary;
* 64-thread ``mapInPandas`` — a ``ThreadPoolExecutor`` mapping a blocking ``http.client``
  call over each pandas batch, each thread keeping one keep-alive connection (as the
  asyncio competitors keep their aiohttp session's pooled connections);
* one-at-a-time UDF — a plain Python UDF calling the service once per row, in turn;
* Little's-law bound — capacity / latency per task, times 2 tasks.

Then, on the same session and service:

* latency that varies (exponential, mean 20 ms; lognormal, median 20 ms, sigma 1), at
  Spark's default Arrow batches: the hand-written loop against ``ordered_wait`` at the same
  capacity, at 16x it, and at 16x it with ``max_in_flight`` at the capacity, and
  ``unordered_wait``, with the service's peak of requests in flight (an ordered queue holds
  results that wait for an earlier element);
* checkpoint cost: ``ordered_wait`` with a checkpoint every 10k records against none on
  the service workload (60k rows, interleaved), and an interval sweep (1k / 10k / 100k /
  none) of a 20 ms ``asyncio.sleep`` function at capacity 1000 (400k rows: the worst
  case, since a task without HTTP work runs many times faster); the latency of every
  snapshot commit of those runs, from the Delta commit history;
* cost of failure: one worker crash (``CrashOnElement``, attempt 0) at 90 % of partition 0,
  with checkpoints every 10k records against plain Spark task retry (no checkpoints):
  repeated external requests (the service's per-key counters) and recovery time (wall
  time over the median failure-free run of the same job);
* memory: peak RSS of the partition task (``PartitionTask``, run outside Spark in a fresh
  process fed by a generator of 10k-row Arrow batches, as Spark feeds it) for 10k and 1M
  rows at capacity 100 and 1000, and at 1000 with checkpoints;
* CPU per row of one task outside Spark (``ordered_wait`` against the hand-written loop)
  and a cProfile of each, summarised by package.

Every Spark run checks its output on its way to the sink (every input row once, with the
service's answer for its id; ``timed_write``) and, against the service, one request per
row. Every Spark run records the CPU time of each of our processes (service, JVM, Python
workers, driver) and of everything else on the machine (psutil): rows per CPU-second of
our processes is reported beside rows/s, because on a shared machine rows/s of a
CPU-bound case moves with other people's load. Cases run interleaved (``Sizes``: the main
comparison and the checkpoint cost on the service workload 5 times, the rest at most 3);
rows/s of the main comparison is the median run, elsewhere the best run; rows per
CPU-second is always the median.

    python benchmarks/spark_bench.py              # ~15 minutes
    python benchmarks/spark_bench.py --quick      # a smoke run, ~3 minutes
    python benchmarks/spark_bench.py --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa
from child import child_output
from options import output_file, positive_int  # benchmarks/ is on sys.path: these are scripts
from peak_rss import peak_rss_mib
from scratch import run_prefix

SCHEMA = "id long, name string, score double, label string"
OUTPUT = pa.schema(
    [("id", pa.int64()), ("name", pa.string()), ("score", pa.float64()), ("label", pa.string())]
)
PARTITIONS = 2
INPUT = pa.schema([("id", pa.int64()), ("name", pa.string())])


T = TypeVar("T")


def rotated(items: Sequence[T], rep: int) -> list[T]:
    """``items`` in repetition ``rep``'s order: each starts a repetition in turn, so no case
    always runs first (after a cold start or another part's load) or after the same one."""
    k = rep % len(items) if items else 0
    return [*items[k:], *items[:k]]


def input_batches(rows: int) -> Iterator[pa.RecordBatch]:
    """The benchmark's input for one task outside Spark, generated lazily in 10k-row Arrow
    batches as Spark feeds ``mapInArrow``: the same rows as ``source``."""
    for start in range(0, rows, 10_000):
        ids = list(range(start, min(rows, start + 10_000)))
        yield pa.RecordBatch.from_pydict(
            {"id": ids, "name": [f"user{i}" for i in ids]}, schema=INPUT
        )


# -- the competitors, written as users write them -------------------------------------------


class HandwrittenAsyncio:
    """A ``mapInArrow`` function: one event loop and one aiohttp session per task; each
    Arrow batch is gathered with a semaphore bounding the requests in flight, then the
    next batch is read (in-flight requests fall to zero at every batch boundary)."""

    def __init__(self, url: str, capacity: int) -> None:
        self.url = url
        self.capacity = capacity

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import aiohttp

        url, capacity = self.url, self.capacity
        loop = asyncio.new_event_loop()

        async def make_session() -> aiohttp.ClientSession:
            # the client settings of ServiceEnrichment (no per-request timeout timer)
            return aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1000),
                timeout=aiohttp.ClientTimeout(total=None),
            )

        session = loop.run_until_complete(make_session())
        semaphore = asyncio.Semaphore(capacity)

        async def enrich(row: dict[str, Any]) -> dict[str, Any]:
            async with semaphore:
                async with session.get(f"{url}/enrich", params={"key": str(row["id"])}) as resp:
                    resp.raise_for_status()
                    answer = await resp.json()
            return {**row, "score": answer["score"], "label": answer["label"]}

        async def enrich_batch(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return await asyncio.gather(*(enrich(row) for row in rows))

        try:
            for batch in batches:
                results = loop.run_until_complete(enrich_batch(batch.to_pylist()))
                yield pa.RecordBatch.from_pylist(results, schema=OUTPUT)
        finally:
            loop.run_until_complete(session.close())
            loop.close()


def fetch(url: str, key: Any) -> dict[str, Any]:
    """One blocking request with the standard library (a new connection per request)."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/enrich?key={key}", timeout=60) as response:
        return json.loads(response.read())


class ThreadPoolPandas:
    """A ``mapInPandas`` function: a thread pool maps a blocking call over each batch. Each
    thread keeps one keep-alive connection to the service for the whole task (a thread-local
    ``http.client`` connection), as the asyncio competitors reuse their aiohttp session's
    pooled connections: a new connection per request (``urllib``) would cost the service
    and the client a TCP handshake per row that no other competitor pays."""

    def __init__(self, url: str, threads: int) -> None:
        self.url = url
        self.threads = threads

    def __call__(self, frames: Iterator[Any]) -> Iterator[Any]:
        import http.client
        import urllib.parse

        address = urllib.parse.urlsplit(self.url)
        local = threading.local()
        connections: list[http.client.HTTPConnection] = []

        def fetch_kept(key: Any) -> dict[str, Any]:
            connection = getattr(local, "connection", None)
            if connection is None:
                connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
                local.connection = connection
                connections.append(connection)
            connection.request("GET", f"/enrich?key={key}")
            response = connection.getresponse()
            body = response.read()
            if response.status >= 400:
                raise RuntimeError(f"the service answered {response.status} for key {key}")
            return json.loads(body)  # type: ignore[no-any-return]

        try:
            with ThreadPoolExecutor(self.threads) as pool:
                for frame in frames:
                    answers = list(pool.map(fetch_kept, frame["id"].tolist()))
                    yield frame.assign(
                        score=[a["score"] for a in answers], label=[a["label"] for a in answers]
                    )
        finally:
            for connection in connections:
                connection.close()


def one_at_a_time_udf(url: str) -> Any:
    from pyspark.sql.functions import udf

    @udf(returnType="struct<score:double,label:string>")
    def enrich(key):  # type: ignore[no-untyped-def]  # hints would make Spark guess a pandas UDF
        answer = fetch(url, key)
        return answer["score"], answer["label"]

    return enrich


# -- cases ----------------------------------------------------------------------------------


def source(spark: Any, rows: int) -> Any:
    return spark.range(0, rows, numPartitions=PARTITIONS).selectExpr(
        "id", "concat('user', id) as name"
    )


def build(
    kind: str,
    df: Any,
    url: str,
    capacity: int,
    checkpoint: Any = None,
    fn: Any = None,
    max_in_flight: int | None = None,
) -> Any:
    from stateful_async.chaos import ServiceEnrichment
    from stateful_async.spark import ordered_wait, unordered_wait

    fn = fn if fn is not None else ServiceEnrichment(url)
    ours = {"capacity": capacity, "max_in_flight": max_in_flight, "checkpoint": checkpoint}
    if kind == "ordered_wait":
        return ordered_wait(df, fn, SCHEMA, **ours)
    if kind == "unordered_wait":
        return unordered_wait(df, fn, SCHEMA, **ours)
    if kind == "handwritten_asyncio":
        return df.mapInArrow(HandwrittenAsyncio(url, capacity), SCHEMA)
    if kind == "threads_mapInPandas":
        return df.mapInPandas(ThreadPoolPandas(url, capacity), SCHEMA)
    if kind == "udf_one_at_a_time":
        enriched = df.select("id", "name", one_at_a_time_udf(url)("id").alias("e"))
        return enriched.select("id", "name", "e.score", "e.label")
    raise ValueError(kind)


def right_rows(answers: str = "service") -> Any:
    """A Column true where a result row is right: its ``name`` is the input's for its ``id``,
    and its ``score`` and ``label`` are what the service answers for that id
    (``stateful_async.chaos.expected_enrichment``, in Spark SQL), or with
    ``answers="constant"`` the constants ``sleep_20ms`` returns."""
    from pyspark.sql import functions as F

    right = F.col("name") == F.concat(F.lit("user"), F.col("id").cast("string"))
    if answers == "constant":
        return right & (F.col("score") == 0.5) & (F.col("label") == "L")
    digest = F.crc32(F.col("id").cast("string"))
    score = (digest % 10_000).cast("double") / 100.0
    label = F.concat(F.lit("L"), F.lpad((digest % 97).cast("string"), 2, "0"))
    return right & (F.col("score") == score) & (F.col("label") == label)


def timed_write(
    df: Any, rows: int, what: str, meter: CpuMeter | None = None, answers: str = "service"
) -> float:
    """Writes ``df`` to Spark's ``noop`` sink and returns the seconds it took. The output is
    observed on its way there (a per-row check in the JVM, next to nothing beside a request)
    and must be ``rows`` rows, ids 0 .. rows - 1 once each (by count, sum and sum of
    squares) and every row right (``right_rows``): a competitor that drops, repeats or
    garbles rows fails the run instead of looking fast."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    observation = Observation()
    df = df.observe(
        observation,
        F.count(F.lit(1)).alias("rows"),
        F.sum("id").alias("id_sum"),
        F.sum(F.col("id") * F.col("id")).alias("id_square_sum"),
        F.sum(F.when(right_rows(answers), 1).otherwise(0)).alias("right"),
    )
    if meter is not None:
        meter.start()
    start = time.perf_counter()
    df.write.format("noop").mode("overwrite").save()
    seconds = time.perf_counter() - start
    if meter is not None:
        meter.stop(seconds)
    checked_output(observation.get, rows, what)
    return seconds


def checked_output(got: dict[str, Any], rows: int, what: str) -> None:
    """The observed output (``timed_write``) is every input row once, each one right."""
    expected = {
        "rows": rows,
        "id_sum": rows * (rows - 1) // 2,
        "id_square_sum": (rows - 1) * rows * (2 * rows - 1) // 6,
        "right": rows,
    }
    if {key: got.get(key) for key in expected} != expected:
        raise AssertionError(
            f"{what}: the output had {got.get('rows')} rows (id sum {got.get('id_sum')}, "
            f"{got.get('right')} of them right) for {rows} input rows (id sum "
            f"{expected['id_sum']})"
        )


def run_case(
    spark: Any,
    service: Any,
    kind: str,
    rows: int,
    capacity: int,
    meter: CpuMeter,
    what: str,
    checkpoint: Any = None,
    fn: Any = None,
    max_in_flight: int | None = None,
) -> tuple[float, dict[str, float]]:
    """One measured run of a competitor against a freshly reset service: its wall time and
    the CPU of each process (``meter``), after checking one request per row."""
    service.reset()
    df = build(kind, source(spark, rows), service.url, capacity, checkpoint, fn, max_in_flight)
    seconds = timed_write(df, rows, what, meter)
    checked(service, rows, what)
    return seconds, meter.last


class CpuMeter:
    """CPU seconds spent during one case by each part of the benchmark (the mock service,
    the Spark JVM, the Python workers, this driver) and by everything else on the machine
    (other people's jobs: the machine is shared), from psutil."""

    def __init__(self, service_pid: int | None) -> None:
        import psutil

        self.psutil = psutil
        self.root = psutil.Process()
        self.service_pid = service_pid
        self.last: dict[str, float] = {}

    def _kind(self, proc: Any) -> str:
        if proc.pid == self.service_pid:
            return "service"
        if proc.pid == self.root.pid:
            return "driver"
        try:
            name = proc.name()
        except self.psutil.Error:
            return "other"
        return "jvm" if name == "java" else "python_workers"

    def _sample(self) -> tuple[dict[int, tuple[str, float]], float]:
        procs: dict[int, tuple[str, float]] = {}
        for proc in [self.root, *self.root.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                procs[proc.pid] = (self._kind(proc), times.user + times.system)
            except self.psutil.Error:
                continue
        machine = self.psutil.cpu_times()
        busy = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
        return procs, busy

    def start(self) -> None:
        self._before = self._sample()

    def stop(self, seconds: float) -> None:
        (before, busy0), (after, busy1) = self._before, self._sample()
        parts = {"service": 0.0, "jvm": 0.0, "python_workers": 0.0, "driver": 0.0}
        for pid, (kind, cpu) in after.items():
            parts[kind] = parts.get(kind, 0.0) + cpu - before.get(pid, (kind, 0.0))[1]
        ours = sum(parts.values())
        parts["others_on_machine"] = max(0.0, (busy1 - busy0) - ours)
        parts["wall"] = seconds
        self.last = parts


def rows_per_cpu_s(rows: int, cpu: dict[str, float]) -> float:
    """Rows per CPU-second of our own processes (service, JVM, Python workers, driver):
    what rows/s would be per core on a machine with no other load. Robust to the other
    jobs on a shared machine, which move rows/s from run to run."""
    ours = sum(cpu.get(k, 0.0) for k in ("service", "jvm", "python_workers", "driver"))
    return rows / ours if ours > 0 else float("nan")


def median_rows_per_cpu_s(rows: int, cpus: list[dict[str, float]]) -> float:
    """The median of ``rows_per_cpu_s`` over the runs of one case."""
    return statistics.median(rows_per_cpu_s(rows, c) for c in cpus)


def checked(service: Any, rows: int, what: str) -> None:
    """Exactly one request per row: every key once, and nothing else."""
    counts = service.counts()
    total = sum(counts.values())
    if total != rows or len(counts) != rows or any(n != 1 for n in counts.values()):
        repeated = sum(1 for n in counts.values() if n != 1)
        raise AssertionError(
            f"{what}: the service saw {total} requests for {rows} rows ({len(counts)} keys, "
            f"{repeated} of them requested more than once)"
        )


LABELS = {
    "ordered_wait": "ordered_wait",
    "unordered_wait": "unordered_wait",
    "handwritten_asyncio": "hand-written asyncio mapInArrow (gather per batch)",
    "threads_mapInPandas": "64-thread mapInPandas (http.client, keep-alive)",
    "udf_one_at_a_time": "one-at-a-time Python UDF (urllib)",
}


@dataclass
class Sizes:
    throughput_rows: int  # async competitors and threads at 20 ms
    udf_rows: int
    slow_rows: int  # at 200 ms
    sweep_rows: int  # checkpoint interval sweep (fast function)
    failure_rows: int  # service checkpoint cost (section 4) and cost of failure (5)
    memory_large: int
    cpu_rows: int  # one task outside Spark, for CPU per row and the profile
    repeat: int
    throughput_repeat: int  # the main comparison: more runs, in a rotating order
    # checkpoint cost on the service workload: a few per cent, under this machine's
    # run-to-run noise, so it takes more runs than the other comparisons
    checkpoint_repeat: int


FULL = Sizes(
    throughput_rows=24_000,
    udf_rows=1_000,
    slow_rows=8_000,
    sweep_rows=400_000,
    failure_rows=60_000,
    memory_large=1_000_000,
    cpu_rows=16_000,
    repeat=3,
    throughput_repeat=5,
    checkpoint_repeat=5,
)
QUICK = Sizes(
    throughput_rows=6_000,
    udf_rows=200,
    slow_rows=1_280,
    sweep_rows=60_000,
    failure_rows=12_000,
    memory_large=100_000,
    cpu_rows=4_000,
    repeat=1,
    throughput_repeat=1,
    checkpoint_repeat=1,
)


def throughput(
    spark: Any, service: Any, sizes: Sizes, capacity: int, work: str
) -> list[dict[str, Any]]:
    """Every competitor at the service's current latency, interleaved ``throughput_repeat``
    times in a rotating order (no case always follows the same one). Rows/s and rows per
    CPU-second are both the median over the runs; ``cpu_s`` is the median run's breakdown
    (by time), ``rows_per_s_best`` the fastest run."""
    cases = [
        "ordered_wait",
        "unordered_wait",
        "handwritten_asyncio",
        "threads_mapInPandas",
        "udf_one_at_a_time",
    ]
    rows_for = {case: sizes.throughput_rows for case in cases}
    rows_for["udf_one_at_a_time"] = sizes.udf_rows
    seconds: dict[str, list[float]] = {case: [] for case in cases}
    cpu: dict[str, list[dict[str, float]]] = {case: [] for case in cases}
    meter = CpuMeter(service.pid)
    for rep in range(sizes.throughput_repeat):
        for case in rotated(cases, rep):
            if case == "udf_one_at_a_time" and rep > 0:
                continue  # ~50x slower than the rest: once is enough to place it
            rows = rows_for[case]
            run_s, run_cpu = run_case(spark, service, case, rows, capacity, meter, case)
            seconds[case].append(run_s)
            cpu[case].append(run_cpu)
            log(f"  {case:<22} {rows:>8,} rows {seconds[case][-1]:7.2f} s")
    out = []
    for case in cases:
        row: dict[str, Any] = {
            "case": case,
            "label": LABELS[case],
            "rows": rows_for[case],
            "runs_s": seconds[case],
            "rows_per_s": rows_for[case] / statistics.median(seconds[case]),
            "rows_per_s_best": rows_for[case] / min(seconds[case]),
            "cpu_s": cpu[case][seconds[case].index(statistics.median_low(seconds[case]))],
            "cpu_runs": cpu[case],
            "rows_per_cpu_s": median_rows_per_cpu_s(rows_for[case], cpu[case]),
        }
        out.append(row)
    return out


BATCH_SWEEP = (1_000, 200)  # Arrow batch sizes besides Spark's default (10,000)


def batch_sweep(spark: Any, service: Any, sizes: Sizes, capacity: int) -> list[dict[str, Any]]:
    """``ordered_wait`` against the hand-written per-batch loop with smaller Arrow batches
    (``spark.sql.execution.arrow.maxRecordsPerBatch``): the hand-written loop drains its
    requests at every batch boundary, ``ordered_wait`` does not, so the smaller the batch
    next to the capacity, the more the drain weighs. Interleaved ``repeat`` times."""
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    kinds = ("ordered_wait", "handwritten_asyncio")
    rows = sizes.throughput_rows // 2
    meter = CpuMeter(service.pid)
    out = []
    try:
        for batch in BATCH_SWEEP:
            spark.conf.set(key, str(batch))
            seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
            cpu: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
            for rep in range(sizes.repeat):
                for kind in rotated(kinds, rep):
                    what = f"{kind} with {batch}-row batches"
                    run_s, run_cpu = run_case(spark, service, kind, rows, capacity, meter, what)
                    seconds[kind].append(run_s)
                    cpu[kind].append(run_cpu)
                    log(f"  {kind:<22} batches of {batch:>6,} {seconds[kind][-1]:7.2f} s")
            row: dict[str, Any] = {"batch_rows": batch, "rows": rows}
            for kind in kinds:
                row[kind] = {
                    "rows_per_s": rows / min(seconds[kind]),
                    "rows_per_cpu_s": median_rows_per_cpu_s(rows, cpu[kind]),
                    "runs_s": seconds[kind],
                }
            row["ratio"] = (
                row["ordered_wait"]["rows_per_s"] / row["handwritten_asyncio"]["rows_per_s"]
            )
            row["cpu_ratio"] = (
                row["ordered_wait"]["rows_per_cpu_s"] / row["handwritten_asyncio"]["rows_per_cpu_s"]
            )
            out.append(row)
    finally:
        spark.conf.unset(key)
    return out


# 20 ms services whose latency varies, as real services' latency does: name, the service's
# configuration, mean latency in ms
LATENCY_SHAPES: tuple[tuple[str, dict[str, Any], float], ...] = (
    ("exponential", {"distribution": "exponential"}, 20.0),
    # median 20 ms, sigma 1: mean 33 ms, p99 205 ms
    ("lognormal", {"distribution": "lognormal", "latency_sigma": 1.0}, 20.0 * math.exp(0.5)),
)
WIDE_CAPACITY = 16  # ordered_wait at 16 x the capacity: what buys back head-of-line blocking


def latency_variance(spark: Any, service: Any, sizes: Sizes, capacity: int) -> list[dict[str, Any]]:
    """The async competitors at Spark's default Arrow batches against a service whose
    latency varies (median 20 ms). The hand-written loop still drains once per batch, but
    now waits for the batch's slowest request; ``ordered_wait`` counts a completed result
    that waits for an earlier one against its capacity (Flink's queue), so fewer requests
    are in flight than ``capacity`` allows; ``unordered_wait`` is neither drained nor
    blocked. Also ``ordered_wait`` at ``WIDE_CAPACITY`` x the capacity, with the service's
    peak of requests in flight to show what that costs it, and the same with
    ``max_in_flight`` at the capacity (the service's concurrency of the others).
    Interleaved, at most twice (the ordered case at the same capacity runs several times
    slower than the rest). A case is (kind, capacity, max_in_flight)."""
    wide = capacity * WIDE_CAPACITY
    cases: list[tuple[str, int, int | None]] = [
        ("handwritten_asyncio", capacity, None),
        ("ordered_wait", capacity, None),
        ("ordered_wait", wide, None),
        ("ordered_wait", wide, capacity),
        ("unordered_wait", capacity, None),
    ]
    # more than two Arrow batches per task, so the hand-written loop drains mid-task
    rows = sizes.throughput_rows * 2
    repeat = min(sizes.repeat, 2)
    meter = CpuMeter(service.pid)
    out = []
    try:
        for name, config, mean_ms in LATENCY_SHAPES:
            service.configure(latency_ms=20, **config)
            seconds: dict[tuple[str, int, int | None], list[float]] = {c: [] for c in cases}
            cpu: dict[tuple[str, int, int | None], list[dict[str, float]]] = {c: [] for c in cases}
            peaks: dict[tuple[str, int, int | None], int] = {c: 0 for c in cases}
            for rep in range(repeat):
                for case in rotated(cases, rep):
                    kind, cap, calls = case
                    bounds = f"capacity {cap:>5}" + (f", max_in_flight {calls}" if calls else "")
                    what = f"{kind} ({bounds}), {name} latency"
                    run_s, run_cpu = run_case(
                        spark, service, kind, rows, cap, meter, what, max_in_flight=calls
                    )
                    seconds[case].append(run_s)
                    cpu[case].append(run_cpu)
                    peaks[case] = max(peaks[case], service.stats()["peak_in_flight"])
                    log(f"  {kind:<22} {bounds:<34} {name:<12} {run_s:7.2f} s")
            anchor = rows / min(seconds[cases[0]])
            measured = []
            for case in cases:
                kind, cap, calls = case
                rate = rows / min(seconds[case])
                measured.append(
                    {
                        "case": kind,
                        "label": LABELS[kind],
                        "capacity": cap,
                        "max_in_flight": calls,
                        "rows_per_s": rate,
                        "vs_handwritten": rate / anchor,
                        "rows_per_cpu_s": median_rows_per_cpu_s(rows, cpu[case]),
                        "peak_in_flight": peaks[case],
                        "runs_s": seconds[case],
                    }
                )
            out.append(
                {
                    "shape": name,
                    "config": config,
                    "mean_ms": mean_ms,
                    "rows": rows,
                    "repeat": repeat,
                    # Little's law at the mean latency, for the competitors at `capacity`
                    "littles_law_rows_per_s": PARTITIONS * capacity / (mean_ms / 1000),
                    "table": measured,
                }
            )
    finally:
        service.configure(latency_ms=20, distribution="constant")
    return out


def slow_service(spark: Any, service: Any, sizes: Sizes, capacity: int) -> list[dict[str, Any]]:
    """At 200 ms, where CPU is not the limit: against the Little's-law bound."""
    service.configure(latency_ms=200)
    meter = CpuMeter(service.pid)
    try:
        out = []
        for kind, repeat in (
            ("ordered_wait", 2),
            ("unordered_wait", 1),
            ("handwritten_asyncio", 1),
        ):
            runs, cpus = [], []
            for _ in range(repeat if sizes.repeat > 1 else 1):
                run_s, run_cpu = run_case(
                    spark, service, kind, sizes.slow_rows, capacity, meter, kind
                )
                runs.append(run_s)
                cpus.append(run_cpu)
            log(f"  {kind:<22} {sizes.slow_rows:>8,} rows {min(runs):7.2f} s (200 ms)")
            out.append(
                {
                    "case": kind,
                    "label": LABELS[kind],
                    "rows": sizes.slow_rows,
                    "runs_s": runs,
                    "rows_per_s": sizes.slow_rows / min(runs),
                    "cpu_s": cpus[runs.index(min(runs))],
                    "cpu_runs": cpus,
                }
            )
        return out
    finally:
        service.configure(latency_ms=20)


# -- checkpoint cost and commit latency -----------------------------------------------------


async def sleep_20ms(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A service that costs no CPU: the sweep's rows/s is set by the task itself."""
    await asyncio.sleep(0.02)
    return [{**row, "score": 0.5, "label": "L"}]


SWEEP_CAPACITY = 1000


def checkpoint_sweep(spark: Any, sizes: Sizes, work: str) -> dict[str, Any]:
    """``ordered_wait`` of a 20 ms ``asyncio.sleep`` function at capacity 1000, checkpoints
    every 1k / 10k / 100k records against none, interleaved ``repeat`` times. Without the
    service's HTTP work per row the task runs many times faster, so a checkpoint (whose
    commit time does not depend on the rate) weighs more: the worst case for its cost."""
    from stateful_async.spark import CheckpointConfig, ordered_wait

    intervals: list[int | None] = [None, 100_000, 10_000, 1_000]
    seconds: dict[str, list[float]] = {str(i): [] for i in intervals}
    cpu: dict[str, list[dict[str, float]]] = {str(i): [] for i in intervals}
    commits: dict[str, list[float]] = {str(i): [] for i in intervals if i is not None}
    counts: dict[str, int] = {}
    rows = sizes.sweep_rows
    meter = CpuMeter(None)
    for rep in range(max(2, sizes.repeat - 1) if sizes.repeat > 1 else 1):
        for interval in rotated(intervals, rep):
            config = None
            if interval is not None:
                config = CheckpointConfig(
                    os.path.join(work, "sweep"),
                    f"sweep-{interval}-{rep}",
                    interval_records=interval,
                )
            df = ordered_wait(
                source(spark, rows), sleep_20ms, SCHEMA, capacity=SWEEP_CAPACITY, checkpoint=config
            )
            what = f"checkpoint every {interval}"
            seconds[str(interval)].append(timed_write(df, rows, what, meter, "constant"))
            cpu[str(interval)].append(meter.last)
            log(
                f"  checkpoint every {interval!s:<7} {rows:>8,} rows "
                f"{seconds[str(interval)][-1]:7.2f} s"
            )
            if config is not None:
                latencies = commit_latencies(config.location, config.job_id)
                commits[str(interval)].extend(latencies)
                counts[str(interval)] = len(latencies)
    base = rows / min(seconds["None"])
    base_cpu = median_rows_per_cpu_s(rows, cpu["None"])
    table = []
    for interval in intervals:
        rate = rows / min(seconds[str(interval)])
        efficiency = median_rows_per_cpu_s(rows, cpu[str(interval)])
        row: dict[str, Any] = {
            "interval": interval,
            "rows": rows,
            "runs_s": seconds[str(interval)],
            "rows_per_s": rate,
            "ratio": rate / base,
            "cost_pct": (1 - rate / base) * 100,
            "cpu_runs": cpu[str(interval)],
            "rows_per_cpu_s": efficiency,
            "cpu_ratio": efficiency / base_cpu,
        }
        if interval is not None:
            row.update(latency_summary(commits[str(interval)]))
            row["commits_per_run"] = counts[str(interval)]
        table.append(row)
    return {
        "rows": rows,
        "capacity": SWEEP_CAPACITY,
        "function": "asyncio.sleep(0.02)",
        "table": table,
        "commit_latencies_ms": commits,
    }


def latency_summary(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"commit_ms_median": None, "commit_ms_p95": None, "commit_ms_max": None}
    return {
        "commit_ms_median": statistics.median(values),
        "commit_ms_p95": percentile(values, 0.95),
        "commit_ms_max": max(values),
    }


def commit_latencies(location: str, job_id: str) -> list[float]:
    """Milliseconds from each checkpoint's ``created_at`` (stamped when ``SubtaskLog.commit``
    starts building its rows) to the timestamp delta-rs gives the Delta commit, for every
    checkpoint that retention kept (expired ones lose their ``created_at``)."""
    from deltalake import DeltaTable

    from checkpoint import SnapshotStore

    store = SnapshotStore(location)
    out = []
    for subtask in store.subtasks(job_id, "enrich"):
        log_ = store.subtask(job_id, "enrich", subtask)
        created = {str(m.ref): m.created_at.timestamp() * 1000 for m in log_.checkpoints(True)}
        for commit in DeltaTable(log_.uri).history():
            ref = commit.get("stateful_async.checkpoint")
            if ref in created:
                out.append(commit["timestamp"] - created[ref])
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- cost of failure ------------------------------------------------------------------------


def disarmed(url: str, crash_at: int, armed: bool) -> Any:
    """The service function inside ``CrashOnElement``; disarmed (attempt 99 never runs) it
    costs the same per row, so armed and disarmed runs compare like for like."""
    from stateful_async.chaos import CrashOnElement, ServiceEnrichment

    return CrashOnElement(
        ServiceEnrichment(url), at=[crash_at], attempt=0 if armed else 99, partitions=[0]
    )


def failure_workload(sizes: Sizes) -> tuple[int, int, int]:
    """(rows, row to crash at, checkpoint interval) of sections 4 (service) and 5."""
    rows = sizes.failure_rows
    partition = rows // PARTITIONS
    interval = 10_000 if partition >= 30_000 else max(1_000, partition // 4)
    return rows, int(partition * 0.9), interval  # partition 0 holds ids 0 .. partition - 1


def service_checkpoint(
    spark: Any, service: Any, sizes: Sizes, capacity: int, work: str
) -> dict[str, Any]:
    """``ordered_wait`` on the service workload with a checkpoint every 10k records against
    none, interleaved ``repeat`` times (issue 4's comparison). Partitions are large enough
    to hold several intervals; these are also section 5's failure-free runs.
    ``checkpoint_repeat`` runs of each."""
    from stateful_async.spark import CheckpointConfig

    rows, crash_at, interval = failure_workload(sizes)
    seconds: dict[str, list[float]] = {"none": [], "checkpoint": []}
    cpu: dict[str, list[dict[str, float]]] = {"none": [], "checkpoint": []}
    commits: list[float] = []
    meter = CpuMeter(service.pid)
    for rep in range(sizes.checkpoint_repeat):
        for case in rotated(("none", "checkpoint"), rep):
            config = None
            if case == "checkpoint":
                config = CheckpointConfig(
                    os.path.join(work, "service"), f"service-{rep}", interval_records=interval
                )
            run_s, run_cpu = run_case(
                spark,
                service,
                "ordered_wait",
                rows,
                capacity,
                meter,
                f"checkpoint {case}",
                config,
                disarmed(service.url, crash_at, armed=False),
            )
            seconds[case].append(run_s)
            cpu[case].append(run_cpu)
            if config is not None:
                commits.extend(commit_latencies(config.location, config.job_id))
            log(
                f"  checkpoint every {interval if config else 'none'!s:<6} {rows:>8,} rows "
                f"{seconds[case][-1]:7.2f} s"
            )
    best_none, best_ckpt = rows / min(seconds["none"]), rows / min(seconds["checkpoint"])
    return {
        "rows": rows,
        "interval": interval,
        "runs_s": seconds,
        "rows_per_s_none": best_none,
        "rows_per_s_checkpoint": best_ckpt,
        "ratio": best_ckpt / best_none,
        "cost_pct": (1 - best_ckpt / best_none) * 100,
        "commits_per_run": len(commits) // max(1, sizes.checkpoint_repeat),
        "commit_latencies_ms": commits,
        "cpu_s": {k: cpu[k][seconds[k].index(min(seconds[k]))] for k in cpu},
        "cpu_runs": cpu,
        "rows_per_cpu_s_none": median_rows_per_cpu_s(rows, cpu["none"]),
        "rows_per_cpu_s_checkpoint": median_rows_per_cpu_s(rows, cpu["checkpoint"]),
    }


def failure_cost(
    spark: Any, service: Any, sizes: Sizes, capacity: int, work: str, baseline: dict[str, Any]
) -> dict[str, Any]:
    """One crash at 90 % of partition 0, with and without checkpoints; the failure-free
    time of each is the median of ``service_checkpoint``'s runs of the same job."""
    from stateful_async.spark import CheckpointConfig

    rows, crash_at, interval = failure_workload(sizes)
    out = []
    for mode, key in (
        ("no checkpoints (Spark task retry)", "none"),
        (f"checkpoint every {interval:,}", "checkpoint"),
    ):
        config = None
        if key == "checkpoint":
            config = CheckpointConfig(
                os.path.join(work, "failure"), "failure", interval_records=interval
            )
        service.reset()
        fn = disarmed(service.url, crash_at, armed=True)
        df = build("ordered_wait", source(spark, rows), service.url, capacity, config, fn)
        seconds = timed_write(df, rows, f"{mode}, crashed")
        counts = service.counts()
        missing = rows - len(counts)
        if missing:
            raise AssertionError(f"{mode}: {missing} rows were never requested")
        repeated = sum(n - 1 for n in counts.values())
        failure_free = statistics.median(baseline["runs_s"][key])
        log(f"  {mode:<34} crash: {seconds:7.2f} s, {repeated:,} repeated requests")
        out.append(
            {
                "mode": mode,
                "interval": interval if config else None,
                "rows": rows,
                "crash_at_row_of_partition": crash_at,
                "partition_rows": rows // PARTITIONS,
                "failure_free_s": failure_free,
                "crash_s": seconds,
                "recovery_s": seconds - failure_free,
                "repeated_requests": repeated,
                "bound": capacity + interval if config else None,
            }
        )
    return {"capacity": capacity, "table": out}


# -- memory ---------------------------------------------------------------------------------


def _memory_child(rows: int, capacity: int, checkpoint_dir: str) -> None:
    """Runs in a fresh process: one partition task outside Spark, as Spark drives it."""
    from stateful_async import OutputMode
    from stateful_async._function import as_async_function
    from stateful_async.spark import CheckpointConfig
    from stateful_async.spark._task import PartitionTask, TaskSpec

    async def fast(row: dict[str, Any]) -> list[dict[str, Any]]:
        await asyncio.sleep(0)  # an instant service: yields once, so the queue fills up
        return [{**row, "score": 0.5, "label": "L"}]

    config = None
    if checkpoint_dir:
        os.environ["STATEFUL_ASYNC_RUN_ID"] = "memory"
        config = CheckpointConfig(checkpoint_dir, "memory", interval_records=10_000)
    spec = TaskSpec(
        fn=as_async_function(fast),
        mode=OutputMode.ORDERED,
        capacity=capacity,
        timeout=None,
        retry=None,
        input_schema=INPUT,
        output_schema=OUTPUT,
        event_time=None,
        max_out_of_orderness=0,
        checkpoint=config,
        app_id="memory-bench",
    )

    baseline = peak_rss_mib()
    start = time.perf_counter()
    out = sum(batch.num_rows for batch in PartitionTask(spec)(input_batches(rows)))
    elapsed = time.perf_counter() - start
    assert out == rows, (out, rows)
    print(json.dumps({"baseline_mib": baseline, "peak_mib": peak_rss_mib(), "seconds": elapsed}))


def memory(sizes: Sizes, work: str) -> list[dict[str, Any]]:
    out = []
    for capacity, checkpointed in ((100, False), (1000, False), (1000, True)):
        row: dict[str, Any] = {
            "capacity": capacity,
            "checkpoint_every": 10_000 if checkpointed else None,
        }
        for label, rows in (("small", 10_000), ("large", sizes.memory_large)):
            ckpt = os.path.join(work, f"memory-{capacity}-{label}") if checkpointed else ""
            out = child_output([__file__, "--memory-child", str(rows), str(capacity), ckpt])
            figures = json.loads(out.strip().splitlines()[-1])
            row[f"{label}_rows"] = rows
            row[f"{label}_peak_mib"] = figures["peak_mib"]
            row[f"{label}_baseline_mib"] = figures["baseline_mib"]
            row[f"{label}_seconds"] = figures["seconds"]
        row["ratio"] = row["large_peak_mib"] / row["small_peak_mib"]
        log(
            f"  capacity {capacity:>5} ckpt={checkpointed!s:<5} "
            f"peak {row['small_peak_mib']:.1f} MiB (10k) vs {row['large_peak_mib']:.1f} MiB "
            f"({sizes.memory_large:,})"
        )
        out.append(row)
    return out


# -- where the CPU goes (outside Spark) -----------------------------------------------------


def _cpu_child(kind: str, rows: int, url: str, capacity: int, profile: bool) -> None:
    """Runs in a fresh process: one task's work outside Spark, as Spark would feed it,
    against the mock service; prints rows/s, CPU per row and (with ``profile``) where the
    CPU went by package, from cProfile."""
    import cProfile
    import pstats

    from stateful_async import OutputMode
    from stateful_async.chaos import ServiceEnrichment
    from stateful_async.spark._task import PartitionTask, TaskSpec

    if kind == "handwritten_asyncio":
        task: Any = HandwrittenAsyncio(url, capacity)
    else:
        mode = OutputMode.ORDERED if kind == "ordered_wait" else OutputMode.UNORDERED
        spec = TaskSpec(
            ServiceEnrichment(url),
            mode,
            capacity,
            None,
            None,
            INPUT,
            OUTPUT,
            None,
            0,
            None,
            "cpu-bench",
        )
        task = PartitionTask(spec)
    # cProfile sees one thread; the task runs its loop and its reader on threads of their
    # own, so every thread started from here on gets a profiler of its own, merged at the
    # end. The timer is the thread's CPU clock: time spent waiting (epoll, queues) is not
    # counted, so the shares below are shares of CPU.
    profilers: list[Any] = []
    if profile:
        original_run = threading.Thread.run

        def profiled_run(thread: threading.Thread) -> None:
            profiler = cProfile.Profile(time.thread_time)
            profilers.append(profiler)
            profiler.enable()
            try:
                original_run(thread)
            finally:
                profiler.disable()

        threading.Thread.run = profiled_run  # type: ignore[method-assign]
        profilers.append(cProfile.Profile(time.thread_time))
        profilers[-1].enable()
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    out = sum(batch.num_rows for batch in task(input_batches(rows)))
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    assert out == rows, (out, rows)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    result: dict[str, Any] = {"rows_per_s": rows / elapsed, "cpu_us_per_row": cpu / rows * 1e6}
    if profile:
        profilers[0].disable()  # the main thread's (made before any task thread)
        time.sleep(0.5)  # let the task's pool threads finish and stop their profilers
        stats = pstats.Stats(profilers[0])
        for profiler in profilers[1:]:
            stats.add(profiler)
        result["by_package"], result["top"] = _summarise(stats)
    print(json.dumps(result))


def _summarise(stats: Any) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """tottime by package (share of the profiled total) and the ten costliest functions."""
    by_package: dict[str, float] = {}
    top = []
    total = 0.0
    for (filename, line, name), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():
        total += tottime
        path = filename.replace("\\", "/")
        if "/aiohttp/" in path or "/yarl/" in path or "/multidict/" in path:
            package = "aiohttp (client)"
        elif "/asyncio/" in path or name.startswith("<method") and "loop" in name:
            package = "asyncio (event loop)"
        elif "/stateful_async/" in path:
            package = "stateful_async (operator, task)"
        elif "/pyarrow/" in path or "pyarrow" in name:
            package = "pyarrow (Arrow <-> Python)"
        elif "/json/" in path or "json" in name:
            package = "json"
        elif filename == "~" and ("select" in name or "epoll" in name or "poll" in name):
            package = "waiting (epoll)"
        elif filename == "~":
            package = "builtins"
        else:
            package = "other"
        by_package[package] = by_package.get(package, 0.0) + tottime
        top.append(
            {
                "function": f"{os.path.basename(filename)}:{line}({name})",
                "calls": calls,
                "tottime_s": tottime,
                "cumtime_s": cumtime,
            }
        )
    top.sort(key=lambda t: -t["tottime_s"])
    shares = {k: v / total for k, v in sorted(by_package.items(), key=lambda kv: -kv[1])}
    return shares, top[:10]


def cpu_profile(sizes: Sizes, capacity: int, latency_ms: float) -> dict[str, Any]:
    """One task's CPU per row, this library against the hand-written loop, outside Spark
    (each in a fresh process, interleaved, best of ``repeat``), then a cProfile of each."""
    import psutil

    from stateful_async.chaos import MockService, ServiceConfig

    rows = sizes.cpu_rows
    kinds = ["ordered_wait", "handwritten_asyncio"]
    out: dict[str, Any] = {"rows": rows, "capacity": capacity, "latency_ms": latency_ms}
    with MockService(ServiceConfig(latency_ms=latency_ms)) as service:
        service_proc = psutil.Process(service.pid)

        def child(kind: str, profile: bool) -> dict[str, Any]:
            before = service_proc.cpu_times()
            out = child_output(
                [
                    __file__,
                    "--cpu-child",
                    kind,
                    str(rows),
                    service.url,
                    str(capacity),
                    "1" if profile else "0",
                ]
            )
            after = service_proc.cpu_times()
            figures = json.loads(out.strip().splitlines()[-1])
            service_cpu = after.user - before.user + after.system - before.system
            figures["service_cpu_us_per_row"] = service_cpu / rows * 1e6
            return figures

        runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
        for rep in range(sizes.repeat):
            for kind in rotated(kinds, rep):
                runs[kind].append(child(kind, False))
                log(
                    f"  {kind:<22} {runs[kind][-1]['rows_per_s']:8,.0f} rows/s "
                    f"{runs[kind][-1]['cpu_us_per_row']:6.0f} us CPU/row (outside Spark)"
                )
        for kind in kinds:
            best = min(runs[kind], key=lambda r: r["cpu_us_per_row"])
            profiled = child(kind, True)
            out[kind] = {
                "rows_per_s": max(r["rows_per_s"] for r in runs[kind]),
                "cpu_us_per_row": best["cpu_us_per_row"],
                "service_cpu_us_per_row": best["service_cpu_us_per_row"],
                "profile_by_package": profiled["by_package"],
                "profile_top": profiled["top"],
            }
    return out


# -- the run --------------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"spark_bench: {message}", file=sys.stderr, flush=True)


KINDS = [
    "ordered_wait",
    "unordered_wait",
    "handwritten_asyncio",
    "threads_mapInPandas",
    "udf_one_at_a_time",
]


def run(quick: bool = False, capacity: int = 64, latency_ms: float = 20.0) -> dict[str, Any]:
    from pyspark import cloudpickle

    from stateful_async.chaos import MockService, ServiceConfig
    from stateful_async.spark import local_session

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers can't import us
    sizes = QUICK if quick else FULL
    work = tempfile.mkdtemp(prefix=run_prefix("spark-bench-"))
    started = time.perf_counter()
    result: dict[str, Any] = {
        "capacity": capacity,
        "latency_ms": latency_ms,
        "partitions": PARTITIONS,
        "master": "local[2,3]",
        "repeat": sizes.repeat,
        "throughput_repeat": sizes.throughput_repeat,
    }
    try:
        log("memory (partition task outside Spark, a fresh process per figure)")
        result["memory"] = memory(sizes, work)
        log("CPU per row and profile (one task outside Spark)")
        result["cpu"] = cpu_profile(sizes, capacity, latency_ms)
        spark = local_session("local[2,3]", app_name="spark-bench")
        result["spark_version"] = spark.version
        result["arrow_max_records_per_batch"] = int(
            spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch")
        )
        try:
            with MockService(ServiceConfig(latency_ms=latency_ms)) as service:
                log("warm-up (Python workers start, imports)")
                for kind in KINDS:
                    timed_write(build(kind, source(spark, 400), service.url, capacity), 400, kind)
                log(f"throughput at {latency_ms:g} ms, capacity {capacity}")
                result["throughput"] = throughput(spark, service, sizes, capacity, work)
                result["littles_law_rows_per_s"] = PARTITIONS * capacity / (latency_ms / 1000)
                log(f"smaller Arrow batches: {', '.join(map(str, BATCH_SWEEP))} rows")
                result["batch_sweep"] = batch_sweep(spark, service, sizes, capacity)
                log("latency that varies (exponential, lognormal; median 20 ms)")
                result["latency_variance"] = latency_variance(spark, service, sizes, capacity)
                log("throughput at 200 ms")
                result["slow"] = {
                    "latency_ms": 200,
                    "littles_law_rows_per_s": PARTITIONS * capacity / 0.2,
                    "table": slow_service(spark, service, sizes, capacity),
                }
                log("checkpoint cost on the service workload")
                result["service_checkpoint"] = service_checkpoint(
                    spark, service, sizes, capacity, work
                )
                log("cost of failure")
                result["failure"] = failure_cost(
                    spark, service, sizes, capacity, work, result["service_checkpoint"]
                )
            log("checkpoint interval sweep")
            result["sweep"] = checkpoint_sweep(spark, sizes, work)
        finally:
            spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["seconds"] = time.perf_counter() - started
    return result


def report(result: dict[str, Any]) -> str:
    lines = [
        f"Spark {result.get('spark_version', '?')} {result['master']}, {result['partitions']} "
        f"partitions, capacity {result['capacity']}, service latency {result['latency_ms']:g} ms, "
        f"rows/s the median of {result['throughput_repeat']} runs",
        "",
    ]
    rows = {r["case"]: r for r in result["throughput"]}
    anchor = rows["handwritten_asyncio"]["rows_per_s"]
    bound = result["littles_law_rows_per_s"]
    lines.append(f"{'competitor':<52}{'rows':>8}{'rows/s':>10}{'vs hand':>9}{'vs bound':>10}")
    for r in result["throughput"]:
        lines.append(
            f"{r['label']:<52}{r['rows']:>8,}{r['rows_per_s']:>10,.0f}"
            f"{r['rows_per_s'] / anchor:>8.2f}x{r['rows_per_s'] / bound:>9.2f}x"
        )
    lines.append(f"{'Little-law bound (capacity / latency x 2 tasks)':<52}{'':>8}{bound:>10,.0f}")
    sc = result["service_checkpoint"]
    lines.append(
        f"checkpoint every {sc['interval']:,} records ({sc['rows']:,} rows, best of "
        f"{len(sc['runs_s']['checkpoint'])}): {sc['ratio']:.3f}x of ordered_wait without "
        f"({sc['cost_pct']:.1f} % cost)"
    )
    slow = result["slow"]
    slow_bound = slow["littles_law_rows_per_s"]
    lines += ["", f"at {slow['latency_ms']} ms (bound {slow_bound:,.0f} rows/s)"]
    for r in slow["table"]:
        lines.append(
            f"{r['label']:<52}{r['rows']:>8,}{r['rows_per_s']:>10,.0f}"
            f"{r['rows_per_s'] / slow_bound:>19.2f}x"
        )
    for shape in result.get("latency_variance", []):
        # the service's latency_ms (20) is an exponential's mean and a lognormal's median
        median = "" if shape["config"]["distribution"] == "exponential" else "median 20 ms, "
        lines += ["", f"{shape['shape']} latency, {median}mean {shape['mean_ms']:.0f} ms"]
        for r in shape["table"]:
            bounds = f"capacity {r['capacity']}" + (
                f", max_in_flight {r['max_in_flight']}" if r.get("max_in_flight") else ""
            )
            lines.append(
                f"{r['label'] + ' (' + bounds + ')':<52}{shape['rows']:>8,}"
                f"{r['rows_per_s']:>10,.0f}{r['vs_handwritten']:>8.2f}x"
                f"  peak in flight {r['peak_in_flight']:,}"
            )
    sweep = result["sweep"]
    lines += [
        "",
        f"checkpoint interval sweep (ordered_wait, {sweep['function']}, capacity "
        f"{sweep['capacity']}, {sweep['rows']:,} rows)",
        f"{'interval':>10}{'rows/s':>10}{'ratio':>8}{'cost':>8}{'commits':>9}"
        f"{'median ms':>11}{'p95 ms':>8}",
    ]
    for r in sweep["table"]:
        extra = ""
        if r["interval"] is not None:
            extra = (
                f"{r['commits_per_run']:>9}{r['commit_ms_median'] or 0:>11.1f}"
                f"{r['commit_ms_p95'] or 0:>8.1f}"
            )
        lines.append(
            f"{str(r['interval'] or 'none'):>10}{r['rows_per_s']:>10,.0f}{r['ratio']:>7.3f}x"
            f"{r['cost_pct']:>7.1f}%{extra}"
        )
    lines += ["", "cost of failure (one crash at 90 % of partition 0)"]
    for r in result["failure"]["table"]:
        lines.append(
            f"{r['mode']:<36} failure-free {r['failure_free_s']:6.1f} s, with crash "
            f"{r['crash_s']:6.1f} s, recovery {r['recovery_s']:+6.1f} s, "
            f"{r['repeated_requests']:,} repeated requests"
            + (f" (bound {r['bound']:,})" if r["bound"] else "")
        )
    lines += ["", "memory: peak RSS of one partition task (outside Spark)"]
    for r in result["memory"]:
        lines.append(
            f"capacity {r['capacity']:>5} checkpoint {str(r['checkpoint_every'] or 'no'):>6}: "
            f"{r['small_peak_mib']:.1f} MiB ({r['small_rows']:,} rows), "
            f"{r['large_peak_mib']:.1f} MiB ({r['large_rows']:,} rows), {r['ratio']:.2f}x"
        )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--cpu-child":
        kind, rows, url, capacity, profile = sys.argv[2:7]
        _cpu_child(kind, int(rows), url, int(capacity), profile == "1")
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--memory-child":
        _memory_child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "")
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small inputs, one repetition")
    parser.add_argument("--capacity", type=positive_int, default=64)
    parser.add_argument(
        "--json", metavar="PATH", type=output_file, help="also write the figures as JSON"
    )
    args = parser.parse_args()
    from stateful_async._signals import sigterm_unwinds

    # a SIGTERM (kill, a timeout) unwinds as Ctrl-C does: the finally blocks stop what the
    # run started and remove its temporary directories
    with sigterm_unwinds():
        result = run(quick=args.quick, capacity=args.capacity)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    print(report(result))


if __name__ == "__main__":
    main()
