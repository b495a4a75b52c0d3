"""A local SparkSession configured the way this library is tested and demonstrated."""

from __future__ import annotations

import os
import sys
from typing import Any

from .._exceptions import ConfigurationError


def local_session(
    master: str = "local[2,3]",
    app_name: str = "stateful-async",
    conf: dict[str, Any] | None = None,
) -> Any:
    """Start (or return) a local ``SparkSession`` for jobs, tests and the demo.

    ``local[N,F]`` runs N task slots and retries a failed task up to F times in all, which
    checkpointed resume needs (plain ``local[N]`` never retries). Python workers use this
    interpreter (so they import this package) and Unix domain sockets; the UI is off and
    everything binds to 127.0.0.1.
    """
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigurationError(
            "PySpark is not installed: pip install 'stateful-async[spark]'."
        ) from exc
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # only loopback, never a public address
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
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
    session.sparkContext.setLogLevel("ERROR")
    return session
