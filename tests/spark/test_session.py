"""``local_session`` when a SparkSession already runs, and sessions that never retry a task."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from stateful_async import ConfigurationError
from stateful_async.spark import CheckpointConfig, local_session, ordered_wait
from stateful_async.spark._session import task_attempts


def test_the_running_session_is_returned_with_its_own_settings(spark: Any) -> None:
    zone = spark.conf.get("spark.sql.session.timeZone")
    partitions = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.session.timeZone", "Europe/Paris")
    try:
        again = local_session("local[2,3]", conf={"spark.sql.shuffle.partitions": "5"})
        assert again is spark
        # The same settings in other spellings: a bool, spaces in the master.
        assert local_session("local[2, 3]", conf={"spark.ui.enabled": False}) is spark
        assert spark.conf.get("spark.sql.session.timeZone") == "Europe/Paris"  # not reset
        assert spark.conf.get("spark.sql.shuffle.partitions") == "5"  # asked for: applied
    finally:
        spark.conf.set("spark.sql.session.timeZone", zone)
        spark.conf.set("spark.sql.shuffle.partitions", partitions)


def test_another_master_is_refused_not_ignored(spark: Any) -> None:
    with pytest.raises(ConfigurationError) as caught:
        local_session("local[2]")
    message = str(caught.value)
    assert "already runs a SparkSession with master 'local[2,3]'" in message
    assert "spark.stop()" in message and "master='local[2,3]'" in message
    assert spark.sparkContext.master == "local[2,3]"


@pytest.mark.parametrize("master", ["lcoal[2,3]", "", None])
def test_a_master_that_is_no_spark_master_is_refused(spark: Any, master: Any) -> None:
    """Without a running session, Spark's launcher exited and PySpark raised its
    JAVA_GATEWAY_EXITED, the reason on stderr only; with one, it read as another master."""
    with pytest.raises(ConfigurationError) as caught:
        local_session(master)
    assert str(caught.value) == (
        f"local_session(master={master!r}): that is no Spark master. Locally, pass "
        "'local[N,F]' (N task slots, F attempts per task); a cluster's starts with "
        "spark://, k8s:// or yarn."
    )


def test_a_conf_that_is_no_dict_is_refused(spark: Any) -> None:
    """A SparkConf failed with TypeError: argument of type 'SparkConf' is not iterable; a
    list of pairs with AttributeError: 'list' object has no attribute 'get'."""
    from pyspark import SparkConf

    start = "local_session(conf=...) takes a dict of Spark settings, like "
    example = "{'spark.sql.shuffle.partitions': '8'}"
    with pytest.raises(ConfigurationError) as caught:
        local_session(conf=SparkConf().set("spark.sql.shuffle.partitions", "5"))  # type: ignore[arg-type]
    assert str(caught.value) == (
        f"{start}{example}; got SparkConf (for a SparkConf: dict(spark_conf.getAll()))."
    )
    with pytest.raises(ConfigurationError) as caught:
        local_session(conf=[("spark.sql.shuffle.partitions", "5")])  # type: ignore[arg-type]
    assert str(caught.value) == f"{start}{example}; got list."


def test_a_setting_the_running_session_cannot_change_is_refused(spark: Any) -> None:
    with pytest.raises(ConfigurationError, match="cannot change 'spark.task.maxFailures'"):
        local_session("local[2,3]", conf={"spark.task.maxFailures": "9"})


def test_an_executor_environment_the_running_session_started_without_is_refused(
    spark: Any,
) -> None:
    """Spark's session conf takes any spark.executorEnv.* key without complaint, but the
    tasks' environment was fixed when the SparkContext started: they would never see it."""
    key = "spark.executorEnv.STATEFUL_ASYNC_PROGRESS_SECONDS"
    with pytest.raises(ConfigurationError) as caught:
        local_session("local[2,3]", conf={key: "5"})
    assert str(caught.value) == (
        f"local_session(conf={{{key!r}: '5'}}): the SparkSession already running in this "
        f"process cannot change {key!r} while it runs (its executors' environment is set as "
        f"it starts). Stop it first (spark.stop()), or leave {key!r} out."
    )
    assert spark.conf.get(key, None) is None


@pytest.mark.parametrize(
    ("master", "max_failures", "attempts"),
    [
        ("local", None, 1),
        ("local[2]", "8", 1),  # local[N] ignores spark.task.maxFailures
        ("local[*]", None, 1),
        ("local[2,3]", None, 3),
        ("local[*, 4]", "1", 4),
        ("spark://127.0.0.1:7077", None, 4),
        ("spark://127.0.0.1:7077", "1", 1),
    ],
)
def test_task_attempts_follow_the_master_and_max_failures(
    master: str, max_failures: str | None, attempts: int
) -> None:
    assert task_attempts(master, max_failures) == attempts


