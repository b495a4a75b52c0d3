"""``ordered_wait`` and ``unordered_wait``: the operator on Spark DataFrames."""

from __future__ import annotations

import datetime as dt
import math
import numbers
import os
import re
import tempfile
import warnings
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

import pyarrow as pa

from checkpoint._types import earlier_same_names

from .._exceptions import ConfigurationError, FunctionNotSerializableError, id_ranges
from .._function import as_async_function
from .._operator import OutputMode, check_capacity_and_timeout
from .._retry import RetryStrategy
from ._columns import field_path, nested_field_advice, spark_types, void_not_null
from ._config import CheckpointConfig, restore_from_in_streaming
from ._metrics import DriverOnlyError, EnrichmentMetrics
from ._results import IntervalUnit, Units
from ._session import is_connect, task_attempts
from ._task import (
    OUTPUT_MODE_PROPERTY,
    PROGRESS_VARIABLE,
    PartitionTask,
    TaskSpec,
    function_names,
    progress_seconds,
    task_name,
)

_MAX_OOO = 2**63 - 1  # event times are 64-bit integers (microseconds, days, or the column's)

Schema = Union[str, Any]  # a DDL string or a pyspark StructType
Duration = Union[dt.timedelta, int, float]


def ordered_wait(
    df: Any,
    fn: Any,
    schema: Schema,
    *,
    capacity: int = 100,
    max_in_flight: int | None = None,
    timeout: float | dt.timedelta | None = None,
    retry: RetryStrategy | None = None,
    checkpoint: CheckpointConfig | None = None,
    metrics: EnrichmentMetrics | None = None,
) -> Any:
    """Enrich every row of ``df`` with ``fn``, many calls in flight per task; results keep
    the input order of each partition (Flink's ``AsyncDataStream.orderedWait``).

    ``fn`` is an ``AsyncFunction`` or an ``async def`` that receives one input row as a dict
    (its own copy; ``TIMESTAMP`` values as time-zone-aware datetimes in UTC, whatever the
    session's time zone; ``MAP`` values as dicts) and returns a list of result rows (dicts
    with exactly the fields of ``schema``, a DDL string or ``StructType``), holding values
    of the declared types: a result that does not match, including a value Arrow would only
    take with loss or would read as something else (2.5 for an integer field, a struct with
    keys it does not declare, a Row or namedtuple whose fields are not the struct's in
    order, a map given as pairs that repeat a key, a number for
    a timestamp or date, a naive datetime for a ``TIMESTAMP`` or an aware one for a
    ``TIMESTAMP_NTZ``, a string for an array), fails the task with ``ResultSchemaError``
    naming the field and the input row (and its record number in the partition).
    ``capacity`` bounds the rows
    in a task's queue: the calls in flight and, as in Flink, the results that wait for an
    earlier row's. Behind a slow call the queue fills with finished results, so against a
    service whose latency varies fewer calls are in flight than ``capacity``;
    ``max_in_flight`` (default: ``capacity``) bounds the calls alone, so with ``capacity``
    well above it the service sees ``max_in_flight`` calls per task through such stalls
    (README, "Ordering modes"); ``timeout`` (seconds or a ``timedelta``, per row, covering
    retries) and ``retry`` are as in ``AsyncWaitOperator``: a ``retry`` needs a
    ``timeout``, which bounds how long a row may keep retrying. With ``checkpoint``, each task
    checkpoints its progress to Delta and a failed task or a killed job resumes instead of
    starting over (see ``CheckpointConfig``). With ``metrics``, the tasks' counts (calls,
    retries, timeouts, resumes, ...) add up in that ``EnrichmentMetrics`` on the driver.
    Works on batch and streaming DataFrames.
    """
    return _async_wait(
        df,
        fn,
        schema,
        OutputMode.ORDERED,
        capacity,
        max_in_flight,
        timeout,
        retry,
        checkpoint,
        None,
        None,
        metrics,
    )


def unordered_wait(
    df: Any,
    fn: Any,
    schema: Schema,
    *,
    capacity: int = 100,
    max_in_flight: int | None = None,
    timeout: float | dt.timedelta | None = None,
    retry: RetryStrategy | None = None,
    checkpoint: CheckpointConfig | None = None,
    event_time: str | None = None,
    max_out_of_orderness: Duration | None = None,
    metrics: EnrichmentMetrics | None = None,
) -> Any:
    """Like ``ordered_wait``, but results leave each task as soon as they are ready
    (Flink's ``AsyncDataStream.unorderedWait``).

    With ``event_time`` (a top-level timestamp, date or integer column of any width; select a
    struct's field up first: ``df.withColumn('ts', F.col('s.ts'))``) each task generates
    watermarks from it with ``max_out_of_orderness`` (a timedelta or seconds for timestamp
    columns; a timedelta of whole days or days for date columns; the column's own units for
    integer columns; default 0, for input in event-time order); results are then
    reordered only between two watermarks, never across one. A watermark is the largest
    event time read so far minus ``max_out_of_orderness`` (just below it), advanced every
    1,024 rows or fewer, and never lowered (a resumed task carries on from the one its
    checkpoint recorded; a job resumed with another ``event_time`` column or
    ``max_out_of_orderness`` starts its watermarks afresh, from its own setting). Spark rows
    carry no event time, so what shapes the output is where watermarks fall: wherever the
    largest event time grew, whatever ``max_out_of_orderness`` is; their values are what
    checkpoints keep. A row whose event time is null does not move it; a row older than the
    last watermark is not dropped: like any row, it stays between the watermarks it was read
    between. Without ``event_time`` a finished result leaves at once, so ``capacity`` bounds
    the calls in flight alone; with it, results after a watermark wait, in the queue, for
    every row before the watermark, and ``max_in_flight`` below ``capacity`` keeps the calls
    in flight up meanwhile, as in ``ordered_wait``.
    """
    return _async_wait(
        df,
        fn,
        schema,
        OutputMode.UNORDERED,
        capacity,
        max_in_flight,
        timeout,
        retry,
        checkpoint,
        event_time,
        max_out_of_orderness,
        metrics,
    )


