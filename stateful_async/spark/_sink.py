"""An exactly-once Delta sink for Spark that needs no Delta JVM jars: format ``delta_rs``.

Spark's Python Data Source API runs the write; ``deltalake`` (delta-rs) commits it::

    from stateful_async.spark import register_delta_sink, clean_orphan_files

    register_delta_sink(spark)                    # once per SparkSession
    df.write.format("delta_rs").mode("append").save("/data/enriched")
    (stream.writeStream.format("delta_rs")
        .option("checkpointLocation", "/chk/enriched")
        .start("/data/enriched"))
    clean_orphan_files("/data/enriched")          # maintenance, e.g. daily

How it works: every task writes its rows as Parquet files under the table directory and
returns their exact Delta statistics (``numRecords``, min/max, null counts); Spark then
calls ``commit`` once, which adds all the files in ONE Delta transaction. A streaming
commit carries the app transaction (app id = ``txnAppId`` or the streaming query id, which
is stable across restarts from the same checkpoint; version = the micro-batch id); a batch
id at or below the version the table already holds is refused without adding anything, so
a replayed batch never duplicates rows. Files of failed task attempts are never committed;
they stay on disk as orphans until ``clean_orphan_files`` (or ``cleanOrphans``) removes them.

Options (names are case-insensitive):

==========================  ===================================================================
``path``                    the table: an absolute local path or a URI (``s3://``,
                            ``abfss://``, ``gs://``, ``file://``). Given by ``save``/``start``.
``partitionBy``             comma-separated partition columns (top-level; string, integer,
                            boolean or date) for a new table; must match an existing table's
                            partitioning if given, which is followed if not.
                            (``DataFrameWriter.partitionBy`` does not reach Python sinks:
                            Spark refuses it in batch writes, ignores it in streaming.)
``mergeSchema``             ``true``: new columns in the data are added to the table.
                            Default ``false``: any difference in columns or types fails with
                            ``SinkSchemaMismatchError``.
``txnAppId`` (``appId``)    app transaction id. Streaming: defaults to the query id; set it
                            only if batch ids continue across the checkpoints it is used
                            with. Batch: with ``txnVersion``, makes the write idempotent.
``txnVersion``              batch writes only: the version recorded with ``txnAppId`` (0 to
                            2**63 - 1); a write whose version is at or below the recorded
                            one is skipped.
``cleanOrphans``            ``true``: after each commit, remove orphan files older than
                            ``orphanRetentionSeconds``. Default ``false``.
``orphanRetentionSeconds``  grace period of ``cleanOrphans`` (default 3600).
``maxRecordsPerFile``       roll over to a new file after this many rows (default 0: one
                            file per task and partition value).
``compression``             Parquet codec: ``snappy`` (default), ``zstd``, ``gzip``, ``lz4``,
                            ``brotli``, ``none``.
``maxCommitRetries``        delta-rs commit retries against concurrent writers (default 100,
                            at most 2**63 - 1).
``storage.<key>``           passed to delta-rs's object store, e.g.
                            ``storage.AWS_REGION``; keys reach it lower-cased.
==========================  ===================================================================

Save modes: ``append`` and ``overwrite`` (Spark refuses the others for Python sinks).
Streaming: ``append`` output mode adds each micro-batch; ``complete`` replaces the table's
content with each micro-batch, in the same single transaction.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from .._exceptions import ConfigurationError, DeltaSinkError, as_float
from ._sink_commit import find_orphans, load_table
from ._sink_files import TableStorage
from ._sink_options import SinkOptions

FORMAT_NAME = "delta_rs"

__all__ = ["FORMAT_NAME", "clean_orphan_files", "register_delta_sink"]


def register_delta_sink(spark: Any) -> None:
    """Register the ``delta_rs`` data source with ``spark`` (a ``SparkSession``).

    After this, ``df.write.format("delta_rs")`` and ``df.writeStream.format("delta_rs")``
    write Delta tables with delta-rs. Executors and the commit worker import this package,
    so it must be installed on them (or shipped with ``--py-files``).

    Spark finds a Python data source through the active session of the calling thread, and
    a thread other than the one that created the session has none: its write fails with
    ``DATA_SOURCE_NOT_FOUND``. Call ``register_delta_sink(spark)`` in each thread that
    writes; it makes ``spark`` that thread's active session too.
    """
    try:
        from ._sink_source import DeltaRsDataSource
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigurationError(
            "The delta_rs sink needs PySpark 4.1 or later with the Python Data Source API: "
            f"{exc}. Install pyspark==4.2.* (the spark extra: pip install '.[spark]' in a "
            "clone of stateful-async)."
        ) from exc
    if not hasattr(spark, "dataSource"):
        raise ConfigurationError(
            f"register_delta_sink needs a SparkSession (PySpark 4.1 or later); got "
            f"{type(spark).__name__}."
        )
    spark.dataSource.register(DeltaRsDataSource)
    jvm, session = getattr(spark, "_jvm", None), getattr(spark, "_jsparkSession", None)
    if jvm is not None and session is not None:  # classic PySpark (not Spark Connect)
        jvm.org.apache.spark.sql.SparkSession.setActiveSession(session)


def clean_orphan_files(
    path: str,
    *,
    older_than: timedelta | float = timedelta(hours=1),
    dry_run: bool = False,
    storage_options: dict[str, str] | None = None,
) -> list[str]:
    """Delete Parquet files under the table that no Delta version refers to.

    Such orphans are left by task attempts that failed or were superseded after writing
    their file, and by jobs killed before their commit. A file counts as referenced if any
    add or remove action of the retained log (commits and checkpoints) names it, so time
    travel to any retained version keeps working; only ``*.parquet`` files outside hidden
    directories (``_delta_log``, ``_*``, ``.*``) are considered.

    ``older_than`` (a timedelta or seconds) is the grace period: a file modified more
    recently is kept, because a running write may not have committed it yet. Keep it longer
    than your slowest write (task start to commit). ``dry_run=True`` deletes nothing.
    Returns the orphans' paths, relative to the table root, sorted.
    """
    seconds = (
        older_than.total_seconds() if isinstance(older_than, timedelta) else as_float(older_than)
    )
    if seconds is None or not 0 <= seconds:
        raise ConfigurationError(
            f"older_than must be a timedelta or a number of seconds, not negative; got "
            f"{older_than!r}. It is the grace period during which fresh, not yet committed "
            "files are kept."
        )
    table_uri = SinkOptions.parse({"path": path}, streaming=False).table_uri
    storage_options = dict(storage_options or {})
    if load_table(table_uri, storage_options) is None:
        raise DeltaSinkError(
            f"There is no Delta table at {table_uri}, so no file there can be told to be "
            "an orphan; nothing was deleted. Check the path."
        )
    storage = TableStorage(table_uri, storage_options)
    try:
        orphans = find_orphans(storage, seconds)
        if not dry_run:
            for rel in orphans:
                storage.delete(rel)
    except OSError as exc:
        raise DeltaSinkError(
            f"Cleaning orphan files of the Delta table at {table_uri} failed: {exc}. Files "
            "already deleted were orphans; re-run the call once the storage is reachable."
        ) from exc
    return orphans
