"""Tools for testing async functions and operators without a service or a wall clock.

* ``ControlledFunction`` — an ``AsyncFunction`` whose calls wait until the test completes
  or fails them, in any order the test chooses.
* ``ControlledTimeoutFunction`` — the same, with a ``timeout()`` handler the test also
  completes.
* ``VirtualClock`` and ``settle`` — time that moves only when the test says so; pass the
  clock to ``AsyncWaitOperator(..., clock=clock)``. Only the operator's timers (timeouts,
  retry backoffs) follow it: an ``asyncio.sleep`` or I/O inside the function runs on the
  event loop's own clock, which ``advance`` and ``settle`` do not wait for, so a function
  sleeping 50 ms times out at once under ``advance(1)`` with a 1 s timeout. Let a
  ``ControlledFunction`` stand for the service, to decide when each call ends.

Example::

    fn = ControlledFunction()
    op = AsyncWaitOperator(fn, out.append, OutputMode.ORDERED, capacity=10)
    await op.open()
    await op.process_element(StreamRecord("a"))
    await op.process_element(StreamRecord("b"))
    await settle()
    fn.complete("b", ["B"])          # "b" finished first ...
    fn.complete("a", ["A"])
    await settle()
    assert [r.value for r in out] == ["A", "B"]   # ... but ordered mode emits in input order
"""

from __future__ import annotations

import asyncio
import reprlib
from collections import deque
from typing import Any, Iterable

from ._function import AsyncFunction, holds_no_clients, not_a_result_list
from ._timers import VirtualClock, settle

__all__ = ["ControlledFunction", "ControlledTimeoutFunction", "VirtualClock", "settle"]


