"""Retry strategies for the async function: fixed delay and exponential backoff."""

from __future__ import annotations

import datetime
import inspect
import math
import random
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, Union

from ._exceptions import ConfigurationError, as_float, as_int, as_seconds
from ._function import is_coroutine_callable

ExceptionPredicate = Union[
    Callable[[BaseException], bool],
    type[BaseException],
    tuple[type[BaseException], ...],
    types.UnionType,
]
ResultPredicate = Callable[[Sequence[Any]], bool]


def _never(_: Sequence[Any]) -> bool:
    return False


def _check_number(name: str, value: Any, minimum: float, unit: str = "") -> float:
    """``value`` as a plain float (numpy's numbers too; a timedelta where ``unit`` is
    seconds), if it is a finite number >= minimum."""
    number = as_seconds(value) if unit == "seconds" else as_float(value)
    if number is None or not math.isfinite(number):
        raise ConfigurationError(
            f"RetryStrategy {name} must be a finite number{' of ' + unit if unit else ''}"
            f"{' or a timedelta' if unit == 'seconds' else ''}; got {value!r}."
        )
    if number < minimum:
        raise ConfigurationError(f"RetryStrategy {name} must be >= {minimum}; got {value!r}.")
    return number


def _keep_number(strategy: RetryStrategy, name: str, minimum: float, unit: str = "") -> None:
    number = _check_number(name, getattr(strategy, name), minimum, unit)
    object.__setattr__(strategy, name, number)  # frozen: as __init__ would have set it


def _is_exception_type(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, BaseException)


def _union_members(value: Any) -> tuple[Any, ...] | None:
    """The members of a union of types (``ValueError | KeyError``, or
    ``typing.Union[ValueError, KeyError]``), which ``isinstance`` accepts; None otherwise."""
    if typing.get_origin(value) in (types.UnionType, Union):
        return typing.get_args(value)
    return None


def _type_name(value: Any) -> str:
    return value.__name__ if isinstance(value, type) else repr(value)


