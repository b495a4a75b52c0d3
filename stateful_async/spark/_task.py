"""Inside one Spark task: the operator on an asyncio loop, fed from ``mapInArrow``.

``PartitionTask`` is the function given to ``DataFrame.mapInArrow``. For each task it runs
an ``AsyncWaitOperator`` on its own event-loop thread; the task's own thread only hands
result batches to Spark. Input batches are read on a reader thread, one at a time, and fed
record by record, so at most ``capacity`` records are in flight and memory is bounded by
capacity plus one input batch.

With checkpointing, at every barrier (every ``interval_records`` input records, and every
``interval_seconds``) the task commits, in one Delta commit, the operator's in-flight
inputs and the results emitted since the previous barrier, with the input position and a
fingerprint of the input consumed so far. Spark throws away a failed attempt's output, so
a retried attempt restores its run's latest checkpoint: it re-emits the committed results,
skips the input already consumed (checking its fingerprint), re-invokes the saved
in-flight inputs and carries on. The successful attempt's output is exactly once. Results
are handed to Spark only once the checkpoint holding them has committed, so nothing
downstream in the task sees a result a retry would compute again.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import hashlib
import inspect
import itertools
import math
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from .._elements import StreamElement, StreamRecord, Watermark, describe
from .._exceptions import (
    ConfigurationError,
    ElementFailedError,
    InputMismatchError,
    InvalidResultError,
    ResultSchemaError,
    error_text,
    id_ranges,
)
from .._function import (
    AsyncFunction,
    CoroutineFunction,
    has_timeout_handler,
    is_data_frame,
    not_a_result_list,
)
from .._operator import AsyncWaitOperator, OutputMode
from .._retry import RetryStrategy, _never
from ._config import CheckpointConfig, restore_from_in_streaming
from ._results import Units, is_list_type, to_batch

_CHUNK_ROWS = 1024  # rows converted to Python and fed per step (bounds loop latency)
_OUTPUT_ROWS = 1024  # rows per output Arrow batch
# an idle task still hands its results over this often (with checkpoints: to the next
# checkpoint, which hands them to Spark once committed)
_FLUSH_SECONDS = 0.2
_MAX_QUEUED_BATCHES = 16  # output backpressure: stop feeding input past this
# The task's end waits for calls left in its loop's default executor (asyncio.to_thread)
# until none has ended for this long: one the operator gave up on may block for ever.
_THREAD_CALLS_SECONDS = 30.0
_PROGRESS_SECONDS = 60.0  # a task logs its progress this often (STATEFUL_ASYNC_PROGRESS_SECONDS)
_EXPIRE_EVERY = 20  # a long task expires old checkpoints every this many checkpoints
_WATERMARK = "watermark"  # checkpoint property: the last watermark the task generated
_OWNER = "owner"  # checkpoint property: the task attempt that wrote it (app/start/attempt id)
EVENT_TIME_PROPERTY = "event_time"  # checkpoint properties: what watermarks came from
_OUT_OF_ORDERNESS = "max_out_of_orderness"
_SAME_WATERMARKS = (EVENT_TIME_PROPERTY, _OUT_OF_ORDERNESS)
OUTPUT_MODE_PROPERTY = "output_mode"  # checkpoint property: ordered_wait or unordered_wait wrote it
# (task attempt, keys of the partitions it computed empty in streaming, committing nothing):
# see _TaskRun._remember_empty
_EMPTY_UNCOMMITTED: tuple[str | None, set[tuple[str, ...]]] = (None, set())


# -- the user's function, seen from the operator --------------------------------------------


class _RowFunction(AsyncFunction[Any, Any]):
    """Calls the user's function with the argument of an ``(input_seq, row, argument)``
    record and pairs each result with the row (for error messages). The argument is the
    function's own copy of the row, the one every attempt and the timeout handler get: a
    function that adds, changes or pops keys, at any depth, does not change the row that a
    checkpoint saves or an error message shows. Result shape is checked here: a wrong shape
    is a programming error and is never retried."""

    def __init__(
        self,
        fn: AsyncFunction[Any, Any],
        names: frozenset[str],
        shown: Callable[[dict[str, Any]], Any],
        partition: int = 0,
    ) -> None:
        self.fn = fn
        self.names = names
        self.shown = shown  # an input row as errors show it: as the function gets it
        self.partition = partition

    async def open(self) -> None:
        fn = self.fn
        self._invoke = fn.fn if isinstance(fn, CoroutineFunction) else fn.async_invoke
        await fn.open()

    async def close(self) -> None:
        await self.fn.close()

    async def async_invoke(self, value: tuple[int, dict[str, Any], dict[str, Any]]) -> list[Any]:
        call = self._invoke(value[2])
        try:
            results = await call
        except TypeError:
            self._refuse_unawaitable(call, value, "async_invoke")
            raise
        return _pair(results, value, self.names, self.shown, self.partition)

    def _refuse_unawaitable(
        self, call: Any, record: tuple[int, dict[str, Any], dict[str, Any]], method: str
    ) -> None:
        """After ``await call`` raised TypeError: if ``call`` is no awaitable (an
        ``async_invoke`` that is a callable object, or a ``functools.partial`` of a plain
        function, passes the function check), raise the programming error it is, never
        retried (as in the operator); otherwise the TypeError was the function's own."""
        if inspect.isawaitable(call):
            return
        raise InvalidResultError(
            f"{type(self.fn).__name__}.{method} returned {type(call).__name__}, not an "
            f"awaitable, for input row {_row_text(record, self.shown, self.partition)}: is it "
            f"an async def? Declare it 'async def {method}(self, row)' returning a list of "
            "result rows.",
            element=record[1],
        ) from None


class _RowFunctionWithTimeout(_RowFunction):
    async def timeout(self, value: tuple[int, dict[str, Any], dict[str, Any]]) -> list[Any]:
        call = self.fn.timeout(value[2])
        try:
            results = await call
        except TypeError:
            self._refuse_unawaitable(call, value, "timeout")
            raise
        return _pair(
            results,
            value,
            self.names,
            self.shown,
            self.partition,
            "The timeout handler",
        )


def _on_rows(retry: RetryStrategy | None) -> RetryStrategy | None:
    """``retry`` for the operator, whose results are ``_RowFunction``'s (result, row) pairs:
    its result predicate still sees the result rows, as the user's function returned them.
    A copy whose ``should_retry_result`` unpairs them, so that a subclass that overrides the
    method, or has its own ``__init__``, is served too."""
    if retry is None or (
        retry.retry_on_result is _never
        and type(retry).should_retry_result is RetryStrategy.should_retry_result
    ):
        return retry
    decide = retry.should_retry_result
    on_rows = copy.copy(retry)  # without calling __init__
    object.__setattr__(  # a frozen dataclass
        on_rows, "should_retry_result", lambda paired: decide([r for r, _ in paired])
    )
    return on_rows


def _record(
    seq: int,
    row: dict[str, Any],
    timestamp: int | None,
    argument: Callable[[dict[str, Any]], dict[str, Any]] = dict,
) -> StreamRecord[Any]:
    """The operator's record of input row number ``seq``: ``(seq, row, argument)``, the
    argument being the function's own copy of the row (see ``_RowFunction``), made by
    ``argument`` (see ``_argument_maker``)."""
    return StreamRecord((seq, row, argument(row)), timestamp)


_Convert = Callable[[Any], Any]