def _async_wait(
    df: Any,
    fn: Any,
    schema: Schema,
    mode: OutputMode,
    capacity: int,
    max_in_flight: int | None,
    timeout: float | dt.timedelta | None,
    retry: RetryStrategy | None,
    checkpoint: CheckpointConfig | None,
    event_time: str | None,
    max_out_of_orderness: Duration | None,
    metrics: EnrichmentMetrics | None,
) -> Any:
    from pyspark.sql import DataFrame

    if not isinstance(df, DataFrame):
        kind = type(df)
        hint = (
            ": make one with spark.createDataFrame(...)"
            if kind.__module__.split(".")[0] in ("pandas", "pyarrow", "polars")
            else ""
        )
        raise ConfigurationError(
            "The first argument must be a pyspark DataFrame; got "
            f"{kind.__module__}.{kind.__qualname__}{hint}."
        )
    function = as_async_function(fn)
    capacity, max_in_flight, seconds = check_capacity_and_timeout(
        capacity, timeout, retry, max_in_flight
    )
    if checkpoint is not None and not isinstance(checkpoint, CheckpointConfig):
        raise ConfigurationError(
            f"checkpoint must be a CheckpointConfig; got {type(checkpoint).__name__}."
        )
    if metrics is not None and not isinstance(metrics, EnrichmentMetrics):
        raise ConfigurationError(
            f"metrics must be an EnrichmentMetrics (EnrichmentMetrics(spark)); got "
            f"{type(metrics).__name__}."
        )
    struct = _output_struct(schema)
    _check_names_apart(df, struct)
    columns = df.columns
    if not columns:
        raise ConfigurationError(
            "The input DataFrame has no columns: Spark hands mapInArrow no rows of such a "
            "DataFrame (however many it has), so the function would never be called and "
            "the output would be empty. Keep at least one column, e.g. "
            "df.withColumn('row', F.monotonically_increasing_id())."
        )
    twice = sorted({name for name in columns if columns.count(name) > 1})
    if twice:
        raise ConfigurationError(
            f"The input DataFrame has more than one column named {', '.join(map(repr, twice))} "
            "(after a join, for example); each row reaches the function as a dict, which "
            "holds one value per name. Rename or drop the duplicates first "
            "(DataFrame.withColumnRenamed, or select with aliases)."
        )
    input_schema = _arrow_schema(df.schema, "input")
    output_schema = _arrow_schema(struct, "output")
    event_time = _resolve_column(df, event_time)
    ooo = _event_time(df, event_time, max_out_of_orderness)
    if checkpoint is not None:
        if checkpoint.restore_from is not None and (
            df.isStreaming or _in_micro_batch(df.sparkSession)
        ):
            raise ConfigurationError(restore_from_in_streaming(checkpoint.restore_from))
        _check_checkpoint(checkpoint, input_schema, output_schema, mode, function_names(function))
        upstream = _upstream_functions(df)
        _refuse_if_tables_taken_upstream(upstream, mode, checkpoint)
        _warn_if_tasks_never_retry(df.sparkSession)
        _warn_if_after_unordered_wait(upstream, mode)
    _check_progress_setting(df.sparkSession)
    source, input_names = _resolvable(df)
    spec = TaskSpec(
        fn=function,
        mode=mode,
        capacity=capacity,
        max_in_flight=max_in_flight,
        timeout=seconds,
        retry=retry,
        input_schema=input_schema,
        output_schema=output_schema,
        event_time=event_time,
        max_out_of_orderness=ooo,
        checkpoint=checkpoint,
        app_id=_app_id(df.sparkSession),
        metrics=None if metrics is None else metrics.accumulator,
        input_names=input_names,
        app_start=_app_start(df.sparkSession),
        output_units=interval_units(struct),
    )
    task = PartitionTask(spec)
    _check_picklable(task, fn, retry)
    return source.mapInArrow(task, struct)


def _in_micro_batch(spark: Any) -> bool:
    """Whether this runs inside a streaming query's micro-batch (foreachBatch), on a classic
    session (Spark Connect runs foreachBatch on the server; the task refuses it there
    where it can see the batch)."""
    try:
        return spark.sparkContext.getLocalProperty("streaming.sql.batchId") is not None
    except Exception:  # Spark Connect: no SparkContext
        return False


def _resolvable(df: Any) -> tuple[Any, tuple[str, ...] | None]:
    """``df`` as ``mapInArrow`` can take it, and the column names the task gives its rows
    back. mapInArrow resolves every input column by name, and a name with a dot in it
    (``a.b``, common after flattening JSON) reads as a struct field: UNRESOLVED_COLUMN; one
    with a backtick cannot be parsed (INVALID_ATTRIBUTE_NAME_SYNTAX), ``*`` is a star, and
    two names that differ only in case are AMBIGUOUS_REFERENCE (unless
    spark.sql.caseSensitive). Such an input goes to Spark under positional names instead
    (``toDF`` renames by position)."""
    names = df.columns
    special = any("." in name or "`" in name or "*" in name for name in names)
    if not special and len({name.lower() for name in names}) == len(names):
        return df, None
    return df.toDF(*[f"_stateful_async_{i}" for i in range(len(names))]), tuple(names)


def _output_struct(schema: Schema) -> Any:
    from pyspark.sql.types import StructType

    struct = _parse_output_struct(schema)
    names = [field.name for field in struct.fields]
    if not names:
        raise ConfigurationError(
            f"The output schema {schema!r} has no fields: name the fields your function's "
            "results have, e.g. 'id long, score double'."
        )
    # At any depth: a struct's value is a dict too, and Arrow's struct of two fields named
    # alike failed every task ("not all nodes, buffers and variadicBufferCounts were consumed");
    # counted by exact name, whatever case twins it also has ('A', 'a', 'a')
    twice = sorted(
        {
            field_path(path, name)
            for path, nested in spark_types(struct)
            if isinstance(nested, StructType)
            for name, count in Counter(nested.fieldNames()).items()
            if count > 1
        }
    )
    if twice:
        raise ConfigurationError(
            f"The output schema {struct.simpleString()!r} names the field(s) {twice} more than "
            "once; a result is a dict, and so is a struct's value, so each field needs a name "
            "of its own."
        )
    return struct


