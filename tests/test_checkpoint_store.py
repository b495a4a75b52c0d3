"""The Delta snapshot store on real Delta tables in tmp_path: round trips, idempotence,
errors, retention, restore into an operator."""

from __future__ import annotations

import datetime as dt
import decimal
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from checkpoint import (
    CheckpointConflictError,
    CheckpointError,
    CheckpointLocationError,
    CheckpointNotFoundError,
    CheckpointRef,
    CorruptCheckpointError,
    InputFingerprint,
    SchemaChangedError,
    SnapshotStore,
    UnsupportedTypeError,
    delta_dataset,
)
from stateful_async import (
    AsyncWaitOperator,
    ConfigurationError,
    OutputMode,
    StreamRecord,
    Watermark,
)
from stateful_async.testing import ControlledFunction, settle

UTC = dt.timezone.utc

# The Spark SQL types users have in DataFrames, as Spark hands them to Arrow.
SPARK_TYPES = pa.schema(
    [
        ("byte", pa.int8()),
        ("short", pa.int16()),
        ("int", pa.int32()),
        ("long", pa.int64()),
        ("float", pa.float32()),
        ("double", pa.float64()),
        ("decimal", pa.decimal128(38, 10)),
        ("string", pa.string()),
        ("binary", pa.binary()),
        ("boolean", pa.bool_()),
        ("date", pa.date32()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
        ("timestamp_ntz", pa.timestamp("us")),
        ("array", pa.list_(pa.int64())),
        ("array_of_structs", pa.list_(pa.struct([("k", pa.string()), ("v", pa.float64())]))),
        ("map", pa.map_(pa.string(), pa.int32())),
        (
            "struct",
            pa.struct([("a", pa.int64()), ("b", pa.struct([("c", pa.list_(pa.string()))]))]),
        ),
    ]
)


def spark_row(i: int) -> dict:
    return {
        "byte": -(i % 128),
        "short": 30000 - i,
        "int": 2**31 - 1 - i,
        "long": 2**63 - 1 - i,
        "float": 1.5 * i,
        "double": -1e300 / (i + 1),
        "decimal": decimal.Decimal("12345678901234567890.0123456789") + i,
        "string": f"ünïcødé {i} \x00 end",
        "binary": bytes([i % 256, 0, 255]),
        "boolean": i % 2 == 0,
        "date": dt.date(1970, 1, 1) + dt.timedelta(days=i * 1000),
        "timestamp": dt.datetime(2024, 2, 29, 23, 59, 59, 999999, tzinfo=UTC),
        "timestamp_ntz": dt.datetime(1900, 1, 1, 0, 0, 0, i),
        "array": [i, None, -i],
        "array_of_structs": [{"k": "x", "v": 0.25}, {"k": None, "v": None}],
        "map": [("a", i), ("b", None)],
        "struct": {"a": i, "b": {"c": ["p", None]}},
    }


def null_row(schema: pa.Schema) -> dict:
    return {name: None for name in schema.names}


OUT = pa.schema([("id", pa.int64()), ("label", pa.string())])


def test_round_trip_over_spark_types_records_and_watermarks_in_order(tmp_path: Path) -> None:
    log = SnapshotStore(tmp_path).subtask("job", "enrich", 3)
    elements = [
        StreamRecord(spark_row(1), timestamp=100),
        Watermark(150),
        StreamRecord(null_row(SPARK_TYPES), timestamp=None),
        StreamRecord(spark_row(2), timestamp=200),
        Watermark(250),
    ]
    results = [{"id": 1, "label": "one"}, {"id": 2, "label": None}]
    log.commit(
        "run",
        1,
        elements,
        results,
        input_schema=SPARK_TYPES,
        output_schema=OUT,
        position=4,
        fingerprint="4:abc",
        input_seqs=[7, None, 8, 9, None],
        result_timestamps=[100, None],
    )
    snapshot = SnapshotStore(tmp_path).load("job", "enrich", 3, 1)
    # Maps come back as lists of pairs from Arrow; compare through Arrow for exactness.
    assert [type(e) for e in snapshot.elements] == [type(e) for e in elements]
    assert snapshot.elements[1] == Watermark(150) and snapshot.elements[4] == Watermark(250)
    for got, want in zip(snapshot.elements, elements, strict=True):
        if isinstance(want, StreamRecord):
            assert got.timestamp == want.timestamp
            assert pa.array([got.value], pa.struct(list(SPARK_TYPES))) == pa.array(
                [want.value], pa.struct(list(SPARK_TYPES))
            )
    assert snapshot.input_seqs == [7, None, 8, 9, None]
    assert snapshot.results.to_pylist() == results
    assert snapshot.result_timestamps == [100, None]
    meta = snapshot.metadata
    assert (meta.position, meta.fingerprint, meta.in_flight, meta.result_count) == (
        4,
        "4:abc",
        5,
        2,
    )


ARROW_ONLY_TYPES = pa.schema(
    [
        ("u8", pa.uint8()),
        ("u16", pa.uint16()),
        ("u32", pa.uint32()),
        ("u64", pa.uint64()),
        ("f16", pa.float16()),
        ("ts_ns", pa.timestamp("ns", tz="Europe/Paris")),
        ("ts_ms", pa.timestamp("ms")),
        ("t64", pa.time64("ns")),
        ("t32", pa.time32("ms")),
        ("dur", pa.duration("ns")),
        ("dict", pa.dictionary(pa.int8(), pa.string())),
        ("large", pa.large_string()),
        ("fixed", pa.binary(3)),
        ("nested", pa.struct([("u", pa.uint64()), ("l", pa.list_(pa.uint32()))])),
        ("map_u", pa.map_(pa.string(), pa.uint64())),
        ("dec256", pa.decimal256(38, 4)),  # delta-rs refused the table: "Decimal256"
    ]
)


def test_types_delta_cannot_hold_round_trip_exactly(tmp_path: Path) -> None:
    import numpy as np

    extremes = {
        "u8": 255,
        "u16": 65535,
        "u32": 2**32 - 1,  # delta-rs alone would store this as int32 and wrap it
        "u64": 2**64 - 1,
        "f16": np.float16(0.0999755859375),
        "ts_ns": pa.scalar(
            1_700_000_000_123_456_789, pa.timestamp("ns", tz="Europe/Paris")
        ).as_py(),
        "ts_ms": dt.datetime(2020, 1, 1, 0, 0, 0, 123000),
        "t64": pa.scalar(86_399_999_999_999, pa.time64("ns")).as_py(),
        "t32": dt.time(23, 59, 59, 999000),
        "dur": pa.scalar(123_456_789, pa.duration("ns")).as_py(),
        "dict": "blue",
        "large": "x" * 1000,
        "fixed": b"abc",
        "nested": {"u": 2**64 - 1, "l": [2**32 - 1, 0]},
        "map_u": [("k", 2**64 - 1)],
        "dec256": decimal.Decimal("-" + "9" * 34 + ".9999"),
    }
    original = pa.Table.from_pylist([extremes, null_row(ARROW_ONLY_TYPES)], schema=ARROW_ONLY_TYPES)
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    log.commit(
        "run",
        1,
        [StreamRecord(row) for row in original.to_pylist()],
        original,  # results too: the output schema can have these types as well
        input_schema=ARROW_ONLY_TYPES,
        output_schema=ARROW_ONLY_TYPES,
        position=2,
    )
    snapshot = log.load(1)
    restored_inputs = pa.Table.from_pylist(
        [e.value for e in snapshot.elements], schema=ARROW_ONLY_TYPES
    )
    assert restored_inputs.equals(original)
    assert snapshot.results.schema.equals(ARROW_ONLY_TYPES)
    assert snapshot.results.equals(original)
    # The nanoseconds survived (the sub-microsecond part is what delta-rs would truncate).
    assert snapshot.results.column("ts_ns").cast(pa.int64())[0].as_py() == 1_700_000_000_123_456_789


# Spark gives a map's struct keys NOT NULL fields (map(named_struct('p', 1), id)); their
# stored form has nullable ones, as uint8 keys are stored as int16.
KEYS_STORED_OTHERWISE = pa.schema(
    [
        ("id", pa.int64()),
        ("sk", pa.map_(pa.struct([pa.field("p", pa.int32(), nullable=False)]), pa.int64())),
        ("u8", pa.map_(pa.uint8(), pa.string())),
        ("inner", pa.struct([("m", pa.map_(pa.uint8(), pa.int64()))])),
        (
            "lists",
            pa.list_(pa.map_(pa.struct([pa.field("q", pa.string(), nullable=False)]), pa.int8())),
        ),
    ]
)


def test_maps_whose_keys_are_stored_as_another_type_round_trip(tmp_path: Path) -> None:
    # pyarrow < 26 (25 is the newest for Python 3.10) casts such a map into an array that
    # concatenates into an invalid one: every commit failed with ArrowInvalid "Map array
    # keys array should have no nulls", so a Spark task over such a column failed on each
    # attempt.
    rows = [
        {
            "id": i,
            "sk": [({"p": i}, -i), ({"p": i + 1}, i)],
            "u8": [(i, str(i))] if i % 2 else [],
            "inner": {"m": [(255, i)]},
            "lists": [[({"q": "a"}, 1)], None, []],
        }
        for i in range(3)
    ] + [null_row(KEYS_STORED_OTHERWISE)]
    original = pa.Table.from_pylist(rows, schema=KEYS_STORED_OTHERWISE)
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    for checkpoint_id in (1, 2):
        log.commit(
            "run",
            checkpoint_id,
            [StreamRecord(row) for row in rows] + [Watermark(5)],
            original,
            input_schema=KEYS_STORED_OTHERWISE,
            output_schema=KEYS_STORED_OTHERWISE,
            position=4 * checkpoint_id,
        )
    snapshot = log.load(2)
    restored_inputs = pa.Table.from_pylist(
        [e.value for e in snapshot.elements[:-1]], schema=KEYS_STORED_OTHERWISE
    )
    assert restored_inputs.equals(original)
    assert snapshot.elements[-1] == Watermark(5)
    assert snapshot.results.equals(original)


# The same maps under a large and a fixed-size list, which the checkpoint takes as well.
MAPS_UNDER_OTHER_LISTS = pa.schema(
    [
        ("id", pa.int64()),
        ("large", pa.large_list(KEYS_STORED_OTHERWISE.field("sk").type)),
        ("fixed", pa.list_(KEYS_STORED_OTHERWISE.field("u8").type, 2)),
    ]
)


def test_maps_stored_as_another_type_under_large_and_fixed_size_lists_round_trip(
    tmp_path: Path,
) -> None:
    # Before, such lists were still cast whole, and under pyarrow < 26 (25 is the newest for
    # Python 3.10) every commit failed with ArrowInvalid "Map array keys array should have
    # no nulls", as it did for the maps above.
    rows = [
        {"id": 0, "large": [[({"p": 0}, 1)], None, []], "fixed": [[(255, "x")], None]},
        {"id": 1, "large": [], "fixed": None},
        {"id": 2, "large": None, "fixed": [[], [(0, None), (1, "y")]]},
    ]
    original = pa.Table.from_pylist(rows, schema=MAPS_UNDER_OTHER_LISTS)
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    log.commit(
        "run",
        1,
        [StreamRecord(row) for row in rows] + [Watermark(5)],
        original.slice(1),  # sliced, as results may be
        input_schema=MAPS_UNDER_OTHER_LISTS,
        output_schema=MAPS_UNDER_OTHER_LISTS,
        position=4,
    )
    snapshot = log.load(1)
    restored_inputs = pa.Table.from_pylist(
        [e.value for e in snapshot.elements[:-1]], schema=MAPS_UNDER_OTHER_LISTS
    )
    assert restored_inputs.equals(original)
    assert snapshot.results.equals(original.slice(1))


def test_storage_conversion_takes_chunked_arrays_both_ways() -> None:
    # Before, to_storage() failed on a ChunkedArray ("no attribute 'offset'") where
    # from_storage() took one.
    from checkpoint._types import from_storage, storage_type, to_storage

    rows = [
        {"id": 0, "large": [[({"p": 0}, 1)], None, []], "fixed": [[(255, "x")], None]},
        {"id": 1, "large": [], "fixed": None},
        {"id": 2, "large": None, "fixed": [[], [(0, None), (1, "y")]]},
    ]
    table = pa.Table.from_batches(
        [pa.RecordBatch.from_pylist([row], schema=MAPS_UNDER_OTHER_LISTS) for row in rows]
    )
    for field in MAPS_UNDER_OTHER_LISTS:
        column = table.column(field.name)
        assert column.num_chunks == 3
        stored = to_storage(column, field.type)
        assert stored.type == storage_type(field.type)
        assert stored.num_chunks == 3
        assert from_storage(stored, field.type).equals(column)


@pytest.mark.parametrize(
    ("gap_type", "message"),
    [
        (pa.month_day_nano_interval(), "has type month_day_nano_interval"),
        # before: committed, then never loadable ("Cannot convert values of type list<...>")
        (pa.list_view(pa.int32()), "which a checkpoint cannot restore as it was"),
        (pa.run_end_encoded(pa.int32(), pa.string()), "Cast it to a plain list"),
        (pa.decimal256(40, 2), "holds decimals of at most 38 digits"),
    ],
)
def test_types_without_a_lossless_form_are_refused_with_the_column_name(
    tmp_path: Path, gap_type: pa.DataType, message: str
) -> None:
    schema = pa.schema([("id", pa.int64()), ("gap", gap_type)])
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    with pytest.raises(UnsupportedTypeError, match="Column 'input.gap' has type") as info:
        log.commit("run", 1, [], None, input_schema=schema, output_schema=OUT, position=0)
    assert message in str(info.value)
    assert not log.exists()


def test_field_names_differing_only_in_case_are_refused_naming_both(tmp_path: Path) -> None:
    # Delta's column names are case-insensitive: delta-rs fails with "Duplicate field name".
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    nested = pa.struct([("Key", pa.int64()), ("key", pa.int64())])
    cases = [
        (
            pa.schema([("id", pa.int64()), ("ID", pa.int64())]),
            OUT,
            "'input' has fields 'id' and 'ID'",
        ),
        (
            pa.schema([("id", pa.int64()), ("s", nested)]),
            OUT,
            "'input.s' has fields 'Key' and 'key'",
        ),
        (
            pa.schema([("id", pa.int64())]),
            pa.schema([("a", pa.int8()), ("A", pa.int8())]),
            "'result' has fields 'a' and 'A'",
        ),
        # exact duplicates (a Spark join can make them), and a struct Parquet cannot hold
        (
            pa.schema([("id", pa.int64()), ("s", pa.struct([("a", pa.int8()), ("a", pa.int8())]))]),
            OUT,
            "'input.s' has two fields named 'a'",
        ),
        (  # beside a case twin met first: named as given twice, not as the case pair
            pa.schema([("id", pa.int64())]),
            pa.schema([("A", pa.int8()), ("a", pa.int8()), ("a", pa.int8())]),
            "'result' has two fields named 'a'",
        ),
        (
            pa.schema([("id", pa.int64()), ("e", pa.struct([]))]),
            OUT,
            "'input.e' is a struct with no fields",
        ),
    ]
    for input_schema, output_schema, problem in cases:
        with pytest.raises(UnsupportedTypeError, match=problem):
            log.commit(
                "run",
                1,
                [],
                None,
                input_schema=input_schema,
                output_schema=output_schema,
                position=0,
            )
    assert not log.exists()


def test_a_foreign_delta_table_in_the_layout_is_named_not_read(tmp_path: Path) -> None:
    write_deltalake(str(tmp_path / "job" / "op" / "subtask=00000"), pa.table({"a": [1, 2]}))
    store = SnapshotStore(tmp_path)
    log = store.subtask("job", "op", 0)
    for read in (log.checkpoints, log.latest, lambda: store.checkpoints("job", "op")):
        with pytest.raises(
            CorruptCheckpointError, match="is a Delta table but not a stateful-async checkpoint"
        ):
            read()  # before: Arrow's "No match for FieldRef.Name(kind) in a: int64"


def test_null_structs_over_not_null_fields_are_restored(tmp_path: Path) -> None:
    # A watermark row's input is a null struct over the input's fields; a null struct column
    # may declare NOT NULL fields. Arrow's cast refuses both, even though nothing is wrong.
    struct = pa.struct([pa.field("a", pa.int64(), nullable=False, metadata={"k": "v"})])
    schema = pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False, metadata={"doc": "the id"}),
            pa.field("s", struct),
            pa.field("items", pa.list_(pa.field("item", struct))),
            pa.field("big", pa.large_list(pa.field("item", struct))),
            pa.field("fixed", pa.list_(pa.field("item", struct), 1)),
            pa.field("by_key", pa.map_(pa.string(), pa.field("value", struct))),
        ]
    )
    empty = {"big": None, "fixed": None, "by_key": None}
    nulls = {"big": [None], "fixed": [None], "by_key": [("k", None)]}
    records = [
        StreamRecord({"id": 1, "s": None, "items": [None, {"a": 1}], **nulls}, 10),
        Watermark(9),
        StreamRecord({"id": 2, "s": {"a": 5}, "items": None, **empty}, 11),
    ]
    results = [
        {"id": 1, "s": None, "items": [None], **nulls},
        {"id": 2, "s": {"a": 5}, "items": [{"a": 2}], **empty},
    ]
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    meta = log.commit(
        "run", 1, records, results, input_schema=schema, output_schema=schema, position=2
    )
    snapshot = log.load(1, "run")
    assert snapshot.elements == records
    assert snapshot.results.schema.equals(schema, check_metadata=True)  # field metadata too
    assert snapshot.results.to_pylist() == results
    assert [t.to_pylist() for t, _ in log.chain_results(meta)] == [results]


