"""The reference chaos job as a Structured Streaming query, for the chaos suite.

    python integration/stream_job.py --input DIR --spark-checkpoint DIR \\
        [--files-per-trigger N] <the options of python -m stateful_async.chaos.job>

Reads JSON files of ``id``, ``name`` rows from ``--input`` (``--files-per-trigger`` per
micro-batch), enriches them as the reference job does (``build_job``: same function,
checkpoints, schema) and writes them with ``writeStream.format("delta_rs")`` to
``--output``. Once its micro-batches have read ``--rows`` input rows and no data is left,
it stops the query and writes a ``JobReport`` (the table's rows and version, the query's
task attempts) to ``--report``. Prints ``app_id <id>`` once the session is up; exits 0
when the query read every row (what the table holds is for the caller to check).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from stateful_async.chaos import session_for
from stateful_async.chaos._job import build_job, job_report, parse_args, write_report
from stateful_async.spark import register_delta_sink

INPUT_SCHEMA = "id long, name string"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stream_job.py")
    parser.add_argument("--input", required=True, help="directory of JSON input files")
    parser.add_argument("--spark-checkpoint", required=True, help="the query's checkpointLocation")
    parser.add_argument("--files-per-trigger", type=int, default=2)
    parser.add_argument("--deadline", type=float, default=400.0, help="seconds to wait for it")
    args, rest = parser.parse_known_args(argv)
    options = parse_args(rest)
    spark = session_for(options.master, app_name="stateful-async-chaos-stream", cores=options.cores)
    print(f"app_id {spark.sparkContext.applicationId}", flush=True)
    register_delta_sink(spark)
    source = (
        spark.readStream.format("json")
        .schema(INPUT_SCHEMA)
        .option("maxFilesPerTrigger", args.files_per_trigger)
        .load(args.input)
    )
    started = time.time()
    query = (
        build_job(spark, options, source)
        .writeStream.format("delta_rs")
        .option("checkpointLocation", args.spark_checkpoint)
        .trigger(processingTime="500 milliseconds")
        .start(options.output)
    )
    print(f"query {query.id} run {query.runId}", flush=True)
    deadline = time.monotonic() + args.deadline
    read: dict[int, int] = {}  # input rows per completed micro-batch
    while True:
        if query.exception() is not None:
            print(f"error: the query failed: {query.exception()}", file=sys.stderr, flush=True)
            spark.stop()
            return 1
        read |= {p["batchId"]: p["numInputRows"] for p in query.recentProgress}
        status = query.status
        idle = not status["isDataAvailable"] and not status["isTriggerActive"]
        if idle and sum(read.values()) >= options.rows:
            break  # every input row went through a completed micro-batch
        if time.monotonic() > deadline:
            print(
                f"error: {sum(read.values())} of {options.rows} input rows read after "
                f"{args.deadline} s",
                file=sys.stderr,
            )
            spark.stop()
            return 1
        time.sleep(0.5)
    query.stop()
    report = job_report(
        spark, options, started, time.time() - started, None, job_group=str(query.runId)
    )
    write_report(report, options.report)
    print(f"done: {report.rows_in_table} rows in {options.output}", flush=True)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
