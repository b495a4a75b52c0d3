"""The benchmark scripts' temporary directories, which a killed run does not leave behind
for good. A SIGTERM unwinds (stateful_async._signals) and the ``finally`` blocks remove
them; a SIGKILL (kill -9, the OOM killer, a CI runner's hard stop) runs none. So each
directory's name carries its script's prefix, the pid namespace, pid and start time of
the run that made it, and the next run of a script removes the directories of its prefix
whose run is gone: in the system's temporary directory only, this user's only, of its own
pid namespace only (a temporary directory shared by containers holds other namespaces'
runs, whose pids mean nothing here), and never one whose pid is alive with that start time
(nor, where start times cannot be told, any whose pid is alive: a reused pid keeps a
directory, it never loses a live run's)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile

_SWEPT: set[str] = set()  # the prefixes this process has cleaned up after already


def run_prefix(prefix: str) -> str:
    """The prefix for a temporary directory of this run (``tempfile.mkdtemp(prefix=...)``,
    ``TemporaryDirectory(prefix=...)``): ``prefix`` (such as ``"spark-bench-"``), this
    process's pid namespace, pid and start time. The first call for a prefix first removes
    what killed runs left under it."""
    if prefix not in _SWEPT:
        _SWEPT.add(prefix)
        _remove_stale(prefix)
    return f"{prefix}{_namespace()}-{os.getpid()}-{_start_time(os.getpid())}-"


def _namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid); 0 if it cannot be
    told (no /proc: no namespaces either)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int) -> int:
    """When process ``pid`` started, in clock ticks since the machine booted (Linux's
    /proc/PID/stat, which no change of the clock moves, unlike psutil's create_time()); 0
    if that cannot be told (no such process, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            text = stat_file.read()
        # the fields after the command's name, which is in parentheses and may hold any
        return int(text.rsplit(b")", 1)[1].split()[19])  # the 22nd field: starttime
    except (OSError, IndexError, ValueError):
        return 0


def _alive(pid: int, started: int) -> bool:
    """Whether the run ``pid``, started at ``started`` (0: unknown), may still be running:
    its pid is, and (if known) the process with that pid is not one started later, that
    reused it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    now = _start_time(pid) if started else 0
    return now == 0 or now <= started


def _remove_stale(prefix: str) -> None:
    root = tempfile.gettempdir()
    named = re.compile(re.escape(prefix) + rf"{_namespace()}-(\d+)-(\d+)-.+")
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        match = named.fullmatch(name)
        if match is None:
            continue
        path = os.path.join(root, name)
        try:
            info = os.lstat(path)  # a symbolic link is not followed, nor removed
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        if not _alive(int(match[1]), int(match[2])):
            shutil.rmtree(path, ignore_errors=True)