def test_a_record_that_does_not_fit_the_input_schema_is_refused(tmp_path: Path) -> None:
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    schema = pa.schema([("n", pa.int8())])
    with pytest.raises(UnsupportedTypeError, match="does not fit the input schema"):
        log.commit(
            "run",
            1,
            [StreamRecord({"n": 1000})],
            None,
            input_schema=schema,
            output_schema=OUT,
            position=1,
        )


def test_the_table_is_readable_by_other_delta_readers(tmp_path: Path) -> None:
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    log.commit(
        "run",
        1,
        [StreamRecord({"id": 5, "label": "x"}), Watermark(9)],
        [{"id": 1, "label": "a"}],
        input_schema=OUT,
        output_schema=OUT,
        position=2,
    )
    path = log.uri
    rows = pl.read_delta(path).filter(pl.col("kind") == "record")
    assert rows["input"].to_list() == [{"id": 5, "label": "x"}]
    # DuckDB's delta extension downloads from the internet (unreachable here): DuckDB reads
    # the Parquet files the Delta log lists as the current version instead.
    files = DeltaTable(path).file_uris()
    counts = duckdb.sql(
        f"SELECT kind, count(*) FROM read_parquet({files!r}) GROUP BY kind ORDER BY kind"
    ).fetchall()
    assert counts == [("checkpoint", 1), ("record", 1), ("result", 1), ("watermark", 1)]
    table = delta_dataset(DeltaTable(path)).to_table()
    assert table.num_rows == 4
    assert set(table.column("job_id").to_pylist()) == {"job"}


# -- ids, zombies, errors ------------------------------------------------------------------


def commit(
    log, run: str, ckpt: int, n: int = 1, parent: CheckpointRef | None = None, position: int = 0
):
    return log.commit(
        run,
        ckpt,
        [StreamRecord({"id": i, "label": str(i)}) for i in range(n)],
        [{"id": ckpt, "label": f"result of {ckpt}"}],
        input_schema=OUT,
        output_schema=OUT,
        position=position,
        parent=parent,
    )


def commit_chain(
    log,
    run: str,
    ids: range | tuple[int, ...],
    n: int = 1,
    parent: CheckpointRef | None = None,
    position_step: int = 0,
) -> CheckpointRef | None:
    """Commits checkpoints ``ids`` of ``run``, each following the one before it (the first
    following ``parent``), checkpoint i at input position i * position_step; the last's ref."""
    for ckpt in ids:
        parent = commit(log, run, ckpt, n=n, parent=parent, position=ckpt * position_step).ref
    return parent


