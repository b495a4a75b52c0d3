"""How messages name the fields inside a column, and what to say when an argument that
names a column names a field inside a struct."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

#: What a path names inside the list or map at a path: its elements (``tags[]``), its keys
#: (``m{key}``), its values (``m{}``); the fields of a struct in them follow with a dot
#: (``tags[].x``, ``m{key}.a``, ``m{}.a``). Messages about types and schemas (the checks
#: before a job, the delta_rs sink's) name nested fields so; messages about values name
#: the concrete position instead (``tags[1]``, ``m['k']``).
ELEMENTS, KEYS, VALUES = "[]", "{key}", "{}"


def field_path(path: str, name: str) -> str:
    """The path of the field ``name`` of the struct at ``path`` ("" for the top level)."""
    return f"{path}.{name}" if path else name


def spark_types(data_type: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``data_type`` (a Spark type) and every type inside it, each with its path (``s.a``,
    ``tags[]``, ``m{key}`` for a map's keys, ``m{}`` for its values), outermost first."""
    from pyspark.sql.types import ArrayType, MapType, StructType

    yield path, data_type
    if isinstance(data_type, StructType):
        for field in data_type.fields:
            yield from spark_types(field.dataType, field_path(path, field.name))
    elif isinstance(data_type, ArrayType):
        yield from spark_types(data_type.elementType, path + ELEMENTS)
    elif isinstance(data_type, MapType):
        yield from spark_types(data_type.keyType, path + KEYS)
        yield from spark_types(data_type.valueType, path + VALUES)


def void_not_null(schema: Any) -> list[str]:
    """The paths of the void types (NullType) in ``schema`` (a Spark StructType) that Spark
    declares NOT NULL: the elements of an empty ``array()``, the keys and values of an empty
    ``create_map()``. Arrow holds no such type, so pyspark's conversion fails on them ("A
    null type field may not be non-nullable") without naming the column."""
    from pyspark.sql.types import ArrayType, MapType, NullType, StructType

    void: list[str] = []
    for path, kind in spark_types(schema):
        if isinstance(kind, StructType):
            void += [
                field_path(path, f.name)
                for f in kind.fields
                if isinstance(f.dataType, NullType) and not f.nullable
            ]
        elif isinstance(kind, ArrayType):
            if isinstance(kind.elementType, NullType) and not kind.containsNull:
                void.append(path + ELEMENTS)
        elif isinstance(kind, MapType):
            if isinstance(kind.keyType, NullType):  # a map's keys are never null
                void.append(path + KEYS)
            if isinstance(kind.valueType, NullType) and not kind.valueContainsNull:
                void.append(path + VALUES)
    return void


def nested_field_advice(
    schema: pa.Schema, name: str, argument: str, usage: str, case_sensitive: bool = True
) -> str | None:
    """If ``name`` (given as ``argument``, which takes top-level columns only) is the path
    of a field inside a struct column of ``schema`` (``s.ts``), what it is and how to
    select it up as a column of its own, to follow the name in an error message: "is the
    field ... then ``usage``" (``usage`` formatted with the new column's name); None
    otherwise. ``case_sensitive``: whether names match only in the same case (Spark's
    ``spark.sql.caseSensitive``)."""
    parts = name.split(".")
    for split in range(1, len(parts)):  # a top-level name may hold dots itself
        path = _resolve(schema, ".".join(parts[:split]), parts[split:], case_sensitive)
        if path is None:
            continue
        alias = free_alias(schema, path)
        column = ".".join(_quoted(p) for p in path)
        return (
            f"is the field {path[-1]!r} inside the struct column {path[0]!r}: nested fields "
            f"are not supported directly, {argument} takes top-level columns. Select it up as "
            f"a column first, e.g. df.withColumn({alias!r}, F.col({column!r})), then "
            f"{usage.format(repr(alias))}."
        )
    return None


def free_alias(schema: pa.Schema, path: list[str]) -> str:
    """A name for the field at ``path`` as a column of its own that no column of ``schema``
    has, in any case: the field's own, else the path joined with underscores, numbered if
    need be. Names differing only in case are taken as the same whatever the setting:
    withColumn replaces a column whose name does unless spark.sql.caseSensitive is on
    (the delta_rs sink's option is checked without knowing it)."""
    taken = {name.lower() for name in schema.names}
    joined = "_".join(path)
    candidates = itertools.chain((path[-1], joined), (f"{joined}_{n}" for n in itertools.count(2)))
    return next(alias for alias in candidates if alias.lower() not in taken)


def _resolve(
    schema: pa.Schema, top: str, rest: list[str], case_sensitive: bool
) -> list[str] | None:
    """The field names along ``top`` then ``rest`` through structs, as the schema spells
    them, or None if the path is not a field inside a struct column."""
    fields: list[pa.Field] = list(schema)
    path: list[str] = []
    for part in [top, *rest]:
        found = [f for f in fields if _same(f.name, part, case_sensitive)]
        if len(found) != 1:
            return None
        path.append(found[0].name)
        if len(path) == len(rest) + 1:
            return path
        if not pa.types.is_struct(found[0].type):
            return None
        fields = list(found[0].type)
    return None


def _same(a: str, b: str, case_sensitive: bool) -> bool:
    return a == b if case_sensitive else a.lower() == b.lower()


def _quoted(name: str) -> str:
    """A name as ``F.col`` reads it: in backticks if it holds a dot or a backtick."""
    if "." in name or "`" in name:
        return "`" + name.replace("`", "``") + "`"
    return name