@dataclass(frozen=True)
class RetryStrategy:
    """When and how soon to try an element's async function again.

    ``max_attempts`` counts **total attempts**, the first one included: ``max_attempts=3``
    means one call and at most two retries. (Flink's ``maxAttempts`` counts retries only, so
    Flink's ``maxAttempts=2`` is ``max_attempts=3`` here.)

    An attempt is retried when its exception matches ``retry_on_exception`` (an exception
    type, a non-empty tuple of them, a union of them (``TimeoutError | ConnectionError``,
    kept as the tuple of its members) or a predicate over the exception; default: any
    ``Exception``; to retry no exception, pass ``lambda exc: False``) or its result list
    matches ``retry_on_result`` (default: never), while attempts remain. A
    ``ConfigurationError`` is never retried, whatever ``retry_on_exception`` says: it is a
    bad setting (such as a ``CrashOnElement`` key no row can equal), not a transient
    failure, and fails the element at once. When attempts run
    out, an exception fails the element and a result is emitted as it is (once the
    operator's timeout has passed, such a result, like an exception, is dropped: the timeout
    handler decides). A predicate is called, never awaited: a plain ``def`` (or lambda)
    returning True or False (an ``async def`` is refused, and an awaitable it returns
    fails the element).

    Delays are seconds (a number or a ``timedelta``).

    The delay before attempt ``n + 1`` is ``initial_delay * multiplier ** (n - 1)``, capped
    at ``max_delay``, then scaled by a random factor in ``[1 - jitter, 1 + jitter]``. It is
    computed from the element's own attempt count: nothing is shared between elements.

    Retries never outlive the operator's per-element timeout, which is why a timeout is
    required with a retry strategy: a retry whose delay would end at or after the deadline
    is not started, and the timeout handler decides the element.
    """

    max_attempts: int
    initial_delay: float
    multiplier: float = 1.0
    max_delay: float | None = None
    jitter: float = 0.0
    retry_on_exception: ExceptionPredicate = Exception
    retry_on_result: ResultPredicate = field(default=_never)

    def __post_init__(self) -> None:
        attempts = as_int(self.max_attempts)
        if attempts is None or attempts < 1:
            raise ConfigurationError(
                f"RetryStrategy max_attempts must be an integer >= 1 (total attempts, the first "
                f"included); got {self.max_attempts!r}."
            )
        object.__setattr__(self, "max_attempts", attempts)
        _keep_number(self, "initial_delay", 0, "seconds")
        _keep_number(self, "multiplier", 1)
        if self.max_delay is not None:
            _keep_number(self, "max_delay", 0, "seconds")
            if self.max_delay < self.initial_delay:
                raise ConfigurationError(
                    f"RetryStrategy max_delay ({self.max_delay!r}) must be >= the initial delay "
                    f"({self.initial_delay!r})."
                )
        _keep_number(self, "jitter", 0)
        if self.jitter > 1:
            raise ConfigurationError(
                f"RetryStrategy jitter must be between 0 and 1; got {self.jitter!r}."
            )
        predicate = self.retry_on_exception
        members = _union_members(predicate)
        if members is not None:
            others = [m for m in members if not _is_exception_type(m)]
            if others:
                kept = [_type_name(m) for m in members if _is_exception_type(m)]
                one = len(others) == 1
                raise ConfigurationError(
                    f"RetryStrategy retry_on_exception is a union of types, {predicate!r}, but "
                    f"{', '.join(_type_name(m) for m in others)} "
                    f"{'is not an exception type' if one else 'are not exception types'}: "
                    "every member of the union must be an exception type (a subclass of "
                    "BaseException). "
                    + (
                        f"Leave {'it' if one else 'them'} out: "
                        f"retry_on_exception={' | '.join(kept)}."
                        if kept
                        else "Pass exception types, e.g. "
                        "retry_on_exception=TimeoutError | ConnectionError."
                    )
                )
            # Kept as the tuple of its members, which isinstance() takes alike and which
            # pickles on every Python this supports (Spark ships the strategy to executors).
            predicate = tuple(members)
            object.__setattr__(self, "retry_on_exception", predicate)  # frozen: as __init__
        if isinstance(predicate, (tuple, list, set, frozenset)) and not predicate:
            # isinstance(exc, ()) is False: an empty tuple would retry nothing, silently.
            raise ConfigurationError(
                f"RetryStrategy retry_on_exception is an empty {type(predicate).__name__}, "
                f"{predicate!r}, which matches no exception, so nothing would ever be retried. "
                "Pass the exception types to retry, e.g. retry_on_exception=(TimeoutError,); "
                "omit it to retry any Exception; or, to retry no exception (only results, with "
                "retry_on_result), pass retry_on_exception=lambda exc: False."
            )
        if isinstance(predicate, tuple):
            valid = all(_is_exception_type(t) for t in predicate)
        elif isinstance(predicate, type):
            valid = _is_exception_type(predicate)
        else:
            valid = callable(predicate)
        if not valid:
            hint = ""
            if isinstance(predicate, (list, set, frozenset)) and all(
                _is_exception_type(t) for t in predicate
            ):
                names = ", ".join(t.__name__ for t in predicate)
                names += "," if len(predicate) == 1 else ""
                hint = f" Pass them as a tuple: retry_on_exception=({names})."
            raise ConfigurationError(
                "RetryStrategy retry_on_exception must be an exception type, a tuple of them, "
                f"or a predicate over the exception; got {predicate!r}.{hint}"
            )
        result_predicate = self.retry_on_result
        expected = "RetryStrategy retry_on_result must be a predicate over the result list"
        if _is_exception_type(result_predicate):
            # callable, and every instance is true: it would retry every result
            raise ConfigurationError(
                f"{expected}; got {result_predicate!r}, an exception type: retry exceptions "
                f"with retry_on_exception={result_predicate.__name__}."
            )
        if not callable(result_predicate):
            raise ConfigurationError(f"{expected}; got {result_predicate!r}.")
        for outcome, check in (("exception", predicate), ("result", result_predicate)):
            if is_coroutine_callable(check):
                raise ConfigurationError(
                    f"RetryStrategy retry_on_{outcome} is an async function, but a predicate is "
                    f"called, not awaited: its coroutine would count as True, so every "
                    f"{outcome} would be retried. Declare it with a plain 'def' that returns "
                    "True or False."
                )

    @classmethod
    def fixed_delay(
        cls,
        max_attempts: int,
        delay: float | datetime.timedelta,
        *,
        retry_on_exception: ExceptionPredicate = Exception,
        retry_on_result: ResultPredicate = _never,
    ) -> RetryStrategy:
        """Retry after the same ``delay`` (seconds), up to ``max_attempts`` total attempts."""
        seconds = _check_number("delay", delay, 0, "seconds")  # named as the caller named it
        return cls(
            max_attempts,
            seconds,
            retry_on_exception=retry_on_exception,
            retry_on_result=retry_on_result,
        )

    @classmethod
    def exponential_backoff(
        cls,
        max_attempts: int,
        initial_delay: float | datetime.timedelta,
        max_delay: float | datetime.timedelta,
        *,
        multiplier: float = 2.0,
        jitter: float = 0.0,
        retry_on_exception: ExceptionPredicate = Exception,
        retry_on_result: ResultPredicate = _never,
    ) -> RetryStrategy:
        """Retry after ``initial_delay``, then ``multiplier`` times longer each time, capped at
        ``max_delay``, optionally with ``jitter``; up to ``max_attempts`` total attempts."""
        return cls(
            max_attempts,
            _check_number("initial_delay", initial_delay, 0, "seconds"),
            multiplier=multiplier,
            max_delay=_check_number("max_delay", max_delay, 0, "seconds"),
            jitter=jitter,
            retry_on_exception=retry_on_exception,
            retry_on_result=retry_on_result,
        )

    def can_retry(self, attempts: int) -> bool:
        """Whether another attempt may follow ``attempts`` attempts made so far."""
        return attempts < self.max_attempts

    def backoff(self, attempts: int) -> float:
        """Seconds to wait after attempt number ``attempts`` (1-based) before the next (an
        override may return a ``timedelta``)."""
        try:
            delay = self.initial_delay * self.multiplier ** (attempts - 1)
        except OverflowError:  # many attempts at a large multiplier: the cap (or never)
            delay = math.inf if self.initial_delay else 0.0  # zero stays zero
        if self.max_delay is not None:
            delay = min(delay, self.max_delay)
        if self.jitter:
            delay *= random.uniform(1 - self.jitter, 1 + self.jitter)
        return delay

    def should_retry_exception(self, exc: BaseException) -> bool:
        predicate = self.retry_on_exception
        if isinstance(predicate, (tuple, type, types.UnionType)):  # a union: kept as a tuple
            return isinstance(exc, predicate)
        return _answer("exception", predicate(exc))

    def should_retry_result(self, results: Sequence[Any]) -> bool:
        return _answer("result", self.retry_on_result(results))


def _answer(outcome: str, answer: Any) -> bool:
    """A predicate's answer as a bool. An awaitable is refused: a plain ``def`` (a lambda)
    that returns an async check's coroutine passes the construction check, and the
    coroutine, never awaited, would count as True."""
    if inspect.isawaitable(answer):
        close = getattr(answer, "close", None)
        if close is not None:
            close()  # never awaited: no "was never awaited" warning on top of this error
        raise TypeError(
            f"RetryStrategy retry_on_{outcome} returned a {type(answer).__name__}, an "
            "awaitable: a predicate is called, not awaited, so it would count as True and "
            f"every {outcome} would be retried. Return True or False from a plain 'def'; it "
            "cannot await an async check."
        )
    return bool(answer)
