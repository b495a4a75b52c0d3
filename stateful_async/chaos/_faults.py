"""Fault injection for enrichment jobs: off unless a job wraps its function in one.

``CrashOnElement`` kills the Python worker (``os._exit``, as a segfault or an OOM kill
would) when it is asked to enrich a chosen row on a chosen task attempt, so a test can
crash a task mid-partition and watch it resume.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from .._function import AsyncFunction, as_async_function, has_timeout_handler


class CrashOnElement(AsyncFunction[Any, Any]):
    """Wraps ``fn``; kills the worker process when invoked with a row whose ``key_field``
    is in ``at``, on task attempt ``attempt`` (default: the first) of ``partitions``
    (default: any). Other calls go to ``fn`` unchanged."""

    def __init__(
        self,
        fn: Any,
        at: Iterable[Any],
        key_field: str = "id",
        attempt: int = 0,
        partitions: Iterable[int] | None = None,
        exit_code: int = 1,
    ) -> None:
        self.fn = as_async_function(fn)
        self.at = frozenset(at)
        self.key_field = key_field
        self.attempt = attempt
        self.partitions = None if partitions is None else frozenset(partitions)
        self.exit_code = exit_code
        self._armed = False

    async def open(self) -> None:
        try:
            from pyspark import TaskContext

            context = TaskContext.get()
        except ImportError:
            context = None
        attempt = context.attemptNumber() if context else 0
        partition = context.partitionId() if context else 0
        self._armed = attempt == self.attempt and (
            self.partitions is None or partition in self.partitions
        )
        await self.fn.open()

    async def close(self) -> None:
        await self.fn.close()

    async def async_invoke(self, row: Any) -> Iterable[Any]:
        if self._armed and row[self.key_field] in self.at:
            os._exit(self.exit_code)  # the worker dies here, mid-partition
        return await self.fn.async_invoke(row)

    async def timeout(self, row: Any) -> Iterable[Any]:
        if has_timeout_handler(self.fn):
            return await self.fn.timeout(row)
        return await super().timeout(row)
