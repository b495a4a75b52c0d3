"""Write throughput: the delta_rs sink vs Spark's own Parquet writer, same data, one run.

Both writers get the same cached DataFrame (id, category, amount, ts, label) on a local
``local[2,3]`` session; each first writes a small warm-up DataFrame (so Python worker
start-up is not charged to the sink), then the timed write runs once. The sink's figure
includes the work Parquet alone does not do: Arrow transfer to Python workers, exact
per-file statistics and the Delta commit. Prints rows/s of both and the ratio
(sink rows/s divided by Parquet rows/s; 1.0 = as fast as Spark's writer).

    python benchmarks/sink_bench.py            # 4M rows
    python benchmarks/sink_bench.py --quick    # 200k rows, a smoke run
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from options import positive_int  # benchmarks/ is on sys.path: these are scripts
from scratch import run_prefix

COLUMNS = [
    "id",
    "CONCAT('cat-', CAST(id % 20 AS STRING)) AS category",
    "CAST(id AS DOUBLE) * 0.37 AS amount",
    "TIMESTAMP_MICROS(1700000000000000 + id * 1000) AS ts",
    "CONCAT('label-', CAST(id * 7919 % 1000003 AS STRING)) AS label",
]


def _timed(write: Any) -> float:
    start = time.perf_counter()
    write()
    return time.perf_counter() - start


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*.parquet"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200k rows instead of 4M")
    parser.add_argument("--rows", type=positive_int, default=None, help="number of rows")
    parser.add_argument(
        "--partitions", type=positive_int, default=4, help="Spark partitions (tasks)"
    )
    args = parser.parse_args()
    rows = args.rows or (200_000 if args.quick else 4_000_000)
    from stateful_async._signals import sigterm_unwinds

    # a SIGTERM (kill, a timeout) unwinds as Ctrl-C does: the finally block stops Spark and
    # removes the temporary directory
    with sigterm_unwinds():
        measure(rows, args.partitions)


def measure(rows: int, partitions: int) -> None:
    """Writes the same cached DataFrame with both writers and prints the table."""
    from deltalake import DeltaTable

    from checkpoint import delta_dataset
    from stateful_async.spark import local_session, register_delta_sink

    spark = local_session("local[2,3]", app_name="sink-bench")
    register_delta_sink(spark)
    work = Path(tempfile.mkdtemp(prefix=run_prefix("sink-bench-")))
    try:
        df = spark.range(0, rows, numPartitions=partitions).selectExpr(*COLUMNS).cache()
        assert df.count() == rows  # materialise the cache: both writers read memory
        warm = spark.range(0, 1000, numPartitions=2).selectExpr(*COLUMNS)
        warm.write.mode("overwrite").parquet(str(work / "warm-parquet"))
        warm.write.format("delta_rs").mode("overwrite").save(str(work / "warm-delta"))

        parquet_path, delta_path = work / "parquet", work / "delta"
        parquet_s = _timed(lambda: df.write.mode("overwrite").parquet(str(parquet_path)))
        sink_s = _timed(lambda: df.write.format("delta_rs").mode("overwrite").save(str(delta_path)))

        assert spark.read.parquet(str(parquet_path)).count() == rows
        table = DeltaTable(str(delta_path))
        assert table.count() == rows
        assert delta_dataset(table).to_table(columns=["id"]).num_rows == rows

        parquet_rate, sink_rate = rows / parquet_s, rows / sink_s
        print(f"rows: {rows:,}   tasks: {partitions}   machine: local[2,3]")
        print(f"{'writer':<28}{'seconds':>9}{'rows/s':>14}{'MiB on disk':>13}")
        for name, seconds, rate, path in (
            ("spark df.write.parquet", parquet_s, parquet_rate, parquet_path),
            ("delta_rs sink (delta-rs)", sink_s, sink_rate, delta_path),
        ):
            print(f"{name:<28}{seconds:>9.2f}{rate:>14,.0f}{_size(path) / 2**20:>13.1f}")
        print(f"ratio (sink / parquet rows/s): {sink_rate / parquet_rate:.2f}x")
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
