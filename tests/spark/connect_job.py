"""A checkpointed enrichment and a delta_rs write on a Spark Connect session, batch and
Structured Streaming, run as its own driver process (a local Connect server cannot share a
process with the tests' classic session). Not a test module.

    python connect_job.py WORKDIR

Prints one JSON object: the outputs, what the checkpoints record, the table's rows.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

from deltalake import DeltaTable  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

from checkpoint import SnapshotStore, delta_dataset  # noqa: E402
from stateful_async.chaos import CrashOnElement  # noqa: E402
from stateful_async.spark import (  # noqa: E402
    CheckpointConfig,
    EnrichmentMetrics,
    local_session,
    ordered_wait,
    register_delta_sink,
    unordered_wait,
)


async def double(row):  # type: ignore[no-untyped-def]
    return [{"id": row["id"], "twice": 2 * row["id"]}]


def main(workdir: str) -> None:
    spark = (
        SparkSession.builder.remote("local[2,3]")  # a Connect server in a JVM of its own
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    df = spark.range(0, 200, numPartitions=2)
    schema = "id long, twice long"
    config = CheckpointConfig(f"{workdir}/chk", "connect", interval_records=20, retain=100)
    crashing = CrashOnElement(double, at=[150])  # the worker dies once, in partition 1
    with warnings.catch_warnings(record=True) as caught:  # the master, read from the conf
        warnings.simplefilter("always")
        enriched = ordered_wait(df, crashing, schema, capacity=8, checkpoint=config)
    ordered = enriched.collect()
    os.environ["STATEFUL_ASYNC_PROGRESS_SECONDS"] = "soon"  # the tasks' too, in local mode
    try:
        ordered_wait(df, double, schema)
        progress = ""
    except Exception as exc:
        progress = f"{type(exc).__name__}: {exc}"
    del os.environ["STATEFUL_ASYNC_PROGRESS_SECONDS"]
    unordered = unordered_wait(
        df, double, schema, capacity=8, event_time="id", max_out_of_orderness=5
    ).collect()
    metas = SnapshotStore(config.location).checkpoints("connect", include_expired=True)
    register_delta_sink(spark)
    table = f"{workdir}/table"
    for _ in range(2):  # idempotent: the second is refused as a replay
        df.selectExpr("id", "id * 2 AS twice").write.format("delta_rs").option(
            "txnAppId", "connect"
        ).option("txnVersion", "1").mode("append").save(table)
    written = delta_dataset(DeltaTable(table)).to_table().column("id").to_pylist()
    try:
        local_session()
        refused = ""
    except Exception as exc:
        refused = f"{type(exc).__name__}: {exc}"
    try:
        EnrichmentMetrics(spark)
        no_metrics = ""
    except Exception as exc:
        no_metrics = f"{type(exc).__name__}: {exc}"
    stream = run_stream(spark, workdir)
    print(
        json.dumps(
            {
                "session": type(spark).__module__,
                "ordered": [[r.id, r.twice] for r in ordered],
                "unordered": sorted([r.id, r.twice] for r in unordered),
                "checkpoints": [
                    [m.subtask, m.properties.get("attempt"), m.parent is not None] for m in metas
                ],
                "table": sorted(written),
                "local_session": refused,
                "stream": stream,
                "metrics": no_metrics,
                "warnings": [str(w.message) for w in caught],
                "progress": progress,
            }
        ),
        flush=True,
    )
    spark.stop()


def write_file(source: str, name: str, ids: range) -> None:
    os.makedirs(source, exist_ok=True)
    with open(f"{source}/{name}.json", "w") as handle:
        handle.writelines(json.dumps({"id": i}) + "\n" for i in ids)


def run_stream(spark: SparkSession, workdir: str) -> dict[str, object]:
    """A file source through ordered_wait into the delta_rs sink, one file per micro-batch:
    a worker dies in the second batch and its task resumes; then the query is started
    again from its checkpoint location with one more file, which alone is processed."""
    source, table = f"{workdir}/stream-in", f"{workdir}/stream-out"
    write_file(source, "a", range(0, 100))
    write_file(source, "b", range(100, 200))
    config = CheckpointConfig(f"{workdir}/chk", "stream", interval_records=20, retain=100)
    query_ids = []
    for _ in range(2):
        df = spark.readStream.schema("id long").option("maxFilesPerTrigger", 1).json(source)
        enriched = ordered_wait(
            df, CrashOnElement(double, at=[150]), "id long, twice long", capacity=8,
            checkpoint=config,
        )  # fmt: skip
        query = (
            enriched.writeStream.format("delta_rs")
            .option("checkpointLocation", f"{workdir}/stream-chk")
            .trigger(availableNow=True)
            .start(table)
        )
        query.awaitTermination()
        query_ids.append(query.id)
        write_file(source, "c", range(200, 300))  # for the restarted query
    rows = delta_dataset(DeltaTable(table)).to_table().to_pylist()
    metas = SnapshotStore(config.location).checkpoints("stream", include_expired=True)
    return {
        "query_ids": query_ids,
        "rows": sorted([r["id"], r["twice"]] for r in rows),
        "checkpoints": [
            [
                m.run_id,
                m.properties.get("query_id"),
                m.properties.get("batch_id"),
                m.properties.get("attempt"),
                m.parent is not None,
                m.final,
            ]
            for m in metas
        ],
    }


if __name__ == "__main__":
    main(sys.argv[1])
