"""Executor side of the ``delta_rs`` sink: Parquet files under the table and their stats.

A task writes its rows into Parquet files under the table directory (one directory per
partition value, Hive style) and describes each file in a ``DataFile``: path relative to
the table root, size, partition values and Delta statistics. Nothing here touches the
Delta log; the commit (``_sink_commit``) adds the files in one transaction.

Statistics are exact or absent. Per leaf column (struct fields included, lists and maps
excluded, as Delta does): ``nullCount`` always; ``minValues``/``maxValues`` for integers,
floats without NaN or infinities, booleans, dates, timestamps (microseconds) and strings
of at most ``MAX_STRING_STAT_CHARS`` characters. Decimals and binaries get null counts only:
a bound that a reader might parse imprecisely would make it skip files it must read.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import posixpath
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlparse

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from .._exceptions import ConfigurationError, DeltaSinkError, SinkSchemaMismatchError
from ._columns import free_alias, nested_field_advice
from ._results import first_forbidden_null, requires
from ._sink_options import CODECS, is_uri

#: Strings longer than this get no min/max (an exact bound would bloat the log).
MAX_STRING_STAT_CHARS = 64

#: Rows buffered per file before a Parquet row group is written (Spark sends ~10k rows
#: per Arrow batch; one row group each would make files slow to read).
ROW_GROUP_ROWS = 128 * 1024
ROW_GROUP_BYTES = 64 * 1024 * 1024
# Rows a task holds for all its open files together (one per partition value): past it,
# the largest buffers are written out as row groups, so memory does not grow with the
# number of partition values.
TASK_BUFFER_BYTES = 128 * 1024 * 1024

#: Directory name of a null partition value (Hive's, which Spark and delta-rs also use).
NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"

_EPOCH = dt.datetime(1970, 1, 1)


@dataclass(frozen=True)
class DataFile:
    """One Parquet file written by a task, described for a Delta ``add`` action.

    ``path`` is relative to the table root and not URL-encoded (delta-rs encodes it in the
    log); ``stats`` is the Delta JSON statistics string.
    """

    path: str
    size: int
    partition_values: dict[str, str | None]
    modification_time: int
    num_records: int
    stats: str


# -- storage ---------------------------------------------------------------------------


class TableStorage:
    """The files of one table: a local directory, or an object store reached through
    delta-rs's own file system (so ``storage.*`` options mean what they mean to delta-rs).
    Paths given to and returned by every method are relative to the table root."""

    def __init__(self, table_uri: str, storage_options: dict[str, str] | None = None) -> None:
        self.table_uri = table_uri
        if not is_uri(table_uri):
            self._fs: pafs.FileSystem = pafs.LocalFileSystem()
            self._root = table_uri
        else:
            from deltalake.fs import DeltaStorageHandler

            parsed = urlparse(table_uri)
            if parsed.scheme == "file":
                # delta-rs's file system refuses a local root that does not exist yet.
                os.makedirs(unquote(parsed.path), exist_ok=True)
            self._fs = pafs.PyFileSystem(DeltaStorageHandler(table_uri, storage_options or {}))
            self._root = ""

    def _full(self, rel: str) -> str:
        return posixpath.join(self._root, rel) if self._root else rel

    def open_output(self, rel: str) -> Any:
        parent = posixpath.dirname(rel)
        if parent or self._root:
            self._fs.create_dir(self._full(parent), recursive=True)
        return self._fs.open_output_stream(self._full(rel))

    def open_input(self, rel: str) -> Any:
        return self._fs.open_input_file(self._full(rel))

    def read_text(self, rel: str) -> str:
        with self._fs.open_input_stream(self._full(rel)) as stream:
            return bytes(stream.read()).decode("utf-8")

    def delete(self, rel: str) -> bool:
        """Delete one file; False if it was already gone."""
        try:
            self._fs.delete_file(self._full(rel))
        except FileNotFoundError:
            return False
        return True

    def list_files(self, under: str = "") -> list[tuple[str, int]]:
        """Every file below ``under`` (recursively) as ``(relative path, mtime in ms)``.

        A file whose store reports no modification time counts as modified now, so that
        no grace period ever treats it as old.
        """
        base = self._full(under) if under else (self._root or "")
        selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
        now_ms = time.time_ns() // 1_000_000
        files = []
        for info in self._fs.get_file_info(selector):
            if info.type != pafs.FileType.File:
                continue
            rel = info.path
            if self._root:
                rel = posixpath.relpath(info.path, self._root)
            mtime = info.mtime_ns // 1_000_000 if info.mtime_ns is not None else now_ms
            files.append((rel, mtime))
        return files


# -- schema helpers ----------------------------------------------------------------------


def as_file_type(arrow_type: pa.DataType) -> pa.DataType:
    """The type a column is written with: nullable all the way down, timestamps in UTC."""
    if pa.types.is_timestamp(arrow_type):
        return pa.timestamp("us", tz="UTC" if arrow_type.tz is not None else None)
    if pa.types.is_struct(arrow_type):
        return pa.struct([as_file_field(arrow_type.field(i)) for i in range(arrow_type.num_fields)])
    if pa.types.is_large_list(arrow_type) or pa.types.is_list(arrow_type):
        return pa.list_(as_file_field(arrow_type.value_field))
    if pa.types.is_map(arrow_type):
        return pa.map_(as_file_type(arrow_type.key_type), as_file_field(arrow_type.item_field))
    if pa.types.is_large_string(arrow_type):
        return pa.string()
    if pa.types.is_large_binary(arrow_type):
        return pa.binary()
    return arrow_type


def as_file_field(f: pa.Field) -> pa.Field:
    return pa.field(f.name, as_file_type(f.type), nullable=True)


def as_file_schema(schema: pa.Schema) -> pa.Schema:
    return pa.schema([as_file_field(f) for f in schema])


def is_partition_type(arrow_type: pa.DataType) -> bool:
    """Partition columns are limited to types whose Delta string form is unambiguous."""
    return (
        pa.types.is_string(arrow_type)
        or pa.types.is_large_string(arrow_type)
        or pa.types.is_boolean(arrow_type)
        or pa.types.is_date32(arrow_type)
        or pa.types.is_signed_integer(arrow_type)
    )


def partition_value(value: Any) -> str | None:
    """The Delta ``partitionValues`` string of a Python value (None for null).

    An empty string is stored as null, as Spark and delta-rs read it back as null anyway.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dt.date):
        return value.isoformat()
    text = str(value)
    return text if text != "" else None