def test_a_checkpoint_table_drops_its_delta_log_after_an_hour_not_thirty_days(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A streaming query commits to every partition's table in every micro-batch, and every
    # commit file slows down the next commits: with Delta's default 30 days of log, a query
    # a minute left ~43,000 log files per partition. The store's tables keep one hour (here:
    # 1 s, and a log checkpoint every 5 commits, so that the test need not wait an hour or
    # make 100 commits).
    import checkpoint._store as store_module

    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    commit(log, "run", 1)
    config = DeltaTable(log.uri).metadata().configuration
    assert config["delta.logRetentionDuration"] == "interval 1 hour"
    assert config["delta.enableExpiredLogCleanup"] == "true"

    short = {**store_module._TABLE_CONFIGURATION, "delta.logRetentionDuration": "interval 1 second"}
    monkeypatch.setattr(
        store_module, "_TABLE_CONFIGURATION", {**short, "delta.checkpointInterval": "5"}
    )
    log = SnapshotStore(tmp_path).subtask("job", "op", 1)
    parent = commit_chain(log, "run", range(1, 7), position_step=1)
    time.sleep(1.5)
    parent = commit_chain(log, "run", range(7, 13), position_step=1, parent=parent)
    logs = sorted(p.name for p in (Path(log.uri) / "_delta_log").glob("*.json"))
    assert logs[0] >= "00000000000000000004.json", logs  # the first commits' entries are gone
    fresh = SnapshotStore(tmp_path).subtask("job", "op", 1)  # and the table reads whole
    assert [m.checkpoint_id for m in fresh.checkpoints()] == list(range(1, 13))
    assert fresh.restore(12).results.column("id").to_pylist() == list(range(1, 13))


def test_a_runs_app_transactions_expire_a_day_after_its_last_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A streaming query is a run per micro-batch, and every run leaves app transactions (its
    # fences) in every partition's table: kept for ever, they pile up and slow every open
    # and lookup. Delta drops an id the table's retention after the last write that stamped
    # it: a day (here 2 s); a run that keeps writing keeps its fences.
    from checkpoint import _store

    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    commit(log, "run", 1)
    config = DeltaTable(log.uri).metadata().configuration
    assert config["delta.setTransactionRetentionDuration"] == "interval 1 day"

    short = {
        **_store._TABLE_CONFIGURATION,
        "delta.setTransactionRetentionDuration": "interval 2 seconds",
    }
    monkeypatch.setattr(_store, "_TABLE_CONFIGURATION", short)

    def attempt():  # type: ignore[no-untyped-def]
        return SnapshotStore(tmp_path).subtask("job", "op", 1)

    first = attempt()
    earlier = commit(first, "finished", 1)
    done = commit(first, "finished", 2, parent=earlier.ref)
    assert first.expire(1, run_id="finished").expired == [earlier.ref]  # its last write
    assert attempt().claim("claimed-only", "attempt-x") is None  # nothing to claim yet
    claimed = attempt()
    commit(claimed, "claimed-only", 1)
    assert claimed.claim("claimed-only", "attempt-x") == 1  # the run's last write
    zombie = attempt()
    started = commit(zombie, "live", 1)
    successor = attempt()
    assert successor.take_over("live", "attempt-b") == (1, started)
    parent = started.ref
    for checkpoint_id in range(2, 8):  # the live run writes for 3 s, the others not
        time.sleep(0.5)
        parent = commit(successor, "live", checkpoint_id, parent=parent).ref

    table = DeltaTable(first.uri)

    def fences(run: str, owner: str) -> list[int | None]:
        ids = (_store._app_id(run), _store._claim_app_id(run), _store._claimer_app_id(run, owner))
        return [table.transaction_version(i) for i in ids]

    assert fences("finished", "-") == [None, None, None]
    assert fences("claimed-only", "attempt-x") == [None, None, None]
    assert fences("live", "attempt-b") == [7, 1, 1]
    assert successor.claimed_by("live", "attempt-b")
    with pytest.raises(CheckpointConflictError, match="taken it over"):
        commit(zombie, "live", 8, parent=parent)
    # A run whose fences expired while its checkpoints stayed is still taken over when it
    # resumes, with a claim above any it had: its earlier attempts are fenced off again.
    claim, latest = attempt().take_over("claimed-only", "attempt-y")
    assert claim is not None and claim > 1 and latest is not None
    with pytest.raises(CheckpointConflictError, match="taken it over"):
        commit(claimed, "claimed-only", 2, parent=latest.ref)  # it holds claim 1
    assert attempt().take_over("finished", "attempt-z")[1] == done
    with pytest.raises(CheckpointConflictError, match="taken it over"):
        commit(first, "finished", 3, parent=done.ref)


def test_an_equal_or_older_checkpoint_id_is_refused_without_duplicates(tmp_path: Path) -> None:
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    commit(log, "run", 1)
    commit(log, "run", 2)
    version = DeltaTable(log.uri).version()
    for zombie_id in (2, 1):
        with pytest.raises(CheckpointConflictError, match="zombie or speculative attempt"):
            commit(log, "run", zombie_id, n=5)
    assert DeltaTable(log.uri).version() == version  # nothing written
    assert [m.checkpoint_id for m in log.checkpoints()] == [1, 2]
    assert log.load(2).metadata.in_flight == 1
    # A zombie holding its own (stale) handle on the table is refused too.
    stale = SnapshotStore(tmp_path).subtask("job", "op", 0)
    with pytest.raises(CheckpointConflictError):
        commit(stale, "run", 2)
    # Other runs have their own sequence.
    commit(log, "other-run", 1)
    assert sorted((m.run_id, m.checkpoint_id) for m in log.checkpoints()) == [
        ("other-run", 1),
        ("run", 1),
        ("run", 2),
    ]


def test_a_zombie_ahead_of_the_attempt_that_took_its_run_over_is_refused(tmp_path: Path) -> None:
    def attempt():  # type: ignore[no-untyped-def]
        return SnapshotStore(tmp_path).subtask("job", "op", 0)

    zombie, nothing_yet = attempt(), attempt()
    assert nothing_yet.claim("run") is None  # nothing of the run committed: nothing to fence
    assert not DeltaTable.is_deltatable(zombie.uri)
    first = commit(zombie, "run", 1)
    second = commit(zombie, "run", 2, parent=first.ref)
    # A new attempt takes the run over, then reads where it stands: checkpoint 2.
    successor = attempt()
    assert successor.claim("run") == 1
    assert successor.latest(run_id="run") == second
    # The zombie, still running, is now refused although it is ahead ...
    with pytest.raises(
        CheckpointConflictError, match=r"taken it over \(claim 1; this attempt's is 0\)"
    ):
        commit(zombie, "run", 3, parent=second.ref)
    # ... so the successor's next checkpoint is not mistaken for a late one.
    third = commit(successor, "run", 3, parent=second.ref)
    assert [m.checkpoint_id for m in attempt().checkpoints()] == [1, 2, 3]
    # A third attempt fences the second in turn; other runs are not affected.
    assert attempt().claim("run") == 2
    with pytest.raises(CheckpointConflictError, match=r"claim 2; this attempt's is 1"):
        commit(successor, "run", 4, parent=third.ref)
    commit(zombie, "other-run", 1)
    assert attempt().load(3, "run").metadata == third


@pytest.mark.parametrize("trial", range(5))
def test_two_attempts_creating_a_partitions_table_at_once_commit_one_checkpoint_1(
    tmp_path: Path, trial: int
) -> None:
    # A speculative copy and its original (or a zombie and its retry) reach checkpoint 1 of
    # a partition whose table does not exist yet, together. deltalake retried the create
    # that lost the race for version 0 as version 1 without checking app transactions:
    # both landed (about 8 times in 10), and the mixed rows failed every later resume.
    from checkpoint import _faults

    both_ready = threading.Barrier(2)
    outcomes: dict[int, str] = {}

    def together(point: str, context: dict) -> None:
        both_ready.wait(timeout=30)  # both hold their rows, the table not yet there

    def attempt(n: int) -> None:
        log = SnapshotStore(tmp_path).subtask("job", "op", 0)
        try:
            log.commit(
                "run",
                1,
                [StreamRecord({"id": n, "label": "in flight"})],
                [{"id": n, "label": "result"}] * (n + 1),
                input_schema=OUT,
                output_schema=OUT,
                position=1,
            )
            outcomes[n] = "landed"
        except CheckpointConflictError as exc:
            outcomes[n] = f"refused: {exc}"

    _faults.install(together)
    try:
        threads = [threading.Thread(target=attempt, args=(n,)) for n in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        _faults.remove(together)
    assert sorted(outcomes.values())[0] == "landed", outcomes
    assert "already committed" in sorted(outcomes.values())[1], outcomes
    (winner,) = [n for n, outcome in outcomes.items() if outcome == "landed"]
    restored = SnapshotStore(tmp_path).subtask("job", "op", 0).restore(1, "run")
    assert restored.elements == [StreamRecord({"id": winner, "label": "in flight"})]
    assert restored.results.num_rows == winner + 1  # one attempt's rows, whole


def test_a_claim_records_its_owner(tmp_path: Path) -> None:
    # The Spark task reads it to tell a retry (another attempt claimed last) from one task
    # attempt computing a partition twice (coalesce after the enrichment).
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    assert not log.claimed_by("run", "app-1/17")  # no table yet
    commit(log, "run", 1)
    assert not log.claimed_by("run", "app-1/17")  # not claimed yet
    assert SnapshotStore(tmp_path).subtask("job", "op", 0).take_over("run", "app-1/17")[0] == 1
    assert log.claimed_by("run", "app-1/17")
    assert not log.claimed_by("run", "app-2/17")  # owners are names, not numbers
    assert log.claim("run", owner="app-2/17") == 2
    assert log.claimed_by("run", "app-2/17") and not log.claimed_by("run", "app-1/17")
    assert log.claim("run") == 3  # a claim naming no owner: nobody named made the newest
    assert not log.claimed_by("run", "app-2/17")
    assert log.claim("run", owner="app-1/17") == 4  # an owner claiming again
    assert log.claimed_by("run", "app-1/17")
    assert not log.claimed_by("other-run", "app-1/17")


def test_owners_and_run_ids_holding_colons_are_told_apart(tmp_path: Path) -> None:
    # The claim of run 'a' by 'b:c' was recorded under the same Delta app id as a claim of
    # run 'a:b' by 'c' ("...claimed-by:a:b:c"): claimed_by('a:b', 'c') was then true, and a
    # Spark task took itself for one that had already taken its run over.
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    commit(log, "a", 1)
    commit(log, "a:b", 1)
    assert log.claim("a", owner="b:c") == 1
    assert log.claim("a:b") == 1
    assert log.claimed_by("a", "b:c")
    assert not log.claimed_by("a:b", "c")
    assert log.claim("a:b", owner="c") == 2
    assert log.claim("a", owner="x") == 2
    assert log.claimed_by("a:b", "c") and not log.claimed_by("a", "b:c")
    # an owner without a ':' is recorded as before: existing claims are still read
    assert DeltaTable(log.uri).transaction_version("stateful-async-claimed-by:a:b:c") == 2


@pytest.mark.parametrize("owner", [1, "", b"app-1/17"])
def test_an_owner_that_is_no_string_is_refused_before_anything_is_claimed(
    tmp_path: Path, owner: Any
) -> None:
    # claim(run, owner=1) was recorded as owner "1": claimed_by(run, "1") was then True
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    commit(log, "run", 1)
    version = DeltaTable(log.uri).version()
    for call in (
        lambda: log.claim("run", owner=owner),
        lambda: log.take_over("run", owner),
        lambda: log.claimed_by("run", owner),
    ):
        with pytest.raises(
            CheckpointError,
            match=rf"^owner must be a non-empty string; got {re.escape(repr(owner))}\.",
        ):
            call()
    assert DeltaTable(log.uri).version() == version  # nothing claimed


def test_reading_a_chain_refuses_what_is_no_checkpoint_metadata_or_row_count(
    tmp_path: Path,
) -> None:
    # chain(1) failed with a bare AttributeError; chain_results(meta, max_rows="x") was taken
    # while the chain had one checkpoint and failed with a bare TypeError once it had two;
    # check_schemas(1, 2) failed with pyarrow's "Argument 'other' has incorrect type"
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    with pytest.raises(CheckpointError, match=r"^input_schema and output_schema must be pyarrow"):
        log.check_schemas(1, 2)  # no table yet: it passed
    last = commit_chain(log, "run", range(1, 3))
    meta = log.find(2, "run")
    assert last == meta.ref
    for bad in (1, meta.ref):
        with pytest.raises(CheckpointError, match=r"^meta must be a CheckpointMetadata \(as"):
            log.chain(bad)  # type: ignore[arg-type]
        with pytest.raises(CheckpointError, match=r"^meta must be a CheckpointMetadata \(as"):
            list(log.chain_results(bad))  # type: ignore[arg-type]
    for rows in ("x", None, -1, 1.5):
        with pytest.raises(
            CheckpointError,
            match=rf"^max_rows must be an integer >= 0; got {re.escape(repr(rows))}\.",
        ):
            list(log.chain_results(meta, max_rows=rows))  # type: ignore[arg-type]
    with pytest.raises(
        CheckpointError,
        match=r"^input_schema and output_schema must be pyarrow\.Schema objects; got int and "
        r"Schema\.",
    ):
        log.check_schemas(1, OUT)  # type: ignore[arg-type]
    log.check_schemas(OUT, OUT)
    assert [len(t) for t, _ in log.chain_results(meta, max_rows=0)] == [1, 1]


def test_taking_over_claims_again_if_the_run_got_its_first_commit_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def attempt():  # type: ignore[no-untyped-def]
        return SnapshotStore(tmp_path).subtask("job", "op", 0)

    zombie, successor = attempt(), attempt()
    commit(zombie, "earlier-run", 1)  # the table exists; the run has nothing yet
    landed = []
    read = successor.latest

    def zombie_commits_first(**kwargs):  # type: ignore[no-untyped-def]
        if not landed:  # the zombie's first commit lands between the claim and the read
            landed.append(commit(zombie, "run", 1))
        return read(**kwargs)

    monkeypatch.setattr(successor, "latest", zombie_commits_first)
    assert successor.take_over("run") == (1, landed[0])
    with pytest.raises(CheckpointConflictError, match="taken it over"):
        commit(zombie, "run", 2, parent=landed[0].ref)
    commit(successor, "run", 2, parent=landed[0].ref)


def test_an_attempt_whose_run_was_taken_over_expires_nothing(tmp_path: Path) -> None:
    def attempt():  # type: ignore[no-untyped-def]
        return SnapshotStore(tmp_path).subtask("job", "op", 0)

    zombie = attempt()
    parent = None
    for checkpoint_id in (1, 2, 3):
        parent = commit(zombie, "run", checkpoint_id, parent=parent and parent.ref)
    successor = attempt()
    assert successor.take_over("run")[0] == 1
    version = DeltaTable(zombie.uri).version()
    report = zombie.expire(1, run_id="run")  # would expire 1 and 2 under the successor
    assert (report.expired, report.deleted) == ([], [])
    assert DeltaTable(zombie.uri).version() == version
    assert [m.expired for m in attempt().checkpoints()] == [False, False, False]
    assert len(successor.expire(1, run_id="run").expired) == 2


@pytest.mark.parametrize("write", ["claim", "commit"])
def test_a_write_that_loses_to_another_writer_of_the_table_tries_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: str
) -> None:
    # Between this write's read of the table and its commit, an expiry (the CLI's, or an
    # earlier attempt's) rewrites files it read. delta-rs refuses the commit; the write reads
    # again and lands instead of failing the task.
    from checkpoint import _store

    def attempt():  # type: ignore[no-untyped-def]
        return SnapshotStore(tmp_path).subtask("job", "op", 0)

    parent = None
    for checkpoint_id in (1, 2, 3, 4):
        parent = commit(attempt(), "run", checkpoint_id, parent=parent and parent.ref)
    log = attempt()
    log.checkpoints()
    real_write = _store.write_deltalake
    interfered = []

    def other_writer_first(table, data, **kwargs):  # type: ignore[no-untyped-def]
        if not interfered and not isinstance(table, str):
            interfered.append(write)  # before the other writer's own write comes through here
            attempt().expire(2)
        return real_write(table, data, **kwargs)

    monkeypatch.setattr(_store, "write_deltalake", other_writer_first)
    if write == "claim":
        assert log.claim("run") == 1
    else:
        commit(log, "run", 5, parent=parent.ref)
    monkeypatch.undo()
    assert interfered
    metas = attempt().checkpoints()
    live = [m.ref for m in metas if not m.expired]
    expected = {"claim": ["run:3", "run:4"], "commit": ["run:3", "run:4", "run:5"]}[write]
    assert [str(ref) for ref in live] == expected
    assert len(metas) == len(expected) + 2  # 1 and 2 expired, their results kept


def test_a_checkpoint_whose_parent_another_run_expired_is_refused(tmp_path: Path) -> None:
    # Two runs of one job share a partition's table; B's retention deletes A's checkpoints.
    # A's next commit named a deleted parent and was accepted: from then on every expiry
    # and every restore of the partition failed, for every run.
    store = SnapshotStore(tmp_path)
    a, b = store.subtask("job", "op", 0), store.subtask("job", "op", 0)
    parent = previous = None
    for i in (1, 2, 3):  # interleaved: each finds its parent in a table the other changed
        parent = commit(a, "A", i, parent=parent).ref
        previous = commit(b, "B", i, parent=previous).ref
    assert [m.created_at for m in a.chain(a.latest(run_id="A"))] == sorted(
        m.created_at for m in a.chain(a.latest(run_id="A"))
    )
    for i in (4, 5, 6):
        previous = commit(b, "B", i, parent=previous).ref
    assert [str(r) for r in b.expire(3, run_id="B").deleted] == ["A:1", "A:2", "A:3"]
    version = DeltaTable(a.uri).version()
    with pytest.raises(CheckpointNotFoundError, match="the checkpoint it follows, A:3, has been"):
        commit(a, "A", 4, parent=parent)
    assert DeltaTable(a.uri).version() == version  # nothing written
    assert a.latest(run_id="A") is None  # a retried attempt of A starts over
    assert b.expire(3, run_id="B").deleted == []  # and the partition stays usable
    assert store.subtask("job", "op", 0).restore(6, "B").results.num_rows == 6


def test_a_checkpoint_with_a_broken_chain_is_never_restored_and_expiry_deletes_it(
    tmp_path: Path,
) -> None:
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    one = commit(log, "R", 1)
    two = commit(log, "R", 2, parent=one.ref)
    commit(log, "R", 3, parent=two.ref)
    DeltaTable(log.uri).delete("run_id = 'R' AND checkpoint_id = 1")  # by hand
    fresh = SnapshotStore(tmp_path).subtask("job", "op", 0)
    with pytest.raises(CorruptCheckpointError, match="follows R:1, which is missing"):
        fresh.restore(3, "R")
    assert fresh.latest(run_id="R") is None  # nothing restorable: a retry starts over
    report = fresh.expire(2)  # used to raise on the broken chain, for every expiry
    assert sorted(str(r) for r in report.deleted) == ["R:2", "R:3"]
    assert fresh.checkpoints() == []


def test_an_id_without_a_run_restores_the_newest_run_whose_chain_is_intact(
    tmp_path: Path,
) -> None:
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    a1 = commit(log, "A", 1)
    commit(log, "A", 2, parent=a1.ref)
    b1 = commit(log, "B", 1)
    commit(log, "B", 2, parent=b1.ref)
    DeltaTable(log.uri).delete("run_id = 'B' AND checkpoint_id = 1")  # by hand
    fresh = SnapshotStore(tmp_path).subtask("job", "op", 0)
    # B:2 is newer, but can never be restored: A:2 is the checkpoint 2 to take
    assert fresh.restore(2).metadata.run_id == "A"
    assert fresh.restore(2).results.column("id").to_pylist() == [1, 2]
    with pytest.raises(CorruptCheckpointError, match="follows B:1, which is missing"):
        fresh.restore(2, "B")


def test_a_checkpoint_is_never_older_than_its_parent_whatever_the_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A retried attempt on an executor whose clock is a minute behind: its checkpoints
    # looked older than its run's earlier ones, and retention deleted the run's newest.
    from checkpoint import _store

    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    parent = commit_chain(log, "R", (1, 2, 3))

    class Behind(dt.datetime):
        @classmethod
        def now(cls, tz=None):  # type: ignore[no-untyped-def]
            return dt.datetime.now(tz) - dt.timedelta(minutes=1)

    monkeypatch.setattr(_store, "datetime", Behind)
    retried = SnapshotStore(tmp_path).subtask("job", "op", 0)
    parent = commit_chain(retried, "R", (4, 5), parent=parent)
    fresh = SnapshotStore(tmp_path).subtask("job", "op", 0)
    assert [m.checkpoint_id for m in fresh.checkpoints()] == [1, 2, 3, 4, 5]
    fresh.expire(2)
    assert [m.checkpoint_id for m in fresh.checkpoints(include_expired=False)] == [4, 5]
    assert fresh.restore(5, "R").results.num_rows == 5


@pytest.mark.parametrize("reopen", [False, True], ids=["same-log", "fresh-log"])
def test_latest_follows_commit_order_across_runs_whose_clocks_differ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reopen: bool
) -> None:
    # Run A ran on machines whose clock is five minutes ahead. Run B rolls back to A:1
    # (restore_from=1) and writes on; run C starts over without restoring. "latest" is the
    # checkpoint written last: it used to go back to A's abandoned line, as B's and C's
    # checkpoints were stamped by their own clocks, earlier than A's.
    from checkpoint import _store

    class Ahead(dt.datetime):
        @classmethod
        def now(cls, tz=None):  # type: ignore[no-untyped-def]
            return dt.datetime.now(tz) + dt.timedelta(minutes=5)

    with monkeypatch.context() as patched:
        patched.setattr(_store, "datetime", Ahead)
        log = SnapshotStore(tmp_path).subtask("job", "op", 0)
        a1 = commit(log, "A", 1)
        commit(log, "A", 3, parent=commit(log, "A", 2, parent=a1.ref).ref)

    def reopened():
        return SnapshotStore(tmp_path).subtask("job", "op", 0) if reopen else log

    b1 = commit(reopened(), "B", 1, parent=a1.ref)
    b2 = commit(reopened(), "B", 2, parent=b1.ref)
    assert SnapshotStore(tmp_path).subtask("job", "op", 0).latest().ref == b2.ref
    c1 = commit(reopened(), "C", 1)
    fresh = SnapshotStore(tmp_path).subtask("job", "op", 0)
    assert fresh.latest().ref == c1.ref
    assert [str(m.ref) for m in fresh.checkpoints()] == ["A:1", "A:2", "A:3", "B:1", "B:2", "C:1"]
    fresh.expire(2)  # the newest two are the last two written
    assert [str(m.ref) for m in fresh.checkpoints(include_expired=False)] == ["B:2", "C:1"]


def test_checkpoints_written_at_one_clock_reading_are_stamped_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stopped (or coarse) clock: each run's checkpoint is still stamped after the one
    # before, also by a writer that reads the newest stamp from the Delta log's file
    # statistics, which cut timestamps to milliseconds.
    from checkpoint import _store

    stopped = dt.datetime(2026, 1, 1, 12, 0, 0, 999_999, tzinfo=dt.timezone.utc)

    class Stopped(dt.datetime):
        @classmethod
        def now(cls, tz=None):  # type: ignore[no-untyped-def]
            return stopped

    monkeypatch.setattr(_store, "datetime", Stopped)
    stamps = [
        commit(SnapshotStore(tmp_path).subtask("job", "op", 0), run, 1).created_at
        for run in ("Z", "Y", "X")
    ]
    assert stamps[0] == stopped
    assert stamps[0] < stamps[1] < stamps[2]
    assert SnapshotStore(tmp_path).subtask("job", "op", 0).latest().run_id == "X"


def test_unknown_checkpoint_id_lists_the_ids_that_exist(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    log = store.subtask("job", "op", 0)
    commit(log, "run-a", 1)
    commit(log, "run-a", 2)
    with pytest.raises(CheckpointNotFoundError) as info:
        store.load("job", "op", 0, 7)
    assert "no checkpoint 7" in str(info.value)
    assert "run run-a: 1-2" in str(info.value)
    with pytest.raises(
        CheckpointNotFoundError, match="Job 'nope' has no checkpoints .* Jobs there: job"
    ):
        store.load("nope", "op", 0, 1)


def test_a_checkpoint_id_that_is_no_integer_is_refused_not_called_missing(
    tmp_path: Path,
) -> None:
    # load("1") said "There is no checkpoint 1 ... Checkpoints that exist: run run-a: 1"
    import numpy as np

    store = SnapshotStore(tmp_path)
    log = store.subtask("job", "op", 0)
    commit(log, "run-a", 1)
    for call in (
        lambda: store.load("job", "op", 0, "1"),  # type: ignore[arg-type]
        lambda: store.restore("job", "op", 0, "1"),  # type: ignore[arg-type]
        lambda: log.find(1.0),  # type: ignore[arg-type]
    ):
        with pytest.raises(CheckpointError, match=r"checkpoint_id must be an integer >= 1; got"):
            call()
    with pytest.raises(CheckpointError, match=r"max_id must be an integer >= 1; got '1'\."):
        log.latest(max_id="1")  # type: ignore[arg-type]
    assert store.load("job", "op", 0, np.int64(1)).metadata.checkpoint_id == 1
    assert log.latest(max_id=np.int32(1)).checkpoint_id == 1  # type: ignore[union-attr]


def test_a_run_id_that_is_no_string_is_refused_not_called_missing(tmp_path: Path) -> None:
    # Run ids are stored as strings: run_id=1 gave load() "There is no checkpoint 1 of ...
    # run 1 ... Checkpoints that exist: run 1: 1", latest() None, expire() nothing expired,
    # while claim(1) claimed run '1'. commit() refused it; every other call now does too.
    store = SnapshotStore(tmp_path)
    log = store.subtask("job", "op", 0)
    commit(log, "1", 1)
    commit(log, "1", 2, parent=CheckpointRef("1", 1))
    version = DeltaTable(log.uri).version()
    for call in (
        lambda: store.load("job", "op", 0, 1, 1),  # type: ignore[arg-type]
        lambda: store.restore("job", "op", 0, 1, 1),  # type: ignore[arg-type]
        lambda: log.find(1, 1),  # type: ignore[arg-type]
        lambda: log.latest(run_id=1),  # type: ignore[arg-type]
        lambda: log.latest(run_id=""),
        lambda: log.last_committed_id(1),  # type: ignore[arg-type]
        lambda: log.claim(1),  # type: ignore[arg-type]
        lambda: log.take_over(1),  # type: ignore[arg-type]
        lambda: log.claimed_by(1, "owner"),  # type: ignore[arg-type]
        lambda: log.expire(1, run_id=1),  # type: ignore[arg-type]
    ):
        with pytest.raises(CheckpointError, match=r"^run_id must be a non-empty string; got"):
            call()
    assert DeltaTable(log.uri).version() == version  # nothing claimed, nothing expired
    assert [m.expired for m in log.checkpoints()] == [False, False]
    assert store.load("job", "op", 0, 1, "1").metadata.ref == CheckpointRef("1", 1)
    assert log.latest(run_id="1").checkpoint_id == 2  # type: ignore[union-attr]


def test_a_blank_run_id_is_refused_when_committed_and_read_where_a_table_holds_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # run_id=" " was committed, and listed as "run  : 1"
    from checkpoint import _store

    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    for blank in (" ", "\t\n"):
        with pytest.raises(
            CheckpointError,
            match=rf"^run_id must hold more than whitespace; got {re.escape(repr(blank))}\.",
        ):
            commit(log, blank, 1)
    assert not log.exists()
    # A ':' is taken (a run's id may hold its application's id): a ref is read from the
    # right, the checkpoint id being an integer.
    assert str(commit(log, "app:1.stage2", 1).ref) == "app:1.stage2:1"
    # A table written before the check keeps its blank run readable by its id.
    checked = _store._check_commit_args
    monkeypatch.setattr(
        _store, "_check_commit_args", lambda run_id, *args: checked(run_id.strip() or "old", *args)
    )
    commit(log, " ", 1)
    monkeypatch.undo()
    fresh = SnapshotStore(tmp_path).subtask("job", "op", 0)
    assert fresh.load(1, " ").metadata.ref == CheckpointRef(" ", 1)
    assert fresh.latest(run_id=" ").run_id == " "  # type: ignore[union-attr]
    assert fresh.last_committed_id(" ") == 1
    assert fresh.latest(run_id="app:1.stage2").checkpoint_id == 1  # type: ignore[union-attr]
    # It restores, but cannot be followed: the refusal said only that the id "names the run
    # in every listing", not what to do with such a checkpoint. Doing what it now says
    # resumes every result.
    restored = fresh.restore(1, " ")
    with pytest.raises(
        CheckpointError,
        match=r"^parent's run_id must hold more than whitespace; got ' '\. A checkpoint of "
        r"a run whose id is blank .* cannot be followed\. To go on from it, commit this run's "
        r"first checkpoint with parent=None and, as its results, the whole chain's: "
        r"restore\(checkpoint_id, run_id\)\.results, then those emitted since",
    ):
        commit(fresh, "new", 2, parent=restored.metadata.ref)
    fresh.commit(
        "new",
        2,
        restored.elements,
        [*restored.results.to_pylist(), {"id": 2, "label": "since"}],
        input_schema=OUT,
        output_schema=OUT,
        position=restored.metadata.position + 1,
    )
    assert fresh.restore(2, "new").results.column("id").to_pylist() == [1, 2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"checkpoint_id": 2**63}, r"checkpoint_id must be at most 9,223,372,036,854,775,807"),
        ({"position": 2**63}, r"position must be at most 9,223,372,036,854,775,807, the"),
        ({"input_seqs": [2**63]}, r"input_seqs must hold integers from -9,223,372,036,854"),
        ({"result_timestamps": [-(2**63) - 1]}, r"result_timestamps must hold integers from"),
        ({"result_timestamps": ["x"]}, r"result_timestamps must hold integers from"),
    ],
)
def test_commit_arguments_past_64_bits_are_refused_naming_them(
    tmp_path: Path, args: dict, message: str
) -> None:
    # They raised pyarrow's bare "Python int too large to convert to C long"
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    given = {"checkpoint_id": 1, "position": 0, **args}
    with pytest.raises(CheckpointError, match=message):
        log.commit(
            "run",
            given.pop("checkpoint_id"),
            [StreamRecord({"id": 1, "label": "a"})],
            [{"id": 1, "label": "b"}],
            input_schema=OUT,
            output_schema=OUT,
            **given,
        )
    assert log.checkpoints() == []
    biggest = 2**63 - 1
    log.commit(
        "run",
        biggest,
        [StreamRecord({"id": 1, "label": "a"})],
        [{"id": 1, "label": "b"}],
        input_schema=OUT,
        output_schema=OUT,
        position=biggest,
        input_seqs=[biggest],
        result_timestamps=[-(2**63)],
    )
    snapshot = log.load(biggest)
    assert (snapshot.metadata.position, snapshot.input_seqs) == (biggest, [biggest])
    assert snapshot.result_timestamps == [-(2**63)]


