"""Timeouts and retries on a virtual clock: no test here sleeps on the wall clock."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import pickle
import random
import re
import time
import typing
import warnings
from datetime import timedelta

import pytest

from stateful_async import (
    AsyncFunction,
    AsyncFunctionError,
    AsyncTimeoutError,
    AsyncWaitOperator,
    ConfigurationError,
    ElementFailedError,
    OperatorStateError,
    OutputMode,
    RetryStrategy,
    StreamRecord,
    TimeoutHandlerError,
    VirtualClock,
)
from stateful_async._timers import SystemClock, TimerService
from stateful_async.chaos import CrashOnElement
from stateful_async.testing import ControlledFunction, ControlledTimeoutFunction, settle


class Flaky(Exception):
    pass


class Fatal(Exception):
    pass


def make(fn, clock, *, mode=OutputMode.ORDERED, capacity=10, timeout=None, retry=None):
    out: list = []
    op = AsyncWaitOperator(
        fn, out.append, mode, capacity=capacity, timeout=timeout, retry=retry, clock=clock
    )
    return out, op


async def timed_out_a(retry=None):  # type: ignore[no-untyped-def]
    """An operator (timeout 1) whose element "a" has just timed out: its attempt is still
    running, and so is the timeout handler, both waiting on the test. Returns (clock, fn,
    out, op)."""
    clock = VirtualClock()
    fn = ControlledTimeoutFunction()
    out, op = make(fn, clock, timeout=1, retry=retry)
    await op.open()
    await op.process_element(StreamRecord("a"))
    await clock.advance(1)
    return clock, fn, out, op


async def running_a(retry, timeout):  # type: ignore[no-untyped-def]
    """An operator whose element "a" is in its first attempt, waiting on the test. Returns
    (clock, fn, out, op)."""
    clock = VirtualClock()
    fn = ControlledFunction()
    out, op = make(fn, clock, timeout=timeout, retry=retry)
    await op.open()
    await op.process_element(StreamRecord("a"))
    await settle()
    return clock, fn, out, op


class Timed(AsyncFunction):
    """Records the virtual time of every attempt; fails while ``fail_until`` says so."""

    def __init__(self, clock: VirtualClock, fail_first: int = 10**9, result=None) -> None:
        self.clock = clock
        self.fail_first = fail_first
        self.result = result
        self.started: list[float] = []

    async def async_invoke(self, value):
        self.started.append(self.clock.now())
        if len(self.started) <= self.fail_first:
            raise Flaky(f"attempt {len(self.started)}")
        return [self.result if self.result is not None else value]


# -- timeouts ------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [5, timedelta(seconds=5)])
async def test_default_timeout_fails_the_operator_naming_the_element(timeout) -> None:
    clock = VirtualClock()
    fn = ControlledFunction()
    out, op = make(fn, clock, timeout=timeout)
    await op.open()
    await op.process_element(StreamRecord("slow"))
    await clock.advance(4.999)
    assert op.failure is None
    await clock.advance(0.001)
    with pytest.raises(AsyncTimeoutError) as info:
        await op.finish()
    assert "StreamRecord('slow')" in str(info.value)
    assert "within the 5 s timeout" in str(info.value)
    assert "implement timeout()" in str(info.value)
    assert fn.pending("slow") == 0  # the attempt was cancelled
    await op.close()


async def test_timeout_handler_results_replace_the_element_results() -> None:
    clock = VirtualClock()

    class Fallback(ControlledFunction):
        async def timeout(self, value):
            return [f"fallback-{value}"]

    fn = Fallback()
    out, op = make(fn, clock, timeout=2)
    await op.open()
    await op.process_element(StreamRecord("a"))
    await op.process_element(StreamRecord("b"))
    await settle()
    fn.complete("b", ["B"])
    await clock.advance(2)
    assert [e.value for e in out] == ["fallback-a", "B"]
    assert op.metrics.timeouts == 1
    await op.close()


async def test_the_timeout_clock_starts_when_the_element_enters_the_queue() -> None:
    clock = VirtualClock()
    fn = ControlledFunction()
    out, op = make(fn, clock, capacity=1, timeout=10)
    await op.open()
    await op.process_element(StreamRecord("a"))  # enters at t=0
    blocked = asyncio.ensure_future(op.process_element(StreamRecord("b")))
    await clock.advance(8)
    assert not blocked.done()
    fn.complete("a", ["A"])
    await settle()
    assert blocked.done()  # "b" entered at t=8: its deadline is t=18, not t=10
    await clock.advance(9.9)  # t=17.9
    assert op.failure is None
    await clock.advance(0.1)  # t=18
    assert isinstance(op.failure, AsyncTimeoutError)
    assert "StreamRecord('b')" in str(op.failure)
    await op.close()


async def test_a_result_arriving_while_the_timeout_handler_runs_wins() -> None:
    clock, fn, out, op = await timed_out_a()
    assert fn.timeout_calls == ["a"]  # the handler is running (waiting on the test)
    fn.complete("a", ["real"])  # the attempt finishes first: it wins
    await settle()
    assert [e.value for e in out] == ["real"]
    with pytest.raises(AssertionError, match="No timeout handler"):
        fn.complete_timeout("a", ["fallback"])  # the handler was cancelled: dropped
    await op.finish()
    assert [e.value for e in out] == ["real"]
    await op.close()


async def test_a_timeout_handler_finishing_first_wins_and_cancels_the_attempt() -> None:
    clock, fn, out, op = await timed_out_a()
    fn.complete_timeout("a", ["fallback"])
    await settle()
    assert [e.value for e in out] == ["fallback"]
    assert fn.pending("a") == 0  # the late attempt was cancelled
    await op.finish()
    await op.close()


async def test_a_failing_attempt_cannot_beat_a_running_timeout_handler() -> None:
    clock, fn, out, op = await timed_out_a()
    fn.fail("a", Fatal("late failure"))
    await settle()
    assert op.failure is None
    fn.complete_timeout("a", ["fallback"])
    await settle()
    assert [e.value for e in out] == ["fallback"]
    await op.close()


@pytest.mark.parametrize(("late", "emitted"), [([], ["fallback"]), (["A"], ["A"])])
async def test_a_late_result_that_retry_on_result_rejects_leaves_the_decision_to_the_handler(
    late: list, emitted: list
) -> None:
    # Like a late exception: a rejected result cannot be retried past the deadline, so the
    # running handler decides. It used to be emitted (here: nothing) and cancel the handler.
    # A result the predicate accepts still wins.
    retry = RetryStrategy.fixed_delay(5, 0.1, retry_on_result=lambda results: results == [])
    clock, fn, out, op = await timed_out_a(retry)
    fn.complete("a", late)
    await settle()
    if late == []:
        assert out == [] and op.failure is None
        fn.complete_timeout("a", ["fallback"])  # still running: it decides
        await settle()
    else:
        with pytest.raises(AssertionError, match="No timeout handler"):
            fn.complete_timeout("a", ["fallback"])  # cancelled: the result won
    await op.finish()
    assert [e.value for e in out] == emitted
    assert fn.calls == ["a"] and op.metrics.results_out == 1
    await op.close()


async def test_a_retry_predicate_that_raises_on_a_late_result_fails_the_element() -> None:
    def predicate(results):
        raise KeyError("status")

    clock, fn, out, op = await timed_out_a(
        RetryStrategy.fixed_delay(5, 0.1, retry_on_result=predicate)
    )
    fn.complete("a", ["A"])
    await settle()
    with pytest.raises(ElementFailedError, match="The retry predicate retry_on_result raised"):
        await asyncio.wait_for(op.finish(), 5)
    assert out == []
    await op.close()


async def test_a_timeout_handler_set_on_the_instance_gives_the_fallback() -> None:
    # Before, only a timeout defined on the class counted: one set on the instance was
    # ignored, and the element failed with AsyncTimeoutError.
    async def fallback(value):
        return [f"fallback {value}"]

    clock = VirtualClock()
    fn = ControlledFunction()
    fn.timeout = fallback  # type: ignore[method-assign]
    out, op = make(fn, clock, timeout=1)
    await op.open()
    await op.process_element(StreamRecord("a"))
    await clock.advance(1)
    await asyncio.wait_for(op.finish(), 5)
    assert [e.value for e in out] == ["fallback a"]
    assert op.metrics.timeouts == 1
    await op.close()


async def test_a_timeout_setting_on_the_instance_is_not_taken_for_a_handler() -> None:
    # A function keeping its client's timeout as self.timeout = 5.0 failed its late element
    # with "TimeoutHandlerError: The timeout handler raised ...: TypeError: 'float' object
    # is not callable", once instance handlers counted, instead of AsyncTimeoutError.
    class Fetch(ControlledFunction):
        def __init__(self) -> None:
            super().__init__()
            self.timeout = 5.0  # type: ignore[assignment]

    clock = VirtualClock()
    out, op = make(Fetch(), clock, timeout=1)
    await op.open()
    await op.process_element(StreamRecord("a"))
    await clock.advance(1)
    with pytest.raises(AsyncTimeoutError) as info:
        await asyncio.wait_for(op.finish(), 5)
    assert str(info.value).startswith(
        "The element did not complete within the 1 s timeout for element StreamRecord('a')"
    )
    assert out == []
    await op.close()


async def test_a_failing_timeout_handler_is_not_retried() -> None:
    clock, fn, out, op = await timed_out_a(RetryStrategy.fixed_delay(10, 0.1))
    fn.fail_timeout("a", Flaky("handler broke"))
    await clock.advance(10)
    assert fn.timeout_calls == ["a"]
    assert fn.calls == ["a"]
    assert isinstance(op.failure, TimeoutHandlerError)
    assert "handler broke" in str(op.failure)
    assert "not retried" in str(op.failure)
    await op.close()


async def test_completion_and_timeout_at_the_same_instant_give_one_outcome() -> None:
    clock = VirtualClock()

    class Fallback(ControlledFunction):
        async def timeout(self, value):
            return ["fallback"]

    fn = Fallback()
    out, op = make(fn, clock, timeout=1)
    await op.open()
    await op.process_element(StreamRecord("a"))
    await clock.advance(0.999)
    fn.complete("a", ["real"])  # completes, but its mail runs inside the next advance
    await clock.advance(0.001)
    await clock.advance(5)
    assert [e.value for e in out] == ["real"]
    assert op.metrics.results_out == 1
    await op.close()


# -- retries -------------------------------------------------------------------------------


async def test_a_timeout_handler_whose_results_raise_fails_the_operator() -> None:
    class Fallback(ControlledFunction):
        async def timeout(self, value):
            def broken():
                yield "fallback"
                raise ValueError("broken fallback")

            return broken()

    clock = VirtualClock()
    op = AsyncWaitOperator(Fallback(), lambda e: None, capacity=2, timeout=1.0, clock=clock)
    await op.open()
    await op.process_element(StreamRecord("x"))
    await clock.advance(1.0)
    with pytest.raises(TimeoutHandlerError, match="broken fallback"):
        await asyncio.wait_for(op.finish(), 5.0)  # failed, not stuck undecided
    await op.close()


async def test_a_cancelled_timeout_handler_is_reported_in_sentences_with_one_full_stop() -> None:
    # Before: "... CancelledError: The timeout handler was cancelled.. The timeout handler
    # ..." (the cause's sentence ended, and the advice added another full stop).
    class Fallback(ControlledFunction):
        async def timeout(self, value):
            raise asyncio.CancelledError

    clock = VirtualClock()
    op = AsyncWaitOperator(Fallback(), lambda e: None, capacity=2, timeout=1.0, clock=clock)
    await op.open()
    await op.process_element(StreamRecord("x"))
    await clock.advance(1.0)
    with pytest.raises(TimeoutHandlerError) as info:
        await asyncio.wait_for(op.finish(), 5.0)
    assert "CancelledError: The timeout handler was cancelled. " in str(info.value)
    assert ".." not in str(info.value)
    await op.close()


async def test_max_attempts_counts_total_attempts() -> None:
    clock = VirtualClock()
    fn = Timed(clock)
    out, op = make(fn, clock, timeout=100, retry=RetryStrategy.fixed_delay(3, 1.0))
    await op.open()
    await op.process_element(StreamRecord("a"))
    await clock.advance(50)
    assert fn.started == [0.0, 1.0, 2.0]
    assert isinstance(op.failure, AsyncFunctionError)
    assert "after 3 attempts" in str(op.failure)
    assert "Flaky: attempt 3" in str(op.failure)
    assert op.metrics.retries == 2
    await op.close()


async def test_exponential_backoff_delays_are_capped() -> None:
    clock = VirtualClock()
    fn = Timed(clock, fail_first=5)
    retry = RetryStrategy.exponential_backoff(10, initial_delay=1, max_delay=5, multiplier=2)
    out, op = make(fn, clock, timeout=1000, retry=retry)
    await op.open()
    await op.process_element(StreamRecord("a"))
    await clock.advance(100)
    # delays 1, 2, 4, 5 (capped), 5
    assert fn.started == [0, 1, 3, 7, 12, 17]
    assert [e.value for e in out] == ["a"]
    await op.close()


async def test_jitter_stays_within_its_bounds() -> None:
    retry = RetryStrategy.exponential_backoff(5, 1.0, 8.0, jitter=0.25)
    random.seed(7)
    for attempts, base in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 8.0)]:
        delays = [retry.backoff(attempts) for _ in range(400)]
        assert all(base * 0.75 <= d <= base * 1.25 for d in delays)
        # jittered: spread over the whole band, not the base delay every time
        assert min(delays) < base * 0.8 and max(delays) > base * 1.2
        assert len(set(delays)) > 300
    assert {RetryStrategy.exponential_backoff(5, 1.0, 8.0).backoff(2) for _ in range(20)} == {2.0}


async def test_backoff_is_per_element() -> None:
    clock = VirtualClock()
    starts: dict[str, list[float]] = {"a": [], "b": []}

    async def flaky(value):
        starts[value].append(clock.now())
        if len(starts[value]) < 4:
            raise Flaky(value)
        return [value]

    retry = RetryStrategy.exponential_backoff(5, 1, 100)
    out, op = make(flaky, clock, mode=OutputMode.UNORDERED, timeout=1000, retry=retry)
    await op.open()
    await op.process_element(StreamRecord("a"))
    await clock.advance(2.5)  # "a" is on its second backoff when "b" starts
    await op.process_element(StreamRecord("b"))
    await clock.advance(100)
    assert starts["a"] == [0, 1, 3, 7]
    assert starts["b"] == [2.5, 3.5, 5.5, 9.5]  # its own sequence, from 1 again
    await op.close()


async def test_exceptions_outside_the_predicate_fail_at_once() -> None:
    clock = VirtualClock()
    fn = ControlledFunction()
    retry = RetryStrategy.fixed_delay(5, 1, retry_on_exception=(Flaky,))
    out, op = make(fn, clock, timeout=100, retry=retry)
    await op.open()
    await op.process_element(StreamRecord("a"))
    await settle()
    fn.fail("a", Flaky("retry me"))
    await clock.advance(1)
    fn.fail("a", Fatal("do not retry me"))
    await clock.advance(10)
    assert fn.calls == ["a", "a"]
    assert isinstance(op.failure, AsyncFunctionError)
    assert "after 2 attempts" in str(op.failure)
    assert "Fatal" in str(op.failure)
    await op.close()


async def test_retry_on_result_then_the_last_result_is_emitted() -> None:
    clock = VirtualClock()
    fn = ControlledFunction()
    retry = RetryStrategy.fixed_delay(3, 1, retry_on_result=lambda results: results == [])
    out, op = make(fn, clock, timeout=100, retry=retry)
    await op.open()
    await op.process_element(StreamRecord("a"))
    await settle()
    fn.complete("a", [])
    await clock.advance(1)
    fn.complete("a", [])
    await clock.advance(1)
    fn.complete("a", [])  # third and last attempt: its (empty) result is final
    await clock.advance(10)
    assert fn.calls == ["a", "a", "a"]
    assert out == []
    await op.finish()
    await op.close()


async def test_timeout_during_a_backoff() -> None:
    clock = VirtualClock()

    class Fallback(ControlledFunction):
        async def timeout(self, value):
            return ["fallback"]

    fn = Fallback()
    out, op = make(fn, clock, timeout=3, retry=RetryStrategy.fixed_delay(5, 5.0))
    await op.open()
    await op.process_element(StreamRecord("a"))
    await clock.advance(1)
    fn.fail("a", Flaky("first"))  # backoff until t=6, past the t=3 deadline
    await clock.advance(1)  # t=2: waiting in backoff
    assert out == []
    await clock.advance(1)  # t=3: the timeout fires during the backoff
    assert [e.value for e in out] == ["fallback"]
    await clock.advance(10)
    assert fn.calls == ["a"]  # the retry was cancelled: no attempt past the deadline
    await op.close()


async def test_the_timeout_budget_spans_all_attempts_and_no_retry_starts_past_it() -> None:
    clock = VirtualClock()
    fn = Timed(clock)
    out, op = make(fn, clock, timeout=10, retry=RetryStrategy.fixed_delay(100, 3.0))
    await op.open()
    await op.process_element(StreamRecord("a"))
    await clock.advance(60)
    # attempts at 0, 3, 6, 9; the next would start at 12 > 10: the timeout decides at 10
    assert fn.started == [0, 3, 6, 9]
    assert all(t < 10 for t in fn.started)
    assert isinstance(op.failure, AsyncTimeoutError)
    assert "after 4 attempts" in str(op.failure)
    assert "Flaky('attempt 4')" in str(op.failure)  # the last failure is in the message
    await op.close()


@pytest.mark.parametrize("outcome", ["exception", "result"])
async def test_a_timeout_waiting_for_a_retry_says_the_retry_did_not_fit(outcome: str) -> None:
    # The element's attempt had ended (its result rejected, or its call failed) and its
    # retry was due past the deadline: the error said the element "did not complete within
    # the timeout" and advised only raising it.
    clock = VirtualClock()
    fn = ControlledFunction()
    retry = RetryStrategy.fixed_delay(3, 5.0, retry_on_result=lambda results: results == [])
    out, op = make(fn, clock, timeout=2, retry=retry)
    await op.open()
    await op.process_element(StreamRecord("a"))
    await clock.advance(0.5)
    if outcome == "result":
        fn.complete("a", [])
    else:
        fn.fail("a", Flaky("service down"))
    await clock.advance(2)
    with pytest.raises(AsyncTimeoutError) as info:
        await op.finish()
    message = str(info.value)
    assert message.startswith(
        "The next retry did not fit within the 2 s timeout for element StreamRecord('a') after "
        "1 attempt"
    )
    last = (
        "returned a result that retry_on_result rejected"
        if outcome == "result"
        else "failed with Flaky('service down')"
    )
    assert (
        f"The last attempt {last}, and its retry was due 5.5 s after the element's first call, "
        "past the 2 s timeout (no retry starts at or after the deadline). Use a longer timeout "
        "or a shorter backoff; or implement timeout()"
    ) in message
    assert fn.calls == ["a"]
    await op.close()


async def test_a_retry_due_in_time_that_a_busy_loop_delays_past_the_deadline_says_so() -> None:
    # The retry (due at 0.15 s) fit the 0.2 s timeout, but the loop was blocked until both
    # timers were overdue and the deadline's ran first: the error advised a shorter backoff.
    calls = []

    async def failing(value):
        calls.append(value)
        raise Flaky("down")

    op = AsyncWaitOperator(
        failing, lambda e: None, timeout=0.2, retry=RetryStrategy.fixed_delay(5, 0.15)
    )
    await op.open()
    await op.process_element(StreamRecord("a"))
    await asyncio.sleep(0)  # the first attempt fails; its retry is armed
    time.sleep(0.3)  # blocking work on the loop
    with pytest.raises(AsyncTimeoutError) as info:
        await op.finish()
    message = str(info.value)
    assert message.startswith("The next retry did not start within the 0.2 s timeout"), message
    assert "within the timeout, but the event loop was busy until after the deadline" in message
    assert calls == ["a"]
    await op.close()


async def test_a_retry_due_exactly_at_the_deadline_does_not_start() -> None:
    clock = VirtualClock()
    fn = Timed(clock)
    out, op = make(fn, clock, timeout=4, retry=RetryStrategy.fixed_delay(100, 2.0))
    await op.open()
    await op.process_element(StreamRecord("a"))
    await clock.advance(10)
    assert fn.started == [0, 2]  # the retry due at t=4 == deadline never started
    assert isinstance(op.failure, AsyncTimeoutError)
    await op.close()


async def test_finish_during_a_backoff_fires_it_at_once_and_disables_retry() -> None:
    clock = VirtualClock()
    fn = ControlledFunction()
    out, op = make(fn, clock, timeout=100, retry=RetryStrategy.fixed_delay(10, 50.0))
    await op.open()
    await op.process_element(StreamRecord("a"))
    await op.process_element(StreamRecord("b"))
    await settle()
    fn.fail("a", Flaky("first"))
    fn.complete("b", ["B"])
    await settle()
    assert fn.calls == ["a", "b"]
    finishing = asyncio.ensure_future(op.finish())
    await settle()
    assert fn.calls == ["a", "b", "a"]  # the backoff fired at once, no time passed
    assert clock.now() == 0
    fn.fail("a", Flaky("second"))  # retrying is now disabled: this outcome is final
    await settle()
    with pytest.raises(AsyncFunctionError, match="after 2 attempts"):
        await asyncio.wait_for(finishing, timeout=5)  # bound only turns a hang into a failure
    assert [e.value for e in out] == []  # ordered: "B" waits behind the failed "a"
    await op.close()


async def test_finish_keep_retrying_lets_backoffs_and_retries_run_their_course() -> None:
    clock = VirtualClock()
    fn = ControlledFunction()
    out, op = make(fn, clock, timeout=100, retry=RetryStrategy.fixed_delay(10, 5.0))
    await op.open()
    await op.process_element(StreamRecord("a"))
    await settle()
    fn.fail("a", Flaky("first"))
    await settle()
    finishing = asyncio.ensure_future(op.finish(keep_retrying=True))
    await settle()
    assert fn.calls == ["a"]  # the backoff keeps its time
    await clock.advance(5)
    assert fn.calls == ["a", "a"]
    fn.fail("a", Flaky("second"))  # still retried while finishing
    await settle()
    await clock.advance(5)
    assert fn.calls == ["a", "a", "a"]
    with pytest.raises(OperatorStateError):
        await op.process_element(StreamRecord("late"))  # no input once finishing
    fn.complete("a", ["A"])
    await asyncio.wait_for(finishing, timeout=5)  # bound only turns a hang into a failure
    assert [e.value for e in out] == ["A"]
    assert op.metrics.retries == 2
    await op.close()


async def test_finish_during_a_backoff_emits_the_final_attempts_result() -> None:
    clock = VirtualClock()
    fn = ControlledFunction()
    retry = RetryStrategy.fixed_delay(10, 50.0, retry_on_result=lambda r: r == ["retry"])
    out, op = make(fn, clock, timeout=100, retry=retry)
    await op.open()
    await op.process_element(StreamRecord("a"))
    await settle()
    fn.complete("a", ["retry"])
    await settle()
    finishing = asyncio.ensure_future(op.finish())
    await settle()
    fn.complete("a", ["retry"])  # would be retried, but retrying is disabled: emitted
    await settle()
    await asyncio.wait_for(finishing, timeout=5)  # bound only turns a hang into a failure
    assert [e.value for e in out] == ["retry"]
    assert fn.calls == ["a", "a"]
    await op.close()


async def test_a_late_result_of_a_superseded_attempt_is_dropped() -> None:
    clock = VirtualClock()
    fn = ControlledFunction()
    out, op = make(fn, clock, timeout=100, retry=RetryStrategy.fixed_delay(5, 1.0))
    await op.open()
    await op.process_element(StreamRecord("a"))
    await settle()
    fn.fail("a", Flaky("1"))
    await clock.advance(1)
    fn.complete("a", ["A"])
    await settle()
    await clock.advance(10)
    assert [e.value for e in out] == ["A"]
    assert op.metrics.results_out == 1
    await op.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_attempts": 0, "initial_delay": 1}, "max_attempts must be an integer >= 1"),
        ({"max_attempts": 2, "initial_delay": -1}, "RetryStrategy initial_delay must be >= 0"),
        ({"max_attempts": 2, "initial_delay": 1, "multiplier": 0.5}, "multiplier must be >= 1"),
        ({"max_attempts": 2, "initial_delay": 1, "jitter": 2}, "jitter must be between 0 and 1"),
        ({"max_attempts": 2, "initial_delay": 5, "max_delay": 1}, "max_delay"),
        ({"max_attempts": True, "initial_delay": 1}, "max_attempts must be an integer"),
        ({"max_attempts": 2, "initial_delay": float("nan")}, "delay must be a finite number"),
        ({"max_attempts": 2, "initial_delay": "1"}, "delay must be a finite number of seconds"),
        ({"max_attempts": 2, "initial_delay": 1, "multiplier": float("nan")}, "multiplier"),
        ({"max_attempts": 2, "initial_delay": 1, "max_delay": float("nan")}, "max_delay must"),
        ({"max_attempts": 2, "initial_delay": 1, "jitter": float("nan")}, "jitter must"),
        (
            {"max_attempts": 2, "initial_delay": 1, "retry_on_exception": (ValueError, "x")},
            "an exception type, a tuple of them",
        ),
        ({"max_attempts": 2, "initial_delay": 1, "retry_on_exception": int}, "exception type"),
        (  # an exception class is callable, and every instance is true: every result retried
            {"max_attempts": 2, "initial_delay": 1, "retry_on_result": TimeoutError},
            r"retry_on_result must be a predicate over the result list; got <class "
            r"'TimeoutError'>, an exception type: retry exceptions with "
            r"retry_on_exception=TimeoutError\.",
        ),
    ],
)
def test_invalid_retry_strategies_fail_at_construction(kwargs: dict, message: str) -> None:
    from stateful_async import ConfigurationError

    with pytest.raises(ConfigurationError, match=message):
        RetryStrategy(**kwargs)


@pytest.mark.parametrize("empty", [(), [], set(), frozenset()], ids=type)
@pytest.mark.parametrize("factory", ["constructor", "fixed_delay", "exponential_backoff"])
def test_an_empty_retry_on_exception_is_refused_at_construction(empty, factory: str) -> None:
    # isinstance(exc, ()) is False: an empty tuple was accepted and retried nothing.
    from stateful_async import ConfigurationError

    make_strategy = {
        "constructor": lambda: RetryStrategy(3, 1, retry_on_exception=empty),
        "fixed_delay": lambda: RetryStrategy.fixed_delay(3, 1, retry_on_exception=empty),
        "exponential_backoff": lambda: RetryStrategy.exponential_backoff(
            3, 1, 4, retry_on_exception=empty
        ),
    }[factory]
    with pytest.raises(ConfigurationError) as info:
        make_strategy()
    assert str(info.value) == (
        f"RetryStrategy retry_on_exception is an empty {type(empty).__name__}, {empty!r}, which "
        "matches no exception, so nothing would ever be retried. Pass the exception types to "
        "retry, e.g. retry_on_exception=(TimeoutError,); omit it to retry any Exception; or, "
        "to retry no exception (only results, with retry_on_result), pass "
        "retry_on_exception=lambda exc: False."
    )


def test_the_no_retry_predicate_the_empty_collection_error_advises_retries_no_exception() -> None:
    retry = RetryStrategy.fixed_delay(
        3, 1, retry_on_exception=lambda exc: False, retry_on_result=lambda r: r == []
    )
    assert retry.should_retry_exception(TimeoutError()) is False
    assert retry.should_retry_result([]) is True


def test_a_list_of_exception_types_is_refused_with_the_tuple_to_pass() -> None:
    from stateful_async import ConfigurationError

    with pytest.raises(ConfigurationError) as info:
        RetryStrategy.fixed_delay(3, 1, retry_on_exception=[TimeoutError, ConnectionError])
    assert str(info.value) == (
        "RetryStrategy retry_on_exception must be an exception type, a tuple of them, or a "
        "predicate over the exception; got [<class 'TimeoutError'>, <class "
        "'ConnectionError'>]. Pass them as a tuple: retry_on_exception=(TimeoutError, "
        "ConnectionError)."
    )


@pytest.mark.parametrize(
    "union", [Flaky | OSError, typing.Union[Flaky, OSError]], ids=["a | b", "typing.Union"]
)
async def test_a_union_of_exception_types_retries_each_member(union) -> None:
    # isinstance() takes a union, but RetryStrategy refused one: "must be an exception type,
    # a tuple of them, or a predicate over the exception".
    retry = RetryStrategy.fixed_delay(5, 1, retry_on_exception=union)
    assert retry.retry_on_exception == (Flaky, OSError)  # kept as the tuple of its members
    assert retry == RetryStrategy.fixed_delay(5, 1, retry_on_exception=(Flaky, OSError))
    clock, fn, out, op = await running_a(retry, timeout=100)
    fn.fail("a", Flaky("retry me"))
    await clock.advance(1)
    fn.fail("a", ConnectionError("a subclass of OSError: retry me too"))
    await clock.advance(1)
    fn.fail("a", Fatal("do not retry me"))
    await clock.advance(10)
    assert fn.calls == ["a", "a", "a"]
    assert isinstance(op.failure, AsyncFunctionError)
    assert "after 3 attempts" in str(op.failure)
    assert "Fatal: do not retry me" in str(op.failure)
    await op.close()


@pytest.mark.parametrize("dumps", ["pickle", "cloudpickle"])
def test_a_retry_strategy_given_a_union_pickles(dumps: str) -> None:
    # Spark ships the strategy to its executors with cloudpickle.
    if dumps == "pickle":
        loads, dump = pickle.loads, pickle.dumps
    else:
        cloudpickle = pytest.importorskip("pyspark.cloudpickle")
        loads, dump = cloudpickle.loads, cloudpickle.dumps
    retry = RetryStrategy.fixed_delay(3, 1, retry_on_exception=Flaky | TimeoutError)
    copy = loads(dump(retry))
    assert copy == retry
    assert copy.retry_on_exception == (Flaky, TimeoutError)
    assert copy.should_retry_exception(TimeoutError()) is True
    assert copy.should_retry_exception(Flaky()) is True
    assert copy.should_retry_exception(Fatal()) is False


@pytest.mark.parametrize(
    ("union", "message"),
    [
        (
            TimeoutError | None,
            "RetryStrategy retry_on_exception is a union of types, TimeoutError | None, but "
            "NoneType is not an exception type: every member of the union must be an "
            "exception type (a subclass of BaseException). Leave it out: "
            "retry_on_exception=TimeoutError.",
        ),
        (
            int | str,
            "RetryStrategy retry_on_exception is a union of types, int | str, but int, str are "
            "not exception types: every member of the union must be an exception type (a "
            "subclass of BaseException). Pass exception types, e.g. "
            "retry_on_exception=TimeoutError | ConnectionError.",
        ),
        (
            typing.Union[TimeoutError, ConnectionError, int, str],
            "RetryStrategy retry_on_exception is a union of types, typing.Union[TimeoutError, "
            "ConnectionError, int, str], but int, str are not exception types: every member of "
            "the union must be an exception type (a subclass of BaseException). Leave them "
            "out: retry_on_exception=TimeoutError | ConnectionError.",
        ),
    ],
    ids=["with None", "no exception type", "typing.Union"],
)
def test_a_union_with_a_type_that_is_no_exception_is_refused(union, message: str) -> None:
    from stateful_async import ConfigurationError

    with pytest.raises(ConfigurationError) as info:
        RetryStrategy(3, 1, retry_on_exception=union)
    assert str(info.value) == message


@pytest.mark.parametrize("outcome", ["exception", "result"])
def test_an_async_retry_predicate_is_refused_at_construction(outcome: str) -> None:
    # Called, never awaited: its coroutine is true, so every outcome was retried.
    from stateful_async import ConfigurationError

    async def predicate(value):  # type: ignore[no-untyped-def]
        return False

    with pytest.raises(ConfigurationError) as info:
        RetryStrategy.fixed_delay(3, 1, **{f"retry_on_{outcome}": predicate})
    assert str(info.value) == (
        f"RetryStrategy retry_on_{outcome} is an async function, but a predicate is called, "
        f"not awaited: its coroutine would count as True, so every {outcome} would be "
        "retried. Declare it with a plain 'def' that returns True or False."
    )


def test_retry_delays_may_be_timedeltas() -> None:
    import datetime

    fixed = RetryStrategy.fixed_delay(3, datetime.timedelta(milliseconds=250))
    backoff = RetryStrategy.exponential_backoff(
        3, datetime.timedelta(seconds=1), datetime.timedelta(minutes=1)
    )
    assert (fixed.initial_delay, backoff.initial_delay, backoff.max_delay) == (0.25, 1.0, 60.0)
    assert backoff.backoff(3) == 4.0


def test_a_retry_strategy_keeps_numpy_numbers_as_plain_ones() -> None:
    import numpy as np

    strategy = RetryStrategy.exponential_backoff(
        np.int64(4), np.float64(0.1), np.int32(2), multiplier=np.float32(1.5), jitter=np.float16(0)
    )
    assert (strategy.max_attempts, strategy.max_delay, strategy.multiplier) == (4, 2.0, 1.5)
    assert type(strategy.max_attempts) is int
    assert {type(strategy.initial_delay), type(strategy.max_delay), type(strategy.jitter)} == {
        float
    }


def test_the_factories_name_their_own_parameters_in_errors() -> None:
    from stateful_async import ConfigurationError

    with pytest.raises(ConfigurationError, match="RetryStrategy delay must be >= 0"):
        RetryStrategy.fixed_delay(3, -0.1)
    with pytest.raises(ConfigurationError, match="RetryStrategy initial_delay must be >= 0"):
        RetryStrategy.exponential_backoff(3, -0.1, 1)


async def first_attempt_ends(op: AsyncWaitOperator, fn: ControlledFunction, outcome: str) -> None:
    """Open ``op``, feed it "a", and end its first attempt with ``outcome``: an
    "exception" (Flaky) or a "result" (["A"])."""
    await op.open()
    await op.process_element(StreamRecord("a"))
    await settle()
    if outcome == "exception":
        fn.fail("a", Flaky("boom"))
    else:
        fn.complete("a", ["A"])
    await settle()


class BuggyBackoff(RetryStrategy):
    def backoff(self, attempts: int) -> float:
        raise ValueError("bug in my backoff")


class BuggyCanRetry(RetryStrategy):
    def can_retry(self, attempts: int) -> bool:
        raise ValueError("bug in my can_retry")


@pytest.mark.parametrize("outcome", ["exception", "result"])
@pytest.mark.parametrize("strategy", [BuggyBackoff, BuggyCanRetry])
async def test_a_retry_strategy_method_that_raises_fails_the_element_at_once(
    strategy: type[RetryStrategy], outcome: str
) -> None:
    # A subclass's backoff() or can_retry() raised in the attempt's task: the error was
    # lost there, and at the deadline the timeout handler's fallback was emitted.
    clock = VirtualClock()
    fn = ControlledTimeoutFunction()
    retry = strategy(3, 1.0, retry_on_result=lambda results: True)
    out, op = make(fn, clock, timeout=10, retry=retry)
    await first_attempt_ends(op, fn, outcome)
    assert op.failure is not None  # now, not at the deadline
    await clock.advance(10)
    assert fn.timeout_calls == [] and out == []
    with pytest.raises(ElementFailedError) as info:
        await op.finish()
    step = "backoff" if strategy is BuggyBackoff else "can_retry"
    message = str(info.value)
    assert f"The retry strategy's {step}() raised after the attempt's {outcome}" in message
    assert f"Fix {strategy.__name__}.{step}: it must return a " in message
    assert isinstance(info.value.__cause__, ValueError)
    await op.close()


class BackoffOf(RetryStrategy):
    """A subclass whose backoff() returns ``delay`` (a class attribute), whatever it is."""

    delay: object = None

    def backoff(self, attempts: int) -> float:
        return self.delay  # type: ignore[return-value]


@pytest.mark.parametrize("outcome", ["exception", "result"])
@pytest.mark.parametrize("delay", [None, float("nan"), "1"])
async def test_a_backoff_that_returns_no_delay_fails_the_element_at_once(
    delay: object, outcome: str
) -> None:
    # None and "1" raised TypeError in the attempt's task, where it was lost; NaN armed a
    # timer that never fired: either way the timeout handler's fallback was emitted at the
    # deadline, and the bug in backoff() was never reported.
    clock = VirtualClock()
    fn = ControlledTimeoutFunction()
    retry = type("Backoff", (BackoffOf,), {"delay": delay})(
        3, 1.0, retry_on_result=lambda results: True
    )
    out, op = make(fn, clock, timeout=10, retry=retry)
    await first_attempt_ends(op, fn, outcome)
    assert op.failure is not None  # now, not at the deadline
    await clock.advance(10)
    assert fn.timeout_calls == [] and out == [] and fn.calls == ["a"]
    with pytest.raises(ElementFailedError) as info:
        await op.finish()
    assert str(info.value) == (
        f"The retry strategy's backoff() returned {delay!r} after the attempt's {outcome} for "
        "element StreamRecord('a') after 1 attempt. Fix Backoff.backoff: it must return a "
        "number of seconds (or a timedelta) for every attempt count."
    )
    await op.close()


async def test_a_backoff_may_return_a_timedelta() -> None:
    clock = VirtualClock()
    fn = ControlledFunction()
    retry = type("Backoff", (BackoffOf,), {"delay": timedelta(seconds=2)})(3, 1.0)
    out, op = make(fn, clock, timeout=10, retry=retry)
    await first_attempt_ends(op, fn, "exception")
    await clock.advance(1.999)
    assert fn.calls == ["a"]
    await clock.advance(0.001)
    assert fn.calls == ["a", "a"]
    fn.complete("a", ["A"])
    await op.finish()
    assert [e.value for e in out] == ["A"]
    await op.close()


def test_retry_strategy_docstring_says_max_attempts_counts_total_attempts() -> None:
    doc = RetryStrategy.__doc__ or ""
    assert "counts **total attempts**" in doc
    assert "Flink's ``maxAttempts`` counts retries" in doc


@pytest.mark.parametrize("with_handler", [False, True])
@pytest.mark.parametrize("outcome", ["exception", "result"])
async def test_a_retry_predicate_that_raises_fails_the_element_at_once(
    outcome: str, with_handler: bool
) -> None:
    # Not hidden in the attempt's task until the deadline, then reported as a timeout (or
    # silently replaced by the fallback).
    def predicate(value):
        return value.response.status == 503  # wrong for what the function gives it

    clock = VirtualClock()
    fn = ControlledTimeoutFunction() if with_handler else ControlledFunction()
    retry = RetryStrategy.fixed_delay(3, 1.0, **{f"retry_on_{outcome}": predicate})
    out, op = make(fn, clock, timeout=60, retry=retry)
    await first_attempt_ends(op, fn, outcome)
    assert op.failure is not None  # now, not at the 60 s deadline
    with pytest.raises(ElementFailedError) as info:
        await op.finish()
    message = str(info.value)
    assert f"The retry predicate retry_on_{outcome} raised" in message
    assert "StreamRecord('a')" in message
    assert "AttributeError" in message
    assert isinstance(info.value.__cause__, AttributeError)
    assert out == [] and fn.calls == ["a"]
    await op.close()


@pytest.mark.parametrize("outcome", ["exception", "result"])
async def test_a_retry_predicate_returning_a_coroutine_fails_the_element_at_once(
    outcome: str,
) -> None:
    # before: a plain lambda wrapping an async check passed the construction check, and the
    # coroutine it returned counted as True: every outcome was retried (with a "never
    # awaited" warning per attempt) until the attempts ran out, those it answers False too
    async def is_transient(value):  # type: ignore[no-untyped-def]
        return False

    clock = VirtualClock()
    fn = ControlledFunction()
    retry = RetryStrategy.fixed_delay(
        3, 1.0, **{f"retry_on_{outcome}": lambda value: is_transient(value)}
    )
    out, op = make(fn, clock, timeout=60, retry=retry)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the coroutine is closed: no "never awaited"
        await first_attempt_ends(op, fn, outcome)
        await clock.advance(5)
        gc.collect()
    assert fn.calls == ["a"]  # not retried
    with pytest.raises(ElementFailedError) as info:
        await op.finish()
    assert str(info.value).startswith(
        f"The retry predicate retry_on_{outcome} raised on the attempt's {outcome} for element "
        f"StreamRecord('a') after 1 attempt: TypeError: RetryStrategy retry_on_{outcome} "
        "returned a coroutine, an awaitable: a predicate is called, not awaited, so it would "
        f"count as True and every {outcome} would be retried. Return True or False from a "
        "plain 'def'; it cannot await an async check."
    )
    assert out == []
    await op.close()


def test_backoff_of_many_attempts_is_capped_instead_of_overflowing() -> None:
    retry = RetryStrategy.exponential_backoff(5000, 0.1, 2.0, multiplier=10)
    assert retry.backoff(1100) == 2.0
    assert RetryStrategy(5000, 0.1, multiplier=10).backoff(1100) == float("inf")
    # No delay at all stays none, however many attempts: not a wait for the deadline.
    assert RetryStrategy(5000, 0, multiplier=10).backoff(1100) == 0.0


class _Unprintable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class _UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str")


async def test_a_value_or_error_that_cannot_be_printed_still_gets_its_error() -> None:
    # The error is built in a timer callback: a repr that raises must not stop the timers
    # (the element would stay undecided and finish() would hang).
    clock = VirtualClock()
    fn = ControlledFunction()
    out, op = make(fn, clock, timeout=5, retry=RetryStrategy.fixed_delay(2, 1.0))
    await op.open()
    value = _Unprintable()
    await op.process_element(StreamRecord(value))
    await settle()
    fn.fail(value, _UnprintableError())
    await clock.advance(1)
    fn.fail(value, _UnprintableError())
    await settle()
    with pytest.raises(AsyncFunctionError) as info:
        await asyncio.wait_for(op.finish(), 5)
    message = str(info.value)
    assert "<_Unprintable object; its repr raised RuntimeError>" in message
    assert "_UnprintableError: <its str() raised RuntimeError>" in message
    await op.close()


class _UnreprableError(Exception):
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


async def test_a_timeout_after_an_error_that_cannot_be_repred_fails_and_timers_go_on() -> None:
    # The timeout error quotes the last attempt's error; a repr that raises there once left
    # the element undecided and the timer service disarmed: no other element timed out.
    clock = VirtualClock()
    fn = ControlledFunction()
    out, op = make(fn, clock, timeout=2, retry=RetryStrategy.fixed_delay(5, 10.0))
    await op.open()
    await op.process_element(StreamRecord("a"))
    await settle()
    fn.fail("a", _UnreprableError("service down"))
    await settle()
    await op.process_element(StreamRecord("b"))
    await clock.advance(2)
    assert op.failure is not None
    message = str(op.failure)
    assert (
        "The next retry did not fit within the 2 s timeout for element StreamRecord('a')" in message
    )
    assert "<_UnreprableError object; its repr raised RuntimeError>" in message
    with pytest.raises(AsyncTimeoutError):
        await asyncio.wait_for(op.finish(), 5)
    await op.close()


async def test_a_timer_callback_that_raises_fails_the_operator_and_keeps_other_timers() -> None:
    clock = VirtualClock()
    errors: list = []
    service = TimerService(clock, errors.append)
    fired: list = []

    def bad() -> None:
        raise RuntimeError("bug")

    service.register("bad", 1.0, bad)
    service.register("same time", 1.0, lambda: fired.append("same time"))
    service.register("later", 2.0, lambda: fired.append("later"))
    await clock.advance(1)
    assert [str(e) for e in errors] == ["bug"] and fired == ["same time"]
    await clock.advance(1)
    assert fired == ["same time", "later"]
    service.register("bad again", 10.0, bad)  # finish() fires backoffs at once: fire_now
    assert service.fire_now("bad again") and [str(e) for e in errors] == ["bug", "bug"]

    fn = ControlledFunction()
    out, op = make(fn, clock, timeout=5)
    await op.open()
    await op.process_element(StreamRecord("x"))
    op._timers.register("bad", clock.now() + 1, bad)
    await clock.advance(1)
    assert isinstance(op.failure, OperatorStateError)
    assert "timer raised RuntimeError: bug" in str(op.failure)
    await op.close()


class Payload:
    def __init__(self, n: int) -> None:
        self.n = n


async def test_a_timeout_keeps_no_element_alive_once_it_is_decided() -> None:
    # Memory is bounded by capacity: a decided element's cancelled timeout timer must not
    # hold the element until its deadline (rate x timeout elements, however big).
    import gc
    import weakref

    alive: weakref.WeakSet = weakref.WeakSet()

    async def number(value):
        return [value.n]

    clock = VirtualClock()  # stands still: no deadline ever passes
    out, op = make(number, clock, capacity=10, timeout=1000)
    await op.open()
    for i in range(5000):
        payload = Payload(i)
        alive.add(payload)
        await op.process_element(StreamRecord(payload))
    del payload
    await settle()
    gc.collect()
    assert len(alive) <= 100, f"{len(alive)} of 5000 elements still referenced"
    await op.finish()
    assert [r.value for r in out] == list(range(5000))
    await op.close()


async def test_a_failure_advises_retrying_only_an_element_that_was_not_retried() -> None:
    # An element that failed after every attempt its strategy allows was told "retry this
    # exception (retry=RetryStrategy(...))", as if no strategy had been given.
    async def fails(clock, retry):
        out, op = make(Timed(clock), clock, timeout=100, retry=retry)
        await op.open()
        await op.process_element(StreamRecord("a"))
        await clock.advance(10)
        with pytest.raises(AsyncFunctionError) as info:
            await asyncio.wait_for(op.finish(keep_retrying=True), 5)
        await op.close()
        return str(info.value)

    used_up = await fails(VirtualClock(), RetryStrategy.fixed_delay(3, 1.0))
    assert "after 3 attempts" in used_up
    assert "retries are used up (max_attempts=3)" in used_up
    assert "retry this exception" not in used_up
    not_matched = await fails(
        VirtualClock(), RetryStrategy.fixed_delay(3, 1.0, retry_on_exception=Fatal)
    )
    assert "after 1 attempt" in not_matched
    assert "retry_on_exception does not match it" in not_matched
    no_strategy = await fails(VirtualClock(), None)
    assert "retry this exception (retry=RetryStrategy(...)" in no_strategy


@pytest.mark.parametrize(
    "retry_on_exception",
    [Exception, ValueError, lambda exc: True],
    ids=["any", "ValueError", "predicate"],
)
async def test_a_configuration_error_the_function_raises_is_never_retried(
    retry_on_exception: typing.Any,
) -> None:
    # Before, an armed CrashOnElement whose key can never match (at=["5"] on int ids) raised
    # its ConfigurationError on every attempt of a retry-everything strategy, and the element
    # failed only once its attempts were used up, told to "allow more attempts".
    async def enrich(row):  # type: ignore[no-untyped-def]
        return [row]

    clock = VirtualClock()
    fn = CountingCalls(CrashOnElement(enrich, at=["5"]))
    retry = RetryStrategy.fixed_delay(4, 1.0, retry_on_exception=retry_on_exception)
    out, op = make(fn, clock, timeout=100, retry=retry)
    await op.open()
    await op.process_element(StreamRecord({"id": 5}))
    await clock.advance(10)
    with pytest.raises(AsyncFunctionError) as info:
        await asyncio.wait_for(op.finish(keep_retrying=True), 5)
    await op.close()
    assert fn.calls == 1
    assert out == []
    message = str(info.value)
    assert "after 1 attempt: ConfigurationError: CrashOnElement can never fire" in message
    assert message.endswith("A ConfigurationError is never retried: fix the setting it names.")
    assert isinstance(info.value.__cause__, ConfigurationError)


class CountingCalls(AsyncFunction):
    """Counts the calls of the function it wraps."""

    def __init__(self, fn: AsyncFunction) -> None:
        self.fn = fn
        self.calls = 0

    async def open(self) -> None:
        await self.fn.open()

    async def async_invoke(self, value):  # type: ignore[no-untyped-def]
        self.calls += 1
        return await self.fn.async_invoke(value)


@pytest.mark.parametrize("cut_short_by", ["finishing", "attempts used up"])
async def test_a_failure_the_predicate_never_retries_is_not_blamed_on_what_ended_retries(
    cut_short_by: str,
) -> None:
    # The strategy was not asked about the exception (finishing, or no attempt left): the
    # advice said finish(keep_retrying=True) or more attempts would help, but the predicate
    # never retries it.
    clock = VirtualClock()
    fn = ControlledFunction()
    retry = RetryStrategy.fixed_delay(2, 1, retry_on_exception=Flaky)
    out, op = make(fn, clock, timeout=10, retry=retry)
    await op.open()
    await op.process_element(StreamRecord("a"))
    await settle()
    if cut_short_by == "finishing":
        finishing = asyncio.ensure_future(op.finish())
    else:
        fn.fail("a", Flaky("busy"))
        await clock.advance(1)  # the second and last attempt
        finishing = asyncio.ensure_future(op.finish(keep_retrying=True))
    await settle()
    fn.fail("a", Fatal("bad request"))
    with pytest.raises(AsyncFunctionError) as info:
        await asyncio.wait_for(finishing, 5)
    message = str(info.value)
    assert "Fatal: bad request" in message
    assert "The retry strategy's retry_on_exception does not match it." in message
    assert "keep_retrying" not in message and "allow more attempts" not in message
    await op.close()


async def test_results_whose_iteration_raises_type_error_are_a_failed_attempt_not_a_wrong_shape():
    # A generator of results that hits a TypeError of its own half-way (a bug in it, or a
    # client raising one) is iterable: its error is the call's, retried like any other,
    # not "returned generator, which is not iterable" (a wrong shape, never retried).
    calls = []

    async def fn(value):
        calls.append(value)

        def results():
            yield value
            if len(calls) == 1:
                raise TypeError("unsupported operand type(s) for +: 'NoneType' and 'int'")

        return results()

    clock = VirtualClock()
    out, op = make(fn, clock, timeout=10, retry=RetryStrategy.fixed_delay(2, 1.0))
    await op.open()
    await op.process_element(StreamRecord("a"))
    await clock.advance(1)
    await asyncio.wait_for(op.finish(), 5.0)
    assert [e.value for e in out] == ["a"]
    assert calls == ["a", "a"]
    await op.close()

    async def never_recovers(value):
        def results():
            yield value
            raise TypeError("bad operand")

        return results()

    op = AsyncWaitOperator(never_recovers, lambda e: None)
    await op.open()
    await op.process_element(StreamRecord("b"))
    with pytest.raises(AsyncFunctionError, match="StreamRecord\\('b'\\)") as info:
        await asyncio.wait_for(op.finish(), 5.0)
    assert "not iterable" not in str(info.value)
    assert isinstance(info.value.__cause__, TypeError)
    await op.close()


@contextlib.contextmanager
def loop_reports() -> typing.Iterator[list[dict]]:
    """What the running loop's exception handler is given while the block runs."""
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        yield reported
    finally:
        loop.set_exception_handler(None)


