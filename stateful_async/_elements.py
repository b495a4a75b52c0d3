"""Stream elements: what flows into and out of the operator.

Plain ``__slots__`` classes rather than dataclasses: one of each is created per input and
per result, so construction cost is on the hot path.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar, Union

T = TypeVar("T")


class StreamRecord(Generic[T]):
    """A record: a value and an optional event-time timestamp.

    ``timestamp`` is None or an integer that fits in 64 bits (the type checkpoints store it
    in); numpy's integers are taken as plain ints; anything else (a float, a bool, a
    datetime) raises ``ConfigurationError`` here rather than when a checkpoint is written.
    Results emitted for a record carry the record's timestamp.
    """

    __slots__ = ("value", "timestamp")

    def __init__(self, value: T, timestamp: int | None = None) -> None:
        self.value = value
        if timestamp is not None and (type(timestamp) is not int or not _MIN <= timestamp <= _MAX):
            timestamp = _checked_timestamp(timestamp, "StreamRecord", "a record's timestamp")
        self.timestamp = timestamp

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is StreamRecord
            and self.value == other.value
            and self.timestamp == other.timestamp
        )

    def __hash__(self) -> int:
        return hash((StreamRecord, _hashable(self.value), self.timestamp))

    def __repr__(self) -> str:
        value = _safe_repr(self.value)
        if self.timestamp is None:
            return f"StreamRecord({value})"
        return f"StreamRecord({value}, timestamp={self.timestamp!r})"


class Watermark:
    """An event-time watermark: no record with a timestamp <= ``timestamp`` follows it.

    ``timestamp`` is an integer that fits in 64 bits, as a record's; numpy's integers are
    taken as plain ints; anything else raises ``ConfigurationError`` here.
    """

    __slots__ = ("timestamp",)

    def __init__(self, timestamp: int) -> None:
        if type(timestamp) is not int or not _MIN <= timestamp <= _MAX:
            timestamp = _checked_timestamp(timestamp, "Watermark", "a watermark's timestamp")
        self.timestamp = timestamp

    def __eq__(self, other: object) -> bool:
        return type(other) is Watermark and self.timestamp == other.timestamp

    def __hash__(self) -> int:
        return hash((Watermark, self.timestamp))

    def __repr__(self) -> str:
        return f"Watermark({self.timestamp!r})"


StreamElement = Union[StreamRecord[Any], Watermark]

# Checkpoints store timestamps as int64 (as Flink's are Java longs).
_MIN = -(2**63)
_MAX = 2**63 - 1


def _checked_timestamp(timestamp: Any, cls: str, what: str) -> int:
    """``timestamp`` as a plain int (numpy's integers too), or a ``ConfigurationError``
    that says what to pass. Off the hot path: a plain int in range never gets here."""
    from ._exceptions import ConfigurationError, as_int  # _exceptions imports this module

    number = as_int(timestamp)  # None for bools, floats, strings, datetimes
    if number is None:
        raise ConfigurationError(
            f"{cls} timestamp must be an integer (event time in your own unit, such as "
            f"milliseconds since the epoch); got {_safe_repr(timestamp)} of type "
            f"{type(timestamp).__name__}. Convert it to an int first, e.g. "
            "int(moment.timestamp() * 1000) for a datetime"
            + ("" if cls == "Watermark" else ", or pass None for no timestamp")
            + "."
        )
    if not _MIN <= number <= _MAX:
        raise ConfigurationError(
            f"{cls} timestamp must fit in a 64-bit signed integer, the type checkpoints store "
            f"{what} in; got {number}. Event times in milliseconds, microseconds or even "
            "nanoseconds since 1970 fit: check how this one was computed."
        )
    return number


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _safe_repr(value: object) -> str:
    try:
        return repr(value)
    except Exception as exc:
        return f"<{type(value).__name__} object; its repr raised {type(exc).__name__}>"


def describe(element: object, limit: int = 200) -> str:
    """A bounded repr of an element for error messages (inputs can be large rows). Never
    raises: a user type whose ``__repr__`` fails must not turn an error report (made in a
    timer or a completion callback) into a second error."""
    text = _safe_repr(element)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text
