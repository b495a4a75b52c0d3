"""Lossless storage types: Arrow types that Delta cannot hold, mapped to ones it can.

Delta (delta-rs 1.6) refuses time, duration and interval types, and silently narrows some
others (``uint32`` is stored as ``int32``, which wraps values above 2**31; nanosecond
timestamps are truncated to microseconds). Snapshots must restore exactly what was saved,
so every column is mapped, by type and never by value, to a storage type that holds all
of its values:

=================================  ===========================================
original                           stored as
=================================  ===========================================
uint8 / uint16 / uint32            int16 / int32 / int64
uint64                             decimal128(20, 0)
float16                            float32
timestamp[ns] (any time zone)      int64 nanoseconds since the epoch
time32 / time64                    int32 / int64 in the type's unit
duration                           int64 in the type's unit
dictionary<value>                  value (decoded)
decimal256(p <= 38, s)             decimal128(p, s)
large_list / fixed_size_list       list (rebuilt with 32-bit offsets)
large_string / large_binary /      string / binary (delta-rs does this itself;
fixed_size_binary                  restored by the cast back)
=================================  ===========================================

The original Arrow schema is kept with the table, and loading casts every column back to
it. Interval and extension types, decimals of more than 38 digits, list views and run-end
encoded arrays have no lossless form here and are refused with ``UnsupportedTypeError``
naming the column, as are fields of one struct whose names differ
only in case (Delta's column names are case-insensitive).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.types as pt

from ._exceptions import UnsupportedTypeError


def storage_type(data_type: pa.DataType, path: str = "") -> pa.DataType:
    """The Delta-safe type that holds every value of ``data_type`` exactly."""
    t = data_type
    if pt.is_uint8(t):
        return pa.int16()
    if pt.is_uint16(t):
        return pa.int32()
    if pt.is_uint32(t):
        return pa.int64()
    if pt.is_uint64(t):
        return pa.decimal128(20, 0)
    if pt.is_float16(t):
        return pa.float32()
    if pt.is_timestamp(t):
        return pa.int64() if t.unit == "ns" else t
    if pt.is_time32(t):
        return pa.int32()
    if pt.is_time64(t) or pt.is_duration(t):
        return pa.int64()
    if pt.is_dictionary(t):
        return storage_type(t.value_type, path)
    if pt.is_struct(t):
        # Stored fields are all nullable: a snapshot row that is not a record has a null
        # ``input`` struct, whose NOT NULL children would then hold nulls (which Parquet
        # writers other than delta-rs refuse). The original schema restores the flags.
        _check_case_distinct(t, path)
        return pa.struct([pa.field(f.name, storage_type(f.type, _join(path, f.name))) for f in t])
    if pt.is_map(t):
        return pa.map_(
            storage_type(t.key_type, _join(path, "key")),
            storage_type(t.item_type, _join(path, "value")),
        )
    if pt.is_list(t) or pt.is_large_list(t) or pt.is_fixed_size_list(t):
        item = t.value_field
        return pa.list_(pa.field(item.name, storage_type(item.type, _join(path, "element"))))
    if pt.is_decimal256(t):
        if t.precision <= 38:
            return pa.decimal128(t.precision, t.scale)
        raise UnsupportedTypeError(
            f"Column {path or '<value>'!r} has type {t}: a Delta table holds decimals of at "
            "most 38 digits. Cast it to a string, or to decimal(38, s) if its values fit, "
            "before enriching."
        )
    if pt.is_list_view(t) or pt.is_large_list_view(t) or pt.is_run_end_encoded(t):
        raise UnsupportedTypeError(
            f"Column {path or '<value>'!r} has type {t}, which a checkpoint cannot restore "
            "as it was. Cast it to a plain list (pa.list_) or, for run-end encoding, to its "
            "value type before enriching."
        )
    if pt.is_interval(t) or isinstance(t, pa.ExtensionType):
        raise UnsupportedTypeError(
            f"Column {path or '<value>'!r} has type {t}, which a Delta table cannot store "
            "without losing information. Convert it in your DataFrame first (for example to "
            "a string or an integer) before enriching."
        )
    return t


def _check_case_distinct(struct: pa.StructType, path: str) -> None:
    """Delta column names are case-insensitive: two fields differing only in case collide;
    and Parquet cannot hold a struct without fields."""
    if struct.num_fields == 0:
        raise UnsupportedTypeError(
            f"{path or '<value>'!r} is a struct with no fields, which a Delta table (which "
            "checkpoints are) cannot store. Drop it, or give it a field, before enriching."
        )
    names = [f.name for f in struct]
    # a name given twice first, whatever case twins it also has ('A', 'a', 'a')
    counts = Counter(names)
    for name in names:
        if counts[name] > 1:
            raise UnsupportedTypeError(
                f"{path or '<value>'!r} has two fields named {name!r}; a Delta table (which "
                "checkpoints are) holds one column per name. Rename one of them before "
                "enriching (an input column with DataFrame.withColumnRenamed, a result field "
                "in the output schema)."
            )
    for field, other in zip(struct, earlier_same_names(names), strict=True):
        if other is not None:
            raise UnsupportedTypeError(
                f"{path or '<value>'!r} has fields {other!r} and {field.name!r}, whose names "
                "differ only in case; a Delta table (which checkpoints are) treats them as one "
                "column. Rename one of them before enriching (an input column with "
                "DataFrame.withColumnRenamed, a result field in the output schema)."
            )


def earlier_same_names(names: list[str]) -> list[str | None]:
    """For each of ``names`` (a struct's fields, or a table's columns), the first earlier one
    that a Delta table takes for the same name: equal to it, or equal but for case (Delta
    names are case-insensitive); None for a name of its own."""
    first: dict[str, str] = {}
    earlier: list[str | None] = []
    for name in names:
        earlier.append(first.get(name.lower()))
        first.setdefault(name.lower(), name)
    return earlier


def storage_schema(schema: pa.Schema) -> pa.Schema:
    """``storage_type`` applied to every field of a schema."""
    return pa.schema([pa.field(f.name, storage_type(f.type, f.name)) for f in schema])


def to_storage(
    array: pa.Array | pa.ChunkedArray, original: pa.DataType
) -> pa.Array | pa.ChunkedArray:
    """Cast ``array`` (of type ``original``) to its storage type; exact by construction.

    Structs, maps and lists (large and fixed-size ones too) are rebuilt child by child, as
    ``from_storage`` does: pyarrow before 26 casts a map whose key type changes (a struct
    key with NOT NULL fields, as Spark gives them, or uint8 keys) into an array that
    concatenates into an invalid one ("Map array keys array should have no nulls"; a bare
    concatenation of it can abort the process), and a snapshot's columns are concatenated.
    """
    target = storage_type(original)
    if array.type == target:
        return array
    if isinstance(array, pa.ChunkedArray):
        return pa.chunked_array([to_storage(c, original) for c in array.chunks], target)
    lists = pt.is_list(original) or pt.is_large_list(original) or pt.is_fixed_size_list(original)
    if pt.is_struct(original) or pt.is_map(original) or lists:
        return _rebuilt(array, original, target, to_storage)
    return _cast(array, target)


def from_storage(
    array: pa.Array | pa.ChunkedArray, original: pa.DataType
) -> pa.Array | pa.ChunkedArray:
    """Cast a stored array back to its original type.

    Nested arrays are rebuilt child by child rather than cast: a null struct (or list, or
    map) may hold nulls in a child its type declares NOT NULL — the null ``input`` of a
    watermark row, a null struct column — and Arrow's cast refuses those nulls even
    under a null parent. Field metadata is the caller's to restore (types compare
    without it).
    """
    if array.type == original:
        return array
    if isinstance(array, pa.ChunkedArray):
        return pa.chunked_array([from_storage(c, original) for c in array.chunks], original)
    stored = array.type
    if (
        (pt.is_struct(original) and pt.is_struct(stored))
        or (pt.is_map(original) and pt.is_map(stored))
        or ((pt.is_list(original) or pt.is_large_list(original)) and pt.is_list(stored))
    ):
        return _rebuilt(array, original, original, from_storage)
    return _cast(array, original)


def _rebuilt(
    array: pa.Array,
    original: pa.DataType,
    target: pa.DataType,
    convert: Callable[[pa.Array, pa.DataType], pa.Array],
) -> pa.Array:
    """A struct, map or list ``array`` (of ``original``, or of its storage type) rebuilt as
    ``target`` (a struct, a map, a list or a large list) from its children, each converted
    by ``convert(child, the child's type in original)``: to_storage or from_storage."""
    if array.offset:
        array = pa.concat_arrays([array])  # from_arrays takes no sliced null bitmaps
    mask = array.is_null() if array.null_count else None
    if pt.is_struct(original):
        children = [convert(array.field(i), f.type) for i, f in enumerate(original)]
        return pa.StructArray.from_arrays(children, fields=list(target), mask=mask)
    if pt.is_map(original):
        keys = convert(array.keys, original.key_type)
        items = convert(array.items, original.item_type)
        return pa.MapArray.from_arrays(array.offsets, keys, items, type=target, mask=mask)
    if pt.is_fixed_size_list(array.type):
        size = array.type.list_size
        values = array.values.slice(0, len(array) * size)
        offsets = pa.array(np.arange(len(array) + 1, dtype=np.int64) * size)
    else:
        values, offsets = array.values, array.offsets
    values = convert(values, original.value_type)
    if pt.is_large_list(target):
        return pa.LargeListArray.from_arrays(
            offsets.cast(pa.int64()), values, type=target, mask=mask
        )
    try:
        offsets = offsets.cast(pa.int32())  # a large list's or a fixed-size list's
    except pa.ArrowInvalid as exc:
        raise UnsupportedTypeError(
            f"Cannot convert values of type {original} to {target} exactly: they hold more "
            "list elements than a list (32-bit offsets) holds. Checkpoint fewer rows at a "
            "time, or split the lists, before enriching."
        ) from exc
    return pa.ListArray.from_arrays(offsets, values, type=target, mask=mask)


def _cast(array: pa.Array | pa.ChunkedArray, target: pa.DataType) -> pa.Array:
    try:
        return array.cast(target, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        if pt.is_fixed_size_list(target):
            # Stored as a list; a null entry may hold nulls under NOT NULL fields, which
            # the cast refuses (see from_storage), and pyarrow 18 (not 25) refuses a nullable
            # field cast to a NOT NULL one outright. Rare enough to go through Python.
            try:
                return pa.array(array.to_pylist(), type=target)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                pass
        raise UnsupportedTypeError(
            f"Cannot convert values of type {array.type} to {target} exactly: {exc}. Convert "
            "the column to a type Delta supports before enriching."
        ) from exc


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
