"""Exceptions raised by ``stateful_async``.

Every error this package raises is a ``StatefulAsyncError``; messages are full sentences
that say what happened, to which element, and what to do about it. Errors of lower layers
(user functions, pyarrow, py4j) are chained with ``raise ... from exc``.

Hierarchy::

    StatefulAsyncError
    ├── ConfigurationError        (also ValueError)   a bad argument or option, found up front
    │   └── FunctionNotSerializableError              Spark cannot ship the function or retry
    ├── OperatorStateError        (also RuntimeError) an operator method called out of order
    ├── ElementFailedError                            one element could not be processed
    │   ├── AsyncFunctionError                        the async function failed, no retry left
    │   ├── InvalidResultError    (also TypeError)    the async function returned a non-iterable
    │   ├── AsyncTimeoutError     (also TimeoutError) the element timed out (default handler)
    │   └── TimeoutHandlerError                       the user's ``timeout()`` raised
    ├── ResultSchemaError         (also ValueError)   a result does not match the output schema
    ├── InputMismatchError                            resuming on input that differs from the
    │                                                 input the checkpoint consumed
    └── DeltaSinkError                                the ``delta_rs`` Spark sink could not
        │                                             write or commit to its Delta table
        └── SinkSchemaMismatchError (also ValueError) the data's schema or partitioning
                                                      differs from the Delta table's

The ``checkpoint`` package has its own module, rooted at ``checkpoint.CheckpointError``,
which is also a ``StatefulAsyncError``.
"""

from __future__ import annotations

import datetime
import math
import numbers
import operator
import os
import sysconfig
import traceback
from typing import Any, Iterable

from ._elements import describe


class StatefulAsyncError(Exception):
    """Base class of every error raised by stateful-async."""


class ConfigurationError(StatefulAsyncError, ValueError):
    """An argument or option is invalid; raised before any work starts."""


class FunctionNotSerializableError(ConfigurationError):
    """The async function, or the retry strategy's predicates, cannot be pickled, so Spark
    cannot send them to executors."""


class OperatorStateError(StatefulAsyncError, RuntimeError):
    """An operator method was called out of order (before ``open``, after ``close``...)."""


class ElementFailedError(StatefulAsyncError):
    """Processing one element failed; the operator has failed with it.

    ``element`` is the failed input element and ``attempts`` the number of attempts made.
    """

    def __init__(self, message: str, *, element: Any = None, attempts: int = 0) -> None:
        super().__init__(message)
        self.element = element
        self.attempts = attempts


class AsyncFunctionError(ElementFailedError):
    """The async function raised and the retry strategy allowed no further attempt."""


class InvalidResultError(ElementFailedError, TypeError):
    """The async function returned something that is not an iterable of results."""


class AsyncTimeoutError(ElementFailedError, TimeoutError):
    """An element did not complete within the timeout and the function has no ``timeout()``
    handler (or its handler re-raised this)."""


class TimeoutHandlerError(ElementFailedError):
    """The async function's ``timeout()`` handler raised; handler errors are never retried."""


class ResultSchemaError(StatefulAsyncError, ValueError):
    """A result row does not match the declared output schema."""


class InputMismatchError(StatefulAsyncError):
    """A task was asked to resume from a checkpoint whose consumed input differs from the
    input it is reading now."""


# the Python installation, its packages, and this package (whose frames call the user's)
_LIBRARIES = tuple(
    sorted(
        {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
        | {os.path.dirname(os.path.abspath(__file__)) + os.sep}
    )
)


def raised_at(error: BaseException) -> str:
    """Where ``error`` was raised, for a message: the deepest frame outside the Python
    installation, its packages and this package (the user's line, also when a library
    raised below it), else the deepest frame. The message keeps it where the traceback is
    lost: PySpark drops a task error's chained cause, and shows its own frames at the wrong
    lines."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    frame = next((f for f in reversed(frames) if not f.filename.startswith(_LIBRARIES)), frames[-1])
    return f" (raised at {frame.filename}:{frame.lineno}, in {frame.name})"


def id_ranges(ids: Iterable[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5' (ids and partition numbers in messages); 'none' if empty."""
    ranges: list[list[int]] = []
    for i in sorted(set(ids)):
        if ranges and i == ranges[-1][1] + 1:
            ranges[-1][1] = i
        else:
            ranges.append([i, i])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in ranges) or "none"


def error_text(error: BaseException) -> str:
    """``str(error)`` that never raises (for messages built in callbacks)."""
    try:
        return str(error)
    except Exception as exc:
        return f"<its str() raised {type(exc).__name__}>"


def element_error(
    kind: type[ElementFailedError],
    what: str,
    element: Any,
    attempts: int,
    advice: str,
    cause: BaseException | None = None,
) -> ElementFailedError:
    """Build an element error with a uniform, complete message.

    ``what`` says what happened in a sentence fragment; ``advice`` says what to do.
    """
    plural = "attempt" if attempts == 1 else "attempts"
    message = f"{what} for element {describe(element)} after {attempts} {plural}"
    if cause is not None:
        message += f": {type(cause).__name__}: {error_text(cause)}{raised_at(cause)}"
    # a cause's own text may end its sentence ("The timeout handler was cancelled.")
    message += f"{'' if message.endswith(('.', '?', '!')) else '.'} {advice}"
    error = kind(message, element=element, attempts=attempts)
    if cause is not None:
        error.__cause__ = cause
    return error


# -- the Delta sink (stateful_async.spark, format "delta_rs") ------------------------------


class DeltaSinkError(StatefulAsyncError):
    """The ``delta_rs`` Spark sink could not write its files or commit them to the Delta
    table; the message says which table, what failed and what to do."""


class SinkSchemaMismatchError(DeltaSinkError, ValueError):
    """The data written to the ``delta_rs`` sink does not match the Delta table: different
    columns or types, a NOT NULL column holding nulls, or different partition columns."""


def as_int(value: Any) -> int | None:
    """``value`` as a plain int if it is an integer (numpy's included; bools not, as
    ``capacity=True`` is a mistake; numpy's timedelta64 not, as it is a duration), else
    None, for the caller to refuse with its own message."""
    # numpy < 2.3 takes np.bool_ as an index
    if isinstance(value, bool) or numpy_kind(value) == "b":
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def numpy_kind(value: Any) -> str | None:
    """The numpy dtype kind of a numpy scalar or array ("b" for a bool), else None."""
    return getattr(getattr(value, "dtype", None), "kind", None)


def as_seconds(value: Any) -> float | None:
    """A duration as seconds: a ``datetime.timedelta``, or a real number (see ``as_float``);
    None for anything else."""
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    return as_float(value)


def as_float(value: Any) -> float | None:
    """``value`` as a plain float if it is a real number (numpy's included; bools and
    timedelta64 not; one too large for a float is infinite), else None."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral) and as_int(value) is None:
        return None
    number: Any = value  # numbers.Real declares no comparison with int
    try:
        return float(number)
    except OverflowError:  # 10**400: as large as a float gets, for "finite" checks to refuse
        return math.inf if number > 0 else -math.inf