async def test_a_timeout_handler_error_that_loses_the_race_is_dropped_silently() -> None:
    # The handler raises and the attempt's result arrives in the same loop iteration: the
    # result decides the element (one outcome), and the handler's error is dropped without
    # asyncio logging "Task exception was never retrieved" for it.
    import gc

    with loop_reports() as logged:
        clock, fn, out, op = await timed_out_a()
        fn.fail_timeout("a", Fatal("handler lost"))
        fn.complete("a", ["A"])
        await settle()
        await op.finish()
        await op.close()
        assert [e.value for e in out] == ["A"]
        del fn, op
        gc.collect()
        await settle()
    assert [c.get("message") for c in logged] == []


# -- the testing tools: VirtualClock, ControlledFunction -----------------------------------


@pytest.mark.parametrize("seconds", [math.nan, math.inf])
async def test_a_virtual_clock_refuses_to_advance_by_a_non_finite_time(seconds) -> None:
    # before: NaN set the clock to NaN and fired every timer; infinity fired every timer
    # and never returned while a timer scheduled another
    clock = VirtualClock()
    fired: list = []
    clock.call_at(5, lambda: fired.append(clock.now()))
    with pytest.raises(ValueError, match=r"advance\(\) takes a finite number of seconds; got "):
        await clock.advance(seconds)
    assert clock.now() == 0.0 and fired == []
    await clock.advance(5)
    assert fired == [5]


