"""The reference chaos job, its fault options, and the checks that prove a run exactly-once.

The job (``run_job``; command line ``python -m stateful_async.chaos.job``) generates its
input (``id``, ``name`` for ids ``0 .. rows-1`` in ``partitions`` partitions, the same on
every run), enriches every row from the mock service with ``ordered_wait`` or
``unordered_wait`` under a ``CheckpointConfig``, and writes the result through the
``delta_rs`` sink in one idempotent batch commit (app transaction ``(job id, 1)``).

Faults are off unless ``--fault`` asks for one; each wraps the enrichment function:

============================  ===========================================================
``crash-at=K``                the Python worker dies (``os._exit``) when asked to enrich
                              row ``K`` (``CrashOnElement``)
``crash-commit=ID``           the Python worker dies while committing checkpoint ``ID``:
                              the fault writes a Parquet file of its rows, the Delta commit
                              never happens (``CrashDuringCommit``)
``delay-commit=ID:SECONDS``   the commit of checkpoint ``ID`` is held ``SECONDS``
                              (``DelayCommit``)
``zombie-commit=ID``          the commit of checkpoint ``ID`` is held until another
                              attempt of the same task has committed ``ID``, then made:
                              a zombie committing late (``ZombieCommit``; run it with
                              ``--speculation`` so that there is another attempt)
============================  ===========================================================

Each takes ``,attempt=A`` (default 0: only the first attempt is hit, so the retry
succeeds) and ``,partition=P`` (repeatable; default: every partition); ``zombie-commit``
also ``,wait=SECONDS`` (default 300), how long it waits for the newer attempt. A fault that
can never fire on the generated input is refused before Spark starts; one that did not
fire all the same (its attempt never ran, a resumed run skipped its row) is named in the
report's ``unfired_faults`` and in a warning on stderr.

The checks — ``compare_outputs``, ``check_snapshot_store``, ``request_repeats`` — work on
any job's output, snapshot store and service counters, not only this job's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import reprlib
import sys
import time
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Union

from .._exceptions import ConfigurationError, StatefulAsyncError, as_int, id_ranges
from .._function import AsyncFunction
from .._operator import check_capacity_and_timeout
from .._retry import RetryStrategy
from ._client import ServiceEnrichment, ServiceError
from ._faults import (
    CrashDuringCommit,
    CrashOnElement,
    DelayCommit,
    ZombieCommit,
    checked_aim,
    checked_seconds,
)
from ._service import expected_enrichment

if TYPE_CHECKING:
    from ..spark import CheckpointConfig

SCHEMA = "id long, name string, score double, label string"
"""The reference job's output schema (its input is ``id long, name string``)."""

FALLBACK = {"score": -1.0, "label": "fallback"}
"""What ``--fallback`` gives a row whose enrichment timed out."""

OPERATOR_ID = "enrich"
# spark.task.maxFailures of session_for: a task gets attempts 0 .. MAX_TASK_ATTEMPTS - 1
MAX_TASK_ATTEMPTS = 8
MODES = ("ordered", "unordered")
FAULT_KINDS = ("crash-at", "crash-commit", "delay-commit", "zombie-commit")

RestoreFrom = Union[None, str, int]


class ChaosCheckError(StatefulAsyncError):
    """A chaos check found the output or the snapshot store inconsistent."""


