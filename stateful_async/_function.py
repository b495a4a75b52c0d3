"""The user's side of the operator: ``AsyncFunction`` and its adapters."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Generic, Iterable, TypeVar, Union

from ._exceptions import ConfigurationError, as_int

IN = TypeVar("IN")
OUT = TypeVar("OUT")


class AsyncFunction(Generic[IN, OUT]):
    """An asynchronous function applied to every record: Flink's ``AsyncFunction``.

    Subclass it and implement ``async_invoke``. ``open`` and ``close`` run once per
    operator, on the event loop: create clients (an ``aiohttp.ClientSession``, a database
    pool) in ``open``, not in ``__init__``, so the function can be pickled and shipped to
    Spark executors (each task gets its own copy, as each Flink operator instance does).
    An instance with an ``open`` or ``close`` of its own runs in one operator at a time: a
    second operator opening it before the first is closed is refused
    (``ConfigurationError``); give each operator its own instance.

    ``timeout`` is called when an element misses its deadline. Its results are emitted in
    place of the element's; if it raises, the operator fails (it is never retried). The
    default raises, which fails the operator with ``AsyncTimeoutError``.
    """

    async def open(self) -> None:
        """Acquire clients. Called once before the first element. If it raises, the
        operator takes no input and ``close`` is not called (as with ``async with``):
        release what was acquired before raising."""

    async def close(self) -> None:
        """Release clients. Called once when the operator closes; closing the operator
        from here (``await operator.close()``) returns at once."""

    async def async_invoke(self, value: IN) -> Iterable[OUT]:
        """Return the results for ``value`` (an iterable; empty to emit nothing)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement 'async def async_invoke(self, value)'."
        )

    async def timeout(self, value: IN) -> Iterable[OUT]:
        """Return fallback results for ``value``, whose deadline has passed; or raise.

        Nothing bounds this call (as in Flink): a handler that never returns holds its
        element, and ``finish()`` (a Spark task's end) waits for it. A fallback that calls
        something slow should bound itself, e.g. with ``asyncio.wait_for``; what it raises
        fails the operator with a ``TimeoutHandlerError`` naming the element.
        """
        raise _DefaultTimeout()


# open() and close() that hold no clients: AsyncFunction's own, and those that a class
# declares so with ``holds_no_clients`` (the testing helpers', which only count calls)
_CLIENTLESS: set[Any] = {AsyncFunction.open, AsyncFunction.close}


def holds_no_clients(cls: type[AsyncFunction[Any, Any]]) -> None:
    """Declare the ``open`` and ``close`` of ``cls`` (not those of a subclass that overrides
    them) to hold no clients, so that its instances may serve several operators at once."""
    _CLIENTLESS.update((cls.open, cls.close))


def has_lifecycle(fn: AsyncFunction[Any, Any]) -> bool:
    """Whether ``fn`` has an ``open`` or ``close`` of its own: clients that one operator
    opens and closes, which a second operator must not share."""
    cls = type(fn)
    return cls.open not in _CLIENTLESS or cls.close not in _CLIENTLESS


def already_open(fn: AsyncFunction[Any, Any], by: str) -> ConfigurationError:
    """The refusal to open ``fn``, already open ``by`` another operator (or a call)."""
    name = type(fn).__qualname__
    if isinstance(fn, ThreadPoolAsyncFunction):
        name, closing = f"{name} ({fn._name()})", "shutting its thread pool down"
    else:
        closing = "the first one's close() would release the clients the other still uses"
    return ConfigurationError(
        f"This {name} is already open ({by}): an instance runs in one operator at a time, "
        f"which opens it and closes it ({closing}). Give each operator its own "
        f"{type(fn).__qualname__}(...), or close the first operator before opening the next."
    )


class _DefaultTimeout(Exception):
    """Raised by the default ``AsyncFunction.timeout``; the operator turns it into an
    ``AsyncTimeoutError`` that names the element."""


def has_timeout_handler(fn: AsyncFunction[Any, Any]) -> bool:
    """Whether ``fn`` has a ``timeout`` of its own: its class's, or one set on the instance
    (``fn.timeout = fallback``), which the operator calls as it would a method. An instance
    attribute that is not callable (``self.timeout = 5.0``, a client's own setting) is no
    handler: the class's ``timeout`` decides, as before instance handlers counted."""
    handler = getattr(fn, "timeout", None)
    if not callable(handler):
        handler = getattr(type(fn), "timeout", None)
    return getattr(handler, "__func__", handler) is not AsyncFunction.timeout


class CoroutineFunction(AsyncFunction[IN, OUT]):
    """Adapts a plain ``async def f(value) -> Iterable[OUT]`` to ``AsyncFunction``."""

    def __init__(self, fn: Callable[[IN], Awaitable[Iterable[OUT]]]) -> None:
        self.fn = fn

    def async_invoke(self, value: IN) -> Awaitable[Iterable[OUT]]:  # type: ignore[override]
        # Returns the coroutine itself: no extra frame per element.
        return self.fn(value)

    def __repr__(self) -> str:
        return f"CoroutineFunction({getattr(self.fn, '__qualname__', self.fn)!r})"