async def test_a_virtual_clock_refuses_to_go_backwards_naming_the_step() -> None:
    clock = VirtualClock(3)
    with pytest.raises(ValueError, match=r"cannot go backwards; advance\(\) got -1\.5\."):
        await clock.advance(-1.5)
    assert clock.now() == 3.0


async def test_a_virtual_clock_refuses_to_advance_past_the_largest_float() -> None:
    # before: a bare "OverflowError: integer division result too large for a float"
    clock = VirtualClock(1e308)
    with pytest.raises(
        ValueError,
        match=r"^advance\(1e\+308\) would move the virtual clock from 1e\+308 past the largest "
        r"float \(1\.7976931348623157e\+308\); advance it by less\.$",
    ):
        await clock.advance(1e308)
    assert clock.now() == 1e308
    await clock.advance(1e307)  # it still works
    assert clock.now() == 1.1e308


@pytest.mark.parametrize("rounds", [0, -1, 2.5, True])
async def test_settle_refuses_a_number_of_rounds_it_cannot_take(rounds) -> None:
    # before: 0 or -1 raised "did not settle within 0 rounds" of a loop with nothing to do
    with pytest.raises(ValueError, match=r"settle\(\) takes max_rounds of at least 1; got "):
        await settle(rounds)
    await settle(1)