# -- faults ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FaultSpec:
    """One ``--fault`` option: ``KIND=VALUE[,attempt=A][,partition=P]...``. ``kind`` is
    ``crash-at``, ``crash-commit``, ``delay-commit`` or ``zombie-commit``; any other raises
    ``ConfigurationError``, as do ``seconds`` on a kind but delay-commit and ``wait`` on a
    kind but zombie-commit."""

    kind: str
    value: int
    seconds: float = 0.0
    attempt: int = 0
    partitions: tuple[int, ...] | None = None
    wait: float = 300.0  # zombie-commit: how long to wait for the newer attempt

    def __post_init__(self) -> None:
        # wrap() would make any other kind a zombie-commit: another fault than the one asked
        if self.kind not in FAULT_KINDS:
            raise ConfigurationError(
                f"Unknown fault kind {self.kind!r}: use one of {', '.join(FAULT_KINDS)}."
            )
        # wrap() would drop them without a word, as the command line refuses them
        if self.seconds != 0.0 and self.kind != "delay-commit":
            raise ConfigurationError(
                f"A {self.kind} fault takes no seconds (only delay-commit does); got "
                f"seconds={self.seconds!r}."
            )
        if self.wait != 300.0 and self.kind != "zombie-commit":
            raise ConfigurationError(
                f"A {self.kind} fault takes no wait (only zombie-commit does); got "
                f"wait={self.wait!r}."
            )

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        head, *extras = [part.strip() for part in text.split(",")]
        kind, sep, value = (part.strip() for part in head.partition("="))
        if not sep or kind not in FAULT_KINDS:
            raise ConfigurationError(
                f"Unknown fault {text!r}: use one of {', '.join(k + '=...' for k in FAULT_KINDS)}"
                ", optionally followed by ,attempt=A and ,partition=P."
            )
        attempt, partitions, wait = 0, [], 300.0
        settings = ["attempt", "partition", *(["wait"] if kind == "zombie-commit" else [])]
        given: set[str] = set()
        try:
            seconds = 0.0
            if kind == "delay-commit":
                number, sep, delay = value.partition(":")
                if not sep:
                    raise ValueError("delay-commit needs ID:SECONDS")
                value, seconds = number, float(delay)
            for extra in extras:
                name, _, setting = (part.strip() for part in extra.partition("="))
                if name not in settings:
                    raise ValueError(
                        f"unknown setting {name!r}; {kind} takes {', '.join(settings)}"
                    )
                if name in given and name != "partition":  # one would silently win
                    raise ValueError(f"{name} is given twice")
                given.add(name)
                if name == "attempt":
                    attempt = int(setting)
                elif name == "partition":
                    partitions.append(int(setting))
                else:
                    wait = float(setting)
            spec = cls(kind, int(value), seconds, attempt, tuple(partitions) or None, wait)
        except ValueError as exc:
            raise ConfigurationError(
                f"Cannot read the fault {text!r}: {exc}. Examples: crash-at=1234, "
                "crash-commit=3,partition=0, delay-commit=2:5, zombie-commit=2,partition=0."
            ) from exc
        if spec.value < (0 if kind == "crash-at" else 1):
            raise ConfigurationError(
                f"The fault {text!r} needs a row id >= 0 or checkpoint id >= 1."
            )
        try:  # the faults' own checks of seconds, attempt and partitions
            checked_aim(spec.attempt, spec.partitions)
            checked_seconds("delay-commit's seconds", spec.seconds)
            checked_seconds("zombie-commit's wait", spec.wait)
        except ConfigurationError as exc:
            raise ConfigurationError(f"Cannot use the fault {text!r}: {exc}") from None
        return spec

    def wrap(self, fn: Any) -> AsyncFunction[Any, Any]:
        if self.kind == "crash-at":
            return CrashOnElement(
                fn, at=[self.value], attempt=self.attempt, partitions=self.partitions
            )
        if self.kind == "crash-commit":
            return CrashDuringCommit(fn, self.value, self.attempt, self.partitions)
        if self.kind == "delay-commit":
            return DelayCommit(fn, self.value, self.seconds, self.attempt, self.partitions)
        return ZombieCommit(fn, self.value, self.attempt, self.partitions, self.wait)

    def __str__(self) -> str:
        text = f"{self.kind}={self.value}" + (
            f":{self.seconds!r}" if self.kind == "delay-commit" else ""
        )
        text += f",attempt={self.attempt}" if self.attempt else ""
        text += "".join(f",partition={p}" for p in self.partitions or ())
        return text + (f",wait={self.wait!r}" if self.kind == "zombie-commit" else "")


