"""The operator contract, run over both output modes with a test-controlled function.

The test decides when and in which order each call completes; the exact emitted sequences
(records and watermarks) are asserted.
"""

from __future__ import annotations

import asyncio
import functools
import json
import linecache
import re
import sys
import time
import traceback
import types

import pytest

from stateful_async import (
    AsyncFunction,
    AsyncFunctionError,
    AsyncWaitOperator,
    ConfigurationError,
    InvalidResultError,
    OperatorStateError,
    OutputMode,
    ResultSchemaError,
    RetryStrategy,
    StreamRecord,
    ThreadPoolAsyncFunction,
    TimeoutHandlerError,
    Watermark,
)
from stateful_async._function import as_async_function
from stateful_async.testing import ControlledFunction, VirtualClock, settle

MODES = [OutputMode.ORDERED, OutputMode.UNORDERED]


def make(mode: OutputMode, capacity: int = 10, **kwargs):
    fn = ControlledFunction()
    out: list = []
    op = AsyncWaitOperator(fn, out.append, mode, capacity=capacity, **kwargs)
    return fn, out, op


def values(out: list) -> list:
    """Emitted elements as plain values: record values, and ('wm', ts) for watermarks."""
    return [("wm", e.timestamp) if isinstance(e, Watermark) else e.value for e in out]


async def feed(op: AsyncWaitOperator, items: list) -> None:
    for item in items:
        if isinstance(item, Watermark):
            await op.process_watermark(item)
        else:
            await op.process_element(StreamRecord(item))


# -- ordering ------------------------------------------------------------------------------


async def test_ordered_emits_in_input_order_whatever_the_completion_order() -> None:
    fn, out, op = make(OutputMode.ORDERED)
    await op.open()
    await feed(op, ["a", "b", "c", "d"])
    await settle()
    for value in ["d", "b", "c"]:
        fn.complete(value, [value.upper()])
    await settle()
    assert out == []  # "a" is still pending and holds everything back
    fn.complete("a", ["A"])
    await settle()
    assert values(out) == ["A", "B", "C", "D"]


async def test_unordered_without_watermarks_emits_in_completion_order() -> None:
    fn, out, op = make(OutputMode.UNORDERED)
    await op.open()
    await feed(op, ["a", "b", "c", "d"])
    await settle()
    for value in ["c", "a", "d", "b"]:
        fn.complete(value, [value.upper()])
        await settle()
    assert values(out) == ["C", "A", "D", "B"]


async def test_ordered_watermarks_keep_their_position() -> None:
    fn, out, op = make(OutputMode.ORDERED)
    await op.open()
    await feed(op, ["a", Watermark(10), "b", Watermark(20), "c"])
    await settle()
    fn.complete("c", ["C"])
    fn.complete("b", ["B"])
    await settle()
    assert out == []
    fn.complete("a", ["A"])
    await settle()
    assert values(out) == ["A", ("wm", 10), "B", ("wm", 20), "C"]


async def test_unordered_records_never_cross_a_watermark() -> None:
    fn, out, op = make(OutputMode.UNORDERED)
    await op.open()
    await feed(op, ["a", "b", Watermark(10), "c", "d", Watermark(20), "e"])
    await settle()
    # Everything after the first watermark completes first: none of it may overtake it.
    for value in ["e", "d", "c"]:
        fn.complete(value, [value.upper()])
    await settle()
    assert out == []
    fn.complete("b", ["B"])
    await settle()
    assert values(out) == ["B"]
    fn.complete("a", ["A"])
    await settle()
    # "a" leaves, then the watermark, then the next segment in completion order (d before c),
    # then the second watermark, then "e".
    assert values(out) == ["B", "A", ("wm", 10), "D", "C", ("wm", 20), "E"]


@pytest.mark.parametrize("mode", MODES)
async def test_a_watermark_with_nothing_ahead_leaves_at_once(mode: OutputMode) -> None:
    fn, out, op = make(mode)
    await op.open()
    await op.process_watermark(Watermark(5))
    # Emitted before process_watermark returned: no loop iteration needed.
    assert values(out) == [("wm", 5)]


@pytest.mark.parametrize("mode", MODES)
async def test_watermark_waits_for_every_record_before_it(mode: OutputMode) -> None:
    fn, out, op = make(mode)
    await op.open()
    await feed(op, ["a", Watermark(5)])
    await settle()
    assert out == []
    fn.complete("a", ["A"])
    await settle()
    assert values(out) == ["A", ("wm", 5)]


@pytest.mark.parametrize("mode", MODES)
async def test_results_carry_the_input_timestamp_and_can_be_many_or_none(mode: OutputMode) -> None:
    fn, out, op = make(mode)
    await op.open()
    await op.process_element(StreamRecord("a", timestamp=100))
    await op.process_element(StreamRecord("b", timestamp=200))
    await settle()
    fn.complete("a", ["a1", "a2", "a3"])
    await settle()
    fn.complete("b", [])
    await settle()
    assert out == [
        StreamRecord("a1", 100),
        StreamRecord("a2", 100),
        StreamRecord("a3", 100),
    ]
    assert op.metrics.results_out == 3


# -- capacity and backpressure -------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_process_element_waits_for_capacity_while_completions_keep_running(
    mode: OutputMode,
) -> None:
    fn, out, op = make(mode, capacity=2)
    await op.open()
    await feed(op, ["a", "b"])
    third = asyncio.ensure_future(op.process_element(StreamRecord("c")))
    await settle()
    assert not third.done()  # full: waits
    assert op.in_flight == 2
    assert fn.calls == ["a", "b"]  # "c" has not been invoked
    fn.complete("a", ["A"])  # a completion and its emission run while "c" waits
    await settle()
    assert third.done()
    assert values(out) == ["A"]
    assert fn.calls == ["a", "b", "c"]
    assert op.in_flight == 2


@pytest.mark.parametrize("mode", MODES)
async def test_a_finished_result_waiting_for_an_earlier_one_keeps_its_entry_in_ordered_mode(
    mode: OutputMode,
) -> None:
    # What README "Choosing capacity for ordered output" rests on: in ordered mode a
    # slow head holds back the calls behind it, in unordered mode it does not.
    fn, out, op = make(mode, capacity=2)
    await op.open()
    await feed(op, ["slow", "fast"])
    await settle()
    fn.complete("fast", ["FAST"])
    await settle()
    third = asyncio.ensure_future(op.process_element(StreamRecord("next")))
    await settle()
    if mode is OutputMode.ORDERED:
        assert values(out) == []  # "FAST" waits for "slow", in the queue
        assert not third.done()
        assert fn.calls == ["slow", "fast"]
        assert (op.calls_in_flight, op.in_flight) == (1, 2)  # one call, yet the queue is full
        fn.complete("slow", ["SLOW"])
        await settle()
        assert values(out) == ["SLOW", "FAST"]
    else:
        assert values(out) == ["FAST"]
    assert third.done()
    assert fn.calls == ["slow", "fast", "next"]


# -- max_in_flight: calls in flight bounded apart from the queue -----------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_max_in_flight_bounds_the_calls_and_starts_them_in_input_order(
    mode: OutputMode,
) -> None:
    fn, out, op = make(mode, capacity=5, max_in_flight=2)
    assert op.max_in_flight == 2
    await op.open()
    await feed(op, ["a", "b", "c", "d", "e"])  # all five enter the queue at once
    await settle()
    assert (op.in_flight, op.calls_in_flight) == (5, 2)
    assert fn.calls == ["a", "b"]
    fn.complete("b", ["B"])
    await settle()
    assert fn.calls == ["a", "b", "c"]  # b's slot goes to the oldest waiting element
    fn.complete("a", ["A"])
    await settle()
    assert fn.calls == ["a", "b", "c", "d"]
    assert sorted(fn.pending_values()) == ["c", "d"]
    assert values(out) == (["A", "B"] if mode is OutputMode.ORDERED else ["B", "A"])
    for value in ["d", "c", "e"]:
        await settle()
        fn.complete(value, [value.upper()])
    finish = asyncio.ensure_future(op.finish())
    await settle()
    assert finish.done()
    assert fn.calls == ["a", "b", "c", "d", "e"]
    if mode is OutputMode.ORDERED:
        assert values(out) == ["A", "B", "C", "D", "E"]
    else:
        assert values(out) == ["B", "A", "D", "C", "E"]