def partition_dir(columns: Iterable[str], values: dict[str, str | None]) -> str:
    parts = []
    for column in columns:
        value = values[column]
        shown = NULL_PARTITION if value is None else quote(value, safe="")
        parts.append(f"{quote(column, safe='')}={shown}")
    return "/".join(parts)


# -- statistics --------------------------------------------------------------------------


class _Leaf:
    """Running statistics of one leaf column of one file."""

    __slots__ = ("path", "kind", "nulls", "low", "high", "bounded", "zeros")

    def __init__(self, path: tuple[str, ...], kind: str) -> None:
        self.path = path
        self.kind = kind  # int, float, bool, string, date, ts, ts_ntz or nulls-only
        self.nulls = 0
        self.low: Any = None
        self.high: Any = None
        self.bounded = kind != "nulls-only"
        self.zeros: set[float] = set()  # which of -0.0 and +0.0 occur, as their sign

    def update(self, column: pa.ChunkedArray) -> None:
        nulls = column.null_count
        self.nulls += nulls
        if not self.bounded or nulls == len(column):
            return
        if self.kind == "float":
            # NaN sorts differently in Spark, DataFusion and IEEE; infinities have no JSON.
            if not pc.all(pc.is_finite(column)).as_py():
                self.bounded = False
                return
        elif self.kind in ("ts", "ts_ntz"):
            column = column.cast(pa.int64())
        elif self.kind == "date":
            column = column.cast(pa.int32())
        bounds = pc.min_max(column)
        low, high = bounds["min"].as_py(), bounds["max"].as_py()
        if self.kind == "float" and low <= 0 <= high:
            self.zeros |= _signed_zeros(column)
        self.low = low if self.low is None or low < self.low else self.low
        self.high = high if self.high is None or high > self.high else self.high

    def bounds(self) -> tuple[Any, Any]:
        """JSON-ready (min, max); either is None when it cannot be stated exactly."""
        if not self.bounded or self.low is None:
            return None, None
        low, high = self.low, self.high
        if self.kind == "float":
            # -0.0 == 0.0 for min_max, but a reader ordering floats totally puts -0.0
            # first: state the zero that really is the minimum (maximum).
            if low == 0:
                low = -0.0 if -1.0 in self.zeros else 0.0
            if high == 0:
                high = 0.0 if 1.0 in self.zeros else -0.0
            return low, high
        if self.kind == "string":
            return (
                low if len(low) <= MAX_STRING_STAT_CHARS else None,
                high if len(high) <= MAX_STRING_STAT_CHARS else None,
            )
        if self.kind == "date":
            return (
                (_EPOCH + dt.timedelta(days=low)).date().isoformat(),
                (_EPOCH + dt.timedelta(days=high)).date().isoformat(),
            )
        if self.kind in ("ts", "ts_ntz"):
            suffix = "Z" if self.kind == "ts" else ""
            try:
                return (
                    (_EPOCH + dt.timedelta(microseconds=low)).isoformat("T", "microseconds")
                    + suffix,
                    (_EPOCH + dt.timedelta(microseconds=high)).isoformat("T", "microseconds")
                    + suffix,
                )
            except OverflowError:  # outside year 1..9999: no bound rather than a wrong one
                return None, None
        return low, high