def test_numpy_integers_are_taken_as_checkpoint_id_and_position(tmp_path: Path) -> None:
    # commit() refused them ("checkpoint_id must be an integer >= 1; got np.int64(1).")
    # where load(), subtask() and expire() take them
    import numpy as np

    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    meta = log.commit(
        "run",
        np.int64(1),
        [StreamRecord({"id": 1, "label": "a"})],
        input_schema=OUT,
        output_schema=OUT,
        position=np.int32(3),
    )
    assert (meta.checkpoint_id, meta.position) == (1, 3)
    assert (type(meta.checkpoint_id), type(meta.position)) == (int, int)
    assert log.last_committed_id("run") == 1
    fresh = SnapshotStore(tmp_path).subtask("job", "op", 0).load(1).metadata
    assert (fresh.checkpoint_id, fresh.position) == (1, 3)
    for args, message in (
        ({"checkpoint_id": np.int64(0)}, r"checkpoint_id must be an integer >= 1; got"),
        ({"checkpoint_id": 2.0}, r"checkpoint_id must be an integer >= 1; got 2\.0\."),
        ({"position": np.int64(-1)}, r"position must be an integer >= 0; got"),
        ({"position": True}, r"position must be an integer >= 0; got True\."),
    ):
        given = {"checkpoint_id": 2, "position": 0, **args}
        with pytest.raises(CheckpointError, match=message):
            log.commit(
                "run",
                given.pop("checkpoint_id"),
                [],
                input_schema=OUT,
                output_schema=OUT,
                **given,
            )


@pytest.mark.parametrize(
    ("properties", "message"),
    [
        ({"attempt": 1}, r"got 'attempt': 1\. Convert keys and values with str\(\) first"),
        ({1: "x"}, r"got 1: 'x'\. Convert"),
        ({"at": dt.datetime(2024, 1, 1)}, r"got 'at': datetime\.datetime\(2024"),
        ([("a", "b")], r"properties must be a dict of strings to strings, or None; got \["),
    ],
    ids=["int-value", "int-key", "datetime", "pairs"],
)
def test_checkpoint_properties_that_are_not_strings_are_refused(
    tmp_path: Path, properties: Any, message: str
) -> None:
    # {"attempt": 1} was committed and read back as 1 (a string key stayed a string), {1: "x"}
    # as {"1": "x"} (while the returned metadata said {1: "x"}), and a datetime failed the
    # commit with json's bare "Object of type datetime is not JSON serializable"
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    with pytest.raises(CheckpointError, match=message):
        log.commit(
            "run", 1, [], input_schema=OUT, output_schema=OUT, position=0, properties=properties
        )
    assert log.checkpoints() == []
    log.commit("run", 1, [], input_schema=OUT, output_schema=OUT, position=0, properties={"a": "1"})
    assert SnapshotStore(tmp_path).subtask("job", "op", 0).load(1).metadata.properties == {"a": "1"}