def test_checkpoints_on_a_session_that_never_retries_warn_and_otherwise_not(
    spark: Any, tmp_path: Path
) -> None:
    async def f(row: dict) -> list[dict]:
        return [row]

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # local[2,3] retries: no warning
        ordered_wait(spark.range(3), f, "id long", checkpoint=CheckpointConfig(str(tmp_path), "j"))
    # One process runs one SparkContext, so a session without retries runs in a child.
    script = f"""
import warnings
from stateful_async.spark import CheckpointConfig, local_session, ordered_wait
spark = local_session("local[1]")
async def f(row):
    return [row]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ordered_wait(spark.range(3), f, "id long", checkpoint=CheckpointConfig({str(tmp_path)!r}, "j"))
spark.stop()
for w in caught:
    print(w.category.__name__, w.filename.endswith("<string>"), w.message)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("UserWarning")]
    assert len(lines) == 1, done.stdout
    assert lines[0].startswith("UserWarning True This SparkSession (master 'local[1]') runs each")
    assert "restore_from='latest'" in lines[0] and "local[N,F]" in lines[0]


def test_a_conf_asking_for_connect_is_refused_with_a_classic_session_running(
    spark: Any,
) -> None:
    """Spark's session conf takes spark.remote without complaint: the classic session came
    back, as if the Connect server asked for had been reached."""
    with pytest.raises(ConfigurationError) as caught:
        local_session("local[2,3]", conf={"spark.remote": "sc://127.0.0.1:9"})
    assert str(caught.value).startswith(
        "local_session() makes classic SparkSessions, and conf spark.remote='sc://127.0.0.1:9' "
        "asks for a Spark Connect session."
    )
    assert spark.conf.get("spark.remote", None) is None


def test_a_connect_session_asked_for_is_refused_before_anything_starts() -> None:
    # With SPARK_REMOTE set, PySpark refused the master local_session gives, with its own
    # PySparkRuntimeError (CANNOT_CONFIGURE_SPARK_CONNECT_MASTER); with spark.api.mode=connect
    # it started a local Spark Connect server first; with SPARK_CONNECT_MODE_ENABLED (PySpark's
    # mark of a Connect session made before) it failed with CONNECT_URL_NOT_SET. A child
    # process: this one runs the tests' classic session, which local_session returns
    # whatever the environment says.
    script = """
import os
from pyspark import SparkContext
from stateful_async.spark import local_session
cases = [
    ({"SPARK_REMOTE": "sc://127.0.0.1:9"}, None),
    ({}, {"spark.remote": "sc://127.0.0.1:9"}),
    ({"SPARK_API_MODE": "Connect"}, None),
    ({}, {"spark.api.mode": "connect"}),
    ({"SPARK_API_MODE": "connect"}, {"spark.api.mode": "classic", "spark.remote": "sc://h"}),
    ({"SPARK_CONNECT_MODE_ENABLED": "1"}, None),
]
for env, conf in cases:
    os.environ.update(env)
    try:
        local_session(conf=conf)
        print("made a session")
    except Exception as exc:
        print(type(exc).__name__, exc)
    for name in env:
        del os.environ[name]
print("jvm", SparkContext._gateway is not None)
"""
    asking = ("SPARK_REMOTE", "SPARK_API_MODE", "SPARK_CONNECT_MODE_ENABLED")
    env = {k: v for k, v in os.environ.items() if k not in asking}
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    advice = (
        "asks for a Spark Connect session. For that one, use SparkSession.builder.getOrCreate() "
        "(ordered_wait, unordered_wait and the delta_rs sink run on it); for a local classic "
        "one, drop that setting."
    )
    start = "ConfigurationError local_session() makes classic SparkSessions, and "
    assert lines == [
        f"{start}the environment's SPARK_REMOTE='sc://127.0.0.1:9' {advice}",
        f"{start}conf spark.remote='sc://127.0.0.1:9' {advice}",
        f"{start}the environment's SPARK_API_MODE='Connect' {advice}",
        f"{start}conf spark.api.mode='connect' {advice}",
        f"{start}conf spark.remote='sc://h' {advice}",
        f"{start}the environment's SPARK_CONNECT_MODE_ENABLED (which PySpark sets once this "
        f"process has made a Spark Connect session) {advice}",
        "jvm False",  # no Spark started
    ], done.stdout
