"""The operator's mailbox: the single thread that may touch operator state.

The asyncio event loop is the mailbox. Work for the operator is a *mail* (a callable)
run by the loop thread; other threads never change operator state, they only ``post``
mails (``loop.call_soon_threadsafe``), like trio's entry queue and Flink's
``MailboxExecutor``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

from ._exceptions import OperatorStateError


class Mailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.get_ident()

    @classmethod
    def for_running_loop(cls) -> Mailbox:
        return cls(asyncio.get_running_loop())

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def post(self, mail: Callable[..., Any], *args: Any) -> None:
        """Queue ``mail(*args)`` for the loop thread; safe from any thread."""
        self._loop.call_soon_threadsafe(mail, *args)

    def execute(self, mail: Callable[..., Any], *args: Any) -> None:
        """Queue ``mail(*args)`` behind what is already queued; loop thread only."""
        self._loop.call_soon(mail, *args)

    def is_mailbox_thread(self) -> bool:
        return threading.get_ident() == self._thread

    def check_thread(self, what: str) -> None:
        if threading.get_ident() != self._thread:
            raise OperatorStateError(
                f"{what} was called from thread {threading.current_thread().name!r}, but the "
                "operator belongs to its event-loop thread. Call it from a coroutine on that "
                "loop, or post a mail with loop.call_soon_threadsafe()."
            )