async def test_max_in_flight_keeps_calls_going_while_finished_results_wait_in_order() -> None:
    # The case it is for: a slow head in ordered mode. With capacity alone (the test above
    # on "slow", "fast") the queue fills with finished results and calls stop; with capacity
    # above max_in_flight, calls stay at max_in_flight while finished results wait.
    fn, out, op = make(OutputMode.ORDERED, capacity=6, max_in_flight=2)
    await op.open()
    await feed(op, ["slow", "b", "c", "d", "e", "f"])
    await settle()
    for value in ["b", "c", "d", "e"]:
        fn.complete(value, [value.upper()])
        await settle()
        assert len(fn.pending_values()) == op.calls_in_flight == 2  # "slow" and the next
    assert fn.calls == ["slow", "b", "c", "d", "e", "f"]
    assert values(out) == []  # everything waits for "slow", in order
    seventh = asyncio.ensure_future(op.process_element(StreamRecord("g")))
    await settle()
    assert not seventh.done()  # capacity still bounds the queue
    fn.complete("slow", ["SLOW"])
    await settle()
    assert seventh.done()
    assert values(out) == ["SLOW", "B", "C", "D", "E"]
    assert fn.calls[-1] == "g"


async def test_with_max_in_flight_the_timeout_starts_with_the_first_call() -> None:
    clock = VirtualClock()
    fn, out, op = make(OutputMode.ORDERED, capacity=3, max_in_flight=1, timeout=5, clock=clock)
    await op.open()
    await feed(op, ["a", "b"])
    await settle()
    await clock.advance(4)  # "b" has waited 4 s for a slot: not its time
    fn.complete("a", ["A"])
    await settle()
    assert fn.calls == ["a", "b"]
    await clock.advance(4.5)  # 8.5 s after "b" entered the queue, 4.5 s after its call started
    await settle()
    assert fn.pending("b") == 1
    assert op.failure is None
    await clock.advance(0.5)
    await settle()
    assert "did not complete within the 5 s timeout" in str(op.failure)
    await op.close()


async def test_a_retry_backoff_keeps_its_call_slot() -> None:
    clock = VirtualClock()
    fn, out, op = make(
        OutputMode.UNORDERED,
        capacity=3,
        max_in_flight=1,
        timeout=60,
        retry=RetryStrategy.fixed_delay(3, 2.0),
        clock=clock,
    )
    await op.open()
    await feed(op, ["a", "b"])
    await settle()
    fn.fail("a", ConnectionError("reset"))
    await settle()
    assert fn.calls == ["a"]  # "a" waits 2 s to retry, still holding the one slot
    await clock.advance(2)
    await settle()
    assert fn.calls == ["a", "a"]
    fn.complete("a", ["A"])
    await settle()
    assert fn.calls == ["a", "a", "b"]
    fn.complete("b", ["B"])
    await op.finish()
    assert values(out) == ["A", "B"]
    await op.close()


@pytest.mark.parametrize("mode", MODES)
async def test_elements_waiting_for_a_call_slot_are_in_snapshots_and_restored(
    mode: OutputMode,
) -> None:
    fn, out, op = make(mode, capacity=4, max_in_flight=1)
    await op.open()
    await feed(op, ["a", Watermark(1), "b", "c"])
    await settle()
    assert fn.calls == ["a"]
    snapshot = op.snapshot_state(1)
    assert [("wm", e.timestamp) if isinstance(e, Watermark) else e.value for e in snapshot] == [
        "a",
        ("wm", 1),
        "b",
        "c",
    ]
    await op.close()
    assert fn.calls == ["a"]  # closed: the waiting ones are never called

    fn2, out2, op2 = make(mode, capacity=2, max_in_flight=1)  # fewer slots than restored
    opening = asyncio.ensure_future(op2.open(restored=snapshot))
    for value in ["a", "b", "c"]:
        await settle()
        assert fn2.pending_values() == [value]
        fn2.complete(value, [value.upper()])
    await settle()
    assert opening.done()
    await op2.finish()
    assert values(out2) == ["A", ("wm", 1), "B", "C"]
    assert fn2.calls == ["a", "b", "c"]


async def test_slots_are_handed_over_in_a_loop_not_one_nested_call_per_waiting_element() -> None:
    # With an eager task factory (Python 3.12+) a call that finishes without suspending is
    # decided while it is being started, inside the hand-over of the slot it took. Emulated
    # here (this may run on 3.11): calls after the first run to the end as they start.
    gate = asyncio.Event()

    async def fn(value):
        if value == 0:
            await gate.wait()
        return [value]

    out: list = []
    waiting = 3 * sys.getrecursionlimit()
    op = AsyncWaitOperator(
        fn, out.append, OutputMode.ORDERED, capacity=waiting + 1, max_in_flight=1
    )
    await op.open()
    real = op._new_task

    def eager(coro):
        if coro.cr_frame.f_locals["handler"].element.value == 0:
            return real(coro)
        done = asyncio.get_running_loop().create_future()
        with pytest.raises(StopIteration):
            coro.send(None)
        done.set_result(None)
        return done

    op._new_task = eager
    await feed(op, range(waiting + 1))
    gate.set()
    await asyncio.wait_for(op.finish(), 30)  # nested, it overflowed the stack and hung here
    assert values(out) == list(range(waiting + 1))
    await op.close()


async def test_elements_waiting_for_a_call_slot_are_never_called_after_a_failure() -> None:
    fn, out, op = make(OutputMode.ORDERED, capacity=4, max_in_flight=1)
    await op.open()
    await feed(op, ["a", "b", "c"])
    await settle()
    fn.fail("a", ValueError("bad row"))
    await settle()
    assert isinstance(op.failure, AsyncFunctionError)
    assert fn.calls == ["a"]
    assert op.metrics.attempts == 1  # "b" was not started (and cancelled) either
    await op.close()
    assert fn.calls == ["a"]


@pytest.mark.parametrize("mode", MODES)
async def test_watermarks_take_capacity(mode: OutputMode) -> None:
    fn, out, op = make(mode, capacity=2)
    await op.open()
    await feed(op, ["a", Watermark(1)])
    blocked = asyncio.ensure_future(op.process_element(StreamRecord("b")))
    await settle()
    assert not blocked.done()
    assert op.in_flight == 2
    fn.complete("a", ["A"])
    await settle()
    assert blocked.done()
    assert values(out) == ["A", ("wm", 1)]


@pytest.mark.parametrize("mode", MODES)
async def test_queue_never_exceeds_capacity(mode: OutputMode) -> None:
    sizes: list[int] = []

    class Probe(AsyncFunction):
        async def async_invoke(self, value):
            sizes.append(op.in_flight)
            await asyncio.sleep(0)
            return [value]

    out: list = []
    op = AsyncWaitOperator(Probe(), out.append, mode, capacity=7)
    async with op:
        for i in range(200):
            await op.process_element(StreamRecord(i))
            sizes.append(op.in_flight)
        await op.finish()
    assert max(sizes) == 7
    assert sorted(values(out)) == list(range(200))


async def test_emission_is_one_queue_entry_per_mail() -> None:
    fn, out, op = make(OutputMode.ORDERED)
    await op.open()
    await feed(op, [0, 1, 2, 3, 4])
    await settle()
    for value in [1, 2, 3, 4]:
        fn.complete(value, [value])
    await settle()
    fn.complete(0, [0])
    seen = []
    for _ in range(50):
        await asyncio.sleep(0)
        seen.append(len(out))
        if len(out) == 5:
            break
    # Four entries became ready at once, but each loop iteration emitted at most one.
    assert seen[-1] == 5
    assert all(b - a <= 1 for a, b in zip(seen, seen[1:], strict=False))
    assert len(set(seen)) >= 5


# -- snapshot and restore ------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_snapshot_returns_unemitted_inputs_in_queue_order(mode: OutputMode) -> None:
    fn, out, op = make(mode)
    await op.open()
    await feed(op, ["a", "b", Watermark(7), "c"])
    await settle()
    fn.complete("b", ["B"])  # completed but held back (ordered: by "a"; unordered: "a" too,
    await settle()  # in the unordered mode "B" leaves)
    snap = op.snapshot_state(checkpoint_id=1)
    if mode is OutputMode.ORDERED:
        assert snap == [StreamRecord("a"), StreamRecord("b"), Watermark(7), StreamRecord("c")]
        assert out == []
    else:
        assert snap == [StreamRecord("a"), Watermark(7), StreamRecord("c")]
        assert values(out) == ["B"]
    # Each snapshot stands alone: a second one reflects the current queue only.
    fn.complete("a", ["A"])
    await settle()
    assert op.snapshot_state(checkpoint_id=2) == [StreamRecord("c")]


@pytest.mark.parametrize("mode", MODES)
async def test_snapshot_never_blocks_on_a_full_queue(mode: OutputMode) -> None:
    fn, out, op = make(mode, capacity=2)
    await op.open()
    await feed(op, ["a", "b"])
    blocked = asyncio.ensure_future(op.process_element(StreamRecord("c")))
    await settle()
    assert not blocked.done()
    assert op.snapshot_state(1) == [StreamRecord("a"), StreamRecord("b")]
    blocked.cancel()


