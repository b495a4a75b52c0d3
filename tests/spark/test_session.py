"""``local_session`` when this process already runs a SparkSession (the shared one)."""

from __future__ import annotations

from typing import Any

import pytest

from stateful_async import ConfigurationError
from stateful_async.spark import local_session


def test_the_running_session_is_returned_with_its_own_settings(spark: Any) -> None:
    zone = spark.conf.get("spark.sql.session.timeZone")
    partitions = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.session.timeZone", "Europe/Paris")
    try:
        again = local_session("local[2,3]", conf={"spark.sql.shuffle.partitions": "5"})
        assert again is spark
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


def test_a_setting_the_running_session_cannot_change_is_refused(spark: Any) -> None:
    with pytest.raises(ConfigurationError, match="cannot change 'spark.task.maxFailures'"):
        local_session("local[2,3]", conf={"spark.task.maxFailures": "9"})
