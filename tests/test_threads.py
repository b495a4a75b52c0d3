"""Completions from foreign threads arrive as mails; operator state stays on the loop thread."""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import time

import pytest

from stateful_async import (
    AsyncWaitOperator,
    ConfigurationError,
    InvalidResultError,
    OperatorStateError,
    OutputMode,
    RetryStrategy,
    StreamRecord,
    ThreadPoolAsyncFunction,
    VirtualClock,
)
from stateful_async.testing import settle


@pytest.mark.parametrize("mode", [OutputMode.ORDERED, OutputMode.UNORDERED])
async def test_thread_pool_completions_touch_operator_state_only_on_the_loop_thread(
    mode: OutputMode,
) -> None:
    loop_thread = threading.get_ident()
    call_threads: set[int] = set()
    state_threads: list[tuple[str, int]] = []

    def blocking_lookup(value: int) -> list[int]:
        call_threads.add(threading.get_ident())
        time.sleep(random.random() * 0.002)  # a blocking client call
        return [value * 10]

    out: list = []
    op = AsyncWaitOperator(
        ThreadPoolAsyncFunction(blocking_lookup, max_workers=8), out.append, mode, capacity=16
    )
    # Record the thread of every operation that changes operator state.
    queue = op._queue
    nested: list[str] = []
    for name in ("try_put", "complete", "poll", "complete_and_poll"):
        original = getattr(queue, name)

        def traced(*args, _original=original, _name=name):
            outer = not nested
            nested.append(_name)  # complete_and_poll may call complete and poll: count once
            try:
                result = _original(*args)
            finally:
                nested.pop()
            if not outer:
                return result
            thread = threading.get_ident()
            if _name == "complete_and_poll":  # the operator's fast path: both in one call
                state_threads.append(("complete", thread))
                _name = "poll"
            if _name != "poll" or result is not None:  # count entries actually emitted
                state_threads.append((_name, thread))
            return result

        setattr(queue, name, traced)

    async with op:
        for i in range(300):
            await op.process_element(StreamRecord(i))
        await op.finish()

    assert loop_thread not in call_threads  # the client ran on pool threads
    assert len(call_threads) > 1
    counts = {name: sum(1 for n, _ in state_threads if n == name) for name in ("complete", "poll")}
    assert counts == {"complete": 300, "poll": 300}  # every completion and emission...
    assert {thread for _, thread in state_threads} == {loop_thread}  # ...ran on the loop thread
    results = [e.value for e in out]
    if mode is OutputMode.ORDERED:
        assert results == [i * 10 for i in range(300)]
    else:
        assert sorted(results) == [i * 10 for i in range(300)]


async def test_thread_pool_exceptions_reach_the_operator() -> None:
    def broken(value):
        raise KeyError(value)

    op = AsyncWaitOperator(ThreadPoolAsyncFunction(broken, max_workers=2), lambda e: None)
    await op.open()
    await op.process_element(StreamRecord("k"))
    with pytest.raises(Exception, match="KeyError: 'k'"):
        await op.finish()
    await op.close()


async def test_thread_pool_subclass_overrides_invoke() -> None:
    class Upper(ThreadPoolAsyncFunction):
        def invoke(self, value):
            return [value.upper()]

    out: list = []
    async with AsyncWaitOperator(Upper(max_workers=2), out.append) as op:
        await op.process_element(StreamRecord("x"))
        await op.finish()
    assert [e.value for e in out] == ["X"]


def test_thread_pool_function_needs_a_function() -> None:
    with pytest.raises(ConfigurationError, match="pass fn=..., or subclass"):
        ThreadPoolAsyncFunction()
    with pytest.raises(ConfigurationError, match="max_workers must be an integer >= 1"):
        ThreadPoolAsyncFunction(len, max_workers=0)
    with pytest.raises(ConfigurationError, match="max_workers must be an integer >= 1"):
        ThreadPoolAsyncFunction(len, max_workers=True)


def test_an_async_function_is_refused_and_told_to_go_to_the_operator() -> None:
    async def lookup(value: int) -> list[int]:
        return [value]

    class Lookup:
        async def __call__(self, value: int) -> list[int]:
            return [value]

    for fn in (lookup, Lookup()):
        # It used to be accepted, then each call failed: a coroutine is not a result list.
        with pytest.raises(ConfigurationError, match="is an async function: pass it to the"):
            ThreadPoolAsyncFunction(fn)


def test_a_decorated_async_function_or_an_async_generator_is_refused_too() -> None:
    # Both were accepted, then every call failed: the decorated one with "returned coroutine
    # ..., an awaitable ... Did you forget `await`?", the generator with "returned
    # async_generator, which is not iterable".
    import functools

    def logged(fn):  # type: ignore[no-untyped-def]
        @functools.wraps(fn)
        def wrapper(*args):  # type: ignore[no-untyped-def]
            return fn(*args)

        return wrapper

    @logged
    async def lookup(value: int) -> list[int]:
        return [value]

    async def stream(value: int):  # type: ignore[no-untyped-def]
        yield value

    with pytest.raises(
        ConfigurationError,
        match=r"; .*lookup is an async function: pass it to the operator \(or ordered_wait",
    ):
        ThreadPoolAsyncFunction(lookup)
    with pytest.raises(
        ConfigurationError,
        match=r"; .*stream is an async generator \(it yields\): write a plain 'def' that "
        r"returns a list of results\.$",
    ):
        ThreadPoolAsyncFunction(stream)