@pytest.mark.parametrize("mode", MODES)
async def test_restore_reinvokes_records_and_replays_watermarks_before_new_input(
    mode: OutputMode,
) -> None:
    fn, out, op = make(mode)
    await op.open()
    await feed(op, ["a", Watermark(3), "b"])
    await settle()  # "a" stays pending, so the watermark behind it is not emitted
    saved = op.snapshot_state(1)
    assert saved == [StreamRecord("a"), Watermark(3), StreamRecord("b")]
    await op.close()
    assert out == []

    fn2 = ControlledFunction()
    out2: list = []
    op2 = AsyncWaitOperator(fn2, out2.append, mode, capacity=10)
    await op2.open(restored=saved)
    await op2.process_element(StreamRecord("new"))
    await settle()
    assert fn2.calls == ["a", "b", "new"]  # restored records first, attempt 1 each
    for value in ("new", "b", "a"):  # completing last-first: the watermark still holds
        fn2.complete(value, [value.upper()])
    await settle()
    if mode is OutputMode.ORDERED:
        assert values(out2) == ["A", ("wm", 3), "B", "NEW"]
    else:  # nothing after the restored watermark overtakes it
        assert values(out2) == ["A", ("wm", 3), "NEW", "B"]
    await op2.close()


@pytest.mark.parametrize("mode", MODES)
async def test_restoring_more_elements_than_capacity_does_not_deadlock(mode: OutputMode) -> None:
    saved = [StreamRecord(i) for i in range(50)] + [Watermark(99)] + [StreamRecord(50)]

    async def double(value: int) -> list[int]:
        await asyncio.sleep(0)
        return [value * 2]

    out: list = []
    op = AsyncWaitOperator(double, out.append, mode, capacity=3)
    # The wall-clock bound only turns a deadlock into a failure; nothing waits on it.
    await asyncio.wait_for(op.open(restored=saved), timeout=10)
    await asyncio.wait_for(op.finish(), timeout=10)
    await op.close()
    records = [e.value for e in out if isinstance(e, StreamRecord)]
    assert sorted(records[:50]) == [i * 2 for i in range(50)]
    assert values(out)[50:] == [("wm", 99), 100]
    assert op.metrics.restored == 52


# -- failure -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_a_failure_names_the_element_and_keeps_what_was_emitted(mode: OutputMode) -> None:
    fn, out, op = make(mode)
    await op.open()
    await feed(op, ["a", "b", "c"])
    await settle()
    fn.complete("a", ["A"])
    await settle()
    fn.fail("b", ConnectionError("service down"))
    await settle()
    assert values(out) == ["A"]
    assert fn.pending("c") == 0  # the failed operator cancelled the rest
    with pytest.raises(AsyncFunctionError) as info:
        await op.process_element(StreamRecord("d"))
    message = str(info.value)
    assert "StreamRecord('b')" in message
    assert "after 1 attempt" in message
    assert "ConnectionError: service down" in message
    assert isinstance(info.value.__cause__, ConnectionError)
    assert info.value.element == StreamRecord("b")
    with pytest.raises(AsyncFunctionError):
        await op.finish()
    with pytest.raises(OperatorStateError, match="has failed"):
        op.snapshot_state(5)
    await op.close()
    assert fn.closed == 1


async def test_a_failure_says_which_line_of_the_function_raised() -> None:
    async def parse(value):
        payload = {"id": value}
        return [payload["score"]]  # raises KeyError here

    async def decode(value):
        return [json.loads(value)]  # json raises deep inside the standard library

    for fn, line in ((parse, 'payload["score"]'), (decode, "json.loads(value)")):
        op = AsyncWaitOperator(fn, lambda e: None, capacity=2)
        await op.open()
        await op.process_element(StreamRecord("not json"))
        with pytest.raises(AsyncFunctionError) as info:
            await op.finish()
        await op.close()
        where = re.search(r"\(raised at (.+):(\d+), in (\w+)\)\. Fix the cause", str(info.value))
        assert where, str(info.value)
        assert where[1] == __file__ and where[3] == fn.__name__
        assert line in linecache.getline(__file__, int(where[2]))


async def test_a_failure_wakes_a_call_waiting_for_capacity() -> None:
    fn, out, op = make(OutputMode.ORDERED, capacity=1)
    await op.open()
    await op.process_element(StreamRecord("a"))
    waiting = asyncio.ensure_future(op.process_element(StreamRecord("b")))
    await settle()
    fn.fail("a", ValueError("bad"))
    await settle()
    with pytest.raises(AsyncFunctionError, match="StreamRecord\\('a'\\)"):
        await waiting


@pytest.mark.parametrize("bad", [{"k": 1}, None, "text", 42])
async def test_a_result_that_is_not_an_iterable_of_results_is_a_clear_error(bad) -> None:
    async def wrong(value):
        return bad

    op = AsyncWaitOperator(wrong, lambda e: None, capacity=2)
    await op.open()
    await op.process_element(StreamRecord(1))
    await settle()
    with pytest.raises(InvalidResultError, match="Return a list: \\[result\\]"):
        await op.finish()
    await op.close()


@pytest.mark.parametrize(
    "bad",
    [bytearray(b"ab"), memoryview(b"ab"), types.MappingProxyType({"k": 1})],
    ids=["bytearray", "memoryview", "mapping"],
)
@pytest.mark.parametrize("through_threads", [False, True], ids=["async", "thread_pool"])
async def test_bytes_like_and_mapping_results_are_refused_not_split(bad, through_threads) -> None:
    # bytes and dicts were refused, but a bytearray or memoryview was emitted as its
    # integers, and a mapping that is not a dict as its keys.
    async def wrong(value):
        return bad

    fn = ThreadPoolAsyncFunction(lambda value: bad, max_workers=1) if through_threads else wrong
    out: list = []
    op = AsyncWaitOperator(fn, out.append, capacity=2)
    await op.open()
    await op.process_element(StreamRecord(1))
    with pytest.raises(InvalidResultError) as info:
        await asyncio.wait_for(op.finish(), 5.0)
    assert f"returned {type(bad).__name__} instead of an iterable of results" in str(info.value)
    assert "Return a list: [result] for one result" in str(info.value)
    assert out == []
    await op.close()


async def test_a_coroutine_returned_as_the_result_asks_whether_await_was_forgotten() -> None:
    # It was refused as "returned coroutine, which is not iterable", which does not say that
    # an `await` is missing, and the coroutine was left to warn "was never awaited" later.
    returned: list = []

    async def lookup(value):
        return [value]

    async def forgot_await(value):
        returned.append(lookup(value))
        return returned[-1]

    op = AsyncWaitOperator(
        forgot_await, lambda e: None, timeout=10, retry=RetryStrategy.fixed_delay(3, 0)
    )
    await op.open()
    await op.process_element(StreamRecord(1))
    with pytest.raises(InvalidResultError) as info:
        await asyncio.wait_for(op.finish(), 5.0)
    message = str(info.value)
    assert "The async function returned coroutine " in message
    assert "lookup, an awaitable, instead of an iterable of results" in message
    assert "Did you forget `await`?" in message
    assert len(returned) == 1  # a programming error: not retried
    assert returned[0].cr_frame is None  # closed: no "was never awaited" warning later
    await op.close()


class _Abort(BaseException):
    pass


@pytest.mark.parametrize("timeout", [None, 10.0])
@pytest.mark.parametrize("raised", [asyncio.CancelledError, _Abort])
async def test_an_output_that_raises_a_base_exception_fails_the_operator(timeout, raised) -> None:
    # The entry was already taken from the queue: an operator left running would wait for it
    # in finish() forever.
    seen = []

    def bad_output(element):
        seen.append(element.value)
        raise raised("sink gone")

    op = AsyncWaitOperator(_noop, bad_output, capacity=4, timeout=timeout)
    await op.open()
    await op.process_element(StreamRecord(1))
    with pytest.raises(OperatorStateError, match=f"output raised {raised.__name__}: sink gone"):
        await asyncio.wait_for(op.finish(), 5)
    assert seen == [1]
    await op.close()


@pytest.mark.parametrize("mode", MODES)
async def test_an_output_that_raises_names_what_it_was_emitting(mode: OutputMode) -> None:
    # It said "while emitting the results of an element" for a watermark too, and named
    # neither the element nor what to fix.
    fix = (
        "; the operator has failed. Fix the output callable: it must accept every emitted "
        "StreamRecord and Watermark without raising."
    )
    for refused, emitting in (
        (Watermark, "Watermark(7)"),
        (StreamRecord, "a result of element StreamRecord('a', timestamp=5)"),
    ):

        def output(element, refused=refused):  # type: ignore[no-untyped-def]
            if isinstance(element, refused):
                raise ValueError("sink gone")

        op = AsyncWaitOperator(_noop, output, mode)
        await op.open()
        await op.process_element(StreamRecord("a", 5))
        with pytest.raises(OperatorStateError) as info:
            if refused is Watermark:  # the record's result out first, then the watermark
                await settle()
                await op.process_watermark(Watermark(7))  # nothing ahead: emitted, raises
            await op.finish()
        assert str(info.value) == (
            f"The operator's output raised ValueError: sink gone while emitting {emitting}{fix}"
        )
        await op.close()


