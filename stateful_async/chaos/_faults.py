"""Fault injection for enrichment jobs: off unless a job wraps its function in one.

``CrashOnElement`` kills the Python worker (``os._exit``, as a segfault or an OOM kill
would) when it is asked to enrich a chosen row on a chosen task attempt, so a test can
crash a task mid-partition and watch it resume.
"""

from __future__ import annotations

import os
import reprlib
import time
from typing import Any, Iterable

from .._exceptions import ConfigurationError, as_int
from .._function import AsyncFunction, as_async_function, has_timeout_handler


def _armed(attempt: int, partitions: frozenset[int] | None) -> bool:
    """Whether the running task is the attempt (and partition) a fault is aimed at."""
    try:
        from pyspark import TaskContext

        context = TaskContext.get()
    except ImportError:
        context = None
    current = context.attemptNumber() if context else 0
    partition = context.partitionId() if context else 0
    return current == attempt and (partitions is None or partition in partitions)


def checked_aim(attempt: int, partitions: Iterable[int] | None) -> frozenset[int] | None:
    """Checks where a fault is aimed (a fault aimed at a negative attempt or partition
    would never fire, and the test using it would pass for the wrong reason); returns the
    partitions as a set, or None for any."""
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
        raise ConfigurationError(
            f"A fault's attempt is a task attempt number (0 = the first); got {attempt!r}."
        )
    if partitions is None:
        return None
    chosen = frozenset(partitions)
    wrong = [p for p in chosen if isinstance(p, bool) or not isinstance(p, int) or p < 0]
    if wrong:
        raise ConfigurationError(
            "A fault's partitions are partition numbers (0 and up); got "
            f"{', '.join(sorted(map(repr, wrong)))}."
        )
    return chosen


def checked_checkpoint_id(name: str, value: int) -> int:
    """A checkpoint id a commit fault waits for: an integer >= 1, since ids start at 1 (a
    0, a negative id or the string "3" never equals a committed id, so the fault would
    never fire)."""
    checkpoint_id = as_int(value)  # numpy's integers too; bools and strings not
    if checkpoint_id is None or checkpoint_id < 1:
        raise ConfigurationError(
            f"{name} is the id of the checkpoint whose commit the fault hits, an integer "
            f">= 1 (a task's checkpoints are numbered from 1); got {value!r}."
        )
    return checkpoint_id


def checked_seconds(name: str, value: float) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 <= value < float("inf")
    ):
        raise ConfigurationError(f"{name} must be a number of seconds >= 0; got {value!r}.")
    return float(value)


class _Wrapper(AsyncFunction[Any, Any]):
    """A fault around the user's function ``fn``: the same enrichment, so checkpoints name
    it after ``fn`` (``__wrapped__``), and a job resumes them without it."""

    fn: AsyncFunction[Any, Any]

    @property
    def __wrapped__(self) -> AsyncFunction[Any, Any]:
        return self.fn


