"""``AsyncWaitOperator``: Flink's async I/O operator on an asyncio event loop."""

from __future__ import annotations

import asyncio
import contextvars
import datetime
import enum
import inspect
import math
import weakref
from collections import deque
from contextlib import suppress
from functools import partial
from threading import get_ident
from types import TracebackType
from typing import (
    Any,
    Awaitable,
    Callable,
    Generic,
    Iterable,
    NoReturn,
    Sequence,
    TypeVar,
    cast,
)

from ._elements import StreamElement, StreamRecord, Watermark, describe
from ._exceptions import (
    AsyncFunctionError,
    AsyncTimeoutError,
    ConfigurationError,
    ElementFailedError,
    InvalidResultError,
    OperatorStateError,
    ResultSchemaError,
    StatefulAsyncError,
    TimeoutHandlerError,
    as_float,
    as_int,
    as_seconds,
    element_error,
    error_text,
)
from ._function import (
    AsyncFunctionLike,
    CoroutineFunction,
    _DefaultTimeout,
    already_open,
    as_async_function,
    has_lifecycle,
    has_timeout_handler,
    not_a_result_list,
)
from ._mailbox import Mailbox
from ._queue import ElementQueue, OrderedQueue, QueueEntry, UnorderedQueue
from ._retry import RetryStrategy
from ._timers import Clock, SystemClock, TimerService

IN = TypeVar("IN")
OUT = TypeVar("OUT")

Output = Callable[[StreamElement], Any]

_TIMEOUT = 0
_RETRY = 1
_PROGRAMMING_ERRORS = (InvalidResultError, ResultSchemaError)
# The advice for a failure with no retry strategy; the command line, whose replay takes no
# strategy, says what its user can do instead (stateful_async.cli).
RETRY_THIS = "retry this exception (retry=RetryStrategy(...), which needs a timeout too)"
_new_record = object.__new__
_NOT_CALLED: Any = object()  # an attempt's call before the function returned


# The operator each function with an open() or close() of its own is open in, by the
# function's id (a function need not be hashable nor weakly referenced), for a second
# operator to be refused it: each operator opens and closes its function's clients.
_open_functions: dict[int, weakref.ref[Any]] = {}

# The operators whose open() is opening their function in this context: a close() made from
# the function's open(), in its task or in one that it started (asyncio.gather, wait_for,
# create_task), must not wait for that open() to return (it would wait for itself).
_opening_in: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar(
    "_opening_in", default=()
)

# The operators whose close() is closing their function in this context: a close() made from
# the function's close(), in its task or in one that it started, returns at once (waiting
# for the closing one to return would wait for itself).
_closing_in: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar(
    "_closing_in", default=()
)


def _safely(method: Callable[..., bool], *args: Any, default: bool) -> bool:
    """``method(*args)`` for a message's sake: ``default`` if it raises (a bug in a user's
    retry strategy, reported where it decides an element)."""
    try:
        return bool(method(*args))
    except Exception:
        return default


class OutputMode(enum.Enum):
    """How results are ordered; see ``AsyncWaitOperator``."""

    ORDERED = "ordered"
    UNORDERED = "unordered"


class _State(enum.Enum):
    CREATED = "created"
    OPEN = "open"
    FINISHING = "finishing"
    FINISHED = "finished"
    FAILED = "failed"
    CLOSED = "closed"


class OperatorMetrics:
    """Counters of one operator (``op.metrics``), read at any time on the loop thread.

    * ``records_in``: records whose first call has started (restored ones included);
    * ``watermarks_in``: watermarks accepted;
    * ``restored``: elements (records and watermarks) that ``open(restored)`` re-added;
    * ``results_out``, ``watermarks_out``: results and watermarks handed to ``output``;
    * ``retries``: calls started again after an attempt failed or its result was rejected;
    * ``timeouts``: records whose deadline passed (decided by the timeout handler, or
      failed with ``AsyncTimeoutError`` without one);
    * ``attempts``: calls of the async function, ``records_in + retries``.

    ``as_dict()`` returns them all by name.
    """

    __slots__ = (
        "records_in",
        "watermarks_in",
        "restored",
        "results_out",
        "watermarks_out",
        "retries",
        "timeouts",
    )

    def __init__(self) -> None:
        self.records_in = 0
        self.watermarks_in = 0
        self.restored = 0
        self.results_out = 0
        self.watermarks_out = 0
        self.retries = 0
        self.timeouts = 0

    @property
    def attempts(self) -> int:
        """Calls of the async function: one per record, plus retries."""
        return self.records_in + self.retries

    def as_dict(self) -> dict[str, int]:
        counters = {name: getattr(self, name) for name in self.__slots__}
        counters["attempts"] = self.attempts
        return counters

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in self.as_dict().items())
        return f"OperatorMetrics({fields})"


class _Element(QueueEntry):
    """A queue entry plus the operator's bookkeeping for it (Flink's ``ResultHandler``).

    For a record, the first outcome decides (``decided``): a result, the timeout handler, or
    a final failure. Watermark entries leave the extra fields unused. Without a timeout (so
    without retries) the timeout and retry fields are never written and read as the class
    defaults below: an entry is built per element, so it carries only what it needs;
    ``_TimedElement`` has them as fields of its own.
    """

    __slots__ = ("attempts", "task", "decided")

    deadline: float | None = None
    timeout_task: asyncio.Future[Any] | None = None
    timed_out = False
    backing_off = False
    retry_due: float | None = None
    last_error: BaseException | None = None
    rejected = False

    def __init__(self, element: StreamElement, done: bool = False) -> None:
        # Fields of QueueEntry set here too: one constructor call per element, not two.
        self.element = element
        self.results: list[Any] | None = None
        self.done = done
        self.segment = None
        self.attempts = 1  # without a timeout, the one attempt (_TimedElement counts its own)
        self.task: asyncio.Future[Any] | None = None
        self.decided = False


class _TimedElement(_Element):
    """An entry of an operator with a timeout: deadline, timeout handler, retry state.

    ``retry_due`` is when the pending retry starts, kept once the deadline has cancelled it
    (the timeout error says so); ``last_error`` and ``rejected`` say how the last attempt
    that ended went: an exception, or a result that ``retry_on_result`` rejected."""

    __slots__ = (
        "deadline",
        "timeout_task",
        "timed_out",
        "backing_off",
        "retry_due",
        "last_error",
        "rejected",
    )

    def __init__(self, element: StreamElement, done: bool = False) -> None:
        super().__init__(element, done)
        self.attempts = 0  # _start counts the first attempt when it starts it
        self.deadline = None
        self.timeout_task = None
        self.timed_out = False
        self.backing_off = False
        self.retry_due = None
        self.last_error = None
        self.rejected = False


def _as_results(
    results: Any, element: StreamElement, attempts: int, source: str = "The async function"
) -> list[Any]:
    if type(results) is list:
        return results
    if not_a_result_list(results):
        raise element_error(
            InvalidResultError,
            f"{source} returned {type(results).__name__} instead of an iterable of results",
            element,
            attempts,
            "Return a list: [result] for one result, [] to emit nothing.",
        )
    if inspect.isawaitable(results):
        returned = type(results).__name__
        if inspect.iscoroutine(results):
            returned += f" {results.__qualname__}"
            results.close()  # never to be awaited: closed, not warned about when collected
        raise element_error(
            InvalidResultError,
            f"{source} returned {returned}, an awaitable, instead of an iterable of results",
            element,
            attempts,
            "Did you forget `await`? Await it inside the function and return a list of its "
            "results: [result] for one result, [] to emit nothing.",
        )
    try:
        iterator = iter(results)
    except TypeError as exc:
        raise element_error(
            InvalidResultError,
            f"{source} returned {type(results).__name__}, which is not iterable",
            element,
            attempts,
            "Return a list: [result] for one result, [] to emit nothing.",
        ) from exc
    # Outside the try: a TypeError raised while iterating (a generator of results that
    # raised) is the call's own error, for the caller to treat as a failed call.
    return list(iterator)