def _argument_maker(schema: pa.Schema) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """How the function's copy of an input row is made: a copy at every depth, since the
    row itself is what a checkpoint saves while the call is in flight. With a shallow copy,
    a function that appended to a list column or set a struct's field before awaiting
    changed the saved row, and a resumed attempt called it again with the changed row (a
    different result than a run without failures gives).

    pyarrow gives a MAP value as a list of (key, value) pairs, where a Spark user expects a
    dict (PySpark's Rows and pandas UDFs give one): ``"k" in row["m"]`` was False, and
    ``row["m"]["k"]`` a TypeError. The copy holds maps as dicts, at any depth (the last of
    equal keys wins, as in PySpark); the row a checkpoint saves and the fingerprint keep
    pyarrow's form."""
    converts = [(field.name, c) for field in schema if (c := _fresh(field.type))]
    if not converts:
        return dict

    def argument(row: dict[str, Any]) -> dict[str, Any]:
        copied = dict(row)
        for name, convert in converts:
            value = copied[name]
            if value is not None:
                copied[name] = convert(value)
        return copied

    return argument


def _fresh(arrow_type: pa.DataType) -> _Convert | None:
    """A value of ``arrow_type`` as pyarrow gives it -> a copy sharing no list or dict with
    it, its maps as dicts; None for a type whose values are immutable (not nested). A map
    whose keys are structs, lists or maps (which a dict cannot hold) stays a list of
    pairs."""
    if pa.types.is_map(arrow_type):
        item = _fresh(arrow_type.item_type) or _same
        if pa.types.is_nested(arrow_type.key_type):
            key = _fresh(arrow_type.key_type) or _same
            return lambda pairs: [(key(k), _or_none(item, v)) for k, v in pairs]
        return lambda pairs: {k: _or_none(item, v) for k, v in pairs}
    if pa.types.is_struct(arrow_type):
        children = [
            (child.name, c)
            for child in (arrow_type.field(i) for i in range(arrow_type.num_fields))
            if (c := _fresh(child.type))
        ]

        def struct(value: dict[str, Any]) -> dict[str, Any]:
            copied = dict(value)
            for name, convert in children:
                if copied[name] is not None:
                    copied[name] = convert(copied[name])
            return copied

        return struct
    if is_list_type(arrow_type):
        element = _fresh(arrow_type.value_type)
        if element is None:
            return list
        return lambda values: [_or_none(element, v) for v in values]
    return None


def _same(value: Any) -> Any:
    return value


def _or_none(convert: _Convert, value: Any) -> Any:
    return None if value is None else convert(value)


def _pair(
    results: Any,
    record: tuple[int, dict[str, Any], dict[str, Any]],
    names: frozenset[str],
    shown: Callable[[dict[str, Any]], Any],
    partition: int,
    source: str = "The async function",
) -> list[Any]:
    """``results`` paired with the ``record`` they are of (see ``_record``), each checked
    to be a dict with the output schema's fields."""
    row = record[1]
    if type(results) is not list:
        if not_a_result_list(results):
            returned, hint = type(results).__name__, ""
            if is_data_frame(results):
                library = type(results).__module__.split(".")[0]
                rows = "df.to_dict('records')" if library == "pandas" else "df.to_dicts()"
                returned = f"a {library} DataFrame"
                hint = f", and {rows} for the rows of a {library} DataFrame df"
            raise InvalidResultError(
                f"{source} returned {returned} for input row "
                f"{_row_text(record, shown, partition)}; it must return a list of result rows "
                f"(dicts): [row] for one result, [] for none{hint}.",
                element=row,
            )
        if inspect.isawaitable(results):
            if inspect.iscoroutine(results):
                results.close()  # never to be awaited: closed, not warned about when collected
            raise InvalidResultError(
                f"{source} returned {type(results).__name__}, an awaitable, instead of a list "
                f"of result rows for input row {_row_text(record, shown, partition)}. Did you "
                "forget `await`? Await it inside the function and return a list of result "
                "rows (dicts).",
                element=row,
            )
        try:
            results = list(results)
        except TypeError:
            raise InvalidResultError(
                f"{source} returned {type(results).__name__}, which is not iterable, "
                f"for input row {_row_text(record, shown, partition)}; return a list of result "
                "rows (dicts).",
                element=row,
            ) from None
    paired = []
    for result in results:
        if type(result) is not dict:
            if hasattr(result, "asDict"):  # a pyspark Row
                result = result.asDict(recursive=True)
            elif hasattr(result, "keys"):
                result = dict(result)
            else:
                raise ResultSchemaError(
                    f"{source} returned a {type(result).__name__} result for input row "
                    f"{_row_text(record, shown, partition)}; each result must be a dict with "
                    f"the fields {sorted(names)}."
                )
        if result.keys() != names:
            raise ResultSchemaError(
                f"A result {source.lower()} returned for input row "
                f"{_row_text(record, shown, partition)} does not match the output schema: "
                f"{_key_difference(result.keys(), names)}. The schema has the fields "
                f"{sorted(names)}."
            )
        paired.append((result, record))
    return paired


def _python_rows(chunk: pa.RecordBatch, first: int, partition: int) -> list[dict[str, Any]]:
    """``chunk``'s rows as the dicts the function gets; a value Python cannot hold fails
    naming its column and record (``first`` is the chunk's first record number)."""
    try:
        return chunk.to_pylist()
    except (OverflowError, ValueError) as exc:
        for name, column in zip(chunk.schema.names, chunk.columns, strict=True):
            for i in range(len(column)):
                try:
                    column[i].as_py()
                except (OverflowError, ValueError) as error:
                    zoned = pa.types.is_timestamp(column.type) and column.type.tz is not None
                    way = (
                        "A zoned timestamp reaches the function as a datetime in UTC, and "
                        "Python's datetime ends at 9999-12-31 (a sentinel such as TIMESTAMP "
                        "'9999-12-31 23:59:59' in a time zone west of UTC is past it in UTC): "
                        "cast the column to timestamp_ntz or a string, or clamp it, before "
                        "enriching."
                        if zoned
                        else "Cast the column to a string, or clamp it, before enriching."
                    )
                    raise ConfigurationError(
                        f"Input column {name!r} of record {first + i} of partition "
                        f"{partition} holds a value Python cannot hold ({error}). {way}"
                    ) from exc
        raise


def _row_text(
    record: tuple[int, dict[str, Any], dict[str, Any]],
    shown: Callable[[dict[str, Any]], Any],
    partition: int,
) -> str:
    """The input row of ``record`` as errors name it: as the function got it, and where."""
    return f"{describe(shown(record[1]))} (record {record[0]} of partition {partition})"


def _key_difference(keys: Any, names: frozenset[str]) -> str:
    # repr order: a function's result may have keys that are not strings, or of mixed types
    missing, extra = sorted(names - keys), sorted(keys - names, key=repr)
    return "; ".join(
        part
        for part in (
            f"missing field(s) {missing}" if missing else "",
            f"unexpected field(s) {extra}" if extra else "",
        )
        if part
    )


# -- the mapInArrow function ---------------------------------------------------------------


@dataclass(frozen=True)
class TaskSpec:
    """Everything a task needs, pickled once by Spark and shipped to executors."""

    fn: AsyncFunction[Any, Any]
    mode: OutputMode
    capacity: int
    timeout: float | None
    retry: RetryStrategy | None
    input_schema: pa.Schema
    output_schema: pa.Schema
    event_time: str | None
    max_out_of_orderness: int
    checkpoint: CheckpointConfig | None
    app_id: str
    max_in_flight: int | None = None
    metrics: Any = None  # a Spark accumulator of EnrichmentMetrics's counters
    # The input's column names where Spark was handed the input under other ones (names
    # with a dot, which mapInArrow cannot resolve): each batch gets them back.
    input_names: tuple[str, ...] | None = None
    # When the SparkContext started (_adapter._app_start): with app_id it names one
    # SparkContext, in whose run ids and task attempt owners it goes.
    app_start: str = ""
    # What output_schema does not say of the output's Spark types: which of its durations
    # are intervals ending above seconds (INTERVAL DAY, ...), for to_batch's checks.
    output_units: Units = None