# -- options ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobOptions:
    """Everything the reference job takes (the command line's options).

    Checked when made, with the checks the job's parts run themselves (the operator's
    capacity and timeout, ``RetryStrategy``, ``CheckpointConfig``, the ``delta_rs`` sink's
    options, the fault wrappers'), so that ``ConfigurationError`` names a bad option before
    Spark starts. A fault that can never fire on the job's generated input is refused
    too: a row id outside the input (or outside the partitions it is aimed at), a
    partition the job does not have, a task attempt Spark never makes (without
    speculation), a checkpoint id beyond those a fresh run takes (``restore_from`` unset).
    """

    master: str
    service_url: str
    checkpoint: str
    output: str
    rows: int = 10_000
    partitions: int = 2
    mode: str = "ordered"
    job_id: str = "chaos-enrich"
    capacity: int = 10
    interval: int = 500
    retain: int = 3
    timeout: float = 30.0
    max_attempts: int = 1
    retry_delay: float = 0.05
    fallback: bool = False
    restore_from: RestoreFrom = None
    faults: tuple[FaultSpec, ...] = ()
    speculation: bool = False
    cores: int | None = None
    driver_host: str | None = None
    txn_version: int = 1
    report: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigurationError(f"mode must be 'ordered' or 'unordered'; got {self.mode!r}.")
        rows, partitions = as_int(self.rows), as_int(self.partitions)
        if rows is None or rows < 0 or partitions is None or partitions < 1:
            raise ConfigurationError(
                f"rows must be an integer >= 0 and partitions one >= 1; got rows={self.rows!r}, "
                f"partitions={self.partitions!r}."
            )
        for what, path in (("checkpoint", self.checkpoint), ("output", self.output)):
            if "://" not in path and not os.path.isabs(path):
                raise ConfigurationError(
                    f"The {what} location must be an absolute path or a URI (executors do not "
                    f"run in this directory); got {path!r}."
                )
        # The operator's, the checkpoint config's and the sink's own checks, run now: the
        # command line refuses a bad option before Spark starts, not as a failed job.
        from ..spark._sink_options import SinkOptions

        with _option("service_url"):
            ServiceEnrichment(self.service_url)
        with _option("capacity"):
            check_capacity_and_timeout(self.capacity, None, None)
        with _option("timeout"):
            check_capacity_and_timeout(1, self.timeout, None)
        with _option("max_attempts", "retry_delay"):
            check_capacity_and_timeout(self.capacity, self.timeout, self.retry_strategy())
        with _option("checkpoint", "job_id"):
            self.checkpoint_config(interval_records=1, retain=1, restore_from=None)
        with _option("interval"):
            self.checkpoint_config(retain=1, restore_from=None)
        with _option("retain"):
            self.checkpoint_config(restore_from=None)
        with _option("restore_from"):
            self.checkpoint_config()
        with _option("txn_version"):
            if as_int(self.txn_version) is None:
                raise ConfigurationError(f"it must be an integer; got {self.txn_version!r}.")
            SinkOptions.parse(
                {"path": self.output, "txnAppId": self.job_id, "txnVersion": str(self.txn_version)},
                streaming=False,
            )
        if self.cores is not None and (as_int(self.cores) is None or self.cores < 1):
            raise ConfigurationError(
                f"cores (--cores) caps the job's cores: an integer >= 1, or None for every core "
                f"the cluster offers; got {self.cores!r}."
            )
        for fault in self.faults:
            self._check_fault(fault)

    def retry_strategy(self) -> RetryStrategy | None:
        """Retries on an HTTP error status (``ServiceError``): ``max_attempts`` in all,
        ``retry_delay`` apart; None for one attempt (the strategy is still built, so that
        a bad delay is refused either way)."""
        retry = RetryStrategy.fixed_delay(
            self.max_attempts, self.retry_delay, retry_on_exception=(ServiceError,)
        )
        return retry if retry.max_attempts > 1 else None

    def checkpoint_config(self, **changes: Any) -> CheckpointConfig:
        """The job's ``CheckpointConfig`` (``changes`` replace its settings)."""
        from ..spark import CheckpointConfig

        settings: dict[str, Any] = {
            "interval_records": self.interval,
            "retain": self.retain,
            "restore_from": self.restore_from,
            "operator_id": OPERATOR_ID,
        }
        return CheckpointConfig(self.checkpoint, self.job_id, **{**settings, **changes})

    def _check_fault(self, fault: FaultSpec) -> None:
        """Refuse a fault that can never fire on this job's input (the generated rows:
        ``partition_ids``), or that its wrapper refuses."""

        def refuse(why: str) -> ConfigurationError:
            return ConfigurationError(f"The fault {str(fault)!r} can never fire: {why}.")

        try:
            fault.wrap(_identity)  # the wrapper's own checks (ids, seconds, attempt, ...)
        except ConfigurationError as exc:
            raise ConfigurationError(f"Cannot use the fault {str(fault)!r}: {exc}") from None
        # (a speculative copy takes an attempt number without a failure: then any may come)
        if fault.attempt >= MAX_TASK_ATTEMPTS and not self.speculation:
            raise refuse(
                f"Spark makes at most {MAX_TASK_ATTEMPTS} attempts of a task, numbered 0 to "
                f"{MAX_TASK_ATTEMPTS - 1} (spark.task.maxFailures={MAX_TASK_ATTEMPTS})"
            )
        aimed = sorted(fault.partitions) if fault.partitions is not None else None
        missing = [p for p in aimed or () if p >= self.partitions]
        if missing:
            raise refuse(
                f"the job has partitions 0 to {self.partitions - 1} (--partitions "
                f"{self.partitions}), not {id_ranges(missing)}"
            )
        partitions = aimed if aimed is not None else list(range(self.partitions))
        where = "" if aimed is None else f" of partition(s) {id_ranges(aimed)}"
        if fault.kind == "crash-at":
            if not any(
                fault.value in partition_ids(self.rows, self.partitions, p) for p in partitions
            ):
                raise refuse(
                    f"row {fault.value} is not among the input rows{where} (ids "
                    f"{_id_span(self.rows, self.partitions, partitions)} with --rows "
                    f"{self.rows} --partitions {self.partitions})"
                )
        elif self.restore_from is None:  # a resumed run numbers on from the store's ids
            # A fresh run's task checkpoints every `interval` records and once at the end:
            # ids 1 .. its rows // interval + 1.
            last = max(
                len(partition_ids(self.rows, self.partitions, p)) // self.interval + 1
                for p in partitions
            )
            if fault.value > last:
                raise refuse(
                    f"the tasks{where} take checkpoints 1 to {last} at most (one every "
                    f"{self.interval} records, --interval, and a final one; --rows "
                    f"{self.rows} in {self.partitions} partitions)"
                )

    @property
    def retry_bound(self) -> int:
        """Repeated requests allowed per failed task attempt: ``capacity + interval``."""
        return self.capacity + self.interval


async def _identity(row: Any) -> list[Any]:
    return [row]


def _id_span(rows: int, partitions: int, chosen: Sequence[int]) -> str:
    ids = [partition_ids(rows, partitions, p) for p in chosen]
    spans = [f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) for r in ids if len(r)]
    return ", ".join(spans) or "none"


@contextlib.contextmanager
def _option(*names: str) -> Iterator[None]:
    """Name the option(s) (field and command-line flag) that a check refused."""
    try:
        yield
    except ConfigurationError as exc:
        flags = ", ".join(f"{name} (--{name.replace('_', '-')})" for name in names)
        raise ConfigurationError(f"Invalid job option {flags}: {exc}") from None


def _restore_from(text: str) -> RestoreFrom:
    if text == "latest":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--restore-from takes 'latest' or a checkpoint id; got {text!r}"
        ) from None