@pytest.mark.parametrize("seconds", ["1", None, True])
async def test_a_virtual_clock_refuses_to_advance_by_what_is_not_a_number(seconds) -> None:
    clock = VirtualClock()
    with pytest.raises(TypeError, match=r"advance\(\) takes a number of seconds; got "):
        await clock.advance(seconds)
    assert clock.now() == 0.0


@pytest.mark.parametrize(
    "when, error", [("1", TypeError), (None, TypeError), (True, TypeError), (math.nan, ValueError)]
)
async def test_a_virtual_clock_refuses_a_wake_up_at_what_is_no_time(when, error) -> None:
    # before: the heap took it first, then call_at('1') raised "'<=' not supported between
    # instances of 'str' and 'float'" and every later call_at() and advance() raised alike;
    # call_at(nan) fired at the next advance, whatever its target
    clock = VirtualClock()
    fired: list = []
    with pytest.raises(error, match=r"call_at\(\) takes a time in seconds that is a number, not "):
        clock.call_at(when, lambda: fired.append("refused"))
    clock.call_at(2, lambda: fired.append(clock.now()))
    await clock.advance(1)
    assert fired == [] and clock.next_deadline() == 2
    await clock.advance(1)
    assert fired == [2]


async def test_a_virtual_clock_advanced_in_steps_reaches_the_deadline_of_their_sum() -> None:
    # before: ten advance(0.1) left the clock at 0.9999999999999999 (float addition), so a
    # 1 s timeout had not expired
    clock = VirtualClock()
    fn = ControlledFunction()
    out, op = make(fn, clock, timeout=1)
    await op.open()
    await op.process_element(StreamRecord("a"))
    for _ in range(10):
        await clock.advance(0.1)
    assert clock.now() == 1.0
    assert isinstance(op.failure, AsyncTimeoutError)
    await op.close()