async def test_operator_methods_refuse_foreign_threads() -> None:
    async def identity(value):
        return [value]

    op = AsyncWaitOperator(identity, lambda e: None)
    await op.open()
    errors: list[BaseException] = []

    def from_another_thread() -> None:
        try:
            op.snapshot_state(1)
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=from_another_thread)
    worker.start()
    await asyncio.get_running_loop().run_in_executor(None, worker.join)
    assert len(errors) == 1
    assert isinstance(errors[0], OperatorStateError)
    assert "belongs to its event-loop thread" in str(errors[0])
    await op.close()


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ("abc", "returned str instead of an iterable of results"),
        ({"k": 1}, "returned dict instead of an iterable of results"),
        (None, "returned NoneType instead of an iterable of results"),
        (7, "returned int, which is not iterable"),
    ],
)
async def test_thread_pool_results_of_the_wrong_shape_are_refused_like_async_ones(
    returned, message
) -> None:
    # Not split into characters or keys on the pool thread, and None is not a "failure"
    # that is retried: the same InvalidResultError an async def gets.
    calls = []

    def lookup(value):
        calls.append(value)
        return returned

    out: list = []
    op = AsyncWaitOperator(
        ThreadPoolAsyncFunction(lookup, max_workers=2),
        out.append,
        timeout=10,
        retry=RetryStrategy.fixed_delay(3, 0),
    )
    await op.open()
    await op.process_element(StreamRecord("x"))
    with pytest.raises(InvalidResultError, match=message):
        await asyncio.wait_for(op.finish(), 5.0)
    assert out == [] and calls == ["x"]
    await op.close()


async def test_thread_pool_results_may_be_any_iterable_made_on_the_pool_thread() -> None:
    threads = []

    def lookup(value):
        def results():
            threads.append(threading.get_ident())
            yield value
            yield value * 2

        return results()

    out: list = []
    async with AsyncWaitOperator(ThreadPoolAsyncFunction(lookup, max_workers=1), out.append) as op:
        await op.process_element(StreamRecord(3))
        await op.finish()
    assert [e.value for e in out] == [3, 6]
    assert threads and threads[0] != threading.get_ident()


async def test_thread_pool_calls_of_decided_elements_are_not_made() -> None:
    # One worker, held by a slow call: the elements queued behind it reach their deadline
    # and take their fallback. Their calls, still in the pool's queue, must not be made later
    # (a request nobody waits for, and a worker held from live elements).
    release = threading.Event()
    made: list[str] = []

    class Lookup(ThreadPoolAsyncFunction):
        def invoke(self, value):
            made.append(value)
            if value == "slow":
                release.wait(10)
            return [value]

        async def timeout(self, value):
            return [f"fallback {value}"]

    out: list = []
    clock = VirtualClock()  # a loaded machine must not move the deadlines under the test
    op = AsyncWaitOperator(
        Lookup(max_workers=1), out.append, OutputMode.UNORDERED, timeout=0.3, clock=clock
    )
    await op.open()
    for value in ("slow", "q1", "q2"):
        await op.process_element(StreamRecord(value))
    await settle()
    await clock.advance(0.3)  # every deadline passed: all three decided by the fallback
    await settle()  # ... and the calls of q1 and q2, still queued in the pool, cancelled
    assert sorted(e.value for e in out) == ["fallback q1", "fallback q2", "fallback slow"]
    release.set()
    await op.process_element(StreamRecord("live"))
    await op.finish()
    await op.close()
    assert "live" in [e.value for e in out]
    assert made == ["slow", "live"]


async def test_a_thread_pool_function_open_in_one_operator_is_refused_by_another() -> None:
    # The second operator's open() replaced the first one's pool with its own; the first
    # operator's close() then shut that pool down under the second's calls: those waiting
    # in it were never answered, and its finish() hung.
    def lookup(value: int) -> list[int]:
        time.sleep(0.05)
        return [value]

    fn = ThreadPoolAsyncFunction(lookup, max_workers=1)
    first = AsyncWaitOperator(fn, lambda e: None)
    second = AsyncWaitOperator(fn, lambda e: None)
    await first.open()
    with pytest.raises(
        ConfigurationError,
        match=r"ThreadPoolAsyncFunction \(test_a_thread_pool.*lookup\) is already open \(by "
        r"another operator.*Give each operator its own ThreadPoolAsyncFunction",
    ):
        await second.open()
    await second.close()
    out: list = []
    third = AsyncWaitOperator(fn, out.append)
    await first.close()  # once closed, the instance may serve another operator
    async with third:
        for value in range(3):
            await third.process_element(StreamRecord(value))
        await asyncio.wait_for(third.finish(), 5.0)
    assert [record.value for record in out] == [0, 1, 2]


@pytest.mark.parametrize("where", ["the blocking call", "the output"])
def test_a_keyboard_interrupt_in_a_call_stops_the_loop_and_is_not_logged_again(
    where: str,
) -> None:
    # The KeyboardInterrupt stopped asyncio.run, as it should, but the call's task kept it
    # as its exception, which nobody awaits: when the task was collected asyncio logged it
    # again, "Task exception was never retrieved", with its whole traceback.
    logged: list[str] = []

    def lookup(value: int) -> list[int]:
        if where == "the blocking call":
            raise KeyboardInterrupt
        return [value]

    def output(element: object) -> None:
        if where == "the output":
            raise KeyboardInterrupt

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: logged.append(context["message"])
        )
        async with AsyncWaitOperator(ThreadPoolAsyncFunction(lookup), output) as op:
            await op.process_element(StreamRecord(1))
            # the call's task raises, which stops the loop long before this sleep ends (not
            # finish(): the output would then be called in this task, not the call's)
            await asyncio.sleep(30)
            raise AssertionError("the call's task never stopped the loop")

    interrupted = False
    try:
        asyncio.run(main())
    except KeyboardInterrupt:  # not kept (pytest.raises would keep it, and the task with it)
        interrupted = True
    assert interrupted
    gc.collect()
    assert logged == []