@pytest.mark.parametrize("fingerprint", [None, 5, b"3:ab"])
def test_a_fingerprint_that_is_no_string_is_refused(tmp_path: Path, fingerprint: Any) -> None:
    # None was committed, returned as None, and read back as "" (5 failed with pyarrow's
    # bare "Expected bytes, got a 'int' object")
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    message = r"fingerprint must be a string \(InputFingerprint.hexdigest\(\), or \"\" when none"
    with pytest.raises(CheckpointError, match=message):
        log.commit(
            "run", 1, [], input_schema=OUT, output_schema=OUT, position=0, fingerprint=fingerprint
        )
    assert log.checkpoints() == []
    digest = InputFingerprint().hexdigest()
    log.commit("run", 1, [], input_schema=OUT, output_schema=OUT, position=0, fingerprint=digest)
    log.commit("run", 2, [], input_schema=OUT, output_schema=OUT, position=0)
    fresh = SnapshotStore(tmp_path).subtask("job", "op", 0)
    assert [m.fingerprint for m in fresh.checkpoints()] == [digest, ""]


@pytest.mark.parametrize(
    ("parent", "message"),
    [
        (
            ("run", 1),
            r"parent must be a CheckpointRef \(the \.ref of .*got \('run', 1\)\.",
        ),
        ("run:1", r"parent must be a CheckpointRef .*got 'run:1'\."),
        (CheckpointRef("run", "1"), r"parent's checkpoint_id must be an integer >= 1; got '1'\."),
        (CheckpointRef(None, 1), r"parent's run_id must be a non-empty string; got None"),
        # refused as commit's own run_id is (it was looked for, and said not to be there)
        (CheckpointRef(" ", 1), r"^parent's run_id must hold more than whitespace; got ' '\."),
    ],
    ids=["tuple", "string", "string-id", "no-run", "blank-run"],
)
def test_a_parent_that_is_no_checkpoint_ref_is_refused_not_called_deleted(
    tmp_path: Path, parent: Any, message: str
) -> None:
    # It was refused as "the checkpoint it follows, ('run', 1), has been deleted, most likely
    # by the retention of another run of this job", which it was not
    import numpy as np

    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    first = commit(log, "run", 1)
    with pytest.raises(CheckpointError, match=message) as info:
        commit(log, "run", 2, parent=parent)
    assert not isinstance(info.value, CheckpointNotFoundError)
    assert [m.checkpoint_id for m in log.checkpoints()] == [1]
    second = commit(log, "run", 2, parent=CheckpointRef("run", np.int64(1)))
    assert second.parent == first.ref and type(second.parent.checkpoint_id) is int


@pytest.mark.parametrize("final", [None, "no", 1])
def test_a_final_flag_that_is_no_bool_is_refused(tmp_path: Path, final: Any) -> None:
    # None was committed, returned as None and read back as False; "no" and 1 failed with
    # pyarrow's bare "Could not convert 'no' with type str: tried to convert to boolean"
    import numpy as np

    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    with pytest.raises(CheckpointError, match=rf"final must be True or False; got {final!r}\."):
        log.commit("run", 1, [], input_schema=OUT, output_schema=OUT, position=0, final=final)
    assert log.checkpoints() == []
    meta = log.commit(
        "run", 1, [], input_schema=OUT, output_schema=OUT, position=0, final=np.bool_(True)
    )
    assert meta.final is True
    assert SnapshotStore(tmp_path).subtask("job", "op", 0).load(1).metadata.final is True


@pytest.mark.parametrize("vacuum", ["no", None, 0])
def test_a_vacuum_flag_that_is_no_bool_is_refused_before_anything_is_expired(
    tmp_path: Path, vacuum: Any
) -> None:
    # expire(vacuum="no") expired, then vacuumed: the files it removed were deleted
    import numpy as np

    store = SnapshotStore(tmp_path)
    log = store.subtask("job", "op", 0)
    commit_chain(log, "run", range(1, 4))
    version = DeltaTable(log.uri).version()
    message = rf"^vacuum must be True or False; got {vacuum!r}\."
    with pytest.raises(CheckpointError, match=message):
        log.expire(1, vacuum=vacuum)
    with pytest.raises(CheckpointError, match=message):
        store.expire("job", 1, vacuum=vacuum)
    assert DeltaTable(log.uri).version() == version
    assert [m.expired for m in log.checkpoints()] == [False, False, False]
    report = store.expire("job", 1, vacuum=np.bool_(False))
    assert (len(report.expired), report.files_removed) == (2, 0)


def test_a_bad_retain_is_refused_before_the_job_is_looked_up(tmp_path: Path) -> None:
    # store.expire("nojob", retain=-1) said the job had no checkpoints, and once the job
    # name was fixed, that retain was wrong: one mistake at a time
    store = SnapshotStore(tmp_path)
    commit_chain(store.subtask("job", "op", 0), "run", range(1, 3))
    for job in ("nojob", "job"):
        with pytest.raises(CheckpointError, match=r"^retain must be an integer >= 0; got -1\."):
            store.expire(job, -1)


def test_other_flags_that_are_no_bool_are_refused_not_taken_as_true(tmp_path: Path) -> None:
    # checkpoints(include_expired="no") listed the expired checkpoints, claim(force="no")
    # claimed a run that had committed nothing, load(results="no") read the results
    import numpy as np

    store = SnapshotStore(tmp_path)
    log = store.subtask("job", "op", 0)
    commit_chain(log, "run", range(1, 3))
    log.expire(1)
    version = DeltaTable(log.uri).version()
    for call, name in (
        (lambda: log.checkpoints(include_expired="no"), "include_expired"),
        (lambda: store.checkpoints("job", include_expired="no"), "include_expired"),
        (lambda: log.claim("other-run", force="no"), "force"),
        (lambda: log.load(2, results="no"), "results"),
    ):
        with pytest.raises(CheckpointError, match=rf"^{name} must be True or False; got 'no'\."):
            call()
    assert DeltaTable(log.uri).version() == version  # no claim
    assert [m.checkpoint_id for m in log.checkpoints(include_expired=np.bool_(False))] == [2]
    assert log.load(2, results=np.bool_(False)).results.num_rows == 0


@pytest.mark.parametrize(
    ("elements", "results", "message"),
    [
        (
            [],
            "abc",
            r"results must be a pyarrow Table or RecordBatch, a list of dicts .* got 'abc'",
        ),
        ([], {"id": 1, "label": "x"}, r"results must be .*; got \{'id': 1, 'label': 'x'\}\."),
        ([], [{"id": 1, "label": "x"}, 2], r"results must be .*; got a list holding 2\."),
        (None, None, r"elements must be a list of StreamRecord and Watermark elements \(the "),
    ],
    ids=["string", "one-dict", "not-a-dict", "no-elements"],
)
def test_results_or_elements_that_are_not_rows_are_refused(
    tmp_path: Path, elements: Any, results: Any, message: str
) -> None:
    # results="abc" was committed as three results of nulls; a dict (one row, not a list
    # of them) failed with a bare "string indices must be integers", elements=None with
    # "object of type 'NoneType' has no len()"
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    with pytest.raises(CheckpointError, match=message):
        log.commit("run", 1, elements, results, input_schema=OUT, output_schema=OUT, position=0)
    assert log.checkpoints() == []
    rows = ({"id": i, "label": str(i)} for i in range(2))  # any iterable of dicts, as before
    assert (
        log.commit("run", 1, [], rows, input_schema=OUT, output_schema=OUT, position=0).result_count
        == 2
    )


@pytest.mark.parametrize("operator_id", [1, ""])
def test_a_job_wide_call_refuses_an_operator_id_that_names_no_directory(
    tmp_path: Path, operator_id: Any
) -> None:
    # operator_id=1 failed with a bare "TypeError: sequence item 2: expected str instance,
    # int found"; "" listed, expired and read every operator of the job
    store = SnapshotStore(tmp_path)
    for operator in ("op", "other"):
        commit_chain(store.subtask("job", operator, 0), "run", range(1, 3))
    message = rf"^operator id {operator_id!r} cannot name a checkpoint directory"
    for call in (
        lambda: store.checkpoints("job", operator_id),
        lambda: store.read_job("job", operator_id),
        lambda: store.expire("job", 1, operator_id),
        lambda: store.remove_orphans("job", 0, operator_id),
        lambda: store.subtasks("job", operator_id),
    ):
        with pytest.raises(CheckpointError, match=message):
            call()
    assert len(store.checkpoints("job")) == 4  # nothing expired
    assert len(store.checkpoints("job", "op")) == 2


def test_a_subtask_past_32_bits_is_refused_before_any_commit(tmp_path: Path) -> None:
    # It failed its first commit with pyarrow's "Value 2147483648 too large to fit in C
    # integer type"
    store = SnapshotStore(tmp_path)
    with pytest.raises(
        CheckpointError,
        match=r"subtask must be an integer from 0 to 2,147,483,647; got 2147483648\.",
    ):
        store.subtask("job", "op", 2**31)
    commit(store.subtask("job", "op", 2**31 - 1), "run", 1)
    assert store.subtasks("job", "op") == [2**31 - 1]


def test_an_unknown_operator_is_refused_naming_the_job_s_operators(tmp_path: Path) -> None:
    # expire(job, 0, operator_id="typo") reported nothing expired; checkpoints() and
    # subtasks() gave [], as if the operator had no partitions
    store = SnapshotStore(tmp_path)
    commit(store.subtask("job", "enrich", 0), "run", 1)
    message = r"Job 'job' has no operator 'typo' at .*\. Its operators: enrich\."
    for call in (
        lambda: store.expire("job", 0, operator_id="typo"),
        lambda: store.checkpoints("job", "typo"),
        lambda: store.remove_orphans("job", 0, operator_id="typo"),
        lambda: store.read_job("job", "typo"),
        lambda: store.subtasks("job", "typo"),
    ):
        with pytest.raises(CheckpointNotFoundError, match=message):
            call()
    assert [m.checkpoint_id for m in store.checkpoints("job", "enrich")] == [1]


def test_loading_from_an_unknown_operator_or_subtask_names_the_ones_there(
    tmp_path: Path,
) -> None:
    # load("job", "typo", 0, 1) said "There is no checkpoint 1 of job 'job', operator
    # 'typo', subtask 0 ... Checkpoints that exist: none." of a job that has checkpoints
    store = SnapshotStore(tmp_path)
    for subtask in (0, 1, 2, 4):
        commit(store.subtask("job", "enrich", subtask), "run", 1)
    for call in (store.load, store.restore):
        with pytest.raises(
            CheckpointNotFoundError,
            match=r"Job 'job' has no operator 'typo' at .*\. Its operators: enrich\.",
        ):
            call("job", "typo", 0, 1)
        with pytest.raises(
            CheckpointNotFoundError,
            match=r"Operator 'enrich' of job 'job' has no subtask 3 at .*\. Its subtasks: 0-2, 4\.",
        ):
            call("job", "enrich", 3, 1)
    with pytest.raises(CheckpointNotFoundError, match=r"There is no checkpoint 2 of job 'job'"):
        store.load("job", "enrich", 4, 2)
    assert store.load("job", "enrich", 4, 1).metadata.subtask == 4


def test_a_missing_location_is_a_clear_error(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "does-not-exist")
    with pytest.raises(CheckpointLocationError, match="does-not-exist does not exist"):
        store.jobs()
    with pytest.raises(CheckpointLocationError):
        store.checkpoints("job")
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(CheckpointLocationError, match="a-file is a file, not a directory"):
        SnapshotStore(tmp_path / "a-file").jobs()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((123,), r"must be a path or URI \(a str or os.PathLike\); got 123\."),
        ((b"/tmp",), r"must be a path or URI \(a str or os.PathLike\); got b'/tmp'\."),
        (("  ",), r"got '  ' \(an empty one would be the working directory\)"),
        (("/tmp/x", ["AWS_REGION=x"]), r"storage_options must be a dict of strings to strings"),
        (("/tmp/x", {"AWS_REGION": 1}), r"storage_options must be a dict of strings to strings"),
    ],
)
def test_bad_store_arguments_are_refused_naming_them(args: tuple, message: str) -> None:
    # A blank location was the working directory (then expired or cleaned there), and bad
    # options were blamed on the location at the first read.
    with pytest.raises(CheckpointError, match=message):
        SnapshotStore(*args)


def test_a_file_uri_with_a_host_is_refused_not_taken_for_another_path(tmp_path: Path) -> None:
    # file://tmp/chk (two slashes) names the host "tmp": before, it became /chk
    from stateful_async.spark import CheckpointConfig

    with pytest.raises(CheckpointLocationError, match=r"names the host 'tmp'") as info:
        SnapshotStore("file://tmp/chk")
    assert "write file:///tmp/chk (three slashes) or the path /tmp/chk." in str(info.value)
    with pytest.raises(ConfigurationError, match=r"names the host 'otherhost'"):
        CheckpointConfig("file://otherhost/data/chk", "job")
    assert SnapshotStore(f"file://localhost{tmp_path}").location == str(tmp_path)
    assert SnapshotStore(f"file://{tmp_path}/").location == str(tmp_path)