def _signed_zeros(column: pa.ChunkedArray) -> set[float]:
    """The signs (-1.0, 1.0) of the zeros in a float column, told apart by their bits."""
    width = pa.int32() if pa.types.is_float32(column.type) else pa.int64()
    negative_zero = -(2 ** (width.bit_width - 1))  # only the sign bit set
    found: set[float] = set()
    for chunk in column.chunks:
        bits = chunk.view(width)
        if pc.any(pc.equal(bits, negative_zero)).as_py():
            found.add(-1.0)
        if pc.any(pc.equal(bits, 0)).as_py():
            found.add(1.0)
    return found


def _leaf_kind(arrow_type: pa.DataType) -> str | None:
    if pa.types.is_integer(arrow_type):
        return "int"
    if pa.types.is_floating(arrow_type):
        return "float"
    if pa.types.is_boolean(arrow_type):
        return "bool"
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "string"
    if pa.types.is_date32(arrow_type):
        return "date"
    if pa.types.is_timestamp(arrow_type):
        return "ts" if arrow_type.tz is not None else "ts_ntz"
    if (
        pa.types.is_decimal(arrow_type)
        or pa.types.is_binary(arrow_type)
        or pa.types.is_large_binary(arrow_type)
        or pa.types.is_fixed_size_binary(arrow_type)
    ):
        return "nulls-only"
    return None  # lists, maps, null type...: no statistics, as in Delta


class FileStats:
    """Delta statistics of one Parquet file, accumulated table by table."""

    def __init__(self, schema: pa.Schema) -> None:
        self.num_records = 0
        self._schema = schema
        self._leaves: list[_Leaf] = []
        for f in schema:
            self._add_leaves((f.name,), f.type)

    def _add_leaves(self, path: tuple[str, ...], arrow_type: pa.DataType) -> None:
        if pa.types.is_struct(arrow_type):
            for i in range(arrow_type.num_fields):
                child = arrow_type.field(i)
                self._add_leaves(path + (child.name,), child.type)
            return
        kind = _leaf_kind(arrow_type)
        if kind is not None:
            self._leaves.append(_Leaf(path, kind))

    def update(self, table: pa.Table) -> None:
        self.num_records += table.num_rows
        columns = _leaf_columns(table, self._schema)
        for leaf in self._leaves:
            leaf.update(columns[leaf.path])

    def to_json(self) -> str:
        mins: dict[str, Any] = {}
        maxs: dict[str, Any] = {}
        nulls: dict[str, Any] = {}
        for leaf in self._leaves:
            _put(nulls, leaf.path, leaf.nulls)
            low, high = leaf.bounds()
            if low is not None:
                _put(mins, leaf.path, low)
            if high is not None:
                _put(maxs, leaf.path, high)
        stats = {
            "numRecords": self.num_records,
            "minValues": mins,
            "maxValues": maxs,
            "nullCount": nulls,
        }
        return json.dumps(stats, allow_nan=False, separators=(",", ":"))


