"""Counters of an enrichment, summed on the driver over its tasks (a Spark accumulator)."""

from __future__ import annotations

from typing import Any

from .._exceptions import ConfigurationError
from ._session import is_connect

#: What ``EnrichmentMetrics.value`` holds; see its docstring.
COUNTERS = (
    "tasks",
    "records",
    "results",
    "attempts",
    "retries",
    "timeouts",
    "checkpoints",
    "resumed_tasks",
    "restored_results",
    "restored_in_flight",
    "skipped_inputs",
)


def zero_counters() -> dict[str, int]:
    return dict.fromkeys(COUNTERS, 0)


class DriverOnlyError(TypeError):
    """Raised when something that lives on the driver is pickled to go to the executors."""


class _CountersParam:
    """How Spark adds up the tasks' counters (PySpark's ``AccumulatorParam`` protocol)."""

    def zero(self, value: dict[str, int]) -> dict[str, int]:
        return zero_counters()

    def addInPlace(self, total: dict[str, int], more: dict[str, int]) -> dict[str, int]:  # noqa: N802 - PySpark's name
        for name, count in more.items():
            total[name] = total.get(name, 0) + count
        return total


class EnrichmentMetrics:
    """Counters of the ``ordered_wait`` / ``unordered_wait`` calls given ``metrics=`` this
    object, summed over their tasks on the driver: what each task's summary line in its
    executor's log says, for the whole job.

    ``value`` is a dict of counts:

    * ``tasks``: task attempts that finished their partition (and whose output Spark read
      to its end: see below);
    * ``records``: rows handed to the function (a resumed task's re-invoked in-flight rows
      included); ``attempts``: calls of the function (``records`` plus ``retries``);
      ``retries``; ``timeouts``: rows whose time ran out (their ``timeout`` handler ran);
    * ``results``: result rows the function's calls produced;
    * ``checkpoints``: checkpoints committed;
    * ``resumed_tasks``: tasks that resumed from a checkpoint, which re-emitted
      ``restored_results`` committed results without calling the function, re-invoked
      ``restored_in_flight`` rows and skipped ``skipped_inputs`` rows of their input.

    So a job writes ``results + restored_results`` rows, and its tasks read
    ``records - restored_in_flight + skipped_inputs`` input rows. It is a Spark accumulator:
    only task attempts that finish are counted (a failed attempt's calls show as a retry's
    restored and skipped counts, or as calls made again); a DataFrame computed twice (two
    actions on it, or a stage Spark runs again after losing an executor) counts twice; a
    streaming query's counts add up over its micro-batches. Read ``value`` after an
    action, on the driver; ``reset()`` zeroes it. Spark Connect has no accumulators: there,
    read the executor logs or the checkpoints (``stateful-async checkpoints list``).

    Actions that stop reading a partition early leave its task out: ``show()``,
    ``take(n)``, ``first()``, ``head()``, and ``limit(n)`` after the enrichment
    (``limit(n).collect()``, ``limit(n).count()``). PySpark sends a Python task's
    accumulator updates after its last output row, and Spark ends a task whose rows it no
    longer wants without reading them, so Spark drops them: that task adds nothing, not the
    rows it read, nor the calls it made (it reads ahead of what Spark takes, so the service
    was called). Such an action's counts are those of the partitions Spark read to the end
    (in ``take(n)``, those with fewer than ``n`` rows), not the action's;
    ``orderBy(...).limit(n)`` reads every partition to its end, and counts in full. To
    count a sample, enrich the sample and read all of it:
    ``ordered_wait(df.limit(n), ...).collect()``.
    """

    def __init__(self, spark: Any) -> None:
        from pyspark.sql import SparkSession

        if not isinstance(spark, SparkSession) and not is_connect(spark):
            raise ConfigurationError(
                f"EnrichmentMetrics needs the SparkSession the job runs on; got "
                f"{type(spark).__name__}."
            )
        if is_connect(spark):
            raise ConfigurationError(
                "EnrichmentMetrics needs a classic SparkSession: it is a Spark accumulator, "
                "and Spark Connect has none. On Connect, each task's summary line is in its "
                "executor's log, and with checkpoints `stateful-async checkpoints list` "
                "shows every partition's progress."
            )
        self._accumulator = spark.sparkContext.accumulator(zero_counters(), _CountersParam())

    @property
    def accumulator(self) -> Any:
        """The Spark accumulator the tasks add their counts to."""
        return self._accumulator

    @property
    def value(self) -> dict[str, int]:
        """The counts so far (a copy), by name; see the class docstring."""
        return {name: int(self._accumulator.value.get(name, 0)) for name in COUNTERS}

    def reset(self) -> None:
        """Zero every count (on the driver, between jobs)."""
        self._accumulator.value = zero_counters()

    def __reduce__(self) -> Any:
        raise DriverOnlyError(
            "EnrichmentMetrics lives on the driver: pass it as ordered_wait(..., metrics=...) "
            "rather than using it inside a function that Spark ships to executors."
        )

    def __repr__(self) -> str:
        counts = ", ".join(f"{name}={count:,}" for name, count in self.value.items())
        return f"EnrichmentMetrics({counts})"