@pytest.mark.parametrize("mode", MODES)
async def test_an_output_that_refuses_a_watermark_fails_the_call_that_emits_it(
    mode: OutputMode,
) -> None:
    # process_watermark() emitted the watermark itself (nothing was ahead of it), the
    # output raised, and the call returned: only the next call raised the failure, unlike
    # process_element(), which raises it from the call that waits while the output fails.
    def output(element):  # type: ignore[no-untyped-def]
        if isinstance(element, Watermark):
            raise ValueError("sink gone")

    op = AsyncWaitOperator(_noop, output, mode)
    await op.open()
    with pytest.raises(OperatorStateError) as info:
        await op.process_watermark(Watermark(7))
    assert info.value is op.failure
    assert str(info.value).startswith(
        "The operator's output raised ValueError: sink gone while emitting Watermark(7); the "
        "operator has failed."
    )
    assert (op.metrics.watermarks_in, op.metrics.watermarks_out) == (1, 0)
    await op.close()


async def test_an_output_that_refuses_a_result_a_watermark_call_emits_fails_that_call() -> None:
    # A completed result waiting for its emission mail leaves ahead of the watermark, from
    # the process_watermark() call: the output refusing it fails that call too.
    fn = ControlledFunction()
    out: list = []

    def output(element):  # type: ignore[no-untyped-def]
        if isinstance(element, StreamRecord) and element.value == "B":
            raise ValueError("sink gone")
        out.append(element)

    op = AsyncWaitOperator(fn, output, OutputMode.ORDERED)
    await op.open()
    await feed(op, ["a", "b"])
    await settle()
    fn.complete("b", ["B"])
    fn.complete("a", ["A"])
    await asyncio.sleep(0)  # A emitted; B's emission is a mail not run yet
    assert values(out) == ["A"]
    with pytest.raises(OperatorStateError) as info:
        await op.process_watermark(Watermark(7))
    assert info.value is op.failure
    assert str(info.value).startswith(
        "The operator's output raised ValueError: sink gone while emitting a result of element "
        "StreamRecord('b'"
    )
    await settle()
    assert values(out) == ["A"]  # the watermark stays behind the failure
    await op.close()


async def test_close_discards_completed_results_it_has_not_emitted() -> None:
    fn = ControlledFunction()
    out: list = []
    op = AsyncWaitOperator(fn, lambda e: out.append(e.value), OutputMode.ORDERED, capacity=3)
    await op.open()
    for v in "abc":
        await op.process_element(StreamRecord(v))
    await settle()
    for v in "cba":  # b and c wait behind a; a's emission posts a mail for them
        fn.complete(v, [v.upper()])
    await asyncio.sleep(0)
    assert out == ["A"]
    await op.close()
    await settle()
    assert out == ["A"]  # nothing reaches the output after close() returned
    assert fn.closed == 1


# -- construction and lifecycle ------------------------------------------------------------


async def _noop(value):
    return [value]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity": 0}, "capacity must be an integer >= 1"),
        ({"capacity": 2.5}, "capacity must be an integer >= 1"),
        ({"timeout": -1}, "timeout must be a finite number of seconds > 0"),
        ({"timeout": float("inf")}, "timeout must be a finite number of seconds > 0"),
        ({"timeout": 0}, "Use timeout=None for no timeout"),
        ({"timeout": "5"}, "timeout must be a number of seconds, a timedelta, or None"),
        ({"retry": RetryStrategy.fixed_delay(3, 0.1)}, "A retry strategy needs a timeout"),
        ({"mode": "sideways"}, "mode must be OutputMode.ORDERED or OutputMode.UNORDERED"),
        ({"retry": 3, "timeout": 1}, r"retry must be a RetryStrategy; got int\.$"),
        # the class or a factory, not called: "got type" / "got method" said nothing more
        (
            {"retry": RetryStrategy, "timeout": 1},
            r"; got type RetryStrategy: call it, such as retry=RetryStrategy\.fixed_delay\(3, "
            r"0\.5\)\.$",
        ),
        (
            {"retry": RetryStrategy.fixed_delay, "timeout": 1},
            r"; got method RetryStrategy\.fixed_delay: call it, such as ",
        ),
        ({"max_in_flight": 0}, r"from 1 to capacity \(100\), or None for capacity; got 0\.$"),
        ({"capacity": 8, "max_in_flight": 9}, "cannot exceed them: raise capacity too"),
        ({"max_in_flight": 2.0}, "max_in_flight must be an integer"),
        ({"max_in_flight": True}, "max_in_flight must be an integer"),
        # a clock function, not a Clock: it failed at the first element with AttributeError
        ({"timeout": 1, "clock": time.monotonic}, "clock must be a Clock"),
        # the class, not a clock: its now() failed at the first element, which stayed queued
        # without a call or a timer, and finish() never returned
        (
            {"timeout": 1, "clock": VirtualClock},
            r"; got the class VirtualClock: pass an instance, clock=VirtualClock\(\)\.$",
        ),
    ],
)
def test_invalid_arguments_fail_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        AsyncWaitOperator(_noop, lambda e: None, **kwargs)


def test_numpy_numbers_are_taken_as_plain_ones() -> None:
    # Options computed with numpy or pandas (np.int64 is no int) were refused.
    import numpy as np

    op = AsyncWaitOperator(
        _noop, lambda e: None, capacity=np.int64(8), timeout=np.float32(2.5),
        max_in_flight=np.int32(4),
    )  # fmt: skip
    assert (op.capacity, op._max_in_flight, op._timeout) == (8, 4, 2.5)
    assert type(op.capacity) is int and type(op._timeout) is float
    for kwargs in (
        {"capacity": np.bool_(True)},
        {"capacity": np.timedelta64(8, "s")},  # a duration, though numbers.Integral
        {"timeout": np.timedelta64(2, "s")},
    ):
        with pytest.raises(ConfigurationError, match="must be an integer|number of seconds"):
            AsyncWaitOperator(_noop, lambda e: None, **kwargs)
    with pytest.raises(ConfigurationError, match="timeout must be a finite number of seconds"):
        AsyncWaitOperator(_noop, lambda e: None, timeout=10**400)  # no float holds it
    from stateful_async import ThreadPoolAsyncFunction

    assert ThreadPoolAsyncFunction(lambda v: [v], max_workers=np.int64(3)).max_workers == 3


class _Numpy22Bool:
    """A bool scalar as numpy < 2.3 makes it (2.2 is the newest for Python 3.10): an
    index (its __index__ only warns), though no number."""

    dtype = type("dtype", (), {"kind": "b"})()

    def __index__(self) -> int:
        return 1

    def __repr__(self) -> str:
        return "np.True_"


def test_a_numpy_bool_is_refused_where_numpy_takes_it_as_an_index() -> None:
    # Under numpy 2.2 capacity=np.bool_(True) was taken as 1 and a watermark at np.True_ as
    # 1: only numpy 2.3 stopped operator.index() from taking a numpy bool.
    with pytest.raises(ConfigurationError, match="capacity must be an integer >= 1"):
        AsyncWaitOperator(_noop, lambda e: None, capacity=_Numpy22Bool())
    with pytest.raises(ConfigurationError, match="Watermark timestamp must be an integer"):
        Watermark(_Numpy22Bool())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="StreamRecord timestamp must be an integer"):
        StreamRecord("a", _Numpy22Bool())  # type: ignore[arg-type]


def _not_integers() -> list:
    import datetime

    import numpy as np

    return [1.5, 2.0, True, "3", datetime.datetime(2024, 1, 1), np.float64(2.0), np.bool_(1)]


@pytest.mark.parametrize("timestamp", _not_integers(), ids=lambda t: type(t).__name__)
def test_a_watermark_timestamp_that_is_not_an_integer_is_refused_at_construction(
    timestamp,
) -> None:
    # It was accepted and flowed through the operator into snapshots, until writing the
    # checkpoint (an int64 column) failed, far from the mistake.
    with pytest.raises(ConfigurationError) as info:
        Watermark(timestamp)
    assert str(info.value) == (
        "Watermark timestamp must be an integer (event time in your own unit, such as "
        f"milliseconds since the epoch); got {timestamp!r} of type {type(timestamp).__name__}. "
        "Convert it to an int first, e.g. int(moment.timestamp() * 1000) for a datetime."
    )


@pytest.mark.parametrize("timestamp", _not_integers(), ids=lambda t: type(t).__name__)
def test_a_record_timestamp_that_is_not_an_integer_or_none_is_refused_at_construction(
    timestamp,
) -> None:
    with pytest.raises(ConfigurationError) as info:
        StreamRecord("a", timestamp)
    assert str(info.value) == (
        "StreamRecord timestamp must be an integer (event time in your own unit, such as "
        f"milliseconds since the epoch); got {timestamp!r} of type {type(timestamp).__name__}. "
        "Convert it to an int first, e.g. int(moment.timestamp() * 1000) for a datetime, or "
        "pass None for no timestamp."
    )
    assert StreamRecord("a").timestamp is None