def _check_names_apart(df: Any, struct: Any) -> None:
    """Spark resolves column names ignoring case unless ``spark.sql.caseSensitive`` is set:
    output fields that differ only in case would make the enriched DataFrame's columns
    ambiguous to every later ``select`` (AMBIGUOUS_REFERENCE, after the job has run), as
    would a struct's fields inside them (AMBIGUOUS_REFERENCE_TO_FIELDS)."""
    if df.sparkSession.conf.get("spark.sql.caseSensitive", "false").lower() == "true":
        return
    found = _names_alike(struct)
    if found is not None:
        other, name = found
        what = "field" if "." in name else "column"
        raise ConfigurationError(
            f"The output schema {struct.simpleString()!r} has the fields {other!r} and "
            f"{name!r}, which Spark takes for one {what} (it ignores case in names unless "
            "spark.sql.caseSensitive is true): rename one of them."
        )


def _names_alike(data_type: Any) -> tuple[str, str] | None:
    """The paths of two fields of a struct inside ``data_type`` whose names differ only in
    case, if it has such a struct (the first such field, and the first before it)."""
    from pyspark.sql.types import StructType

    for path, nested in spark_types(data_type):
        if isinstance(nested, StructType):
            names = nested.fieldNames()
            for name, earlier in zip(names, earlier_same_names(names), strict=True):
                if earlier is not None and earlier != name:  # not a name given twice
                    return field_path(path, earlier), field_path(path, name)
    return None


def _parse_output_struct(schema: Schema) -> Any:
    from pyspark.sql.types import StructType, _parse_datatype_string

    if isinstance(schema, StructType):
        return schema
    if isinstance(schema, str):
        try:
            parsed = _parse_datatype_string(schema)
        except Exception as exc:
            raise ConfigurationError(
                f"The output schema {schema!r} is not a valid DDL string "
                f"(e.g. 'id long, score double'): {exc}"
            ) from exc
        if isinstance(parsed, StructType):
            return parsed
    raise ConfigurationError(
        f"schema must be a DDL string like 'id long, score double' or a StructType; got {schema!r}."
    )


def _first_nested(data_type: Any, kind: Any, path: str = "") -> tuple[str, Any] | None:
    """The path and type of the first type of ``kind`` (a class or a tuple of them) inside
    ``data_type``, outermost first; None if it holds none."""
    return next(((p, t) for p, t in spark_types(data_type, path) if isinstance(t, kind)), None)


def _udt_refusal(what: str, path: str, udt: Any) -> ConfigurationError:
    """Spark hands a user-defined type to Arrow, and so to the function, as its storage
    type: an ML vector as {type, size, indices, values}, and takes a result only in it."""
    name = type(udt).__name__
    if name == "VectorUDT":
        advice = (
            "Pass it as an array instead: select vector_to_array(col) AS col first (from "
            "pyspark.ml.functions), for a list of floats; or drop the column if the function "
            "does not read it."
            if what == "input"
            else "Return a list of floats in an ARRAY<DOUBLE> field instead, and "
            "array_to_vector(col) of it after (from pyspark.ml.functions)."
        )
    else:
        advice = (
            "Convert it to plain columns first (the type's own functions, or a UDF), or "
            "drop it if the function does not read it."
            if what == "input"
            else "Declare plain types in the schema instead, and convert after."
        )
    return ConfigurationError(
        f"The {what} field {path!r} is a user-defined type ({name}), which Spark hands to "
        "Arrow (mapInArrow, which the adapter runs on) as its storage type, "
        f"{udt.sqlType().simpleString()}: "
        + (
            "the function would get that struct, not the object. "
            if what == "input"
            else "a result would have to be that struct, not the object. "
        )
        + advice
    )


def _char_field(struct: Any) -> tuple[Any, str, Any] | None:
    """The first CHAR or VARCHAR inside ``struct``: the top-level field holding it, its
    path and its type; None if it holds none."""
    from pyspark.sql.types import CharType, VarcharType

    for field in struct.fields:
        if found := _first_nested(field.dataType, (CharType, VarcharType), field.name):
            return field, *found
    return None


def _with_strings(data_type: Any) -> Any:
    """``data_type`` with STRING in place of each CHAR and VARCHAR inside it."""
    from pyspark.sql.types import (
        ArrayType,
        CharType,
        MapType,
        StringType,
        StructField,
        StructType,
        VarcharType,
    )

    if isinstance(data_type, (CharType, VarcharType)):
        return StringType()
    if isinstance(data_type, StructType):
        return StructType(
            [
                StructField(f.name, _with_strings(f.dataType), f.nullable, f.metadata)
                for f in data_type.fields
            ]
        )
    if isinstance(data_type, ArrayType):
        return ArrayType(_with_strings(data_type.elementType), data_type.containsNull)
    if isinstance(data_type, MapType):
        return MapType(
            _with_strings(data_type.keyType),
            _with_strings(data_type.valueType),
            data_type.valueContainsNull,
        )
    return data_type