def _fault(text: str) -> FaultSpec:
    try:
        return FaultSpec.parse(text)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: Sequence[str] | None = None) -> JobOptions:
    parser = argparse.ArgumentParser(
        prog="python -m stateful_async.chaos.job",
        description=(
            "The stateful-async reference chaos job: generated input, enriched from the mock "
            "service with checkpoints, written exactly once to a Delta table."
        ),
    )
    parser.add_argument("--master", required=True, help="spark://host:port, or local[N,F]")
    parser.add_argument("--service-url", required=True, help="the mock service, http://host:port")
    parser.add_argument("--checkpoint", required=True, help="checkpoint location (absolute)")
    parser.add_argument("--output", required=True, help="the Delta table to write (absolute)")
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--mode", choices=MODES, default="ordered")
    parser.add_argument("--job-id", default="chaos-enrich")
    parser.add_argument("--capacity", type=int, default=10, help="requests in flight per task")
    parser.add_argument("--interval", type=int, default=500, help="records per checkpoint")
    parser.add_argument("--retain", type=int, default=3, help="checkpoints kept per partition")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per row")
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=1,
        help="total attempts per row on an HTTP error status (>= 400)",
    )
    parser.add_argument("--retry-delay", type=float, default=0.05, help="seconds between attempts")
    parser.add_argument(
        "--fallback", action="store_true", help=f"a row that times out gets {FALLBACK}"
    )
    parser.add_argument("--restore-from", type=_restore_from, default=None)
    parser.add_argument(
        "--fault", type=_fault, action="append", default=[], help="|".join(FAULT_KINDS)
    )
    parser.add_argument("--speculation", action="store_true", help="speculative task copies")
    parser.add_argument(
        "--cores", type=int, default=None, help="cap the job's cores; wait until they register"
    )
    parser.add_argument(
        "--driver-host", default=None, help="the driver's address as executors see it"
    )
    parser.add_argument("--txn-version", type=int, default=1, help="the sink's txnVersion")
    parser.add_argument("--report", default=None, help="write the run's JSON report here")
    args = parser.parse_args(argv)
    try:
        return JobOptions(
            master=args.master,
            service_url=args.service_url,
            checkpoint=args.checkpoint,
            output=args.output,
            rows=args.rows,
            partitions=args.partitions,
            mode=args.mode,
            job_id=args.job_id,
            capacity=args.capacity,
            interval=args.interval,
            retain=args.retain,
            timeout=args.timeout,
            max_attempts=args.max_attempts,
            retry_delay=args.retry_delay,
            fallback=args.fallback,
            restore_from=args.restore_from,
            faults=tuple(args.fault),
            speculation=args.speculation,
            cores=args.cores,
            driver_host=args.driver_host,
            txn_version=args.txn_version,
            report=args.report,
        )
    except ConfigurationError as exc:
        parser.error(str(exc))
        raise  # pragma: no cover - parser.error exits


def to_argv(options: JobOptions) -> list[str]:
    """The command-line arguments that give ``options`` (the inverse of ``parse_args``)."""
    argv = [
        "--master", options.master,
        "--service-url", options.service_url,
        "--checkpoint", options.checkpoint,
        "--output", options.output,
        "--rows", str(options.rows),
        "--partitions", str(options.partitions),
        "--mode", options.mode,
        "--job-id", options.job_id,
        "--capacity", str(options.capacity),
        "--interval", str(options.interval),
        "--retain", str(options.retain),
        "--timeout", str(options.timeout),
        "--max-attempts", str(options.max_attempts),
        "--retry-delay", str(options.retry_delay),
        "--txn-version", str(options.txn_version),
    ]  # fmt: skip
    if options.fallback:
        argv.append("--fallback")
    if options.restore_from is not None:
        argv += ["--restore-from", str(options.restore_from)]
    for fault in options.faults:
        argv += ["--fault", str(fault)]
    if options.speculation:
        argv.append("--speculation")
    if options.cores is not None:
        argv += ["--cores", str(options.cores)]
    if options.driver_host:
        argv += ["--driver-host", options.driver_host]
    if options.report:
        argv += ["--report", options.report]
    return argv


# -- the job ---------------------------------------------------------------------------------


def session_for(
    master: str,
    app_name: str = "stateful-async-chaos-job",
    *,
    speculation: bool = False,
    cores: int | None = None,
    driver_host: str | None = None,
    quick_start: bool = True,
    conf: dict[str, Any] | None = None,
) -> Any:
    """A ``SparkSession`` on ``master`` (a ``LocalCluster``'s ``master_url``, any
    ``spark://`` master, or ``local[N,F]``) set up for chaos runs.

    Failed tasks are retried (up to 8 attempts) and executors run Python with this
    interpreter. ``cores`` caps the application's cores and makes the session wait (up to
    two minutes) until executors with that many cores have registered, so that every
    partition starts at once. ``speculation`` launches speculative copies of slow tasks
    quickly. ``quick_start`` gives the driver and executor JVMs flags that favour start-up
    over peak speed (C1 JIT only, serial GC): chaos runs are short. The driver listens on
    127.0.0.1 unless ``driver_host`` names the address executors reach it at (e.g. in
    docker-compose). ``conf`` overrides any of these settings.
    """
    from ..spark import local_session

    settings: dict[str, Any] = {
        "spark.task.maxFailures": str(MAX_TASK_ATTEMPTS),
        "spark.pyspark.python": sys.executable,
        "spark.executor.memory": "1g",
    }
    if quick_start:
        flags = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
        settings["spark.driver.extraJavaOptions"] = flags
        settings["spark.executor.extraJavaOptions"] = flags
    if cores is not None:
        settings.update(
            {
                "spark.cores.max": str(cores),
                "spark.scheduler.minRegisteredResourcesRatio": "1.0",
                "spark.scheduler.maxRegisteredResourcesWaitingTime": "120s",
            }
        )
    if speculation:
        settings.update(
            {
                "spark.speculation": "true",
                "spark.speculation.interval": "100ms",
                "spark.speculation.quantile": "0.5",
                "spark.speculation.multiplier": "1.5",
                "spark.speculation.minTaskRuntime": "500ms",
                "spark.speculation.efficiency.enabled": "false",
            }
        )
    if driver_host:
        settings.update({"spark.driver.host": driver_host, "spark.driver.bindAddress": "0.0.0.0"})
    settings.update(conf or {})
    return local_session(master, app_name, settings)