def test_a_location_holding_a_percent_escape_is_refused_and_a_file_uri_decoded(
    tmp_path: Path,
) -> None:
    # delta-rs decodes '%20' when it reads a table: before, the first commit to
    # <tmp>/a%20b failed with "Kernel error: File not found: <tmp>/a b/..._delta_log/...",
    # leaving its files, and file:///<tmp>/c%20d was taken as the directory 'c%20d' (so too).
    from stateful_async.spark import CheckpointConfig

    for location, escape in [(f"{tmp_path}/a%20b", "%20"), (f"file://{tmp_path}/e%2520f", "%20")]:
        with pytest.raises(CheckpointLocationError) as info:
            SnapshotStore(location)
        assert str(info.value) == (
            f"The checkpoint location {location!r} is a local directory whose path holds "
            f"{escape!r}, which delta-rs decodes (as an escaped character) when it reads a "
            "checkpoint table, so it would not find the tables it writes there. Use a "
            "directory whose path has no '%' followed by two hexadecimal digits."
        )
        with pytest.raises(ConfigurationError, match="which delta-rs decodes"):
            CheckpointConfig(location, "job")
    assert os.listdir(tmp_path) == []
    store = SnapshotStore(f"file://{tmp_path}/c%20d")
    assert store.location == f"{tmp_path}/c d"
    log = store.subtask("job", "op", 0)
    commit(log, "run", 1)
    commit(log, "run", 2)
    assert (
        SnapshotStore(f"{tmp_path}/c d").subtask("job", "op", 0).load(2).metadata.checkpoint_id == 2
    )


def test_a_schema_change_between_runs_is_refused(tmp_path: Path) -> None:
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    commit(log, "run", 1)
    changed = pa.schema([("id", pa.int64()), ("label", pa.large_string())])
    fresh = SnapshotStore(tmp_path).subtask("job", "op", 0)
    with pytest.raises(SchemaChangedError, match="The input schema differs") as info:
        fresh.commit("run2", 1, [], None, input_schema=changed, output_schema=OUT, position=0)
    assert "written with: 'label' was string, is now large_string. Checkpoints" in str(info.value)
    assert "use a new job_id" in str(info.value)
    assert "Two enrichments in one job (one chained after the other, say) each need" in str(
        info.value
    )
    assert f"checkpoints expire {tmp_path} --job job --retain 0" in str(info.value)
    # a command to paste into a shell: a location with a space is quoted
    spaced = SnapshotStore(tmp_path / "a b").subtask("job", "op", 0)
    commit(spaced, "run", 1)
    with pytest.raises(SchemaChangedError) as info:
        SnapshotStore(tmp_path / "a b").subtask("job", "op", 0).commit(
            "run2", 1, [], None, input_schema=changed, output_schema=OUT, position=0
        )
    assert f"checkpoints expire '{tmp_path}/a b' --job job --retain 0" in str(info.value)
    renamed = pa.schema([("id", pa.int64()), ("payload", pa.string())])
    with pytest.raises(
        SchemaChangedError,
        match=r"'label' \(string\) is gone; 'payload' \(string\) is new\. Checkpoints",
    ):
        fresh.commit("run2", 1, [], None, input_schema=renamed, output_schema=OUT, position=0)
    # Nullability alone (a chained enrichment's input: spark.range's id, then a result's).
    nullable = pa.schema([pa.field("id", pa.int64(), nullable=False), ("label", pa.string())])
    with pytest.raises(
        SchemaChangedError, match=r"written with: 'id' \(int64\) was nullable, is now NOT NULL\."
    ):
        fresh.commit("run2", 1, [], None, input_schema=nullable, output_schema=OUT, position=0)
    strict = SnapshotStore(tmp_path).subtask("strict-job", "op", 0)
    strict.commit("run", 1, [], None, input_schema=nullable, output_schema=OUT, position=0)
    with pytest.raises(
        SchemaChangedError, match=r"written with: 'id' \(int64\) was NOT NULL, is now nullable\."
    ):
        strict.commit("run2", 1, [], None, input_schema=OUT, output_schema=OUT, position=0)


@pytest.mark.parametrize("interrupted", [False, True])
def test_after_deleting_every_checkpoint_the_job_runs_with_the_changed_schema(
    tmp_path: Path, interrupted: bool
) -> None:
    # What SchemaChangedError advises (expire --retain 0) must let the job run again.
    store = SnapshotStore(tmp_path)
    commit(store.subtask("job", "op", 0), "run", 1)
    changed = pa.schema([("id", pa.int64()), ("label", pa.string()), ("score", pa.float64())])
    with pytest.raises(SchemaChangedError):
        store.subtask("job", "op", 0).check_schemas(changed, changed)
    assert len(store.expire("job", retain=0).deleted) == 1
    log = store.subtask("job", "op", 0)
    if interrupted:  # a reset that stopped between its description and its data commits
        from checkpoint._store import _description

        DeltaTable(log.uri).alter.set_table_description(_description(changed, changed))
    log.check_schemas(changed, changed)  # accepted: nothing is left to resume
    row = {"id": 1, "label": "a", "score": 0.5}
    meta = log.commit(
        "run2",
        1,
        [StreamRecord(row)],
        [row],
        input_schema=changed,
        output_schema=changed,
        position=1,
    )
    fresh = SnapshotStore(tmp_path).subtask("job", "op", 0)
    assert fresh.schemas() == (changed, changed)
    assert [m.ref for m in fresh.checkpoints()] == [meta.ref]
    restored = fresh.load(1, "run2")
    assert restored.elements == [StreamRecord(row)]
    assert [t.to_pylist() for t, _ in fresh.chain_results(meta)] == [[row]]
    with pytest.raises(SchemaChangedError):  # and the new schema is now the one kept
        fresh.check_schemas(OUT, OUT)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("../escape", "cannot name a checkpoint directory"),
        ("", "cannot name"),
        ("a/b", "cannot name"),
    ],
)
def test_job_ids_must_be_safe_directory_names(tmp_path: Path, name: str, message: str) -> None:
    from checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=message):
        SnapshotStore(tmp_path).subtask(name, "op", 0)


# -- chains, restore, retention --------------------------------------------------------------


def test_restore_collects_results_along_the_chain_across_runs(tmp_path: Path) -> None:
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    a1 = commit(log, "run-a", 1, position=10)
    a2 = commit(log, "run-a", 2, parent=a1.ref, position=20)
    commit(log, "run-a", 3, parent=a2.ref, position=30)  # not in run-b's chain
    b3 = commit(log, "run-b", 3, parent=a2.ref, position=25)  # run-b resumed from run-a:2
    b4 = commit(log, "run-b", 4, parent=b3.ref, position=40)
    restored = log.restore(4, run_id="run-b")
    assert restored.position == 40
    assert restored.results.column("label").to_pylist() == [
        "result of 1",
        "result of 2",
        "result of 3",
        "result of 4",
    ]
    assert [m.ref for m in log.chain(b4)] == [a1.ref, a2.ref, b3.ref, b4.ref]
    assert log.latest().ref == b4.ref  # most recently created, any run
    assert log.latest(run_id="run-a").ref == CheckpointRef("run-a", 3)
    assert log.latest(max_id=3).ref == b3.ref


def test_chain_results_come_in_bounded_groups_in_commit_order(tmp_path: Path) -> None:
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    parent = None
    for ckpt in range(1, 8):  # each checkpoint commits one result
        parent = commit(log, "run-a" if ckpt < 4 else "run-b", ckpt, parent=parent).ref
    last = log.find(7, "run-b")
    groups = [t.column("label").to_pylist() for t, _ in log.chain_results(last, max_rows=3)]
    assert groups == [
        ["result of 1", "result of 2", "result of 3"],
        ["result of 4", "result of 5", "result of 6"],
        ["result of 7"],
    ]
    whole = [t.column("label").to_pylist() for t, _ in log.chain_results(last)]
    assert whole == [[f"result of {i}" for i in range(1, 8)]]
    assert log.restore(7, "run-b").results.column("label").to_pylist() == whole[0]


def test_large_results_are_put_in_order_one_checkpoint_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrow sorts a column by concatenating it, which a string column cannot past 2 GiB: a
    # group of checkpoints holding more than _RESTORE_GROUP_BYTES of results (here: any)
    # comes one checkpoint at a time, each in order. (Before, 4 checkpoints of one 600 MiB
    # text each could never be restored: "offset overflow while concatenating arrays".)
    import checkpoint._store as store_module

    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    parent = None
    for ckpt in range(1, 5):
        parent = log.commit(
            "run-a" if ckpt < 3 else "run-b",
            ckpt,
            [],
            [{"id": ckpt * 10 + i, "label": f"{ckpt}.{i}"} for i in range(3)],
            input_schema=OUT,
            output_schema=OUT,
            position=ckpt,
            parent=parent,
            result_timestamps=[ckpt * 100 + i for i in range(3)],
        ).ref
    last = log.find(4, "run-b")
    together = [(t.to_pylist(), s.to_pylist()) for t, s in log.chain_results(last)]
    assert len(together) == 1
    monkeypatch.setattr(store_module, "_RESTORE_GROUP_BYTES", 0)
    apart = [(t.to_pylist(), s.to_pylist()) for t, s in log.chain_results(last)]
    assert [len(rows) for rows, _ in apart] == [3, 3, 3, 3]
    assert [row for rows, _ in apart for row in rows] == together[0][0]
    assert [stamp for _, stamps in apart for stamp in stamps] == together[0][1]
    assert together[0][0][:4] == [
        {"id": 10, "label": "1.0"},
        {"id": 11, "label": "1.1"},
        {"id": 12, "label": "1.2"},
        {"id": 20, "label": "2.0"},
    ]
    assert log.restore(4, "run-b").results.to_pylist() == together[0][0]


def test_a_checkpoint_past_2_gib_in_one_column_is_refused_saying_what_to_change(
    tmp_path: Path,
) -> None:
    # Arrow's string and binary columns end at 2 GiB; before, these failed with a bare
    # pyarrow error (or a TypeError) at every attempt.
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    text = "x" * (600 << 20)
    results = pa.Table.from_batches(
        [pa.record_batch({"id": [i], "label": [text]}, schema=OUT) for i in range(4)]
    )
    with pytest.raises(CheckpointError, match=r"its results hold more than 2 GiB") as info:
        log.commit("run", 1, [], results, input_schema=OUT, output_schema=OUT, position=4)
    assert "a lower interval_records or interval_seconds" in str(info.value)
    del results, info  # the traceback holds the table too: 2.4 GiB
    in_flight = [StreamRecord({"id": i, "label": text}) for i in range(4)]
    with pytest.raises(CheckpointError, match=r"its in-flight records hold more than 2 GiB"):
        log.commit("run", 1, in_flight, [], input_schema=OUT, output_schema=OUT, position=4)
    assert log.checkpoints() == []  # nothing written
    commit(log, "run", 1)  # and the log takes the next commit


def test_retention_keeps_the_last_n_and_reclaims_storage(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    log = store.subtask("job", "op", 0)
    parent = commit_chain(log, "run", range(1, 7), n=200, position_step=10)
    other = store.subtask("job", "op", 1)
    commit(other, "run", 1, n=200)
    size_before = _dir_size(Path(log.uri))
    files_before = _files(tmp_path)

    report = store.expire("job", retain=2)

    assert [m.checkpoint_id for m in log.checkpoints(include_expired=False)] == [5, 6]
    for old in (1, 2, 3, 4):
        with pytest.raises(CheckpointNotFoundError, match=f"Checkpoint {old} .* has expired"):
            log.load(old)
    # The retained checkpoints restore completely: their chains' results survived.
    restored = log.restore(6)
    assert restored.results.column("id").to_pylist() == [1, 2, 3, 4, 5, 6]
    assert len(restored.elements) == 200
    assert other.load(1).metadata.in_flight == 200  # fewer than 2 checkpoints: untouched
    assert sorted(r.checkpoint_id for r in report.expired) == [1, 2, 3, 4]
    assert _dir_size(Path(log.uri)) < size_before  # the dropped state left the disk
    # files_removed counts what left the disk, and only this expiry's: a vacuum lists again
    # the files an earlier one deleted (their removal stays in the Delta log)
    assert report.files_removed == len(files_before - _files(tmp_path)) > 0
    parent = commit_chain(log, "run", range(7, 9), n=200, position_step=10, parent=parent)
    files_before = _files(tmp_path)
    report = store.expire("job", retain=2)
    assert report.files_removed == len(files_before - _files(tmp_path)) > 0
    # ... and those an expiry without vacuum left for this one to delete
    parent = commit_chain(log, "run", range(9, 11), n=200, position_step=10, parent=parent)
    assert store.expire("job", retain=3, vacuum=False).files_removed == 0
    files_before = _files(tmp_path)
    report = store.expire("job", retain=2)
    assert report.files_removed == len(files_before - _files(tmp_path)) > 0
    with pytest.raises(
        CheckpointNotFoundError, match=r"Checkpoint 3 .* has expired.*run run: 9-10\."
    ):
        log.load(3)

    store.expire("job", retain=0)
    assert log.checkpoints() == []
    with pytest.raises(CheckpointNotFoundError, match="Checkpoints that exist: none"):
        log.load(6)


def test_an_expiry_that_deletes_part_of_a_rewritten_file_leaves_the_table_readable(
    tmp_path: Path,
) -> None:
    # An expiry that only deletes went through delta-rs's delete, which rewrote the file it
    # kept rows of (one an earlier expiry wrote, holding several checkpoints' results) with
    # string_view columns: every later read of the table failed with "Function 'equal' has
    # no kernel matching input types (string, string_view)", so no task could restore.
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    run_a = [commit(log, "a", 1).ref]
    for ckpt in range(2, 5):
        run_a.append(commit(log, "a", ckpt, parent=run_a[-1]).ref)
    forked = commit(log, "b", 3, parent=run_a[1])  # a run resumed from a:2 (restore_from=2)
    assert log.expire(2).expired == run_a[:3]  # a:1-3 rewritten together into one file
    commit(log, "b", 4, parent=forked.ref)
    report = log.expire(2)  # keeps b:3 and b:4, which need a:1 and a:2
    assert report.expired == [] and report.deleted == run_a[2:]
    fresh = SnapshotStore(tmp_path).subtask("job", "op", 0)
    assert [str(m.ref) for m in fresh.checkpoints()] == ["a:1", "a:2", "b:3", "b:4"]
    assert fresh.restore(4, "b").results.column("id").to_pylist() == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "rewrite",
    [
        lambda table: table.update(
            updates={"properties": '\'{"by": "hand"}\''},
            predicate="kind = 'checkpoint' AND checkpoint_id = 2",
        ),
        lambda table: table.delete("kind = 'result' AND checkpoint_id = 4"),
    ],
    ids=["update", "delete"],
)
def test_a_table_that_delta_rs_rewrote_with_string_views_stays_readable(
    tmp_path: Path, rewrite: Callable[[DeltaTable], object]
) -> None:
    # deltalake's DeltaTable.update and .delete (a user's, or an expiry of an earlier
    # version) rewrite the files they keep rows of with string_view columns: every read of
    # the partition then failed with "Function 'equal' has no kernel matching input types
    # (string, string_view)", so it could neither be listed, restored, committed to nor
    # expired.
    store = SnapshotStore(tmp_path)
    log = store.subtask("job", "op", 0)
    commit_chain(log, "run", range(1, 5), n=3)
    rewrite(DeltaTable(log.uri))
    assert any(
        pa.types.is_string_view(f.type)
        for path in Path(log.uri).glob("*.parquet")
        for f in pq.read_schema(path)
    )
    fresh = SnapshotStore(tmp_path).subtask("job", "op", 0)
    assert [str(m.ref) for m in fresh.checkpoints()] == ["run:1", "run:2", "run:3", "run:4"]
    assert len(store.checkpoints("job")) == 4
    restored = fresh.restore(3)
    assert restored.results.schema == OUT
    assert restored.results.column("label").to_pylist() == [f"result of {i}" for i in (1, 2, 3)]
    assert restored.elements == [StreamRecord({"id": i, "label": str(i)}) for i in range(3)]
    commit(fresh, "run", 5, parent=fresh.find(3).ref)
    assert len(fresh.expire(1).expired) == 3
    assert fresh.restore(5).results.column("id").to_pylist() == [1, 2, 3, 5]


