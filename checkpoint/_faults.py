"""Fault-injection points of the snapshot store, for chaos tests.

The list of hooks is empty unless a test installs one (``stateful_async.chaos`` does,
for jobs that wrap their function in ``CrashDuringCommit`` or ``DelayCommit``); with no
hook, ``fire`` costs one list check per commit.

Points:

* ``"before_delta_commit"`` — a checkpoint's rows are built and about to be written and
  committed; context: ``log`` (the SubtaskLog), ``meta`` (its CheckpointMetadata),
  ``data`` (the pyarrow Table of rows).
"""

from __future__ import annotations

from typing import Any, Callable

Hook = Callable[[str, dict[str, Any]], None]

_hooks: list[Hook] = []


def install(hook: Hook) -> None:
    _hooks.append(hook)


def remove(hook: Hook) -> None:
    if hook in _hooks:
        _hooks.remove(hook)


def fire(point: str, **context: Any) -> None:
    for hook in list(_hooks):
        hook(point, context)
