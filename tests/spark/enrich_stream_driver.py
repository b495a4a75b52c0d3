"""A streaming driver for the ``ordered_wait`` streaming tests, run in its own process so a
test can SIGKILL it (driver, JVM and Python workers) in the middle of a micro-batch.

    python enrich_stream_driver.py SOURCE_DIR TABLE_PATH STREAM_CHECKPOINT SNAPSHOTS URL

The query reads the JSON files of SOURCE_DIR one per micro-batch, enriches every row with
the mock service at URL through ``ordered_wait`` (snapshots in SNAPSHOTS) and writes the
results with the delta_rs sink; it runs until killed. ``start_query`` is also imported by
the tests to start (or restart) the same query in-process.
"""

from __future__ import annotations

import sys
from typing import Any

SCHEMA = "id long, name string, score double, label string"
CAPACITY, INTERVAL = 5, 50


def start_query(
    spark: Any,
    source: str,
    table: str,
    stream_checkpoint: str,
    snapshots: str,
    url: str,
    *,
    function: Any = None,
    operator_id: str = "enrich",
) -> Any:
    from stateful_async.chaos import ServiceEnrichment
    from stateful_async.spark import CheckpointConfig, ordered_wait

    df = (
        spark.readStream.schema("id long, name string").option("maxFilesPerTrigger", 1).json(source)
    )
    enriched = ordered_wait(
        df,
        function or ServiceEnrichment(url),
        SCHEMA,
        capacity=CAPACITY,
        timeout=30.0,
        checkpoint=CheckpointConfig(
            snapshots, "stream", interval_records=INTERVAL, retain=100, operator_id=operator_id
        ),
    )
    return (
        enriched.writeStream.format("delta_rs")
        .option("checkpointLocation", stream_checkpoint)
        .start(table)
    )


def renamed_enrichment(url: str) -> Any:
    """The same enrichment as a class of another name: new code deployed on a restart."""
    from stateful_async.chaos import ServiceEnrichment

    class RenamedEnrichment(ServiceEnrichment):
        pass

    return RenamedEnrichment(url)


def main(argv: list[str]) -> None:
    from stateful_async.spark import local_session, register_delta_sink

    source, table, stream_checkpoint, snapshots, url = argv
    spark = local_session("local[2,3]", app_name="enrich-stream-sigkill-driver")
    register_delta_sink(spark)
    query = start_query(spark, source, table, stream_checkpoint, snapshots, url)
    print(f"started {query.id}", flush=True)
    query.awaitTermination()


if __name__ == "__main__":
    main(sys.argv[1:])