async def test_a_virtual_clock_stepped_through_a_timeout_from_a_later_start_reaches_it() -> None:
    # before: an element that entered at 0.6 with a 1.1 s timeout has its deadline at
    # 0.6 + 1.1 == 1.7000000000000002, and eleven advance(0.1) from there reach 1.7 (their
    # exact sum, rounded): it had not timed out, though one advance(1.1) times it out
    clock = VirtualClock()
    fn = ControlledFunction()
    out, op = make(fn, clock, timeout=1.1)
    await op.open()
    await clock.advance(0.6)
    await op.process_element(StreamRecord("a"))
    for _ in range(10):
        await clock.advance(0.1)
    assert op.failure is None  # 1 s of the 1.1 s
    await clock.advance(0.1)
    assert clock.now() == 1.7
    assert isinstance(op.failure, AsyncTimeoutError)
    await op.close()
    # a wake-up a rounding error past the target runs at the target, not past it
    fired: list = []
    clock.call_at(math.nextafter(2.7, 3), lambda: fired.append(clock.now()))
    clock.call_at(2.7 + 1e-9, lambda: fired.append("too late"))
    await clock.advance(1)
    assert fired == [2.7] and clock.now() == 2.7


async def test_a_timer_a_rounding_error_past_a_late_clock_s_target_fires_and_ends() -> None:
    # before: past 2**32 s two units in the last place exceed the timer service's microsecond
    # of slack, so a timer the clock ran early, at its target, was not yet due for the
    # service, which armed it again at the same time, which the same advance ran again:
    # advance() never returned
    start = float(2**33)
    clock = VirtualClock(start)
    service = TimerService(clock, pytest.fail)
    target = start + 1
    fired: list = []
    service.register("t", target + 2 * math.ulp(target), lambda: fired.append(clock.now()))
    await asyncio.wait_for(clock.advance(1), 5)
    assert clock.now() == target
    await clock.advance(1)  # fired at the target or at the next advance, once
    assert len(fired) == 1


