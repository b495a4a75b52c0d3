"""Processing-time clocks and the operator's timer service.

The operator never reads the wall clock or calls ``loop.call_at`` itself: it asks a
``Clock`` for the time and for one wake-up. ``SystemClock`` is asyncio's monotonic clock;
``VirtualClock`` only moves when a test says so, which lets tests of timeouts and backoff
run without sleeping (the idea of trio's ``MockClock``).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import sys
from fractions import Fraction
from typing import Callable, Hashable, Protocol

from ._exceptions import as_float

# A TimerService runs a timer due within this many seconds of its wake-up (asyncio may wake
# it up to one clock resolution early); a VirtualClock runs no wake-up earlier than that.
_EARLY_SLACK = 1e-6


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """A source of processing time (seconds, monotonic) that can wake the loop once."""

    def now(self) -> float:
        """The current processing time in seconds."""
        ...

    def call_at(self, when: float, callback: Callable[[], None]) -> Cancellable:
        """Run ``callback`` on the event-loop thread once ``now() >= when``."""
        ...


class SystemClock:
    """asyncio's monotonic clock (``loop.time()``); must be used on the loop thread."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def call_at(self, when: float, callback: Callable[[], None]) -> Cancellable:
        return asyncio.get_running_loop().call_at(when, callback)


