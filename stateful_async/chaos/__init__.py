"""Chaos-testing tools for checkpointed enrichment jobs.

* ``MockService`` / ``ServiceConfig`` — a mock enrichment service (aiohttp, its own
  process on 127.0.0.1) with latency, errors, bursts, hangs and per-key request counters.
* ``ServiceEnrichment`` — an ``AsyncFunction`` that enriches rows from it.
* ``expected_enrichment`` — what the service answers for a key, for reference outputs.
* ``CrashOnElement`` — kills the Python worker at a chosen row and task attempt.
* ``CrashDuringCommit`` — kills it as it commits a checkpoint, leaving an orphan Parquet
  file (written by the fault) in the checkpoint table.
* ``DelayCommit`` — holds a checkpoint commit back, so it lands late (a zombie).
* ``ZombieCommit`` — holds it until a newer attempt committed the same checkpoint.
* ``LocalCluster`` — a Spark standalone cluster (master, workers) on 127.0.0.1 that can
  kill executors (``ExecutorProcess``) and workers; ``DriverProcess`` — a driver program
  to kill mid-job.
* ``run_job`` / ``JobOptions`` / ``session_for`` — the reference chaos job
  (``python -m stateful_async.chaos.job``): ``FaultSpec`` is one of its ``--fault``s,
  ``to_argv`` gives its options as that command's arguments, and ``JobReport`` (a
  ``TaskAttempt`` per task attempt, and the faults that never fired) is what ``--report``
  writes. Its input is
  ``generate_input`` (``partition_ids`` tells which ids a partition holds), its output
  schema ``SCHEMA``, its timeout fallback ``FALLBACK``, and ``expected_output`` what it
  must write.
* ``compare_outputs`` (an ``OutputDiff``), ``check_snapshot_store`` (a ``StoreCheck``),
  ``request_repeats`` — the checks that a run was exactly-once, its snapshot store whole
  and its repeated requests bounded; ``read_table_rows`` reads an output table.

Their errors are ``stateful_async.StatefulAsyncError``s: a bad setting or option is a
``ConfigurationError`` (also a ``ValueError``), refused before anything starts; then
``ServiceError``, ``MockServiceError``, ``ClusterError`` and ``ChaosCheckError``. Only a
wait that runs out (``wait_until``, ``DriverProcess.wait``) raises the built-in
``TimeoutError``.

See ``docs/chaos.md``.

Needs the ``chaos`` extra (aiohttp, psutil): ``pip install '.[chaos]'`` in a clone of
stateful-async.
"""

from ._client import ServiceEnrichment, ServiceError
from ._cluster import (
    ClusterError,
    DriverProcess,
    ExecutorProcess,
    LocalCluster,
    wait_until,
)
from ._faults import CrashDuringCommit, CrashOnElement, DelayCommit, ZombieCommit
from ._job import (
    FALLBACK,
    SCHEMA,
    ChaosCheckError,
    FaultSpec,
    JobOptions,
    JobReport,
    OutputDiff,
    StoreCheck,
    TaskAttempt,
    check_snapshot_store,
    compare_outputs,
    expected_output,
    generate_input,
    partition_ids,
    read_table_rows,
    request_repeats,
    run_job,
    session_for,
    to_argv,
)
from ._process import MockService, MockServiceError
from ._service import ServiceConfig, expected_enrichment

__all__ = [
    "FALLBACK",
    "SCHEMA",
    "ChaosCheckError",
    "ClusterError",
    "CrashDuringCommit",
    "CrashOnElement",
    "DelayCommit",
    "DriverProcess",
    "ExecutorProcess",
    "FaultSpec",
    "JobOptions",
    "JobReport",
    "LocalCluster",
    "MockService",
    "MockServiceError",
    "OutputDiff",
    "ServiceConfig",
    "ServiceEnrichment",
    "ServiceError",
    "StoreCheck",
    "TaskAttempt",
    "ZombieCommit",
    "check_snapshot_store",
    "compare_outputs",
    "expected_enrichment",
    "expected_output",
    "generate_input",
    "partition_ids",
    "read_table_rows",
    "request_repeats",
    "run_job",
    "session_for",
    "to_argv",
    "wait_until",
]