AsyncFunctionLike = Union[AsyncFunction[IN, OUT], Callable[[IN], Awaitable[Iterable[OUT]]]]


def as_async_function(fn: Any) -> AsyncFunction[Any, Any]:
    """Accept an ``AsyncFunction`` or an ``async def``; anything else is a clear error."""
    if isinstance(fn, AsyncFunction):
        if type(fn).async_invoke is AsyncFunction.async_invoke:
            raise ConfigurationError(
                f"{type(fn).__name__} subclasses AsyncFunction but does not implement "
                "'async def async_invoke(self, value)'."
            )
        if not isinstance(fn, CoroutineFunction):
            for name in ("async_invoke", "timeout", "open", "close"):
                _check_async_method(fn, name)
        return fn
    if isinstance(fn, type) and issubclass(fn, AsyncFunction):
        raise ConfigurationError(
            f"{fn.__qualname__} is an AsyncFunction class; pass an instance of it: "
            f"{fn.__qualname__}(...)."
        )
    if inspect.isasyncgenfunction(fn) or (
        callable(fn) and inspect.isasyncgenfunction(type(fn).__call__)
    ):
        raise ConfigurationError(
            f"{getattr(fn, '__qualname__', fn)!r} is an async generator (it yields), but the "
            "operator awaits one list of results per value: write 'async def' that returns "
            "a list ([] to emit nothing)."
        )
    if is_coroutine_callable(fn):
        return CoroutineFunction(fn)
    if callable(fn):
        raise ConfigurationError(
            f"{getattr(fn, '__qualname__', fn)!r} is a regular function, but the operator needs "
            "an async one. Write it as 'async def', subclass AsyncFunction, or wrap a "
            "synchronous client with ThreadPoolAsyncFunction(fn, max_workers=...)."
        )
    raise ConfigurationError(
        f"Expected an AsyncFunction or an async def function; got {type(fn).__name__}."
    )


def is_coroutine_callable(fn: Any) -> bool:
    """Whether calling ``fn`` gives a coroutine: an ``async def``, or an object whose
    ``__call__`` is one."""
    return _is_async(fn) or (callable(fn) and _is_async(type(fn).__call__))


def _is_async(fn: Any) -> bool:
    """An ``async def``, also under decorators that kept it as ``__wrapped__``
    (``functools.wraps``), whose plain ``def`` wrapper returns the coroutine: a wrapper
    that does not is refused at its first call (the operator checks what it awaits)."""
    if inspect.iscoroutinefunction(fn):
        return True
    try:
        return inspect.iscoroutinefunction(inspect.unwrap(fn))
    except ValueError:  # a __wrapped__ cycle
        return False


def _check_async_method(fn: AsyncFunction[Any, Any], name: str) -> None:
    """A method the operator awaits must be an ``async def`` (a plain ``def`` fails every
    call with "can't be used in 'await' expression", which would be retried as a service
    error; an async generator never returns a list)."""
    method = getattr(type(fn), name)
    if getattr(AsyncFunction, name) is method or not inspect.isfunction(method):
        return  # inherited, or not a plain function (a callable object): trusted
    if inspect.isasyncgenfunction(method):
        problem = "is an async generator (it yields)"
    elif not _is_async(method):
        problem = "is a plain 'def'"
    else:
        return
    raise ConfigurationError(
        f"{type(fn).__name__}.{name} {problem}, but the operator awaits it: declare it "
        f"'async def {name}(self{', value' if name in ('async_invoke', 'timeout') else ''})'"
        + (" returning a list of results." if name in ("async_invoke", "timeout") else ".")
    )