class _VirtualHandle:
    __slots__ = ("when", "callback", "cancelled")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class VirtualClock:
    """A clock that stands still until ``advance`` moves it.

    ``await clock.advance(seconds)`` moves time forward deadline by deadline; before each
    step, and at the end, it lets the event loop run until nothing is ready, so everything
    that would happen "instantly" at a moment in time happens before time moves on.

    The steps are summed exactly (then rounded once), so ten ``advance(0.1)`` reach a
    deadline at 1.0 as one ``advance(1)`` does (float addition stops at 0.9999999999999999).
    A wake-up due within two units in the last place (and a microsecond) past the target is
    due at it, as a float rounding error: an element that entered at 0.6 with a 1.1 s
    timeout has its deadline at 0.6 + 1.1 == 1.7000000000000002, which eleven
    ``advance(0.1)`` (1.7) reach.

    It is the time of whoever is given it (the operator's timeouts and retry backoffs), not
    the event loop's: ``asyncio.sleep`` and I/O still take real time, which ``advance``
    does not wait for (a call sleeping 50 ms times out under ``advance(1)`` with a 1 s
    timeout).
    """

    def __init__(self, start: float = 0.0) -> None:
        now = as_float(start)
        if now is None or not math.isfinite(now):
            raise ValueError(
                f"A virtual clock starts at a finite number of seconds; got {start!r}."
            )
        self._now = now
        self._elapsed = Fraction(now)  # the exact sum of the steps: ``now`` rounds it
        self._heap: list[tuple[float, int, _VirtualHandle]] = []
        self._seq = itertools.count()
        # While an advance runs: what its wake-ups raised (those run soon included)
        self._errors: list[BaseException] | None = None

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[[], None]) -> Cancellable:
        """Run ``callback`` once ``now() >= when``: at the ``advance`` that reaches ``when``
        (or comes within a float rounding error of it: see the class),
        or, if ``now()`` already has (a zero delay), soon, as ``SystemClock`` does: without
        waiting for an ``advance`` (as a loop callback then: what it raises goes to the
        loop's exception handler, as on ``SystemClock``, unless an ``advance`` is running:
        that advance raises it). ``when`` must be a number, not NaN (infinity: never)."""
        number = as_float(when)
        if number is None or math.isnan(number):
            # Checked before the heap takes it: a time no deadline compares with would
            # break every later call_at() and advance(), or (NaN) fire at any of them.
            raise (TypeError if number is None else ValueError)(
                f"call_at() takes a time in seconds that is a number, not NaN; got "
                f"{type(when).__name__} {when!r}."
            )
        when = number
        handle = _VirtualHandle(when, callback)
        heapq.heappush(self._heap, (when, next(self._seq), handle))
        if when <= self._now:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (called outside one): the next advance fires it
                pass
            else:
                loop.call_soon(self._fire_one_due)
        return handle

    def _fire_one_due(self) -> None:
        """Run the earliest wake-up that is due, if any (``advance`` may have run it)."""
        self._drop_cancelled()
        if self._heap and self._heap[0][0] <= self._now:
            self._run(heapq.heappop(self._heap)[2])

    def _run(self, handle: _VirtualHandle) -> None:
        """Run a wake-up; during an ``advance`` what it raises is kept for the advance to
        raise (see there), else it propagates (to the loop's exception handler)."""
        try:
            handle.callback()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # CancelledError too, as asyncio's Handle._run
            if self._errors is None:
                raise
            self._errors.append(exc)

    def next_deadline(self) -> float | None:
        """The earliest pending wake-up, or None."""
        self._drop_cancelled()
        return self._heap[0][0] if self._heap else None

    async def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds`` (a finite number >= 0, which keeps the clock
        within the largest float), firing every wake-up that falls due.

        A wake-up that raises stops neither time nor the others, as on ``SystemClock``,
        whose loop reports a callback's exception and keeps going: every wake-up due by
        the target runs, the clock reaches the target, and then ``advance`` raises the
        first exception a wake-up raised during it, so that a test sees it (a
        ``CancelledError`` in a ``RuntimeError``, so that the advance does not look
        cancelled); the ones raised after it are listed in its notes (``__notes__``).
        ``KeyboardInterrupt`` and ``SystemExit`` propagate at once, as the loop lets them:
        the clock stays at the deadline of the wake-up that raised, and the next ``advance``
        starts there (so does one after an ``advance`` that was cancelled). An ``advance``
        that ends so, or is cancelled, hands what its wake-ups raised before to the loop's
        exception handler, as ``SystemClock``'s loop would have.

        One ``advance`` at a time: another started while one runs (in another task)
        raises ``RuntimeError``.
        """
        step = as_float(seconds)
        if step is None:
            raise TypeError(
                f"advance() takes a number of seconds; got {type(seconds).__name__} {seconds!r}."
            )
        if step < 0:
            raise ValueError(f"A virtual clock cannot go backwards; advance() got {seconds!r}.")
        if not math.isfinite(step):
            # NaN would set the clock to NaN and fire every timer; infinity would fire
            # every timer, and never return while one schedules another.
            raise ValueError(f"advance() takes a finite number of seconds; got {seconds!r}.")
        if self._errors is not None:
            # Both would wait for the loop to settle while the other kept it busy (until
            # settle() gave up), and each move time from where they began.
            raise RuntimeError(
                "advance() was called while another advance() of this clock was running; "
                "await each advance() before starting the next."
            )
        if float(self._elapsed) != self._now:  # an advance stopped part-way (see above)
            self._elapsed = Fraction(self._now)
        elapsed = self._elapsed + Fraction(step)
        try:
            target = float(elapsed)
        except OverflowError:  # a float holds no time that late
            raise ValueError(
                f"advance({seconds!r}) would move the virtual clock from {self._now!r} past the "
                f"largest float ({sys.float_info.max!r}); advance it by less."
            ) from None
        # A deadline computed as now() + delay in floats may lie a rounding error past the
        # steps that add up to it (0.6 + 1.1 is 1.7000000000000002; eleven advance(0.1)
        # from 0.6 reach 1.7): a wake-up within two units in the last place is due. No
        # further than the TimerService's microsecond of slack: a timer it ran at the target
        # that the service did not find due it would arm again, for this advance to run again.
        reach = min(target + 2 * math.ulp(target), target + _EARLY_SLACK)
        errors: list[BaseException] = []
        self._errors = errors
        try:
            await settle()
            while True:
                self._drop_cancelled()
                if not self._heap or self._heap[0][0] > reach:
                    break
                when, _, handle = heapq.heappop(self._heap)
                self._now = max(self._now, min(when, target))
                self._run(handle)
                await settle()
            self._now = target
            self._elapsed = elapsed
            await settle()
        except BaseException as stopped:
            # not raised by this advance, which ends with another exception: reported
            for error in errors:
                asyncio.get_running_loop().call_exception_handler(
                    {
                        "message": (
                            "Exception in a VirtualClock wake-up, during an advance() that "
                            f"ended with {type(stopped).__name__}"
                        ),
                        "exception": error,
                    }
                )
            raise
        finally:
            self._errors = None
        if errors:
            raise _first_of(errors, target)

    def _drop_cancelled(self) -> None:
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)


def _first_of(errors: list[BaseException], target: float) -> BaseException:
    """The first of the exceptions wake-ups raised in one ``advance``, noting the others.
    A ``CancelledError`` a wake-up raised (``fut.result()`` of a cancelled future) comes in
    a ``RuntimeError``: raised as it is, it would make ``advance`` look cancelled."""
    first = errors[0]
    if isinstance(first, asyncio.CancelledError):
        wrapped = RuntimeError(
            f"A VirtualClock wake-up due by {target:.15g} raised CancelledError (the "
            "wake-up's own exception, such as result() of a cancelled future; advance() was "
            "not cancelled, and the clock reached its target)."
        )
        wrapped.__cause__ = first
        first = wrapped
    if len(errors) > 1:
        others = "; ".join(f"{type(e).__name__}: {e}" for e in errors[1:])
        note = (
            f"{len(errors) - 1} more wake-up(s) due by {target:.15g} raised after it (each "
            f"ran, and the clock reached {target:.15g}): {others}"
        )
        add_note = getattr(first, "add_note", None)
        if add_note is not None:
            add_note(note)
        else:  # Python 3.10: no add_note; __notes__ is where 3.11 keeps them
            first.__notes__ = [*getattr(first, "__notes__", ()), note]  # type: ignore[attr-defined]
    return first


async def settle(max_rounds: int = 10_000) -> None:
    """Let the running loop work until no callback is ready (every task is blocked).

    The loop-thread equivalent of trio's ``wait_all_tasks_blocked``; it never sleeps on
    the wall clock. Threads that will post mails later are not waited for. Gives up with
    ``RuntimeError`` after ``max_rounds`` (at least 1) turns of a loop that stays busy.
    """
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
        raise ValueError(f"settle() takes max_rounds of at least 1; got {max_rounds!r}.")
    loop = asyncio.get_running_loop()
    ready = getattr(loop, "_ready", None)
    for _ in range(max_rounds):
        await asyncio.sleep(0)
        if ready is not None and not ready:
            return
    if ready is None:
        return
    raise RuntimeError(
        f"The event loop did not settle within {max_rounds} rounds: something keeps it busy "
        "without waiting on anything, such as a task looping on asyncio.sleep(0), or "
        "retries without a delay of a call that fails at once (give the RetryStrategy a "
        "delay, which the virtual clock then moves through)."
    )


_MIN_COMPACT = 64  # a heap this small is never compacted


class TimerService:
    """Processing-time timers keyed by (owner, kind): registering a key again replaces its
    timer, cancelling removes it. One heap; one clock wake-up armed for the earliest timer.

    Cancellation is lazy (a cancelled timer stays in the heap until it reaches the top),
    so register and cancel are O(log n) and O(1), amortized: a cancel that finds the heap
    twice as long as after its last compaction (and at least 64) compacts it, so the heap
    holds at most about twice the peak number of live timers (an element's timeout,
    cancelled once the element is decided, would otherwise keep the element alive until its
    deadline: memory growing with rate times timeout, not with the operator's capacity).
    """

    def __init__(
        self, clock: Clock, on_error: Callable[[BaseException], None] | None = None
    ) -> None:
        """``on_error`` receives what a timer's callback raises; the other due timers still
        run and the next wake-up is still armed (without it the error propagates, after
        the wake-up is re-armed)."""
        self._clock = clock
        self._on_error = on_error
        self._heap: list[tuple[float, int, Hashable]] = []
        self._timers: dict[Hashable, tuple[int, Callable[[], None]]] = {}
        self._seq = itertools.count()
        self._armed: Cancellable | None = None
        self._armed_at: float | None = None
        self._compact_at = _MIN_COMPACT  # heap size past which cancel() compacts it

    @property
    def clock(self) -> Clock:
        return self._clock

    def __len__(self) -> int:
        return len(self._timers)

    def register(self, key: Hashable, when: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` at processing time ``when``; replaces any timer under ``key``."""
        seq = next(self._seq)
        self._timers[key] = (seq, callback)
        heapq.heappush(self._heap, (when, seq, key))
        if self._armed_at is None or when < self._armed_at:
            self._arm(when)

    def cancel(self, key: Hashable) -> bool:
        """Cancel the timer under ``key``; returns whether there was one."""
        if self._timers.pop(key, None) is None:
            return False
        if len(self._heap) > self._compact_at:
            self._compact()
        return True

    def _compact(self) -> None:
        """Drop cancelled and replaced timers from the heap, in place (``_on_wakeup`` may
        be iterating over it). The next compaction waits for the heap to double: O(1) per
        timer, amortized."""
        timers = self._timers
        self._heap[:] = [
            item
            for item in self._heap
            if (entry := timers.get(item[2])) is not None and entry[0] == item[1]
        ]
        heapq.heapify(self._heap)
        self._compact_at = max(_MIN_COMPACT, 2 * len(self._heap))

    def fire_now(self, key: Hashable) -> bool:
        """Cancel the timer under ``key`` and run its callback immediately."""
        entry = self._timers.pop(key, None)
        if entry is None:
            return False
        self._run(entry[1])
        return True

    def _run(self, callback: Callable[[], None]) -> None:
        try:
            callback()
        except BaseException as exc:
            if self._on_error is None or isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            self._on_error(exc)

    def keys(self) -> list[Hashable]:
        return list(self._timers)

    def cancel_all(self) -> None:
        self._timers.clear()
        self._heap.clear()
        if self._armed is not None:
            self._armed.cancel()
        self._armed = None
        self._armed_at = None

    def _arm(self, when: float) -> None:
        if self._armed is not None:
            self._armed.cancel()
        self._armed_at = when
        self._armed = self._clock.call_at(when, self._on_wakeup)

    def _on_wakeup(self) -> None:
        self._armed = None
        self._armed_at = None
        # asyncio may wake us up to one clock resolution early; a microsecond of slack
        # avoids re-arming for the same deadline.
        now = self._clock.now() + _EARLY_SLACK
        heap = self._heap
        timers = self._timers
        try:
            while heap and heap[0][0] <= now:
                _, seq, key = heapq.heappop(heap)
                entry = timers.get(key)
                if entry is None or entry[0] != seq:
                    continue  # cancelled or replaced
                del timers[key]
                self._run(entry[1])
        finally:
            self._arm_next()

    def _arm_next(self) -> None:
        heap = self._heap
        timers = self._timers
        while heap:
            when, seq, key = heap[0]
            entry = timers.get(key)
            if entry is not None and entry[0] == seq:
                self._arm(when)
                break
            heapq.heappop(heap)