@pytest.mark.parametrize("timestamp", [2**63, -(2**63) - 1])
def test_a_timestamp_beyond_64_bits_is_refused_at_construction(timestamp: int) -> None:
    # Checkpoints store timestamps as int64: the write failed with an OverflowError.
    for make_element, cls, what in (
        (Watermark, "Watermark", "a watermark's"),
        (functools.partial(StreamRecord, "a"), "StreamRecord", "a record's"),
    ):
        with pytest.raises(ConfigurationError) as info:
            make_element(timestamp)
        assert str(info.value) == (
            f"{cls} timestamp must fit in a 64-bit signed integer, the type checkpoints store "
            f"{what} timestamp in; got {timestamp}. Event times in milliseconds, microseconds "
            "or even nanoseconds since 1970 fit: check how this one was computed."
        )
    assert Watermark(2**63 - 1).timestamp == 2**63 - 1
    assert StreamRecord("a", -(2**63)).timestamp == -(2**63)


@pytest.mark.parametrize("mode", MODES)
async def test_numpy_integer_timestamps_are_taken_as_plain_ints(mode: OutputMode) -> None:
    # Timestamps computed with numpy or pandas: kept as plain ints, so that snapshots,
    # results and JSON (the CLI's) hold the same values as for Python ints.
    import numpy as np

    fn, out, op = make(mode)
    await op.open()
    await op.process_element(StreamRecord("a", np.int64(7)))
    await op.process_watermark(Watermark(np.int32(6)))
    snapshot = op.snapshot_state(1)
    assert snapshot == [StreamRecord("a", 7), Watermark(6)]
    assert [type(element.timestamp) for element in snapshot] == [int, int]
    assert json.dumps([element.timestamp for element in snapshot]) == "[7, 6]"
    await settle()
    fn.complete("a", ["A"])
    await settle()
    await op.finish()
    assert out == [StreamRecord("A", 7), Watermark(6)]
    assert type(out[0].timestamp) is int
    await op.close()


def test_a_regular_function_is_refused_with_advice() -> None:
    def sync(value):
        return [value]

    with pytest.raises(ConfigurationError, match="ThreadPoolAsyncFunction"):
        AsyncWaitOperator(sync, lambda e: None)


async def test_an_async_def_under_a_wrapping_decorator_is_accepted() -> None:
    # A decorator whose plain 'def' wrapper returns the coroutine (functools.wraps keeps
    # the async def as __wrapped__) was refused as "a regular function".
    calls: list = []

    def logged(fn):
        @functools.wraps(fn)
        def wrapper(*args):
            calls.append(args[-1])
            return fn(*args)

        return wrapper

    @logged
    async def enrich(value):
        return [value * 2]

    class Enrich(AsyncFunction):
        @logged
        async def async_invoke(self, value):
            return [value + 1]

    for fn, expected in ((enrich, [2, 4]), (Enrich(), [2, 3])):
        out: list = []
        op = AsyncWaitOperator(fn, out.append)
        await op.open()
        for value in (1, 2):
            await op.process_element(StreamRecord(value))
        await op.finish()
        await op.close()
        assert [e.value for e in out] == expected
    assert calls == [1, 2, 1, 2]


def test_an_async_function_class_is_refused_asking_for_an_instance() -> None:
    # it was called "a regular function" and sent to ThreadPoolAsyncFunction
    with pytest.raises(
        ConfigurationError,
        match=r"ControlledFunction is an AsyncFunction class; "
        r"pass an instance of it: ControlledFunction\(\.\.\.\)",
    ):
        AsyncWaitOperator(ControlledFunction, lambda e: None)


def test_mode_accepts_its_name() -> None:
    assert AsyncWaitOperator(_noop, print, "unordered").mode is OutputMode.UNORDERED


async def test_lifecycle_misuse_is_reported() -> None:
    fn, out, op = make(OutputMode.ORDERED)
    with pytest.raises(OperatorStateError, match="call 'await open\\(\\)' first"):
        await op.process_element(StreamRecord(1))
    await op.open()
    with pytest.raises(OperatorStateError, match="an operator opens once"):
        await op.open()
    with pytest.raises(ConfigurationError, match="Wrap the value: StreamRecord"):
        await op.process_element(1)  # type: ignore[arg-type]
    await op.finish()
    with pytest.raises(OperatorStateError, match="no more input is accepted"):
        await op.process_element(StreamRecord(1))
    await op.close()
    await op.close()  # idempotent
    assert (fn.opened, fn.closed) == (1, 1)


async def test_a_cancelled_finish_may_be_awaited_again_and_drains() -> None:
    # After asyncio.wait_for(op.finish(), ...) timed out, a second finish() was refused:
    # "finish() was called on an operator that is finishing: ... no more input is
    # accepted", leaving close(), which discards what is in flight, as the only way out.
    fn, out, op = make(OutputMode.ORDERED)
    await op.open()
    await feed(op, ["a", "b"])
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(op.finish(), 0.01)
    fn.complete("a", ["A"])
    with pytest.raises(OperatorStateError, match="no more input is accepted"):
        await op.process_element(StreamRecord("c"))  # still finishing: no input
    again = asyncio.ensure_future(op.finish())
    await settle()
    assert not again.done()  # "b" is still in flight
    with pytest.raises(OperatorStateError, match=r"finish\(\) was called on an operator"):
        await op.finish()  # while another finish() drains: refused as before
    fn.complete("b", ["B"])
    await asyncio.wait_for(again, 5.0)
    assert [e.value for e in out] == ["A", "B"]
    with pytest.raises(OperatorStateError, match="that is finished"):
        await op.finish()  # once finished, as before
    await op.close()


async def test_an_open_cancelled_while_restoring_fails_the_operator() -> None:
    # open() was cancelled while it waited for room to re-add restored elements: the
    # operator stayed open with some of them, took input, and a snapshot returned only
    # those, silently dropping the rest from the next checkpoint.
    fn, out, op = make(OutputMode.ORDERED, capacity=1)
    opening = asyncio.ensure_future(
        op.open([StreamRecord("a"), StreamRecord("b"), StreamRecord("c")])
    )
    await settle()  # "a" re-added; "b" waits for room
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    with pytest.raises(OperatorStateError, match="Cannot take snapshot 1: the operator has failed"):
        op.snapshot_state(1)
    with pytest.raises(OperatorStateError) as info:
        await op.process_element(StreamRecord("d"))
    assert str(info.value).startswith(
        "open() did not finish re-adding the restored elements (CancelledError), so the "
        "operator holds only some of them and has failed"
    )
    await op.close()
    assert fn.closed == 1


async def test_close_without_finish_cancels_in_flight_calls() -> None:
    fn, out, op = make(OutputMode.UNORDERED)
    await op.open()
    await feed(op, ["a", "b"])
    await settle()
    await op.close()
    assert fn.pending_values() == []
    assert out == []


class SlowToCancel(AsyncFunction):
    """Its calls wait until cancelled, then take 50 ms to clean up (a connection handed back
    to its pool); ``log`` records that and its close()."""

    def __init__(self) -> None:
        self.log: list[str] = []

    async def async_invoke(self, value):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)
            self.log.append("call cleaned up")
            raise

    async def close(self):
        self.log.append("fn.close")


async def first_close_waiting_for_a_call() -> tuple[list[str], AsyncWaitOperator, asyncio.Future]:
    """An operator with one call in flight, and its first close() (running) waiting for
    that call, which it cancelled, to clean up."""
    fn = SlowToCancel()
    op = AsyncWaitOperator(fn, lambda e: None)
    await op.open()
    await op.process_element(StreamRecord("a"))
    await settle()
    first = asyncio.ensure_future(op.close())
    await settle()  # the first close() waits for the cancelled call
    return fn.log, op, first


async def test_a_close_while_another_close_runs_returns_once_the_function_is_closed() -> None:
    # The second close() returned at once, while the first still waited for a cancelled
    # call to clean up: the function was not closed yet, and a caller that then ended its
    # loop (asyncio.run) cancelled the first close() before it closed the function.
    log, op, first = await first_close_waiting_for_a_call()
    await asyncio.wait_for(op.close(), 5.0)
    assert log == ["call cleaned up", "fn.close"]
    assert first.done()
    await op.close()  # and once closed, at once
    assert log == ["call cleaned up", "fn.close"]