class ThreadPoolAsyncFunction(AsyncFunction[IN, OUT]):
    """Runs a synchronous (blocking) client call in a bounded thread pool.

    Pass the call as ``fn``, or subclass and override ``invoke``. The call runs on a pool
    thread; its outcome comes back to the event loop as a mail
    (``loop.call_soon_threadsafe``), so the operator's state is only ever touched on the
    loop thread. At most ``max_workers`` calls run at once; more wait in the pool's queue
    (their timeout clock is already running: size the pool to the operator's calls in
    flight, ``max_in_flight``, which is ``capacity`` unless set). The pool is the
    instance's own, opened and shut down by its operator: give each operator its own
    instance (a second operator opening one that is open is refused).

    A timeout decides the element but cannot stop its thread: a call that never returns
    keeps its thread (and pool slot), and ``close()`` does not wait for it; but the pool's
    threads are not daemons, so the interpreter waits for it at exit (``concurrent.futures``
    joins them) and a script whose call hangs never ends (a Spark Python worker forked by
    PySpark's daemon, the default outside Windows, leaves with ``os._exit`` and does). Give
    blocking clients their own socket timeouts.
    """

    def __init__(
        self, fn: Callable[[IN], Iterable[OUT]] | None = None, *, max_workers: int = 16
    ) -> None:
        workers = as_int(max_workers)  # numpy's integers too
        if workers is None or workers < 1:
            raise ConfigurationError(
                f"ThreadPoolAsyncFunction max_workers must be an integer >= 1; got {max_workers!r}."
            )
        max_workers = workers
        if fn is not None and not callable(fn):
            raise ConfigurationError(
                f"ThreadPoolAsyncFunction needs a callable; got {type(fn).__name__}."
            )
        if fn is not None and is_coroutine_callable(fn):  # decorated (__wrapped__) too
            raise ConfigurationError(
                f"ThreadPoolAsyncFunction runs blocking functions on threads; "
                f"{getattr(fn, '__qualname__', type(fn).__name__)} is an async function: pass "
                "it to the operator (or ordered_wait / unordered_wait) directly."
            )
        if fn is not None and (
            inspect.isasyncgenfunction(fn) or inspect.isasyncgenfunction(type(fn).__call__)
        ):
            raise ConfigurationError(
                f"ThreadPoolAsyncFunction runs blocking functions on threads; "
                f"{getattr(fn, '__qualname__', type(fn).__name__)} is an async generator (it "
                "yields): write a plain 'def' that returns a list of results."
            )
        if fn is None and type(self).invoke is ThreadPoolAsyncFunction.invoke:
            raise ConfigurationError(
                "ThreadPoolAsyncFunction needs a synchronous function: pass fn=..., or subclass "
                "it and override 'def invoke(self, value)'."
            )
        self.fn = fn
        self.max_workers = max_workers
        self._pool: ThreadPoolExecutor | None = None

    @property
    def __wrapped__(self) -> Callable[[IN], Iterable[OUT]] | None:
        """The function it runs (what checkpoints name the enrichment after); None for a
        subclass with its own ``invoke``."""
        return self.fn if type(self).invoke is ThreadPoolAsyncFunction.invoke else None

    def invoke(self, value: IN) -> Iterable[OUT]:
        """The synchronous call; runs on a pool thread."""
        assert self.fn is not None
        return self.fn(value)

    async def open(self) -> None:
        if self._pool is not None:
            # A second operator would share the pool, and the first one's close() would
            # shut it down under the second's calls (those waiting in it never answered).
            raise already_open(self, "by another operator, or a call to its open()")
        self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="async-fn")

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def async_invoke(self, value: IN) -> Iterable[OUT]:
        pool = self._pool
        if pool is None:
            raise RuntimeError(
                f"ThreadPoolAsyncFunction ({self._name()}) was invoked while it is not open "
                "(before open() or after close()); the operator opens it and closes it."
            )
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Iterable[OUT]] = loop.create_future()

        def run() -> None:
            results: Any = None
            error: BaseException | None = None
            try:
                results = _listed(self.invoke(value))
            except BaseException as exc:  # delivered to the loop, never lost in the pool
                error = exc
            try:
                loop.call_soon_threadsafe(_settle, future, results, error)
            except RuntimeError:
                pass  # the loop has closed: the operator is gone and nobody awaits this

        call = pool.submit(run)
        try:
            return await future
        except asyncio.CancelledError:
            # The element was decided (its timeout, another attempt) or the operator closed:
            # a call still waiting in the pool's queue is not made at all.
            call.cancel()
            raise

    def _name(self) -> str:
        """What errors call it: its function's name, or its subclass's."""
        return str(getattr(self.__wrapped__, "__qualname__", None) or type(self).__qualname__)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None
        return state


def not_a_result_list(results: Any) -> bool:
    """Whether a function's return value is one that ``list()`` would take but that is not
    a collection of results (None, a str split into characters, bytes or a bytearray into
    integers, a dict or any other mapping into its keys, a pandas or polars DataFrame into
    its column labels)."""
    return (
        results is None
        or isinstance(results, (str, bytes, bytearray, memoryview, Mapping))
        or is_data_frame(results)
    )


def is_data_frame(value: Any) -> bool:
    """Whether ``value`` is a pandas or polars DataFrame (without importing either)."""
    module = type(value).__module__
    return type(value).__name__ == "DataFrame" and module.split(".")[0] in ("pandas", "polars")


def _listed(results: Any) -> Any:
    """A synchronous call's results as a list, made on the pool thread (a generator of
    results may block). A value that is not an iterable of results (None, a str, a dict,
    a number) is passed on as it is, for the operator to refuse with the same error as an
    async function's, instead of being split into characters or keys."""
    if type(results) is list or not_a_result_list(results) or not isinstance(results, Iterable):
        return results
    return list(results)


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    """The mail a pool thread posts: runs on the loop thread."""
    if future.done():  # cancelled meanwhile: the outcome is dropped
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
