"""Chaos-testing tools for checkpointed enrichment jobs.

* ``MockService`` / ``ServiceConfig`` — a mock enrichment service (aiohttp, its own
  process on 127.0.0.1) with latency, errors, bursts, hangs and per-key request counters.
* ``ServiceEnrichment`` — an ``AsyncFunction`` that enriches rows from it.
* ``expected_enrichment`` — what the service answers for a key, for reference outputs.
* ``CrashOnElement`` — kills the Python worker at a chosen row and task attempt.
* ``CrashDuringCommit`` — kills it between writing a checkpoint's files and its commit.
* ``DelayCommit`` — holds a checkpoint commit back, so it lands late (a zombie).

Needs the ``chaos`` extra: ``pip install 'stateful-async[chaos]'``.
"""

from ._client import ServiceEnrichment, ServiceError
from ._faults import CrashDuringCommit, CrashOnElement, DelayCommit
from ._process import MockService, MockServiceError
from ._service import ServiceConfig, expected_enrichment

__all__ = [
    "CrashDuringCommit",
    "CrashOnElement",
    "DelayCommit",
    "MockService",
    "MockServiceError",
    "ServiceConfig",
    "ServiceEnrichment",
    "ServiceError",
    "expected_enrichment",
]