def task_name(mode: OutputMode, checkpoint: CheckpointConfig | None = None) -> str:
    """``ordered_wait`` / ``unordered_wait``: what a ``PartitionTask`` is called in plans
    and Spark's UI. With checkpoints, ``..._checkpointed[job/operator@hash]``, the hash
    being of the location: the tables the task writes, which the adapter looks for in the
    plan (two enrichments writing the same ones cannot both resume)."""
    name = f"{mode.value}_wait"
    if checkpoint is None:
        return name
    where = hashlib.sha1(str(checkpoint.location).encode()).hexdigest()[:8]
    return f"{name}_checkpointed[{checkpoint.job_id}/{checkpoint.operator_id}@{where}]"


class PartitionTask:
    """The ``mapInArrow`` function of ``ordered_wait`` / ``unordered_wait``."""

    def __init__(self, spec: TaskSpec) -> None:
        self.spec = spec
        # the name Spark gives its MapInArrow (plans, the UI), which the adapter looks for
        self.__name__ = task_name(spec.mode, spec.checkpoint)

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        try:
            from pyspark import TaskContext

            context = TaskContext.get()
        except ImportError:  # pragma: no cover - the adapter always runs under Spark
            context = None
        return _TaskRun(self.spec, batches, _task_identity(self.spec, context)).run()


@dataclass(frozen=True)
class TaskIdentity:
    partition: int
    attempt: int
    run_id: str
    properties: dict[str, str]

    @property
    def streaming(self) -> bool:
        """Whether the task runs a streaming micro-batch (its run is that batch)."""
        return "batch_id" in self.properties


def _task_identity(spec: TaskSpec, context: Any) -> TaskIdentity:
    """Which run this task belongs to (see docs/checkpointing.md), from its TaskContext."""
    if context is None:  # called outside Spark (tests of the task itself)
        return TaskIdentity(0, 0, os.environ.get("STATEFUL_ASYNC_RUN_ID", "local"), {})
    batch_id = context.getLocalProperty("streaming.sql.batchId")
    query_id = context.getLocalProperty("sql.streaming.queryId")
    if batch_id is not None and query_id is not None:
        run_id = f"{query_id}.batch{batch_id}"
    else:
        run_id = f"{spec.app_id}.{spec.app_start}.stage{context.stageId()}"
    properties = {
        "attempt": str(context.attemptNumber()),
        "task_attempt_id": str(context.taskAttemptId()),  # unique in the application
        # unique across SparkContexts: who wrote a checkpoint, made a claim
        _OWNER: f"{spec.app_id}/{spec.app_start}/{context.taskAttemptId()}",
        "stage": str(context.stageId()),
        "app_id": spec.app_id,
    }
    if batch_id is not None:
        properties["batch_id"] = batch_id
    if query_id is not None:
        properties["query_id"] = query_id
    job_group = context.getLocalProperty("spark.jobGroup.id")
    if job_group:
        properties["job_group"] = job_group
    return TaskIdentity(context.partitionId(), context.attemptNumber(), run_id, properties)


def function_names(fn: Any) -> tuple[str, ...]:
    """The names checkpoints record for the user's function (the first) or recorded before
    (the others, which resumes accept as the same function): module.qualname, the same in
    every attempt and restart of a run, different for two different enrichments.

    A wrapper that calls another function and says so with ``__wrapped__``
    (``ThreadPoolAsyncFunction(f)``, the chaos faults) is named after that one:
    ``CrashOnElement(f)`` and ``f`` are one enrichment. Earlier versions named it after
    the wrapper's class, and checkpoints they wrote (a streaming batch stopped before an
    upgrade) still resume."""
    target: Any = fn
    for _ in range(100):  # a chain of wrappers, never a cycle of them
        if not isinstance(target, AsyncFunction):
            break
        if isinstance(target, CoroutineFunction):
            target = target.fn
            break
        inner = getattr(target, "__wrapped__", None)
        if inner is None:
            target = type(target)
            break
        target = inner
    before = fn.fn if isinstance(fn, CoroutineFunction) else type(fn)
    names = [_qualified(target), _qualified(before)]
    return tuple(dict.fromkeys(names))  # without repeats, in order


def _qualified(target: Any) -> str:
    if not hasattr(target, "__qualname__"):  # a callable object
        target = type(target)
    module = getattr(target, "__module__", None) or "?"
    return f"{module}.{getattr(target, '__qualname__', type(target).__qualname__)}"


class _DefaultExecutor(ThreadPoolExecutor):
    """The task loop's default executor (``asyncio.to_thread``, ``run_in_executor(None,
    ...)``): asyncio's own, counting its calls. ``asyncio.run`` waits for every one at the
    end, with no limit (from Python 3.12, up to 5 minutes); a blocking call the operator
    gave up on (it timed out, or its task failed or was stopped) would hold the task for as
    long as it blocks. Once ``left_behind`` is set, shutting down no longer waits: they go
    on in their threads."""

    def __init__(self) -> None:
        super().__init__(thread_name_prefix="asyncio")
        self._counts = threading.Lock()
        self.unfinished = 0  # submitted, not ended
        self.ended = 0
        self.left_behind = False

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        with self._counts:
            self.unfinished += 1
        try:
            future = super().submit(fn, *args, **kwargs)
        except BaseException:
            with self._counts:
                self.unfinished -= 1
            raise
        # when it is done: run, or cancelled before it ran (a call awaited by an element
        # the operator decided, still queued for a thread), which never runs at all
        future.add_done_callback(self._ended)
        return future

    def _ended(self, _: Any) -> None:
        with self._counts:
            self.unfinished -= 1
            self.ended += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=wait and not self.left_behind, cancel_futures=cancel_futures)


class _Abort(Exception):
    """Raised inside the loop thread to stop the task with a stored error."""


