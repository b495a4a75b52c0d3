"""Signal handling shared by the command line and the benchmark scripts, apart from the CLI
so that a process using it does not load Typer and Rich."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any


def _unwinding(signum: int, frame: Any) -> None:
    """The SIGTERM handler while a first SIGTERM unwinds: the clean-up goes on."""


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Within it, a SIGTERM (kill, a timeout, a CI job cancelled) unwinds as Ctrl-C does:
    ``SystemExit(143)`` is raised, so that the ``finally`` and ``with`` blocks stop what the
    program started and remove what it wrote, instead of the process ending on the spot.

    Once: a second SIGTERM while those blocks run (a process group's SIGTERM, then the
    parent's own, or a second ``kill``) is ignored, since raising again would stop the
    clean-up it asked for half way. SIGKILL, or Ctrl-C, still ends the process."""

    def unwind(signum: int, frame: Any) -> None:
        # What Ctrl-C does first: PySpark's SIGINT handler, once Spark runs, cancels its jobs
        # and drops the py4j connection a call was waiting on. Left as it was, that call's
        # late answer was read as spark.stop()'s ("... does not exist in the JVM"), a
        # traceback and exit status 1 instead of stopping.
        on_interrupt = signal.getsignal(signal.SIGINT)
        if callable(on_interrupt):
            with suppress(KeyboardInterrupt, Exception):
                on_interrupt(signal.SIGINT, frame)
        # a do-nothing handler, not SIG_IGN, which a program started by a finally would inherit
        signal.signal(signal.SIGTERM, _unwinding)
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread can take signals
        return
    previous = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