def test_an_expiry_with_nothing_new_to_expire_deletes_what_an_earlier_one_left(
    tmp_path: Path,
) -> None:
    # It returned before its vacuum: the files an expiry killed between its commit and its
    # vacuum (or one without vacuum) left stayed on disk, re-run after re-run, until the
    # orphan step took them a day later for files of "commits that never completed".
    store = SnapshotStore(tmp_path)
    log = store.subtask("job", "op", 0)
    commit_chain(log, "run", range(1, 7), n=50, position_step=10)
    assert store.expire("job", retain=2, vacuum=False).files_removed == 0
    left = _files(tmp_path)
    report = store.expire("job", retain=2)  # nothing new to expire
    assert report.expired == [] and report.deleted == []
    assert report.files_removed == len(left - _files(tmp_path)) > 0
    version = DeltaTable(log.uri).version()
    assert store.expire("job", retain=2).files_removed == 0  # nothing left: no vacuum
    assert DeltaTable(log.uri).version() == version  # (which would log two commits)
    assert log.restore(6).results.column("id").to_pylist() == [1, 2, 3, 4, 5, 6]


def test_a_tasks_expiry_deletes_the_files_its_commit_removed_without_a_vacuum(
    tmp_path: Path,
) -> None:
    # A task expires after every final checkpoint (each micro-batch of a stream): a vacuum
    # listed the whole directory and logged two more Delta commits every time.
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    for batch in range(1, 6):  # micro-batches: a run each, one final checkpoint
        commit(log, f"batch{batch}", 1, n=3, position=batch)
    files_before = _files(tmp_path)
    version = DeltaTable(log.uri).version()

    report = log.expire(2, run_id="batch5")

    assert sorted(str(r) for r in report.deleted) == ["batch1:1", "batch2:1", "batch3:1"]
    gone = files_before - _files(tmp_path)
    assert report.files_removed == len(gone) == 3  # one file per deleted checkpoint
    assert (
        DeltaTable(log.uri).version() == version + 1
    )  # the delete only (an overwrite of its rows with none)
    assert [h["operation"] for h in DeltaTable(log.uri).history(1)] == ["WRITE"]
    assert [m.run_id for m in log.checkpoints()] == ["batch4", "batch5"]
    assert log.restore(1, run_id="batch4").results.column("id").to_pylist() == [1]
    # nothing left for a vacuum of the table to delete
    assert SnapshotStore(tmp_path).expire("job", retain=2).files_removed == 0


@pytest.mark.parametrize("retain", [1, 3, 4, 5, 7, 9])
def test_retention_keeps_every_checkpoint_of_a_partition_that_has_fewer(
    tmp_path: Path, retain: int
) -> None:
    # retain=7 kept only 7 - 5 = 2 of 5 checkpoints (a slice from a negative start), and the
    # resume from one the docs promised to keep was refused as expired.
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    commit_chain(log, "run", range(1, 6), n=3, position_step=10)
    log.expire(retain)
    kept = [m.checkpoint_id for m in log.checkpoints(include_expired=False)]
    assert kept == [1, 2, 3, 4, 5][-retain:]


def test_a_log_that_commits_and_expires_knows_its_checkpoints_without_rereading(
    tmp_path: Path,
) -> None:
    # A task's log keeps its checkpoint list current through its own commits and expiries
    # (reading it again scans every result ever written); it must always equal a fresh read,
    # also when another writer committed in between.
    store = SnapshotStore(tmp_path)
    log = store.subtask("job", "op", 0)

    def fresh() -> list:
        return SnapshotStore(tmp_path).subtask("job", "op", 0).checkpoints(include_expired=True)

    parent = None
    for ckpt in range(1, 10):
        parent = commit(log, "run", ckpt, n=20, parent=parent, position=ckpt * 10).ref
        if ckpt % 3 == 0:
            log.expire(2, vacuum=ckpt != 6)
        assert log.checkpoints(include_expired=True) == fresh()
    assert [m.checkpoint_id for m in log.checkpoints(include_expired=False)] == [8, 9]

    commit(SnapshotStore(tmp_path).subtask("job", "op", 0), "other", 1, n=5)  # a zombie
    log.expire(1)
    assert log.checkpoints(include_expired=True) == fresh()
    assert [m.ref for m in log.checkpoints()] == [CheckpointRef("other", 1)]  # all else deleted
    assert log.restore(1, run_id="other").metadata.in_flight == 5


def _writer_and_reader(tmp_path: Path, checkpoints: int) -> tuple[Any, Any]:
    """A job's log with ``checkpoints`` checkpoints of 5 elements, and another process's
    view of it that has read them."""
    writer = SnapshotStore(tmp_path).subtask("job", "op", 0)
    commit_chain(writer, "run", range(1, checkpoints + 1), n=5, position_step=10)
    reader = SnapshotStore(tmp_path).subtask("job", "op", 0)
    reader.checkpoints()
    return writer, reader


def _expiring_under(monkeypatch: pytest.MonkeyPatch, reader, writer, retain: int) -> list:
    """Make ``writer`` expire (and vacuum) right after ``reader`` has listed the files of
    its next read, once: the interleaving of a job's expiry with a reader of its table."""
    from checkpoint import _layout

    real = _layout.delta_dataset
    reports: list = []

    def listed_then_expired(table, storage_options=None):
        dataset = real(table, storage_options)
        if not reports and table is reader._table:
            reports.append(writer.expire(retain))
        return dataset

    monkeypatch.setattr(_layout, "delta_dataset", listed_then_expired)
    return reports


def test_a_read_whose_files_a_running_jobs_expiry_vacuums_reads_the_newer_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A reader (the CLI, a notebook) of a running job's table read a snapshot whose files the
    # job's expiry then rewrote and vacuumed: "Failed to open local file", now and then.
    writer, reader = _writer_and_reader(tmp_path, 5)
    commit(writer, "run", 6, n=5, parent=CheckpointRef("run", 5), position=60)

    reports = _expiring_under(monkeypatch, reader, writer, retain=2)
    listed = reader.checkpoints()
    assert reports and reports[0].expired  # the expiry did run under the read
    assert listed == writer.checkpoints()
    commit(writer, "run", 7, n=5, parent=CheckpointRef("run", 6), position=70)
    reports.clear()
    restored = reader.restore(6)
    assert reports and reports[0].files_removed > 0
    assert restored.results.column("id").to_pylist() == [1, 2, 3, 4, 5, 6]
    assert len(restored.elements) == 5


def test_a_data_file_gone_without_an_expiry_is_named_so_not_read_again(tmp_path: Path) -> None:
    # It was read 10 times over and blamed on "an expiry of a running job".
    writer, reader = _writer_and_reader(tmp_path, 2)
    newest = max(Path(writer.uri).glob("*.parquet"), key=lambda p: p.stat().st_mtime_ns)
    newest.unlink()
    with pytest.raises(CheckpointError, match="names a data file that is not there") as info:
        reader.restore(2)
    assert "expiry" not in str(info.value)
    # what deletes the file of a commit still in progress, which it then logs
    assert "as an orphan with no grace period, `checkpoints expire --orphans-older-than 0`, " in (
        " ".join(str(info.value).split())
    )


def test_a_checkpoint_expired_while_it_is_read_is_named_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer, reader = _writer_and_reader(tmp_path, 3)
    _expiring_under(monkeypatch, reader, writer, retain=1)
    with pytest.raises(
        CheckpointNotFoundError,
        match=r"Checkpoint run:2 .* was expired while it was being read.*newer checkpoint: "
        r"run run: 3\.",
    ):
        reader.load(2)


def test_looking_up_one_job_lists_only_that_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On an object store every listing is a request: finding one job's subtasks (what the
    # driver does for every enrichment with checkpoints) must not walk the other jobs.
    from checkpoint import _layout

    store = SnapshotStore(tmp_path)
    for job in range(6):
        for operator in ("a", "b"):
            (tmp_path / f"job{job}" / operator / "subtask=00000").mkdir(parents=True)
    (tmp_path / "lost+found").mkdir()
    listed: list[tuple[str, ...]] = []
    real = _layout.list_dirs

    def counting(location: str, *parts: str, **options: Any) -> list[str]:
        listed.append(parts)
        return real(location, *parts, **options)

    monkeypatch.setattr(_layout, "list_dirs", counting)
    assert store.subtasks("job3", "b") == [0]
    assert all(not parts or parts[0] == "job3" for parts in listed), listed
    assert len(listed) <= 3
    assert store.jobs() == [f"job{j}" for j in range(6)]  # lost+found is no job


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*.parquet"))


def _files(path: Path) -> set[Path]:
    """Data files (the Delta logs' checkpoints aside)."""
    return {f for f in path.rglob("*.parquet") if "_delta_log" not in f.parts}


# A process that commits checkpoints 1..CRASH-1 of one subtask, then dies committing
# CRASH (CrashDuringCommit: the data file is written, the Delta log never takes it).
CRASH_MID_COMMIT = """
import asyncio, sys
sys.path.insert(0, sys.argv[4])
from checkpoint import SnapshotStore
from stateful_async.chaos import CrashDuringCommit
from test_checkpoint_store import commit_chain

async def enrich(row):
    return [row]

location, subtask, crash = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
asyncio.run(CrashDuringCommit(enrich, checkpoint_id=crash).open())
log = SnapshotStore(location).subtask("job", "op", subtask)
commit_chain(log, "run", range(1, crash + 1), n=50)
"""


