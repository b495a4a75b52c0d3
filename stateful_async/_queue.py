"""Element queues: where in-flight elements wait until they may be emitted.

One contract, two implementations, as in Flink's ``StreamElementQueue``:

* ``OrderedQueue`` — an entry leaves only when it is complete and every entry before it
  has left: output order is input order, watermarks included.
* ``UnorderedQueue`` — entries are grouped in segments separated by watermarks. Within
  the first segment, completed records leave in completion order; a watermark is a
  segment of its own and leaves once every segment before it has left. So no record
  crosses a watermark in either direction. With no watermarks there is one segment and
  the output is fully unordered (processing-time unordered); with watermarks it is
  event-time unordered.

Capacity counts entries, watermarks included. ``try_put`` never blocks: it returns None
when the queue is full. All methods run on the event-loop thread.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterator, Protocol

from ._elements import StreamElement, Watermark


class QueueEntry:
    """One queue slot: an element, and once complete, its results.

    The operator subclasses it to keep its per-element bookkeeping (attempts, timers) in
    the same object; the queue gets its entries from the ``new_entry`` callable it was
    given (``new_entry(element, done)``; a ``QueueEntry`` subclass, or a function that
    reuses entries).
    """

    __slots__ = ("element", "results", "done", "segment")

    def __init__(self, element: StreamElement, done: bool = False) -> None:
        self.element = element
        self.results: list[Any] | None = None
        self.done = done
        self.segment: _Segment | None = None


class ElementQueue(Protocol):
    """The queue contract shared by both output modes."""

    capacity: int
    # Entries done and not yet polled: 0 means has_completed() is False, read without a call.
    completed: int

    def try_put(self, element: StreamElement) -> QueueEntry | None:
        """Add ``element`` and return its entry, or return None if the queue is full."""
        ...

    def complete(self, entry: QueueEntry, results: list[Any]) -> None:
        """Record the results of a record's entry; it may leave once the mode allows."""
        ...

    def has_completed(self) -> bool:
        """Whether an entry may leave now."""
        ...

    def complete_and_poll(self, entry: QueueEntry, results: list[Any]) -> QueueEntry | None:
        """``complete(entry, results)``, then ``poll()``: one call on the hot path."""
        ...

    def poll(self) -> QueueEntry | None:
        """Remove and return the next entry that may leave, or None if none may."""
        ...

    def values(self) -> list[StreamElement]:
        """Every element not yet emitted, in input order (for snapshots)."""
        ...

    def entries(self) -> Iterator[QueueEntry]:
        """Every entry not yet emitted, in input order."""
        ...

    def __len__(self) -> int: ...


class OrderedQueue:
    """Entries leave in input order (see the module docstring)."""

    def __init__(
        self, capacity: int, new_entry: Callable[[StreamElement, bool], QueueEntry] = QueueEntry
    ) -> None:
        self.capacity = capacity
        self.completed = 0
        self._new_entry = new_entry
        self._entries: deque[QueueEntry] = deque()

    def try_put(self, element: StreamElement) -> QueueEntry | None:
        if len(self._entries) >= self.capacity:
            return None
        done = type(element) is Watermark
        entry = self._new_entry(element, done)
        self._entries.append(entry)
        if done:
            self.completed += 1
        return entry

    def complete(self, entry: QueueEntry, results: list[Any]) -> None:
        entry.results = results
        entry.done = True
        self.completed += 1

    def has_completed(self) -> bool:
        entries = self._entries
        return bool(entries) and entries[0].done

    def complete_and_poll(self, entry: QueueEntry, results: list[Any]) -> QueueEntry | None:
        entry.results = results
        entry.done = True
        entries = self._entries
        head = entries[0]  # entry is in the queue: never empty here
        if head is entry:  # the usual case: completed at the head, leaves at once
            return entries.popleft()
        if head.done:  # an earlier completed head whose emission is still queued
            return entries.popleft()  # it leaves, entry waits: completed is unchanged
        self.completed += 1
        return None

    def poll(self) -> QueueEntry | None:
        entries = self._entries
        if entries and entries[0].done:
            self.completed -= 1
            return entries.popleft()
        return None

    def values(self) -> list[StreamElement]:
        return [entry.element for entry in self._entries]

    def entries(self) -> Iterator[QueueEntry]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)


class _Segment:
    """Entries between two watermarks (or one watermark on its own).

    ``pending`` keeps every entry not yet emitted in insertion order (a dict is an ordered
    set with O(1) removal); ``completed`` holds the ones that may leave, in completion order.
    """

    __slots__ = ("pending", "completed", "is_watermark")

    def __init__(self, is_watermark: bool) -> None:
        self.pending: dict[QueueEntry, None] = {}
        self.completed: deque[QueueEntry] = deque()
        self.is_watermark = is_watermark


class UnorderedQueue:
    """Records leave in completion order within watermark segments (see module docstring)."""

    def __init__(
        self, capacity: int, new_entry: Callable[[StreamElement, bool], QueueEntry] = QueueEntry
    ) -> None:
        self.capacity = capacity
        self._new_entry = new_entry
        self._segments: deque[_Segment] = deque()
        self._size = 0
        self.completed = 0

    def try_put(self, element: StreamElement) -> QueueEntry | None:
        if self._size >= self.capacity:
            return None
        segments = self._segments
        if type(element) is Watermark:
            entry = self._new_entry(element, True)
            segment = _Segment(is_watermark=True)
            segment.completed.append(entry)
            segments.append(segment)
            self.completed += 1
        else:
            entry = self._new_entry(element, False)
            if not segments or segments[-1].is_watermark:
                segments.append(_Segment(is_watermark=False))
            segment = segments[-1]
        segment.pending[entry] = None
        entry.segment = segment
        self._size += 1
        return entry

    def complete(self, entry: QueueEntry, results: list[Any]) -> None:
        entry.results = results
        entry.done = True
        assert entry.segment is not None
        entry.segment.completed.append(entry)
        self.completed += 1

    def has_completed(self) -> bool:
        segments = self._segments
        return bool(segments) and bool(segments[0].completed)

    def complete_and_poll(self, entry: QueueEntry, results: list[Any]) -> QueueEntry | None:
        self.complete(entry, results)
        return self.poll()

    def poll(self) -> QueueEntry | None:
        segments = self._segments
        if not segments or not segments[0].completed:
            return None
        segment = segments[0]
        entry = segment.completed.popleft()
        del segment.pending[entry]
        self._size -= 1
        self.completed -= 1
        if not segment.pending:
            segments.popleft()
        return entry

    def values(self) -> list[StreamElement]:
        return [entry.element for segment in self._segments for entry in segment.pending]

    def entries(self) -> Iterator[QueueEntry]:
        return iter([entry for segment in self._segments for entry in segment.pending])

    def __len__(self) -> int:
        return self._size