async def test_a_close_after_a_cancelled_close_closes_the_function_once_its_calls_end() -> None:
    # The first close() was cancelled while it waited for a cancelled call to clean up,
    # before it closed the function; every later close() returned at once, and the
    # function (its connection pool) was never closed.
    log, op, first = await first_close_waiting_for_a_call()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert log == []
    await asyncio.wait_for(op.close(), 5.0)
    assert log == ["call cleaned up", "fn.close"]
    await op.close()  # and once closed, at once
    assert log == ["call cleaned up", "fn.close"]


async def test_two_closes_after_a_cancelled_close_both_return_once_the_function_is_closed() -> None:
    # Both waited for the first close(), which was cancelled; the one that woke first took
    # over its work, and the other returned while the function was still not closed.
    class SlowToClose(SlowToCancel):
        async def close(self):
            await asyncio.sleep(0.05)  # a connection pool that takes a moment to close
            self.log.append("fn.close")

    fn = SlowToClose()
    op = AsyncWaitOperator(fn, lambda e: None)
    await op.open()
    await op.process_element(StreamRecord("a"))
    await settle()
    first = asyncio.ensure_future(op.close())
    await settle()
    second, third = asyncio.ensure_future(op.close()), asyncio.ensure_future(op.close())
    await settle()
    first.cancel()
    await asyncio.wait({second, third}, return_when=asyncio.FIRST_COMPLETED)
    assert fn.log == ["call cleaned up", "fn.close"]
    await asyncio.gather(second, third)
    assert fn.log == ["call cleaned up", "fn.close"]


@pytest.mark.parametrize("how", ["in_its_task", "gather", "wait_for", "create_task"])
async def test_a_close_from_the_functions_own_close_returns_at_once(how: str) -> None:
    # A function that closes its operator from its close(): the inner close() found the
    # operator closing and waited for that close() to return, which waited for the
    # function's close(): it hung for ever. Made in a task the function's close() started
    # (asyncio.gather, wait_for before Python 3.12, create_task), it still hung.
    log: list[str] = []

    class ClosesItsOperator(AsyncFunction):
        operator: AsyncWaitOperator

        async def async_invoke(self, value):
            return [value]

        async def close(self):
            if how == "in_its_task":
                await self.operator.close()
            elif how == "gather":
                await asyncio.gather(self.operator.close())
            elif how == "wait_for":
                await asyncio.wait_for(asyncio.ensure_future(self.operator.close()), 30)
            else:
                await asyncio.get_running_loop().create_task(self.operator.close())
            log.append("fn.close")

    fn = ClosesItsOperator()
    op = fn.operator = AsyncWaitOperator(fn, lambda e: None)
    await op.open()
    await asyncio.wait_for(op.close(), 5.0)
    assert log == ["fn.close"]
    await op.close()
    assert log == ["fn.close"]


async def test_every_close_raises_what_the_functions_close_raised() -> None:
    # Only the close() that ran the function's close() raised its error: one waiting for
    # it, and any later one, returned as if the function had released its clients.
    error = ConnectionError("the pool did not close")

    class BrokenClose(AsyncFunction):
        async def async_invoke(self, value):
            return [value]

        async def close(self):
            await asyncio.sleep(0.01)
            raise error

    op = AsyncWaitOperator(BrokenClose(), lambda e: None)
    await op.open()
    first, waiting = await asyncio.gather(op.close(), op.close(), return_exceptions=True)
    assert first is error
    assert waiting is error
    frames = []
    for _ in range(3):  # each with the traceback of the function's close(), not a longer one
        with pytest.raises(ConnectionError, match="the pool did not close") as raised:
            await op.close()
        frames.append(len(traceback.extract_tb(raised.value.__traceback__)))
    assert frames[0] == frames[1] == frames[2], frames


@pytest.mark.parametrize("decided_by", ["the timeout handler", "the attempt"])
async def test_close_waits_for_the_calls_cancelled_when_their_element_was_decided(
    decided_by: str,
) -> None:
    # The call that lost the race was cancelled, but close() did not wait for it: the
    # function's close() ran while it still cleaned up, and a loop closed after close()
    # logged "Task was destroyed but it is pending!".
    log: list = []
    answer = asyncio.get_running_loop().create_future()

    async def cleans_up_when_cancelled(call: str) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)  # a connection handed back to its pool
            log.append(f"{call} cleaned up")
            raise

    class Fn(AsyncFunction):
        async def async_invoke(self, value):
            if decided_by == "the attempt":
                return await answer
            await cleans_up_when_cancelled("attempt")

        async def timeout(self, value):
            if decided_by == "the timeout handler":
                return ["fallback"]
            await cleans_up_when_cancelled("timeout handler")

        async def close(self):
            log.append("fn.close")

    clock = VirtualClock()
    out: list = []
    op = AsyncWaitOperator(Fn(), out.append, capacity=4, timeout=1, clock=clock)
    await op.open()
    await op.process_element(StreamRecord("a"))
    await clock.advance(1)  # the handler starts
    answer.set_result(["A"])  # what the attempt returns, if it still runs
    await settle()
    assert [e.value for e in out] == (["A"] if decided_by == "the attempt" else ["fallback"])
    await op.close()
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
    loser = "timeout handler" if decided_by == "the attempt" else "attempt"
    assert log == [f"{loser} cleaned up", "fn.close"]


async def test_a_snapshot_during_restore_is_refused() -> None:
    fn = ControlledFunction()
    op = AsyncWaitOperator(fn, lambda e: None, capacity=1)
    opening = asyncio.ensure_future(op.open(restored=[StreamRecord("a"), StreamRecord("b")]))
    await settle()
    assert not opening.done()  # "b" waits for room behind "a"
    with pytest.raises(OperatorStateError, match="still re-adding restored elements"):
        op.snapshot_state(1)
    fn.complete("a", ["A"])
    await settle()
    assert opening.done()
    assert op.snapshot_state(1) == [StreamRecord("b")]
    await op.close()


async def test_a_function_whose_open_raises_leaves_the_operator_refusing_work() -> None:
    class Unreachable(ControlledFunction):
        async def open(self):
            raise ConnectionError("no database")

    fn = Unreachable()
    op = AsyncWaitOperator(fn, lambda e: None)
    with pytest.raises(ConnectionError, match="no database"):
        await op.open()
    with pytest.raises(OperatorStateError, match="its function's open\\(\\) raised"):
        await op.process_element(StreamRecord(1))
    with pytest.raises(OperatorStateError, match="the operator is failed"):
        op.snapshot_state(1)
    with pytest.raises(OperatorStateError, match="open\\(\\) raised"):
        await op.finish()
    await op.close()
    assert (fn.calls, fn.closed) == ([], 0)  # never invoked; close() is open()'s to undo


class _PlainInvoke(AsyncFunction):
    def async_invoke(self, value):
        return [value]


class _GeneratorInvoke(AsyncFunction):
    async def async_invoke(self, value):
        yield value


class _PlainTimeout(AsyncFunction):
    async def async_invoke(self, value):
        return [value]

    def timeout(self, value):
        return []


class _PlainOpen(AsyncFunction):
    async def async_invoke(self, value):
        return [value]

    def open(self):
        pass


async def _generator(value):
    yield value


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (_PlainInvoke(), "_PlainInvoke.async_invoke is a plain 'def'.*'async def async_invoke"),
        (_GeneratorInvoke(), "_GeneratorInvoke.async_invoke is an async generator"),
        (_PlainTimeout(), "_PlainTimeout.timeout is a plain 'def'"),
        (_PlainOpen(), "_PlainOpen.open is a plain 'def'.*'async def open\\(self\\)'"),
        (_generator, "is an async generator \\(it yields\\).*returns a list"),
    ],
)
def test_functions_the_operator_cannot_await_are_refused_at_construction(fn, message) -> None:
    with pytest.raises(ConfigurationError, match=message):
        AsyncWaitOperator(fn, lambda e: None)


