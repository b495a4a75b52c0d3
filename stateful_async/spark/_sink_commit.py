"""Driver side of the ``delta_rs`` sink: plan a write, commit it once, abort it safely.

These functions run in Python workers that Spark spawns (planning, commit, abort), never
in the user's driver process, so they take everything from their arguments: the options,
the planned schema and the executors' ``DataFile`` descriptions.

Exactly-once rests on three rules:

* one Delta transaction adds every file of a write, together with an app transaction
  ``(app id, version)``; the version already recorded for the app id is read from the
  *same* ``DeltaTable`` object that commits, so a writer racing on the same app id fails
  with delta-rs's "Concurrent transaction" conflict instead of both committing;
* a version at or below the recorded one is refused: nothing is added, and the refused
  attempt's own files (fresh names, in no Delta version) are deleted;
* ``abort`` deletes files only when the commit that carried them provably did not land: the
  commit records a ``stateful_async.sink.commitId`` (a digest of its file paths) in its
  commit info, and ``abort`` looks for it in the table history first.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import posixpath
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.parquet as pq

from checkpoint._types import earlier_same_names

from .._exceptions import ConfigurationError, DeltaSinkError, SinkSchemaMismatchError
from ._columns import ELEMENTS, KEYS, VALUES, field_path
from ._sink_files import (
    DataFile,
    TableStorage,
    as_file_schema,
    check_partition_columns,
    option_can_name,
)
from ._sink_options import SinkOptions, is_uri

log = logging.getLogger("stateful_async.spark.sink")

#: Commit-info key that names the files of a commit (see ``commit_id``).
COMMIT_ID_KEY = "stateful_async.sink.commitId"

#: Commit-info keys of a streaming commit: its app id, and the query that committed it.
APP_ID_KEY = "stateful_async.sink.appId"
QUERY_ID_KEY = "stateful_async.sink.queryId"

#: Executor and committer clocks may disagree; look this far before the oldest file.
CLOCK_SKEW_MS = 10 * 60 * 1000


def query_txn_id(app_id: str, query_id: str) -> str:
    """The app transaction that a commit of ``app_id`` by the streaming query ``query_id``
    also records, at the same version: how far that query got under the app id.

    Spark's query ids are UUIDs (no ``@``), so the part after the last ``@`` is the query
    and two (app id, query) pairs never share an id. delta-rs takes any string.
    """
    return f"{app_id}@{query_id}"


def named_txn_id(app_id: str) -> str:
    """The app transaction holding the last version of ``app_id`` committed together with
    a ``query_txn_id`` (``*``: any query). When it equals the app id's own version, the
    query that committed that version is on record."""
    return f"{app_id}@*"


class Outcome(enum.Enum):
    COMMITTED = "committed"
    REFUSED = "refused"  # the app transaction already holds this version (a replay)
    NOTHING = "nothing"  # an append of no rows to an existing table


@dataclass(frozen=True)
class WritePlan:
    """What executors need to write files the commit will accept."""

    # file form of the data's schema, partition columns included, with the table's NOT NULL
    # flags (at every depth) when there is a table
    schema: pa.Schema
    partition_by: tuple[str, ...]


# -- tables and schemas ------------------------------------------------------------------


def load_table(table_uri: str, storage_options: dict[str, str] | None) -> Any:
    """The Delta table at ``table_uri``, or None if there is none yet."""
    from deltalake import DeltaTable
    from deltalake.exceptions import DeltaError, TableNotFoundError

    try:
        if not DeltaTable.is_deltatable(table_uri, storage_options or None):
            return None
        return DeltaTable(table_uri, storage_options=storage_options or None)
    except TableNotFoundError:
        return None
    except (DeltaError, OSError) as exc:
        raise DeltaSinkError(
            f"The delta_rs sink could not read the Delta table at {table_uri}: {exc}. Check "
            "the path and, for object stores, the storage.* options."
        ) from exc


def delta_schema(schema: pa.Schema) -> Any:
    """The Delta schema of an Arrow schema; unsupported types raise ConfigurationError."""
    from deltalake import Schema as DeltaSchema

    # delta-rs takes a struct without fields, which no Parquet file holds: every task would
    # fail on it.
    structs = [
        (p, kind) for p, kind in _nested_types(pa.struct(list(schema))) if pa.types.is_struct(kind)
    ]
    _cannot_store(
        [path for path, kind in structs if path and kind.num_fields == 0],
        ("is a struct", "are structs"),
        " with no fields, which Parquet files cannot hold. Drop it, or give it a field, "
        "before writing.",
    )
    try:
        return DeltaSchema.from_arrow(schema)
    except Exception as exc:  # deltalake raises plain Exception subclasses here
        # names given twice (each once, whatever case twins they also have), then case twins
        counts = [(path, Counter(f.name for f in kind)) for path, kind in structs]
        columns = [name for path, n in counts if not path for name in n if n[name] > 1]
        inside = [field_path(path, name) for path, n in counts if path for name in n if n[name] > 1]
        same = [
            (field_path(path, earlier), field_path(path, f.name))
            for path, kind in structs
            for f, earlier in zip(kind, earlier_same_names([f.name for f in kind]), strict=True)
            if earlier is not None and earlier != f.name
        ]
        if columns or inside:
            what, advice = [], []
            if columns:
                what.append(f"more than one column named {', '.join(map(repr, columns))}")
                advice.append(
                    "after a join on equal columns, join on their names to keep one: "
                    f"a.join(b, {columns[0]!r})"
                )
            if inside:
                what.append(f"more than one field named {', '.join(map(repr, inside))} in a struct")
                advice.append("for a field, rebuild its struct with named_struct")
            raise ConfigurationError(
                f"The data cannot be stored in a Delta table: it has {' and '.join(what)}, and "
                "a Delta table holds one per name. Drop or rename the others before writing "
                f"({'; '.join(advice)})."
            ) from exc
        if same:
            raise ConfigurationError(
                "The data cannot be stored in a Delta table: "
                + "; ".join(f"{a!r} and {b!r}" for a, b in same)
                + " differ only in case, and Delta column and field names are "
                "case-insensitive. Rename one of each pair before writing (withColumnRenamed "
                "for a column; for a field, rebuild its struct with named_struct)."
            ) from exc
        bad = [f"{f.name!r} ({f.type})" for f in schema if not _delta_can_hold(f)]
        raise ConfigurationError(
            "The data cannot be stored in a Delta table: "
            + (f"the column(s) {', '.join(bad)} have no Delta type" if bad else str(exc))
            + ". Cast them to a Delta type before writing (an interval to a bigint count "
            "of seconds, or to a string, for example)."
        ) from exc


def _nested_types(kind: pa.DataType, path: str = "") -> Iterator[tuple[str, pa.DataType]]:
    """``kind`` and every type inside it, each with its path, outermost first: for
    ``pa.struct(list(schema))``, the columns' struct at "", then ``s``, ``s.a``, ``l[]``
    (a list's elements), ``m{key}`` and ``m{}`` (a map's keys and values), ``m{}.a``..."""
    yield path, kind
    if pa.types.is_struct(kind):
        for f in kind:
            yield from _nested_types(f.type, field_path(path, f.name))
    elif pa.types.is_list(kind) or pa.types.is_large_list(kind):
        yield from _nested_types(kind.value_type, path + ELEMENTS)
    elif pa.types.is_map(kind):
        yield from _nested_types(kind.key_type, path + KEYS)
        yield from _nested_types(kind.item_type, path + VALUES)


def _delta_can_hold(field: pa.Field) -> bool:
    from deltalake import Schema as DeltaSchema

    try:
        DeltaSchema.from_arrow(pa.schema([field]))
    except Exception:
        return False
    return True


def _strip(node: Any) -> Any:
    """A Delta type in JSON form without nullability or metadata (compared by name/type)."""
    if isinstance(node, dict):
        return {
            k: _strip(v)
            for k, v in node.items()
            if k not in ("nullable", "containsNull", "valueContainsNull", "metadata")
        }
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def _fields_sorted(node: Any) -> Any:
    """A Delta type in JSON form with the fields of its structs, at any depth, sorted by
    name: equal for two types that differ only in the order of struct fields."""
    if isinstance(node, dict):
        out = {k: _fields_sorted(v) for k, v in node.items()}
        if isinstance(out.get("fields"), list):
            out["fields"] = sorted(out["fields"], key=lambda f: f["name"])
        return out
    if isinstance(node, list):
        return [_fields_sorted(v) for v in node]
    return node


def _in_another_order(data_type: Any, table_type: Any) -> bool:
    """Whether two Delta types in JSON form have the same struct fields, at every depth,
    but not in the same order (whatever the fields' own types)."""
    data, table = _names_of(data_type), _names_of(table_type)
    return data != table and _fields_sorted(data) == _fields_sorted(table)


def _names_of(node: Any) -> Any:
    """A Delta type in JSON form without its leaf types: the names of its structs' fields,
    in order, and where its arrays and maps hold structs."""
    if not isinstance(node, dict):
        return None
    kind = node.get("type")
    if kind == "struct":
        fields = [{"name": f["name"], "type": _names_of(f["type"])} for f in node["fields"]]
        return {"type": "struct", "fields": fields}
    if kind == "array":
        return {"type": "array", "elementType": _names_of(node["elementType"])}
    if kind == "map":
        return {
            "type": "map",
            "keyType": _names_of(node["keyType"]),
            "valueType": _names_of(node["valueType"]),
        }
    return None


def _type_name(node: Any) -> str:
    if isinstance(node, str):
        return node
    kind = node.get("type")
    if kind == "struct":
        inner = ", ".join(f"{f['name']}: {_type_name(f['type'])}" for f in node["fields"])
        return f"struct<{inner}>"
    if kind == "array":
        return f"array<{_type_name(node['elementType'])}>"
    if kind == "map":
        return f"map<{_type_name(node['keyType'])}, {_type_name(node['valueType'])}>"
    return json.dumps(node)


def _fields(schema: Any) -> dict[str, Any]:
    return {f["name"]: _strip(f["type"]) for f in json.loads(schema.to_json())["fields"]}


def check_schema(table: Any, schema: pa.Schema, *, merge: bool, table_uri: str) -> list[Any]:
    """Compare the data's schema with the table's; return the fields ``mergeSchema`` adds.

    Columns are matched by name, types compared without nullability. Extra columns are
    allowed only with ``merge``; missing columns and changed types are never allowed. A
    column or struct field the data spells in another case is named as such (its type is
    compared as if spelt as the table does).
    """
    ours = delta_schema(schema)
    table_fields = _fields(table.schema())
    data_fields = _fields(ours)
    # Delta names are case-insensitive: a data column 'ID' is the table's 'id' spelt
    # otherwise, not a new column that mergeSchema could add; so is a struct field.
    in_other_case = _spelt_otherwise(list(table_fields), list(data_fields))
    advised, problems = [], []  # advised: the problems whose words say how to mend them
    for name, table_type in table_fields.items():
        spelt = in_other_case.get(name, name)
        if spelt not in data_fields:
            problems.append(f"the table column {name!r} is missing from the data")
            continue
        if spelt != name:
            advised.append(
                f"the table column {name!r} is {spelt!r} in the data (Delta column names are "
                f"case-insensitive, but a write must spell them as the table does: rename it "
                f"with withColumnRenamed({spelt!r}, {name!r}))"
            )
        data_type = data_fields[spelt]
        fields_renamed: list[tuple[str, str]] = []
        as_in_table = _spelt_as_in_table(table_type, data_type, (name, spelt), fields_renamed)
        advised.extend(
            f"the table field {table_path!r} is {data_path!r} in the data (Delta field names "
            f"are case-insensitive, but a write must spell them as the table does: rebuild "
            f"the column {spelt!r} with the table's field names, e.g. with named_struct)"
            for table_path, data_path in fields_renamed
        )
        if as_in_table == table_type:
            continue
        types = f"{_type_name(table_type)} in the table but {_type_name(data_type)} in the data"
        if _in_another_order(as_in_table, table_type):  # no cast of the whole column mends it
            advised.append(
                f"the column {name!r} has the table's struct fields in another order: {types} "
                f"(rebuild it in the table's order, e.g. with named_struct; a cast would match "
                f"the fields by position, not by name)"
                if _fields_sorted(as_in_table) == _fields_sorted(table_type)  # the order alone
                else f"the column {name!r} is {types}, its struct fields in another order "
                f"(rebuild it in the table's order, e.g. with named_struct, casting each field "
                f"to the table's type; a cast of the whole column would match the fields by "
                f"position, not by name)"
            )
        else:
            problems.append(f"the column {name!r} is {types}")
    renamed = set(in_other_case.values())
    extra = [name for name in data_fields if name not in table_fields and name not in renamed]
    if extra and not merge:
        problems.extend(f"the data column {name!r} is not in the table" for name in extra)
    if advised or problems:
        # The advised ones say how to mend them; the rest need this advice. mergeSchema adds
        # columns only: advised for new ones, never for a type change.
        advice = (
            "Select and cast the columns to match the table"
            + (
                ", or set the option mergeSchema=true to add new columns"
                if extra and not merge
                else ""
            )
            + "."
        )
        raise SinkSchemaMismatchError(
            f"The data's schema does not match the Delta table at {table_uri}: "
            + "; ".join(advised + problems)
            + (f". {advice}" if problems else ".")
        )
    return [f for f in ours.fields if f.name in extra]


def _spelt_otherwise(table_names: list[str], data_names: list[str]) -> dict[str, str]:
    """The table's names that the data spells in another case, each with the data's
    spelling (only names the other side lacks as they are)."""
    return {
        name: other
        for name in table_names
        if name not in data_names
        for other in data_names
        if other not in table_names and other.lower() == name.lower()
    }


def _spelt_as_in_table(
    table_type: Any, data_type: Any, paths: tuple[str, str], renames: list[tuple[str, str]]
) -> Any:
    """``data_type`` (a Delta type in JSON form) with the names of its struct fields, at any
    depth, that the table's ``table_type`` spells in another case spelt as the table does,
    to compare what is left; each such field goes to ``renames`` as (table path, data path),
    from ``paths``, the column's: ``s.Name`` and ``s.name``; ``l[].X``, ``m{key}.a`` and
    ``m{}.a`` inside lists and maps."""
    if not isinstance(table_type, dict) or not isinstance(data_type, dict):
        return data_type
    kind = table_type["type"]
    if kind != data_type["type"]:
        return data_type
    if kind == "struct":
        table_fields = {f["name"]: f["type"] for f in table_type["fields"]}
        data_names = [f["name"] for f in data_type["fields"]]
        as_table = {v: k for k, v in _spelt_otherwise(list(table_fields), data_names).items()}
        fields = []
        for f in data_type["fields"]:
            name = as_table.get(f["name"], f["name"])
            inner = (field_path(paths[0], name), field_path(paths[1], f["name"]))
            if name != f["name"]:
                renames.append(inner)
            fields.append(
                {
                    **f,
                    "name": name,
                    "type": _spelt_as_in_table(table_fields.get(name), f["type"], inner, renames),
                }
            )
        return {**data_type, "fields": fields}
    parts = {
        "array": [("elementType", ELEMENTS)],
        "map": [("keyType", KEYS), ("valueType", VALUES)],
    }
    return {
        **data_type,
        **{
            key: _spelt_as_in_table(
                table_type[key], data_type[key], (paths[0] + part, paths[1] + part), renames
            )
            for key, part in parts.get(kind, [])
        },
    }


def _check_partitioning(table: Any, partition_by: tuple[str, ...], table_uri: str) -> None:
    existing = tuple(table.metadata().partition_columns)
    if existing != partition_by:
        raise SinkSchemaMismatchError(
            f"The Delta table at {table_uri} is partitioned by "
            f"{list(existing) or 'no column'}, but the write is partitioned by "
            f"{list(partition_by) or 'no column'}. "
            + (
                f"Set the option partitionBy to {','.join(existing)!r} (or leave it out to "
                "follow the table)."
                if all(map(option_can_name, existing))
                else "Leave the option partitionBy out to follow the table (a name holding a "
                "comma or leading or trailing spaces cannot be given in it)."
            )
        )


def plan_write(
    opts: SinkOptions, spark_arrow_schema: pa.Schema, *, mode: str = "append"
) -> WritePlan:
    """Check the data against the table (if any) before executors write a single file."""
    schema = as_file_schema(spark_arrow_schema)
    delta_schema(schema)
    table = load_table(opts.table_uri, opts.storage_options)
    if table is None:
        _check_typed(list(schema))
        check_partition_columns(schema, opts.partition_by, opts.partition_by_option)
        _claim_new_location(opts, replacing=mode == "overwrite")
        return WritePlan(schema, opts.partition_by)
    check_table_features(table, opts.table_uri, mode)
    existing = tuple(table.metadata().partition_columns)
    if opts.partition_by_option is not None:
        _check_partitioning(table, opts.partition_by, opts.table_uri)
    added = check_schema(table, schema, merge=opts.merge_schema, table_uri=opts.table_uri)
    _check_typed([f for f in schema if f.name in {a.name for a in added}])
    check_partition_columns(schema, existing)
    # Files carry the table's NOT NULL flags, as delta-rs's own writer's do: a file whose
    # null struct holds nulls in a child the table declares NOT NULL is otherwise refused
    # by delta-rs's reader (Arrow's cast), which would make the whole table unreadable.
    # Tasks check the data against the flags.
    return WritePlan(_with_table_nullability(table, schema), existing)


# Left (empty) at a location where the sink is about to create a table, before any file of
# the write: hidden (an underscore), so Delta readers and the search for orphans pass it over.
NEW_TABLE_MARK = "_stateful_async_new_table"


def _claim_new_location(opts: SinkOptions, replacing: bool) -> None:
    """Before the first write to a location without a Delta table: refuse one that holds
    Parquet files the sink did not write there (a Parquet dataset, say), which the table's
    orphan clean-up (``clean_orphan_files``, ``cleanOrphans``) would delete as files no
    version names, unless the write is ``replacing`` them (an overwrite); otherwise leave
    ``NEW_TABLE_MARK`` there, by which a write that follows one that failed before its
    commit knows the files it finds as that one's: those written since the mark (files
    older than it are someone else's; the first commit removes it)."""
    storage = TableStorage(opts.table_uri, opts.storage_options)
    try:
        files = storage.list_files()
        marked = [mtime for rel, mtime in files if rel == NEW_TABLE_MARK]
        # files older than the mark were there before the sink came: not a write's of it
        since = min(marked, default=None)
        foreign = [
            (rel, mtime) for rel, mtime in data_files(files) if since is None or mtime < since
        ]
        if foreign and not replacing:
            shown = ", ".join(rel for rel, _ in foreign[:3])
            raise ConfigurationError(
                f"{opts.table_uri} holds no Delta table but {len(foreign)} Parquet file(s) "
                f"({shown}{', ...' if len(foreign) > 3 else ''}): a table created there would "
                "not name them, so its orphan clean-up (clean_orphan_files, cleanOrphans) "
                "would delete them. Write to an empty location; or, to replace those files, "
                "write with mode('overwrite') (or delete them: a failed write's leftovers, "
                "say); or, if they are data to keep, make them a Delta table first "
                "(deltalake's convert_to_deltalake) and write to it."
            )
        if not marked:
            # empty (its name says it all): delta-rs's file system, behind file:// and object
            # store locations, takes no write of a Python buffer ("'Buffer' object is not an
            # instance of 'bytes'")
            storage.open_output(NEW_TABLE_MARK).close()
    except OSError as exc:
        raise DeltaSinkError(
            f"The delta_rs sink cannot prepare {opts.table_uri} for a new Delta table: "
            f"{exc}. Check that the location is reachable and writable."
        ) from exc


def _remove_new_table_mark(opts: SinkOptions) -> None:
    """Remove ``NEW_TABLE_MARK`` once the table exists: it would otherwise outlive the
    table (deleted, its location reused) and vouch for Parquet files put there later. A
    failure is only logged: the write has landed."""
    try:
        TableStorage(opts.table_uri, opts.storage_options).delete(NEW_TABLE_MARK)
    except OSError as exc:
        log.warning("Could not remove %s from %s: %s", NEW_TABLE_MARK, opts.table_uri, exc)


def _check_typed(columns: list[pa.Field]) -> None:
    """Refuse columns the write would add to the table with a void type (Spark's NullType,
    which a bare NULL has) at any depth: delta-rs takes it, but the table could then never
    hold a value there (a later write of the column typed is a type change)."""
    refuse_void([p for p, kind in _nested_types(pa.struct(columns)) if pa.types.is_null(kind)])


def refuse_void(paths: list[str]) -> None:
    """Refuse data with a void type (Spark's NullType) at each of ``paths`` (``n``, ``s.a``,
    ``l[]``, ``m{key}``, ``m{}``), naming them; nothing if there are none."""
    _cannot_store(
        paths,
        ("has", "have"),
        " no type (void: a bare NULL, such as F.lit(None), has none, nor do the "
        "elements of an empty array() or the keys and values of an empty create_map()), "
        "so the table could never hold a value there. Cast it to the type it stands for "
        "before writing (an empty array or map as a whole), e.g. F.lit(None).cast('string') "
        "or F.array().cast('array<string>').",
    )


def _cannot_store(paths: list[str], verb: tuple[str, str], why: str) -> None:
    """Refuse data whose columns or fields at ``paths`` a Delta table cannot hold: they
    ``verb`` (its singular and plural) ``why``; nothing if there are none."""
    if paths:
        raise ConfigurationError(
            f"The data cannot be stored in a Delta table: {', '.join(repr(p) for p in paths)} "
            + verb[len(paths) > 1]
            + why
        )


def _with_table_nullability(table: Any, schema: pa.Schema) -> pa.Schema:
    """``schema`` with the NOT NULL flags of ``table``'s fields, at every depth."""
    table_fields = {f["name"]: f for f in json.loads(table.schema().to_json())["fields"]}
    return pa.schema(
        [_strict_field(f, table_fields[f.name]) if f.name in table_fields else f for f in schema],
        metadata=schema.metadata,
    )


def _check_not_null_kept(table: Any, planned: pa.Schema, uri: str) -> None:
    """Refuse a commit if the table declares NOT NULL a field the write was planned (and
    its tasks checked) as nullable: another writer created the table, or changed its
    schema, while this write ran. Its files may hold nulls there, which would make the
    table unreadable to delta-rs."""
    now = _with_table_nullability(table, planned)
    newly = [p for a, b in zip(planned, now, strict=True) for p in _newly_required(a, b, "")]
    if newly:
        raise SinkSchemaMismatchError(
            f"The Delta table at {uri} declares {', '.join(newly)} NOT NULL, which it did not "
            "when this write was planned (another writer created the table or changed its "
            "schema meanwhile), so the write's rows were not checked for nulls there. Nothing "
            "was committed; re-run the write."
        )


def _newly_required(planned: pa.Field, now: pa.Field, path: str) -> Iterator[str]:
    """The fields (at any depth) NOT NULL in ``now`` but nullable in ``planned`` (two
    fields of one type, ``now`` with the table's flags, of the struct at ``path``), named
    as ``_all_fields`` names them (``s.a``, ``l[].x``, ``m{key}.p``, ``m{}.p``; the flags of
    list elements and map values as ``the elements of 'tags'``, ``the values of 'm'``)."""
    path = field_path(path, planned.name)
    if planned.nullable and not now.nullable:
        yield repr(path)
    yield from _newly_required_inside(planned.type, now.type, path)


def _newly_required_inside(planned: pa.DataType, now: pa.DataType, path: str) -> Iterator[str]:
    """``_newly_required`` of what is inside a field of type ``planned`` at ``path``."""
    if pa.types.is_struct(planned):
        for i in range(planned.num_fields):
            yield from _newly_required(planned.field(i), now.field(i), path)
    elif pa.types.is_list(planned) or pa.types.is_large_list(planned):
        if planned.value_field.nullable and not now.value_field.nullable:
            yield f"the elements of {path!r}"
        yield from _newly_required_inside(planned.value_type, now.value_type, path + ELEMENTS)
    elif pa.types.is_map(planned):
        yield from _newly_required_inside(planned.key_type, now.key_type, path + KEYS)
        if planned.item_field.nullable and not now.item_field.nullable:
            yield f"the values of {path!r}"
        yield from _newly_required_inside(planned.item_type, now.item_type, path + VALUES)


def _strict_field(field: pa.Field, delta: dict[str, Any]) -> pa.Field:
    """``field`` with the nullability of the Delta field ``delta`` (schema JSON), at every
    depth."""
    return pa.field(
        field.name,
        _strict_type(field.type, delta["type"]),
        nullable=delta.get("nullable", True),
        metadata=field.metadata,
    )


def _strict_type(data_type: pa.DataType, kind: Any) -> pa.DataType:
    if not isinstance(kind, dict):
        return data_type
    if kind["type"] == "struct" and pa.types.is_struct(data_type):
        by_name = {f["name"]: f for f in kind["fields"]}
        return pa.struct(
            [_strict_field(f, by_name[f.name]) if f.name in by_name else f for f in data_type]
        )
    if kind["type"] == "array" and pa.types.is_list(data_type):
        item = data_type.value_field
        return pa.list_(
            pa.field(
                item.name,
                _strict_type(item.type, kind["elementType"]),
                nullable=kind.get("containsNull", True),
            )
        )
    if kind["type"] == "map" and pa.types.is_map(data_type):
        key, item = data_type.key_field, data_type.item_field
        return pa.map_(
            pa.field(key.name, _strict_type(key.type, kind["keyType"]), nullable=False),
            pa.field(
                item.name,
                _strict_type(item.type, kind["valueType"]),
                nullable=kind.get("valueContainsNull", True),
            ),
        )
    return data_type


# Column metadata keys of Delta features whose values the writer must compute or check.
_COLUMN_FEATURES = {
    "delta.generationExpression": "a generated column",
    "delta.identity.start": "an identity column",
    "delta.invariants": "a column invariant",
}


def _all_fields(fields: list[dict[str, Any]], path: str = "") -> Iterator[tuple[str, Any]]:
    """Every field of the struct at ``path`` ("" for the columns) of a Delta schema (JSON),
    and of the structs inside them at any depth, with its path (``s.a``, ``l[].x``,
    ``m{key}.a``, ``m{}.a``)."""
    for field in fields:
        name = field_path(path, field["name"])
        yield name, field
        yield from _fields_inside(field["type"], name)


def _fields_inside(kind: Any, path: str) -> Iterator[tuple[str, Any]]:
    """``_all_fields`` of the structs inside a Delta type (JSON) at ``path``."""
    if not isinstance(kind, dict):
        return
    if kind["type"] == "struct":
        yield from _all_fields(kind["fields"], path)
    elif kind["type"] == "array":
        yield from _fields_inside(kind["elementType"], path + ELEMENTS)
    elif kind["type"] == "map":
        yield from _fields_inside(kind["keyType"], path + KEYS)
        yield from _fields_inside(kind["valueType"], path + VALUES)


def check_table_features(table: Any, table_uri: str, mode: str) -> None:
    """Refuse a table whose rules this sink would break without noticing: CHECK
    constraints, generated, identity or invariant columns and column mapping (values it
    cannot compute or check), and an overwrite of an append-only table."""
    config = table.metadata().configuration
    problems = [
        f"the CHECK constraint {key.split('.', 2)[2]!r} ({value})"
        for key, value in sorted(config.items())
        if key.startswith("delta.constraints.")
    ]
    for path, field in _all_fields(json.loads(table.schema().to_json())["fields"]):
        for key, what in _COLUMN_FEATURES.items():
            if key in (field.get("metadata") or {}):
                problems.append(f"{what} ({path!r})")
    if config.get("delta.columnMapping.mode", "none") != "none":
        problems.append(
            f"column mapping (delta.columnMapping.mode={config['delta.columnMapping.mode']})"
        )
    if problems:
        raise DeltaSinkError(
            f"The Delta table at {table_uri} has {'; '.join(problems)}, which the delta_rs "
            "sink does not evaluate: it would write rows that break them. Write to this "
            "table with deltalake.write_deltalake, or with Spark and the Delta Lake jars "
            "(delta-spark), or drop the rule if it need not hold (for a constraint: "
            "DeltaTable(path).alter.drop_constraint(name))."
        )
    if mode == "overwrite" and config.get("delta.appendOnly", "false").lower() == "true":
        raise DeltaSinkError(
            f"The Delta table at {table_uri} is append-only (delta.appendOnly=true): an "
            "overwrite (mode('overwrite'), or a streaming query in complete output mode) "
            "would remove its rows. Write in append mode, or set delta.appendOnly to false "
            "if its rows may be replaced."
        )


# -- commit ------------------------------------------------------------------------------


def commit_id(files: Sequence[DataFile]) -> str:
    """A digest naming one set of files; file names are unique, so it names one write."""
    digest = hashlib.sha256("\n".join(sorted(f.path for f in files)).encode("utf-8"))
    return digest.hexdigest()[:32]


def commit_write(
    opts: SinkOptions,
    plan: WritePlan,
    files: Sequence[DataFile],
    *,
    mode: str,
    app_id: str | None,
    version: int | None,
    query_id: str | None = None,
) -> Outcome:
    """Add ``files`` to the table in one transaction, or refuse a version already there.

    ``mode`` is ``append`` or ``overwrite``. With ``app_id``, the transaction records
    ``(app_id, version)`` and a version at or below the recorded one is refused. With the
    streaming ``query_id`` too (unless it is the app id itself), it also records
    ``(query_txn_id(app_id, query_id), version)`` and ``(named_txn_id(app_id), version)``,
    and a version refused because *another* query recorded it under the same app id raises
    instead (see ``_check_same_query``).
    """
    from deltalake.exceptions import CommitFailedError, DeltaError
    from deltalake.transaction import (
        AddAction,
        CommitProperties,
        Transaction,
        create_table_with_add_actions,
    )

    uri = opts.table_uri
    adds = [
        AddAction(f.path, f.size, f.partition_values, f.modification_time, True, f.stats)
        for f in files
    ]
    cid = commit_id(files) if files else f"empty-{time.time_ns()}"
    metadata = {COMMIT_ID_KEY: cid}
    if app_id is not None and query_id is not None:
        metadata |= {APP_ID_KEY: app_id, QUERY_ID_KEY: query_id}
    transactions = None
    if app_id is not None and version is not None:
        transactions = [Transaction(app_id, version)]
        if query_id is not None and query_id != app_id:
            transactions += [
                Transaction(query_txn_id(app_id, query_id), version),
                Transaction(named_txn_id(app_id), version),
            ]
    props = CommitProperties(
        custom_metadata=metadata,
        max_commit_retries=opts.max_commit_retries,
        app_transactions=transactions,
    )
    what = _describe(files, app_id, version)
    table = load_table(uri, opts.storage_options)
    if table is None:
        try:
            create_table_with_add_actions(
                uri,
                delta_schema(plan.schema),
                adds,
                mode="error",
                partition_by=list(plan.partition_by),
                storage_options=opts.storage_options or None,
                commit_properties=props,
            )
            log.info("Created the Delta table at %s with %s.", uri, what)
            _remove_new_table_mark(opts)
            return Outcome.COMMITTED
        except DeltaError as exc:
            # Another writer may have created the table first: then commit normally.
            table = load_table(uri, opts.storage_options)
            if table is None:
                raise DeltaSinkError(
                    f"The delta_rs sink could not create the Delta table at {uri}: {exc}. "
                    "Check that the location is writable."
                ) from exc
    _check_partitioning(table, plan.partition_by, uri)
    check_table_features(table, uri, mode)  # again: the table may have changed since planning
    new_fields = check_schema(table, plan.schema, merge=opts.merge_schema, table_uri=uri)
    _check_not_null_kept(table, plan.schema, uri)
    if _already_committed(table, app_id, version):
        _check_same_query(table, app_id, version, query_id, uri)
        return _refuse(opts, files, app_id, version, query_id)
    if not files and mode == "append":
        return Outcome.NOTHING
    try:
        if new_fields:
            table.alter.add_columns(new_fields)
            log.info("Added the columns %s to %s (mergeSchema).", [f.name for f in new_fields], uri)
            # alter() moved this object to a newer snapshot: check again on that one.
            if _already_committed(table, app_id, version):
                _check_same_query(table, app_id, version, query_id, uri)
                return _refuse(opts, files, app_id, version, query_id)
        table.create_write_transaction(
            adds,
            mode,
            table.schema(),
            partition_by=list(plan.partition_by),
            commit_properties=props,
        )
    except CommitFailedError as exc:
        if "Unsupported table features" in str(exc):
            # Not a conflict: every re-run fails the same way, after writing its files.
            raise DeltaSinkError(
                f"The Delta table at {uri} needs writer features that delta-rs (deltalake "
                f"{_deltalake_version()}) cannot write ({exc}), so the commit of {what} was "
                "refused: nothing was committed and Spark removes the write's files. "
                "Re-running the write or restarting the query fails the same way: write to "
                "this table with Spark and the Delta Lake jars (delta-spark), or to another "
                "table."
            ) from exc
        raise DeltaSinkError(
            f"The commit of {what} to the Delta table at {uri} failed: {exc}. Spark "
            "aborts this write and removes its files. If another writer committed a "
            "conflicting change at the same time (for the same app id, a concurrent commit "
            "of the same batch), restart the query or re-run the write; otherwise fix the "
            "cause above first."
        ) from exc
    except DeltaError as exc:
        if commit_landed(opts, files):
            # A step after the commit failed (delta-rs writes a log checkpoint every so many
            # commits): the rows are in the table, and failing would make a re-run of a
            # write without txnAppId write them twice.
            log.warning(
                "Committed %s to %s, but delta-rs failed after the commit: %s. The table "
                "holds the write; fix the cause before the next commit runs into it.",
                what,
                uri,
                exc,
            )
            return Outcome.COMMITTED
        raise DeltaSinkError(
            f"The commit of {what} to the Delta table at {uri} failed: {exc}. Spark aborts "
            "this write and removes its files; fix the cause and re-run the write."
        ) from exc
    log.info("Committed %s to %s.", what, uri)
    return Outcome.COMMITTED


def _deltalake_version() -> str:
    from importlib.metadata import version

    return version("deltalake")


def _describe(files: Sequence[DataFile], app_id: str | None, version: int | None) -> str:
    rows = sum(f.num_records for f in files)
    text = f"{len(files)} file(s) holding {rows} row(s)"
    if app_id is not None:
        text += f" (app id {app_id!r}, version {version})"
    return text


def _already_committed(table: Any, app_id: str | None, version: int | None) -> bool:
    if app_id is None or version is None:
        return False
    committed = table.transaction_version(app_id)
    return committed is not None and version <= committed


#: How far back the commit info is read for the query that committed an app id's version,
#: when no app transaction records it (see ``_check_same_query``).
_SAME_QUERY_HISTORY = 1000


def _check_same_query(
    table: Any, app_id: str | None, version: int | None, query_id: str | None, uri: str
) -> None:
    """Raise if the app id's recorded version was committed by another streaming query.

    A replay comes from the same query (Spark keeps the query id across restarts from one
    checkpoint location). A *new* query given another query's ``txnAppId`` starts its batch
    ids at 0: every batch of it would be refused as a replay, and its rows silently lost.
    Each commit records how far its query got under the app id (``query_txn_id``), so a
    version is a replay only if this query's own record reaches it.

    If the app id's version was committed with no query on record (by this sink before it
    kept these app transactions, or by a write that had no query id), the commit info of
    the last 1,000 commits is the fallback: one naming another query stops this one; with
    none (no query named, or the history cleaned up) the refusal stands.
    """
    if app_id is None or version is None or query_id is None or app_id == query_id:
        return  # no query to tell, or the default app id: the query id itself
    own = table.transaction_version(query_txn_id(app_id, query_id))
    if own is not None and version <= own:
        return  # this query committed the version: a replay
    recorded = table.transaction_version(app_id)
    on_record = table.transaction_version(named_txn_id(app_id)) == recorded
    other = _last_query_in_history(table, app_id)
    if own is None and not on_record and other in (None, query_id):
        return
    # Another query committed the version; the history, if it still holds that commit,
    # only names it.
    by = f" ({other})" if other is not None and other != query_id else ""
    raise DeltaSinkError(
        f"The Delta table at {uri} already holds batch {recorded} of app id {app_id!r}, "
        f"committed by another streaming query{by}; this query ({query_id}) is at batch "
        f"{version}, so its batches would be refused as replays and their rows never "
        "written. Nothing was committed. Give each query its own txnAppId (in writeStream "
        "you may leave the option out: the query id is used), or restart the other query "
        "from its own checkpoint location."
    )


def _last_query_in_history(table: Any, app_id: str) -> str | None:
    """The query named by the newest of the last 1,000 commits that name ``app_id``."""
    entry = next(
        (e for e in table.history(_SAME_QUERY_HISTORY) if e.get(APP_ID_KEY) == app_id), None
    )
    return entry.get(QUERY_ID_KEY) if entry is not None else None


def _refuse(
    opts: SinkOptions,
    files: Sequence[DataFile],
    app_id: str | None,
    version: int | None,
    query_id: str | None,
) -> Outcome:
    if files and commit_landed(opts, files):
        # This very set of files is in the table: a retried commit() of a commit that
        # landed. Report success so Spark moves on, and keep the files.
        return Outcome.COMMITTED
    deleted = _delete(opts, files)
    if query_id is not None:
        why = "a replayed batch of this query"
    else:
        why = (
            "no streaming query id reached this write's tasks (a batch write; or "
            "foreachBatch under Spark Connect, or in a thread of your own), so the sink "
            "could not check which query committed that version. A re-run of the same "
            "write is rightly refused; but if this write is a batch of a query started "
            "from a new checkpoint location that reuses this txnAppId, its rows were not "
            "written: give each checkpoint location its own txnAppId"
        )
    log.warning(
        "Refused version %s of app id %r for the Delta table at %s: the table already "
        "holds that version (%s). Nothing was added; this write's %d file(s) were deleted.",
        version,
        app_id,
        opts.table_uri,
        why,
        len(deleted),
    )
    return Outcome.REFUSED


def commit_landed(opts: SinkOptions, files: Sequence[DataFile]) -> bool:
    """True if a commit of exactly these files is in the table: one of them is in its
    current version, or the commit is in its history (a later one may have removed them).

    delta-rs's history lists only commits that carry commit info, which the Delta protocol
    leaves optional (a writer may omit it): the current version is looked at first, so that
    the files of a landed commit are never taken for a lost one's. Only commits made after
    the oldest file was written (minus clock skew) can hold them, so the history is read
    newest first, in growing pages, back to that time (entries without a time do not end
    it).
    """
    table = load_table(opts.table_uri, opts.storage_options)
    if table is None or not files:
        return False
    from checkpoint._layout import table_files

    current = table_files(table)
    if any(f.path in current for f in files):
        return True
    wanted = commit_id(files)
    not_before = min(f.modification_time for f in files) - CLOCK_SKEW_MS
    limit = 32
    while True:
        history = table.history(limit)
        if any(entry.get(COMMIT_ID_KEY) == wanted for entry in history):
            return True
        if len(history) < limit:
            return False
        stamps = [int(entry["timestamp"]) for entry in history if entry.get("timestamp")]
        if stamps and min(stamps) < not_before:
            return False
        limit *= 4


def abort_write(opts: SinkOptions, files: Sequence[DataFile]) -> list[str]:
    """Delete the files of a write that did not land; keep them if it might have.

    Never raises: Spark calls this after a failure, whose error is the one to report.
    """
    if not files:
        return []
    try:
        if commit_landed(opts, files):
            log.warning(
                "Not deleting the %d file(s) of an aborted write to %s: a commit holding "
                "them is in the table.",
                len(files),
                opts.table_uri,
            )
            return []
        return _delete(opts, files)
    except Exception:  # noqa: BLE001 - abort must not mask the original failure
        log.exception(
            "Could not clean up an aborted write to %s; its files are orphans that "
            "clean_orphan_files() removes.",
            opts.table_uri,
        )
        return []


def _delete(opts: SinkOptions, files: Sequence[DataFile]) -> list[str]:
    storage = TableStorage(opts.table_uri, opts.storage_options)
    return [f.path for f in files if storage.delete(f.path)]


# -- orphan files ------------------------------------------------------------------------


def _is_hidden(rel: str) -> bool:
    parts = rel.split("/")
    if parts[0] == "_delta_log":
        return True
    return any(p.startswith(("_", ".")) and "=" not in p for p in parts)


def _log_path(path: str, storage: TableStorage) -> str | None:
    """A path from an add/remove action as a path relative to the table root."""
    if not is_uri(path):
        return unquote(path)
    full = unquote(urlparse(path).path)
    root = urlparse(storage.table_uri).path if is_uri(storage.table_uri) else storage.table_uri
    root = root.rstrip("/") + "/"
    return full[len(root) :] if full.startswith(root) else None


def referenced_paths(storage: TableStorage) -> set[str]:
    """Every data file that any retained version of the table refers to.

    Commit files (``*.json``) hold every add and remove since the oldest retained one;
    checkpoints (and v2 sidecars) hold the files live or tombstoned at their version.
    """
    refs: set[str] = set()
    for rel, _ in storage.list_files("_delta_log"):
        name = posixpath.basename(rel)
        paths: list[str] = []
        if name.endswith(".json"):
            for line in storage.read_text(rel).splitlines():
                if not line.strip():
                    continue
                action = json.loads(line)
                for kind in ("add", "remove", "cdc"):
                    body = action.get(kind)
                    if isinstance(body, dict) and isinstance(body.get("path"), str):
                        paths.append(body["path"])
        elif name.endswith(".parquet"):
            parquet = pq.ParquetFile(storage.open_input(rel))
            kinds = [k for k in ("add", "remove", "cdc") if k in parquet.schema_arrow.names]
            if kinds:
                data = parquet.read(columns=kinds)
                for kind in kinds:
                    column = data.column(kind).combine_chunks()
                    index = column.type.get_field_index("path")
                    if index >= 0:
                        values = column.flatten()[index]
                        paths.extend(p for p in values.to_pylist() if p is not None)
        for path in paths:
            relative = _log_path(path, storage)
            if relative is not None:
                refs.add(relative)
    return refs


def find_orphans(storage: TableStorage, older_than_seconds: float) -> list[str]:
    """Parquet files under the table that no retained version refers to and that were
    last modified more than ``older_than_seconds`` ago."""
    cutoff_ms = (time.time() - older_than_seconds) * 1000
    # List the files before reading the log: a file committed in between is then in the
    # log we read, so it cannot be mistaken for an orphan.
    candidates = data_files(storage.list_files())
    referenced = referenced_paths(storage)
    return sorted(rel for rel, mtime in candidates if rel not in referenced and mtime < cutoff_ms)


def data_files(files: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Of a location's ``files`` (``TableStorage.list_files``), the Parquet files a table
    there could hold: none hidden, none of a Delta table nested inside (a checkpoint
    location kept inside the table, say: its files are its own)."""
    nested = {rel.split("/_delta_log/")[0] + "/" for rel, _ in files if "/_delta_log/" in rel}
    return sorted(
        (rel, mtime)
        for rel, mtime in files
        if rel.endswith(".parquet")
        and not _is_hidden(rel)
        and not any(rel.startswith(root) for root in nested)
    )


def clean_after_commit(opts: SinkOptions) -> None:
    """The ``cleanOrphans`` option: remove old orphans; failures are only logged."""
    try:
        storage = TableStorage(opts.table_uri, opts.storage_options)
        orphans = find_orphans(storage, opts.orphan_retention_seconds)
        for rel in orphans:
            storage.delete(rel)
        if orphans:
            log.info("Removed %d orphan file(s) from %s.", len(orphans), opts.table_uri)
    except Exception:  # noqa: BLE001 - the commit landed; cleaning can wait for next time
        log.exception("Could not remove orphan files from %s after a commit.", opts.table_uri)
