"""``CheckpointConfig``: where and how often a Spark enrichment checkpoints, and what it
resumes from."""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass, field
from typing import Any, Union

from .._exceptions import ConfigurationError, as_int, as_seconds

RestoreFrom = Union[None, str, int]


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpointing of ``ordered_wait`` / ``unordered_wait``.

    ``location`` is a directory (local path or object-store URI; ``storage_options`` are
    passed to deltalake) that every executor can reach: on a cluster, an object store or a
    shared filesystem mounted at the same path everywhere. A relative local path is made
    absolute here, against the working directory of the process that builds the config
    (the driver), so every task uses the same directory (``~`` is the driver's home).
    ``job_id`` names the enrichment there; ``operator_id`` tells two enrichments of one job
    apart.

    Each task checkpoints every ``interval_records`` input records (and, if set, every
    ``interval_seconds``), and once more when its input ends (but for a micro-batch's
    partition that had no input). Every 20 checkpoints, and
    after its final one, a task keeps its ``retain`` newest checkpoints and expires the
    rest (their in-flight state is deleted; results stay while a kept checkpoint's chain
    needs them).

    ``restore_from`` decides what a *new run* starts from (a retried task attempt always
    resumes its own run's latest checkpoint, whatever this says):

    * ``None`` — start fresh; never read another run's checkpoints (the job's checkpoints
      must still have been written with this input and output schema, or the driver
      raises ``SchemaChangedError``, saying how to clear them);
    * ``"latest"`` — each partition resumes from its most recently written checkpoint;
    * ``N`` (an int) — each partition resumes from its most recent checkpoint whose id is
      ``N`` or lower.

    Resuming, the driver warns if another function wrote those checkpoints: their
    results are re-emitted as they are. See ``docs/checkpointing.md`` for what a run and a
    checkpoint id are.
    """

    location: str | os.PathLike[str]  # kept as a str, absolute if local
    job_id: str
    interval_records: int = 10_000
    interval_seconds: float | datetime.timedelta | None = None  # kept as seconds
    retain: int = 3
    restore_from: RestoreFrom = None
    operator_id: str = "enrich"
    storage_options: dict[str, str] | None = field(default=None, hash=False)

    @property
    def _seconds(self) -> float | None:
        """``interval_seconds`` as it is kept: seconds, or None."""
        return self.interval_seconds  # type: ignore[return-value]

    def __post_init__(self) -> None:
        from checkpoint import CheckpointError
        from checkpoint._layout import check_name, check_storage_options, normalize

        try:
            object.__setattr__(self, "location", normalize(self.location))
            check_name("job_id", self.job_id)
            check_name("operator_id", self.operator_id)
            check_storage_options(self.storage_options)
        except CheckpointError as exc:
            raise ConfigurationError(f"CheckpointConfig: {exc}") from None
        records = as_int(self.interval_records)  # numpy's integers too, kept as plain ints
        if records is None or records < 1:
            raise ConfigurationError(
                f"CheckpointConfig interval_records must be an integer >= 1; got "
                f"{self.interval_records!r}."
            )
        object.__setattr__(self, "interval_records", records)
        if self.interval_seconds is not None:
            seconds = as_seconds(self.interval_seconds)
            if seconds is None or not 0 < seconds < math.inf:
                raise ConfigurationError(
                    f"CheckpointConfig interval_seconds must be a number of seconds > 0 (and "
                    f"finite), a timedelta, or None; got {self.interval_seconds!r}."
                )
            object.__setattr__(self, "interval_seconds", seconds)
        retain = as_int(self.retain)
        if retain is None or retain < 1:
            raise ConfigurationError(
                f"CheckpointConfig retain must be an integer >= 1 (checkpoints kept per "
                f"partition); got {self.retain!r}."
            )
        object.__setattr__(self, "retain", retain)
        restore = self.restore_from
        checkpoint_id = as_int(restore)
        if not (
            restore is None
            or (isinstance(restore, str) and restore == "latest")
            or (checkpoint_id is not None and checkpoint_id >= 1)
        ):
            hint = (
                f" (a checkpoint id is an int: restore_from={int(restore)})"
                if isinstance(restore, str) and restore.strip().isdecimal()
                else ""
            )
            raise ConfigurationError(
                f"CheckpointConfig restore_from must be None, 'latest' or a checkpoint id >= 1; "
                f"got {restore!r}{hint}."
            )
        if checkpoint_id is not None:
            object.__setattr__(self, "restore_from", checkpoint_id)


def restore_from_in_streaming(restore_from: Any) -> str:
    """Why ``restore_from`` is refused in a streaming query, or in ``foreachBatch``."""
    return (
        f"restore_from={restore_from!r} is for batch jobs, and this enrichment runs in a "
        "streaming query (a streaming DataFrame, or foreachBatch's DataFrame of one "
        "micro-batch). A streaming query resumes by itself: restarted from its "
        "checkpointLocation, it re-runs the interrupted micro-batch under the same query id "
        "and batch id, and that batch resumes from its own checkpoints. Drop restore_from "
        "(each micro-batch is a run of its own, so it would only find the previous batch's "
        "checkpoints and re-emit their results as this batch's)."
    )