class CrashOnElement(_Wrapper):
    """Wraps ``fn``; kills the worker process when invoked with a row whose ``key_field``
    is in ``at``, on task attempt ``attempt`` (default: the first) of ``partitions``
    (default: any). Other calls go to ``fn`` unchanged.

    The keys in ``at`` must be of a type the rows' keys can equal: where the fault meets a
    key that none of ``at`` ever equals by its type (``at=["5"]`` with int ids, or bytes
    against str: the fault would never fire), or a row without ``key_field``, it raises
    ``ConfigurationError``. Armed, it checks each key type once; on the attempts it is not
    aimed at, the first row with a key that is not null (so that the retry of an attempt
    that failed with this error fails too, rather than succeed without the fault). A null
    key is never checked."""

    def __init__(
        self,
        fn: Any,
        at: Iterable[Any],
        key_field: str = "id",
        attempt: int = 0,
        partitions: Iterable[int] | None = None,
        exit_code: int = 1,
    ) -> None:
        self.fn = as_async_function(fn)
        # a str: frozenset("12") would be {"1", "2"}; a number or None: not a collection
        if isinstance(at, (str, bytes)) or not isinstance(at, Iterable):
            raise ConfigurationError(
                f"CrashOnElement's at is a collection of keys, like [{at!r}]; got {at!r}."
            )
        try:
            self.at = frozenset(at)  # empty: disarmed, the function's name and cost kept
        except TypeError as exc:  # an unhashable key, such as a list
            raise ConfigurationError(
                f"CrashOnElement's at holds keys a row's key field could equal, which are "
                f"hashable (a str, a number, a tuple...); got {reprlib.repr(at)}: {exc}."
            ) from None
        if not isinstance(key_field, str):
            raise ConfigurationError(
                f"CrashOnElement's key_field is the name of a field; got {key_field!r}."
            )
        self.key_field = key_field
        self.attempt = attempt
        self.partitions = checked_aim(attempt, partitions)
        code = as_int(exit_code)
        if code is None:
            raise ConfigurationError(
                f"CrashOnElement's exit_code is an integer (os._exit's); got {exit_code!r}."
            )
        self.exit_code = code
        self._armed = False
        self._watching = False  # looking at the rows' keys: armed, or until one is checked
        self._key_types: set[type] = set()  # the types of key seen, each checked once

    async def open(self) -> None:
        self._armed = _armed(self.attempt, self.partitions)
        self._watching = bool(self.at)  # empty: disarmed everywhere, rows never looked at
        await self.fn.open()

    async def close(self) -> None:
        await self.fn.close()

    async def async_invoke(self, row: Any) -> Iterable[Any]:
        if self._watching:
            key = self._key(row)
            if type(key) not in self._key_types:
                self._check_key_type(key)
            if self._armed:
                if key in self.at:
                    os._exit(self.exit_code)  # the worker dies here, mid-partition
            elif key is not None:  # checked: a key of the rows' type, on an attempt not aimed at
                self._watching = False
        return await self.fn.async_invoke(row)

    def _key(self, row: Any) -> Any:
        try:
            return row[self.key_field]
        except (LookupError, ValueError, TypeError):  # a pyspark Row raises ValueError
            fields = list(row.keys()) if hasattr(row, "keys") else None
            raise ConfigurationError(
                f"CrashOnElement's key_field is {self.key_field!r}, but a row it was asked "
                f"to enrich has no such field ("
                + (
                    f"its fields: {', '.join(map(repr, fields))}"
                    if fields is not None
                    else f"it is a {type(row).__name__}, {reprlib.repr(row)}"
                )
                + "). Pass key_field= the name of the field holding the keys in at."
            ) from None

    def _check_key_type(self, key: Any) -> None:
        """Refuses a key that no key in ``at`` can ever equal, by its type (a str "5" never
        equals the int 5): the fault would never fire, and the test using it would pass for
        the wrong reason. Each type is checked once; None (a null key) never is."""
        try:
            hash(key)
        except TypeError:
            raise ConfigurationError(
                f"CrashOnElement can never fire: the rows' {self.key_field!r} values are "
                f"of type {type(key).__name__}, such as {reprlib.repr(key)}, which is not hashable "
                "and never equals a key in at. Pass key_field= a field of str or number keys."
            ) from None
        if key is not None and key not in self.at:
            if not any(_comparable(key, k) for k in self.at):
                kinds = " and ".join(sorted({type(k).__name__ for k in self.at}))
                raise ConfigurationError(
                    f"CrashOnElement can never fire: its at holds keys of type {kinds} "
                    f"({_some(self.at)}), but the rows' {self.key_field!r} values are of "
                    f"type {type(key).__name__}, such as {key!r}, which never equals them. Give "
                    f"at the keys as the rows hold them, e.g. at=[{key!r}]."
                )
        self._key_types.add(type(key))

    async def timeout(self, row: Any) -> Iterable[Any]:
        if has_timeout_handler(self.fn):
            return await self.fn.timeout(row)
        return await super().timeout(row)


def _comparable(a: Any, b: Any) -> bool:
    """Whether ``a == b`` compares the values: False when both sides' ``__eq__`` give up
    (NotImplemented), as a str's and an int's do, and only identity would count."""
    eq_a: Any = type(a).__eq__  # typeshed gives object.__eq__ one argument
    eq_b: Any = type(b).__eq__
    try:
        return eq_a(a, b) is not NotImplemented or eq_b(b, a) is not NotImplemented
    except Exception:  # an __eq__ that raises: it compares, in its way
        return True


def _some(keys: Iterable[Any]) -> str:
    """A few of ``keys``, for a message."""
    shown = sorted(map(repr, keys))
    return ", ".join(shown[:3]) + (", ..." if len(shown) > 3 else "")


