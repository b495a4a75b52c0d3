"""Hypothesis drives the operator against a plain in-memory model.

Random records and watermarks, completions in random order, retryable failures, time
advancing (timeouts fall back to the same results), checkpoints, and crashes that restore a
fresh operator from the last checkpoint, with the same or another capacity and
``max_in_flight`` (so a restore may hold more elements than the new queue). The output
follows the checkpoint protocol the Spark adapter uses: output since the last checkpoint is
uncommitted and a crash discards it; inputs consumed after the checkpoint are fed again
after the restore.

Half the runs have no timeout and no retries (the fast path, which reuses the entries of
emitted elements); the other half have both. Half the runs bound the calls in flight
below capacity (``max_in_flight``), so elements also wait in the queue for a call slot.

Invariants: never more than ``capacity`` queue entries (in flight and kept for reuse), nor
more than ``max_in_flight`` calls, and no call slot idle while an element waits for one;
ordered output is a prefix of the input-order output; in unordered mode no record crosses a
watermark either way; a snapshot taken at any step holds exactly the consumed inputs whose
output has not left, in input order (watermarks included); and in the end the committed
output equals a failure-free run exactly once (as a sequence when ordered, as a multiset per
watermark segment when unordered).

``FailureMachine`` adds what this one never does: operator failures (an attempt or a timeout
handler failing for good) followed by the restore a job's retry makes, timeout handlers that
race the attempt they replace, results as tuples and generators, and ``finish()`` with calls
and backoffs in flight, crashed during.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from functools import partial

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from stateful_async import (
    AsyncWaitOperator,
    OperatorStateError,
    OutputMode,
    RetryStrategy,
    StreamRecord,
    VirtualClock,
    Watermark,
)
from stateful_async.testing import ControlledFunction, ControlledTimeoutFunction, settle


class Retryable(Exception):
    pass


def results_of(value: int) -> list[int]:
    """The failure-free results of a record: none, one or two."""
    if value % 5 == 4:
        return []
    if value % 3 == 0:
        return [value * 10, value * 10 + 1]
    return [value * 10]


class ModelFunction(ControlledFunction):
    async def timeout(self, value):  # the fallback is the real answer: output stays exact
        return results_of(value)


TIMEOUT = 5.0
RETRY = RetryStrategy.fixed_delay(10_000, 1.0, retry_on_exception=(Retryable,))


class OperatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = VirtualClock()
        self.next_value = 0
        self.next_watermark = 0
        self.consumed: list = []  # inputs in the operator (or emitted), in input order
        self.to_feed: list = []  # inputs not yet consumed
        self.committed: list = []  # output covered by the last checkpoint
        self.uncommitted: list = []  # output since the last checkpoint
        self.saved: tuple[list, int] = ([], 0)  # (snapshot, input position)
        self.checkpoint_id = 0
        self.max_in_flight = 0
        self.feeder: asyncio.Task | None = None

    # -- plumbing --------------------------------------------------------------------------

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def new_operator(self) -> None:
        self.fn = ModelFunction()
        self.op = AsyncWaitOperator(
            self.fn,
            self.uncommitted_append,
            self.mode,
            capacity=self.capacity,
            timeout=TIMEOUT if self.timed else None,
            retry=RETRY if self.timed else None,
            max_in_flight=self.max_calls,
            clock=self.clock,
        )

    def uncommitted_append(self, element) -> None:
        self.uncommitted.append(element)

    async def _feed(self, restored: list | None) -> None:
        if restored is not None:
            await self.op.open(restored=restored)
        while self.to_feed:
            item = self.to_feed[0]
            if isinstance(item, Watermark):
                await self.op.process_watermark(item)
            else:
                await self.op.process_element(item)
            self.consumed.append(self.to_feed.pop(0))

    def start_feeder(self, restored: list | None = None) -> None:
        if self.feeder is None or self.feeder.done():
            if self.feeder is not None:
                self.feeder.result()  # surface any error of the previous feeder
            self.feeder = self.loop.create_task(self._feed(restored))
        self.run(settle())
        self.max_in_flight = max(self.max_in_flight, self.op.in_flight)

    def restoring(self) -> bool:
        return self.op._restoring

    # -- rules -----------------------------------------------------------------------------

    @initialize(
        mode=st.sampled_from([OutputMode.ORDERED, OutputMode.UNORDERED]),
        capacity=st.integers(1, 6),
        timed=st.booleans(),
        max_calls=st.integers(0, 3),
    )
    def start(self, mode: OutputMode, capacity: int, timed: bool, max_calls: int = 0) -> None:
        """``timed``: with a timeout and retries; else neither, where the operator reuses
        the entries of emitted elements for new ones. ``max_calls``: the operator's
        ``max_in_flight`` (0 for none; capped at ``capacity``)."""
        self.mode = mode
        self.capacity = capacity
        self.timed = timed
        self.max_calls = min(max_calls, capacity) or None
        self.new_operator()
        self.run(self.op.open())

    @rule(count=st.integers(1, 4))
    def add_records(self, count: int) -> None:
        for _ in range(count):
            self.to_feed.append(StreamRecord(self.next_value))
            self.next_value += 1
        self.start_feeder()

    @rule()
    def add_watermark(self) -> None:
        self.next_watermark += 1
        self.to_feed.append(Watermark(self.next_watermark))
        self.start_feeder()

    @rule(data=st.data())
    def complete_one(self, data) -> None:
        pending = sorted(set(self.fn.pending_values()))
        if not pending:
            return
        value = data.draw(st.sampled_from(pending))
        self.fn.complete(value, results_of(value))
        self.run(settle())

    @precondition(lambda self: self.timed)
    @rule(data=st.data())
    def fail_one_retryably(self, data) -> None:
        pending = sorted(set(self.fn.pending_values()))
        if not pending:
            return
        value = data.draw(st.sampled_from(pending))
        self.fn.fail(value, Retryable(value))
        self.run(settle())

    @rule(seconds=st.sampled_from([0.5, 1.0, 3.0]))
    def advance_time(self, seconds: float) -> None:
        self.run(self.clock.advance(seconds))

    @precondition(lambda self: not self.restoring())
    @rule()
    def checkpoint(self) -> None:
        self.checkpoint_id += 1
        snapshot = self.op.snapshot_state(self.checkpoint_id)
        self.committed.extend(self.uncommitted)
        self.uncommitted.clear()
        self.saved = (snapshot, len(self.consumed))

    @rule()
    def crash_and_restore(self) -> None:
        if self.feeder is not None:
            self.feeder.cancel()
            self.run(asyncio.wait([self.feeder]))
            self.feeder = None
        self.run(self.op.close())
        self.uncommitted.clear()  # the failed attempt's output is discarded
        snapshot, position = self.saved
        self.to_feed = self.consumed[position:] + self.to_feed
        del self.consumed[position:]
        self.new_operator()
        self.start_feeder(restored=list(snapshot))

    @rule(capacity=st.integers(1, 6), max_calls=st.integers(0, 3))
    def crash_and_restore_resized(self, capacity: int, max_calls: int) -> None:
        """A job resumed with another ``capacity`` (and ``max_in_flight``): the snapshot may
        hold more elements than the new queue, which the restore must not deadlock on."""
        self.capacity = capacity
        self.max_calls = min(max_calls, capacity) or None
        self.crash_and_restore()

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def within_capacity(self) -> None:
        assert self.op.in_flight <= self.capacity
        # entries kept for reuse count too: memory stays bounded by capacity
        assert self.op.in_flight + len(self.op._spare) <= self.capacity

    @invariant()
    def calls_within_max_in_flight(self) -> None:
        op = self.op
        assert len(self.fn.pending_values()) <= op.calls_in_flight <= op.max_in_flight
        if op._limited:
            assert op._calls <= op.max_in_flight
            if op._waiting and op.failure is None:
                assert op._calls == op.max_in_flight, "a call slot is idle while elements wait"

    @invariant()
    def completed_count_is_exact(self) -> None:
        # the emission path skips has_completed() when the queue's count says none is done
        queue = self.op._queue
        assert queue.completed == sum(1 for entry in queue.entries() if entry.done)

    @invariant()
    def output_is_consistent_so_far(self) -> None:
        output = self.committed + self.uncommitted
        inputs = self.consumed + self.to_feed
        if self.mode is OutputMode.ORDERED:
            expected = expected_sequence(inputs)
            assert output == expected[: len(output)]
        else:
            check_unordered_prefix(output, inputs)

    @invariant()
    def snapshot_holds_exactly_what_is_not_yet_out(self) -> None:
        """A snapshot taken now holds every consumed input whose output has not left, in
        input order, and nothing else: the output so far plus the snapshot's results is
        every consumed input's results (in order when ordered; per watermark segment when
        unordered). The end-to-end check only sees the snapshots that a crash restored."""
        op = self.op
        if self.restoring() or op.failure is not None or op._state.value == "closed":
            return
        snapshot = op.snapshot_state(0)
        output = self.committed + self.uncommitted
        consumed = self.consumed
        if self.mode is OutputMode.ORDERED:
            assert snapshot == consumed[len(consumed) - len(snapshot) :], "not the unemitted tail"
            assert output + expected_sequence(snapshot) == expected_sequence(consumed)
            return
        position = {element: index for index, element in enumerate(consumed)}
        indices = [position[element] for element in snapshot]
        assert indices == sorted(set(indices)), "not a subsequence of the input, in order"
        watermarks = [element for element in consumed if isinstance(element, Watermark)]
        emitted = [element for element in output if isinstance(element, Watermark)]
        assert [e for e in snapshot if isinstance(e, Watermark)] == watermarks[len(emitted) :]
        actual = [counter for counter, _ in segments(output)]
        actual += [Counter() for _ in range(len(watermarks) + 1 - len(actual))]
        for element, index in zip(snapshot, indices, strict=True):
            if isinstance(element, StreamRecord):
                segment = sum(isinstance(e, Watermark) for e in consumed[:index])
                actual[segment].update(results_of(element.value))
        assert actual == [Counter(seg) for seg, _ in expected_segments(consumed)]

    def teardown(self) -> None:
        try:
            self.drain_and_check()
        finally:
            self.run(self.op.close())
            self.loop.close()

    def drain_and_check(self) -> None:
        if not hasattr(self, "op"):
            return
        self.start_feeder()
        for _ in range(10_000):
            if self.feeder is not None and self.feeder.done():
                self.feeder.result()
            if not self.to_feed and self.op.in_flight == 0 and not self.restoring():
                break
            for value in set(self.fn.pending_values()):
                self.fn.complete(value, results_of(value))
            self.run(self.clock.advance(1.0))
        else:
            raise AssertionError("The operator never drained.")
        self.run(self.op.finish())
        self.check_exactly_once()

    def check_exactly_once(self) -> None:
        """After a full drain: the output so far, with what is not yet checkpointed, is
        every consumed input's results exactly once, in order (within watermark segments
        in unordered mode)."""
        self.committed.extend(self.uncommitted)
        self.uncommitted.clear()
        inputs = self.consumed
        if self.mode is OutputMode.ORDERED:
            assert self.committed == expected_sequence(inputs)
        else:
            assert segments(self.committed) == [
                (Counter(seg), wm) for seg, wm in expected_segments(inputs)
            ]


def expected_sequence(inputs: list) -> list:
    out: list = []
    for item in inputs:
        if isinstance(item, Watermark):
            out.append(item)
        else:
            out.extend(StreamRecord(r, item.timestamp) for r in results_of(item.value))
    return out


def expected_segments(inputs: list) -> list[tuple[list, Watermark | None]]:
    result: list[tuple[list, Watermark | None]] = []
    current: list = []
    for item in inputs:
        if isinstance(item, Watermark):
            result.append((current, item))
            current = []
        else:
            current.extend(results_of(item.value))
    result.append((current, None))
    return result


def segments(output: list) -> list[tuple[Counter, Watermark | None]]:
    result: list[tuple[Counter, Watermark | None]] = []
    current: Counter = Counter()
    for element in output:
        if isinstance(element, Watermark):
            result.append((current, element))
            current = Counter()
        else:
            current[element.value] += 1
    result.append((current, None))
    return result


def check_unordered_prefix(output: list, inputs: list) -> None:
    """Every emitted segment is a sub-multiset of its expected segment, every segment
    closed by a watermark is complete, and watermarks leave in order."""
    expected = expected_segments(inputs)
    emitted = segments(output)
    assert len(emitted) <= len(expected)
    for index, (counter, watermark) in enumerate(emitted):
        want = Counter(expected[index][0])
        assert not counter - want, f"segment {index} has results that do not belong to it"
        if watermark is not None:
            assert watermark == expected[index][1]
            assert counter == want, f"watermark {watermark} overtook records of its segment"


TestOperatorStateMachine = OperatorMachine.TestCase
TestOperatorStateMachine.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- a second machine: failures, slow timeout handlers, finish() mid-run -----------------------


class Fatal(Exception):
    pass


class SlowFallbackFunction(ControlledTimeoutFunction):
    """Its timeout handler waits for the test, so a handler and the attempt it replaces race."""


def shaped(results: list, shape: str):
    if shape == "tuple":
        return tuple(results)
    if shape == "generator":
        return (r for r in results)
    return list(results)


SHORT_TIMEOUT = 2.5  # one advance_time(3.0) times out every call in flight


class FailureMachine(OperatorMachine):
    """``OperatorMachine`` (every rule and invariant of it) plus what it never does: attempts
    that fail for good and timeout handlers that fail (the operator fails; the job restores
    from the last checkpoint and, the error being transient, the value succeeds then), a
    timeout handler that takes its time and races the late attempt, results returned as a
    tuple or a generator, timestamps, and ``finish()`` called while elements are in flight
    (backoffs pending, with or without ``keep_retrying``), then crashes during it.

    Extra invariant: an operator emits nothing once it has failed or been replaced."""

    def __init__(self) -> None:
        super().__init__()
        self.generation = 0
        self.finisher: asyncio.Task | None = None

    def new_operator(self) -> None:
        self.generation += 1
        self.fn = SlowFallbackFunction() if self.slow_fallback else ModelFunction()
        self.op = AsyncWaitOperator(
            self.fn,
            partial(self.emitted_by, self.generation),
            self.mode,
            capacity=self.capacity,
            timeout=SHORT_TIMEOUT if self.timed else None,
            retry=RETRY if self.timed else None,
            max_in_flight=self.max_calls,
            clock=self.clock,
        )

    def emitted_by(self, generation: int, element) -> None:
        assert generation == self.generation, "a replaced (closed) operator emitted"
        assert self.op.failure is None, "a failed operator emitted"
        self.uncommitted.append(element)

    def failed(self) -> bool:
        return self.op.failure is not None

    def finishing(self) -> bool:
        return self.finisher is not None

    @initialize(
        mode=st.sampled_from([OutputMode.ORDERED, OutputMode.UNORDERED]),
        capacity=st.integers(1, 6),
        timed=st.booleans(),
        max_calls=st.integers(0, 3),
        slow_fallback=st.booleans(),
        records=st.integers(1, 8),
    )
    def start(  # type: ignore[override]
        self,
        mode: OutputMode,
        capacity: int,
        timed: bool,
        max_calls: int,
        slow_fallback: bool,
        records: int,
    ) -> None:
        self.slow_fallback = slow_fallback and timed
        super().start(mode, capacity, timed, max_calls)
        self.add_records(records)  # rules may be switched off: begin with work in flight

    # -- inputs stop while finishing or failed ------------------------------------------------

    @precondition(lambda self: not self.failed() and not self.finishing())
    @rule(count=st.integers(1, 4))
    def add_records(self, count: int) -> None:
        for _ in range(count):
            self.to_feed.append(StreamRecord(self.next_value, timestamp=1000 + self.next_value))
            self.next_value += 1
        self.start_feeder()

    @precondition(lambda self: not self.failed() and not self.finishing())
    @rule()
    def add_watermark(self) -> None:
        super().add_watermark()

    @precondition(lambda self: not self.restoring() and not self.failed())
    @rule()
    def checkpoint(self) -> None:
        super().checkpoint()

    @precondition(lambda self: self.failed())
    @rule()
    def a_failed_operator_refuses_a_snapshot(self) -> None:
        try:
            self.op.snapshot_state(10**6)
        except OperatorStateError:
            return
        raise AssertionError("a failed operator took a snapshot")

    # -- outcomes -----------------------------------------------------------------------------

    @rule(data=st.data(), shape=st.sampled_from(["list", "tuple", "generator"]))
    def complete_one(self, data, shape: str) -> None:
        pending = sorted(set(self.fn.pending_values()))
        if not pending:
            return
        value = data.draw(st.sampled_from(pending))
        self.fn._next(value).set_result(shaped(results_of(value), shape))
        self.run(settle())

    @rule(data=st.data())
    def fail_one_for_good(self, data) -> None:
        pending = sorted(set(self.fn.pending_values()))
        if not pending or data.draw(st.integers(0, 3), label="rarer than the others"):
            return
        self.fn.fail(data.draw(st.sampled_from(pending)), Fatal("transient, but not retried"))
        self.run(settle())

    @precondition(lambda self: self.slow_fallback)
    @rule(data=st.data(), fail=st.booleans())
    def end_one_timeout_handler(self, data, fail: bool) -> None:
        pending = sorted(set(self.fn.pending_timeout_values()))
        if not pending:
            return
        value = data.draw(st.sampled_from(pending))
        if fail:
            self.fn.fail_timeout(value, Fatal("fallback failed"))
        else:
            self.fn.complete_timeout(value, results_of(value))
        self.run(settle())

    # -- finish() mid-run, crashes ------------------------------------------------------------

    @precondition(
        lambda self: (
            not self.failed() and not self.finishing() and not self.restoring() and not self.to_feed
        )
    )
    @rule(keep_retrying=st.booleans())
    def finish(self, keep_retrying: bool) -> None:
        if self.feeder is not None:
            self.feeder.result()
            self.feeder = None
        self.finisher = self.loop.create_task(self.op.finish(keep_retrying=keep_retrying))
        self.run(settle())

    @rule()
    def crash_and_restore(self) -> None:
        if self.finisher is not None:
            self.finisher.cancel()
            self.run(asyncio.wait([self.finisher]))
            if not self.finisher.cancelled():
                self.finisher.exception()  # the failure it raised: the crash's cause
            self.finisher = None
        super().crash_and_restore()

    @invariant()
    def finish_ends_only_drained_or_failed(self) -> None:
        if self.finisher is not None and self.finisher.done():
            if self.finisher.cancelled() or self.finisher.exception() is not None:
                assert self.failed()
            else:
                assert self.op.in_flight == 0

    def drain_and_check(self) -> None:
        if not hasattr(self, "op"):
            return
        for _ in range(10_000):
            if self.failed():
                self.crash_and_restore()  # the job's retry of the failed task
                continue
            if self.finisher is not None:
                if self.finisher.done():
                    self.finisher.result()
                    break
            else:
                if self.feeder is None or self.feeder.done():
                    self.start_feeder()
                if self.feeder is not None and self.feeder.done():
                    self.feeder.result()
                if not self.to_feed and self.op.in_flight == 0 and not self.restoring():
                    self.run(self.op.finish())
                    break
            for value in set(self.fn.pending_values()):
                self.fn.complete(value, results_of(value))
            if self.slow_fallback:
                for value in set(self.fn.pending_timeout_values()):
                    self.fn.complete_timeout(value, results_of(value))
            self.run(self.clock.advance(1.0))
        else:
            raise AssertionError("The operator never drained.")
        self.check_exactly_once()


TestFailureMachine = FailureMachine.TestCase
TestFailureMachine.settings = settings(
    max_examples=1000,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