def _nullable(data_type: pa.DataType) -> pa.DataType:
    """``data_type`` with every field inside it nullable (map keys excepted)."""
    if pa.types.is_struct(data_type):
        return pa.struct([pa.field(f.name, _nullable(f.type)) for f in data_type])
    if pa.types.is_list(data_type):
        return pa.list_(pa.field(data_type.value_field.name, _nullable(data_type.value_type)))
    if pa.types.is_map(data_type):
        key = data_type.key_field
        item = data_type.item_field
        return pa.map_(
            pa.field(key.name, _nullable(key.type), nullable=False),
            pa.field(item.name, _nullable(item.type)),
        )
    return data_type


def _leaf_columns(table: pa.Table, schema: pa.Schema) -> dict[tuple[str, ...], pa.ChunkedArray]:
    """Every struct leaf as a column whose nulls include its parents' nulls."""
    out: dict[tuple[str, ...], pa.ChunkedArray] = {}

    def walk(path: tuple[str, ...], column: pa.ChunkedArray) -> None:
        out[path] = column
        if pa.types.is_struct(column.type):
            # ChunkedArray.flatten merges the struct's validity into each child.
            for i, child in enumerate(column.flatten()):
                walk(path + (column.type.field(i).name,), child)

    for f in schema:
        walk((f.name,), table.column(f.name))
    return out