class _Calls:
    """A callable object that is not an async function: it returns what ``fn`` returns."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, value):
        return self.fn(value)


@pytest.mark.parametrize("timeout", [None, 10.0])
@pytest.mark.parametrize("kind", ["callable object", "functools.partial"])
async def test_an_async_invoke_that_returns_no_awaitable_fails_at_once_and_is_not_retried(
    kind: str, timeout: float | None
) -> None:
    # A callable object or a partial passes the construction check (it may return an
    # awaitable); one that returns results made `await` raise TypeError, which
    # retry_on_exception=Exception retried until the attempts ran out.
    calls: list = []

    def results_now(value):
        calls.append(value)
        return [value]

    class Fn(AsyncFunction):
        # a partial as a class attribute becomes a method from Python 3.14 (3.13 warns)
        async_invoke = (
            _Calls(results_now)
            if kind == "callable object"
            else staticmethod(functools.partial(results_now))
        )

    retry = None if timeout is None else RetryStrategy.fixed_delay(3, 0)
    op = AsyncWaitOperator(Fn(), lambda e: None, timeout=timeout, retry=retry)
    await op.open()
    await op.process_element(StreamRecord("a"))
    with pytest.raises(InvalidResultError) as info:
        await asyncio.wait_for(op.finish(), 5.0)
    assert str(info.value).startswith(
        "Fn.async_invoke returned list, not an awaitable for element StreamRecord('a') after 1 "
        "attempt. async_invoke must return an awaitable: is it an async def?"
    )
    assert calls == ["a"]
    await op.close()


async def _a_spark_row_timed_out(fn: AsyncFunction, retry: RetryStrategy | None = None):
    """An operator as a Spark task runs ``fn`` (output schema: ``y``), holding the input
    row {'x': 1} whose 1 s timeout has just passed."""
    pytest.importorskip("pyarrow")
    from stateful_async.spark._task import _RowFunctionWithTimeout

    clock = VirtualClock()
    wrapped = _RowFunctionWithTimeout(fn, frozenset({"y"}), lambda row: row)
    op = AsyncWaitOperator(wrapped, lambda e: None, timeout=1, retry=retry, clock=clock)
    await op.open()
    await op.process_element(StreamRecord((0, {"x": 1}, {"x": 1})))
    await clock.advance(1)
    return op


@pytest.mark.parametrize("method", ["async_invoke", "timeout"])
async def test_a_spark_tasks_function_that_returns_no_awaitable_fails_at_once(method: str) -> None:
    # The Spark task awaits the user's function inside its own coroutine, which the
    # operator's check above does not see through: the TypeError was retried (async_invoke),
    # or reported as "the timeout handler raised" (timeout).
    calls: list = []

    def results_now(row):
        calls.append(row)
        return [{"y": 1}]

    class Fn(AsyncFunction):
        async def async_invoke(self, row):
            await asyncio.Event().wait()

    setattr(Fn, method, _Calls(results_now))
    op = await _a_spark_row_timed_out(Fn(), retry=RetryStrategy.fixed_delay(3, 0))
    with pytest.raises(InvalidResultError) as info:
        await asyncio.wait_for(op.finish(), 5.0)
    assert str(info.value).startswith(
        f"Fn.{method} returned list, not an awaitable, for input row {{'x': 1}} (record 0 of "
        f"partition 0): is it an async def? Declare it 'async def {method}(self, row)'"
    )
    assert calls == [{"x": 1}]
    await op.close()


async def test_a_spark_tasks_function_that_forgot_await_is_told_so() -> None:
    pytest.importorskip("pyarrow")
    from stateful_async.spark._task import _RowFunction

    async def lookup(row):
        return [{"y": 1}]

    async def forgot_await(row):
        return lookup(row)

    op = AsyncWaitOperator(
        _RowFunction(as_async_function(forgot_await), frozenset({"y"}), lambda row: row),
        lambda e: None,
    )
    await op.open()
    await op.process_element(StreamRecord((0, {"x": 1}, {"x": 1})))
    with pytest.raises(InvalidResultError, match=r"returned coroutine, an awaitable, .* Did you "):
        await asyncio.wait_for(op.finish(), 5.0)
    await op.close()


class _Abort(BaseException):
    """Like gevent's Timeout or pytest's outcomes: a BaseException that is not an Exception."""


async def _aborts(value):
    raise _Abort("stop")


async def _aborts_half_way(value):  # consuming its results is part of the call
    def results():
        yield value
        raise _Abort("stop")

    return results()


@pytest.mark.parametrize("timeout", [None, 10.0])
@pytest.mark.parametrize("function", [_aborts, _aborts_half_way])
async def test_a_base_exception_from_the_function_fails_the_element_instead_of_hanging(
    function, timeout
) -> None:
    op = AsyncWaitOperator(function, lambda e: None, timeout=timeout)
    await op.open()
    await op.process_element(StreamRecord("x"))
    with pytest.raises(AsyncFunctionError, match="StreamRecord\\('x'\\).*_Abort: stop"):
        await asyncio.wait_for(op.finish(), 5.0)
    await op.close()


async def test_a_timeout_handler_of_the_wrong_shape_is_named_as_the_handler() -> None:
    class Fallback(ControlledFunction):
        async def timeout(self, value):
            return {"value": value}

    clock = VirtualClock()
    op = AsyncWaitOperator(Fallback(), lambda e: None, timeout=1, clock=clock)
    await op.open()
    await op.process_element(StreamRecord("x"))
    await clock.advance(1)
    with pytest.raises(InvalidResultError, match="The timeout handler returned dict"):
        await asyncio.wait_for(op.finish(), 5.0)
    await op.close()


async def test_a_timeout_handler_that_returns_no_awaitable_is_told_so_not_said_to_raise() -> None:
    # A handler that is a plain callable object (which passes the construction check)
    # returned its fallback list; the operator reported "The timeout handler raised ...:
    # TypeError: An asyncio.Future, a coroutine or an awaitable is required", and advised
    # returning fallback results instead of raising, which it had done.
    class Fallback:
        def __call__(self, value):
            return [f"fallback {value}"]

    class Fn(ControlledFunction):
        timeout = Fallback()  # not a descriptor: called as fn.timeout(value)

    clock = VirtualClock()
    op = AsyncWaitOperator(Fn(), lambda e: None, timeout=1, clock=clock)
    await op.open()
    await op.process_element(StreamRecord("x"))
    await clock.advance(1)
    with pytest.raises(InvalidResultError) as info:
        await asyncio.wait_for(op.finish(), 5.0)
    message = str(info.value)
    assert message.startswith(
        "Fn.timeout returned list, not an awaitable for element StreamRecord('x')"
    ), message
    assert "Declare it 'async def timeout(self, value)'" in message
    await op.close()


async def test_fallback_rows_that_do_not_match_the_schema_are_not_reported_as_raised() -> None:
    # The Spark task checks the handler's fallback rows against the output schema: a
    # mismatch was reported as a TimeoutHandlerError, "the handler raised ... return
    # fallback results from timeout() instead of raising", though it had returned them.
    class Fallback(AsyncFunction):
        async def async_invoke(self, row):
            await asyncio.Event().wait()

        async def timeout(self, row):
            return [{"wrong": 1}]

    op = await _a_spark_row_timed_out(Fallback())
    with pytest.raises(ResultSchemaError) as info:
        await asyncio.wait_for(op.finish(), 5.0)
    assert str(info.value).startswith(
        "A result the timeout handler returned for input row {'x': 1} (record 0 of partition 0) "
        "does not match the output schema: missing field(s) ['y']"
    )
    await op.close()


async def test_fallback_results_that_raise_a_base_exception_fail_instead_of_hanging() -> None:
    class Fallback(ControlledFunction):
        async def timeout(self, value):
            def results():
                yield value
                raise _Abort("stop")

            return results()

    clock = VirtualClock()
    op = AsyncWaitOperator(Fallback(), lambda e: None, timeout=1, clock=clock)
    await op.open()
    await op.process_element(StreamRecord("x"))
    await clock.advance(1)
    with pytest.raises(TimeoutHandlerError, match="StreamRecord\\('x'\\)"):
        await asyncio.wait_for(op.finish(), 5.0)
    await op.close()


class SlowOpen(ControlledFunction):
    """Its open() returns once the test sets ``gate``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def open(self):
        await self.gate.wait()
        self.opened += 1


async def test_close_during_the_functions_open_still_closes_the_function() -> None:
    # close() found the function not open yet: open() must close it once it is, and not
    # return as if the operator were ready (its clients would never be released).
    fn = SlowOpen()
    op = AsyncWaitOperator(fn, lambda e: None)
    opening = asyncio.ensure_future(op.open(restored=[StreamRecord("a")]))
    await settle()
    closing = asyncio.ensure_future(op.close())
    fn.gate.set()
    with pytest.raises(OperatorStateError, match="closed while its function was opening"):
        await opening
    await closing
    assert (fn.opened, fn.closed, fn.calls) == (1, 1, [])
    await op.close()
    assert fn.closed == 1


@pytest.mark.parametrize("close_fails", [False, True])
async def test_a_close_during_the_functions_open_returns_once_it_has_closed_the_function(
    close_fails: bool,
) -> None:
    # close() returned at once, the function still opening and then never closed by it: a
    # caller that ended its loop then (asyncio.run) left the clients open; and what the
    # function's close() raised came out of open(), while every close() returned.
    class SlowOpenBrokenClose(SlowOpen):
        async def close(self):
            self.closed += 1
            if close_fails:
                raise ConnectionError("the pool did not close")

    fn = SlowOpenBrokenClose()
    op = AsyncWaitOperator(fn, lambda e: None)
    opening = asyncio.ensure_future(op.open())
    await settle()
    closing = asyncio.ensure_future(op.close())
    await settle()
    assert not closing.done()  # it waits for the function's open() ...
    fn.gate.set()
    with pytest.raises(OperatorStateError, match="closed while its function was opening"):
        await opening
    for close in (closing, op.close()):  # ... and then closes it, this close() and later ones
        if close_fails:
            with pytest.raises(ConnectionError, match="the pool did not close"):
                await close
        else:
            await close
    assert (fn.opened, fn.closed) == (1, 1)


