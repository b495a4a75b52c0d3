"""``LocalCluster``: a Spark standalone cluster (a master and workers) on 127.0.0.1, started
from the installed ``pyspark`` package, for chaos tests that kill executors and workers.

Every process is started by this module with ``$SPARK_HOME/bin/spark-class`` (``SPARK_HOME``
is the ``pyspark`` package directory), on free loopback ports, with its logs, work
directories and configuration in a directory the cluster owns. A daemon whose port another
process took in the meantime exits (``spark.port.maxRetries=0``) and is started again on
new ports; the master's REST server, on the fixed port 6066, is off. ``stop()`` ends only the
processes the cluster started — the daemons it launched, the executors and Python workers
they launched — each by pid, after checking the pid still names the same process (its
start time), so a recycled pid is never killed.

The cluster's state (pids, ports, directories) is written to ``<base_dir>/cluster.json``,
so another process can attach to it (``LocalCluster.attach``): that is how the command line
``python -m stateful_async.chaos.cluster start|status|stop`` works.

``DriverProcess`` runs a Spark driver (for example the reference job,
``python -m stateful_async.chaos.job``) as a child process in its own session, so a test
can SIGKILL the driver with its JVM and Python workers, by pid. A watchdog process (as a
cluster's) kills them should the process that started the driver die first.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

from .._exceptions import StatefulAsyncError

T = TypeVar("T")

_STATE_FILE = "cluster.json"
_LOCK_FILE = "cluster.lock"  # held by a start() or start_worker() in progress, and by stop()
_EXECUTOR_CLASS = "org.apache.spark.executor.CoarseGrainedExecutorBackend"
_MASTER_CLASS = "org.apache.spark.deploy.master.Master"
_WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
# Spark treats executors on different host names as different machines. Speculative task
# copies never run on the host of the original attempt, so the workers get two names that
# both resolve to the loopback address.
DEFAULT_HOSTS = ("127.0.0.1", "localhost")
# Java options of every daemon. free_port() only finds a port free *now*; another process
# may take it before the JVM binds. By default Spark then moves silently to the next port
# (up to 16 times), and the cluster would go on talking to whatever holds the port it
# chose. With no retries the daemon exits instead, and the cluster starts it again on new
# ports (up to _BIND_ATTEMPTS launches).
_DAEMON_OPTIONS = ("-Dspark.port.maxRetries=0",)
# The master's REST submission server binds the fixed port 6066 (on by default since
# Spark 4.1); nothing here submits through it.
_MASTER_OPTIONS = (*_DAEMON_OPTIONS, "-Dspark.master.rest.enabled=false")
_BIND_ATTEMPTS = 3
_LOG4J = """\
rootLogger.level = info
rootLogger.appenderRef.stdout.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss.SSS} %p %c{1}: %m%n%ex
logger.jetty.name = org.sparkproject.jetty
logger.jetty.level = warn
"""


class ClusterError(StatefulAsyncError):
    """The local cluster could not be started, found, or told to do something."""


def spark_home() -> str:
    """The ``pyspark`` package directory, which holds ``bin/spark-class`` and the jars."""
    try:
        import pyspark
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ClusterError(
            "PySpark is not installed, so there is no Spark to start: install "
            "pyspark==4.2.* (the spark extra: pip install '.[spark,chaos]' in a clone of "
            "stateful-async)."
        ) from exc
    return os.path.dirname(os.path.abspath(pyspark.__file__))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(
    condition: Callable[[], T | None],
    timeout: float,
    message: str,
    interval: float = 0.1,
) -> T:
    """Poll ``condition`` until it returns something truthy (returned), or raise
    ``TimeoutError`` with ``message`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{message} (waited {timeout:.0f} s).")
        time.sleep(interval)


@dataclass(frozen=True)
class ProcessRecord:
    """A process this module started: its pid and its start time (``psutil``'s
    ``create_time``), which together name it even after the pid is recycled."""

    pid: int
    create_time: float

    @classmethod
    def of(cls, pid: int) -> ProcessRecord:
        import psutil

        try:
            return cls(pid, psutil.Process(pid).create_time())
        except psutil.Error as exc:
            raise ClusterError(f"Process {pid} exited right after it was started.") from exc

    def process(self) -> Any:
        """The live ``psutil.Process``, or None if it has exited (or the pid was reused)."""
        import psutil

        try:
            process = psutil.Process(self.pid)
            if abs(process.create_time() - self.create_time) > 0.01:
                return None
            if process.status() == psutil.STATUS_ZOMBIE:
                return None
            return process
        except psutil.Error:
            return None

    def alive(self) -> bool:
        return self.process() is not None


@dataclass(frozen=True)
class WorkerInfo:
    """One worker daemon: its index in the cluster, host name, ports and work directory."""

    index: int
    host: str
    port: int
    webui_port: int
    work_dir: str
    record: ProcessRecord

    @property
    def pid(self) -> int:
        return self.record.pid


@dataclass(frozen=True)
class ExecutorProcess:
    """An executor JVM (``CoarseGrainedExecutorBackend``) that a worker launched, named by
    its pid and start time (``psutil``'s ``create_time``), as ``ProcessRecord`` names one."""

    pid: int
    app_id: str
    executor_id: str
    worker: int  # the index of the worker that launched it; -1 if that worker is gone
    create_time: float

    @property
    def record(self) -> ProcessRecord:
        return ProcessRecord(self.pid, self.create_time)


def _tree(process: Any) -> list[Any]:
    import psutil

    try:
        return [process, *process.children(recursive=True)]
    except psutil.Error:
        return [process]


def _kill_all(processes: Sequence[Any], sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` to each process, by pid; returns the pids signalled."""
    import psutil

    sent = []
    for process in processes:
        try:
            process.send_signal(sig)
            sent.append(process.pid)
        except psutil.Error:
            pass
    return sent


def _running(process: Any) -> bool:
    import psutil

    try:
        return bool(process.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _wait_gone(processes: Sequence[Any], timeout: float) -> list[Any]:
    """Wait until the processes have exited; returns those still running (zombies, which
    only wait for their parent to reap them, count as exited)."""
    import psutil

    _, alive = psutil.wait_procs(list(processes), timeout=timeout)
    return [p for p in alive if _running(p)]


def _arg(cmdline: Sequence[str], name: str) -> str:
    for i, part in enumerate(cmdline[:-1]):
        if part == name:
            return cmdline[i + 1]
    return ""


# The units Spark reads an amount of memory in (JavaUtils.byteStringAs, which
# Utils.memoryStringToMb, the worker's parser of --memory, calls): case-insensitive; a
# number without one is bytes.
_MEMORY_UNITS = {
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "p": 1 << 50,
    "pb": 1 << 50,
}
_MAX_WORKER_MIB = 2**31 - 1  # the worker keeps its memory as an Int of MiB
_MAX_WORKER_CORES = 2**31 - 1  # and its cores as an Int (--cores past it: a usage message)


def _check_count(name: str, value: Any, need: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClusterError(f"{need}: {name} must be a whole number of at least 1; got {value!r}.")
    return value


def check_workers(name: str, value: Any) -> int:
    """``value`` if it is a number of workers (at least 1); else ``ClusterError`` naming the
    setting ``name``."""
    return _check_count(name, value, "A cluster needs at least one worker")


def check_cores(name: str, value: Any) -> int:
    """``value`` if it is a number of cores per worker (at least 1, at most 2**31 - 1, the
    most a Spark worker can count); else ``ClusterError`` naming the setting ``name``."""
    cores = _check_count(name, value, "Each worker needs at least one core to offer executors")
    if cores > _MAX_WORKER_CORES:
        raise ClusterError(
            f"{name} must be at most {_MAX_WORKER_CORES}, the most cores a Spark worker can "
            f"count; got {value!r}."
        )
    return cores


def check_memory(name: str, value: Any) -> str:
    """``value`` (stripped) if a Spark worker takes it as its memory (``--memory``): a whole
    number with an optional unit (b, k, m, g, t, p, or kb .. pb; case-insensitive; none is
    bytes) of at least 1 MiB, as Spark's ``Utils.memoryStringToMb`` reads it; else
    ``ClusterError`` naming the setting ``name``."""
    text = value.strip() if isinstance(value, str) else None
    match = re.fullmatch(r"([0-9]+)([a-z]+)?", text.lower()) if text else None
    if text is None or match is None or (match[2] or "b") not in _MEMORY_UNITS:
        if isinstance(value, int) and not isinstance(value, bool):
            hint = (
                f" Pass it as a string with its unit: '{value}m' for {value} MiB, '{value}g' for "
                f"{value} GiB."
            )
        elif text is not None and re.fullmatch(r"[0-9]*\.[0-9]+[a-zA-Z]*", text):
            hint = " Spark takes no fractions: use a smaller unit (1536m, not 1.5g)."
        else:
            hint = ""
        raise ClusterError(
            f"{name} must be a whole number with a unit, k, m, g, t or p (or kb .. pb; in any "
            f"case), as a Spark worker reads an amount of memory, such as 512m or 2g; got "
            f"{value!r}.{hint}"
        )
    mib = int(match[1]) * _MEMORY_UNITS[match[2] or "b"] >> 20
    if mib < 1:
        hint = (
            f" A number without a unit is bytes to Spark: did you mean {text}m?"
            if match[2] is None and int(match[1]) > 0
            else ""
        )
        raise ClusterError(
            f"{name} must be at least 1 MiB (1m), the least a Spark worker runs with; got "
            f"{value!r}.{hint}"
        )
    if mib > _MAX_WORKER_MIB:
        raise ClusterError(
            f"{name} must be below 2 PiB (2048t), the most a Spark worker can count; got {value!r}."
        )
    return text


# The units Java reads a heap size in (-Xmx, which spark-class gives the daemons
# SPARK_DAEMON_MEMORY as): case-insensitive; a number without one is bytes.
_JAVA_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_MIN_HEAP = 2 << 20  # Java's -Xmx must be "greater than 2 MB"
_MAX_HEAP = 1 << 64  # Java counts it in 64 bits: from 16 EiB on, an "Invalid maximum heap size"


def check_daemon_memory(name: str, value: Any) -> str:
    """``value`` (stripped) if Java takes it as the daemons' heap size (``-Xmx``): a whole
    number with an optional unit (k, m, g or t; case-insensitive; none is bytes) of more
    than 2 MiB and below 16 EiB; else ``ClusterError`` naming the setting ``name``. (Java
    also reads hex, ``0x10m``; refused here, with the decimal size as a hint.)"""
    text = value.strip() if isinstance(value, str) else None
    match = re.fullmatch(r"([0-9]+)([kmgt]?)", text, re.IGNORECASE) if text else None
    if text is None or match is None:
        hexa = re.fullmatch(r"0x([0-9a-f]+)([kmgt]?)", text, re.IGNORECASE) if text else None
        if isinstance(value, int) and not isinstance(value, bool) and value << 20 > _MIN_HEAP:
            # (only a size it takes: '0m' or '-1m' would be refused in turn)
            hint = f" Pass it as a string with its unit: '{value}m' for {value} MiB."
        elif text is not None and re.fullmatch(r"[0-9]*\.[0-9]+[a-zA-Z]*", text):
            hint = " Java takes no fractions: use a smaller unit (1536m, not 1.5g)."
        elif hexa and _MIN_HEAP < int(hexa[1], 16) * _JAVA_UNITS[hexa[2].lower()] < _MAX_HEAP:
            hint = f" Write it in decimal: {int(hexa[1], 16)}{hexa[2]} for {text}."
        else:
            hint = ""
        raise ClusterError(
            f"{name} must be a whole number with a unit, k, m, g or t (in any case), as Java "
            f"reads a heap size (-Xmx), such as 512m or 1g; got {value!r}.{hint}"
        )
    size = int(match[1]) * _JAVA_UNITS[match[2].lower()]
    if size <= _MIN_HEAP:
        hint = (
            f" A number without a unit is bytes to Java: did you mean {text}m?"
            if not match[2] and int(match[1]) > 0
            else ""
        )
        raise ClusterError(
            f"{name} must be more than 2 MiB (2m), the least heap Java starts with; got "
            f"{value!r}.{hint}"
        )
    if size >= _MAX_HEAP:
        raise ClusterError(
            f"{name} must be below 16 EiB (16777216t), the most heap size Java can count; got "
            f"{value!r}."
        )
    return text


def _is_seconds(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def check_timeout(
    name: str, value: Any, purpose: str = "the time the master and workers get to start"
) -> float:
    """``value`` if it is a finite number of seconds above 0; else ``ClusterError`` naming
    the setting ``name`` and what it is for (``purpose``)."""
    if not _is_seconds(value) or not 0 < value < math.inf:
        raise ClusterError(
            f"{name} must be a finite number of seconds above 0, {purpose}; got {value!r}."
        )
    return float(value)


def check_wait(name: str, value: Any) -> float:
    """``value`` if it is a finite number of seconds, 0 or more (how long a stop waits for a
    start running in its directory); else ``ClusterError`` naming the setting ``name``."""
    if not _is_seconds(value) or not 0 <= value < math.inf:
        raise ClusterError(
            f"{name} must be a finite number of seconds, 0 or more, the time to wait for a "
            f"start running in the cluster's directory to be done; got {value!r}. Leave it "
            "out to wait as long as that start may take."
        )
    return float(value)


# What attach() reads from the state file: a dict is an object with those fields, a type
# a value of it; _WORKERS is the workers object, worker index (a string) -> worker; an
# _Optional field may be missing (a file an older version wrote lacks it).
class _Workers:
    pass


@dataclass(frozen=True)
class _Optional:
    schema: Any


_WORKERS = _Workers()
_RECORD_SCHEMA: dict[str, Any] = {"pid": int, "create_time": (int, float)}
_WORKER_SCHEMA: dict[str, Any] = {
    "index": int,
    "host": str,
    "port": int,
    "webui_port": int,
    "work_dir": str,
    "record": _RECORD_SCHEMA,
}
_STATE_SCHEMA: dict[str, Any] = {
    "master": _RECORD_SCHEMA,
    "master_port": int,
    "webui_port": int,
    "workers": _WORKERS,
    "settings": {
        "workers": int,
        "cores": int,
        "memory": str,
        "hosts": list,
        "python": str,
        "daemon_memory": str,
        "startup_timeout": _Optional((int, float)),  # an older version wrote none: the default
    },
}


def _check_state(
    value: Any, schema: Any, where: str, missing: list[str], malformed: list[str]
) -> None:
    """Add to ``missing`` the fields of ``schema`` that ``value`` lacks, and to ``malformed``
    those it has with a value of the wrong kind, each named by its path (``settings.cores``)."""
    name = where.rstrip(".") or "the file's content"
    if isinstance(schema, (dict, _Workers)):
        if not isinstance(value, dict):
            malformed.append(f"{name} (not a JSON object)")
        elif isinstance(schema, dict):
            for key, field_schema in schema.items():
                optional = isinstance(field_schema, _Optional)
                if optional:
                    field_schema = field_schema.schema
                if key in value:
                    _check_state(value[key], field_schema, f"{where}{key}.", missing, malformed)
                elif not optional:
                    missing.append(f"{where}{key}")
        else:
            for key, worker in value.items():
                if key.isdigit():
                    _check_state(worker, _WORKER_SCHEMA, f"{where}{key}.", missing, malformed)
                else:
                    malformed.append(f"{where}{key} (not a worker index)")
    elif isinstance(value, bool) or not isinstance(value, schema):
        malformed.append(f"{name} ({json.dumps(value)})")


def _named_pids(state: Any) -> list[tuple[str, int, Any]]:
    """(role, pid, create_time or None) of each process ``state`` names, as far as it
    names them."""
    named: list[tuple[str, int, Any]] = []

    def add(role: str, record: Any) -> None:
        if isinstance(record, dict) and type(record.get("pid")) is int and record["pid"] > 0:
            create_time = record.get("create_time")
            if isinstance(create_time, bool) or not isinstance(create_time, (int, float)):
                create_time = None
            named.append((role, record["pid"], create_time))

    if isinstance(state, dict):
        add("the master", state.get("master"))
        workers = state.get("workers")
        if isinstance(workers, dict):
            for index, worker in workers.items():
                if isinstance(worker, dict):
                    add(f"worker {index}", worker.get("record"))
    return named


def _unusable_state_message(
    path: Path, state: Any, missing: list[str], malformed: list[str], reason: str = ""
) -> str:
    """Why the state file ``path`` cannot be used, and what to do about its processes."""
    import psutil

    problems = []
    if missing:
        problems.append(f"it lacks {', '.join(missing)}")
    if malformed:
        problems.append(f"it has a wrong value for {', '.join(malformed)}")
    if reason:
        problems.append(reason)
    running = []
    for role, pid, create_time in _named_pids(state):
        if create_time is not None:
            if ProcessRecord(pid, float(create_time)).alive():
                running.append(f"{pid} ({role})")
        elif psutil.pid_exists(pid):  # no start time to tell it from a reused pid
            running.append(f"{pid} ({role}, or another process that took its pid)")
    if running:
        advice = (
            f"Processes it names are running: {', '.join(running)}. Check that each is a "
            f"Spark daemon of this cluster, stop it by hand (kill PID) with the executors it "
            f"launched (their work directories are under {path.parent / 'work'}), then "
            f"remove {path}."
        )
    else:
        advice = f"None of the processes it names is running: remove {path}."
    return (
        f"The cluster state file {path} cannot be used: {'; '.join(problems)}. It was "
        "edited by hand or written by another version of stateful-async, and the cluster "
        "commands need all of it to find and stop the cluster's processes. "
        f"{advice} Then start a new cluster (python -m stateful_async.chaos.cluster start "
        f"--dir {path.parent})."
    )


# "\tat org.apache.spark...(Master.scala:42)", "\t... 12 more": a Java stack trace's frames
_STACK_FRAME = re.compile(r"\s+(at |\.\.\. \d+ more)")
_STOP_MARK = "stop"  # cluster.lock held by a stop: "<pid> stop"
# A watchdog (_launch_watchdog): it waits, importing nothing, for its owner to write
# _STOPPED to its stdin. Should the pipe close first, the owner died without stopping what
# it watches (SIGKILL, a SIGTERM nobody handles: atexit runs for neither), and the watchdog
# stops it: argv is "cluster", the cluster's directory and "owned" if it is to go too (a
# LocalCluster); or "driver", the driver's pid and start time (a DriverProcess: its watchdog
# also leaves once the driver's session is gone, see _watch_driver). It imports
# stateful_async from the owner's (first on its PYTHONPATH), not from the working directory
# that python -c puts first on sys.path: another checkout or version there would be
# imported instead, and a watchdog failing to import stops nothing.
_STOPPED = "stopped\n"
_WATCHDOG = f"""\
import sys
if sys.path[:1] == [""]:
    del sys.path[0]