def _put(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for name in path[:-1]:
        tree = tree.setdefault(name, {})
    tree[path[-1]] = value


# -- the task's writer -------------------------------------------------------------------


class _OpenFile:
    def __init__(
        self,
        storage: TableStorage,
        rel_path: str,
        schema: pa.Schema,
        partition_values: dict[str, str | None],
        compression: str,
    ) -> None:
        self.rel_path = rel_path
        self.partition_values = partition_values
        self.schema = schema
        self.rows = 0
        self.buffered: list[pa.RecordBatch] = []
        self.buffered_rows = 0
        self.buffered_bytes = 0
        self.stats = FileStats(schema)
        self._stream = storage.open_output(rel_path)
        self._writer = pq.ParquetWriter(
            self._stream,
            schema,
            compression=compression if compression != "uncompressed" else "none",
        )

    def add(self, batch: pa.RecordBatch) -> None:
        self.buffered.append(batch)
        self.rows += batch.num_rows
        self.buffered_rows += batch.num_rows
        self.buffered_bytes += batch.nbytes
        if self.buffered_rows >= ROW_GROUP_ROWS or self.buffered_bytes >= ROW_GROUP_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.buffered:
            return
        table = pa.Table.from_batches(self.buffered, schema=self.schema)
        self.stats.update(table)
        self._writer.write_table(table, row_group_size=table.num_rows)
        self.buffered, self.buffered_rows, self.buffered_bytes = [], 0, 0

    def abandon(self) -> None:
        try:
            self._writer.close()
        except Exception:  # noqa: BLE001 - the file is deleted next; only free resources
            pass
        self._stream.close()

    def close(self) -> DataFile:
        self.flush()
        self._writer.close()
        size = self._stream.tell()
        self._stream.close()
        return DataFile(
            path=self.rel_path,
            size=size,
            partition_values=self.partition_values,
            modification_time=int(time.time() * 1000),
            num_records=self.rows,
            stats=self.stats.to_json(),
        )


class TaskFileWriter:
    """Writes one task's Arrow batches as Parquet files under the table directory.

    ``schema`` is the written data's schema (partition columns included), already in its
    file form (``as_file_schema``). Rows are split by partition value; a file is rolled
    over after ``max_records_per_file`` rows when that is not 0. ``close()`` returns the
    files written, which exist on storage but are in no Delta version yet.
    """

    def __init__(
        self,
        storage: TableStorage,
        schema: pa.Schema,
        partition_by: tuple[str, ...],
        *,
        compression: str = "snappy",
        max_records_per_file: int = 0,
        file_tag: str = "00000",
    ) -> None:
        self._storage = storage
        self._schema = schema
        self._partition_by = partition_by
        self._required = [f for f in schema if requires(f)]  # NOT NULL, or holding one
        # an empty string partition value is stored as null (see partition_value)
        self._no_empty = [
            name
            for name in partition_by
            if not schema.field(name).nullable and pa.types.is_string(schema.field(name).type)
        ]
        self._compression = compression
        self._max_records = max_records_per_file
        self._data_schema = pa.schema([f for f in schema if f.name not in partition_by])
        self._prefix = f"part-{file_tag}-{uuid.uuid4()}"
        self._suffix = f".{CODECS[compression]}parquet"
        self._open: dict[tuple[str | None, ...], _OpenFile] = {}
        self._done: list[DataFile] = []
        self._count = 0
        self._buffered = 0  # bytes held by the open files' buffers

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        batch = self._conform(batch)
        if not self._partition_by:
            self._append((), batch.select(self._data_schema.names))
            return
        # The partition columns under names of their own (p0, p1, ...), beside the row
        # numbers: a column of the data may be called anything, "row" included.
        keys = [f"p{i}" for i in range(len(self._partition_by))]
        indexed = pa.Table.from_arrays(
            [*batch.select(list(self._partition_by)).columns, pa.array(np.arange(batch.num_rows))],
            names=[*keys, "row"],
        )
        groups = indexed.group_by(keys, use_threads=False).aggregate([("row", "list")])
        data = batch.select(self._data_schema.names)
        for i in range(groups.num_rows):
            key = tuple(partition_value(groups.column(c)[i].as_py()) for c in keys)
            rows = groups.column("row_list")[i].values
            self._append(key, data.take(rows))

    def buffered_bytes(self) -> int:
        """Bytes of rows held for the open files, not yet written."""
        return self._buffered

    def _bound_buffers(self) -> None:
        for opened in sorted(self._open.values(), key=lambda f: f.buffered_bytes, reverse=True):
            self._buffered -= opened.buffered_bytes
            opened.flush()
            if self._buffered <= TASK_BUFFER_BYTES // 2:
                return

    def _conform(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        try:
            found = first_forbidden_null(batch, self._required)
        except KeyError as exc:
            raise self._mismatch(batch, exc) from exc
        empty = [
            name for name in self._no_empty if pc.any(pc.equal(batch.column(name), "")).as_py()
        ]
        if found is not None or empty:
            path = found[1] if found is not None else empty[0]
            what = "column" if path in self._schema.names else "field"
            raise SinkSchemaMismatchError(
                f"The {what} {path!r} is NOT NULL in the Delta table at "
                f"{self._storage.table_uri}, but the data written holds "
                + ("null values" if found is not None else "empty strings (stored as null)")
                + " in it. Filter out or fill those nulls before writing."
            )
        if batch.schema.equals(self._schema):
            return batch
        try:
            columns = []
            for field in self._schema:
                column = batch.column(field.name)
                if column.type != field.type:
                    # Spark's types are all nullable: the table's NOT NULL flags are taken
                    # as a view (same buffers, checked above), since Arrow's cast refuses
                    # the nulls a null struct holds in its NOT NULL children.
                    column = (
                        column.view(field.type)
                        if _nullable(column.type) == _nullable(field.type)
                        else column.cast(field.type)
                    )
                columns.append(column)
            return pa.RecordBatch.from_arrays(columns, schema=self._schema)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, KeyError) as exc:
            raise self._mismatch(batch, exc) from exc

    def _mismatch(self, batch: pa.RecordBatch, exc: Exception) -> SinkSchemaMismatchError:
        return SinkSchemaMismatchError(
            f"A batch sent to the delta_rs sink has the schema {batch.schema}, which "
            f"cannot be cast to the planned schema {self._schema}: {exc}. Write a "
            "DataFrame whose schema does not change during the write."
        )

    def _append(self, key: tuple[str | None, ...], batch: pa.RecordBatch) -> None:
        offset = 0
        while offset < batch.num_rows:
            current = self._open.get(key)
            if current is None:
                current = self._open_file(key)
            room = batch.num_rows - offset
            if self._max_records:
                room = min(room, self._max_records - current.rows)
            before = current.buffered_bytes
            current.add(batch.slice(offset, room))  # may write a row group
            self._buffered += current.buffered_bytes - before
            offset += room
            if self._max_records and current.rows >= self._max_records:
                self._buffered -= current.buffered_bytes
                self._done.append(self._open.pop(key).close())
            if self._buffered > TASK_BUFFER_BYTES:
                self._bound_buffers()

    def _open_file(self, key: tuple[str | None, ...]) -> _OpenFile:
        values = dict(zip(self._partition_by, key, strict=True))
        name = f"{self._prefix}-c{self._count:03d}{self._suffix}"
        self._count += 1
        directory = partition_dir(self._partition_by, values)
        rel = f"{directory}/{name}" if directory else name
        try:
            opened = _OpenFile(self._storage, rel, self._data_schema, values, self._compression)
        except OSError as exc:
            raise DeltaSinkError(
                f"The delta_rs sink could not create the file {rel} under the table at "
                f"{self._storage.table_uri}: {exc}. Check that the location is writable "
                "from every executor (and the storage.* options for object stores)."
            ) from exc
        self._open[key] = opened
        return opened

    def close(self) -> list[DataFile]:
        for key in list(self._open):
            self._done.append(self._open.pop(key).close())
        self._buffered = 0
        return self._done

    def discard(self) -> None:
        """After a failure: delete every file this writer started (best effort). They are
        in no commit message yet, so no Delta version can refer to them."""
        paths = [f.path for f in self._done]
        for opened in self._open.values():
            paths.append(opened.rel_path)
            opened.abandon()
        self._open.clear()
        for rel in paths:
            try:
                self._storage.delete(rel)
            except OSError:
                pass  # left as an orphan for clean_orphan_files()


def option_can_name(column: str) -> bool:
    """Whether the option partitionBy (names split at commas and stripped) can name
    ``column``."""
    return "," not in column and column == column.strip()


def check_partition_columns(
    schema: pa.Schema, partition_by: tuple[str, ...], option: str | None = None
) -> None:
    """Partition columns must exist, have a supported type, and leave a data column.
    ``option``: the option partitionBy as given, read as ``partition_by``."""
    # The option is a list of names split at commas and stripped: a column whose name holds
    # a comma or outer spaces cannot be named in it, and was partitioned by other columns
    # (partitionBy='a,b' for a column 'a,b' and columns a and b) or refused as not a column.
    unnamable = [
        name for name in schema.names if not option_can_name(name) and name in (option or "")
    ]
    if unnamable:
        alias = free_alias(schema, [unnamable[0].strip().replace(",", "_")])
        raise ConfigurationError(
            f"The option partitionBy={option!r} cannot name the column {unnamable[0]!r}: the "
            f"option is a comma-separated list of names stripped of spaces (it reads "
            f"{list(partition_by)}), so a name holding a comma or leading or trailing spaces "
            "cannot be given in it. Rename the column first, e.g. "
            f"df.withColumnRenamed({unnamable[0]!r}, {alias!r}), then the option "
            f"partitionBy={alias}."
        )
    for column in partition_by:
        if column not in schema.names:
            nested = nested_field_advice(schema, column, "partitionBy", "the option partitionBy={}")
            if nested is not None:
                raise ConfigurationError(
                    f"The partition column {column!r} (option partitionBy) {nested}"
                )
            alike = [name for name in schema.names if name.lower() == column.lower()]
            raise ConfigurationError(
                f"The partition column {column!r} (option partitionBy) is not a column of the "
                + (
                    f"data: its column {alike[0]!r} differs only in case, and partition "
                    f"columns are named as the data spells them (partitionBy={alike[0]})."
                    if alike
                    else f"data, whose columns are {', '.join(map(repr, schema.names))}."
                )
            )
        arrow_type = schema.field(column).type
        if not is_partition_type(arrow_type):
            raise ConfigurationError(
                f"The partition column {column!r} has type {arrow_type}; the delta_rs sink "
                "partitions by string, integer, boolean or date columns only. Partition by "
                "a derived column of one of those types instead."
            )
    if partition_by and len(partition_by) == len(schema):
        raise ConfigurationError(
            "Every column is a partition column; a Delta table needs at least one data "
            "column outside partitionBy."
        )