class ControlledFunction(AsyncFunction[Any, Any]):
    """Every call returns a future that the test resolves with ``complete`` or ``fail``.

    ``calls`` lists the values of every attempt in call order; ``pending(value)`` counts the
    unresolved attempts of ``value``.

    A call is matched by its value and its type: ``complete(1, ...)`` completes a call with
    1, not one with ``True`` or ``1.0`` (which ``==`` 1). Values must be hashable: a call
    with a dict or list value fails with ``TypeError`` saying so, as do ``complete``,
    ``fail`` and ``pending`` given one; to key calls by a field of a dict row, override
    ``async_invoke`` to call ``super().async_invoke(value["id"])``.

    Its ``open`` and ``close`` only count (``opened``, ``closed``), so one instance may
    serve several operators at once: a test that simulates a crash may restore the first
    operator's snapshot into a second one without closing the first (a subclass with an
    ``open`` or ``close`` of its own runs in one operator at a time, as any function does).
    """

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self._pending: dict[tuple[type, Any], deque[asyncio.Future[Any]]] = {}
        self.opened = 0
        self.closed = 0

    async def open(self) -> None:
        self.opened += 1

    async def close(self) -> None:
        self.closed += 1

    async def async_invoke(self, value: Any) -> Iterable[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        key = _call_key("async_invoke", value)
        self.calls.append(value)
        self._pending.setdefault(key, deque()).append(future)
        return await future

    def pending(self, value: Any) -> int:
        return sum(1 for f in self._pending.get(_call_key("pending", value), ()) if not f.done())

    def pending_values(self) -> list[Any]:
        return _waiting(self._pending)

    def complete(self, value: Any, results: Iterable[Any]) -> None:
        """Resolve the oldest unresolved attempt of ``value`` with ``results``."""
        self._next(value, "complete").set_result(_result_list("complete", "fail", results))

    def fail(self, value: Any, error: BaseException | type[BaseException]) -> None:
        """Make the oldest unresolved attempt of ``value`` raise ``error`` (an exception, or
        an exception type, which asyncio instantiates)."""
        self._next(value, "fail").set_exception(_exception("fail", "complete", error))

    def _next(self, value: Any, method: str = "complete") -> asyncio.Future[Any]:
        futures = self._pending.get(_call_key(method, value), ())
        return _oldest_waiting(futures, "call", value, self.calls)


# its open() and close() only count: a test may restore an abandoned operator's snapshot
# into a new one with the same function, as a crash recovery does
holds_no_clients(ControlledFunction)


class ControlledTimeoutFunction(ControlledFunction):
    """A ``ControlledFunction`` whose ``timeout()`` handler also waits for the test:
    ``complete_timeout(value, results)`` or ``fail_timeout(value, error)``."""

    def __init__(self) -> None:
        super().__init__()
        self.timeout_calls: list[Any] = []
        self._timeouts: dict[tuple[type, Any], deque[asyncio.Future[Any]]] = {}

    async def timeout(self, value: Any) -> Iterable[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        key = _call_key("timeout", value)
        self.timeout_calls.append(value)
        self._timeouts.setdefault(key, deque()).append(future)
        return await future

    def pending_timeout_values(self) -> list[Any]:
        """The values of the timeout handler's unresolved calls (as ``pending_values``)."""
        return _waiting(self._timeouts)

    def complete_timeout(self, value: Any, results: Iterable[Any]) -> None:
        self._next_timeout(value, "complete_timeout").set_result(
            _result_list("complete_timeout", "fail_timeout", results)
        )

    def fail_timeout(self, value: Any, error: BaseException | type[BaseException]) -> None:
        self._next_timeout(value, "fail_timeout").set_exception(
            _exception("fail_timeout", "complete_timeout", error)
        )

    def _next_timeout(self, value: Any, method: str = "complete_timeout") -> asyncio.Future[Any]:
        futures = self._timeouts.get(_call_key(method, value), ())
        return _oldest_waiting(futures, "timeout handler", value, self.timeout_calls)


def _result_list(method: str, fail: str, results: Iterable[Any]) -> list[Any]:
    """``results`` as the list the call returns; a str (which ``list`` would split into
    characters), bytes or a bytearray, None, a dict or other mapping, or a number is refused,
    as the operator refuses it from a function, but here at the test's line."""
    if not_a_result_list(results) or not isinstance(results, Iterable):
        raise TypeError(
            f"{method}() takes an iterable of results ([result] for one, [] for none); got "
            f"{type(results).__name__} {reprlib.repr(results)}. To make the call raise, use "
            f"{fail}()."
        )
    return list(results)


def _exception(
    method: str, complete: str, error: BaseException | type[BaseException]
) -> BaseException | type[BaseException]:
    """``error``, if it is an exception or an exception type; else refused at the test's line
    (asyncio's own refusal says only 'invalid exception object')."""
    if isinstance(error, BaseException) or (
        isinstance(error, type) and issubclass(error, BaseException)
    ):
        return error
    raise TypeError(
        f"{method}() takes the exception the call raises, e.g. OSError('down'); got "
        f"{type(error).__name__} {reprlib.repr(error)}. To make the call return results, use "
        f"{complete}()."
    )


def _call_key(method: str, value: Any) -> tuple[type, Any]:
    """What calls are matched by: the value and its type (1, 1.0 and True are equal, and
    would be one dict key); an unhashable value is refused, saying what to do."""
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"ControlledFunction matches calls by their value, which must be hashable; "
            f"{method}() got {type(value).__name__} {reprlib.repr(value)}. To match dict rows "
            "by a field, override async_invoke to call super().async_invoke(value['id'])."
        ) from None
    return type(value), value


def _waiting(calls: dict[tuple[type, Any], deque[asyncio.Future[Any]]]) -> list[Any]:
    return [key[1] for key, fs in calls.items() for f in fs if not f.done()]


def _oldest_waiting(
    futures: Iterable[asyncio.Future[Any]], what: str, value: Any, calls: list[Any]
) -> asyncio.Future[Any]:
    """The oldest unresolved future of ``value``; else an error that says why none is."""
    futures = list(futures)
    for future in futures:
        if not future.done():
            return future
    if not futures:
        when = (
            "A call is made once the event loop runs the element's task: await settle() "
            "after process_element()."
            if what == "call"
            else "A timeout handler is called once the operator's clock reaches the element's "
            "deadline (a VirtualClock's: await clock.advance(...) to it)."
        )
        others = [c for c in calls if c == value]  # of another type, as True for 1
        if others:
            when = (
                f"Calls are matched by value and type: {others[0]!r} "
                f"({type(others[0]).__name__}) equals {value!r} ({type(value).__name__}) but "
                "is not the same call."
            )
        raise AssertionError(
            f"No {what} for {value!r} is waiting: there has been none ({what} values so far: "
            f"{calls!r}). {when}"
        )
    cancelled = sum(1 for f in futures if f.cancelled())
    resolved = len(futures) - cancelled
    why = []
    if resolved:
        why.append(
            f"{resolved} {'was' if resolved == 1 else 'were'} completed or failed by the test"
        )
    if cancelled:
        why.append(
            f"{cancelled} {'was' if cancelled == 1 else 'were'} cancelled (the operator cancels "
            "a call once another outcome, such as its timeout, decides its element, and when "
            "it closes)"
        )
    plural = "s" if len(futures) > 1 else ""
    raise AssertionError(
        f"No {what} for {value!r} is waiting: of its {len(futures)} {what}{plural}, "
        + " and ".join(why)
        + "."
    )