def _sql_type(data_type: Any, not_null: bool = False) -> str:
    """``data_type`` as Spark SQL reads it in a cast or a DDL string: its simpleString,
    with a struct's field names in backticks where they hold more than letters, digits
    and underscores (simpleString leaves ``struct<a b:string>``, which does not parse).
    ``not_null``: with NOT NULL after a struct's fields that are (simpleString drops it;
    a DDL string keeps it, and an array's or a map's values have no words for it)."""
    from pyspark.sql.types import ArrayType, MapType, StructType

    if isinstance(data_type, StructType):
        fields = (
            f"{_sql_name(f.name)}:{_sql_type(f.dataType, not_null)}"
            + (" NOT NULL" if not_null and not f.nullable else "")
            for f in data_type.fields
        )
        return f"struct<{','.join(fields)}>"
    if isinstance(data_type, ArrayType):
        return f"array<{_sql_type(data_type.elementType, not_null)}>"
    if isinstance(data_type, MapType):
        key, value = (_sql_type(t, not_null) for t in (data_type.keyType, data_type.valueType))
        return f"map<{key},{value}>"
    return str(data_type.simpleString())


_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _sql_name(name: str) -> str:
    """A field name as Spark SQL reads it: as it is if plain, else in backticks."""
    return name if _PLAIN_NAME.fullmatch(name) else _backticked(name)