if sys.argv[1] == "driver":
    from stateful_async.chaos._cluster import _watch_driver
    _watch_driver(int(sys.argv[2]), float(sys.argv[3]))
elif sys.stdin.readline() != {_STOPPED!r}:
    from stateful_async.chaos._cluster import _stop_for_dead_owner
    _stop_for_dead_owner(sys.argv[2], owned=sys.argv[3:] == ["owned"])
"""
_WATCH_INTERVAL = 1.0  # seconds between a driver's watchdog's looks at the driver's session


# Pipes to a child that stops what this process started once they close (a watchdog's, a
# MockService's stdin): a child forked from this process without exec (multiprocessing's
# fork, os.fork) would hold them open too, and what they guard would outlive this process
# until that child exits. In such a child their fds are made to name /dev/null instead.
_owner_pipes: set[IO[str]] = set()
# The same child would also run, on a normal exit, the stop() its parent registered with
# atexit (a LocalCluster's, a MockService's): stopping the parent's cluster under it.
_owner_stops: list[Callable[[], Any]] = []


def stop_at_exit(stop: Callable[[], Any]) -> None:
    """Has ``stop`` run when this process exits (``atexit``): not in a child forked
    from it without exec, whose exit is not the end of what this process started."""
    atexit.register(stop)
    _owner_stops.append(stop)


def no_stop_at_exit(stop: Callable[[], Any]) -> None:
    """Undoes ``stop_at_exit(stop)``."""
    atexit.unregister(stop)
    with contextlib.suppress(ValueError):
        _owner_stops.remove(stop)


def _release_owner_pipes() -> None:
    """In a child forked without exec: let go of the parent's ``_owner_pipes``, and of the
    stops it registered to run at its exit."""
    for stop in _owner_stops:
        atexit.unregister(stop)
    _owner_stops.clear()
    pipes = [pipe for pipe in _owner_pipes if not pipe.closed]
    _owner_pipes.clear()  # the parent's to close, not this child's
    if pipes:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            for pipe in pipes:
                os.dup2(null, pipe.fileno(), inheritable=False)
        finally:
            os.close(null)


os.register_at_fork(after_in_child=_release_owner_pipes)


def _launch_watchdog(args: Sequence[str], log_path: Path) -> subprocess.Popen[str]:
    """Start a watchdog (``_WATCHDOG``) that acts on ``args`` should this process die
    before ``_dismiss_watchdog``; it logs to ``log_path``. It holds a pipe from this
    process: the system closes it when this process dies, however it dies."""
    package_root = str(Path(__file__).resolve().parents[2])  # where stateful_async is
    path = os.environ.get("PYTHONPATH")
    with open(log_path, "a") as log:
        watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, *args],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=log,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join([package_root, *filter(None, [path])]),
            },
            start_new_session=True,  # a Ctrl-C to this process's group is not for it
            text=True,
        )
    assert watchdog.stdin is not None
    _owner_pipes.add(watchdog.stdin)
    return watchdog


def _dismiss_watchdog(watchdog: subprocess.Popen[str] | None) -> None:
    """Tell ``watchdog`` that what it watches is stopped, and reap it."""
    if watchdog is None:
        return
    assert watchdog.stdin is not None
    _owner_pipes.discard(watchdog.stdin)
    try:
        watchdog.stdin.write(_STOPPED)
        watchdog.stdin.close()
    except OSError:  # it died
        pass
    try:
        watchdog.wait(10)
    except subprocess.TimeoutExpired:
        watchdog.kill()
        watchdog.wait()


def _stop_for_dead_owner(base_dir: str, owned: bool) -> None:
    """What a cluster's watchdog does once its owner died without stopping the cluster.
    What it could not stop stays recorded (the directory is kept, for ``cluster stop
    --dir``), and why goes to its log, logs/watchdog.log."""
    try:
        LocalCluster.attach(base_dir).stop()  # waits for the owner's start, if it was one
    except ClusterError as exc:  # none recorded (a failed start stopped what it started),
        print(f"stateful-async cluster watchdog: {exc}", file=sys.stderr)  # or it failed
        if (Path(base_dir) / _STATE_FILE).exists():
            return  # the only record of what may still run
    if owned:
        shutil.rmtree(base_dir, ignore_errors=True)


def _watch_driver(pid: int, create_time: float) -> None:
    """A driver's watchdog (``_WATCHDOG``): it waits for its owner to dismiss it or to die
    (the pipe on stdin closes: it kills the driver's session), but no longer than that
    session lasts. Once the session is gone its id, the driver's pid, is free for a new
    process, and the session that process may lead (another driver, a cluster daemon) is
    not this watchdog's to kill when the owner exits later."""
    import select

    driver = ProcessRecord(pid, create_time)
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], _WATCH_INTERVAL)
        if readable:
            if sys.stdin.readline() != _STOPPED:
                _kill_for_dead_owner(pid, create_time)
            return
        if not driver.alive() and not _session_processes(driver):
            return