async def test_a_virtual_clock_reaches_its_target_when_a_wake_up_raises() -> None:
    # before: advance stopped at the first wake-up that raised, with the clock at its
    # deadline and the later due wake-ups not run; an asyncio loop reports a callback's
    # exception and keeps going
    clock = VirtualClock()
    fired: list = []

    def schedules_one_due_now() -> None:
        fired.append(clock.now())
        clock.call_at(clock.now(), lambda: {}["due now"])  # run soon, within the advance

    clock.call_at(0.5, lambda: 1 / 0)
    clock.call_at(0.75, schedules_one_due_now)
    clock.call_at(0.8, lambda: [][1])
    clock.call_at(2, lambda: fired.append(clock.now()))
    with pytest.raises(ZeroDivisionError) as info:
        await clock.advance(1)
    assert clock.now() == 1.0 and fired == [0.75]
    assert info.value.__notes__ == [  # type: ignore[attr-defined]
        "2 more wake-up(s) due by 1 raised after it (each ran, and the clock reached 1): "
        "KeyError: 'due now'; IndexError: list index out of range"
    ]
    clock.call_at(2.5, lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError) as info:
        await clock.advance(2)
    assert clock.now() == 3.0 and fired == [0.75, 2.0]
    assert not hasattr(info.value, "__notes__")  # the only one: nothing to add