class _CommitFault(_Wrapper):
    """Base of wrappers that act on the snapshot store's commits in their own task."""

    def __init__(
        self,
        fn: Any,
        checkpoint_id: int,
        attempt: int = 0,
        partitions: Iterable[int] | None = None,
    ) -> None:
        self.fn = as_async_function(fn)
        self.checkpoint_id = checked_checkpoint_id(
            f"{type(self).__name__}'s checkpoint_id", checkpoint_id
        )
        self.attempt = attempt
        self.partitions = checked_aim(attempt, partitions)
        self._hook: Any = None

    async def open(self) -> None:
        from checkpoint import _faults

        await self.fn.open()  # first: a function that fails to open leaves no hook behind
        if _armed(self.attempt, self.partitions):
            self._hook = self._on_commit
            _faults.install(self._hook)

    async def close(self) -> None:
        from checkpoint import _faults

        if self._hook is not None:
            _faults.remove(self._hook)
            self._hook = None
        await self.fn.close()

    async def async_invoke(self, row: Any) -> Iterable[Any]:
        return await self.fn.async_invoke(row)

    async def timeout(self, row: Any) -> Iterable[Any]:
        if has_timeout_handler(self.fn):
            return await self.fn.timeout(row)
        return await super().timeout(row)

    def _on_commit(self, point: str, context: dict[str, Any]) -> None:
        raise NotImplementedError


class CrashDuringCommit(_CommitFault):
    """Kills the worker in the middle of committing checkpoint ``checkpoint_id`` (on task
    attempt ``attempt``), just before the snapshot store hands the commit to delta-rs.

    It leaves what a writer that dies between writing a data file and committing the Delta
    log leaves: before dying, the fault itself writes the checkpoint's rows (with pyarrow)
    as a Parquet file into the Delta table's directory, named as delta-rs names data files.
    delta-rs is never called for that commit. The checkpoint location must be local (a
    path or a ``file:`` URI); elsewhere the commit fails with ``ConfigurationError``.
    """

    def _on_commit(self, point: str, context: dict[str, Any]) -> None:
        meta = context["meta"]
        if point != "before_delta_commit" or meta.checkpoint_id != self.checkpoint_id:
            return
        import uuid

        import pyarrow.parquet as pq

        from checkpoint._layout import is_local, normalize

        log = context["log"]
        if not is_local(log.uri):
            raise ConfigurationError(
                f"CrashDuringCommit writes its orphan Parquet file on the local file system, "
                f"but checkpoint {meta.ref} goes to {log.uri}. Use a local checkpoint "
                "location (a path or a file: URI) for this fault."
            )
        directory = normalize(log.uri)  # file:///a/b -> /a/b (not a directory named "file:")
        os.makedirs(directory, exist_ok=True)
        name = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
        pq.write_table(context["data"], os.path.join(directory, name))
        os._exit(1)


class DelayCommit(_CommitFault):
    """Holds the commit of checkpoint ``checkpoint_id`` (on attempt ``attempt``) for
    ``seconds``: the attempt turns into a zombie whose commit comes late, after a newer
    attempt has moved on (use with speculation or a task kill)."""

    def __init__(
        self,
        fn: Any,
        checkpoint_id: int,
        seconds: float,
        attempt: int = 0,
        partitions: Iterable[int] | None = None,
    ) -> None:
        super().__init__(fn, checkpoint_id, attempt, partitions)
        self.seconds = checked_seconds("DelayCommit's seconds", seconds)

    def _on_commit(self, point: str, context: dict[str, Any]) -> None:
        if point == "before_delta_commit" and context["meta"].checkpoint_id == self.checkpoint_id:
            import time

            time.sleep(self.seconds)


class ZombieCommit(_CommitFault):
    """Holds the commit of checkpoint ``checkpoint_id`` (on task attempt ``attempt``) until
    another attempt of the same task and run has committed that id or a later one, then
    lets it go ahead: the commit of a zombie, landing after a newer attempt moved on. The
    snapshot store must refuse it (``CheckpointConflictError``), which fails this attempt
    while the newer one carries on.

    There must be a newer attempt: run with speculation, or kill this attempt's executor
    in a way that leaves the Python worker running. After ``max_wait`` seconds without one,
    the commit goes ahead anyway (and is not a zombie's).
    """

    def __init__(
        self,
        fn: Any,
        checkpoint_id: int,
        attempt: int = 0,
        partitions: Iterable[int] | None = None,
        max_wait: float = 300.0,
    ) -> None:
        super().__init__(fn, checkpoint_id, attempt, partitions)
        self.max_wait = checked_seconds("ZombieCommit's max_wait", max_wait)

    def _on_commit(self, point: str, context: dict[str, Any]) -> None:
        meta = context["meta"]
        if point != "before_delta_commit" or meta.checkpoint_id != self.checkpoint_id:
            return
        log = context["log"]
        mine = meta.properties.get("attempt")
        deadline = time.monotonic() + self.max_wait
        while time.monotonic() < deadline:
            if any(
                m.run_id == meta.run_id
                and m.checkpoint_id >= self.checkpoint_id
                and m.properties.get("attempt") != mine
                for m in log.checkpoints()
            ):
                return
            time.sleep(0.1)