def _kill_for_dead_owner(pid: int, create_time: float) -> None:
    """What a driver's watchdog does once the process that started the driver died: SIGKILL
    the driver and every process of its session (its JVM, the JVM's Python workers)."""
    processes = _session_processes(ProcessRecord(pid, create_time))
    _kill_all(processes)
    survivors = _wait_gone(processes, 30)
    if survivors:
        print(
            f"stateful-async driver watchdog: driver processes survived SIGKILL: {survivors}.",
            file=sys.stderr,
        )


def _lock_holder(text: str) -> tuple[str, float | None, str]:
    """The pid a cluster.lock names ('unknown' if none), the time (``time.time()``) its
    start gives up by, if it names one (a stop's, or an older version's, does not), and
    what the holder does: "stop", or "start" (of the cluster or a worker; an older
    version's stop too, which the lock does not tell apart)."""
    parts = text.split()
    holder = parts[0] if parts and parts[0].isdigit() else "unknown"
    if parts[1:2] == [_STOP_MARK]:
        return holder, None, "stop"
    try:
        gives_up_at = float(parts[1])
    except (IndexError, ValueError):
        return holder, None, "start"
    return holder, gives_up_at if math.isfinite(gives_up_at) else None, "start"


class LocalCluster:
    """A Spark standalone cluster on 127.0.0.1: one master and ``workers`` workers.

        with LocalCluster() as cluster:            # ~5-35 s until the workers are alive
            spark = session_for(cluster.master_url)
            ...
            cluster.kill_executor(app_id)          # SIGKILL one executor JVM
            cluster.kill_worker(1)                 # SIGKILL a worker with its executors
            cluster.start_worker(1)                # bring it back

    Each worker offers ``cores`` cores and ``memory`` to executors; the workers' host names
    cycle through ``hosts`` (all loopback names), so Spark sees separate machines.
    ``python`` is the daemons' ``PYSPARK_PYTHON``, but Python tasks run the interpreter the
    driver names (its ``PYSPARK_PYTHON``, else ``python3``): ``session_for`` names its own,
    so that executors import what this environment has installed. ``workers`` and
    ``cores`` are at least 1 (``cores`` at most 2**31 - 1), ``memory`` is an amount as a
    Spark worker reads it (``512m``, ``2g``) of at least 1 MiB, ``daemon_memory`` (the
    master's and each worker's own heap) a heap size as Java reads it (``512m``, ``1g``;
    not in hex) of more than 2 MiB and below 16 EiB, and ``startup_timeout`` a finite
    number of seconds above 0: anything else raises ``ClusterError`` here, before
    anything starts.

    Everything the cluster writes (configuration, daemon logs, executor work directories,
    the state file) goes under ``base_dir``; without one, a temporary directory is created
    and removed by ``stop()``. ``stop()`` (also called on exit of a ``with`` block and, with
    ``stop_at_exit``, when the interpreter exits) ends every process the cluster started,
    by pid, and nothing else. With ``stop_at_exit``, a process that dies without stopping
    the cluster (SIGKILL, a SIGTERM nobody handles: no atexit) has it stopped all the
    same, by a watchdog process that ``start()`` launches.
    """

    def __init__(
        self,
        workers: int = 2,
        *,
        cores: int = 1,
        memory: str = "2g",
        base_dir: str | os.PathLike[str] | None = None,
        hosts: Sequence[str] = DEFAULT_HOSTS,
        python: str = sys.executable,
        daemon_memory: str = "512m",
        startup_timeout: float = 180.0,
        stop_at_exit: bool = True,
    ) -> None:
        # checked here, before anything starts: on a worker's command line they are found
        # wrong (if at all) only once it is launched
        check_workers("workers", workers)
        check_cores("cores", cores)
        memory = check_memory("memory", memory)
        daemon_memory = check_daemon_memory("daemon_memory", daemon_memory)
        startup_timeout = check_timeout("startup_timeout", startup_timeout)
        if not hosts or any(h not in ("127.0.0.1", "localhost") for h in hosts):
            raise ClusterError(
                f"Worker host names must be loopback names ('127.0.0.1', 'localhost'); got "
                f"{list(hosts)}. The local cluster never listens on other addresses."
            )
        self.workers_wanted = workers
        self.cores = cores
        self.memory = memory
        self.hosts = tuple(hosts)
        self.python = python
        self.daemon_memory = daemon_memory
        self.startup_timeout = startup_timeout
        self.stop_at_exit = stop_at_exit
        self._owns_dir = base_dir is None
        # absolute: the daemons run in it, and take its paths (conf, work dirs) from here
        self.base_dir = Path(os.path.abspath(base_dir)) if base_dir is not None else None
        self.master: ProcessRecord | None = None
        self.master_port = 0
        self.webui_port = 0
        self.workers: dict[int, WorkerInfo] = {}
        self._popen: dict[int, subprocess.Popen[bytes]] = {}  # children, reaped when killed
        self._log_starts: dict[int, tuple[Path, int]] = {}  # pid -> its log, where its run began
        self._exit_codes: dict[int, int] = {}  # pid -> exit code, of a dead worker reaped
        self._spark_home = ""
        self._at_exit_registered = False
        # whether base_dir is this object's to clean up: set once start() took it (or
        # attach() found a cluster there), so stop() never touches another cluster's dir
        self._claimed = False
        self._attached = False  # made by attach(): cluster.json, not this object, knows best
        self._lock: IO[str] | None = None  # cluster.lock, while this object holds it
        self._watchdog: subprocess.Popen[str] | None = None  # with stop_at_exit, once started

    # -- addresses ----------------------------------------------------------------------

    @property
    def master_url(self) -> str:
        self._require_started()
        return f"spark://127.0.0.1:{self.master_port}"

    @property
    def webui_url(self) -> str:
        self._require_started()
        return f"http://127.0.0.1:{self.webui_port}"

    @property
    def state_file(self) -> Path:
        self._require_started()
        assert self.base_dir is not None
        return self.base_dir / _STATE_FILE

    def _require_started(self) -> None:
        if self.master is None or self.base_dir is None:
            raise ClusterError("The cluster is not started: call start() first.")

    # -- start --------------------------------------------------------------------------

    def start(self) -> LocalCluster:
        """Start the master and the workers and wait until every worker is alive."""
        if self.master is not None:
            return self
        self._spark_home = spark_home()
        if self.base_dir is None:
            self.base_dir = Path(tempfile.mkdtemp(prefix="stateful-async-cluster-"))
        try:
            self.base_dir.mkdir(parents=True, exist_ok=True)
            # Held until start() returns: two starts in one directory would both find no
            # state file, and the second's would overwrite the first's, whose processes
            # nothing would then stop. (A lock the system drops when its holder dies: none
            # goes stale.)
            lock = self._lock_start(gives_up_in=self.startup_timeout)
        except OSError as exc:  # a file in the way, a folder it may not write in
            why = "it is a file, not a directory" if self.base_dir.is_file() else exc.strerror
            raise ClusterError(
                f"The cluster cannot keep its state in {self.base_dir}: {why or exc}. Give it "
                "a directory it can create or write in (base_dir, or --dir)."
            ) from exc
        self._lock = lock
        try:
            return self._start_locked()
        finally:
            self._lock = None
            lock.close()

    def _lock_start(
        self,
        wait: float | None = None,
        on_wait: Callable[[str, str], None] | None = None,
        *,
        gives_up_in: float | None = None,
        margin: float | None = None,
    ) -> IO[str]:
        """Take ``<base_dir>/cluster.lock`` for this start (of the cluster or of a worker),
        or raise ``ClusterError`` if another one (in any process) holds it. The lock file
        names this process's pid and, for a start that gives up in ``gives_up_in`` seconds,
        the time it gives up by. With ``wait`` (for a stop, which the lock file then says),
        wait up to that many seconds for the holder to be done instead, or with ``margin``
        too, until the time the holder gives up by, plus ``margin`` (where it names one);
        and call ``on_wait(holder's pid, "start" or "stop")`` once if it has to."""
        import fcntl

        assert self.base_dir is not None
        path = self.base_dir / _LOCK_FILE
        lock = open(path, "a+")  # noqa: SIM115 - closed by the caller, which releases it
        began = time.monotonic()
        waited = False
        rechecked = False
        while True:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                lock.seek(0)
                holder, gives_up_at, doing = _lock_holder(lock.read())
                pid = f" (pid {holder})" if holder.isdigit() else ""
                # until the holder's give-up time plus margin, where both are known: on the
                # wall clock (another process's monotonic clock differs from this one's)
                until = None if margin is None or gives_up_at is None else gives_up_at + margin
                if until is None:
                    limit = began + (wait or 0.0)
                else:
                    limit = time.monotonic() + until - time.time()
                if wait is not None and time.monotonic() < limit:
                    if not waited and on_wait is not None:
                        on_wait(holder, doing)
                    waited = True
                    time.sleep(0.1)
                    continue
                if until is not None and not rechecked:
                    # What a start that has just taken the lock has not yet replaced (its
                    # predecessor's pid and time) is read once more before giving up on it
                    rechecked = True
                    time.sleep(0.1)
                    continue
                lock.close()
                if wait is not None and doing == "stop":
                    raise ClusterError(
                        f"A stop of the cluster in {self.base_dir} is still running in another "
                        f"process{pid} after {wait:g} s ({path} is locked). Wait until it is "
                        "done and see what runs (python -m stateful_async.chaos.cluster status "
                        f"--dir {self.base_dir})."
                    ) from None
                if wait is not None:
                    waited_for = (
                        f"{time.monotonic() - began:.0f} s, {time.time() - gives_up_at:.0f} s "
                        "past the time it said it would give up by"
                        if until is not None and gives_up_at is not None
                        else f"{wait:g} s"
                    )
                    raise ClusterError(
                        f"A start of a cluster or a worker in {self.base_dir} is still running "
                        f"in another process{pid} after {waited_for} ({path} is locked), so "
                        "nothing was stopped: what it starts would be recorded again after "
                        "the stop. Run stop again once it is done (python -m "
                        f"stateful_async.chaos.cluster stop --dir {self.base_dir})."
                    ) from None
                doing_what = (
                    "stopping the cluster" if doing == "stop" else "starting a cluster or a worker"
                )
                raise ClusterError(
                    f"Another process{pid} is {doing_what} in "
                    f"{self.base_dir} right now ({path} is locked). Wait until it is done and "
                    "see what runs (python -m stateful_async.chaos.cluster status --dir "
                    f"{self.base_dir}), or use another directory."
                ) from None
        lock.seek(0)
        lock.truncate()
        if wait is not None:
            lock.write(f"{os.getpid()} {_STOP_MARK}")
        elif gives_up_in is not None:
            lock.write(f"{os.getpid()} {time.time() + gives_up_in:.3f}")
        else:
            lock.write(str(os.getpid()))
        lock.flush()
        return lock

    def _start_locked(self) -> LocalCluster:
        assert self.base_dir is not None
        existing = self.base_dir / _STATE_FILE
        if existing.exists():
            raise ClusterError(
                f"{existing} already describes a cluster. Stop it first (python -m "
                f"stateful_async.chaos.cluster stop --dir {self.base_dir}) or use another "
                "directory."
            )
        self._claimed = True
        for sub in ("conf", "logs", "work"):
            (self.base_dir / sub).mkdir(exist_ok=True)
        (self.base_dir / "conf" / "log4j2.properties").write_text(_LOG4J)
        if self.stop_at_exit and not self._at_exit_registered:
            stop_at_exit(self.stop)
            self._at_exit_registered = True
        try:
            if self.stop_at_exit and self._watchdog is None:
                self._start_watchdog()
            deadline = time.monotonic() + self.startup_timeout
            self._start_master(deadline)
            for index in range(self.workers_wanted):
                self._launch_worker(index)
            self._wait_registered(range(self.workers_wanted), deadline - time.monotonic())
        except BaseException:
            self.stop()
            raise
        return self

    def _start_watchdog(self) -> None:
        """Start a process that stops the cluster should this one die without stopping it
        (atexit does not run on SIGKILL or on a SIGTERM nobody handles, and the daemons,
        in sessions of their own, would run on)."""
        assert self.base_dir is not None
        (self.base_dir / "logs").mkdir(exist_ok=True)
        self._watchdog = _launch_watchdog(
            ["cluster", str(self.base_dir), *(["owned"] if self._owns_dir else [])],
            self.base_dir / "logs" / "watchdog.log",
        )

    def _dismiss_watchdog(self) -> None:
        """Tell the watchdog the cluster is stopped, and reap it."""
        watchdog, self._watchdog = self._watchdog, None
        _dismiss_watchdog(watchdog)

    def _start_master(self, deadline: float) -> None:
        """Launch the master on free ports and wait until its web UI answers as this
        master; on new ports again if another process took one first."""
        for attempt in range(1, _BIND_ATTEMPTS + 1):
            self.master_port, self.webui_port = free_port(), free_port()
            process = self._launch(
                "master",
                [
                    _MASTER_CLASS,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.master_port),
                    "--webui-port",
                    str(self.webui_port),
                ],
                "SPARK_MASTER_OPTS",
                _MASTER_OPTIONS,
            )
            self.master = ProcessRecord.of(process.pid)
            self._save()
            if self._wait_master_up(process, deadline):
                return
            self._popen.pop(process.pid, None)
            self.master = None
            failure = self._bind_failure(process.pid)
            if failure is None or attempt == _BIND_ATTEMPTS:
                raise ClusterError(
                    self._exit_message("master", process, failure, attempt) + f" {self._log_tail()}"
                )

    def _wait_master_up(self, process: subprocess.Popen[bytes], deadline: float) -> bool:
        """Wait until the master's web UI answers as this master (True) or the master
        exits (False)."""

        def settled() -> bool:
            if process.poll() is not None:
                return True
            try:
                self.master_status(timeout=2.0)  # checks it is this master's
                return True
            except ClusterError:
                return False  # not listening yet

        try:
            wait_until(
                settled, max(deadline - time.monotonic(), 1.0), "The Spark master did not start"
            )
        except TimeoutError as exc:
            raise ClusterError(f"{exc} {self._log_tail()}") from exc
        return process.poll() is None

    def start_worker(self, index: int, timeout: float | None = None) -> WorkerInfo:
        """Start worker ``index`` again (after ``kill_worker``), on new ports, and wait until
        the master counts it alive, up to ``timeout`` seconds (a finite number above 0;
        default: ``startup_timeout``). With the master gone, ``ClusterError`` at once, and
        nothing is launched."""
        if timeout is None:
            timeout = self.startup_timeout
        else:
            check_timeout("timeout", timeout, "the time the worker gets to start")
        self._require_started()
        # Held until the worker runs: two at once would both find it dead and both launch
        # one, and the state file would keep only the second (the first never stopped).
        lock = self._lock_start(gives_up_in=timeout)
        self._lock = lock
        try:
            return self._start_worker_locked(index, timeout)
        finally:
            self._lock = None
            lock.close()

    def _start_worker_locked(self, index: int, timeout: float) -> WorkerInfo:
        if index not in self.workers:
            raise ClusterError(
                f"The cluster has no worker {index}: its workers are "
                f"{', '.join(map(str, sorted(self.workers)))} (start-worker starts a killed "
                "one again; for more workers, start the cluster with more)."
            )
        if self.workers[index].record.alive():
            raise ClusterError(
                f"Worker {index} is already running (pid {self.workers[index].pid})."
            )
        # a worker launched without one would never register: refused before, not after a wait
        self._check_master(
            f"Cannot start worker {index}: the",
            "No worker can join a cluster whose master is gone: stop the cluster (python -m "
            f"stateful_async.chaos.cluster stop --dir {self.base_dir}) and start a new one.",
        )
        self._launch_worker(index)
        self._wait_registered([index], timeout)
        return self.workers[index]  # relaunched on other ports if its first ones were taken

    def _launch_worker(self, index: int) -> WorkerInfo:
        assert self.base_dir is not None
        host = self.hosts[index % len(self.hosts)]
        port, webui = free_port(), free_port()
        work_dir = self.base_dir / "work" / f"worker-{index}"
        work_dir.mkdir(parents=True, exist_ok=True)
        process = self._launch(
            f"worker-{index}",
            [
                _WORKER_CLASS,
                f"spark://127.0.0.1:{self.master_port}",
                "--host",
                host,
                "--cores",
                str(self.cores),
                "--memory",
                self.memory,
                "--port",
                str(port),
                "--webui-port",
                str(webui),
                "--work-dir",
                str(work_dir),
            ],
            "SPARK_WORKER_OPTS",
            _DAEMON_OPTIONS,
        )
        info = WorkerInfo(index, host, port, webui, str(work_dir), ProcessRecord.of(process.pid))
        self.workers[index] = info
        self._save()
        return info

    def _launch(
        self, name: str, args: list[str], options_variable: str, options: Sequence[str]
    ) -> subprocess.Popen[bytes]:
        """Start a daemon with ``spark-class``; ``options`` (Java options) go last in
        ``options_variable`` (``SPARK_MASTER_OPTS``/``SPARK_WORKER_OPTS``), so they win
        over the same options set there by the user."""
        assert self.base_dir is not None
        env = dict(os.environ)
        env.update(
            SPARK_HOME=self._spark_home,
            SPARK_CONF_DIR=str(self.base_dir / "conf"),
            SPARK_LOG_DIR=str(self.base_dir / "logs"),
            SPARK_LOCAL_IP="127.0.0.1",  # web UIs and daemons bind to loopback only
            SPARK_DAEMON_MEMORY=self.daemon_memory,
            PYSPARK_PYTHON=self.python,
        )
        # The daemons are short-lived test fixtures: start-up matters more than peak speed.
        env.setdefault("SPARK_DAEMON_JAVA_OPTS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        env[options_variable] = " ".join([env.get(options_variable, ""), *options]).strip()
        env.pop("SPARK_LOCAL_HOSTNAME", None)
        spark_class = os.path.join(self._spark_home, "bin", "spark-class")
        log_path = self.base_dir / "logs" / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - child owns it
        log_start = log.tell()
        try:
            # Its own session: a Ctrl-C in the terminal does not reach the cluster, and the
            # daemon outlives the command-line process that started it.
            process = subprocess.Popen(
                [spark_class, *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(self.base_dir),
                start_new_session=True,
            )
        except OSError as exc:
            raise ClusterError(f"Cannot start the Spark {name} with {spark_class}: {exc}") from exc
        finally:
            log.close()
        self._popen[process.pid] = process
        self._log_starts[process.pid] = (log_path, log_start)
        if process.poll() is not None:
            raise ClusterError(
                f"The Spark {name} exited at once with code {process.returncode}. "
                f"{self._log_tail()}"
            )
        return process

    # -- state --------------------------------------------------------------------------

    def _save(self) -> None:
        assert self.base_dir is not None and self.master is not None
        state = {
            "master": asdict(self.master),
            "master_port": self.master_port,
            "webui_port": self.webui_port,
            "workers": {str(i): asdict(w) for i, w in self.workers.items()},
            "settings": {
                "workers": self.workers_wanted,
                "cores": self.cores,
                "memory": self.memory,
                "hosts": list(self.hosts),
                "python": self.python,
                "daemon_memory": self.daemon_memory,
                "startup_timeout": self.startup_timeout,
            },
        }
        path = self.base_dir / _STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(path)

    @classmethod
    def attach(cls, base_dir: str | os.PathLike[str]) -> LocalCluster:
        """The cluster described by ``<base_dir>/cluster.json`` (started by another process,
        e.g. ``python -m stateful_async.chaos.cluster start``), with the settings it was
        started with, ``startup_timeout`` included (the default if the file, an older
        version's, does not record it)."""
        path = Path(base_dir) / _STATE_FILE
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ClusterError(
                f"No cluster is recorded in {base_dir} ({path} does not exist). Start one with "
                f"python -m stateful_async.chaos.cluster start --dir {base_dir}."
            ) from exc
        except (OSError, ValueError) as exc:
            raise ClusterError(f"Cannot read the cluster state {path}: {exc}") from exc
        missing: list[str] = []
        malformed: list[str] = []
        _check_state(state, _STATE_SCHEMA, "", missing, malformed)
        if missing or malformed:
            raise ClusterError(_unusable_state_message(path, state, missing, malformed))
        settings = state["settings"]
        recorded = {k: settings[k] for k in ("startup_timeout",) if k in settings}
        try:
            cluster = cls(
                settings["workers"],
                cores=settings["cores"],
                memory=settings["memory"],
                base_dir=base_dir,
                hosts=settings["hosts"],
                python=settings["python"],
                daemon_memory=settings["daemon_memory"],
                stop_at_exit=False,
                **recorded,
            )
        except ClusterError as exc:  # settings edited by hand
            raise ClusterError(
                _unusable_state_message(
                    path, state, [], [], f"its settings are refused ({str(exc).rstrip('.')})"
                )
            ) from exc
        cluster._spark_home = spark_home()
        cluster._claimed = True
        cluster._attached = True
        # the fields checked above alone: one this version does not know (a newer one's)
        # would make the constructors raise TypeError
        cluster.master = ProcessRecord(**{k: state["master"][k] for k in _RECORD_SCHEMA})
        cluster.master_port = state["master_port"]
        cluster.webui_port = state["webui_port"]
        for index, worker in state["workers"].items():
            fields = {k: worker[k] for k in _WORKER_SCHEMA}
            fields["record"] = ProcessRecord(**{k: worker["record"][k] for k in _RECORD_SCHEMA})
            cluster.workers[int(index)] = WorkerInfo(**fields)
        return cluster

    # -- status -------------------------------------------------------------------------

    def master_status(self, timeout: float = 5.0) -> dict[str, Any]:
        """The master's JSON status (``/json/``): workers, applications, cores in use."""
        try:
            with urllib.request.urlopen(self.webui_url + "/json/", timeout=timeout) as response:
                status = dict(json.loads(response.read()))
        except (OSError, ValueError) as exc:
            raise ClusterError(
                f"The Spark master at {self.webui_url} did not answer: {exc}"
            ) from exc
        if status.get("url") != self.master_url:
            raise ClusterError(
                f"{self.webui_url} answers for the master {status.get('url')!r}, not for this "
                f"cluster's {self.master_url}: another process holds the web UI port."
            )
        return status

    def alive_workers(self) -> list[dict[str, Any]]:
        """The workers the master counts alive (its JSON entries), among this cluster's
        running worker daemons (a worker just killed stays alive for the master a moment)."""
        ports = {w.port for w in self.workers.values() if w.record.alive()}
        return [
            w
            for w in self.master_status()["workers"]
            if w["state"] == "ALIVE" and w["port"] in ports
        ]

    def wait_for_workers(self, count: int, timeout: float | None = None) -> None:
        """Wait until ``count`` of this cluster's workers are registered and alive, up to
        ``timeout`` seconds (default: ``startup_timeout``).

        Only running workers count, however the others died (``kill_worker``, the OOM
        killer, a kill from another process): fewer running than ``count`` fails at once,
        naming the dead ones (``start_worker`` brings them back).

        ``count`` is a whole number from 1 to the cluster's number of workers, and
        ``timeout`` (if given) a finite number of seconds above 0: anything else raises
        ``ClusterError`` before anything waits."""
        if timeout is None:
            timeout = self.startup_timeout
        else:
            check_timeout("timeout", timeout, "the time the workers get to register")
        self._require_started()
        whole = not isinstance(count, bool) and isinstance(count, int)
        if not whole or not 1 <= count <= len(self.workers):
            more = whole and count > len(self.workers)
            raise ClusterError(
                f"count must be a whole number from 1 to the cluster's number of workers, "
                f"{len(self.workers)}, the workers to wait for; got {count!r}."
                + (" For more workers, start a cluster with more." if more else "")
            )

        def ready() -> bool:
            self._check_master()
            dead = self._dead_workers()
            running = sorted(set(self.workers) - set(dead))
            if len(running) < count:
                gone = "; ".join(
                    f"worker {i} (pid {self.workers[i].pid}) "
                    + ("is not running" if code is None else f"exited with code {code}")
                    for i, code in sorted(dead.items())
                )
                raise ClusterError(
                    f"Cannot wait for {count} workers: {len(running)} of the cluster's "
                    f"{len(self.workers)} run ({', '.join(map(str, running)) or 'none'}); "
                    f"{gone}. Start {'it' if len(dead) == 1 else 'them'} again with "
                    + ", ".join(f"start_worker({i})" for i in sorted(dead))
                    + "."
                )
            try:
                return len(self.alive_workers()) >= count
            except ClusterError:
                return False  # the master's web UI is not up yet

        try:
            wait_until(ready, timeout, "The Spark workers did not register")
        except TimeoutError as exc:
            raise ClusterError(f"{exc} {self._log_tail()}") from exc

    def _wait_registered(self, indices: Sequence[int], timeout: float) -> None:
        """Wait until the master counts workers ``indices`` alive, each on the port it was
        last launched on. A worker that exits because another process took one of its
        ports is launched again on new ports (up to ``_BIND_ATTEMPTS`` launches)."""
        launches = dict.fromkeys(indices, 1)

        def ready() -> bool:
            for index in indices:
                info = self.workers[index]
                process = self._popen.get(info.pid)
                if process is None or process.poll() is None:
                    continue
                self._popen.pop(info.pid)
                failure = self._bind_failure(info.pid)
                if failure is None or launches[index] == _BIND_ATTEMPTS:
                    raise ClusterError(
                        self._exit_message(f"worker {index}", process, failure, launches[index])
                        + f" {self._log_tail()}"
                    )
                launches[index] += 1
                self._launch_worker(index)
            self._check_master()  # not the other workers: they may have died since, unwaited
            self._dead_workers(besides=indices)  # reaped; their deaths fail nothing here
            try:
                alive = {
                    w["port"] for w in self.master_status()["workers"] if w["state"] == "ALIVE"
                }
            except ClusterError:
                return False  # the master's web UI is not up yet
            return all(self.workers[i].port in alive for i in indices)

        try:
            wait_until(ready, max(timeout, 1.0), "The Spark workers did not register")
        except TimeoutError as exc:
            raise ClusterError(f"{exc} {self._log_tail()}") from exc

    def _bind_failure(self, pid: int) -> str | None:
        """The line of daemon ``pid``'s log that says it could not bind a port, if any."""
        path, start = self._log_starts.get(pid, (None, 0))
        if path is None:
            return None
        with open(path, "rb") as log:
            log.seek(start)
            text = log.read().decode(errors="replace")
        for line in text.splitlines():
            if "java.net.BindException" in line:
                return line.strip()
        return None

    def _exit_message(
        self, name: str, process: subprocess.Popen[bytes], failure: str | None, launches: int
    ) -> str:
        if failure is None:
            return f"The Spark {name} (pid {process.pid}) exited with code {process.returncode}."
        found = re.search(r"starting from (\d+)\)", failure)
        port = f"port {found.group(1)}" if found else "one of its ports"
        return (
            f"The Spark {name} could not bind {port} on 127.0.0.1: another process took it "
            f"after it was found free. Launched {launches} time(s), on new free ports each "
            f"time. The daemon said: {failure}"
        )

    def _check_master(self, subject: str = "The", advice: str = "") -> None:
        """Raise if the master is gone (the workers cannot register without it): "``subject``
        Spark master ... is not running. ``advice`` <the daemons' logs>"."""
        assert self.master is not None
        process = self._popen.get(self.master.pid)
        code = None if process is None else process.poll()
        if code is not None or not self.master.alive():
            raise ClusterError(
                f"{subject} Spark master (pid {self.master.pid}) "
                + ("is not running" if code is None else f"exited with code {code}")
                + f". {advice + ' ' if advice else ''}{self._log_tail()}"
            )

    def _dead_workers(self, besides: Sequence[int] = ()) -> dict[int, int | None]:
        """The workers (other than ``besides``, being started) whose daemon is not running,
        by index, with its exit code where this object launched it (else None: killed by
        another process, the one that launched it gone). Their child entries are reaped
        and dropped: a worker that died after it registered is nobody's start-up failure."""
        dead: dict[int, int | None] = {}
        for index, info in self.workers.items():
            if index in besides or info.record.alive():
                continue
            process = self._popen.pop(info.pid, None)
            if process is not None:
                # Shown a zombie, a killed JVM can take a moment more to be reapable: its
                # threads are still exiting.
                try:
                    self._exit_codes[info.pid] = process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._popen[info.pid] = process  # reaped by a later call, or stop()
                self._log_starts.pop(info.pid, None)
            dead[index] = self._exit_codes.get(info.pid)
        return dead

    def _log_tail(self, lines: int = 15) -> str:
        """The last ``lines`` of the logs of this cluster's daemons, stack frames left out
        (a JVM that dies of an exception ends its log with them, below the line that says
        what it was). A log is appended to by every daemon of its name that a directory
        used again ever ran: for a daemon this object launched, only what was written
        since; for one another process launched (``attach()``), the end of its log."""
        if self.base_dir is None:
            return ""
        logs = self.base_dir / "logs"
        begins: dict[Path, int] = {}
        for path, start in self._log_starts.values():
            begins[path] = min(start, begins.get(path, start))
        for name in ("master", *(f"worker-{i}" for i in self.workers)):
            begins.setdefault(logs / f"{name}.log", 0)
        parts = []
        for path, start in sorted(begins.items()):
            try:
                with open(path, "rb") as log:
                    log.seek(start)
                    text = log.read().decode(errors="replace").splitlines()
            except OSError:  # none written yet
                continue
            text = [line for line in text if not _STACK_FRAME.match(line)][-lines:]
            parts.append(f"--- {path} ---\n" + "\n".join(text))
        return "Daemon logs:\n" + "\n".join(parts)

    def active_apps(self) -> list[str]:
        """Ids of the applications the master is running."""
        return [app["id"] for app in self.master_status().get("activeapps", [])]

    def wait_for_no_active_apps(self, timeout: float = 60.0) -> None:
        """Wait until the master runs no application (e.g. after a driver was killed), up
        to ``timeout`` seconds, a finite number above 0 (anything else raises
        ``ClusterError`` before anything waits)."""
        check_timeout("timeout", timeout, "the time the master gets to end its applications")
        wait_until(
            lambda: not self.active_apps(), timeout, "The Spark master still runs applications"
        )

    def worker_pids(self) -> list[int]:
        """Pids of the worker daemons that are running."""
        return [w.pid for w in self.workers.values() if w.record.alive()]

    def executors(self, app_id: str | None = None) -> list[ExecutorProcess]:
        """Executor JVMs launched by this cluster's workers (of ``app_id``, if given)."""
        found: dict[int, ExecutorProcess] = {}
        for worker in self.workers.values():
            process = worker.record.process()
            if process is None:
                continue
            for child in _tree(process)[1:]:
                executor = self._as_executor(child, worker.index)
                if executor is not None:
                    found[executor.pid] = executor
        for process in self._orphans():
            executor = self._as_executor(process, -1)
            if executor is not None and executor.pid not in found:
                found[executor.pid] = executor
        return [e for e in found.values() if app_id is None or e.app_id == app_id]

    def executor_pids(self, app_id: str | None = None) -> list[int]:
        return [e.pid for e in self.executors(app_id)]

    @staticmethod
    def _as_executor(process: Any, worker: int) -> ExecutorProcess | None:
        import psutil

        try:
            cmdline = process.cmdline()
            if _EXECUTOR_CLASS not in cmdline or process.status() == psutil.STATUS_ZOMBIE:
                return None
            create_time = process.create_time()
        except psutil.Error:
            return None
        return ExecutorProcess(
            process.pid,
            _arg(cmdline, "--app-id"),
            _arg(cmdline, "--executor-id"),
            worker,
            create_time,
        )

    def _orphans(self) -> list[Any]:
        """Executor-side processes (executor JVMs, PySpark daemons and workers) running in
        this cluster's work directory whose worker is gone: a killed worker's children."""
        import psutil

        if self.base_dir is None:
            return []
        work = str((self.base_dir / "work").resolve()) + os.sep
        found = []
        for process in psutil.process_iter(["cmdline", "cwd"]):
            try:
                cwd = process.info["cwd"] or ""
                cmdline = " ".join(process.info["cmdline"] or [])
            except psutil.Error:
                continue
            if (cwd + os.sep).startswith(work) and (
                _EXECUTOR_CLASS in cmdline or "pyspark" in cmdline
            ):
                found.append(process)
        return found

    def app_processes(self, app_id: str) -> list[Any]:
        """Live processes working for application ``app_id``: its executor JVMs and their
        Python workers (everything running in the application's work directories)."""
        import psutil

        if self.base_dir is None:
            return []
        dirs = [str(p.resolve()) + os.sep for p in (self.base_dir / "work").glob(f"*/{app_id}")]
        found = []
        for process in psutil.process_iter(["cwd", "status"]):
            try:
                cwd = (process.info["cwd"] or "") + os.sep
            except psutil.Error:
                continue
            if process.info["status"] != psutil.STATUS_ZOMBIE and any(
                cwd.startswith(d) for d in dirs
            ):
                found.append(process)
        return found

    def executor_log(self, app_id: str) -> str:
        """The stderr of every executor of ``app_id`` (Spark's log and what Python tasks
        print), concatenated."""
        self._require_started()
        assert self.base_dir is not None
        parts = []
        for path in sorted((self.base_dir / "work").glob(f"worker-*/{app_id}/*/stderr")):
            parts.append(f"--- {path} ---\n{path.read_text(errors='replace')}")
        return "\n".join(parts)

    # -- faults -------------------------------------------------------------------------

    def kill_executor(
        self,
        app_id: str | None = None,
        worker: int | None = None,
        timeout: float = 30.0,
    ) -> ExecutorProcess:
        """SIGKILL one executor JVM (of ``app_id`` and on ``worker``, if given) and wait
        until it is gone, up to ``timeout`` seconds (a finite number above 0). Its worker
        stays up (and launches a replacement executor). Only the process listed is killed,
        by pid and start time: one that exited meanwhile raises ``ClusterError``."""
        check_timeout("timeout", timeout, "the time the executor gets to exit after SIGKILL")
        candidates = [
            e
            for e in self.executors(app_id)
            if e.worker >= 0 and (worker is None or e.worker == worker)
        ]
        if not candidates:
            raise ClusterError(
                f"No executor to kill (app {app_id or 'any'}, worker "
                f"{'any' if worker is None else worker}); executors running: {self.executors()}."
            )
        executor = sorted(candidates, key=lambda e: (e.worker, e.pid))[0]
        # The process listed, by its start time too: had it exited since, its pid could
        # name another process by now.
        process = executor.record.process()
        if process is None:
            raise ClusterError(
                f"Executor {executor.executor_id} of {executor.app_id} (pid {executor.pid}, "
                f"worker {executor.worker}) exited before it could be killed; nothing was "
                "killed. See which executors run now (cluster.executors(), or python -m "
                "stateful_async.chaos.cluster status) and kill one of them."
            )
        _kill_all([process])
        if _wait_gone([process], timeout):
            raise ClusterError(f"Executor {executor} survived SIGKILL for {timeout} s.")
        return executor

    def kill_worker(self, index: int, timeout: float = 30.0) -> list[int]:
        """SIGKILL worker ``index`` together with every executor and Python worker it
        launched, as if its machine died, and wait until they are gone, up to ``timeout``
        seconds (a finite number above 0). Returns the pids killed."""
        check_timeout(
            "timeout", timeout, "the time the worker and what it launched get to exit after SIGKILL"
        )
        info = self.workers.get(index)
        process = info.record.process() if info else None
        if info is None or process is None:
            running = sorted(i for i, w in self.workers.items() if w.record.alive())
            raise ClusterError(f"Worker {index} is not running; running workers: {running}.")
        tree = _tree(process)
        killed = _kill_all(tree)
        popen = self._popen.pop(info.pid, None)
        if popen is not None:
            self._exit_codes[info.pid] = popen.wait(timeout)
        survivors = _wait_gone(tree, timeout)
        if survivors:
            raise ClusterError(f"Processes of worker {index} survived SIGKILL: {survivors}.")
        return killed

    # -- stop ---------------------------------------------------------------------------

    def processes(self) -> list[Any]:
        """Every live process this cluster started: daemons, executors, Python workers."""
        import psutil

        found: dict[int, Any] = {}
        daemons = [self.master, *(w.record for w in self.workers.values())]
        for record in daemons:
            process = record.process() if record is not None else None
            if process is not None:
                for p in _tree(process):
                    found[p.pid] = p
        for process in self._orphans():
            for p in _tree(process):
                found[p.pid] = p
        for pid, popen in self._popen.items():  # launched, maybe never recorded (failed start)
            if popen.poll() is None:
                try:
                    found.update((p.pid, p) for p in _tree(psutil.Process(pid)))
                except psutil.Error:
                    pass
        found.pop(os.getpid(), None)
        return list(found.values())

    def stop(
        self,
        timeout: float = 15.0,
        wait: float | None = None,
        on_wait: Callable[[str], None] | None = None,
    ) -> list[int]:
        """Stop every process this cluster started (SIGTERM, then SIGKILL after
        ``timeout`` seconds), by pid; remove the state file (and the directory, if the
        cluster created it). Returns the pids stopped. Safe to call twice.

        A start (``start()``, ``start_worker()``) running in the directory, in any process,
        is waited for first (or another stop), up to ``wait`` seconds (default: until the
        time that start gives up by, by its own ``startup_timeout``, plus ``timeout``; for
        one that does not say, a stop or an older version's start, this object's
        ``startup_timeout`` plus ``timeout``), calling ``on_wait(its pid)`` if it has to;
        a cluster from ``attach()`` then stops what ``cluster.json`` records by then. Still
        running after that: ``ClusterError``, and nothing is stopped.

        ``timeout`` is a finite number of seconds above 0, and ``wait`` (if given) one of 0
        or more: anything else raises ``ClusterError`` before anything is stopped."""
        check_timeout(
            "timeout", timeout, "the time the processes get to exit after SIGTERM, then SIGKILL"
        )
        if wait is not None:
            check_wait("wait", wait)
        if not self._claimed or self.base_dir is None:
            return []  # never started, or stopped already
        if self._lock is not None or not self.base_dir.is_dir():
            # this object's own start failed (it holds the lock); or no directory to lock
            return self._stop_locked(timeout)
        # Without the lock, a stop during a start killed what had started and removed
        # cluster.json, and the start then recorded its cluster again.
        waiting = None if on_wait is None else lambda pid, _doing: on_wait(pid)
        lock = self._lock_stop(wait, timeout, waiting)  # by default, the start's time + ours
        try:
            if self._attached:
                self._reload()
            return self._stop_holding(lock, timeout)
        finally:
            lock.close()

    def _lock_stop(
        self, wait: float | None, margin: float, on_wait: Callable[[str, str], None] | None
    ) -> IO[str]:
        """Take ``cluster.lock`` for a stop once the start (or stop) holding it is done: up
        to ``wait`` seconds, or by default until the time that start gives up by, plus
        ``margin``; for a holder naming none, ``startup_timeout`` plus ``margin``."""
        if wait is None:
            return self._lock_start(self.startup_timeout + margin, on_wait, margin=margin)
        return self._lock_start(wait, on_wait)

    def _stop_holding(self, lock: IO[str], timeout: float = 15.0) -> list[int]:
        """``stop()`` for a caller holding ``cluster.lock`` already (``stop()`` itself; the
        command line, which takes it before ``attach()`` reads what a start recorded): no
        start can begin meanwhile, and no second wait."""
        self._lock = lock
        try:
            return self._stop_locked(timeout)
        finally:
            self._lock = None

    def _reload(self) -> None:
        """Take up what ``cluster.json`` records now: a start that held the directory may
        have recorded more since ``attach()`` (none recorded: keep what was)."""
        assert self.base_dir is not None
        try:
            now = LocalCluster.attach(self.base_dir)
        except ClusterError:
            return
        self.master, self.workers = now.master, now.workers
        self.master_port, self.webui_port = now.master_port, now.webui_port

    def _stop_locked(self, timeout: float) -> list[int]:
        if not self._claimed or self.base_dir is None:
            return []  # stopped meanwhile
        processes = self.processes()
        stopped = _kill_all(processes, signal.SIGTERM)
        survivors = _wait_gone(processes, timeout)
        _kill_all(survivors)
        for popen in self._popen.values():
            try:
                popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self._popen.clear()
        self._log_starts.clear()
        self._exit_codes.clear()
        leftovers = _wait_gone(survivors, timeout)
        if leftovers:
            raise ClusterError(f"Cluster processes survived SIGKILL: {leftovers}.")
        (self.base_dir / _STATE_FILE).unlink(missing_ok=True)
        if self._owns_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)
        self.master = None
        self.workers = {}
        self._claimed = False
        if self._at_exit_registered:
            no_stop_at_exit(self.stop)
            self._at_exit_registered = False
        self._dismiss_watchdog()
        return stopped

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        if self.master is None:
            return "LocalCluster(stopped)"
        return f"LocalCluster({self.master_url}, workers={sorted(self.workers)})"


def _session_processes(driver: ProcessRecord) -> list[Any]:
    """The driver ``driver`` names, if it runs, and every live process of its session: its
    children and, after the driver exited, the orphans it left (re-parented, same session)."""
    import psutil

    found: dict[int, Any] = {}
    process = driver.process()
    if process is not None:
        found.update((p.pid, p) for p in _tree(process))
    else:
        try:
            if abs(psutil.Process(driver.pid).create_time() - driver.create_time) > 0.01:
                return []  # the pid was reused, so the session it named is gone (below)
        except psutil.Error:
            pass  # nothing holds it
    # The session id is the driver's pid. A pid that names a live session is never
    # reused, so a member started after the driver belongs to this driver's session
    # (unless the session emptied and the pid now names another: a process still holds
    # it then, or held it and left orphans, which the watchdog, gone with the session,
    # leaves alone).
    for member in psutil.process_iter(["create_time", "status"]):
        try:
            if (
                os.getsid(member.pid) == driver.pid
                and member.info["create_time"] >= driver.create_time - 0.01
                and member.info["status"] != psutil.STATUS_ZOMBIE
            ):
                found[member.pid] = member
        except (OSError, psutil.Error):
            continue  # exited while we looked
    found.pop(os.getpid(), None)
    return [p for p in found.values() if _running(p)]


class DriverProcess:
    """A Spark driver program in a child process with its own session, e.g.

        driver = DriverProcess([sys.executable, "-m", "stateful_async.chaos.job", ...],
                               log_dir=tmp)
        driver.wait(timeout=300)        # or driver.kill() mid-job

    stdout and stderr go to ``<log_dir>/<name>.out`` / ``.err``. The driver leads its own
    session, so every process it starts (its JVM, the JVM's Python workers) stays in that
    session even once the driver has exited and they were re-parented: ``pids()`` lists
    them all and ``kill()`` SIGKILLs them all, by pid.

    Should the process that started the driver exit before ``kill()`` (or a ``wait()``
    that found nothing of the session left), however it exits (SIGKILL included), a
    watchdog process SIGKILLs the driver and its session all the same; why it could not
    goes to ``<log_dir>/<name>.watchdog.log``. The watchdog leaves once nothing of the
    session runs: the driver's pid, the session's id, may then name another process's.
    """

    def __init__(
        self,
        argv: Sequence[str],
        log_dir: str | os.PathLike[str],
        name: str = "driver",
        env: dict[str, str] | None = None,
    ) -> None:
        if isinstance(argv, (str, bytes)) or not argv:  # a str would run its first letter
            raise ClusterError(
                "DriverProcess's argv is the program and its arguments as a list, like "
                f"[sys.executable, 'job.py', '--rows', '100']; got {argv!r}."
            )
        self.argv = list(argv)
        self.log_dir = Path(log_dir)
        if self.log_dir.exists() and not self.log_dir.is_dir():
            raise ClusterError(
                f"DriverProcess's log_dir {str(self.log_dir)!r} is a file, not a directory: "
                "give a directory (made if missing) for the driver's logs."
            )
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.stdout_path = self.log_dir / f"{name}.out"
        self.stderr_path = self.log_dir / f"{name}.err"
        self.started = time.time()
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.process = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        self._watchdog: subprocess.Popen[str] | None = None
        try:
            self.record = ProcessRecord.of(self.process.pid)
            # Its session would run on, Spark job and JVM included, after a test that
            # died (SIGKILL, a timeout's kill) without kill().
            self._watchdog = _launch_watchdog(
                ["driver", str(self.record.pid), repr(self.record.create_time)],
                self.log_dir / f"{name}.watchdog.log",
            )
        except BaseException:
            self.process.kill()
            self.process.wait()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def running(self) -> bool:
        return self.process.poll() is None

    def wait(self, timeout: float) -> int:
        """Wait for the driver to exit; on timeout, kill it and raise ``TimeoutError``."""
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(
                f"The driver {' '.join(self.argv[:4])} ... did not finish within {timeout} s "
                f"and was killed. Its stderr ends with:\n{self.stderr_tail()}"
            ) from None
        if not self._processes():  # nothing left for the watchdog to kill
            self._dismiss_watchdog()
        return code

    def _processes(self) -> list[Any]:
        """The driver, if it runs, and every live process of its session."""
        return _session_processes(self.record)

    def pids(self) -> list[int]:
        """The driver and every live process it started, including those left running
        after the driver exited."""
        return sorted(p.pid for p in self._processes())

    def kill(self, timeout: float = 30.0) -> list[int]:
        """SIGKILL the driver and every process of its session, by pid (also after the
        driver exited); wait until they are gone. Returns the pids killed."""
        processes = self._processes()
        killed = _kill_all(processes)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass  # reported below with the other survivors
        survivors = _wait_gone(processes, timeout)
        if survivors:
            raise ClusterError(f"Driver processes survived SIGKILL: {survivors}.")
        self._dismiss_watchdog()
        return sorted(killed)

    def _dismiss_watchdog(self) -> None:
        watchdog, self._watchdog = self._watchdog, None
        _dismiss_watchdog(watchdog)

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr_tail(self, lines: int = 40) -> str:
        text = self.stderr_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


__all__ = [
    "ClusterError",
    "DriverProcess",
    "ExecutorProcess",
    "LocalCluster",
    "ProcessRecord",
    "WorkerInfo",
    "free_port",
    "spark_home",
    "wait_until",
]
