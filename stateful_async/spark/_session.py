"""A local SparkSession configured the way this library is tested and demonstrated."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from typing import Any

from .._exceptions import ConfigurationError

#: How a master Spark accepts begins (SparkSubmit refuses any other).
_MASTER_PREFIXES = ("local", "spark", "k8s", "yarn")


def local_session(
    master: str = "local[2,3]",
    app_name: str = "stateful-async",
    conf: Mapping[str, Any] | None = None,
) -> Any:
    """Start (or return) a local ``SparkSession`` for jobs, tests and the demo.

    ``local[N,F]`` runs N task slots and retries a failed task up to F times in all, which
    checkpointed resume needs (plain ``local[N]`` never retries). Python workers use this
    interpreter (so they import this package) and Unix domain sockets; the UI is off,
    everything binds to 127.0.0.1 and the session time zone is UTC.

    If this process already runs a SparkSession, that session is returned as it is: with
    the same ``master``, and with each setting in ``conf`` applied to it, or a
    ``ConfigurationError`` if it runs another master or a setting cannot change while it
    runs (``spark.executorEnv.*`` included: its tasks' environment is fixed as it starts).
    Its other settings (its time zone, for one) are left alone.

    A ``master`` that is no Spark master (one starting ``local``, ``spark``, ``k8s`` or
    ``yarn``, as Spark checks) raises a ``ConfigurationError`` before anything starts.

    Spark Connect sessions are not made here: where one runs, or where ``SPARK_REMOTE``,
    ``spark.remote`` or ``spark.api.mode=connect`` (in ``conf`` or the environment), or
    PySpark's ``SPARK_CONNECT_MODE_ENABLED``, asks for one, this raises a
    ``ConfigurationError`` before starting anything. A classic session already running is
    returned whatever the environment says, but not for a ``conf`` that asks for Connect.
    """
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigurationError(
            "PySpark is not installed: install pyspark==4.2.* (the spark extra: pip install "
            "'.[spark]' in a clone of stateful-async)."
        ) from exc
    if not isinstance(master, str) or not master.startswith(_MASTER_PREFIXES):
        # Spark's launcher would exit with the reason on stderr only, and PySpark raise
        # JAVA_GATEWAY_EXITED
        raise ConfigurationError(
            f"local_session(master={master!r}): that is no Spark master. Locally, pass "
            "'local[N,F]' (N task slots, F attempts per task); a cluster's starts with "
            "spark://, k8s:// or yarn."
        )
    if conf is not None and not isinstance(conf, Mapping):
        hint = " (for a SparkConf: dict(spark_conf.getAll()))" if hasattr(conf, "getAll") else ""
        raise ConfigurationError(
            f"local_session(conf=...) takes a dict of Spark settings, like "
            f"{{'spark.sql.shuffle.partitions': '8'}}; got {type(conf).__name__}{hint}."
        )
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # only loopback, never a public address
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    running = _running_session(SparkSession)
    # PySpark would refuse the master, or start a Connect server; a running classic session
    # is returned whatever the environment says, but not for a conf that asks for Connect
    asking = _connect_asked(conf or {}, os.environ if running is None else {})
    if asking is not None:
        raise _refuse_connect(asking)
    if running is not None:
        return _reuse(running, master, conf or {})
    settings: dict[str, Any] = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.python.unix.domain.socket.enabled": "true",
        "spark.sql.shuffle.partitions": "2",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.sql.session.timeZone": "UTC",
    }
    settings.update(conf or {})
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in settings.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    if is_connect(session):  # the environment asked for Spark Connect
        raise _refuse_connect()
    session.sparkContext.setLogLevel("ERROR")
    return session


def is_connect(session: Any) -> bool:
    """Whether ``session`` is a Spark Connect session (one without a SparkContext)."""
    return type(session).__module__.startswith("pyspark.sql.connect")


def _refuse_connect(asking: str | None = None) -> ConfigurationError:
    """Why ``local_session`` makes no session: one runs on Spark Connect, or ``asking``
    (a setting, as the user gave it) asks for one."""
    if asking is None:
        return ConfigurationError(
            "local_session() makes classic SparkSessions, and this process runs a Spark "
            "Connect session (or SPARK_REMOTE / spark.api.mode asks for one): use that "
            "session itself; ordered_wait, unordered_wait and the delta_rs sink run on it."
        )
    return ConfigurationError(
        f"local_session() makes classic SparkSessions, and {asking} asks for a Spark Connect "
        "session. For that one, use SparkSession.builder.getOrCreate() (ordered_wait, "
        "unordered_wait and the delta_rs sink run on it); for a local classic one, drop "
        "that setting."
    )


def _connect_asked(conf: Mapping[str, Any], environ: Mapping[str, str]) -> str | None:
    """The setting that asks SparkSession.builder for a Spark Connect session (``conf``,
    then the environment ``environ``, as PySpark reads them), or None."""
    if "spark.remote" in conf:
        return f"conf spark.remote={conf['spark.remote']!r}"
    if "SPARK_REMOTE" in environ:
        return f"the environment's SPARK_REMOTE={environ['SPARK_REMOTE']!r}"
    mode = conf.get("spark.api.mode")
    if mode is not None:
        return f"conf spark.api.mode={mode!r}" if str(mode).lower() == "connect" else None
    if environ.get("SPARK_API_MODE", "").lower() == "connect":
        return f"the environment's SPARK_API_MODE={environ['SPARK_API_MODE']!r}"
    if "SPARK_CONNECT_MODE_ENABLED" in environ:  # PySpark's builder goes by it first
        return (
            "the environment's SPARK_CONNECT_MODE_ENABLED (which PySpark sets once this "
            "process has made a Spark Connect session)"
        )
    return None


def _running_session(session_class: Any) -> Any:
    """The SparkSession this process runs (from any thread), or None."""
    session = session_class.getActiveSession() or session_class._instantiatedSession
    if session is not None and is_connect(session):
        raise _refuse_connect()
    if session is None or session.sparkContext._jsc is None:  # stopped
        return None
    return session


def _reuse(session: Any, master: str, conf: Mapping[str, Any]) -> Any:
    running = session.sparkContext.master
    if running.replace(" ", "") != master.replace(" ", ""):  # local[2, 3] is local[2,3]
        raise ConfigurationError(
            f"local_session(master={master!r}): this process already runs a SparkSession "
            f"with master {running!r} (a process runs one SparkContext). Stop it first "
            f"(spark.stop()), or pass master={running!r} to use it as it is."
            + (
                f" Note that {running!r} never retries a failed task, so a checkpointed "
                "task cannot resume within the job: local[N,F] retries it."
                if task_attempts(running, None) == 1  # a cluster's default is 4
                else ""
            )
        )
    for key, value in conf.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)  # as Spark has it
        if key.startswith("spark.executorEnv."):
            # The tasks' environment is fixed as the SparkContext starts; the session's conf
            # would take a new value without complaint, and no task would ever see it.
            if session.sparkContext.getConf().get(key) != text:
                raise _cannot_change(key, value, "its executors' environment is set as it starts")
            continue
        if session.conf.get(key, None) == text:
            continue
        try:
            session.conf.set(key, value)
        except Exception as exc:  # pyspark's AnalysisException: a static or core setting
            raise _cannot_change(key, value, type(exc).__name__) from exc
    return session


def _cannot_change(key: str, value: Any, why: str) -> ConfigurationError:
    return ConfigurationError(
        f"local_session(conf={{{key!r}: {value!r}}}): the SparkSession already running in "
        f"this process cannot change {key!r} while it runs ({why}). Stop it first "
        f"(spark.stop()), or leave {key!r} out."
    )


def task_attempts(master: str, max_failures: str | None) -> int:
    """How many times Spark runs a task before failing its job: ``local[N,F]`` says F,
    ``local`` and ``local[N]`` 1 (they ignore spark.task.maxFailures); a cluster takes
    spark.task.maxFailures (default 4)."""
    local = re.fullmatch(r"local(?:\[\s*([^,\]]*?)\s*(?:,\s*(\d+)\s*)?\])?", master)
    if local is not None:
        return int(local.group(2)) if local.group(2) else 1
    try:
        return int(max_failures) if max_failures is not None else 4
    except ValueError:
        return 4
