"""A checkpointed enrichment job run as its own driver process, to be SIGKILLed by a test.

    python adapter_job.py LOCATION JOB_ID SERVICE_URL ROWS OUTPUT_JSON

Prints "started" once the Spark session is up; writes the collected output to
OUTPUT_JSON only if the job completes. Not a test module.
"""

from __future__ import annotations

import json
import sys

from stateful_async.chaos import ServiceEnrichment
from stateful_async.spark import CheckpointConfig, local_session, ordered_wait

SCHEMA = "id long, name string, score double, label string"


def build(spark, rows: int):  # type: ignore[no-untyped-def]
    return spark.range(0, rows, numPartitions=2).selectExpr("id", "concat('user', id) as name")


def main(location: str, job_id: str, url: str, rows: int, output: str) -> None:
    spark = local_session("local[2,3]", app_name="adapter-job")
    print("started", flush=True)
    config = CheckpointConfig(location, job_id, interval_records=250, retain=100)
    result = ordered_wait(
        build(spark, rows),
        ServiceEnrichment(url),
        SCHEMA,
        capacity=10,
        timeout=30.0,
        checkpoint=config,
    ).collect()
    with open(output, "w") as handle:
        json.dump([r.asDict() for r in result], handle)
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
