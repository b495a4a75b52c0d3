"""Stream elements: what flows into and out of the operator.

Plain ``__slots__`` classes rather than dataclasses: one of each is created per input and
per result, so construction cost is on the hot path.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar, Union

T = TypeVar("T")


class StreamRecord(Generic[T]):
    """A record: a value and an optional event-time timestamp.

    Results emitted for a record carry the record's timestamp.
    """

    __slots__ = ("value", "timestamp")

    def __init__(self, value: T, timestamp: int | None = None) -> None:
        self.value = value
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
    """An event-time watermark: no record with a timestamp <= ``timestamp`` follows it."""

    __slots__ = ("timestamp",)

    def __init__(self, timestamp: int) -> None:
        self.timestamp = timestamp

    def __eq__(self, other: object) -> bool:
        return type(other) is Watermark and self.timestamp == other.timestamp

    def __hash__(self) -> int:
        return hash((Watermark, self.timestamp))

    def __repr__(self) -> str:
        return f"Watermark({self.timestamp!r})"


StreamElement = Union[StreamRecord[Any], Watermark]


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