@pytest.mark.parametrize("how", ["in_its_task", "gather", "wait_for", "create_task"])
async def test_a_close_from_the_functions_open_returns_at_once(how: str) -> None:
    # A close() made from the function's open() in a task it started (asyncio.gather,
    # wait_for before Python 3.12, create_task) waited for that open() to return, which
    # waited for it: open() hung for ever.
    class GivesUp(ControlledFunction):
        async def open(self):
            await super().open()
            if how == "in_its_task":
                await op.close()
            elif how == "gather":
                await asyncio.gather(op.close())
            elif how == "wait_for":
                await asyncio.wait_for(asyncio.ensure_future(op.close()), 30)
            else:
                await asyncio.get_running_loop().create_task(op.close())

    fn = GivesUp()
    op = AsyncWaitOperator(fn, lambda e: None)
    with pytest.raises(OperatorStateError, match="closed while its function was opening"):
        await asyncio.wait_for(op.open(), 5.0)
    await op.close()
    assert (fn.opened, fn.closed) == (1, 1)


async def test_a_snapshot_while_the_function_opens_is_refused() -> None:
    # The restored elements are not back in the queue yet: an empty snapshot taken then
    # would drop them from the next checkpoint.
    fn = SlowOpen()
    op = AsyncWaitOperator(fn, lambda e: None)
    opening = asyncio.ensure_future(op.open(restored=[StreamRecord("a"), Watermark(1)]))
    await settle()
    with pytest.raises(OperatorStateError, match="still re-adding restored elements"):
        op.snapshot_state(1)
    fn.gate.set()
    await opening
    assert op.snapshot_state(1) == [StreamRecord("a"), Watermark(1)]
    await op.close()


async def test_input_while_the_function_opens_is_refused() -> None:
    # It would call a function that is not open yet, and overtake the restored elements.
    fn = SlowOpen()
    out: list = []
    op = AsyncWaitOperator(fn, out.append)
    opening = asyncio.ensure_future(op.open(restored=[StreamRecord("a")]))
    await settle()
    message = r"while open\(\) was still awaiting the function's open\(\).*Await open\(\) first"
    with pytest.raises(OperatorStateError, match=r"process_element\(\) was called " + message):
        op.process_element(StreamRecord("b"))
    with pytest.raises(OperatorStateError, match=r"process_watermark\(\) was called " + message):
        await op.process_watermark(Watermark(1))
    with pytest.raises(OperatorStateError, match=r"finish\(\) was called " + message):
        await op.finish()
    assert fn.calls == []
    fn.gate.set()
    await opening
    await op.process_element(StreamRecord("b"))
    await settle()
    assert fn.calls == ["a", "b"]
    fn.complete("b", ["B"])
    fn.complete("a", ["A"])
    await op.finish()
    assert values(out) == ["A", "B"]
    await op.close()


async def test_a_call_while_an_unawaited_one_waits_for_room_is_refused_finish_too() -> None:
    # The record of a process_element() that was never awaited waits for room; a later
    # call would take the room first (reordering), and finish() drained without it: lost.
    fn, out, op = make(OutputMode.ORDERED, capacity=1)
    await op.open()
    await op.process_element(StreamRecord("a"))
    pending = asyncio.ensure_future(op.process_element(StreamRecord("b")))  # not awaited
    await settle()
    assert not pending.done()  # waiting for room
    refused = r"called while a process_element\(\)/process_watermark\(\) call was still waiting"
    with pytest.raises(OperatorStateError, match=r"process_element\(\)/process_watermark\(\) was"):
        await op.process_element(StreamRecord("c"))
    finishing = asyncio.ensure_future(op.finish())
    await settle()
    if not finishing.done():  # it drains a (never completed): b would be left out
        finishing.cancel()
    with pytest.raises(OperatorStateError, match=rf"finish\(\) was {refused}"):
        await finishing
    fn.complete("a", ["A"])
    await pending  # the room came: b entered
    await settle()
    fn.complete("b", ["B"])
    await op.finish()
    assert values(out) == ["A", "B"]
    await op.close()


async def test_a_function_with_clients_open_in_one_operator_is_refused_by_another() -> None:
    # Both operators opened it: its open() ran twice (the second session replacing the
    # first), and the first operator's close() closed the clients the second still used,
    # whose calls then failed with the function's own error, far from the cause.
    class Lookup(AsyncFunction):
        def __init__(self) -> None:
            self.session: object | None = None
            self.opened = self.closed = 0

        async def open(self):
            self.opened += 1
            self.session = object()

        async def close(self):
            self.closed += 1
            self.session = None

        async def async_invoke(self, value):
            assert self.session is not None, "the session is closed"
            return [value]

    fn = Lookup()
    first = AsyncWaitOperator(fn, lambda e: None)
    second = AsyncWaitOperator(fn, lambda e: None)
    await first.open()
    with pytest.raises(
        ConfigurationError,
        match=r"This .*Lookup is already open \(by another operator that has not been closed\)"
        r".*Give each operator its own .*Lookup\(\.\.\.\), or close the first operator",
    ):
        await second.open()
    await second.close()
    assert (fn.opened, fn.closed) == (1, 0)
    out: list = []
    third = AsyncWaitOperator(fn, out.append)
    await first.close()  # once closed, the instance may serve another operator
    async with third:
        await third.process_element(StreamRecord(1))
        await third.finish()
    assert values(out) == [1]
    assert (fn.opened, fn.closed) == (2, 2)

    # without an open() or close() of its own a function holds no clients: it may be shared
    class Echo(AsyncFunction):
        async def async_invoke(self, value):
            return [value]

    shared = Echo()
    async with AsyncWaitOperator(shared, lambda e: None), AsyncWaitOperator(shared, lambda e: None):
        pass


async def test_a_controlled_function_serves_the_operator_restored_from_an_abandoned_one() -> None:
    # A test simulating a crash restores the first operator's snapshot into a second one
    # with the same ControlledFunction, without closing the first: its open() and close()
    # only count, yet the second operator was refused as if it held clients.
    fn = ControlledFunction()
    crashed = AsyncWaitOperator(fn, lambda e: None)
    await crashed.open()
    await crashed.process_element(StreamRecord(1))
    snapshot = crashed.snapshot_state(1)
    out: list = []
    restored = AsyncWaitOperator(fn, out.append)
    await restored.open(restored=snapshot)
    await settle()
    assert fn.pending(1) == 2  # the abandoned operator's call, and the restored one's
    fn.complete(1, ["lost"])  # (the oldest: the abandoned operator's)
    fn.complete(1, ["one"])
    await restored.finish()
    await restored.close()
    assert values(out) == ["one"]
    assert (fn.opened, fn.closed) == (2, 1)

    class WithClient(ControlledFunction):  # an open() of its own: one operator at a time
        async def open(self):
            await super().open()

    fn = WithClient()
    await AsyncWaitOperator(fn, lambda e: None).open()
    with pytest.raises(ConfigurationError, match="WithClient is already open"):
        await AsyncWaitOperator(fn, lambda e: None).open()


@pytest.mark.parametrize("where", ["async_invoke", "timeout"])
def test_a_keyboard_interrupt_in_a_call_fails_the_operator_for_a_loop_run_again(
    where: str,
) -> None:
    # A KeyboardInterrupt in async_invoke stopped the loop and left its element with no
    # outcome: a loop run again (asyncio.run's clean-up, a caller that catches Ctrl-C and
    # drains) waited for ever on it in finish(). The timeout handler's failed the operator
    # advising to return fallback results instead of raising.
    class Interrupted(AsyncFunction):
        async def async_invoke(self, value):
            if where == "async_invoke":
                raise KeyboardInterrupt
            await asyncio.sleep(30)
            return [value]

        async def timeout(self, value):
            raise KeyboardInterrupt

    op = AsyncWaitOperator(
        Interrupted(), lambda e: None, timeout=None if where == "async_invoke" else 0.01
    )

    async def start() -> None:
        await op.open()
        await op.process_element(StreamRecord(1))
        await asyncio.sleep(30)

    loop = asyncio.new_event_loop()
    try:
        interrupted = False
        try:
            loop.run_until_complete(start())
        except KeyboardInterrupt:
            interrupted = True
        assert interrupted

        async def drain() -> None:
            try:
                await asyncio.wait_for(op.finish(), 5.0)
            finally:
                await op.close()

        error = AsyncFunctionError if where == "async_invoke" else TimeoutHandlerError
        source = "async function" if where == "async_invoke" else "timeout handler"
        with pytest.raises(
            error,
            match=rf"The {source} was interrupted by KeyboardInterrupt for element "
            r"StreamRecord\(1\).*close the operator, and restore its last snapshot",
        ):
            loop.run_until_complete(drain())
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