def _backticked(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


_INTERVAL_FIELDS = {
    0: ("day", 86_400_000_000),
    1: ("hour", 3_600_000_000),
    2: ("minute", 60_000_000),
}


def interval_units(data_type: Any) -> Units:
    """The ``Units`` of ``data_type`` for ``to_batch``: where its DAY-TIME intervals end
    above seconds, which its Arrow type does not say (each is a duration in microseconds);
    None if none do."""
    from pyspark.sql.types import ArrayType, DayTimeIntervalType, MapType, StructType

    if isinstance(data_type, DayTimeIntervalType):
        if data_type.endField not in _INTERVAL_FIELDS:  # ... TO SECOND
            return None
        name, micros = _INTERVAL_FIELDS[data_type.endField]
        return IntervalUnit(name, micros, data_type.simpleString())
    if isinstance(data_type, StructType):
        children = tuple(interval_units(field.dataType) for field in data_type.fields)
    elif isinstance(data_type, ArrayType):
        children = (interval_units(data_type.elementType),)
    elif isinstance(data_type, MapType):
        children = (interval_units(data_type.keyType), interval_units(data_type.valueType))
    else:
        return None
    return None if all(child is None for child in children) else children


def _arrow_schema(struct: Any, what: str) -> pa.Schema:
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import UserDefinedType, VariantType, YearMonthIntervalType

    variant = _first_nested(struct, VariantType)
    if variant is not None:  # Arrow carries it as its encoded bytes: {value, metadata}
        raise ConfigurationError(
            f"The {what} field {variant[0]!r} is a VARIANT, which would reach Python as its "
            "encoded bytes. "
            + (
                "Pass it as JSON text instead: select to_json(col) AS col first."
                if what == "input"
                else "Return JSON text in a STRING field instead, and parse_json() it after."
            )
        )
    udt = _first_nested(struct, UserDefinedType)
    if udt is not None:
        raise _udt_refusal(what, *udt)
    char = _char_field(struct)
    if char is not None:  # a DDL string's char(n), or a table's with preserveCharVarcharTypeInfo
        top, path, char_type = char
        name = _backticked(top.name)
        as_string = _sql_type(_with_strings(top.dataType), not_null=what == "output")
        not_null = "" if top.nullable else " NOT NULL"  # (a cast keeps the column's own)
        raise ConfigurationError(
            f"The {what} field {path!r} is a {char_type.simpleString()}, which Spark cannot "
            "hand to Arrow (mapInArrow, which the adapter runs on, needs Arrow-compatible "
            "columns); a CHAR or VARCHAR is a STRING whose length Spark checks. "
            + (
                f"Cast it to a string first: select cast({name} AS {as_string}) AS {name}."
                if what == "input"
                else f"Declare it a string instead: {name} {as_string}{not_null}."
            )
        )
    interval = _first_nested(struct, YearMonthIntervalType)
    if interval is not None:  # Spark has no Arrow type for them (DAY TO SECOND: durations)
        path, interval_type = interval
        nested = (
            ""
            if path in struct.names
            else " (inside a struct, an array or a map: do it there, with withField, "
            "transform, transform_keys or transform_values)"
        )
        raise ConfigurationError(
            f"The {what} field {path!r} is an {interval_type.simpleString()}, which Spark "
            "cannot hand to Arrow (mapInArrow, which the adapter runs on, needs Arrow-"
            "compatible columns). "
            + (
                "Pass it as its number of months instead: select cast(cast(col AS interval "
                f"year to month) AS int) AS col first{nested} (a cast to int alone gives "
                "years for an interval year). DAY TO SECOND intervals go through as they are."
                if what == "input"
                else f"Return its number of months in an INT field instead{nested}, and "
                "make_ym_interval(0, col) of it after."
            )
        )
    void = void_not_null(struct)
    if void:  # to_arrow_schema would fail naming no field
        raise ConfigurationError(
            f"The {what} field {void[0]!r} has no type (void: the elements of an empty "
            "array(), the keys and values of an empty create_map()) and Spark declares it NOT "
            "NULL, which Arrow cannot carry (mapInArrow, which the adapter runs on, needs "
            "Arrow-compatible columns). "
            + (
                "Cast the empty array or map to the type it stands for first, e.g. "
                "F.array().cast('array<string>')."
                if what == "input"
                else "Declare the type it stands for instead, e.g. array<string>."
            )
        )
    try:
        return to_arrow_schema(struct, timezone="UTC")
    except Exception as exc:
        raise ConfigurationError(
            f"The {what} schema has a type Arrow cannot carry ({exc}); mapInArrow, which "
            "the adapter runs on, needs Arrow-compatible columns."
        ) from exc


def _resolve_column(df: Any, name: Any) -> Any:
    """The input column ``name`` means, as Spark resolves names: with its default
    ``spark.sql.caseSensitive=false``, ``event_time="TS"`` is the column ``ts``."""
    if not isinstance(name, str):
        return name
    sensitive = str(df.sparkSession.conf.get("spark.sql.caseSensitive", "false")).lower()
    if sensitive == "true":
        return name
    matches = [c for c in df.columns if c.lower() == name.lower()]
    if len(matches) > 1:
        raise ConfigurationError(
            f"event_time {name!r} names the columns {', '.join(map(repr, matches))}, which "
            "Spark tells apart only with spark.sql.caseSensitive=true: rename one of them."
        )
    return matches[0] if matches else name


def _event_time(df: Any, column: str | None, ooo: Duration | None) -> int:
    from pyspark.sql.types import (
        ByteType,
        DateType,
        IntegerType,
        LongType,
        ShortType,
        TimestampNTZType,
        TimestampType,
    )

    if column is None:
        if ooo is not None:
            raise ConfigurationError(
                "max_out_of_orderness needs event_time: name the column the watermarks come from."
            )
        return 0
    if not isinstance(column, str):
        raise ConfigurationError(
            f"event_time must be a column name: a str such as event_time='ts'; got {column!r}."
        )
    fields = {f.name: f.dataType for f in df.schema.fields}
    if column not in fields:
        unquoted = column[1:-1].replace("``", "`")
        if column[:1] == column[-1:] == "`" and unquoted in fields:  # as Spark SQL quotes it
            raise ConfigurationError(
                f"event_time takes a column's name as it is, without Spark's backticks: "
                f"event_time={unquoted!r}, not {column!r}."
            )
        sensitive = str(df.sparkSession.conf.get("spark.sql.caseSensitive", "false")).lower()
        schema = _arrow_schema(df.schema, "input")
        nested = nested_field_advice(
            schema, column, "event_time", "event_time={}", sensitive == "true"
        )
        raise ConfigurationError(
            f"event_time {column!r} {nested}"
            if nested is not None
            else f"event_time column {column!r} is not in the DataFrame; its columns are "
            f"{sorted(fields)}."
        )
    kind = fields[column]
    if isinstance(kind, (TimestampType, TimestampNTZType)):
        unit, per, scale = "seconds", dt.timedelta(seconds=1), 1_000_000  # held in µs
    elif isinstance(kind, DateType):
        unit, per, scale = "days", dt.timedelta(days=1), 1
    elif isinstance(kind, (LongType, IntegerType, ShortType, ByteType)):
        unit, per, scale = "the column's own units", None, 1
    else:
        raise ConfigurationError(
            f"event_time column {column!r} has type {kind.simpleString()}; use a timestamp, "
            "date or integer column."
        )
    if ooo is None:
        return 0
    import numpy as np

    given = ooo
    if isinstance(ooo, np.timedelta64):  # an Integral to `numbers`, but a duration
        # months and years have no fixed length, and no unit at all is read as
        # microseconds by numpy but as nanoseconds by pandas: neither is a duration
        if not np.isnat(ooo) and np.datetime_data(ooo.dtype)[0] in ("generic", "M", "Y"):
            raise ConfigurationError(
                f"max_out_of_orderness {given!r} has no fixed length (a numpy timedelta64 in "
                "months or years, or without a unit): give it with a unit, such as "
                "np.timedelta64(5, 's'), or as a timedelta."
            )
        try:
            ooo = dt.timedelta(microseconds=float(ooo / np.timedelta64(1, "us")))
        except (OverflowError, ValueError):  # NaT, or beyond timedelta's range
            ooo = -1  # refused below
    if isinstance(ooo, dt.timedelta):
        if per is None:
            raise ConfigurationError(
                f"event_time column {column!r} is an integer: give max_out_of_orderness in its "
                "units, as a number."
            )
        amount: Any = ooo / per
    elif isinstance(ooo, numbers.Real) and not isinstance(ooo, bool):
        amount = float(ooo) if not isinstance(ooo, numbers.Integral) else int(ooo)
    else:
        amount = None
    if amount is None or not 0 <= amount < math.inf:
        raise ConfigurationError(
            f"max_out_of_orderness must be a finite duration >= 0: a timedelta, or a number "
            f"in the column's units ({column!r}: {unit}); got {given!r}."
        )
    amount *= scale
    if scale == 1 and amount != int(amount):
        raise ConfigurationError(
            f"event_time column {column!r} is {'a date' if per else 'an integer'}: "
            f"max_out_of_orderness must be a whole number of {unit}; got {given!r}."
        )
    if amount > _MAX_OOO:
        raise ConfigurationError(
            f"max_out_of_orderness {given!r} is beyond what event times can differ by (they "
            "are held as 64-bit integers); give a smaller one."
        )
    return round(amount)


def _check_checkpoint(
    config: CheckpointConfig,
    input_schema: pa.Schema,
    output_schema: pa.Schema,
    mode: OutputMode,
    function: tuple[str, ...],
) -> None:
    """What the driver can check before any task runs (``function``: the names of the
    enrichment's function, as checkpoints record it, see ``function_names``)."""
    from checkpoint import (
        CheckpointError,
        CheckpointNotFoundError,
        SchemaChangedError,
        SnapshotStore,
    )
    from checkpoint._types import storage_type

    for column, schema in (("input", input_schema), ("result", output_schema)):
        storage_type(pa.struct(list(schema)), column)  # what the store cannot hold, named
    _check_local_location(str(config.location))
    store = SnapshotStore(config.location, config.storage_options)
    try:
        try:  # a few listings, not the whole location's: each is a request on object stores
            subtasks = store.subtasks(config.job_id, config.operator_id) if _exists(store) else []
        except CheckpointNotFoundError:
            subtasks = []
        has_job = bool(subtasks)
        if has_job:
            log = store.subtask(config.job_id, config.operator_id, subtasks[0])
            log.check_schemas(input_schema, output_schema)
        if config.restore_from is None:
            return
        # one read of every partition's checkpoints, expired ones too (for the messages)
        every = (
            store.checkpoints(config.job_id, config.operator_id, include_expired=True)
            if has_job
            else []
        )
        metas = [m for m in every if not m.expired]
        if not metas:
            raise ConfigurationError(
                f"restore_from={config.restore_from!r}, but job {config.job_id!r} (operator "
                f"{config.operator_id!r}) has no checkpoints at {config.location}"
                f"{_what_is_there(store, config)}. Check the location and job_id, or drop "
                "restore_from to start fresh."
            )
        if config.restore_from != "latest":
            wanted = int(config.restore_from)
            ids = sorted({m.checkpoint_id for m in metas})
            if wanted < ids[0]:
                expired = sorted(
                    m.checkpoint_id for m in every if m.expired and m.checkpoint_id <= wanted
                )
                raise ConfigurationError(
                    f"restore_from={wanted}, but job {config.job_id!r} has no restorable "
                    f"checkpoint with id {wanted} or lower"
                    + (
                        f" ({'checkpoint' if len(set(expired)) == 1 else 'checkpoints'} "
                        f"{id_ranges(expired)} "
                        f"{'has' if len(set(expired)) == 1 else 'have'} expired: `retain` "
                        "keeps only the newest of each partition)"
                        if expired
                        else ""
                    )
                    + f". Restorable checkpoint ids: {id_ranges(ids)}."
                )
            if wanted > ids[-1]:  # a typo, most likely: no partition got that far
                raise ConfigurationError(
                    f"restore_from={wanted}, but no partition of job {config.job_id!r} reached "
                    f"checkpoint {wanted}. Checkpoint ids that exist: {id_ranges(ids)}; "
                    "restore_from='latest' resumes from the newest."
                )
            _check_every_partition_can_restore(every, wanted, config)
        points = _restore_points(every, config)  # what each partition's task resumes
        if mode is OutputMode.ORDERED:
            _check_order_kept(points, config)
        _warn_if_function_changed(points, config, function)
    except CheckpointError as exc:
        if isinstance(exc, SchemaChangedError):
            raise
        raise ConfigurationError(
            f"Cannot use checkpoint location {config.location}: {exc}"
        ) from exc


def _check_every_partition_can_restore(
    metas: list[Any], wanted: int, config: CheckpointConfig
) -> None:
    """Each partition numbers and expires its own checkpoints, so an id one partition can
    restore from may have expired in another: that partition's task would fail (after all
    of Spark's attempts). Refuse up front, naming the ids every partition can restore from."""
    by_partition: dict[int, list[Any]] = {}
    for meta in metas:
        by_partition.setdefault(meta.subtask, []).append(meta)

    def stuck(at: int) -> list[int]:  # partitions that had checkpoints <= at, none restorable
        return sorted(
            p
            for p, ms in by_partition.items()
            if any(m.checkpoint_id <= at for m in ms)
            and not any(m.checkpoint_id <= at and not m.expired for m in ms)
        )

    partitions = stuck(wanted)
    if not partitions:
        return
    details = "; ".join(
        f"partition {p}: {id_ranges([m.checkpoint_id for m in ms if m.checkpoint_id <= wanted])}"
        f" expired, restorable {id_ranges([m.checkpoint_id for m in ms if not m.expired])}"
        for p in partitions[:5]
        for ms in [by_partition[p]]
    ) + ("; ..." if len(partitions) > 5 else "")
    usable = sorted(
        {m.checkpoint_id for m in metas if not m.expired and not stuck(m.checkpoint_id)}
    )
    raise ConfigurationError(
        f"restore_from={wanted}: {len(partitions)} partition(s) of job {config.job_id!r} have no "
        f"restorable checkpoint with id {wanted} or lower ({details}). Each partition numbers "
        "its own checkpoints and `retain` keeps the newest of each, so one id may be "
        "restorable in one partition and expired in another. Ids every partition can resume "
        f"from: {id_ranges(usable)}; restore_from='latest' resumes each "
        "partition from its newest."
    )


def _restore_points(every: list[Any], config: CheckpointConfig) -> dict[int, Any]:
    """The checkpoint each partition's task resumes from under ``config.restore_from``, by
    partition (partitions with none left out)."""
    from checkpoint._store import newest_restorable

    restore = config.restore_from
    max_id = restore if isinstance(restore, int) else None  # "latest": no bound
    by_partition: dict[int, list[Any]] = {}
    for meta in every:
        by_partition.setdefault(meta.subtask, []).append(meta)
    points = {}
    for partition, metas in sorted(by_partition.items()):
        metas.sort(key=lambda m: (m.created_at, m.checkpoint_id))  # as SubtaskLog lists them
        chosen = newest_restorable(metas, max_id=max_id)  # what the partition's task picks
        if chosen is not None:
            points[partition] = chosen
    return points


def _check_order_kept(points: dict[int, Any], config: CheckpointConfig) -> None:
    """ordered_wait cannot resume from unordered_wait's checkpoints (their results are in
    completion order; the task refuses, see _TaskRun._check_order_kept): refuse up front,
    rather than after all of Spark's attempts of the first such task. ``points``: see
    ``_restore_points``."""
    unordered = [
        partition
        for partition, chosen in points.items()
        if chosen.properties.get(OUTPUT_MODE_PROPERTY) == OutputMode.UNORDERED.value
    ]
    if unordered:
        raise ConfigurationError(
            f"restore_from={config.restore_from!r}: job {config.job_id!r} (operator "
            f"{config.operator_id!r}) would resume partition(s) {id_ranges(unordered)} from "
            "checkpoints that unordered_wait wrote, and this is ordered_wait. Their results "
            "were emitted in completion order; re-emitting them would break ordered_wait's "
            "input order. Resume with unordered_wait, or start ordered_wait fresh: drop "
            "restore_from, or give it a new operator_id (CheckpointConfig(..., operator_id=...))."
        )


def _warn_if_function_changed(
    points: dict[int, Any], config: CheckpointConfig, ours: tuple[str, ...]
) -> None:
    """A resumed partition re-emits the results its checkpoints committed as they are, and
    calls this job's function for the rest: if another function wrote them, the output
    mixes the two. That may be wanted (the same enrichment renamed or moved to a module),
    so it is said, not refused."""
    by_function: dict[str, list[int]] = {}
    for partition, chosen in points.items():
        theirs = chosen.properties.get("function")
        if theirs is not None and theirs not in ours:
            by_function.setdefault(theirs, []).append(partition)
    if not by_function:
        return
    written = "; ".join(
        f"partition(s) {id_ranges(partitions)} from checkpoints function {theirs} wrote"
        for theirs, partitions in sorted(by_function.items())
    )
    warnings.warn(
        f"restore_from={config.restore_from!r}: job {config.job_id!r} (operator "
        f"{config.operator_id!r}) resumes {written}, and this job calls function {ours[0]}. "
        "The results those checkpoints committed are re-emitted as they are; this function "
        "computes the rest of each partition. If it is the same enrichment renamed or moved, "
        "that is what you want; to compute every row with this function, drop restore_from "
        "or give it a new operator_id (CheckpointConfig(..., operator_id=...)).",
        UserWarning,
        stacklevel=5,  # the call of ordered_wait / unordered_wait
    )


def _app_id(session: Any) -> str:
    """The application's id (run ids start with it), from the SparkContext, or on Spark
    Connect, which has none, from the session's conf (Spark copies it there)."""
    if not is_connect(session):
        return str(session.sparkContext.applicationId)
    return str(session.conf.get("spark.app.id"))  # raises if missing, never a blank id


def _app_start(session: Any) -> str:
    """When the application's SparkContext started (ms since the epoch; on Spark Connect
    from the session's conf, where Spark copies it). An application id can repeat (a YARN
    application attempt; a fixed spark.app.id and a SparkContext made again in one
    process), and task attempt and stage ids start from 0 in each SparkContext: with the
    start time, run ids and task attempt owners name one SparkContext's."""
    if not is_connect(session):
        return str(session.sparkContext.startTime)
    return str(session.conf.get("spark.app.startTime"))


#: logical plan nodes that keep their input's partitions and order, one stage with it
_SAME_STAGE = frozenset(
    {"Project", "Filter", "SubqueryAlias", "MapInArrow", "MapInPandas", "Union", "Sample",
     "Generate", "Expand", "ResolvedHint", "LocalLimit", "MapPartitions", "CollectMetrics",
     "EventTimeWatermark"}
)  # fmt: skip


def _upstream_functions(df: Any) -> dict[str, bool]:
    """The functions of the MapInArrow nodes in the plan of ``df`` (as Spark caches it: a
    persisted DataFrame is a leaf), each with whether it runs in the same stage as ``df``
    (only narrow steps after it). One walk of the plan, read through py4j node by node.
    Spark Connect's plans cannot be walked from the client: none there, as for anything
    this cannot read (a heuristic: it never fails the user's call)."""
    found: dict[str, bool] = {}
    try:
        plan = df._jdf.queryExecution()
        # a streaming plan has no cached form (Spark refuses to make one outside a query)
        root = plan.analyzed() if df.isStreaming else plan.withCachedData()
        pending, seen = [(root, True)], 0
        while pending and seen < 1000:  # a plan of thousands of nodes: look no further
            (node, same_stage), seen = pending.pop(), seen + 1
            kind = node.nodeName()
            if kind == "MapInArrow":
                name = node.functionExpr().name()
                found[name] = found.get(name, False) or same_stage
            narrow = kind in _SAME_STAGE or (kind == "Repartition" and not node.shuffle())
            children = node.children()  # coalesce() is a Repartition without shuffle
            pending.extend(
                (children.apply(i), same_stage and narrow) for i in range(children.size())
            )
    except Exception:
        return found
    return found


def _after_unordered_wait(upstream: dict[str, bool]) -> bool:
    """Whether the input is the output of an unordered_wait without checkpoints with only
    narrow steps after it (``upstream``: ``_upstream_functions``). A checkpointed one hands
    over only committed results, which its retry re-emits in the same order."""
    return upstream.get(task_name(OutputMode.UNORDERED), False)


def _refuse_if_tables_taken_upstream(
    upstream: dict[str, bool], mode: OutputMode, checkpoint: CheckpointConfig
) -> None:
    """Two checkpointed enrichments of one plan with the same location, ``job_id`` and
    ``operator_id`` would write the same checkpoint tables: in one stage they are one run
    and refuse each other's checkpoints (or schemas), on every task attempt; in two, each
    one's retention expires the other's checkpoints (``upstream``: ``_upstream_functions``
    of the input)."""
    for upstream_mode in OutputMode:
        if task_name(upstream_mode, checkpoint) in upstream:
            raise ConfigurationError(
                f"This {task_name(mode)} checkpoints as job {checkpoint.job_id!r}, operator "
                f"{checkpoint.operator_id!r} at {checkpoint.location}, and so does the "
                f"{task_name(upstream_mode)} whose output it reads: both would write the same "
                "checkpoint tables, and neither could resume. Give each enrichment its own "
                "operator_id (CheckpointConfig(..., operator_id='...'))."
            )


def _warn_if_after_unordered_wait(upstream: dict[str, bool], mode: OutputMode) -> None:
    """A checkpointed enrichment resumes only over input that comes in the same order on
    every attempt; unordered_wait's results come in completion order. Chained after one
    without checkpoints in the same stage (nothing between but narrow steps), its retries
    fail with InputMismatchError: say so before the job."""
    if not _after_unordered_wait(upstream):
        return
    warnings.warn(
        f"This checkpointed {task_name(mode)} reads the output of an unordered_wait without "
        "checkpoints in the same Spark stage. Its results come in completion order, which "
        "differs from attempt to attempt, so a retried task of this enrichment almost always "
        "reads other input than its checkpoint consumed and cannot resume (it fails with "
        "InputMismatchError on every attempt); the job then fails. Give that unordered_wait "
        "a checkpoint too (a retry re-emits its committed results in their order), use "
        "ordered_wait there, sort its output within partitions by a unique key "
        "(sortWithinPartitions), or write it out and read it back first.",
        UserWarning,
        stacklevel=4,  # the call of ordered_wait / unordered_wait
    )


def _check_progress_setting(session: Any) -> None:
    """The executors' progress interval, as far as the driver sees it (the session's
    ``spark.executorEnv``; in local mode the tasks' environment is the driver's): a bad
    one would fail every task."""
    try:
        master, setting = _settings(session, f"spark.executorEnv.{PROGRESS_VARIABLE}")
    except Exception:  # nothing to check against: the tasks check it
        return
    _check_progress(setting, master, os.environ)


def _check_progress(setting: str | None, master: str, environ: Mapping[str, str]) -> None:
    """The progress interval the executors will see: the session's ``spark.executorEnv``
    setting, over the environment they inherit (in local mode, ``environ``, the driver's)."""
    if setting is not None:
        progress_seconds(setting, f"the session's spark.executorEnv.{PROGRESS_VARIABLE}")
    elif master.startswith("local") and environ.get("STATEFUL_ASYNC_TASK_LOG") != "0":
        progress_seconds(environ.get(PROGRESS_VARIABLE), "the driver's environment")


def _settings(session: Any, key: str) -> tuple[str, str | None]:
    """The session's master and its setting ``key`` (None if unset), as the context was
    given them (Spark Connect has no SparkContext: its conf has them)."""
    if is_connect(session):
        return session.conf.get("spark.master"), session.conf.get(key, None)
    context = session.sparkContext
    return context.master, context.getConf().get(key)


def _warn_if_tasks_never_retry(session: Any) -> None:
    master, failures = _settings(session, "spark.task.maxFailures")
    if task_attempts(master, failures) > 1:
        return
    warnings.warn(
        f"This SparkSession (master {master!r}) runs each task once: a task that fails fails "
        "the job, and its checkpoints are resumed only by running the job again with "
        "restore_from='latest'. For a failed task to resume within the job, let Spark retry "
        "it: master 'local[N,F]' (F attempts) locally, spark.task.maxFailures on a cluster.",
        UserWarning,
        stacklevel=4,  # the call of ordered_wait / unordered_wait
    )


def _check_local_location(location: str) -> None:
    """A local location must be a directory the job can write, or creatable as one
    (checked on the driver, which reads the store too; on a cluster it is a shared
    filesystem mounted at the same path on the driver and every executor). Otherwise every
    task attempt would fail on it, with delta-rs's message."""
    from checkpoint._layout import is_local

    if not is_local(location):
        return
    path = Path(location)
    doing = "reaching"
    try:
        existing = next(c for c in (path, *path.parents) if c.exists())
        if not existing.is_dir():
            raise ConfigurationError(
                f"The checkpoint location {location} cannot be a directory: {existing} is "
                "a file. Choose a directory path (it is created if missing)."
            )
        missing = [c for c in (path, *path.parents) if c != existing and existing in c.parents]
        if missing:  # created and removed again: the tasks create it when they commit
            doing = "creating"
            path.mkdir(parents=True, exist_ok=True)
            for created in missing:
                try:
                    created.rmdir()
                except OSError:
                    break  # another writer's meanwhile, no longer empty: theirs
        else:
            doing = "writing to"
            with tempfile.TemporaryFile(dir=path):
                pass
    except OSError as exc:
        raise ConfigurationError(
            f"The checkpoint location {location} is not writable: "
            f"{doing} it failed ({exc}). Choose a "
            "directory this job can write (on a cluster: mounted at the same path on the "
            "driver and every executor), or an object-store URI."
        ) from exc


def _what_is_there(store: Any, config: CheckpointConfig) -> str:
    """For the error of a ``restore_from`` with nothing to restore (only then: listing a
    whole location costs a request per job on object stores): what the location holds
    instead, so that a mistyped ``job_id`` or ``operator_id`` shows."""
    try:
        if not _exists(store):
            return " (there is nothing at that location)"
        jobs = store.jobs()
        if config.job_id in jobs:
            return (
                f" (the job has operator(s) {', '.join(map(repr, store.operators(config.job_id)))})"
            )
        return f"; jobs there: {', '.join(map(repr, jobs)) if jobs else 'none'}"
    except Exception:  # the error at hand matters more than this detail
        return ""


def _exists(store: Any) -> bool:
    from checkpoint._layout import location_exists

    return location_exists(store.location, store.storage_options)


def _check_picklable(task: PartitionTask, fn: Any, retry: RetryStrategy | None) -> None:
    from pyspark import cloudpickle

    try:
        cloudpickle.dumps(task)
    except Exception as exc:
        _check_retry_picklable(fn, retry)
        name = getattr(fn, "__qualname__", type(fn).__name__)
        advice = (
            ""
            if isinstance(exc, DriverOnlyError)  # says what to do itself
            else " Create clients (HTTP sessions, connection pools, locks) in "
            "AsyncFunction.open(), not in __init__ or at module level, and keep only "
            "picklable settings (URLs, keys) on the object."
        )
        raise FunctionNotSerializableError(
            f"The async function {name} cannot be pickled, so Spark cannot send it to the "
            f"executors: {type(exc).__name__}: {str(exc).rstrip('.')}.{advice}"
        ) from exc


def _check_retry_picklable(fn: Any, retry: RetryStrategy | None) -> None:
    """The task did not pickle: if the function does and the retry strategy (its
    predicates) does not, say so, rather than blame the function."""
    from pyspark import cloudpickle

    if retry is None:
        return
    try:
        cloudpickle.dumps(fn)
    except Exception:
        return  # the function does not pickle: reported as such
    try:
        cloudpickle.dumps(retry)
    except Exception as exc:
        raise FunctionNotSerializableError(
            "The retry strategy cannot be pickled, so Spark cannot send it to the executors: "
            f"{type(exc).__name__}: {str(exc).rstrip('.')}. Give it retry_on_exception and "
            "retry_on_result predicates that pickle: module-level functions, or lambdas and "
            "objects that hold only picklable values (no clients, locks or open files)."
        ) from exc