class _TaskRun:
    def __init__(
        self, spec: TaskSpec, batches: Iterator[pa.RecordBatch], identity: TaskIdentity
    ) -> None:
        self.spec = spec
        self.batches = batches
        self.identity = identity
        # recorded on every checkpoint: who wrote it (see _check_same_enrichment)
        self.function_names = function_names(spec.fn)
        self.properties = {
            **identity.properties,
            "function": self.function_names[0],
            OUTPUT_MODE_PROPERTY: spec.mode.value,
        }
        if spec.event_time is not None:
            self.properties[EVENT_TIME_PROPERTY] = spec.event_time
            self.properties[_OUT_OF_ORDERNESS] = str(spec.max_out_of_orderness)
        self.argument = _argument_maker(spec.input_schema)  # the function's copy of a row
        self.out: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.error: BaseException | None = None
        self.stopped_early = False  # Spark stopped reading (show(), take(), limit(n))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.driver: asyncio.Task[None] | None = None
        # output accumulated on the loop thread
        self.rows: list[dict[str, Any]] = []
        self.sources: list[tuple[int, dict[str, Any], dict[str, Any]]] = []  # their records
        self.uncommitted: list[pa.RecordBatch] = []  # results not yet in a checkpoint
        self.committed_final = False  # the final checkpoint has committed
        self.flush_scheduled = False
        self.tick: asyncio.TimerHandle | None = None  # the flush timer, once the task runs
        self.progress_timer: asyncio.TimerHandle | None = None
        # input position and checkpoint bookkeeping
        self.position = 0
        self.leftover: pa.RecordBatch | None = None
        self.last_watermark: int | None = None
        self.stats: dict[str, Any] = {
            "restored_from": None,
            "restored_results": 0,
            "restored_in_flight": 0,
            "restored_watermarks": 0,
            "skipped": 0,
            "checkpoints": 0,
        }

    # -- the task's own thread: hand batches to Spark -------------------------------------

    def run(self) -> Iterator[pa.RecordBatch]:
        thread = threading.Thread(
            target=self._thread_main,
            name=f"stateful-async-p{self.identity.partition}",
            daemon=True,
        )
        thread.start()
        ended = False  # the loop thread said done, or raised
        try:
            while True:
                kind, item = self.out.get()
                if kind == "batch":
                    yield item
                    continue
                ended = True
                if kind == "done":
                    break
                raise item
        finally:
            if not ended:  # Spark stopped reading early: stop the loop
                self.stopped_early = True
                loop, driver = self.loop, self.driver
                if loop is not None and driver is not None:
                    try:
                        loop.call_soon_threadsafe(driver.cancel)
                    except RuntimeError:
                        pass
                thread.join(timeout=30)

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self.out.put(
                (
                    "error",
                    _naming_the_row(self.error or exc, self.identity.partition, self.argument),
                )
            )
        else:
            self.out.put(("done", None))

    # -- the loop thread --------------------------------------------------------------------

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.driver = asyncio.current_task()
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="stateful-async-input")
        self.io = ThreadPoolExecutor(1, thread_name_prefix="stateful-async-checkpoint")
        self.thread_calls = _DefaultExecutor()
        self.loop.set_default_executor(self.thread_calls)
        self.started = time.monotonic()  # the task's clock: progress lines and summary
        failed: BaseException | None = None
        try:
            await self._drive()
        except BaseException as exc:
            failed = exc
            if isinstance(exc, asyncio.CancelledError) and self.error is not None:
                failed = self.error  # the loop was cancelled for this error: raised as it
                raise self.error from None
            raise
        finally:
            self.reader.shutdown(wait=False, cancel_futures=True)
            self.io.shutdown(wait=True)
            await self._let_thread_calls_end()
            if failed is not None:
                self._log_failure(failed)
        if self.spec.metrics is not None:
            self.spec.metrics.add(self._counters())
        self._log_summary(time.monotonic() - self.started)

    async def _let_thread_calls_end(self) -> None:
        """Wait for the calls the function left in the loop's default executor while they
        keep ending; once none has for ``_THREAD_CALLS_SECONDS``, say so and let the task
        end without them (asyncio.run would wait for ever, or 5 minutes from Python 3.12, on
        one that blocks for ever).

        Tasks the function left running are cancelled first, as asyncio.run cancels them
        before its own wait: one that keeps starting calls (a watch loop its close() did
        not stop) would otherwise keep this wait from ever ending."""
        current = asyncio.current_task()
        for task in asyncio.all_tasks():
            if task is not current:
                task.cancel()
        executor = self.thread_calls
        ended, quiet_since = executor.ended, time.monotonic()
        try:
            while executor.unfinished > 0:
                if executor.ended != ended:
                    ended, quiet_since = executor.ended, time.monotonic()
                elif time.monotonic() - quiet_since >= _THREAD_CALLS_SECONDS:
                    executor.left_behind = True
                    _write_line(
                        f"stateful-async: partition {self.identity.partition} attempt "
                        f"{self.identity.attempt}: "
                        f"{_count(executor.unfinished, 'call')} the function left in the event "
                        "loop's default executor (asyncio.to_thread, run_in_executor(None, "
                        f"...)) still running, none ended in {_THREAD_CALLS_SECONDS:g} s; the "
                        "task ends without them, and they go on in their threads. A call the "
                        "task gave up on (timed out, or of a failed or stopped task) is not "
                        "stopped by that: give blocking calls a timeout of their own."
                    )
                    return
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:  # stopped (again) meanwhile: no more waiting
            executor.left_behind = True
            if not self.stopped_early:
                raise
            # Spark read no further: the task's end goes on (raised from _main's finally,
            # this cancellation hid the task's line, and the error it had failed with)

    async def _drive(self) -> None:
        spec = self.spec
        self.progress = _progress_seconds()  # a bad setting fails the task before any I/O
        fn_class = _RowFunctionWithTimeout if has_timeout_handler(spec.fn) else _RowFunction
        function = fn_class(
            spec.fn, frozenset(spec.output_schema.names), self.argument, self.identity.partition
        )
        self.op = AsyncWaitOperator(
            function,
            self._on_output,
            spec.mode,
            spec.capacity,
            spec.timeout,
            _on_rows(spec.retry),
            max_in_flight=spec.max_in_flight,
        )
        self.checkpointing = spec.checkpoint is not None
        # progress lines from the start: a resume (skipping input, re-emitting results) can
        # be the longest part of a retried task
        self.progress_at = self.started
        self.progress_records = 0
        if self.progress:
            self.progress_timer = self.loop.call_later(  # type: ignore[union-attr]
                self.progress, self._log_progress
            )
        try:
            restored = await self._restore() if self.checkpointing else []
            self.tick = self.loop.call_later(_FLUSH_SECONDS, self._tick)  # type: ignore[union-attr]
            await self.op.open(restored=restored)
            await self._consume()
            # The end of a partition is not the end of the job: its last elements keep
            # their retries (Flink's end-of-input drain would make each one's current
            # attempt its last).
            await self.op.finish(keep_retrying=True)
            self._flush()
            if self.checkpointing and self._nothing_to_checkpoint():
                self._remember_empty()
            elif self.checkpointing:
                await self._checkpoint(final=True)
                retain = spec.checkpoint.retain  # type: ignore[union-attr]
                await self._in_io(self.log.expire, retain, run_id=self.identity.run_id)
        except BaseException as failure:
            self._stop_timers()
            await self._close_after(failure)
            raise
        self._stop_timers()
        await self.op.close()
        self._flush()

    def _stop_timers(self) -> None:
        for timer in (self.tick, self.progress_timer):
            if timer is not None:
                timer.cancel()

    async def _close_after(self, failure: BaseException) -> None:
        """Close the operator of a failed task. A ``close()`` that raises too (often for the
        same cause: a broken client) must not replace the failure, which names the row: it
        is logged, and the task fails with the failure."""
        try:
            await self.op.close()
        except Exception as error:
            _write_line(
                f"stateful-async: partition {self.identity.partition} attempt "
                f"{self.identity.attempt}: the function's close() raised "
                f"{type(error).__name__}: {error_text(error)}, after the task had failed with "
                f"{type(failure).__name__}, which the task reports. close()'s traceback:\n"
                + "".join(traceback.format_exception(error))
            )

    # -- input ------------------------------------------------------------------------------

    async def _next_batch(self) -> pa.RecordBatch | None:
        if self.leftover is not None:
            batch, self.leftover = self.leftover, None
            return batch
        await self._wait_for_room()
        assert self.loop is not None
        return await self.loop.run_in_executor(self.reader, self._read)

    def _read(self) -> pa.RecordBatch | None:
        batch = next(self.batches, None)
        if batch is None:
            return None
        if self.spec.input_names is not None:
            batch = batch.rename_columns(list(self.spec.input_names))
        return in_utc(batch)

    async def _wait_for_room(self) -> None:
        while self.out.qsize() > _MAX_QUEUED_BATCHES:  # Spark is slower than we are
            await asyncio.sleep(0.005)

    async def _consume(self) -> None:
        spec = self.spec
        process = self.op.process_element
        interval = spec.checkpoint.interval_records if spec.checkpoint else None
        seconds = spec.checkpoint._seconds if spec.checkpoint else None
        event_time = spec.event_time
        argument = self.argument
        out = self.out
        self.last_checkpoint = time.monotonic()  # the interval runs from here, not from restore
        while True:
            batch = await self._next_batch()
            if batch is None:
                return
            offset = 0
            while offset < batch.num_rows:
                size = min(_CHUNK_ROWS, batch.num_rows - offset)
                if interval is not None:
                    size = min(size, interval - self.position % interval)
                chunk = batch.slice(offset, size)
                rows = _python_rows(chunk, self.position, self.identity.partition)
                # taken before any call: what the input was, whatever a function does to it
                reprs = [repr(row) for row in rows] if self.checkpointing else []
                stamps = None if event_time is None else _timestamps(chunk, event_time)
                seq = self.position
                # interval_seconds is looked at after every record (a chunk of slow calls can
                # take far longer than it); when it is due, the chunk ends there.
                due = None if seconds is None else self.last_checkpoint + seconds
                for row, stamp in zip(rows, stamps or itertools.repeat(None), strict=False):
                    # output backpressure per record, not per input batch: the results of
                    # one batch's rows would fill the queue past the bound while Spark waits
                    if out.qsize() > _MAX_QUEUED_BATCHES:
                        await self._wait_for_room()
                    await process(_record(seq, row, stamp, argument))
                    seq += 1
                    if due is not None and time.monotonic() >= due:
                        break
                if seq - self.position < len(rows):
                    rows = rows[: seq - self.position]
                    stamps = stamps[: len(rows)] if stamps else None
                offset += len(rows)
                if stamps is not None:
                    await self._advance_watermark(stamps)
                if self.checkpointing:
                    self.fingerprint.update_reprs(reprs[: len(rows)])
                self.position = seq
                if self.checkpointing and (
                    self.position % interval == 0  # type: ignore[operator]
                    or (seconds is not None and time.monotonic() - self.last_checkpoint >= seconds)
                ):
                    await self._checkpoint()

    async def _advance_watermark(self, stamps: list[int | None]) -> None:
        present = [s for s in stamps if s is not None]
        if not present:
            return
        # never below the smallest 64-bit integer, which checkpoints store watermarks in
        watermark = max(max(present) - self.spec.max_out_of_orderness - 1, -(2**63))
        if self.last_watermark is None or watermark > self.last_watermark:
            self.last_watermark = watermark
            await self.op.process_watermark(Watermark(watermark))

    # -- output -----------------------------------------------------------------------------

    def _on_output(self, element: StreamElement) -> None:
        if type(element) is Watermark:
            return  # watermarks order the operator's output; Spark rows do not carry them
        result, source = element.value  # type: ignore[union-attr]
        self.rows.append(result)
        self.sources.append(source)
        if len(self.rows) >= _OUTPUT_ROWS and not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush_soon)  # type: ignore[union-attr]

    def _flush_soon(self) -> None:
        self.flush_scheduled = False
        try:
            self._flush()
        except BaseException as exc:
            self._abort(exc)

    def _tick(self) -> None:
        self._flush_soon()
        assert self.loop is not None
        self.tick = self.loop.call_later(_FLUSH_SECONDS, self._tick)

    def _flush(self) -> None:
        if not self.rows:
            return
        rows, sources = self.rows, self.sources
        self.rows, self.sources = [], []
        batch = to_batch(
            rows, sources, self.spec.output_schema, self._described, self.spec.output_units
        )
        if self.checkpointing and not self.committed_final:
            # Held until the checkpoint that holds it has committed (_checkpoint): what
            # leaves the task is what a retry re-emits as it is. An enrichment chained after
            # this one in the same task (checkpointed itself) then only ever consumes
            # results a retry reproduces, however the service answers the calls the retry
            # makes again, so its own checkpoints' input check holds.
            self.uncommitted.append(batch)
            return
        # one call may return many results, and more pile up until a flush runs
        for start in range(0, batch.num_rows, _OUTPUT_ROWS):
            self.out.put(("batch", batch.slice(start, _OUTPUT_ROWS)))

    def _described(self, record: tuple[int, dict[str, Any], dict[str, Any]]) -> str:
        return _row_text(record, self.argument, self.identity.partition)

    def _abort(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        if self.driver is not None:
            self.driver.cancel()

    # -- checkpoints ------------------------------------------------------------------------

    async def _in_io(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        assert self.loop is not None
        return await self.loop.run_in_executor(self.io, functools.partial(fn, *args, **kwargs))

    def _nothing_to_checkpoint(self) -> bool:
        """A micro-batch's partition that had no input, and no checkpoint of its run to
        resume: a retry of it starts as it did and ends the same, empty, so its final
        checkpoint (and the expiry after it), a few Delta commits per partition and
        micro-batch, would keep nothing. A batch job's partition still commits one: a later
        run's ``restore_from`` takes each partition's newest checkpoint, which must be this
        run's, empty, not an earlier run's."""
        return (
            self.identity.streaming
            and self.position == 0
            and self.parent is None
            and not self.stats["checkpoints"]
        )

    def _key(self, config: CheckpointConfig) -> tuple[str, ...]:
        """The checkpoints this task's partition of the run would write."""
        return (
            str(config.location),
            config.job_id,
            config.operator_id,
            str(self.identity.partition),
            self.identity.run_id,
        )

    def _remember_empty(self) -> None:
        """An empty partition left no checkpoint, which is how a second computation of the
        same partition in this task attempt (``coalesce()`` after the enrichment) is told
        apart (``_check_not_this_attempt``): remember it instead, for this task attempt
        only (a worker runs one task at a time)."""
        global _EMPTY_UNCOMMITTED
        owner = self.properties.get(_OWNER)
        if owner is None:
            return
        if _EMPTY_UNCOMMITTED[0] != owner:
            _EMPTY_UNCOMMITTED = (owner, set())
        _EMPTY_UNCOMMITTED[1].add(self._key(self.spec.checkpoint))  # type: ignore[arg-type]

    async def _restore(self) -> list[StreamElement]:
        from checkpoint import InputFingerprint, SnapshotStore

        config = self.spec.checkpoint
        assert config is not None
        store = SnapshotStore(config.location, config.storage_options)
        self.log = store.subtask(config.job_id, config.operator_id, self.identity.partition)
        self.fingerprint = InputFingerprint()
        self.last_checkpoint = time.monotonic()
        self.restored_final = False
        point = await self._in_io(self._find_restore_point, config)
        # Above every id this run committed, restorable or not: its checkpoints may be gone
        # (another run's retention, an expire by hand) while its app transaction, which
        # refuses any id at or below it, stays.
        committed = await self._in_io(self.log.last_committed_id, self.identity.run_id) or 0
        self.next_id = max(committed, point.metadata.checkpoint_id if point else 0) + 1
        self.parent = None
        if point is None:
            return []
        meta = point.metadata
        self.parent = meta.ref
        self.restored_final = meta.final
        self.stats.update(
            restored_from=str(meta.ref),
            restored_results=0,
            restored_in_flight=sum(type(e) is not Watermark for e in point.elements),
            restored_watermarks=sum(type(e) is Watermark for e in point.elements),
        )
        same_run = meta.run_id == self.identity.run_id
        # a micro-batch replayed by a restarted query (another execution of it: its run id,
        # Spark's job group), rather than Spark's retry of a task of this execution
        replayed = self.identity.streaming and any(
            meta.properties.get(key) != self.properties.get(key) for key in ("job_group", "app_id")
        )
        await self._skip_consumed(
            meta.position, meta.fingerprint, str(meta.ref), same_run, replayed
        )
        # Committed results are re-emitted, not recomputed: read a group of checkpoints'
        # results at a time, and only as fast as Spark takes them.
        groups = self.log.chain_results(meta)
        while (group := await self._in_io(next, groups, None)) is not None:
            results, _ = group  # Spark rows carry no timestamps
            self.stats["restored_results"] += results.num_rows
            for batch in results.to_batches(max_chunksize=_OUTPUT_ROWS):
                await self._wait_for_room()
                self.out.put(("batch", batch))
        # The last watermark generated (the highest, those of the snapshot included) is
        # carried on only if this task generates them alike: one of another event_time
        # column (other units) or max_out_of_orderness would hold back its watermarks. A
        # checkpoint that records neither was written before they were recorded: as then.
        if _WATERMARK in meta.properties and (
            EVENT_TIME_PROPERTY not in meta.properties
            or all(meta.properties.get(key) == self.properties.get(key) for key in _SAME_WATERMARKS)
        ):
            self.last_watermark = int(meta.properties[_WATERMARK])
        restored: list[StreamElement] = []
        for element, seq in zip(point.elements, point.input_seqs, strict=True):
            if type(element) is Watermark:
                restored.append(element)
            else:
                restored.append(_record(seq, element.value, element.timestamp, self.argument))
        return restored

    def _find_restore_point(self, config: CheckpointConfig) -> Any:
        if config.restore_from is not None and self.identity.streaming:
            # foreachBatch hands over a batch DataFrame, which the driver cannot tell from
            # a batch job's (the driver refuses it where it can: _async_wait)
            raise ConfigurationError(restore_from_in_streaming(config.restore_from))
        log = self.log
        owner = self.properties.get(_OWNER)
        if owner is not None and _EMPTY_UNCOMMITTED[0] == owner:
            if self._key(config) in _EMPTY_UNCOMMITTED[1]:
                raise self._run_twice_in_one_task("computed it already: no input, nothing kept")
        if owner is not None and log.claimed_by(self.identity.run_id, owner):
            latest = log.latest(run_id=self.identity.run_id)
            if latest is not None:
                self._check_same_enrichment(latest)  # another enrichment took it over
            raise self._run_twice_in_one_task("already took this run over")
        # An earlier attempt of this run may still be running and committing (a cancelled
        # task's worker lives on for a while): fence it off first, then read what it left.
        self.stats["claim"], meta = log.take_over(self.identity.run_id, owner)  # a retry
        if meta is None and config.restore_from is not None:  # a new run that asks to resume
            max_id = None if config.restore_from == "latest" else int(config.restore_from)
            meta = log.latest(max_id=max_id)
            if meta is None:  # none restorable: had this partition one that has expired?
                metas = log.checkpoints(include_expired=True)
                gone = sorted(
                    {m.checkpoint_id for m in metas if max_id is None or m.checkpoint_id <= max_id}
                )
                if gone:
                    from checkpoint import CheckpointNotFoundError

                    restorable = sorted({m.checkpoint_id for m in metas if not m.expired})
                    raise CheckpointNotFoundError(
                        f"Partition {self.identity.partition} cannot resume from "
                        f"restore_from={config.restore_from!r}: its checkpoint(s) "
                        f"{id_ranges(gone)} have expired (retain={config.retain} keeps the "
                        "newest per partition). Restorable ids of this partition: "
                        f"{id_ranges(restorable)}. Pick one of those, or drop restore_from to "
                        "start this job fresh."
                    )
        if meta is None:
            return None
        log.check_schemas(self.spec.input_schema, self.spec.output_schema)
        if meta.run_id == self.identity.run_id:
            self._check_same_enrichment(meta)
            self._check_not_this_attempt(meta)
        self._check_order_kept(meta)
        return log.load(meta.checkpoint_id, meta.run_id, results=False)  # see chain_results

    def _check_same_enrichment(self, meta: Any) -> None:
        """A checkpoint of this task's own run, written by another enrichment or another
        stage of the same execution, is not this task's to resume. That happens in streaming,
        where a run is a micro-batch: two enrichments with one job_id and operator_id in a
        query (a stream-stream join), or in foreachBatch, where every action of a micro-batch
        shares its run. Resuming would re-emit the other's results as this one's."""
        theirs, ours = meta.properties, self.properties
        other_function = theirs.get("function", ours["function"]) not in self.function_names
        other_stage = (
            theirs.get("job_group") == ours.get("job_group")
            and theirs.get("app_id") == ours.get("app_id")
            and theirs.get("stage", ours.get("stage")) != ours.get("stage")
        )
        if not other_function and not (other_stage and "batch_id" in ours):
            return
        if (
            other_function
            and "batch_id" in ours
            and theirs.get("job_group") != ours.get("job_group")
        ):
            raise self._changed_function(meta, theirs.get("function"), ours["function"])
        what = "function" if other_function else "stage"
        same = "" if other_function else " of this same micro-batch execution"
        raise self._shared_checkpoint(
            f"found checkpoint {meta.ref} written by {what} {theirs.get(what)}{same}; this task "
            f"runs {what} {ours.get(what)}",
            ""
            if other_function
            else " Or the query was restarted and foreachBatch sets its own job group "
            f"({ours.get('job_group')!r}), which hides the query's run id that tells a "
            "restart from another stage: drop that setJobGroup call (a job description "
            "does no harm), or restart the query in a new application.",
        )

    def _check_not_this_attempt(self, meta: Any) -> None:
        """A resume reads an *earlier* attempt's checkpoint. One written (or a run taken
        over, ``_find_restore_point``) by this very task attempt means Spark runs this
        enrichment's partition a second time in one task: ``coalesce()`` after it computes
        several of its partitions one after another in one task, and they all report that
        task's partition number, so their checkpoints would mix (the next one would take
        the previous one's as its own and refuse its input)."""
        if self._written_by_this_attempt(meta):
            raise self._run_twice_in_one_task(f"already wrote checkpoint {meta.ref}")

    def _written_by_this_attempt(self, meta: Any) -> bool:
        """Whether this very task attempt wrote the checkpoint ``meta``. (Checkpoints older
        than the owner property are taken as another attempt's.)"""
        ours = self.properties.get(_OWNER)
        return ours is not None and meta.properties.get(_OWNER) == ours

    def _run_twice_in_one_task(self, done: str) -> ConfigurationError:
        """The error for a partition of the enrichment computed twice in one task attempt
        (``_check_not_this_attempt``); ``done`` says how the first one shows."""
        config = self.spec.checkpoint
        assert config is not None
        return ConfigurationError(
            f"Spark is running partition {self.identity.partition} of this checkpointed "
            f"enrichment (job {config.job_id!r}, operator {config.operator_id!r}) a second "
            f"time in one task (run {self.identity.run_id!r}; this task attempt {done}). "
            "Checkpoints are kept per Spark partition, so "
            "they cannot tell the two apart. coalesce() after ordered_wait / unordered_wait "
            "does this (it computes several of the enrichment's partitions in one task): "
            "use repartition(n) instead, or coalesce the input before the enrichment, or "
            "write the enriched DataFrame out first. Two enrichments chained in one stage "
            "with the same job_id and operator_id do it too: give each its own operator_id."
        )

    def _check_order_kept(self, meta: Any) -> None:
        """``ordered_wait`` promises its partition's results in input order; a checkpoint of
        ``unordered_wait`` holds results in completion order, and re-emitting them would
        break that promise without a word. (The other way round is fine: results in input
        order are one of the orders ``unordered_wait`` may emit.) Checkpoints written before
        the mode was recorded are taken as they are."""
        theirs = meta.properties.get(OUTPUT_MODE_PROPERTY)
        if self.spec.mode is not OutputMode.ORDERED or theirs != OutputMode.UNORDERED.value:
            return
        from checkpoint import CheckpointConflictError

        config = self.spec.checkpoint
        assert config is not None
        same_run = meta.run_id == self.identity.run_id
        raise CheckpointConflictError(
            f"Partition {self.identity.partition} cannot resume from checkpoint {meta.ref} "
            f"(job {config.job_id!r}, operator {config.operator_id!r}): unordered_wait wrote "
            "it, and this job runs ordered_wait. Its results were emitted in completion "
            "order; re-emitting them would break ordered_wait's input order. "
            + (
                "Finish this micro-batch with unordered_wait, then switch; or give the "
                "ordered enrichment a new operator_id (CheckpointConfig(..., operator_id=...)) "
                "to redo the batch."
                if same_run
                else "Resume with unordered_wait, or start ordered_wait fresh: drop "
                "restore_from, or give it a new operator_id."
            )
        )

    def _changed_function(self, meta: Any, theirs: str | None, ours: str) -> Exception:
        """The error for a query restarted mid-batch with another function: most likely the
        code changed (or was renamed) between the runs of the query."""
        from checkpoint import CheckpointConflictError

        config = self.spec.checkpoint
        assert config is not None
        return CheckpointConflictError(
            f"Partition {self.identity.partition} of micro-batch {self.identity.run_id!r} "
            f"(job {config.job_id!r}, operator {config.operator_id!r}) found checkpoint "
            f"{meta.ref}, written by function {theirs} in an earlier run of this query; this "
            f"run calls function {ours}. The query stopped during this batch and restarted "
            "with other code, and this batch's committed results came from the old one. "
            "Either run the old function until this batch has completed, then switch; or, to "
            "redo the batch with the new function, give it a new operator_id "
            "(CheckpointConfig(..., operator_id=...)): the batch then starts over and calls "
            "the service again for every row of it. (If instead two enrichments of this "
            "query share job_id and operator_id, give each its own operator_id.)"
        )

    def _shared_checkpoint(self, found: str, hint: str = "") -> Exception:
        """The error for two enrichments that write one run's checkpoints."""
        from checkpoint import CheckpointConflictError

        config = self.spec.checkpoint
        assert config is not None
        return CheckpointConflictError(
            f"Partition {self.identity.partition} of run {self.identity.run_id!r} (job "
            f"{config.job_id!r}, operator {config.operator_id!r}) {found}. Two enrichments "
            "of one run (one Spark stage, or one streaming micro-batch) share these "
            "checkpoints: give each its own operator_id (CheckpointConfig(..., "
            "operator_id=...)), and persist() an enriched DataFrame that foreachBatch uses "
            "more than once." + hint
        )

    async def _skip_consumed(
        self, position: int, fingerprint: str, ref: str, same_run: bool, replayed: bool
    ) -> None:
        while self.position < position:
            batch = await self._next_batch()
            if batch is None:
                break
            take = min(batch.num_rows, position - self.position)
            # a chunk of Python rows at a time, as _consume reads them: a large input batch
            # is not held as Python rows all at once, nor does it hold up the loop's timers
            for start in range(0, take, _CHUNK_ROWS):
                size = min(_CHUNK_ROWS, take - start)
                self.fingerprint.update(batch.slice(start, size).to_pylist())
                self.position += size
                self.stats["skipped"] = self.position  # as it goes: progress lines show it
                await asyncio.sleep(0)
            if take < batch.num_rows:
                self.leftover = batch.slice(take)
        found = self.fingerprint.hexdigest()
        if self.position < position or found != fingerprint:
            config = self.spec.checkpoint
            assert config is not None
            if replayed:
                # A streaming query has no restore_from: every restart replays this batch.
                advice = (
                    "A restarted streaming query re-reads this micro-batch, and this "
                    "partition now reads other records: most likely the batch is split into "
                    "partitions differently than before the restart (another "
                    "spark.sql.files.maxPartitionBytes or number of cores, say), or its "
                    "source files changed. Either restore what decides the split until this "
                    "batch has completed, or give the enrichment a new operator_id "
                    "(CheckpointConfig(..., operator_id=...)): the batch then starts over "
                    "and calls the service again for every row of it."
                )
            elif same_run:
                # Not a choice the user made (restore_from): Spark retried the task, and the
                # retry read what the first attempt did not.
                advice = (
                    "This attempt is Spark's retry of a task of the same run, so the "
                    "partition's input is not deterministic: after a shuffle (repartition, "
                    "join, groupBy), the order in which a task fetches its rows can differ "
                    "from one attempt to the next; a source that changed under the job, a "
                    "non-deterministic expression (rand(), a UDF), or an unordered_wait "
                    "without checkpoints earlier in this stage (its results come in "
                    "completion order, which differs from attempt to attempt) does the same. "
                    "Every retry of this task is refused alike. Make the input deterministic "
                    "before the enrichment (after a shuffle: df.sortWithinPartitions(<a "
                    "unique key>); after unordered_wait: ordered_wait there, or write its "
                    "output out first) and run the job again."
                )
            else:
                advice = (
                    "Resuming needs the same input in the same order, split into the same "
                    "partitions: each partition resumes the checkpoint of the partition with "
                    "its number, so a plan that splits the input otherwise (a union or a "
                    "repartition added before the enrichment, other source files, another "
                    "spark.sql.files.maxPartitionBytes) is refused alike. Fix the input, or "
                    "start a new run without restore_from (or under a new job_id)."
                )
            raise InputMismatchError(
                f"Partition {self.identity.partition} cannot resume from checkpoint {ref} of job "
                f"{config.job_id!r}: that checkpoint had consumed {position} input records "
                f"(fingerprint {fingerprint}), but the first {self.position} records read now "
                f"have fingerprint {found}. The input differs from the one the checkpoint was "
                "taken on (changed data, or an order that is not deterministic, e.g. after a "
                f"shuffle). {advice}"
            )

    async def _checkpoint(self, final: bool = False) -> None:
        self._flush()
        if (
            final
            and self.restored_final
            and self.position == self.stats["skipped"]
            and not self.uncommitted
        ):
            self.committed_final = True
            return  # restored a finished partition and did nothing new: nothing to record
        checkpoint_id = self.next_id
        snapshot = self.op.snapshot_state(checkpoint_id)
        elements: list[StreamElement] = []
        seqs: list[int | None] = []
        for element in snapshot:
            if type(element) is Watermark:
                elements.append(element)
                seqs.append(None)
            else:
                seq, row, _ = element.value  # type: ignore[union-attr]
                elements.append(StreamRecord(row, element.timestamp))
                seqs.append(seq)
        schema = self.spec.output_schema
        results = pa.Table.from_batches(self.uncommitted, schema=schema)
        self.uncommitted = []
        config = self.spec.checkpoint
        assert config is not None
        # Input waits for the commit (calls in flight go on meanwhile): the input consumed
        # past the last durable checkpoint never exceeds one interval, which is what bounds
        # the repeated requests after a crash (capacity + interval).
        await self._in_io(
            self._commit,
            checkpoint_id,
            elements,
            results,
            input_schema=self.spec.input_schema,
            output_schema=schema,
            position=self.position,
            fingerprint=self.fingerprint.hexdigest(),
            parent=self.parent,
            input_seqs=seqs,
            final=final,
            properties=self._checkpoint_properties(),
        )
        from checkpoint import CheckpointRef

        self.parent = CheckpointRef(self.identity.run_id, checkpoint_id)
        self.next_id += 1
        self.last_checkpoint = time.monotonic()
        self.stats["checkpoints"] += 1
        self.committed_final = final
        # now durable: they may leave (as Spark takes them)
        for batch in results.to_batches(max_chunksize=_OUTPUT_ROWS):
            await self._wait_for_room()
            self.out.put(("batch", batch))
        if not final and self.stats["checkpoints"] % _EXPIRE_EVERY == 0:
            await self._in_io(self.log.expire, config.retain, run_id=self.identity.run_id)

    def _checkpoint_properties(self) -> dict[str, str]:
        """The task's properties, and the last watermark generated: one already emitted is
        in no snapshot, and a resume must not generate lower ones after it."""
        if self.last_watermark is None:
            return self.properties
        return {**self.properties, _WATERMARK: str(self.last_watermark)}

    def _commit(self, checkpoint_id: int, *args: Any, **kwargs: Any) -> None:
        from checkpoint import CheckpointConflictError

        run_id = self.identity.run_id
        try:
            self.log.commit(run_id, checkpoint_id, *args, **kwargs)
        except CheckpointConflictError:
            # Refused as late. A zombie is an earlier attempt; a checkpoint ahead of this
            # one by this very attempt was written by another enrichment in this task.
            latest = self.log.latest(run_id=run_id)
            if latest is None or latest.checkpoint_id < checkpoint_id:
                raise
            if not self._written_by_this_attempt(latest):
                raise
            raise self._shared_checkpoint(
                f"could not commit checkpoint {checkpoint_id}: this same task attempt has "
                f"already committed checkpoint {latest.checkpoint_id}, by function "
                f"{latest.properties.get('function')}"
            ) from None

    def _log_progress(self) -> None:
        """Every ``STATEFUL_ASYNC_PROGRESS_SECONDS`` while the task runs: where it is, so that
        a long task's executor log shows it moving (or stuck behind a slow service)."""
        now = time.monotonic()
        op = self.op
        records = op.metrics.records_in
        rate = (records - self.progress_records) / max(now - self.progress_at, 1e-9)
        self.progress_at, self.progress_records = now, records
        parts = self._task_parts(now - self.started)
        parts[2] += f" ({rate:,.0f}/s lately)"
        parts[4:4] = [
            _count(op.calls_in_flight, "call") + " in flight",
            f"{op.in_flight:,} in the queue",
        ]
        if self.checkpointing and self.stats["checkpoints"]:
            parts[-1] += f", the last {now - self.last_checkpoint:.0f} s ago"
        parts.extend(self._restored_parts())
        _write_line("stateful-async: " + ", ".join(parts) + " (in progress)")
        self.progress_timer = self.loop.call_later(  # type: ignore[union-attr]
            self.progress, self._log_progress
        )

    def _task_parts(self, seconds: float) -> list[str]:
        """The task's line: who it is, then what this attempt did (a resumed attempt's
        re-emitted results are counted apart, by _restored_parts)."""
        metrics = self.op.metrics
        parts = [
            f"partition {self.identity.partition} attempt {self.identity.attempt}",
            f"run {self.identity.run_id}",
            _count(metrics.records_in, "record") + " invoked",
            _count(metrics.results_out, "result") + " emitted",
            _count(metrics.retries, "retry", "retries"),
            _count(metrics.timeouts, "timeout"),
            f"{seconds:.1f} s",
        ]
        if self.checkpointing:
            parts.append(_count(self.stats["checkpoints"], "checkpoint"))
        return parts

    def _restored_parts(self) -> list[str]:
        """What a resumed attempt took from its checkpoint (as it goes, in progress lines)."""
        if not self.checkpointing:
            return []
        stats = self.stats
        parts = ["took the run over from earlier attempts"] if stats.get("claim") else []
        if stats["restored_from"]:
            done = [
                _count(stats["restored_results"], "result") + " re-emitted",
                f"{stats['restored_in_flight']:,} in flight re-invoked",
                _count(stats["restored_watermarks"], "watermark") + " replayed",
                _count(stats["skipped"], "input") + " skipped",
            ]
            if not stats["restored_watermarks"]:
                del done[2]
            parts.append(f"restored from {stats['restored_from']} ({', '.join(done)})")
        return parts

    def _counters(self) -> dict[str, int]:
        """This finished task's counts, as EnrichmentMetrics adds them up."""
        metrics, stats = self.op.metrics, self.stats
        return {
            "tasks": 1,
            "records": metrics.records_in,
            "results": metrics.results_out,
            "attempts": metrics.attempts,
            "retries": metrics.retries,
            "timeouts": metrics.timeouts,
            "checkpoints": stats["checkpoints"],
            "resumed_tasks": int(stats["restored_from"] is not None),
            "restored_results": stats["restored_results"],
            "restored_in_flight": stats["restored_in_flight"],
            "skipped_inputs": stats["skipped"],
        }

    def _log_summary(self, seconds: float, ending: str = "") -> None:
        if os.environ.get("STATEFUL_ASYNC_TASK_LOG", "1") == "0":
            return
        parts = self._task_parts(seconds) + self._restored_parts()
        _write_line("stateful-async: " + ", ".join(parts) + ending)

    def _log_failure(self, error: BaseException) -> None:
        """A failed attempt's line too: what it did before the error (which Spark reports).
        Nothing when it failed before its operator existed; never masks the error."""
        if getattr(self, "op", None) is None:
            return
        ending = f" (failed: {type(error).__name__})"
        if self.stopped_early and isinstance(error, asyncio.CancelledError):
            ending = " (stopped: Spark read no further)"  # not a failure: show(), take()
        try:
            self._log_summary(time.monotonic() - self.started, ending)
        except Exception:  # the line is a courtesy; the task's own error is what matters
            pass


def _write_line(text: str) -> None:
    """One line of the task's log, to its executor's stderr. The log is a courtesy: a
    stream that cannot take a line (closed: ValueError; a broken pipe or a full disk behind
    it: OSError) loses that line, not the later ones, nor the task."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n:,} {one if n == 1 else many or one + 's'}"


PROGRESS_VARIABLE = "STATEFUL_ASYNC_PROGRESS_SECONDS"


def progress_seconds(text: str | None, where: str) -> float:
    """A progress interval setting (``where`` says whose, for the error); 0 turns it off."""
    if text is None:
        return _PROGRESS_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < math.inf:
        raise ConfigurationError(
            f"{PROGRESS_VARIABLE} must be a number of seconds >= 0 (0: no progress lines); "
            f"{where} has {text!r}."
        )
    return seconds


def _progress_seconds() -> float:
    """The task's progress interval, from the executor's environment (the driver checked
    what it could see of it)."""
    if os.environ.get("STATEFUL_ASYNC_TASK_LOG", "1") == "0":
        return 0.0
    return progress_seconds(os.environ.get(PROGRESS_VARIABLE), "the executor")


def _naming_the_row(
    error: BaseException, partition: int, shown: Callable[[dict[str, Any]], Any]
) -> BaseException:
    """The operator names a failed element as this task wraps it, ``StreamRecord((seq,
    row, argument))``: name the input row and its place in the partition instead."""
    if not isinstance(error, ElementFailedError) or not isinstance(error.element, StreamRecord):
        return error
    value = error.element.value
    if not (isinstance(value, tuple) and len(value) == 3 and isinstance(value[1], dict)):
        return error
    seq, row, _ = value
    wrapped = f"for element {describe(error.element)}"
    plain = f"for input row {describe(shown(row))} (record {seq} of partition {partition})"
    if wrapped not in str(error):
        return error
    renamed = type(error)(
        str(error).replace(wrapped, plain, 1), element=row, attempts=error.attempts
    )
    renamed.__cause__ = error.__cause__
    return renamed


def in_utc(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` with every zoned timestamp (at any depth) in UTC: the same instants.

    Spark hands zoned timestamps over in the session's time zone; a checkpoint stores, and
    restores, them in UTC. The function sees UTC either way, so a retried attempt invokes it
    on restored rows with the values the first attempt had, and the input fingerprint does
    not change with the session's time zone."""
    types = [_utc_type(t) for t in batch.schema.types]
    if types == batch.schema.types:
        return batch
    from checkpoint._types import from_storage  # casts nested arrays child by child

    fields = [f.with_type(t) for f, t in zip(batch.schema, types, strict=True)]
    return pa.RecordBatch.from_arrays(
        [from_storage(c, t) for c, t in zip(batch.columns, types, strict=True)],
        schema=pa.schema(fields, metadata=batch.schema.metadata),
    )


def _utc_type(t: pa.DataType) -> pa.DataType:
    if pa.types.is_timestamp(t):
        return t if t.tz in (None, "UTC") else pa.timestamp(t.unit, "UTC")
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_utc_type(f.type)) for f in t])
    if pa.types.is_map(t):
        key, item = t.key_field, t.item_field
        return pa.map_(
            key.with_type(_utc_type(key.type)), item.with_type(_utc_type(item.type)), t.keys_sorted
        )
    if pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(_utc_type(t.value_type)))
    if pa.types.is_large_list(t):
        return pa.large_list(t.value_field.with_type(_utc_type(t.value_type)))
    return t


def _timestamps(chunk: pa.RecordBatch, column: str) -> list[int | None]:
    array = chunk.column(column)
    if pa.types.is_timestamp(array.type):
        array = array.cast(pa.timestamp("us", tz=array.type.tz)).cast(pa.int64())
    elif pa.types.is_date(array.type):
        array = array.cast(pa.date32()).cast(pa.int32()).cast(pa.int64())
    return array.cast(pa.int64()).to_pylist()