def partition_ids(rows: int, partitions: int, partition: int) -> range:
    """The ids the job's input puts in ``partition`` (``spark.range`` splits evenly)."""
    return range(partition * rows // partitions, (partition + 1) * rows // partitions)


def generate_input(spark: Any, rows: int, partitions: int) -> Any:
    """The job's input: ``id`` 0..rows-1 and ``name`` 'user<id>', the same on every run."""
    return spark.range(0, rows, 1, partitions).selectExpr("id", "concat('user', id) AS name")


def expected_output(
    rows: int, fallback_keys: Iterable[int] = (), ids: Iterable[int] | None = None
) -> list[dict[str, Any]]:
    """What the job must write, computed without the service, sorted by id. Rows in
    ``fallback_keys`` carry ``FALLBACK`` (their enrichment timed out)."""
    fallback = set(fallback_keys)
    out = []
    for i in range(rows) if ids is None else ids:
        answer = FALLBACK if i in fallback else expected_enrichment(str(i))
        out.append(
            {"id": i, "name": f"user{i}", "score": answer["score"], "label": answer["label"]}
        )
    return out


def enrichment_function(options: JobOptions) -> AsyncFunction[Any, Any]:
    """``ServiceEnrichment`` against the service, wrapped in the requested faults."""
    fn: AsyncFunction[Any, Any] = ServiceEnrichment(
        options.service_url, fallback=dict(FALLBACK) if options.fallback else None
    )
    for fault in options.faults:
        fn = fault.wrap(fn)
    return fn


@dataclass(frozen=True)
class TaskAttempt:
    """One task attempt of a job, as Spark's status store recorded it."""

    stage_id: int
    partition: int
    attempt: int
    status: str
    speculative: bool
    executor_id: str
    host: str
    launch_time: float  # epoch seconds
    duration: float | None  # seconds
    error: str | None


@dataclass
class JobReport:
    """What one run of the job did (``--report`` writes it as JSON)."""

    app_id: str
    job_id: str
    mode: str
    rows: int
    partitions: int
    started: float  # epoch seconds, when the write began
    seconds: float  # the write's duration
    table_version: int | None
    written: bool  # False if the sink skipped an already committed txnVersion
    rows_in_table: int
    tasks: list[TaskAttempt] = field(default_factory=list)
    # the --fault options whose effect none of the tasks shows (see unfired_faults)
    unfired_faults: list[str] = field(default_factory=list)

    def failed_attempts(self) -> list[TaskAttempt]:
        return [t for t in self.tasks if t.status == "FAILED"]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> JobReport:
        data = json.loads(text)
        data["tasks"] = [TaskAttempt(**t) for t in data["tasks"]]
        return cls(**data)


def build_job(spark: Any, options: JobOptions, source: Any = None) -> Any:
    """The enriched DataFrame (not yet written) of ``source``, by default the generated
    input (``generate_input``); a streaming DataFrame of the same columns gives a
    streaming query."""
    from ..spark import ordered_wait, unordered_wait

    enrich = ordered_wait if options.mode == "ordered" else unordered_wait
    return enrich(
        generate_input(spark, options.rows, options.partitions) if source is None else source,
        enrichment_function(options),
        SCHEMA,
        capacity=options.capacity,
        timeout=options.timeout,
        retry=options.retry_strategy(),
        checkpoint=options.checkpoint_config(),
    )


def run_job(spark: Any, options: JobOptions) -> JobReport:
    """Run the reference job on ``spark`` and write its output to ``options.output`` with
    the ``delta_rs`` sink, in one commit that carries the app transaction
    ``(options.job_id, options.txn_version)`` (a re-run that finds it committed is skipped).
    """
    from ..spark import register_delta_sink

    register_delta_sink(spark)
    enriched = build_job(spark, options)
    before = _table_version(options.output)
    # jobs the session ran before (an earlier run): their task attempts are not this run's
    earlier_jobs = _job_ids(spark, None)
    started = time.time()
    (
        enriched.write.format("delta_rs")
        .mode("append")
        .option("txnAppId", options.job_id)
        .option("txnVersion", str(options.txn_version))
        .save(options.output)
    )
    return job_report(
        spark, options, started, time.time() - started, before, earlier_jobs=earlier_jobs
    )


def job_report(
    spark: Any,
    options: JobOptions,
    started: float,
    seconds: float,
    version_before: int | None,
    job_group: str | None = None,
    earlier_jobs: Collection[int] = (),
) -> JobReport:
    """The report of a run of the reference job (batch, or streaming in ``job_group``) that
    took ``seconds`` from ``started`` and found ``options.output`` at ``version_before``;
    the jobs ``earlier_jobs`` (Spark job ids) were not the run's."""
    after = _table_version(options.output)
    tasks = task_attempts(spark, job_group=job_group, earlier_jobs=earlier_jobs)
    app_id = spark.sparkContext.applicationId
    return JobReport(
        app_id=app_id,
        job_id=options.job_id,
        mode=options.mode,
        rows=options.rows,
        partitions=options.partitions,
        started=started,
        seconds=seconds,
        table_version=after,
        written=after is not None and after != version_before,
        rows_in_table=_table_rows(options.output),
        tasks=tasks,
        unfired_faults=[
            str(f)
            for f in unfired_faults(
                options.faults,
                tasks,
                _run_commits(options, app_id, tasks),
                options.rows,
                options.partitions,
            )
        ],
    )


# What a fault's aimed task attempt fails with once it has fired: a crash kills the Python
# worker, a zombie's late commit is refused (as is a delayed one that a newer attempt
# overtook). A delay-commit that went ahead leaves its checkpoint, committed by that attempt.
_FIRED_SIGNS = {
    "crash-at": "Python worker exited unexpectedly",
    "crash-commit": "Python worker exited unexpectedly",
    "delay-commit": "CheckpointConflictError",
    "zombie-commit": "CheckpointConflictError",
}
# a crash ends its attempt: one crashed attempt shows one crash fault firing, not two
_CRASHES = ("crash-at", "crash-commit")


def unfired_faults(
    faults: Iterable[FaultSpec],
    tasks: Sequence[TaskAttempt],
    commits: Iterable[Any] = (),
    rows: int | None = None,
    partitions: int | None = None,
) -> list[FaultSpec]:
    """The faults that, by ``tasks`` (a run's task attempts) and ``commits`` (the
    ``CheckpointMetadata`` of the checkpoints the run committed), never fired: no attempt
    they are aimed at (its number, one of its partitions) failed as the fault makes it
    fail — a crashed Python worker (``crash-at``, ``crash-commit``), a refused late commit
    (``zombie-commit``; one whose wait ran out with no newer attempt made an ordinary
    commit) — and, for ``delay-commit``, no such attempt committed the checkpoint it holds
    back (or had that commit refused). A crashed attempt shows one crash fault firing: two
    aimed at it (``crash-at=10`` and ``crash-at=20``) cannot both have fired, and one is
    listed. With ``rows`` and ``partitions`` (the reference job's input), a ``crash-at``
    is aimed at the partition that holds its row only. Such a fault was armed on a task
    that never reached its row or checkpoint (a resumed run skipped them), or on an
    attempt that never ran; a chaos test with it proved nothing. Nothing is listed without
    ``tasks`` (Spark's status store unread)."""
    if not tasks:
        return []
    faults = list(faults)
    commits = list(commits)

    def aimed(fault: FaultSpec, partition: int) -> bool:
        if fault.partitions is not None and partition not in fault.partitions:
            return False
        if fault.kind == "crash-at" and rows is not None and partitions is not None:
            return fault.value in partition_ids(rows, partitions, partition)
        return True

    def signs(fault: FaultSpec) -> list[tuple[int, int, int]]:
        """The run's task attempts (stage, partition, attempt) that show ``fault`` fired."""
        return [
            (t.stage_id, t.partition, t.attempt)
            for t in tasks
            if t.attempt == fault.attempt
            and aimed(fault, t.partition)
            and _FIRED_SIGNS[fault.kind] in (t.error or "")
        ]

    def delayed(fault: FaultSpec) -> bool:
        return any(
            m.checkpoint_id == fault.value
            and m.properties.get("attempt") == str(fault.attempt)
            and aimed(fault, m.subtask)
            for m in commits
        )

    fired = {
        i
        for i, fault in enumerate(faults)
        if fault.kind not in _CRASHES
        and (signs(fault) or (fault.kind == "delay-commit" and delayed(fault)))
    }
    # each crashed attempt accounts for one crash fault at most (a bipartite matching)
    crashes = {i: signs(f) for i, f in enumerate(faults) if f.kind in _CRASHES}
    crashed_by: dict[tuple[int, int, int], int] = {}

    def match(i: int, seen: set[tuple[int, int, int]]) -> bool:
        for sign in crashes[i]:
            if sign not in seen:
                seen.add(sign)
                if sign not in crashed_by or match(crashed_by[sign], seen):
                    crashed_by[sign] = i
                    return True
        return False

    fired |= {i for i in crashes if match(i, set())}
    return [fault for i, fault in enumerate(faults) if i not in fired]


def _run_commits(options: JobOptions, app_id: str, tasks: Sequence[TaskAttempt]) -> list[Any]:
    """The checkpoints that ``tasks`` (the run's task attempts, of application ``app_id``)
    committed to the job's snapshot store, read only when a delay-commit fault needs
    them (a delayed commit's mark); [] with a warning if the store cannot be read."""
    if not any(f.kind == "delay-commit" for f in options.faults) or not tasks:
        return []
    from checkpoint import SnapshotStore

    stages = {str(t.stage_id) for t in tasks}
    try:
        metas = SnapshotStore(options.checkpoint).checkpoints(
            options.job_id, OPERATOR_ID, include_expired=True
        )
    except Exception as exc:
        print(f"warning: cannot read the run's checkpoints: {exc}", file=sys.stderr)
        return []
    return [
        m
        for m in metas
        if m.properties.get("app_id") == app_id and m.properties.get("stage") in stages
    ]


def _table_version(path: str) -> int | None:
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        return int(DeltaTable(path).version())
    except TableNotFoundError:  # the first run creates it
        return None


def _table_rows(path: str) -> int:
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    from checkpoint import delta_dataset

    try:
        return int(delta_dataset(DeltaTable(path)).count_rows())
    except TableNotFoundError:  # an empty input writes no table
        return 0


def task_attempts(
    spark: Any,
    settle: float = 30.0,
    job_group: str | None = None,
    earlier_jobs: Collection[int] = (),
) -> list[TaskAttempt]:
    """Every task attempt of the application's jobs outside job groups (or of the jobs of
    ``job_group``: a streaming query runs its micro-batches in the group of its run id),
    but those of ``earlier_jobs`` (Spark job ids: the jobs of earlier runs in the session),
    from Spark's status store (through py4j: Python has no API for it). Waits up to
    ``settle`` seconds for attempts still shown running (a speculative loser being killed,
    events not yet processed). Returns [] with a warning if the status store cannot be
    read: the report is not worth failing a job."""
    try:
        return _task_attempts(spark, settle, job_group, frozenset(earlier_jobs))
    except Exception as exc:
        print(
            f"warning: cannot read task attempts from Spark's status store: {exc}",
            file=sys.stderr,
        )
        return []


def _job_ids(spark: Any, job_group: str | None) -> frozenset[int]:
    """The ids of the Spark jobs the session has run in ``job_group`` (None: outside job
    groups) so far."""
    return frozenset(spark.sparkContext.statusTracker().getJobIdsForGroup(job_group))


def _task_attempts(
    spark: Any, settle: float, job_group: str | None, earlier_jobs: frozenset[int]
) -> list[TaskAttempt]:
    sc = spark.sparkContext
    store = sc._jsc.sc().statusStore()
    tracker = sc.statusTracker()
    deadline = time.monotonic() + settle
    while True:
        attempts: list[TaskAttempt] = []
        for job in _job_ids(spark, job_group) - earlier_jobs:
            info = tracker.getJobInfo(job)
            for stage_id in info.stageIds if info else []:
                stage = tracker.getStageInfo(stage_id)
                if stage is None:
                    continue
                tasks = store.taskList(stage_id, stage.currentAttemptId, 1_000_000)
                for i in range(tasks.size()):
                    task = tasks.apply(i)
                    duration = task.duration()
                    error = task.errorMessage()
                    attempts.append(
                        TaskAttempt(
                            stage_id=stage_id,
                            partition=int(task.index()),
                            attempt=int(task.attempt()),
                            status=str(task.status()),
                            speculative=bool(task.speculative()),
                            executor_id=str(task.executorId()),
                            host=str(task.host()),
                            launch_time=task.launchTime().getTime() / 1000.0,
                            duration=duration.get() / 1000.0 if duration.isDefined() else None,
                            error=str(error.get())[:20_000] if error.isDefined() else None,
                        )
                    )
        if all(a.status != "RUNNING" for a in attempts) or time.monotonic() > deadline:
            return sorted(attempts, key=lambda a: (a.stage_id, a.partition, a.attempt))
        time.sleep(0.2)


def _report_path_problem(report: str) -> str | None:
    """Why ``--report`` cannot be written at the end of the job, or None."""
    folder = os.path.dirname(os.path.abspath(report))
    if not os.path.isdir(folder):
        return (
            f"the report's folder {folder} does not exist; create it, or pass --report a "
            "path in an existing folder"
        )
    if os.path.isdir(report):
        return (
            "it is a folder: pass --report the path of a file, such as "
            f"{os.path.join(report, 'run.json')}"
        )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    if options.report:  # found now, not after the output is committed
        problem = _report_path_problem(options.report)
        if problem:
            print(f"error: {problem} (got {options.report!r})", file=sys.stderr)
            return 2
    started = time.time()
    try:
        spark = session_for(
            options.master,
            speculation=options.speculation,
            cores=options.cores,
            driver_host=options.driver_host,
        )
    except Exception as exc:
        print(f"error: cannot start a Spark session on {options.master}: {exc}", file=sys.stderr)
        return 1
    print(f"app_id {spark.sparkContext.applicationId}", flush=True)
    print(f"session started in {time.time() - started:.1f} s", file=sys.stderr, flush=True)
    try:
        report = run_job(spark, options)
        print(
            f"done: {report.rows_in_table} rows in {options.output} (table version "
            f"{report.table_version}, {'written' if report.written else 'already committed'}), "
            f"write {report.seconds:.1f} s, {len(report.failed_attempts())} failed task "
            "attempts",
            flush=True,
        )
        for fault in report.unfired_faults:
            print(
                f"warning: the fault {fault} never fired: no task attempt it is aimed at "
                "shows its mark (a crashed worker, a refused or a held commit), so this run "
                "tested no recovery from it. Aim it at a row or checkpoint the run reaches, "
                "and at an attempt that runs.",
                file=sys.stderr,
                flush=True,
            )
        write_report(report, options.report)
    except Exception as exc:
        print(f"error: the job failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        spark.stop()
    return 0


def write_report(report: JobReport, path: str | None) -> None:
    """Write ``report`` to ``path`` (if given) whole or not at all: the caller may be
    waiting for the file."""
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as handle:
            handle.write(report.to_json())
        os.replace(tmp, path)


# -- checks ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputDiff:
    """How an output differs from the expected one, by key: keys ``lost`` (expected, not
    there), ``duplicated`` (there more than once), ``unexpected`` (there, not expected) and
    ``mismatched`` (there once, but not equal to the expected row)."""

    lost: list[Any]
    duplicated: list[Any]
    unexpected: list[Any]
    mismatched: list[Any]
    duplicates: int  # rows beyond the first per key

    @property
    def exact(self) -> bool:
        return not (self.lost or self.duplicated or self.unexpected or self.mismatched)


def compare_outputs(
    expected: Sequence[dict[str, Any]], actual: Sequence[dict[str, Any]], key: str = "id"
) -> OutputDiff:
    """Compare two outputs row by row, matching rows by ``key``. A row without ``key``, or
    whose key is not hashable, raises ``ChaosCheckError`` naming it. The diff's key lists
    are sorted (keys of types that do not order together, such as None among ints, by type
    name first)."""
    want = {_row_key(row, key, "expected"): row for row in expected}
    if len(want) != len(expected):
        raise ChaosCheckError(f"The expected output has repeated {key!r} values.")
    got_keys = [_row_key(row, key, "actual") for row in actual]
    seen = Counter(got_keys)
    got = dict(zip(got_keys, actual, strict=True))
    return OutputDiff(
        lost=_sorted_keys(k for k in want if k not in seen),
        duplicated=_sorted_keys(k for k, n in seen.items() if n > 1),
        unexpected=_sorted_keys(k for k in seen if k not in want),
        mismatched=_sorted_keys(k for k in want if k in got and seen[k] == 1 and got[k] != want[k]),
        duplicates=sum(n - 1 for n in seen.values()),
    )


def _row_key(row: Any, key: str, output: str) -> Any:
    """``row[key]``, or a ``ChaosCheckError`` naming the row and the key."""
    try:
        value = row[key]
        hash(value)
    except (LookupError, TypeError, ValueError) as exc:
        missing = not isinstance(exc, TypeError) or not hasattr(row, "keys") or key not in row
        raise ChaosCheckError(
            f"A row of the {output} output "
            + (f"has no {key!r} field" if missing else f"has an unhashable {key!r}")
            + f" (the key rows are matched by): {reprlib.repr(row)}. Pass key= the field "
            "that identifies a row in both outputs."
        ) from None
    return value


def _sorted_keys(items: Iterable[Any], by: Callable[[Any], Any] = lambda k: k) -> list[Any]:
    """``items`` sorted by ``by``; keys that do not order with each other (None among ints,
    str and int) by type name and then value, or else repr."""
    listed = list(items)
    for order in (by, lambda i: (type(by(i)).__name__, by(i)), lambda i: repr(by(i))):
        try:
            return sorted(listed, key=order)
        except TypeError:
            continue
    return listed  # not reached: reprs order


def read_table_rows(path: str, key: str = "id") -> list[dict[str, Any]]:
    """Every row of the Delta table at ``path`` (read with deltalake), sorted by ``key``."""
    from deltalake import DeltaTable

    from checkpoint import delta_dataset

    try:
        rows: list[dict[str, Any]] = delta_dataset(DeltaTable(path)).to_table().to_pylist()
    except Exception as exc:
        raise ChaosCheckError(f"Cannot read the Delta table at {path}: {exc}") from exc
    return _sorted_keys(rows, lambda row: _row_key(row, key, f"Delta table at {path}'s"))


def request_repeats(counts: dict[str, int]) -> dict[str, int]:
    """Keys requested more than once, with how many requests beyond the first."""
    return {key: n - 1 for key, n in counts.items() if n > 1}


@dataclass(frozen=True)
class StoreCheck:
    """The result of ``check_snapshot_store``: every live checkpoint (each loaded and
    verified), and per partition its newest final checkpoint (of whichever run committed
    it) with the number of results its chain restores."""

    checkpoints: list[Any]
    finals: dict[int, Any]
    final_results: dict[int, int]


def check_snapshot_store(location: str, job_id: str, operator_id: str = OPERATOR_ID) -> StoreCheck:
    """Verify a job's snapshot store has no partial or duplicate checkpoint.

    Every checkpoint that is not expired is loaded (``load`` checks that its in-flight and
    result rows are all there); no (run, partition, checkpoint id) is committed twice; the
    chain of each partition's newest final checkpoint restores. Raises ``ChaosCheckError``
    naming the first problem.
    """
    from checkpoint import (
        CheckpointError,
        CheckpointLocationError,
        CheckpointNotFoundError,
        SnapshotStore,
    )

    def inconsistent(exc: CheckpointError) -> ChaosCheckError:
        return ChaosCheckError(
            f"The snapshot store of job {job_id!r} at {location} is inconsistent: {exc}"
        )

    try:
        store = SnapshotStore(location)
        metas = store.checkpoints(job_id, operator_id, include_expired=False)
    except (CheckpointLocationError, CheckpointNotFoundError) as exc:
        raise ChaosCheckError(f"Cannot check the snapshot store: {exc}") from exc
    except CheckpointError as exc:  # a table it cannot list: a data file gone or broken
        raise inconsistent(exc) from exc
    if not metas:  # a wrong job or operator id must not pass as a clean store
        raise ChaosCheckError(
            f"No checkpoints of job {job_id!r}, operator {operator_id!r} at {location}: "
            "check the location and ids (`stateful-async checkpoints list` shows the jobs "
            "there)."
        )
    try:
        keys = Counter((m.run_id, m.subtask, m.checkpoint_id) for m in metas)
        twice = [k for k, n in keys.items() if n > 1]
        if twice:
            raise ChaosCheckError(
                f"Checkpoints of job {job_id!r} were committed more than once: {twice}."
            )
        for m in metas:
            store.load(job_id, operator_id, m.subtask, m.checkpoint_id, m.run_id)
        finals: dict[int, Any] = {}
        for m in metas:
            if m.final and (m.subtask not in finals or m.created_at > finals[m.subtask].created_at):
                finals[m.subtask] = m
        results = {
            p: store.restore(job_id, operator_id, p, m.checkpoint_id, m.run_id).results.num_rows
            for p, m in finals.items()
        }
    except CheckpointError as exc:
        raise inconsistent(exc) from exc
    return StoreCheck(metas, finals, results)