async def test_a_virtual_clock_wake_up_raising_cancelled_error_is_not_a_cancelled_advance() -> None:
    # before: advance raised the wake-up's CancelledError as it was, so the awaiting task
    # ended as cancelled, as if the advance itself had been
    clock = VirtualClock()
    gone = asyncio.get_running_loop().create_future()
    gone.cancel()
    clock.call_at(0.5, gone.result)  # raises CancelledError
    clock.call_at(0.75, lambda: 1 / 0)
    advancing = asyncio.ensure_future(clock.advance(1))
    with pytest.raises(RuntimeError) as info:
        await advancing
    assert not advancing.cancelled()
    assert str(info.value) == (
        "A VirtualClock wake-up due by 1 raised CancelledError (the wake-up's own "
        "exception, such as result() of a cancelled future; advance() was not cancelled, "
        "and the clock reached its target)."
    )
    assert isinstance(info.value.__cause__, asyncio.CancelledError)
    assert info.value.__notes__ == [  # type: ignore[attr-defined]
        "1 more wake-up(s) due by 1 raised after it (each ran, and the clock reached 1): "
        "ZeroDivisionError: division by zero"
    ]
    assert clock.now() == 1.0


async def test_a_virtual_clock_whose_advance_was_cancelled_advances_from_there() -> None:
    clock = VirtualClock()
    advancing = asyncio.ensure_future(clock.advance(1))
    clock.call_at(0.5, advancing.cancel)
    with pytest.raises(asyncio.CancelledError):
        await advancing
    assert clock.now() == 0.5  # where it was cancelled
    await clock.advance(0.25)
    assert clock.now() == 0.75


async def test_a_virtual_clock_advance_cancelled_after_a_wake_up_raised_reports_it() -> None:
    # before: the advance kept what the wake-up at 0.25 raised to raise it at its end, and
    # being cancelled at 0.5 it never did: the exception was lost, where SystemClock's loop
    # hands it to the exception handler
    with loop_reports() as reported:
        clock = VirtualClock()
        advancing = asyncio.ensure_future(clock.advance(1))
        clock.call_at(0.25, lambda: 1 / 0)
        clock.call_at(0.5, advancing.cancel)
        with pytest.raises(asyncio.CancelledError):
            await advancing
    assert clock.now() == 0.5
    assert [(c["message"], type(c["exception"])) for c in reported] == [
        (
            "Exception in a VirtualClock wake-up, during an advance() that ended with "
            "CancelledError",
            ZeroDivisionError,
        )
    ]


async def test_an_advance_kept_busy_by_retries_without_delay_says_what_to_change() -> None:
    # Before: only "The event loop did not settle within 10000 rounds."
    class FailsAtOnce(AsyncFunction):
        async def async_invoke(self, value):
            raise Flaky("down")

    clock = VirtualClock()
    out, op = make(FailsAtOnce(), clock, timeout=10, retry=RetryStrategy.fixed_delay(100_000, 0))
    await op.open()
    await op.process_element(StreamRecord("a"))
    with pytest.raises(RuntimeError, match="did not settle within 10000 rounds") as info:
        await clock.advance(1)
    assert "retries without a delay of a call that fails at once" in str(info.value)
    assert "give the RetryStrategy a delay" in str(info.value)
    await op.close()


async def test_a_virtual_clock_refuses_an_advance_while_another_runs() -> None:
    # before: both ran, each from where time stood when it began (two advance(1) reached
    # 1.0), the first failing with settle()'s "did not settle within 10000 rounds"; and
    # as they ended out of order the clock kept the first's error list, where every later
    # wake-up's exception went, outside any advance too: lost, not to the loop's handler
    with loop_reports() as reported:
        clock = VirtualClock()
        first = asyncio.ensure_future(clock.advance(1))
        await asyncio.sleep(0)  # the first is running
        with pytest.raises(RuntimeError) as info:
            await clock.advance(1)
        assert str(info.value) == (
            "advance() was called while another advance() of this clock was running; await "
            "each advance() before starting the next."
        )
        await first
        assert clock.now() == 1.0
        clock.call_at(clock.now(), lambda: 1 / 0)  # no advance runs: the loop reports it
        await settle()
    assert [type(c["exception"]) for c in reported] == [ZeroDivisionError]
    await clock.advance(1)
    assert clock.now() == 2.0