class AsyncWaitOperator(Generic[IN, OUT]):
    """Applies an async function to every record with many calls in flight.

    Ordering (``mode``):

    * ``ORDERED``: output order is input order, watermarks included.
    * ``UNORDERED``: results between two watermarks leave in completion order; a
      watermark leaves only after every record before it, and no record after it
      overtakes it. Without watermarks the output is fully unordered.

    ``capacity`` bounds the queue, watermarks included; ``process_element`` waits (while
    completions, timers and emission keep running) when it is full, so memory is bounded
    by capacity, not by input size.

    ``max_in_flight`` (default: ``capacity``) bounds the elements whose calls have started
    and are not yet decided; the rest of the queue holds elements waiting for a call slot
    and finished results waiting for their turn to leave. In ordered mode a finished result
    keeps its queue entry until every earlier element is done, so behind one slow call the
    queue fills with finished results and the calls in flight fall below ``capacity``:
    ``capacity`` well above ``max_in_flight`` keeps the calls in flight at
    ``max_in_flight`` (what the service sees) through such stalls, memory still bounded by
    ``capacity``. Elements start their calls in input order.

    ``timeout`` (seconds, or a ``timedelta``) is per element, starts with the element's
    first call (as it enters the queue, or with ``max_in_flight`` once a call slot is free
    for it: time spent waiting for room does not count) and covers every retry. At the
    deadline ``fn.timeout(value)`` decides the element (results, or failure). While the
    handler runs, the attempt that was running at the deadline may still end: a result
    that ``retry`` accepts (any result, without ``retry_on_result``) wins and the handler
    is cancelled; an exception, or a result that ``retry_on_result`` rejects, is dropped,
    as no retry starts at or after the deadline, and the handler decides.

    ``retry`` decides whether a failed attempt (or an unwanted result) is tried again,
    after a per-element backoff; a ``ConfigurationError`` the function raises (a bad
    setting, which no attempt can get past) is never retried. The first outcome of an
    element wins — a result, the timeout handler, or a final failure; later ones are
    dropped and the element's other attempts are cancelled. A failure fails the operator
    with an ``ElementFailedError`` naming the element; everything emitted before stays
    emitted.

    State is touched only on the event-loop thread. ``output`` receives every emitted
    result (as ``StreamRecord`` with the input's timestamp) and every watermark, one
    queue entry per mail so the loop is never hogged.

    Lifecycle: ``await open(restored)``, ``await process_element`` /
    ``process_watermark`` ..., ``snapshot_state(id)`` at any point between ``open()``
    returning and ``close()`` unless the operator has failed, ``await finish()`` to drain,
    ``await close()`` always (also usable as ``async with``). ``metrics`` (an
    ``OperatorMetrics``) counts records, results, retries and timeouts as they happen.
    """

    def __init__(
        self,
        fn: AsyncFunctionLike[IN, OUT],
        output: Output,
        mode: OutputMode | str = OutputMode.ORDERED,
        capacity: int = 100,
        timeout: float | datetime.timedelta | None = None,
        retry: RetryStrategy | None = None,
        *,
        max_in_flight: int | None = None,
        clock: Clock | None = None,
    ) -> None:
        self._fn = as_async_function(fn)
        if not callable(output):
            raise ConfigurationError(
                f"output must be a callable that receives each emitted element; got "
                f"{type(output).__name__}."
            )
        self._mode = _check_mode(mode)
        count = as_int(capacity)  # numpy's integers too, as plain ints
        if count is None or count < 1:
            raise ConfigurationError(
                f"capacity must be an integer >= 1 (queue entries in flight); got {capacity!r}."
            )
        capacity = count
        if max_in_flight is not None:
            count = as_int(max_in_flight)
            if count is None or not 1 <= count <= capacity:
                raise ConfigurationError(
                    f"max_in_flight must be an integer from 1 to capacity ({capacity}), or None "
                    f"for capacity; got {max_in_flight!r}."
                    + (
                        " It bounds the calls in flight among the queue's entries, so it cannot "
                        "exceed them: raise capacity too."
                        if count is not None and count > capacity
                        else ""
                    )
                )
            max_in_flight = count
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if timeout is not None:
            given_timeout, timeout = timeout, as_float(timeout)
            if timeout is None:
                raise ConfigurationError(
                    f"timeout must be a number of seconds, a timedelta, or None; got "
                    f"{given_timeout!r}."
                )
            if not 0 < timeout < math.inf:
                raise ConfigurationError(
                    f"timeout must be a finite number of seconds > 0; got {given_timeout!r}. Use "
                    "timeout=None for no timeout."
                )
        if retry is not None:
            if not isinstance(retry, RetryStrategy):
                uncalled = retry is RetryStrategy or getattr(retry, "__self__", None) is (
                    RetryStrategy
                )  # the class, or a factory such as RetryStrategy.fixed_delay, not called
                raise ConfigurationError(
                    f"retry must be a RetryStrategy; got {type(retry).__name__}"
                    + (
                        f" {getattr(retry, '__qualname__', retry)!s}: call it, such as "
                        "retry=RetryStrategy.fixed_delay(3, 0.5)."
                        if uncalled
                        else "."
                    )
                )
            if timeout is None:
                raise ConfigurationError(
                    "A retry strategy needs a timeout: it bounds how long an element may keep "
                    "retrying. Pass timeout=<seconds> together with retry=..."
                )
        self._output = output
        self._capacity = capacity
        self._max_in_flight = capacity if max_in_flight is None else max_in_flight
        # Below capacity, calls are counted and elements past the bound wait, in input order,
        # for a slot (_admit); at capacity the queue's own bound is the only one needed.
        self._limited = self._max_in_flight < capacity
        self._calls = 0
        self._waiting: deque[_Element] = deque()
        self._handing_over = False  # _call_ended is handing slots to waiting elements
        self._timeout = None if timeout is None else float(timeout)
        self._retry = retry
        self._has_timeout_handler = has_timeout_handler(self._fn)
        # A plain async def is called directly: one call layer less per element.
        self._invoke: Callable[[Any], Any] = (
            self._fn.fn if isinstance(self._fn, CoroutineFunction) else self._fn.async_invoke
        )
        if clock is not None and (
            # a class has the methods too, unbound: its now() fails at the first element
            isinstance(clock, type)
            or not all(callable(getattr(clock, method, None)) for method in ("now", "call_at"))
        ):
            raise ConfigurationError(
                "clock must be a Clock (with now() and call_at(when, callback) methods), such "
                "as stateful_async.testing.VirtualClock(), or None for asyncio's; got "
                + (
                    f"the class {clock.__name__}: pass an instance, clock={clock.__name__}()."
                    if isinstance(clock, type)
                    else f"{clock!r}."
                )
            )
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._timers = TimerService(self._clock, self._on_timer_error)
        new_entry = self._reuse_entry if self._timeout is None else _TimedElement
        self._queue: ElementQueue = (
            OrderedQueue(capacity, new_entry)
            if self._mode is OutputMode.ORDERED
            else UnorderedQueue(capacity, new_entry)
        )
        self._try_put = self._queue.try_put  # bound again in open(): called per element
        self._complete_and_poll = self._queue.complete_and_poll
        self._state = _State.CREATED
        self._retry_while_finishing = False  # finish(keep_retrying=True)
        # The loop thread's id while input is accepted (state OPEN), else None: one
        # comparison per element checks both state and thread.
        self._accepting_thread: int | None = None
        self._failure: ElementFailedError | StatefulAsyncError | None = None
        self._mailbox: Mailbox | None = None
        self._thread_id: int | None = None
        self._new_task: Callable[[Any], asyncio.Future[Any]] = _not_open
        self._loop: asyncio.AbstractEventLoop | None = None
        self._capacity_waiter: asyncio.Future[None] | None = None
        self._drain_waiter: asyncio.Future[None] | None = None
        self._emit_scheduled = False
        # Emitted entries kept for reuse by new ones (see _reuse_entry); without a timeout.
        self._spare: list[_Element] = []
        self._fn_opened = False
        self._restoring = False
        # Calls and timeout handlers _release cancelled, until they have ended: close()
        # waits for them as for the calls it cancels itself.
        self._cancelled: set[asyncio.Future[Any]] = set()
        self._closing: asyncio.Future[None] | None = None  # done once close() has returned
        # done once the function's open() has ended (and open() has closed the function again
        # if close() ran meanwhile; see _opening_in)
        self._opening: asyncio.Future[None] | None = None
        # what the function's close() raised, and its traceback then (raised again with
        # it: re-raising the object alone would add each close()'s frames to it)
        self._close_error: tuple[Exception, TracebackType | None] | None = None
        self.metrics = OperatorMetrics()

    def _set_state(self, state: _State) -> None:
        self._state = state
        accepting = state is _State.OPEN and self._fn_opened
        self._accepting_thread = self._thread_id if accepting else None

    def _may_retry(self) -> bool:
        """Whether a failed or rejected attempt may be retried: while input is accepted,
        and while finishing with ``keep_retrying``."""
        state = self._state
        return state is _State.OPEN or (state is _State.FINISHING and self._retry_while_finishing)

    # -- properties -------------------------------------------------------------------

    @property
    def mode(self) -> OutputMode:
        return self._mode

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def max_in_flight(self) -> int:
        """The most elements whose calls are in flight at once (``capacity`` unless set)."""
        return self._max_in_flight

    @property
    def calls_in_flight(self) -> int:
        """Records whose call has started and that are not decided yet (those waiting out a
        retry backoff or a timeout handler included): what the service has to answer."""
        if self._failure is not None or self._state is _State.CLOSED:
            return 0  # every call was cancelled
        if self._limited:
            return self._calls
        entries: Iterable[_Element] = self._queue.entries()  # type: ignore[assignment]
        return sum(type(e.element) is StreamRecord and not e.decided for e in entries)

    @property
    def function(self) -> Any:
        return self._fn

    @property
    def in_flight(self) -> int:
        """Queue entries not yet emitted (records and watermarks)."""
        return len(self._queue)

    @property
    def failure(self) -> BaseException | None:
        """The error that failed the operator, if it failed."""
        return self._failure

    # -- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> AsyncWaitOperator[IN, OUT]:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def open(self, restored: Iterable[StreamElement] | None = None) -> None:
        """Open the function, then re-add ``restored`` elements (from ``snapshot_state``)
        in order before any new input: records are invoked again from attempt 1 with a
        fresh timeout, watermarks are replayed. More restored elements than ``capacity``
        is fine: this waits for room like ``process_element``. If it is cancelled (or
        raises) before every restored element is back, the operator fails, as a snapshot
        would miss the rest: close it and restore into a new one."""
        if self._state is not _State.CREATED:
            raise OperatorStateError(
                f"open() was called on an operator that is {self._state.value}; an operator "
                "opens once. Create a new AsyncWaitOperator to restore into."
            )
        self._loop = loop = asyncio.get_running_loop()
        self._mailbox = Mailbox(loop)
        self._post_emit = self._mailbox.execute
        self._done: asyncio.Future[None] = loop.create_future()
        self._done.set_result(None)
        self._thread_id = get_ident()
        self._try_put = self._queue.try_put
        self._complete_and_poll = self._queue.complete_and_poll
        # asyncio.Task(coro) skips the Python wrapper of loop.create_task, and without a loop=
        # argument it takes the running loop (this one: tasks start on the loop thread only)
        # at no cost. A loop with a task factory (or a non-asyncio loop) gets create_task.
        self._new_task = (
            asyncio.Task
            if isinstance(loop, asyncio.BaseEventLoop) and loop.get_task_factory() is None
            else loop.create_task
        )
        self._set_state(_State.OPEN)
        # From here until every restored element is back in the queue a snapshot would miss
        # them: snapshot_state refuses, also while the function's open() is awaited.
        self._restoring = True
        # close() waits for the function's open() to end (see _wait_for_open)
        opening = self._opening = loop.create_future()
        opener = _opening_in.set((*_opening_in.get(), self))
        try:
            try:
                try:
                    self._claim_function()
                    await self._fn.open()
                except BaseException:
                    self._release_function()
                    # The function is not open: no input, no snapshot, and close() does not
                    # close it (like an ``async with`` whose __aenter__ raised; see
                    # AsyncFunction.open).
                    if self._state is not _State.CLOSED:
                        self._set_state(_State.FAILED)
                    raise
                self._fn_opened = True
                if self._state is _State.CLOSED:
                    # close() ran while the function was opening, too early to close it: now,
                    # while that close() waits to raise what the function's close() raises.
                    with suppress(Exception):
                        await self._close_function()
                    raise OperatorStateError(
                        "The operator was closed while its function was opening; the function "
                        "was closed once its open() had returned."
                    )
            finally:
                _opening_in.reset(opener)
                opening.set_result(None)
            self._set_state(self._state)  # input is accepted from here (the restore's first)
            try:
                await self._restore(restored or ())
            except BaseException as exc:
                # Cancelled, or refused an element, part-way: the operator holds only some of
                # the restored elements, and a snapshot of it would lose the others.
                if self._failure is None and self._state is not _State.CLOSED:
                    failure = OperatorStateError(
                        f"open() did not finish re-adding the restored elements "
                        f"({type(exc).__name__}), so the operator holds only some of them and "
                        "has failed: a snapshot or new input would lose the others. Close it "
                        "and restore into a new AsyncWaitOperator."
                    )
                    failure.__cause__ = exc
                    self._fail(failure)
                raise
        finally:
            self._restoring = False

    async def _restore(self, restored: Iterable[StreamElement]) -> None:
        for element in restored:
            if type(element) is Watermark:
                await self.process_watermark(element)
            elif type(element) is StreamRecord:
                await self.process_element(element)
            else:
                raise ConfigurationError(
                    f"restored must contain StreamRecord and Watermark elements (as returned by "
                    f"snapshot_state); got {type(element).__name__}."
                )
            self.metrics.restored += 1

    def process_element(self, record: StreamRecord[IN]) -> Awaitable[None]:
        """Add a record and start its first attempt (with ``max_in_flight``, once a call
        slot is free); await the returned awaitable.

        Use it as ``await op.process_element(record)``. When the queue has room the record
        is added at once and an already-completed awaitable is returned; when it is full, the
        awaitable waits for room (completions, timers and emission keep running) and then
        adds the record. Misuse raises at the call.
        """
        if get_ident() != self._accepting_thread:
            self._check_accepting("process_element()")
        if type(record) is not StreamRecord:
            raise ConfigurationError(
                f"process_element() takes a StreamRecord; got {type(record).__name__}. Wrap "
                "the value: StreamRecord(value, timestamp)."
                + (
                    " Use process_watermark() for watermarks."
                    if isinstance(record, Watermark)
                    else ""
                )
            )
        if self._capacity_waiter is not None:
            raise self._overtaking()  # woken but not resumed yet: its room is not ours
        entry = self._try_put(record)
        if entry is None:
            # The waiter is registered now, not when the coroutine first runs: if the caller
            # forgets to await it, the next call is refused instead of this record being lost.
            return self._put_when_room(record, self._register_capacity_waiter())
        if self._limited:
            self._admit(entry)  # type: ignore[arg-type]
        elif self._timeout is None:  # _start without a timeout, inlined: the hot path
            self.metrics.records_in += 1
            entry.task = self._new_task(self._attempt_once(entry))  # type: ignore[arg-type, attr-defined]
        else:
            self._start(entry)  # type: ignore[arg-type]
        return self._done  # no coroutine per element on the fast path

    async def _put_when_room(self, record: StreamRecord[IN], waiter: asyncio.Future[None]) -> None:
        await self._await_capacity(waiter)
        while (entry := self._queue.try_put(record)) is None:
            await self._wait_for_capacity()
        self._admit(entry)  # type: ignore[arg-type]

    def _admit(self, entry: _Element) -> None:
        """A record entered the queue: start its call, or with ``max_in_flight`` below
        capacity and no slot free, keep it waiting (in the queue, so in snapshots) for
        ``_call_ended``."""
        if not self._limited:
            self._start(entry)
        elif self._calls < self._max_in_flight:
            self._calls += 1
            self._start(entry)
        else:
            self._waiting.append(entry)

    def _call_ended(self) -> None:
        """An element holding a call slot was decided: its slot goes to the oldest waiting
        element, unless the operator failed or closed (waiting elements are then never
        called). Retry backoffs and the timeout handler keep the slot: the element is in
        flight until decided.

        A loop, not a call per slot: with an eager task factory (Python 3.12+) a started
        call that finishes without suspending is decided inside ``_start``, and calls made
        from here would nest one level per waiting element."""
        self._calls -= 1
        if self._handing_over:
            return  # the loop below, further up this stack, hands this slot over too
        self._handing_over = True
        try:
            while (
                self._waiting
                and self._calls < self._max_in_flight
                and self._failure is None
                and self._state is not _State.CLOSED
            ):
                self._calls += 1
                self._start(self._waiting.popleft())
        finally:
            self._handing_over = False

    def _reuse_entry(self, element: StreamElement, done: bool) -> _Element:
        """A queue entry for ``element``: an emitted one reused, or a new one.

        Without a timeout an element is decided only by its one attempt, so nothing refers
        to its entry once it is emitted, and the entry can serve a new element. Reused, it
        costs a few stores instead of an allocation; and what it held from its previous
        element (record, results, finished task) is freed now, one element's worth per new
        element, rather than a queue's worth at once at emission followed by a queue's worth
        of allocations on refill, which set the garbage collector's young generation
        running over every in-flight element again and again. Entries in flight and spare
        together never exceed ``capacity``.
        """
        spare = self._spare
        if not spare:
            return _Element(element, done)
        entry = spare.pop()
        entry.element = element
        entry.results = None
        entry.done = done
        entry.task = None
        entry.decided = False
        return entry  # attempts is 1 still; an unordered queue sets segment

    def _start(self, entry: _Element) -> None:
        """A record's first attempt starts, and its timeout clock: as it enters the queue,
        or with ``max_in_flight`` once a call slot is free for it.
        (``process_element`` inlines the case without a timeout.)"""
        self.metrics.records_in += 1
        if self._timeout is None:
            entry.task = self._new_task(self._attempt_once(entry))
            return
        timed = cast(_TimedElement, entry)
        timed.deadline = deadline = self._clock.now() + self._timeout
        self._timers.register((timed, _TIMEOUT), deadline, partial(self._on_timeout, timed))
        timed.attempts = 1
        timed.task = self._new_task(self._attempt(timed, 1))

    async def process_watermark(self, watermark: Watermark) -> None:
        """Add a watermark; it leaves as soon as everything before it has left: at once,
        from this call, when nothing is ahead of it.

        Raises the operator's failure if the operator fails during the call, as
        ``process_element`` does while it waits for room: the output raising on the
        watermark (or on a result this call emits ahead of it) included. The watermark
        was accepted by then (counted in ``metrics.watermarks_in``).
        """
        self._check_accepting("process_watermark()")
        if type(watermark) is not Watermark:
            raise ConfigurationError(
                f"process_watermark() takes a Watermark; got {type(watermark).__name__}."
            )
        if self._capacity_waiter is not None:
            raise self._overtaking()
        while self._queue.try_put(watermark) is None:
            await self._wait_for_capacity()
        self.metrics.watermarks_in += 1
        self._output_completed()
        if self._failure is not None:  # the output raised on what this call emitted
            raise self._failure

    def snapshot_state(self, checkpoint_id: int) -> list[StreamElement]:
        """Every queue entry not yet emitted, in queue order, as its input element.

        Pending and completed-but-unemitted records and watermarks are all included;
        results and retry counts are not (a restore invokes those records again). Each
        snapshot stands alone: it replaces, never extends, the previous one. Never blocks,
        even on a full queue; a record whose ``process_element`` is still waiting for room
        is not in the queue yet, so not in the snapshot: count it as not yet consumed.

        Raises ``OperatorStateError`` before ``open()`` has returned (while it re-adds
        restored elements, too), after ``close()``, and once the operator has failed.
        """
        self._check_thread("snapshot_state()")
        if self._failure is not None:
            raise OperatorStateError(
                f"Cannot take snapshot {checkpoint_id}: the operator has failed "
                f"({self._failure}). A failed operator's state must not be checkpointed."
            ) from self._failure
        if self._state not in (_State.OPEN, _State.FINISHING, _State.FINISHED):
            raise OperatorStateError(
                f"Cannot take snapshot {checkpoint_id}: the operator is {self._state.value}."
            )
        if self._restoring:
            raise OperatorStateError(
                f"Cannot take snapshot {checkpoint_id} while open() is still re-adding restored "
                "elements: the snapshot would miss those not yet re-added. Wait for open()."
            )
        return self._queue.values()

    async def finish(self, *, keep_retrying: bool = False) -> None:
        """Drain: no more input; pending retry backoffs fire now and retrying is disabled
        (each element's current attempt is its last), as Flink does at the end of input;
        waits until everything in flight has completed and been emitted. Raises the
        operator's failure, if any.

        With ``keep_retrying=True`` the elements in flight keep their backoffs and retries
        (each still bounded by its timeout): for a caller whose timers keep running after
        its input ends, such as a Spark task at the end of its partition, whose last
        elements should be retried like any other.

        A ``finish()`` that was cancelled (``asyncio.wait_for(op.finish(), ...)`` timing out)
        may be awaited again: the drain goes on from where it was.
        """
        if self._state is _State.FINISHING and self._failure is None and self._drain_waiter is None:
            self._check_thread("finish()")  # resuming a cancelled finish(): no input came since
        else:
            self._check_accepting("finish()")
        if self._capacity_waiter is not None:  # an element still waits to enter: not lost
            raise self._overtaking("finish()")
        self._retry_while_finishing = keep_retrying
        self._set_state(_State.FINISHING)
        if not keep_retrying:
            for entry in self._queue.entries():
                if entry.backing_off:  # type: ignore[attr-defined]
                    self._timers.fire_now((entry, _RETRY))
        while len(self._queue):
            if self._failure is not None:
                break
            assert self._loop is not None
            waiter = self._drain_waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._drain_waiter = None
        self._spare.clear()
        if self._failure is not None:
            raise self._failure
        self._set_state(_State.FINISHED)

    async def close(self) -> None:
        """Release everything: cancels timers and in-flight calls (without ``finish()``,
        in-flight elements are discarded), waits up to 5 s (wall clock) for the cancelled
        calls to end, those cancelled earlier because another outcome decided their element
        included (one that ignores its cancellation is left running, its outcome dropped),
        then closes the function. Idempotent: a call made while another is still closing
        waits until that one has returned (its function closed); a call after one that was
        cancelled before it closed the function does what it left undone. A call made by
        the function's own ``close()`` (a function that closes its operator), in its task
        or in one it started, returns at once: the operator is closing it, and waiting
        would wait for itself. A call made
        while ``open()`` awaits the function's ``open()`` waits for that to return, and
        returns once the function is closed again (``open()`` then raises
        ``OperatorStateError``); made from the function's ``open()`` (in its task, or in one
        it started), it returns at once.

        If the function's ``close()`` raised, so does this call, and every ``close()`` that
        waited for it or comes after it raises the same error (as a failed future would):
        the operator is closed, but its function may not have released its clients."""
        if self._state is _State.CLOSED:
            closing = self._closing
            while closing is not None and not closing.done():
                if self in _closing_in.get():
                    return  # re-entered from the function's close() (see _closing_in)
                await asyncio.shield(closing)
                closing = self._closing  # another waiter may have taken over a cancelled one
            if not self._fn_opened:
                await self._wait_for_open()
                self._raise_close_error()
                return
        else:
            self._set_state(_State.CLOSED)
            self._spare.clear()
            self._timers.cancel_all()
            for task in self._cancel_in_flight():  # waited for below, by a later call too
                self._cancelled.add(task)
                task.add_done_callback(self._cancelled.discard)
            self._wake_waiters(
                OperatorStateError("The operator was closed while a call was waiting on it.")
            )
        self._closing = closing = asyncio.get_running_loop().create_future()
        closer = _closing_in.set((*_closing_in.get(), self))
        try:
            tasks = {task for task in self._cancelled if not task.done()}
            if tasks:
                await asyncio.wait(tasks, timeout=5.0)
            if self._fn_opened:
                await self._close_function()
            else:  # not open, or still opening: open() closes it once open
                await self._wait_for_open()
                self._raise_close_error()
        finally:
            _closing_in.reset(closer)
            closing.set_result(None)

    async def _close_function(self) -> None:
        """Close the open function; what its ``close()`` raises is kept, for every
        ``close()`` of the operator to raise."""
        self._fn_opened = False
        try:
            await self._fn.close()
        except Exception as exc:  # not a cancellation: the close's outcome
            self._close_error = (exc, exc.__traceback__)
            raise
        finally:
            self._release_function()

    def _claim_function(self) -> None:
        """Refuse a function that another operator has open (see ``_open_functions``)."""
        if not has_lifecycle(self._fn):
            return  # nothing to open or close: it may serve several operators at once
        key = id(self._fn)
        owner = _open_functions.get(key)
        if owner is not None and owner() is not None:
            raise already_open(self._fn, "by another operator that has not been closed")
        _open_functions[key] = weakref.ref(self, partial(_forget_function, key))

    def _release_function(self) -> None:
        key = id(self._fn)
        owner = _open_functions.get(key)
        if owner is not None and owner() is self:
            del _open_functions[key]

    async def _wait_for_open(self) -> None:
        """Wait until the function's ``open()``, if it is still running, has returned and
        ``open()`` has closed the function again; at once if that ``open()`` is what called
        ``close()``, in its task or one it started (it would wait for itself)."""
        opening = self._opening
        if opening is not None and not opening.done() and self not in _opening_in.get():
            await asyncio.shield(opening)

    def _raise_close_error(self) -> None:
        if self._close_error is not None:
            error, trace = self._close_error
            raise error.with_traceback(trace)

    # -- attempts, retries, timeouts ---------------------------------------------------

    def _start_attempt(self, handler: _Element) -> None:
        handler.attempts = attempt = handler.attempts + 1
        handler.task = self._new_task(self._attempt(handler, attempt))

    async def _attempt_once(self, handler: _Element) -> None:
        """The only attempt of an element of an operator without timeout (so without
        retries): ``_attempt`` cut to what that case needs, since every element takes it.
        The outcome is handled in the step that finishes the call: no mail per element."""
        call = _NOT_CALLED
        try:
            call = self._invoke(handler.element.value)  # type: ignore[union-attr]
            results = await call
        except BaseException as exc:
            self._on_attempt_raised(handler, 1, exc, call)
            return
        if handler.decided:
            return  # the operator failed or closed meanwhile: dropped
        if type(results) is list:
            handler.decided = True  # nothing to release: no timers, no other attempts
            if self._limited:
                self._call_ended()
            entry = self._complete_and_poll(handler, results)
            if entry is not None and self._failure is None:
                self._emit(entry)
        else:
            handler.task = None
            self._on_attempt_result(handler, results)

    async def _attempt(self, handler: _Element, attempt: int) -> None:
        """Attempt number ``attempt`` of an element, with a timeout and maybe retries."""
        call = _NOT_CALLED
        try:
            call = self._invoke(handler.element.value)  # type: ignore[union-attr]
            results = await call
        except BaseException as exc:
            self._on_attempt_raised(handler, attempt, exc, call)
            return
        if handler.decided or attempt != handler.attempts:
            return  # the element is decided, or this attempt was superseded: dropped
        handler.task = None
        self._on_attempt_result(handler, results)

    def _not_awaitable(
        self, handler: _Element, call: Any, method: str = "async_invoke"
    ) -> InvalidResultError:
        """The error of a call whose function returned something ``await`` refuses (an
        ``async_invoke`` or ``timeout`` that is a callable object or a ``functools.partial``
        of a plain function passes the construction check): a programming error, never
        retried. For ``async_invoke``, checked once ``await`` has raised, so that a call that
        returns an awaitable, every call, pays nothing for it."""
        function = (
            "The async function"
            if isinstance(self._fn, CoroutineFunction)
            else f"{type(self._fn).__name__}.{method}"
        )
        return cast(
            InvalidResultError,
            element_error(
                InvalidResultError,
                f"{function} returned {type(call).__name__}, not an awaitable",
                handler.element,
                handler.attempts,
                f"{method} must return an awaitable: is it an async def? Declare it "
                f"'async def {method}(self, value)' returning a list of results (a callable "
                "object needs an 'async def __call__'; a functools.partial, an async function "
                "inside).",
            ),
        )

    def _on_attempt_raised(
        self, handler: _Element, attempt: int, exc: BaseException, call: Any
    ) -> None:
        """Attempt ``attempt`` raised ``exc``; ``call`` is what the function returned
        (``_NOT_CALLED`` if it raised instead)."""
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            self._interrupted(handler, exc)
        if handler.decided or attempt != handler.attempts:
            return  # decided elsewhere (which cancels its other attempts), or superseded
        if type(exc) is TypeError and call is not _NOT_CALLED and not inspect.isawaitable(call):
            exc = self._not_awaitable(handler, call)  # await refused it: never retried
        elif isinstance(exc, asyncio.CancelledError):
            exc = asyncio.CancelledError(
                "The attempt was cancelled by someone other than the operator."
            )
        handler.task = None
        self._on_attempt_error(handler, exc)

    def _interrupted(
        self,
        handler: _Element,
        exc: KeyboardInterrupt | SystemExit,
        source: str = "The async function",
        stop: bool = True,
    ) -> None:
        """A call (or the timeout handler: ``source``) raised ``exc``, which stops the loop
        (raised again here if ``stop``): not an outcome of the element, which has none. The
        operator fails, so that a loop run again (``asyncio.run``'s clean-up, a caller that
        catches it) does not wait for ever on the element in ``finish()``."""
        if not handler.decided:
            self._decide_failure(
                handler,
                element_error(
                    AsyncFunctionError if source == "The async function" else TimeoutHandlerError,
                    f"{source} was interrupted by {type(exc).__name__}",
                    handler.element,
                    handler.attempts,
                    "It stopped the event loop and failed the operator: close the operator, "
                    "and restore its last snapshot into a new one to go on.",
                    cause=exc,
                ),
            )
        if stop:
            _stop_loop(exc)

    def _on_attempt_error(self, handler: _Element, error: BaseException) -> None:
        if self._timeout is not None:
            timed = cast(_TimedElement, handler)
            timed.last_error, timed.rejected = error, False  # a timeout error reports it
        if isinstance(error, _PROGRAMMING_ERRORS):
            # A result of the wrong shape: deterministic, never retried, already names the
            # element.
            self._decide_failure(handler, error)
            return
        if handler.timed_out:
            return  # the timeout handler decides this element
        if (
            self._retry is not None
            and self._may_retry()
            # a bad setting, found by a check the function runs (such as CrashOnElement's on
            # the rows' keys): no attempt can go otherwise, whatever the strategy matches
            and not isinstance(error, ConfigurationError)
            and self._retried(handler, "exception", error)
        ):
            return
        self._decide_failure(
            handler,
            element_error(
                AsyncFunctionError,
                "The async function failed",
                handler.element,
                handler.attempts,
                self._failure_advice(handler, error),
                cause=error,
            ),
        )

    def _failure_advice(self, handler: _Element, error: BaseException) -> str:
        """What to do about an element whose last attempt raised ``error``: retrying it
        (more attempts, or while finishing) is advice only for an exception the strategy
        retries, and only when it was not retried already until its attempts ran out."""
        retry = self._retry
        fallback = "or catch it in async_invoke and return a fallback result."
        if isinstance(error, ConfigurationError):
            return "A ConfigurationError is never retried: fix the setting it names."
        if retry is None:
            return f"Fix the cause; or {RETRY_THIS}; {fallback}"
        # The predicate first: can_retry, or a finishing operator, may have kept it from
        # being asked, and then neither more attempts nor keep_retrying would help.
        if not _safely(retry.should_retry_exception, error, default=True):
            return (
                "The retry strategy's retry_on_exception does not match it. Fix the cause; or "
                f"make retry_on_exception match it; {fallback}"
            )
        if not _safely(retry.can_retry, handler.attempts, default=True):
            return (
                f"Its retries are used up (max_attempts={retry.max_attempts}). Fix the "
                f"cause; or allow more attempts; {fallback}"
            )
        if not self._may_retry():
            return (
                "The operator was finishing, which ends retries (finish(keep_retrying=True) "
                f"keeps them). Fix the cause; {fallback}"
            )
        return f"Fix the cause; {fallback}"  # a predicate that answered otherwise just before

    def _on_attempt_result(self, handler: _Element, results: Any) -> None:
        try:
            results = _as_results(results, handler.element, handler.attempts)
        except InvalidResultError as exc:
            self._decide_failure(handler, exc)
            return
        except (KeyboardInterrupt, SystemExit) as exc:
            self._interrupted(handler, exc)
        except BaseException as exc:  # a generator of results that raised: the call failed
            self._on_attempt_error(handler, exc)
            return
        if handler.timed_out:
            # As with an exception (see _on_attempt_error): a result the strategy would
            # retry cannot be retried past the deadline, so the running timeout handler
            # decides; a result it accepts wins.
            if self._retry is not None and self._rejected_late(
                cast(_TimedElement, handler), results
            ):
                return
        elif (
            self._retry is not None
            and self._may_retry()
            and self._retried(handler, "result", results)
        ):
            return
        self._decide(handler, results)

    def _rejected_late(self, handler: _TimedElement, results: list[Any]) -> bool:
        """Whether ``retry_on_result`` rejects a result that came after the deadline, while
        the timeout handler runs; True also if the predicate raised, which fails the
        element (see ``_retried``)."""
        assert self._retry is not None
        try:
            rejected = self._retry.should_retry_result(results)
        except Exception as exc:
            self._decide_failure(
                handler, self._strategy_error(handler, "result", "retry_on_result", exc)
            )
            return True
        if rejected:
            handler.last_error, handler.rejected = None, True
        return bool(rejected)

    def _retried(self, handler: _Element, outcome: str, value: Any) -> bool:
        """Ask the retry strategy whether the attempt's ``outcome`` ("exception" or
        "result") is retried (attempts left, and its predicate) and after what backoff, and
        schedule the retry; True if the element was dealt with here. A strategy method that
        raises (a subclass's ``can_retry`` or ``backoff``, or a predicate) is a bug in it,
        never retried: the element fails now, rather than waiting for its deadline with the
        error lost in the attempt's task; so does a ``backoff`` that returns no delay (None,
        NaN; a ``timedelta`` is taken as its seconds)."""
        retry = self._retry
        assert retry is not None
        step = "can_retry"
        try:
            if not retry.can_retry(handler.attempts):
                return False
            step = f"retry_on_{outcome}"
            again = (
                retry.should_retry_exception(value)
                if outcome == "exception"
                else retry.should_retry_result(value)
            )
            step = "backoff"
            delay = retry.backoff(handler.attempts) if again else 0.0
        except Exception as exc:
            self._decide_failure(handler, self._strategy_error(handler, outcome, step, exc))
            return True
        if again:
            seconds = as_seconds(delay)  # a timedelta too, as the strategy's own delays
            if seconds is None or math.isnan(seconds):
                # A subclass's backoff() that returned no delay: failed now, not lost in the
                # attempt's task (or in the timers) until the deadline decides the element.
                self._decide_failure(handler, self._bad_backoff(handler, outcome, delay))
                return True
            delay = seconds
            timed = cast(_TimedElement, handler)  # retry needs a timeout
            if outcome == "result":
                timed.last_error, timed.rejected = None, True  # a timeout error reports it
            self._schedule_retry(timed, delay)
        return bool(again)

    def _strategy_error(
        self, handler: _Element, outcome: str, step: str, error: Exception
    ) -> ElementFailedError:
        """The error of an element whose retry strategy raised at ``step``, deciding on the
        attempt's ``outcome``."""
        what, advice = (
            (
                f"The retry predicate {step} raised on the attempt's {outcome}",
                f"Fix the predicate: it must return True or False for every {outcome} the "
                "function can produce.",
            )
            if step.startswith("retry_on_")
            else (
                f"The retry strategy's {step}() raised after the attempt's {outcome}",
                f"Fix {type(self._retry).__name__}.{step}: it must return a "
                + ("bool" if step == "can_retry" else "number of seconds")
                + " for every attempt count.",
            )
        )
        return element_error(
            ElementFailedError, what, handler.element, handler.attempts, advice, cause=error
        )

    def _bad_backoff(self, handler: _Element, outcome: str, delay: Any) -> ElementFailedError:
        name = type(self._retry).__name__
        return element_error(
            ElementFailedError,
            f"The retry strategy's backoff() returned {describe(delay)} after the attempt's "
            f"{outcome}",
            handler.element,
            handler.attempts,
            f"Fix {name}.backoff: it must return a number of seconds (or a timedelta) for every "
            "attempt count.",
        )

    def _schedule_retry(self, handler: _TimedElement, delay: float) -> None:
        handler.retry_due = when = self._clock.now() + delay
        # Armed even when it ends past the deadline: the timeout timer, registered first,
        # fires first (ties included), decides the element and cancels this one.
        handler.backing_off = True
        self._timers.register((handler, _RETRY), when, partial(self._on_retry_timer, handler))

    def _on_retry_timer(self, handler: _TimedElement) -> None:
        handler.backing_off = False
        if handler.decided:
            return
        if handler.deadline is not None and self._clock.now() >= handler.deadline:
            return  # never start an attempt at or past the deadline; the timeout decides
        handler.retry_due = None
        self.metrics.retries += 1
        self._start_attempt(handler)

    def _on_timer_error(self, error: BaseException) -> None:
        """A timeout or retry callback raised (a bug: they handle user errors themselves).
        Fail the operator rather than leave its element undecided, which would hang
        finish(); the timer service keeps the other elements' timers running."""
        failure = OperatorStateError(
            f"A timeout or retry timer raised {type(error).__name__}: {error_text(error)}; the "
            "operator has failed. This is a bug in stateful-async: please report it with "
            "this traceback."
        )
        failure.__cause__ = error
        self._fail(failure)

    def _on_timeout(self, handler: _TimedElement) -> None:
        if handler.decided:
            return
        handler.timed_out = True
        self.metrics.timeouts += 1
        if handler.backing_off:
            handler.backing_off = False
            self._timers.cancel((handler, _RETRY))
        if not self._has_timeout_handler:
            self._decide_failure(handler, self._timeout_error(handler, None))
            return
        assert self._loop is not None
        task: asyncio.Future[Any]
        try:
            awaitable = self._fn.timeout(handler.element.value)  # type: ignore[union-attr]
            if not inspect.isawaitable(awaitable):
                # A handler that returned its results (or anything) without an awaitable:
                # it did not raise, as ensure_future's TypeError would have it reported.
                self._decide_failure(handler, self._not_awaitable(handler, awaitable, "timeout"))
                return
            task = asyncio.ensure_future(awaitable, loop=self._loop)
        except Exception as exc:
            task = self._loop.create_future()
            task.set_exception(exc)
        handler.timeout_task = task
        task.add_done_callback(partial(self._on_timeout_handler_done, handler))

    def _on_timeout_handler_done(self, handler: _TimedElement, task: asyncio.Future[Any]) -> None:
        if handler.decided:
            if not task.cancelled():
                task.exception()  # a later outcome, dropped silently: not logged by asyncio
            return
        handler.timeout_task = None
        error = (
            asyncio.CancelledError("The timeout handler was cancelled.")
            if task.cancelled()
            else task.exception()
        )
        if error is None:
            try:
                results = _as_results(
                    task.result(), handler.element, handler.attempts, "The timeout handler"
                )
            except InvalidResultError as exc:
                self._decide_failure(handler, exc)
                return
            except (KeyboardInterrupt, SystemExit) as exc:
                self._interrupted(handler, exc, "The timeout handler")
            except BaseException as exc:  # a generator of fallback results that raised
                error = exc
            else:
                self._decide(handler, results)
                return
        if isinstance(error, _PROGRAMMING_ERRORS):
            # Fallback results of the wrong shape, found by a wrapper's check (the Spark
            # task's, against the output schema): the handler returned, it did not raise.
            # As on the attempt's side, the error already names the element.
            self._decide_failure(handler, error)
            return
        if isinstance(error, _DefaultTimeout):
            self._decide_failure(handler, self._timeout_error(handler, None))
            return
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            # its task raised it out of the loop already: the loop runs again to get here
            self._interrupted(handler, error, "The timeout handler", stop=False)
            return
        self._decide_failure(
            handler,
            element_error(
                TimeoutHandlerError,
                f"The timeout handler raised after the {self._timeout:g} s timeout",
                handler.element,
                handler.attempts,
                "Timeout handler errors are not retried: return fallback results from "
                "timeout() instead of raising.",
                cause=error,
            ),
        )

    def _timeout_error(
        self, handler: _TimedElement, cause: BaseException | None
    ) -> ElementFailedError:
        """The element's deadline passed and no fallback decides it. Says whether an attempt
        was still running, or the element was waiting for a retry due past the deadline
        (after an exception, or a result rejected by ``retry_on_result``)."""
        timeout = self._timeout
        assert timeout is not None and handler.deadline is not None
        fallback = "or implement timeout() on the AsyncFunction to return a fallback result."
        if handler.rejected:
            last = "returned a result that retry_on_result rejected"
        elif handler.last_error is not None:
            last = f"failed with {describe(handler.last_error)}"
        else:
            last = ""
        if handler.retry_due is not None and last:
            due = handler.retry_due - (handler.deadline - timeout)
            if handler.retry_due >= handler.deadline:
                what = f"The next retry did not fit within the {timeout:g} s timeout"
                advice = (
                    f"The last attempt {last}, and its retry was due {due:g} s after the "
                    f"element's first call, past the {timeout:g} s timeout (no retry starts at "
                    f"or after the deadline). Use a longer timeout or a shorter backoff; "
                    f"{fallback}"
                )
            else:  # due in time, but its timer ran after the deadline's
                what = f"The next retry did not start within the {timeout:g} s timeout"
                advice = (
                    f"The last attempt {last}, and its retry was due {due:g} s after the "
                    "element's first call, within the timeout, but the event loop was busy "
                    "until after the deadline (no retry starts at or after it): keep "
                    "blocking work off the loop (ThreadPoolAsyncFunction), or use a longer "
                    f"timeout; {fallback}"
                )
        else:
            what = f"The element did not complete within the {timeout:g} s timeout"
            advice = f"Raise the timeout, {fallback}" + (
                f" The last attempt that ended {last}." if last else ""
            )
        return element_error(
            AsyncTimeoutError,
            what,
            handler.element,
            handler.attempts,
            advice,
            cause=cause or handler.last_error,
        )

    # -- outcomes and emission ----------------------------------------------------------

    def _release(self, handler: _Element) -> None:
        """The element is decided: cancel its timers and its other running calls."""
        handler.decided = True
        if self._limited:
            self._call_ended()
        if self._timeout is None:
            return  # no timers, no timeout handler; the attempt that decided has finished
        timed = cast(_TimedElement, handler)
        self._timers.cancel((timed, _TIMEOUT))
        if timed.backing_off:
            timed.backing_off = False
            self._timers.cancel((timed, _RETRY))
        for task in (timed.task, timed.timeout_task):
            if task is not None and not task.done():
                task.cancel()
                self._cancelled.add(task)
                task.add_done_callback(self._cancelled.discard)
        timed.task = timed.timeout_task = None

    def _decide(self, handler: _Element, results: list[Any]) -> None:
        self._release(handler)
        self._queue.complete(handler, results)
        self._output_completed()

    def _decide_failure(self, handler: _Element, error: StatefulAsyncError) -> None:
        # Failed first: the call slot _release frees must not start a waiting element.
        self._fail(error)
        self._release(handler)

    def _fail(self, error: StatefulAsyncError) -> None:
        if self._failure is not None:
            return
        self._failure = error
        if self._state is not _State.CLOSED:
            self._set_state(_State.FAILED)
        self._timers.cancel_all()
        self._cancel_in_flight()
        self._wake_waiters(error)

    def _output_completed(self) -> None:
        """Emit one completed queue entry; if more are ready, post a mail for the next."""
        if self._failure is not None or self._state is _State.CLOSED:
            return  # a closed operator discards what it still holds (see close())
        entry = self._queue.poll()
        if entry is not None:
            self._emit(entry)

    def _emit(self, entry: QueueEntry) -> None:
        """Emit ``entry``, just polled from the queue; if more are ready, post a mail."""
        queue = self._queue
        element = entry.element
        output = self._output
        if self._timeout is None:
            # Spare from here on (see _reuse_entry): reads below use locals only, so even an
            # output that re-enters process_element may reuse it, and entries in flight plus
            # spare stay within capacity.
            self._spare.append(entry)  # type: ignore[arg-type]
        try:
            if type(element) is Watermark:
                output(element)
                self.metrics.watermarks_out += 1
            else:
                timestamp = element.timestamp
                results = entry.results
                for result in results:  # type: ignore[union-attr]
                    # StreamRecord(result, timestamp) without the __init__ call: one per result
                    record = _new_record(StreamRecord)
                    record.value = result
                    record.timestamp = timestamp
                    output(record)
                self.metrics.results_out += len(results)  # type: ignore[arg-type]
        except BaseException as exc:
            # Any exception, CancelledError included: the entry is already polled, so an
            # operator left running would wait forever for it in finish().
            emitting = (
                describe(element)
                if type(element) is Watermark
                else f"a result of element {describe(element)}"
            )
            error = OperatorStateError(
                f"The operator's output raised {type(exc).__name__}: {error_text(exc)} while "
                f"emitting {emitting}; the operator has failed. Fix the output callable: it "
                "must accept every emitted StreamRecord and Watermark without raising."
            )
            error.__cause__ = exc
            self._fail(error)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                _stop_loop(exc)
            return
        waiter = self._capacity_waiter
        if waiter is not None and not waiter.done():
            # Cleared by the waiting call when it resumes, not here: until then a second
            # call must still find it and be refused (calls are awaited one at a time).
            waiter.set_result(None)
        if self._drain_waiter is not None:
            waiter = self._drain_waiter
            if not len(queue) and not waiter.done():
                waiter.set_result(None)
        if queue.completed and not self._emit_scheduled and queue.has_completed():
            self._emit_scheduled = True
            self._post_emit(self._emit_mail)

    def _emit_mail(self) -> None:
        self._emit_scheduled = False
        self._output_completed()

    # -- helpers ------------------------------------------------------------------------

    @staticmethod
    def _overtaking(call: str = "process_element()/process_watermark()") -> OperatorStateError:
        """A call made while an earlier one still waits for room: refused, since it would
        take the room first and reorder the input (or, ``finish()``, drop it)."""
        return OperatorStateError(
            f"{call} was called while a process_element()/process_watermark() call was "
            "still waiting for queue capacity (or was never awaited); await each call "
            "before the next."
        )

    def _register_capacity_waiter(self) -> asyncio.Future[None]:
        if self._capacity_waiter is not None:
            raise self._overtaking()
        assert self._loop is not None
        waiter = self._capacity_waiter = self._loop.create_future()
        return waiter

    async def _await_capacity(self, waiter: asyncio.Future[None]) -> None:
        try:
            await waiter
        finally:
            self._capacity_waiter = None
        self._check_accepting("process_element()")

    async def _wait_for_capacity(self) -> None:
        await self._await_capacity(self._register_capacity_waiter())

    def _wake_waiters(self, error: BaseException) -> None:
        for waiter in (self._capacity_waiter, self._drain_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_exception(error)

    def _cancel_in_flight(self) -> list[asyncio.Future[Any]]:
        tasks = []
        for entry in self._queue.entries():
            handler: _Element = entry  # type: ignore[assignment]
            handler.decided = True
            for task in (handler.task, handler.timeout_task):
                if task is not None and not task.done():
                    task.cancel()
                    tasks.append(task)
        return tasks

    def _check_thread(self, what: str) -> None:
        if self._mailbox is not None:
            self._mailbox.check_thread(what)

    def _check_accepting(self, what: str) -> None:
        if self._failure is not None:
            raise self._failure
        if self._state is not _State.OPEN:
            hint = {
                _State.CREATED: "call 'await open()' first",
                _State.FINISHING: "finish() has been called; no more input is accepted",
                _State.FINISHED: "finish() has been called; no more input is accepted",
                _State.CLOSED: "it was closed",
                _State.FAILED: "its function's open() raised",
            }.get(self._state, "")
            raise OperatorStateError(
                f"{what} was called on an operator that is {self._state.value}: {hint}."
            )
        if not self._fn_opened:
            raise OperatorStateError(
                f"{what} was called while open() was still awaiting the function's open(): a "
                "call would reach a function that is not open yet. Await open() first."
            )
        self._check_thread(what)


def _check_mode(mode: OutputMode | str) -> OutputMode:
    if isinstance(mode, OutputMode):
        return mode
    try:
        return OutputMode(str(mode).lower())
    except ValueError:
        raise ConfigurationError(
            f"mode must be OutputMode.ORDERED or OutputMode.UNORDERED; got {mode!r}."
        ) from None


def check_capacity_and_timeout(
    capacity: int,
    timeout: float | datetime.timedelta | None,
    retry: Any,
    max_in_flight: int | None = None,
) -> tuple[int, int | None, float | None]:
    """Validate operator options without running an operator (the Spark adapter checks
    them on the driver, before a job starts); return them as the operator keeps them:
    capacity and max_in_flight as plain ints, the timeout in seconds."""
    operator = AsyncWaitOperator(
        _noop_function,
        _discard,
        OutputMode.ORDERED,
        capacity,
        timeout,
        retry,
        max_in_flight=max_in_flight,
    )
    limit = None if max_in_flight is None else operator._max_in_flight
    return operator.capacity, limit, operator._timeout


async def _noop_function(value: Any) -> Sequence[Any]:
    return ()


def _discard(element: StreamElement) -> None:
    return None


def _stop_loop(exc: KeyboardInterrupt | SystemExit) -> NoReturn:
    """Raise ``exc``, which stops the loop, as asyncio lets these two do. Raised in a call's
    task (an attempt, or an output it emits to), which nobody awaits, asyncio also keeps it
    as the task's exception and, once the task is collected, logs it a second time as "Task
    exception was never retrieved": the task's exception is taken once it is done (when
    the loop runs again, as ``asyncio.run`` does to cancel what is left)."""
    task = asyncio.current_task()  # None in a mail: the loop just raises it
    if task is not None:
        task.add_done_callback(_take_exception)
    raise exc


def _forget_function(key: int, owner: weakref.ref[Any]) -> None:
    """An operator that had its function open was collected without being closed: the
    function is no longer its (``_open_functions``)."""
    if _open_functions.get(key) is owner:
        del _open_functions[key]


def _take_exception(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _not_open(coro: Any) -> asyncio.Future[Any]:
    coro.close()
    raise OperatorStateError("The operator started a call before open(); this is a bug.")