def test_orphan_files_of_commits_that_never_completed_are_removed_once_old_enough(
    tmp_path: Path,
) -> None:
    # Subtask 0 dies committing its checkpoint 3, subtask 1 its first (no Delta log yet).
    for subtask, crash in ((0, 3), (1, 1)):
        died = subprocess.run(
            [sys.executable, "-c", CRASH_MID_COMMIT, str(tmp_path), str(subtask), str(crash)]
            + [str(Path(__file__).parent)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert died.returncode == 1, died.stderr
    store = SnapshotStore(tmp_path)
    log = store.subtask("job", "op", 0)
    live = {Path(f) for f in DeltaTable(log.uri).file_uris()}
    orphans = _files(tmp_path) - live
    assert len(live) == 2 and len(orphans) == 2
    assert [m.checkpoint_id for m in log.checkpoints()] == [1, 2]
    # Neither expiry nor its vacuum deletes them: no version of the log names them.
    store.expire("job", retain=1)
    assert orphans <= _files(tmp_path)
    # Fresh, they may be a commit still running: kept.
    assert store.remove_orphans("job") == []
    assert orphans <= _files(tmp_path)
    # Once older than the grace period (every file here is: the live ones too), only the
    # orphans go; the retained checkpoint still restores.
    for path in _files(tmp_path):
        os.utime(path, (time.time() - 25 * 3600,) * 2)
    assert store.remove_orphans("job") == sorted(f"op/{p.parent.name}/{p.name}" for p in orphans)
    assert not orphans & _files(tmp_path)
    assert log.restore(2).results.column("id").to_pylist() == [1, 2]
    assert store.remove_orphans("job", older_than=0) == []


@pytest.mark.parametrize(
    "older_than", [-1, dt.timedelta(seconds=-1), "1h", float("nan"), 3600 * 2.6e12]
)
def test_a_bad_grace_period_for_orphans_is_refused_before_anything_is_deleted(
    tmp_path: Path, older_than: Any
) -> None:
    commit(SnapshotStore(tmp_path).subtask("job", "op", 0), "run", 1)
    with pytest.raises(CheckpointError, match="older_than must be a timedelta or a number"):
        SnapshotStore(tmp_path).remove_orphans("job", older_than=older_than)


def test_listing_a_job(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    for subtask in (0, 1, 2):
        commit(store.subtask("job", "op", subtask), "run", 1)
    commit(store.subtask("job", "other-op", 0), "run", 1)
    assert store.jobs() == ["job"]
    assert store.operators("job") == ["op", "other-op"]
    assert store.subtasks("job", "op") == [0, 1, 2]
    metas = store.checkpoints("job", "op")
    assert [(m.subtask, m.checkpoint_id) for m in metas] == [(0, 1), (1, 1), (2, 1)]
    assert store.read_job("job").num_rows == 4 * 3  # (meta, 1 record, 1 result) x 4 tables


def test_job_wide_reads_work_on_several_partitions_at_once_and_keep_their_order(
    tmp_path: Path,
) -> None:
    store = SnapshotStore(tmp_path)
    for subtask in range(12):
        for checkpoint_id in (1, 2):
            commit(store.subtask("job", "op", subtask), "run", checkpoint_id)
    commit(store.subtask("job", "other-op", 0), "run", 1)
    threads: set[str] = set()

    def who(log):  # type: ignore[no-untyped-def]
        threads.add(threading.current_thread().name)
        time.sleep(0.01)  # each worker gets partitions of its own
        return (log.operator_id, log.subtask, len(log.checkpoints()))

    assert store.map_subtasks("job", None, who) == [
        *(("op", n, 2) for n in range(12)),
        ("other-op", 0, 1),
    ]
    assert len(threads) > 1 and all(t.startswith("checkpoint-scan") for t in threads)
    metas = store.checkpoints("job", "op")
    assert [(m.subtask, m.checkpoint_id) for m in metas] == [  # in the order they were made
        (n, c) for n in range(12) for c in (1, 2)
    ]
    report = store.expire("job", retain=1, operator_id="op")
    assert [ref.checkpoint_id for ref in report.expired + report.deleted] == [1] * 12
    assert [m.checkpoint_id for m in store.checkpoints("job", "op")] == [2] * 12
    # a partition that cannot be read fails the whole listing, named
    write_deltalake(str(tmp_path / "job" / "op" / "subtask=00012"), pa.table({"a": [1]}))
    with pytest.raises(CorruptCheckpointError, match=r"subtask=00012 is a Delta table but not"):
        store.checkpoints("job", "op")


def test_fingerprint_ignores_batching_but_not_order_or_content() -> None:
    rows = [{"id": i, "v": i * 0.5} for i in range(100)]
    whole = InputFingerprint()
    whole.update(rows)
    pieces = InputFingerprint()
    for start in range(0, 100, 7):
        pieces.update(rows[start : start + 7])
    assert whole.hexdigest() == pieces.hexdigest()
    assert whole.hexdigest().startswith("100:")
    swapped = InputFingerprint()
    swapped.update(rows[1:2] + rows[:1] + rows[2:])
    assert swapped.hexdigest() != whole.hexdigest()
    changed = InputFingerprint()
    changed.update(rows[:50] + [{"id": 50, "v": 25.1}] + rows[51:])
    assert changed.hexdigest() != whole.hexdigest()


# -- operator -> snapshot -> Delta -> restore -> operator ----------------------------------


@pytest.mark.parametrize("mode", [OutputMode.ORDERED, OutputMode.UNORDERED])
async def test_operator_snapshot_survives_a_round_trip_through_delta(tmp_path: Path, mode) -> None:
    schema = pa.schema([("id", pa.int64()), ("name", pa.string())])
    out_schema = pa.schema([("id", pa.int64()), ("greeting", pa.string())])
    inputs = [StreamRecord({"id": i, "name": f"n{i}"}, timestamp=i) for i in range(6)]

    def answer(value: dict) -> list[dict]:
        return [{"id": value["id"], "greeting": f"hello {value['name']}"}]

    emitted: list = []

    class ById(ControlledFunction):  # dict values are not hashable: key the calls by id
        async def async_invoke(self, value):
            return await super().async_invoke(value["id"])

    fn = ById()
    op = AsyncWaitOperator(fn, emitted.append, mode, capacity=10)
    await op.open()
    for record in inputs[:3]:
        await op.process_element(record)
    await op.process_watermark(Watermark(2))
    for record in inputs[3:]:
        await op.process_element(record)
    await settle()
    fn.complete(0, answer(inputs[0].value))
    fn.complete(4, answer(inputs[4].value))
    await settle()
    snapshot = op.snapshot_state(1)
    await op.close()

    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    log.commit(
        "run",
        1,
        snapshot,
        [e.value for e in emitted],
        input_schema=schema,
        output_schema=out_schema,
        position=6,
        result_timestamps=[e.timestamp for e in emitted],
    )
    restored = SnapshotStore(tmp_path).subtask("job", "op", 0).restore(1)
    assert restored.elements == snapshot

    async def real(value: dict) -> list[dict]:
        return answer(value)

    after: list = []
    op2 = AsyncWaitOperator(real, after.append, mode, capacity=2)  # smaller than the snapshot
    await op2.open(restored=restored.elements)
    await op2.finish()
    await op2.close()
    combined = restored.result_records() + [e for e in after if isinstance(e, StreamRecord)]
    expected = [StreamRecord(answer(r.value)[0], r.timestamp) for r in inputs]
    if mode is OutputMode.ORDERED:
        assert combined == expected
    else:
        key = lambda r: r.value["id"]  # noqa: E731
        assert sorted(combined, key=key) == expected
    # the watermark was in flight: restored, and replayed between the same records
    assert Watermark(2) in snapshot and Watermark(2) not in emitted
    at = after.index(Watermark(2))
    assert {e.value["id"] for e in after[:at]} == {1, 2}
    assert {e.value["id"] for e in after[at + 1 :]} == {3, 4, 5}


def test_commit_of_a_10k_element_snapshot_is_one_delta_version(tmp_path: Path) -> None:
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    commit(log, "run", 1, n=10_000)
    table = DeltaTable(log.uri)
    assert table.version() == 0
    assert delta_dataset(table).to_table().num_rows == 1 + 10_000 + 1
    assert os.path.isdir(log.uri)


def test_not_null_input_fields_store_and_restore(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from checkpoint import _faults

    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), ("name", pa.string())])
    written: list[pa.Table] = []

    def capture(point: str, context: dict) -> None:
        written.append(context["data"])

    _faults.install(capture)
    try:
        log = SnapshotStore(tmp_path).subtask("job", "op", 0)
        log.commit(
            "run",
            1,
            [StreamRecord({"id": 7, "name": None})],
            [{"id": 1, "label": "x"}],
            input_schema=schema,
            output_schema=OUT,
            position=1,
        )
    finally:
        _faults.remove(capture)
    assert log.load(1).elements == [StreamRecord({"id": 7, "name": None})]
    # The rows of a checkpoint are plain Parquet any writer accepts: the NOT NULL flag of
    # an input field is not stored (the meta row's input struct is null), only restored.
    (rows,) = written
    assert rows.schema.field("input").type.field("id").nullable
    pq.write_table(rows, tmp_path / "copy.parquet")
    assert pq.read_table(tmp_path / "copy.parquet").num_rows == 3


def test_a_long_lived_log_opens_its_table_afresh_every_so_many_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One DeltaTable object brought forward through every commit got slower and bigger
    # with each (benchmarks/checkpoint_bench.py, "long task"); the log reopens it.
    from checkpoint import _store

    monkeypatch.setattr(_store, "_REOPEN_VERSIONS", 3)
    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    parent, objects = None, []
    for ckpt in range(1, 9):
        parent = commit(log, "run", ckpt, parent=parent).ref
        objects.append(log._open(refresh=True))
    distinct = [o for i, o in enumerate(objects) if all(o is not p for p in objects[:i])]
    assert 2 <= len(distinct) <= 4  # a new object every 3 versions, not one per commit
    assert (
        objects[-1].version() == SnapshotStore(tmp_path).subtask("job", "op", 0)._open().version()
    )
    latest = log.latest(run_id="run")
    assert latest is not None and latest.checkpoint_id == 8
    assert [m.checkpoint_id for m in log.chain(latest)] == list(range(1, 9))


def _committing_during_the_orphan_scan(
    monkeypatch: pytest.MonkeyPatch, action: Callable[[], object]
) -> list[object]:
    """Run ``action`` (a running job's commit or expiry) once, after ``remove_orphans`` has
    read its table's snapshot and before it lists and deletes the directory's files."""
    done: list[object] = []
    real = DeltaTable.vacuum

    def vacuum(table: DeltaTable, *args: Any, **kwargs: Any) -> list[str]:
        if not done:
            done.append(action())
        return real(table, *args, **kwargs)

    monkeypatch.setattr(DeltaTable, "vacuum", vacuum)
    return done


def test_removing_orphans_never_deletes_the_file_of_a_commit_that_landed_during_the_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The scan vacuumed the snapshot it had read before listing the directory: a checkpoint
    # a running task committed in between had its data file deleted (with a grace period
    # shorter than the file's age: 0 here), and every later read of the partition, its
    # retry's restore included, failed with "names a data file that is not there".
    task = SnapshotStore(tmp_path).subtask("job", "op", 0)
    parent = commit(task, "run", 1, n=2, position=1).ref
    done = _committing_during_the_orphan_scan(
        monkeypatch, lambda: commit(task, "run", 2, n=2, parent=parent, position=2)
    )

    removed = SnapshotStore(tmp_path).remove_orphans("job", older_than=0)

    assert done and removed == []
    restored = SnapshotStore(tmp_path).subtask("job", "op", 0).restore(2)
    assert restored.results.column("id").to_pylist() == [1, 2]


def test_removing_orphans_while_a_running_task_expires_does_not_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The vacuum logged a commit of its own, which a task's expiry landing meanwhile made
    # fail: `checkpoints expire` against a running job exited 2, "Removing orphan files ...
    # failed: ... a concurrent transaction deleted data this operation read ... run it again
    # once the storage is reachable" (whatever the grace period).
    task = SnapshotStore(tmp_path).subtask("job", "op", 0)
    commit_chain(task, "run", range(1, 5), n=2, position_step=1)
    stray = Path(task.uri) / "part-00000-orphan-c000.snappy.parquet"
    pq.write_table(pa.table({"id": [1]}), stray)
    os.utime(stray, (time.time() - 25 * 3600,) * 2)
    done = _committing_during_the_orphan_scan(monkeypatch, lambda: task.expire(1, run_id="run"))

    removed = SnapshotStore(tmp_path).remove_orphans("job")

    assert done and done[0].expired  # type: ignore[attr-defined]
    assert removed == [f"op/subtask=00000/{stray.name}"] and not stray.exists()
    restored = SnapshotStore(tmp_path).subtask("job", "op", 0).restore(4)
    assert restored.results.column("id").to_pylist() == [1, 2, 3, 4]


def test_an_expiry_whose_vacuum_a_running_task_s_commit_refuses_still_reports_and_deletes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The vacuum after the expiry's rewrite logs commits of its own; a task's expiry landing
    # meanwhile made it fail, and the whole expiry was tried again: the rewrite had landed,
    # so the second try found nothing to do, and `checkpoints expire` said "0 checkpoint(s)
    # expired ... 0 file(s) removed" with the files it had replaced left on disk.
    task = SnapshotStore(tmp_path).subtask("job", "op", 0)
    commit_chain(task, "run", range(1, 7), n=2, position_step=1)
    before = _files(tmp_path)

    def running_task() -> object:
        commit(task, "run", 7, n=2, parent=CheckpointRef("run", 6), position=7)
        return task.expire(3, run_id="run")

    done = _committing_during_the_orphan_scan(monkeypatch, running_task)

    report = SnapshotStore(tmp_path).expire("job", retain=4)

    assert done and [str(r) for r in done[0].expired] == ["run:3", "run:4"]  # type: ignore[attr-defined]
    assert [str(r) for r in report.expired] == ["run:1", "run:2"]
    assert report.files_removed == 2
    assert len(before - _files(tmp_path)) == 4  # the expiry's two and the task's two
    restored = SnapshotStore(tmp_path).subtask("job", "op", 0).restore(7)
    assert restored.results.column("id").to_pylist() == [1, 2, 3, 4, 5, 6, 7]


def test_a_delta_failure_after_the_commit_landed_is_named_as_such(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # delta-rs can fail in a post-commit step (writing a log checkpoint) after the commit
    # itself landed: its bare DeltaError used to leave the store, saying nothing of that.
    from deltalake.exceptions import DeltaError

    from checkpoint import _store

    log = SnapshotStore(tmp_path).subtask("job", "op", 0)
    first = commit(log, "R", 1)
    real_write = _store.write_deltalake

    def write_then_fail(*args, **kwargs):  # type: ignore[no-untyped-def]
        real_write(*args, **kwargs)
        raise DeltaError("Generic error: writing the log checkpoint failed")

    monkeypatch.setattr(_store, "write_deltalake", write_then_fail)
    with pytest.raises(CheckpointError, match=r"R:2 .* may have landed before the failure"):
        commit(log, "R", 2, parent=first.ref)
    monkeypatch.undo()
    assert SnapshotStore(tmp_path).subtask("job", "op", 0).latest(run_id="R").checkpoint_id == 2
