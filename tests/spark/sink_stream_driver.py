"""A streaming driver for the delta_rs sink tests, run in its own process so a test can
SIGKILL it (driver, JVM and Python workers) in the middle of a query.

    python sink_stream_driver.py SOURCE_DIR TABLE_PATH CHECKPOINT_DIR

The query reads the Parquet files of SOURCE_DIR one per micro-batch, one micro-batch a
second, and writes them to the Delta table with the delta_rs sink; it runs until killed.
``start_query`` is also imported by the tests to restart the same query in-process.
"""

from __future__ import annotations

import sys
from typing import Any

SOURCE_SCHEMA = "id long, name string, amount double, ts timestamp"


def start_query(
    spark: Any, source: str, table: str, checkpoint: str, *, interval: str | None, **options: str
) -> Any:
    """Start the query: a micro-batch every ``interval``, or ``availableNow`` if None;
    ``options`` go to the sink."""
    writer = (
        spark.readStream.schema(SOURCE_SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .parquet(source)
        .writeStream.format("delta_rs")
        .option("checkpointLocation", checkpoint)
        .options(**options)
    )
    if interval is None:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=interval)
    return writer.start(table)


def main(argv: list[str]) -> None:
    from stateful_async.spark import local_session, register_delta_sink

    source, table, checkpoint = argv
    spark = local_session("local[2,3]", app_name="delta-sink-sigkill-driver")
    register_delta_sink(spark)
    query = start_query(spark, source, table, checkpoint, interval="1 second")
    print(f"started {query.id}", flush=True)
    query.awaitTermination()


if __name__ == "__main__":
    main(sys.argv[1:])
