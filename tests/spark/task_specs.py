"""What tests that run a Spark task in their own process (``_TaskRun``, no Spark) build
it from, and a streaming query run to its end. Not a test module; tests/spark is on
pytest's pythonpath."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from stateful_async import OutputMode
from stateful_async._function import as_async_function
from stateful_async.spark import CheckpointConfig
from stateful_async.spark._task import TaskIdentity, TaskSpec, _TaskRun

#: the input and output schema of these tasks: one ``id`` column
ID_SCHEMA = pa.schema([("id", pa.int64())])


def id_task(
    fn: Any,
    mode: OutputMode = OutputMode.ORDERED,
    capacity: int = 4,
    checkpoint: CheckpointConfig | None = None,
    event_time: str | None = None,
) -> TaskSpec:
    """A task over rows of ``ID_SCHEMA`` that calls ``fn`` (an ``async def`` or an
    AsyncFunction), as the adapter builds one: no timeout, retry or out-of-orderness."""
    return TaskSpec(
        as_async_function(fn), mode, capacity, None, None, ID_SCHEMA, ID_SCHEMA, event_time, 0,
        checkpoint, "app",
    )  # fmt: skip


def id_task_run(spec: TaskSpec, rows: int, partition: int = 0) -> _TaskRun:
    """``spec``'s task in this process (attempt 0 of run app.stage1), over one input batch
    of ids 0 to ``rows`` - 1; its ``run()`` yields its output batches."""
    batch = pa.record_batch([pa.array(range(rows), pa.int64())], schema=ID_SCHEMA)
    return _TaskRun(spec, iter([batch]), TaskIdentity(partition, 0, "app.stage1", {}))


def run_available_now(writer: Any, checkpoint_location: Any, seconds: float = 120) -> None:
    """Start ``writer`` (a DataStreamWriter) with ``trigger(availableNow=True)`` and wait
    for the query to end: it must, within ``seconds``."""
    query = (
        writer.option("checkpointLocation", str(checkpoint_location))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert query.awaitTermination(seconds), f"the query did not end within {seconds} s"
    finally:
        query.stop()