async def test_a_virtual_clock_runs_a_wake_up_already_due_without_an_advance() -> None:
    # As SystemClock (asyncio's call_at) does; before, a zero delay waited for the test's
    # next advance, so a retry with no backoff was not made until then.
    for clock in (SystemClock(), VirtualClock(7)):
        fired: list = []
        clock.call_at(clock.now(), lambda: fired.append("now"))  # noqa: B023
        clock.call_at(clock.now() - 1, lambda: fired.append("past"))  # noqa: B023
        clock.call_at(clock.now() - 1, lambda: fired.append("cancelled")).cancel()  # noqa: B023
        await settle()
        assert fired == ["past", "now"], clock  # earliest deadline first
    assert clock.now() == 7


async def test_a_retry_without_backoff_is_made_on_a_virtual_clock_without_an_advance() -> None:
    clock, fn, out, op = await running_a(RetryStrategy.fixed_delay(3, 0), timeout=10)
    fn.fail("a", Flaky("once"))
    await settle()
    assert fn.calls == ["a", "a"]
    fn.complete("a", ["A"])
    await op.finish()
    await op.close()
    assert [e.value for e in out] == ["A"]


@pytest.mark.parametrize("start", [math.nan, math.inf, "0"])
def test_a_virtual_clock_starts_at_a_finite_time(start) -> None:
    with pytest.raises(ValueError, match="A virtual clock starts at a finite number of seconds"):
        VirtualClock(start)


async def test_a_controlled_function_says_why_no_call_of_a_value_is_waiting() -> None:
    # before: "No call for 'a' is waiting (calls so far: ['a'])", whatever had become of it
    clock, fn, out, op = await timed_out_a()
    fn.complete_timeout("a", ["fallback"])  # decides "a": its attempt is cancelled
    await settle()
    with pytest.raises(
        AssertionError,
        match=r"^No call for 'a' is waiting: of its 1 call, 1 was cancelled \(the operator "
        r"cancels a call once another outcome, such as its timeout, decides its element, and "
        r"when it closes\)\.$",
    ):
        fn.complete("a", ["A"])
    with pytest.raises(
        AssertionError,
        match=r"^No timeout handler for 'a' is waiting: of its 1 timeout handler, 1 was "
        r"completed or failed by the test\.$",
    ):
        fn.complete_timeout("a", ["again"])
    with pytest.raises(
        AssertionError,
        match=r"^No call for 'b' is waiting: there has been none \(call values so far: "
        r"\['a'\]\)\. A call is made once the event loop runs the element's task: await "
        r"settle\(\) after process_element\(\)\.$",
    ):
        fn.fail("b", Fatal("never called"))
    with pytest.raises(
        AssertionError,
        match=r"^No timeout handler for 'b' is waiting: there has been none \(timeout handler "
        r"values so far: \['a'\]\)\. A timeout handler is called once the operator's clock "
        r"reaches the element's deadline \(a VirtualClock's: await clock\.advance\(\.\.\.\) "
        r"to it\)\.$",
    ):
        fn.complete_timeout("b", ["fallback"])
    await op.finish()
    await op.close()
    assert [e.value for e in out] == ["fallback"]


async def test_a_controlled_function_completed_before_its_call_ran_says_to_settle() -> None:
    # before: only "there has been none (call values so far: [])": process_element() starts
    # the call's task, which makes the call when the event loop runs it
    fn = ControlledFunction()
    out, op = make(fn, VirtualClock())
    await op.open()
    await op.process_element(StreamRecord("a"))
    with pytest.raises(AssertionError, match=r"await settle\(\) after process_element\(\)\.$"):
        fn.complete("a", ["A"])
    await settle()
    fn.complete("a", ["A"])
    await op.finish()
    await op.close()
    assert [e.value for e in out] == ["A"]


async def test_a_controlled_function_tells_equal_values_of_other_types_apart() -> None:
    # before: 1, 1.0 and True were one value: complete(True, ...) completed the call with 1,
    # and pending(1.0) counted it
    fn = ControlledFunction()
    out, op = make(fn, VirtualClock())
    await op.open()
    for value in (1, True):
        await op.process_element(StreamRecord(value))
    await settle()
    assert (fn.pending(1), fn.pending(True), fn.pending(1.0)) == (1, 1, 0)
    assert fn.pending_values() == [1, True]
    with pytest.raises(
        AssertionError,
        match=r"^No call for 1\.0 is waiting: there has been none \(call values so far: "
        r"\[1, True\]\)\. Calls are matched by value and type: 1 \(int\) equals 1\.0 \(float\) "
        r"but is not the same call\.$",
    ):
        fn.complete(1.0, ["float"])
    fn.complete(True, ["bool"])
    fn.complete(1, ["int"])
    await op.finish()
    await op.close()
    assert [e.value for e in out] == ["int", "bool"]


async def test_a_controlled_function_refuses_an_unhashable_value_saying_why() -> None:
    # before: the element failed with the function's "unhashable type: 'dict'", as if the
    # function under test had failed, and pending({...}) raised the same bare TypeError
    fn = ControlledFunction()
    out, op = make(fn, VirtualClock())
    await op.open()
    await op.process_element(StreamRecord({"id": 1}))
    await settle()
    unhashable = (
        r"^ControlledFunction matches calls by their value, which must be hashable; {}\(\) "
        r"got dict \{{'id': 1\}}\. To match dict rows by a field, override async_invoke to "
        r"call super\(\)\.async_invoke\(value\['id'\]\)\.$"
    )
    with pytest.raises(TypeError, match=unhashable.format("pending")):
        fn.pending({"id": 1})
    with pytest.raises(TypeError, match=unhashable.format("complete")):
        fn.complete({"id": 1}, [])
    with pytest.raises(AsyncFunctionError) as failed:  # the element's failure says why
        await op.finish()
    await op.close()
    assert re.match(unhashable.format("async_invoke"), str(failed.value.__cause__))
    assert (fn.calls, out) == ([], [])


async def a_call_waiting_for_the_test() -> tuple[ControlledFunction, list, AsyncWaitOperator]:
    """An open operator whose ControlledFunction has a call for "a" waiting."""
    fn = ControlledFunction()
    out, op = make(fn, VirtualClock())
    await op.open()
    await op.process_element(StreamRecord("a"))
    await settle()
    return fn, out, op


@pytest.mark.parametrize(
    ("results", "named"), [("AB", "str 'AB'"), (None, "NoneType None"), (3, "int 3")]
)
async def test_a_controlled_function_refuses_results_that_are_not_a_list_of_them(
    results, named
) -> None:
    # before: "AB" was split into the results "A" and "B" (an async function returning it
    # is refused by the operator); None failed with "'NoneType' object is not iterable"
    fn, out, op = await a_call_waiting_for_the_test()
    with pytest.raises(
        TypeError,
        match=rf"^complete\(\) takes an iterable of results \(\[result\] for one, \[\] for "
        rf"none\); got {re.escape(named)}\. To make the call raise, use fail\(\)\.$",
    ):
        fn.complete("a", results)
    assert fn.pending("a") == 1  # still waiting for the test
    fn.complete("a", ["AB"])
    await op.finish()
    await op.close()
    assert [e.value for e in out] == ["AB"]


@pytest.mark.parametrize(("error", "named"), [("down", "str 'down'"), (None, "NoneType None")])
async def test_a_controlled_function_refuses_to_fail_a_call_with_what_is_no_exception(
    error, named
) -> None:
    # before: asyncio's "TypeError: invalid exception object", which names neither the
    # argument nor what to pass
    fn, out, op = await a_call_waiting_for_the_test()
    with pytest.raises(
        TypeError,
        match=rf"^fail\(\) takes the exception the call raises, e\.g\. OSError\('down'\); got "
        rf"{re.escape(named)}\. To make the call return results, use complete\(\)\.$",
    ):
        fn.fail("a", error)
    assert fn.pending("a") == 1  # still waiting for the test
    fn.fail("a", KeyError)  # an exception type: asyncio makes the exception
    await settle()
    assert isinstance(op.failure, AsyncFunctionError)
    assert isinstance(op.failure.__cause__, KeyError)
    await op.close()


async def test_a_controlled_timeout_handler_refuses_results_that_are_not_a_list_of_them() -> None:
    clock, fn, out, op = await timed_out_a()
    with pytest.raises(
        TypeError,
        match=r"^complete_timeout\(\) takes an iterable of results .*; got str 'fallback'\. To "
        r"make the call raise, use fail_timeout\(\)\.$",
    ):
        fn.complete_timeout("a", "fallback")
    with pytest.raises(
        TypeError,
        match=r"^fail_timeout\(\) takes the exception the call raises, .*; got str 'no'\. To "
        r"make the call return results, use complete_timeout\(\)\.$",
    ):
        fn.fail_timeout("a", "no")
    fn.complete_timeout("a", ["fallback"])
    await op.finish()
    await op.close()
    assert [e.value for e in out] == ["fallback"]
