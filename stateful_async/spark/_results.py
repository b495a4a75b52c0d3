"""Results to Arrow: a task's result dicts become one batch of the output schema, or a
``ResultSchemaError`` that names the field, the value and the input row.

pyarrow converts some values it cannot hold by dropping data (1.5 into a long becomes 1, a
struct's unknown keys vanish, a Decimal written with more than 38 digits can become 0),
reads some as something else (an epoch in seconds for a
timestamp as microseconds, a string for an array as its characters, bytes for a string as
UTF-8 text, when they are) and lets a null into
a field the schema declares NOT NULL (which Spark's JVM then fails on with a bare stack
trace): all are refused here.
"""

from __future__ import annotations

import datetime as dt
import decimal
import functools
import math
import numbers
import operator
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from .._elements import describe
from .._exceptions import ResultSchemaError

_DECIMAL_DIGITS = 38  # the most a Spark DECIMAL holds

# what pyarrow raises for a value it cannot convert to a type
_CONVERSION_ERRORS = (
    pa.ArrowInvalid,
    pa.ArrowTypeError,
    pa.ArrowNotImplementedError,  # a numpy number for a timestamp or an interval
    OverflowError,
    TypeError,
    ValueError,
)


def to_batch(
    rows: list[dict[str, Any]],
    sources: list[Any],
    schema: pa.Schema,
    described: Callable[[Any], str] = describe,
    units: Units = None,
) -> pa.RecordBatch:
    """``rows`` (results of the input rows ``sources``) as a batch of ``schema``; a result
    that does not fit fails with ``ResultSchemaError`` naming its input row, as
    ``described`` words it (a task's: the row as the function got it, and its place).
    ``units`` says which of its durations are Spark intervals ending above seconds."""
    for field in schema:
        if _holds_map(field.type):  # before pyarrow sees them: see _none_map_entry
            for row, source in zip(rows, sources, strict=True):
                if (loss := _none_map_entry(row.get(field.name), field.type)) is not None:
                    raise _refusal(field.name, loss, described(source))
    try:
        batch = pa.RecordBatch.from_pylist(rows, schema=schema)
    except _CONVERSION_ERRORS:
        pass
    else:
        # pyarrow converts some values it cannot hold by dropping data (1.5 into a long
        # becomes 1, a struct's unknown keys vanish): refuse those, naming the field.
        for name, check, passes in _lossy_checks(schema, units):
            # a column of plain values (floats for a DOUBLE, Decimals pyarrow reads right)
            # costs no Python call per row
            if passes(map(operator.itemgetter(name), rows)):
                continue
            for row, source in zip(rows, sources, strict=True):
                value = row[name]
                if value is not None and (problem := check(value)) is not None:
                    raise _refusal(name, problem, described(source))
        # ... and lets a null into a NOT NULL field, which Spark's JVM fails on.
        found = _first_null(batch, [field for _, field in _required_fields(schema)])
        if found is not None:
            row_index, required, problem = found
            raise _refusal(required.name, problem, described(sources[row_index]))
        return batch
    checks = {name: check for name, check, _ in _lossy_checks(schema, units, refused=True)}
    for row, source in zip(rows, sources, strict=True):  # find the culprit, for the message
        for field in schema:
            value = row.get(field.name)
            try:
                pa.array([value], type=field.type)
            except _CONVERSION_ERRORS as exc:
                # pyarrow refuses a frozenset (a set it takes) at any depth: what the lossy
                # checks find in the value says what to do, in place of pyarrow's words
                if (loss := _loss_in(checks.get(field.name), value)) is not None:
                    raise _refusal(field.name, loss, described(source)) from exc
                # pyarrow names neither where in a struct, an array or a map the value it
                # refuses is, nor what the type there takes ("Expected bytes, got a 'int'")
                # (nor, for the value itself, what the type takes: said as it is for a nested one)
                loss = _refused_in(value, field.type) or _Loss(
                    "", field.type, value, _takes(field.type, value, exc)
                )
                raise _refusal(field.name, loss, described(source)) from exc
    # Every value converts alone but a column does not: pyarrow takes the form of a
    # column's values (a struct as a dict, or as a tuple) from its first one.
    for field in schema:
        values = [row.get(field.name) for row in rows]
        if (at := _first_failing_prefix(values, field.type)) is None:
            continue
        first = next(value for value in values if value is not None)
        raise ResultSchemaError(
            f"The result field {field.name!r} ({field.type}) cannot hold {describe(values[at])} "
            f"({type(values[at]).__name__}), returned for input row "
            f"{described(sources[at])}, in the same batch as {describe(first)} "
            f"({type(first).__name__}). Return each field in one form for every row (a struct "
            "always as a dict, or always as a tuple)."
        )
    raise ResultSchemaError(  # pragma: no cover - one of the searches above finds it
        f"The results could not be converted to the output schema {schema}."
    )


def _first_failing_prefix(values: list[Any], arrow_type: pa.DataType) -> int | None:
    """The index of the value that makes ``values`` fail to convert, or None if they convert."""

    def converts(count: int) -> bool:
        try:
            pa.array(values[:count], type=arrow_type)
        except _CONVERSION_ERRORS:
            return False
        return True

    if converts(len(values)):
        return None
    good, bad = 0, len(values)  # the first `good` values convert, the first `bad` do not
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if converts(middle) else (good, middle)
    return bad - 1


def _refused_alone(value: Any, arrow_type: pa.DataType) -> Exception | None:
    """pyarrow's error for ``value`` alone as ``arrow_type``; None if it converts."""
    try:
        pa.array([value], type=arrow_type)
    except _CONVERSION_ERRORS as exc:
        return exc
    return None


def _holds_map(arrow_type: pa.DataType) -> bool:
    """Whether ``arrow_type`` is a map or holds one at any depth."""
    if pa.types.is_map(arrow_type):
        return True
    if is_list_type(arrow_type):
        return _holds_map(arrow_type.value_type)
    if pa.types.is_struct(arrow_type):
        return any(_holds_map(f.type) for f in arrow_type)
    return False


def _none_map_entry(value: Any, arrow_type: pa.DataType) -> _Loss | None:
    """A map in ``value`` (of ``arrow_type``) given as a list of (key, value) pairs with a
    None among them: pyarrow makes a null entry of it, and its check of the map array
    aborts the whole Python process ("Map array child array should have no nulls"), which
    Spark reports as a crashed worker, naming no row."""
    if value is None:
        return None
    if pa.types.is_map(arrow_type):
        if isinstance(value, dict):
            entries = list(value.items())
        elif isinstance(value, (list, tuple)):
            if any(entry is None for entry in value):
                return _Loss("", arrow_type, value, _NONE_ENTRY)
            entries = [e for e in value if isinstance(e, tuple) and len(e) == 2]
        else:
            return None  # pyarrow refuses it, and the checks say why
        if _holds_map(arrow_type.item_type):
            for key, item in entries:
                if (loss := _none_map_entry(item, arrow_type.item_type)) is not None:
                    return loss.under(f"[{key!r}]")
        return None
    if is_list_type(arrow_type) and isinstance(value, (list, tuple)):
        for i, element in enumerate(value):
            if (loss := _none_map_entry(element, arrow_type.value_type)) is not None:
                return loss.under(f"[{i}]")
    if pa.types.is_struct(arrow_type) and isinstance(value, (dict, tuple)):
        for i, field in enumerate(arrow_type):
            if isinstance(value, dict):
                child = value.get(field.name)
            else:
                child = value[i] if i < len(value) else None
            if _holds_map(field.type) and (loss := _none_map_entry(child, field.type)):
                return loss.under(f".{field.name}")
    return None


_NONE_ENTRY = (
    "a map field takes a dict or a list of (key, value) pairs, and None is no pair: leave "
    "it out, or give (key, None) for a key without a value"
)


def _refused_in(value: Any, arrow_type: pa.DataType) -> _Loss | None:
    """Where inside ``value``, which pyarrow refused as ``arrow_type``, is the value it
    refuses (at any depth), and what the type there takes; None if it is ``value`` itself,
    or if each part of it converts alone. Only on the error path: a binary search of an
    array's elements, a map's keys and its values finds the first refused one."""
    # (path, values, their type, and for a map's values their keys, to name each by)
    parts: list[tuple[str, list[Any], pa.DataType, list[Any] | None]] = []
    try:
        if pa.types.is_struct(arrow_type):
            children = _children(arrow_type)
            if isinstance(value, dict):
                fields = [value.get(child.name) for child in children]
            elif isinstance(value, tuple):  # by position, as pyarrow takes it
                fields = list(value[: len(children)])
            else:
                return None
            parts = [
                (f".{c.name}", [v], c.type, None) for c, v in zip(children, fields, strict=False)
            ]
        elif pa.types.is_map(arrow_type):
            entries = list(_map_entries(value))
            for k, v in entries:
                if k is None:  # pyarrow: "Invalid Map: key field cannot contain null values"
                    reason = (
                        f"a map's keys cannot be null (Spark's maps have none), and the entry "
                        f"None: {describe(v)} has one: drop it, or give it a key"
                    )
                    return _Loss("{key}", arrow_type.key_type, None, reason)
            names = [k for k, _ in entries]
            parts = [
                ("{key}", names, arrow_type.key_type, None),
                ("", [v for _, v in entries], arrow_type.item_type, names),
            ]
        elif is_list_type(arrow_type) and not isinstance(value, (str, bytes, dict)):
            parts = [("", list(value), arrow_type.value_type, None)]
    except (TypeError, ValueError):  # not a form pyarrow takes for the type: its words then
        return None
    for path, values, value_type, keys in parts:
        at = _first_failing_prefix(values, value_type)
        if at is None or values[at] is None:
            continue
        if (exc := _refused_alone(values[at], value_type)) is None:
            return None  # refused only with the others (a struct as a dict, then a tuple)
        where = path or (f"[{keys[at]!r}]" if keys is not None else f"[{at}]")
        inner = _refused_in(values[at], value_type)
        found = inner or _Loss("", value_type, values[at], _takes(value_type, values[at], exc))
        return found.under(where)
    return None


def _takes(arrow_type: pa.DataType, value: Any, exc: Exception) -> str:
    """What a field of ``arrow_type`` takes, in plain words, and that ``value`` is not it
    (pyarrow's ``exc`` where no words here fit, or where ``value`` is a form the type takes,
    a list of pairs for a map or a struct, and the fault is in its entries)."""
    found = type(value).__name__
    if found == "NaTType":
        return "NaT is pandas' missing time: return None for a missing value"
    takes = next((words for kind, words in _WHAT_IT_TAKES if kind(arrow_type)), None)
    if takes is None:  # words that depend on the type's parameters, or on the value's form
        if pa.types.is_decimal(arrow_type):
            precision, scale = arrow_type.precision, arrow_type.scale
            takes = f"a DECIMAL({precision},{scale}) field takes a Decimal or an int"
        elif pa.types.is_map(arrow_type):
            if isinstance(value, (list, tuple)):  # a form pyarrow takes: its words say why
                return f"a map field takes a dict or a list of (key, value) pairs, and {exc}"
            takes = "a map field takes a dict"
        elif pa.types.is_struct(arrow_type):
            names = [arrow_type.field(i).name for i in range(arrow_type.num_fields)]
            takes = f"a STRUCT field takes a dict keyed by its field names {names}, or a tuple"
            if isinstance(value, list):  # of (name, value) pairs, which pyarrow takes too
                return f"{takes} or a list of (name, value) pairs, and {exc}"
        elif pa.types.is_null(arrow_type):  # pyarrow: "Invalid null value"
            return (
                "a VOID field (one declared without a type) holds only None: declare the type "
                "of its values in the output schema instead (array<string> for array<void>, ...)"
            )
        else:
            return f"pyarrow refuses it: {exc}"
    return f"{takes}, not {'an' if found[0] in 'aeiouAEIOU' else 'a'} {found}"


def _refusal(name: str, problem: _Loss, source: str) -> ResultSchemaError:
    """The error for a result value that ``problem`` says pyarrow would change; ``source``
    describes the input row."""
    return ResultSchemaError(
        f"The result field {name + problem.path!r} ({problem.type}) cannot hold "
        f"{describe(problem.value)} ({type(problem.value).__name__}): {problem.reason}, "
        f"returned for input row {source}. Return values of the types the output schema "
        "declares."
    )


@dataclass(frozen=True)
class _Loss:
    """A value pyarrow would convert with loss: where below the field, its type, why."""

    path: str
    type: pa.DataType
    value: Any
    reason: str

    def under(self, prefix: str) -> _Loss:
        return _Loss(prefix + self.path, self.type, self.value, self.reason)


_Check = Callable[[Any], "_Loss | None"]  # None: pyarrow converts the value without loss


@dataclass(frozen=True)
class IntervalUnit:
    """The finest field of a Spark DAY-TIME interval that ends above seconds (``INTERVAL
    DAY``, ``DAY TO HOUR``, ``HOUR TO MINUTE``, ...): Arrow carries every DAY-TIME interval
    as a duration in microseconds, and Spark takes a part below this field as it is, but
    casts and shows the value without it."""

    name: str  # "day", "hour" or "minute"
    micros: int  # its length
    type_name: str  # Spark's, e.g. "interval day to hour"


# What the output schema's Arrow types do not say of its Spark types: for a type, None (no
# IntervalUnit inside), its IntervalUnit (a duration), or a tuple of its children's
# (a struct's fields', a list's element's, a map's key's and value's).
Units = Any


@functools.lru_cache(maxsize=64)
def _lossy_checks(
    schema: pa.Schema, units: Units = None, refused: bool = False
) -> tuple[tuple[str, _Check, Callable[[Iterable[Any]], bool]], ...]:
    """The top-level fields whose values pyarrow might convert with loss, with their checks
    and a test of a column's values that is true only if the check passes each of them
    without a Python call per value. ``refused``: with the checks that only say why pyarrow
    refused a value (see ``_check_for``)."""
    return tuple(
        (field.name, check, _column_test(field.type))
        for i, field in enumerate(schema)
        if (check := _check_for(field.type, _child(units, i), refused)) is not None
    )


def _column_test(arrow_type: pa.DataType, refused: bool = False) -> Callable[[Iterable[Any]], bool]:
    """See ``_lossy_checks``: whether a column's values are all of the types the field's
    check always passes (None's included), or Decimals pyarrow reads right (``refused``:
    never for Decimals and integers, whose checks then say why pyarrow refused one: too
    many digits, or beyond the type's range)."""
    if refused and (pa.types.is_decimal(arrow_type) or pa.types.is_integer(arrow_type)):
        return _never
    if pa.types.is_decimal(arrow_type):
        return _read_right
    plain = _passed(arrow_type)
    return lambda values: plain.issuperset(map(type, values))


def _passed(arrow_type: pa.DataType, refused: bool = False) -> frozenset[type]:
    """The types of value the check of a field of ``arrow_type`` always passes (None's
    included), to test without calling it; of a refused batch, and for Decimals, None's
    only (see ``_column_test``)."""
    if refused or pa.types.is_decimal(arrow_type):
        return _NONE_ONLY
    return frozenset({type(None), *_plain_types(arrow_type)})


_NONE_ONLY = frozenset({type(None)})


def _never(values: Iterable[Any]) -> bool:
    return False


def _child(units: Units, i: int) -> Units:
    return None if units is None else units[i]


def _plain_types(arrow_type: pa.DataType) -> tuple[type, ...]:
    if pa.types.is_integer(arrow_type):
        return (int,)
    if pa.types.is_floating(arrow_type) and not _is_single(arrow_type):
        return (float, int)
    if _is_binary(arrow_type):
        return (bytes,)
    if _is_string(arrow_type):
        return (str,)
    return ()


def _is_binary(arrow_type: pa.DataType) -> bool:
    """What Spark's BINARY arrives as (large with spark.sql.execution.arrow.useLargeVarTypes)."""
    return pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type)


def _is_string(arrow_type: pa.DataType) -> bool:
    """What Spark's STRING arrives as (large with spark.sql.execution.arrow.useLargeVarTypes)."""
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def _is_single(arrow_type: pa.DataType) -> bool:
    """A float of 32 bits or fewer: a Python float may be beyond its range."""
    return pa.types.is_float32(arrow_type) or pa.types.is_float16(arrow_type)


def is_list_type(arrow_type: pa.DataType) -> bool:
    """An Arrow list of any kind: what Spark's ARRAY arrives as."""
    return (
        pa.types.is_list(arrow_type)
        or pa.types.is_large_list(arrow_type)
        or pa.types.is_fixed_size_list(arrow_type)
    )


def _check_for(
    arrow_type: pa.DataType, units: Units = None, refused: bool = False
) -> _Check | None:
    """The check of values of ``arrow_type``. With ``refused``, for values pyarrow refused,
    it also finds what it says in words no one could act on (a DECIMAL's too many digits):
    checks a batch that converted has no need of. Without, a DECIMAL's check finds only the
    values pyarrow read wrongly (see ``_DECIMAL_WIDTH``)."""
    if pa.types.is_integer(arrow_type):
        low, high, beyond = _integer_range(arrow_type)

        def check_integer(value: Any) -> _Loss | None:
            if type(value) is int and not refused:
                return None
            if isinstance(value, np.bool_):  # pyarrow refuses a bool, but takes numpy's as 1
                return _Loss("", arrow_type, value, _BOOLEAN_NUMBER)
            if isinstance(value, bool):  # pyarrow: "Expected integer, got bool"
                return _Loss("", arrow_type, value, _BOOLEAN_INTEGER) if refused else None
            if not isinstance(value, (numbers.Number, decimal.Decimal)):
                return None  # pyarrow refuses it outright
            if not isinstance(value, numbers.Integral):
                try:
                    whole = value == int(value)  # type: ignore[arg-type]
                except (ValueError, OverflowError, TypeError):
                    whole = False  # nan, inf, complex
                if not whole:  # 2.0 is 2: pyarrow converts it without loss
                    return _Loss("", arrow_type, value, "an integer field would truncate it")
            # (of a value pyarrow refused) "Value 300 too large to fit in C integer type"
            if refused and not low <= int(value) <= high:  # type: ignore[arg-type]
                return _Loss("", arrow_type, value, beyond)
            return None

        return check_integer
    if pa.types.is_struct(arrow_type):
        children = [arrow_type.field(i) for i in range(arrow_type.num_fields)]
        order = [child.name for child in children]
        names = frozenset(order)
        # each field's check, and the types it always passes (no Python call for those)
        checks = [
            (child.name, _check_for(child.type, _child(units, i), refused), _passed(child.type))
            for i, child in enumerate(children)
        ]

        def check_struct(value: Any) -> _Loss | None:
            if isinstance(value, dict):
                extra = value.keys() - names
                if extra:  # pyarrow would drop them (a missing key is null, as in Spark)
                    reason = (
                        f"unexpected field(s) {sorted(extra, key=repr)} would be dropped "
                        f"(the struct has {order})"
                    )
                    return _Loss("", arrow_type, value, reason)
                fields: Any = (
                    (name, check, plain, value.get(name)) for name, check, plain in checks
                )
            elif isinstance(value, tuple):  # taken by position, its names notwithstanding
                # a Row names its fields __fields__, a namedtuple _fields
                kind = "Row" if hasattr(value, "__fields__") else "namedtuple"
                row_names = getattr(value, "__fields__", None) or getattr(value, "_fields", None)
                if row_names is not None and list(row_names) != order:
                    reason = (
                        f"a {kind}'s fields are taken by position, and its fields "
                        f"{list(row_names)} are not the struct's {order} in order: return a "
                        f"dict, or a {kind} with the struct's fields in order"
                    )
                    return _Loss("", arrow_type, value, reason)
                fields = (
                    (name, check, plain, child)
                    for (name, check, plain), child in zip(checks, value, strict=False)
                )
            elif not refused or _pairs(value):  # pyarrow takes [(name, value), ...] too
                return None  # pyarrow refuses it outright
            else:  # pyarrow: "was expecting tuple of (key, value) pair" for a list
                reason = (
                    f"a STRUCT field takes a dict keyed by its field names {order}, or a tuple "
                    "of its fields in order"
                )
                return _Loss("", arrow_type, value, reason)
            for name, check, plain, child in fields:
                if check is not None and type(child) not in plain and (loss := check(child)):
                    return loss.under(f".{name}")
            return None

        return check_struct
    if is_list_type(arrow_type):
        check_element = _check_for(arrow_type.value_type, _child(units, 0), refused)
        plain = _column_test(arrow_type.value_type, refused)  # no Python call per element

        def check_list(value: Any) -> _Loss | None:
            if isinstance(value, (set, frozenset)):  # pyarrow takes a set in its iteration order
                return _Loss("", arrow_type, value, _SET_ORDER)
            if isinstance(value, (str, bytes, bytearray)):  # pyarrow splits it up
                reason = (
                    "an array field would split it into its characters (or bytes): "
                    "return a list, e.g. [value]"
                )
                return _Loss("", arrow_type, value, reason)
            if isinstance(value, dict):  # pyarrow refuses it; iterated, its keys would be blamed
                reason = "an array field takes a list, not a dict: return [value] for one element"
                return _Loss("", arrow_type, value, reason) if refused else None
            if check_element is not None and not plain(value):
                for i, element in enumerate(value):
                    if element is not None and (loss := check_element(element)):
                        return loss.under(f"[{i}]")
            return None

        return check_list
    if pa.types.is_timestamp(arrow_type) or pa.types.is_date(arrow_type):
        return _check_datetime(arrow_type)
    if pa.types.is_decimal(arrow_type):
        return _check_decimal(arrow_type) if refused else _check_wide_decimal(arrow_type)
    if pa.types.is_time(arrow_type):  # Spark's TIME, as time64[ns]
        units = {"s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "nanoseconds"}
        time_reason = (
            f"a TIME field would read a number as {units[arrow_type.unit]} since midnight: "
            "return a datetime.time"
        )

        def check_time(value: Any) -> _Loss | None:
            if _is_number(value):  # 5 would be 00:00:00.000000005, 5.7 too
                return _Loss("", arrow_type, value, time_reason)
            if isinstance(value, dt.time) and value.tzinfo is not None:
                return _Loss("", arrow_type, value, _zoned_time(value))
            return None

        return check_time
    if pa.types.is_duration(arrow_type):
        interval = units if isinstance(units, IntervalUnit) else None

        def check_duration(value: Any) -> _Loss | None:
            if _is_number(value):
                reason = "an interval field would read a number as microseconds: return a timedelta"
                return _Loss("", arrow_type, value, reason)
            if isinstance(value, dt.timedelta):
                unit = getattr(value, "unit", None)
                if unit in _ZEROED_UNITS and value != _NO_TIME:  # 0 is read right
                    return _Loss("", arrow_type, value, _zeroed(unit))
                if dropped := _nanoseconds(value, "nanoseconds"):
                    return _Loss("", arrow_type, value, dropped)
            if isinstance(value, np.timedelta64) and (misread := _numpy_unit(value, arrow_type)):
                return _Loss("", arrow_type, value, misread)
            if interval is not None and (below := _below_unit(value, interval)):
                return _Loss("", arrow_type, value, below)
            return None

        return check_duration
    if pa.types.is_floating(arrow_type):
        single = _is_single(arrow_type)

        def check_float(value: Any) -> _Loss | None:
            if isinstance(value, bool):  # pyarrow takes it as 1.0 or 0.0
                return _Loss("", arrow_type, value, _BOOLEAN_NUMBER)
            if refused and isinstance(value, decimal.Decimal):  # "Could not convert Decimal(..."
                return _Loss("", arrow_type, value, _DECIMAL_FLOAT)
            if isinstance(value, np.uint64) and value > _INT64_MAX:
                # pyarrow reads its 64 bits as a signed number: 2**64 - 1 becomes -1.0
                reason = (
                    "a floating-point field would wrap it to a negative number: return float(value)"
                )
                return _Loss("", arrow_type, value, reason)
            if single and isinstance(value, numbers.Real):
                try:
                    number = float(value)
                except OverflowError:
                    return None  # pyarrow refuses it outright
                if math.isfinite(number) and abs(number) > _FLOAT32_MAX:
                    reason = "a FLOAT field (32 bits) would make it infinite: declare it DOUBLE"
                    return _Loss("", arrow_type, value, reason)
                # below the smallest normal float32 it keeps fewer digits, down to none
                if 0 < abs(number) < _FLOAT32_TINY:
                    stored = float(np.float32(number))
                    if stored != number:
                        reason = (
                            f"a FLOAT field (32 bits) would round it to {stored!r} (it holds "
                            f"numbers down to {_FLOAT32_TINY:.7g} with full precision): "
                            "declare it DOUBLE"
                        )
                        return _Loss("", arrow_type, value, reason)
            return None

        return check_float
    if _is_binary(arrow_type):

        def check_binary(value: Any) -> _Loss | None:
            # pyarrow stores a str's UTF-8 bytes: base64 or hex text would stay text
            return _Loss("", arrow_type, value, _TEXT_BYTES) if isinstance(value, str) else None

        return check_binary
    if _is_string(arrow_type):

        def check_string(value: Any) -> _Loss | None:
            # pyarrow decodes bytes as UTF-8, and refuses those that are not: a job would
            # pass on some rows and fail on others, or store binary data as text
            binary = isinstance(value, (bytes, bytearray, memoryview))
            return _Loss("", arrow_type, value, _BYTES_TEXT) if binary else None

        return check_string
    if pa.types.is_map(arrow_type):
        key = _check_for(arrow_type.key_type, _child(units, 0), refused)
        item = _check_for(arrow_type.item_type, _child(units, 1), refused)
        plain_keys = _passed(arrow_type.key_type, refused)
        plain_items = _passed(arrow_type.item_type, refused)

        def check_map(value: Any) -> _Loss | None:
            # pairs (not a dict) can repeat a key, and Spark's maps cannot: pyarrow would
            # make a map that reads one value or the other depending on how it is read
            if isinstance(value, dict):
                if (key is None or plain_keys.issuperset(map(type, value))) and (
                    item is None or plain_items.issuperset(map(type, value.values()))
                ):
                    return None
                seen: set[Any] | None = None
            else:
                seen = set()
                for entry in value:
                    if isinstance(entry, dict) and (extra := entry.keys() - _ENTRY_KEYS):
                        reason = (  # pyarrow would drop them, as a struct's
                            f"a map entry {describe(entry)} has unexpected key(s) "
                            f"{sorted(extra, key=repr)}, which would be dropped (an entry "
                            "given as a dict has 'key' and 'value'): return a dict of the map, "
                            "or its entries as (key, value) pairs"
                        )
                        return _Loss("", arrow_type, value, reason)
            for k, v in _map_entries(value):
                if key is not None and k is not None and (loss := key(k)):
                    return loss.under("{key}")  # as the checks before the job name a key
                if item is not None and v is not None and (loss := item(v)):
                    return loss.under(f"[{k!r}]")
                if seen is not None:
                    try:
                        if k in seen:
                            reason = (
                                f"a map field would hold the key {k!r} twice, and a Spark map "
                                "holds each key once: keep one entry per key (a dict does)"
                            )
                            return _Loss("", arrow_type, value, reason)
                        seen.add(k)
                    except TypeError:  # an unhashable key (a struct as a dict): not checked
                        seen = None
            return None

        return check_map
    return None


_FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT64_MAX = np.uint64(np.iinfo(np.int64).max)
_FLOAT32_TINY = float(np.finfo(np.float32).smallest_normal)  # 2**-126, 1.175494e-38
_TEXT_BYTES = (
    "a BINARY field would store the text's UTF-8 bytes, and Spark refuses a str for one "
    "(in createDataFrame and a UDF's result): return bytes, e.g. value.encode() for its "
    "UTF-8 bytes or base64.b64decode(value) for base64 text, or declare the field STRING"
)
# What a field of a type takes, in plain words (see _takes), where the words are the same
# for every type of the kind.
_WHAT_IT_TAKES: tuple[tuple[Callable[[pa.DataType], bool], str], ...] = (
    (pa.types.is_boolean, "a BOOLEAN field takes a bool"),
    (pa.types.is_integer, "an integer field takes an int"),
    (pa.types.is_floating, "a floating-point field takes a float (or an int)"),
    (_is_string, "a STRING field takes a str"),
    (_is_binary, "a BINARY field takes bytes"),
    (pa.types.is_date, "a DATE field takes a datetime.date"),
    (pa.types.is_timestamp, "a timestamp field takes a datetime.datetime"),
    (pa.types.is_time, "a TIME field takes a datetime.time"),
    (pa.types.is_duration, "an interval field takes a datetime.timedelta"),
    (is_list_type, "an array field takes a list"),
)
_BYTES_TEXT = (
    "a STRING field takes text, not bytes (pyarrow would decode them as UTF-8, and refuse "
    "those that are not): return value.decode() for UTF-8 text, or declare the field BINARY"
)
_SET_ORDER = (
    "an array field holds its elements in order, and a set's order is arbitrary (it can "
    "differ from one process, a retried task, to the next): return sorted(value), or "
    "list(value) if any order will do"
)
_BOOLEAN_NUMBER = (
    "a numeric field would take a boolean as 1 or 0: return a number, or declare the field BOOLEAN"
)
_BOOLEAN_INTEGER = (
    "an integer field takes an int, not a boolean: return int(value) for 1 or 0, or declare "
    "the field BOOLEAN"
)
_DECIMAL_FLOAT = (
    "a floating-point field takes a float (or an int), not a Decimal: return float(value) "
    "if its nearest binary fraction will do, or declare the field DECIMAL to keep its digits"
)


def _zoned_time(value: dt.time) -> str:
    """Why a time with a tzinfo cannot go into a TIME field: pyarrow would drop the tzinfo.
    A zone's tzinfo (a ZoneInfo's) gives a time without a date no UTC offset, so Python
    calls that time naive: the message neither calls it aware nor asks for a naive time."""
    zone = value.tzinfo
    shown = str(zone) if isinstance(zone, dt.timezone) else repr(zone)  # UTC+05:00
    naive = (
        ""
        if value.utcoffset() is not None
        else ", though Python calls this time naive, as a zone gives no UTC offset without a date"
    )
    return (
        f"it has a tzinfo ({shown}) that a TIME field cannot keep (it holds a time of day "
        f"without a zone, and pyarrow would drop the tzinfo{naive}): return a time without a "
        "tzinfo (value.replace(tzinfo=None) keeps its wall-clock time; convert it to the zone "
        "you mean first, through a datetime on its date, if it is another)"
    )


def _check_decimal(arrow_type: pa.DataType) -> _Check:
    """pyarrow refuses a value a DECIMAL cannot hold, saying 'Decimal type with precision
    31 does not fit into precision inferred from first array element: 38' for one with too
    many digits before the point, 'Rescaling Decimal value would cause data loss' for too
    many after it, and 'The string 'True' is not a valid decimal128 number' for a boolean:
    say which, and what to do."""
    precision, scale = arrow_type.precision, arrow_type.scale
    declared = f"a DECIMAL({precision},{scale}) field"

    def check_decimal(value: Any) -> _Loss | None:
        if isinstance(value, bool):
            reason = f"{declared} takes a Decimal or an int, not a boolean"
        elif isinstance(value, (float, np.floating)):  # pyarrow: "int or Decimal ... expected"
            reason = (
                f"{declared} takes a Decimal or an int, not a float (a binary fraction): "
                f"return Decimal(str(value)), or declare the field DOUBLE"
            )
        elif isinstance(value, np.integer):
            reason = f"{declared} takes a Decimal or an int, not a numpy integer: return int(value)"
        elif isinstance(value, decimal.Decimal) and not value.is_finite():
            reason = f"{declared} holds no NaN or infinity: return None for a missing value"
        elif isinstance(value, (decimal.Decimal, int)):
            _, digits, exponent = decimal.Decimal(value).as_tuple()
            significant = len(digits)
            while significant and digits[significant - 1] == 0:  # 1.200 needs 1 place
                significant -= 1
            # 1E+3 needs none, and 0.00000 is 0
            places = -int(exponent) - (len(digits) - significant) if significant else 0
            whole = significant - places if significant else 0  # digits before the point
            if places > scale:
                reason = (
                    f"{declared} holds {scale} digit(s) after the point, and it has "
                    f"{places}: round it first, e.g. value.quantize(Decimal('1e-{scale}')), "
                    "or declare more places"
                )
            elif whole > precision - scale:
                before = f"{declared} holds {precision - scale} digit(s) before the point"
                if whole + scale <= _DECIMAL_DIGITS:
                    advice = f"declare DECIMAL({whole + scale},{scale}) or wider"
                elif whole <= _DECIMAL_DIGITS:
                    advice = (
                        f"declare fewer places after the point, e.g. "
                        f"DECIMAL({_DECIMAL_DIGITS},{_DECIMAL_DIGITS - whole})"
                    )
                else:
                    advice = (
                        f"no DECIMAL holds it (Spark's hold {_DECIMAL_DIGITS} digits at most): "
                        "declare the field DOUBLE, or STRING to keep every digit"
                    )
                reason = f"{before}, and it has {whole}: {advice}"
            elif len(digits) > _DECIMAL_DIGITS or -int(exponent) > _DECIMAL_DIGITS:
                reason = (  # it fits, but is written with more digits than pyarrow takes
                    f"pyarrow takes no Decimal written with more than {_DECIMAL_DIGITS} digits "
                    f"or places, and it is written with {len(digits)} digits, "
                    f"{max(-int(exponent), 0)} places: round it first, e.g. "
                    f"value.quantize(Decimal('1e-{scale}'))"
                )
            else:
                return None
        else:
            return None
        return _Loss("", arrow_type, value, reason)

    return check_decimal


# pyarrow reads a Decimal of more than 38 digits, or with more than 38 places, wrongly when
# it does not refuse it: Decimal(1934.3561801924002), 41 places, became 0.00 in a
# DECIMAL(10,2), silently. This context rounds exactly those (Etiny = Emin - prec + 1 = -38),
# raising Rounded: a column of Decimals that fit is tested in C, with no Python call per row.
_DECIMAL_WIDTH = decimal.Context(
    prec=_DECIMAL_DIGITS, Emin=-1, Emax=_DECIMAL_DIGITS - 1, traps=[decimal.Rounded]
)


def _read_right(values: Iterable[Any]) -> bool:
    """Whether ``values`` are all None or Decimals (or ints) pyarrow reads right; False
    also for values of another type, which pyarrow refuses. (A loop: for a column as for
    an array's few elements it costs less than map() and its iterators.)"""
    plus = _DECIMAL_WIDTH.plus
    try:
        for value in values:
            if value:  # None, and 0 however many places it is written with
                plus(value)
    except (decimal.Rounded, TypeError):
        return False
    return True


def _check_wide_decimal(arrow_type: pa.DataType) -> _Check:
    """A Decimal pyarrow converted, but wrongly (see ``_DECIMAL_WIDTH``): say why it does
    not fit, or if it fits once normalized, how to normalize it."""
    explain = _check_decimal(arrow_type)

    def check_wide_decimal(value: Any) -> _Loss | None:
        try:
            _DECIMAL_WIDTH.plus(value)
            return None
        except decimal.Rounded:
            pass
        except TypeError:
            return None  # not a Decimal: pyarrow refuses it
        try:
            stored = pa.array([value], type=arrow_type)[0].as_py()
        except _CONVERSION_ERRORS:
            return None  # refused alone: not what the batch did (pyarrow's words then)
        if stored == value:
            return None  # 1.000...0 (39 digits) is read right
        loss = explain(value)  # wide as it is, it always finds why
        reason = "it is written with too many digits" if loss is None else loss.reason
        return _Loss("", arrow_type, value, f"{reason} (pyarrow would store {stored})")

    return check_wide_decimal


def _is_number(value: Any) -> bool:
    # numpy's timedelta64 is one of its integers, but a duration: pyarrow converts it as one
    return isinstance(value, (numbers.Number, decimal.Decimal)) and not isinstance(
        value, (dt.datetime, dt.date, dt.timedelta, np.timedelta64)
    )


def _check_datetime(arrow_type: pa.DataType) -> _Check:
    """pyarrow reads a number as a count of the type's units since 1970 (an epoch in
    seconds becomes a time in January 1970), a naive datetime in a zoned TIMESTAMP as UTC
    (Spark takes it as local time), an aware one in a TIMESTAMP_NTZ as its UTC time, and
    drops a datetime's time of day in a DATE and a pandas Timestamp's nanoseconds: refuse
    each instead of guessing."""
    if pa.types.is_date(arrow_type):

        def check_date(value: Any) -> _Loss | None:
            if isinstance(value, dt.datetime):
                if value != value:  # pandas' NaT, which pyarrow stores as 0001-01-01
                    reason = "NaT is not a date (pyarrow would store 0001-01-01): return None"
                elif (
                    value.tzinfo is None
                    and value.time() == dt.time()
                    and not getattr(value, "nanosecond", 0)  # a pandas Timestamp's
                ):
                    return None  # midnight: the date itself, nothing lost
                else:
                    reason = (
                        "a DATE field would drop its time of day (and zone): return value.date()"
                    )
            elif _is_number(value):
                reason = "a DATE field would read a number as days since 1970: return a date"
            elif isinstance(value, np.datetime64):  # pyarrow refuses each, in any unit
                reason = (
                    "NaT is not a date: return None"
                    if np.isnat(value)
                    else "pyarrow cannot take a numpy datetime64 for a DATE: return a date, "
                    "e.g. value.astype('datetime64[D]').item() (.tolist() for a numpy array)"
                )
            elif isinstance(value, str):  # pyarrow refuses it, as 'cannot be converted to int'
                reason = (
                    "a DATE field takes a date, not text: parse it first, e.g. "
                    "date.fromisoformat(value)"
                )
            else:
                return None
            return _Loss("", arrow_type, value, reason)

        return check_date
    zoned = arrow_type.tz is not None

    naive = (
        "a naive datetime does not say which instant it is (pyarrow would take it as "
        "UTC, Spark as local time): return an aware one, e.g. "
        "datetime.now(timezone.utc), or declare the field TIMESTAMP_NTZ"
    )

    def check_timestamp(value: Any) -> _Loss | None:
        if isinstance(value, dt.datetime):
            if (value.utcoffset() is not None) == zoned:
                reason = _nanoseconds(value, "nanosecond")
                return None if reason is None else _Loss("", arrow_type, value, reason)
            reason = (
                naive
                if zoned
                else "a TIMESTAMP_NTZ field holds wall-clock times, and would store an aware "
                "datetime's UTC time: return a naive one (value.replace(tzinfo=None) keeps its "
                "wall-clock time), or declare the field TIMESTAMP"
            )
        elif isinstance(value, np.datetime64):  # naive (a numpy array's, in an array field)
            if not zoned:  # as it is, if pyarrow reads its unit as the field's
                misread = _numpy_unit(value, arrow_type)
                return None if misread is None else _Loss("", arrow_type, value, misread)
            reason = naive
        elif _is_number(value):
            reason = (
                "a timestamp field would read a number as microseconds since 1970: return a "
                "datetime, e.g. datetime.fromtimestamp(seconds, timezone.utc)"
            )
        # pyarrow refuses these, saying only that it "cannot be converted to int"
        elif isinstance(value, dt.date):  # a date, not a datetime
            reason = (
                "a timestamp field takes a datetime, not a date: return one, e.g. "
                f"datetime.combine(value, time(){', tzinfo=timezone.utc' if zoned else ''}), "
                "or declare the field DATE"
            )
        elif isinstance(value, dt.time):
            reason = (
                "a timestamp field takes a datetime, not a time of day: combine it with its "
                "date, e.g. datetime.combine(day, value), or declare the field TIME"
            )
        elif isinstance(value, str):
            reason = (
                "a timestamp field takes a datetime, not text: parse it first, e.g. "
                "datetime.fromisoformat(value)"
                + (" (with its UTC offset, such as +00:00 or Z)" if zoned else "")
            )
        else:
            return None
        return _Loss("", arrow_type, value, reason)

    return check_timestamp


def _nanoseconds(value: dt.datetime | dt.timedelta, attribute: str) -> str | None:
    """Why a pandas Timestamp or Timedelta (whose ``attribute`` holds the nanoseconds
    below its microseconds) cannot go into a field of microseconds, as pyarrow would drop
    them; None for a value without any (every datetime and timedelta)."""
    nanoseconds = getattr(value, attribute, 0)
    if not nanoseconds:
        return None
    return (
        f"Spark holds microseconds, and pyarrow would drop its {nanoseconds} nanoseconds: "
        "round it to microseconds first, e.g. value.round('us') or value.floor('us')"
    )


# pyarrow reads a timedelta's days, seconds and microseconds as datetime.timedelta holds
# them, and a pandas Timedelta in seconds or milliseconds leaves those at 0 (its own
# attributes are right): one of 1 day became 0 in an interval field, silently
_ZEROED_UNITS = frozenset({"s", "ms"})
_NO_TIME = dt.timedelta(0)  # compared as pandas compares: by its value, not those fields


def _zeroed(unit: str) -> str:
    return (
        f"pyarrow would read a pandas Timedelta in {unit} (its unit '{unit}') as 0: convert "
        "it first, e.g. value.as_unit('us') or value.to_pytimedelta()"
    )


def _below_unit(value: Any, interval: IntervalUnit) -> str | None:
    """Why a duration with a part below ``interval``'s finest field cannot go into it
    (Spark would keep the part, but cast and show the value without it: INTERVAL DAY of 36
    hours shows as 1 day and casts to 1, yet equals no INTERVAL '1' DAY); None if whole."""
    if isinstance(value, dt.timedelta):  # a pandas Timedelta's nanoseconds are refused before
        micros = (value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds
    elif isinstance(value, np.timedelta64) and not np.isnat(value):  # in microseconds here
        micros = int(value.astype(np.int64))
    else:
        return None
    part = micros % interval.micros
    if not part:
        return None
    kind = interval.type_name.upper()
    return (
        f"an {kind} field holds whole {interval.name}s, and Spark would keep its "
        f"{dt.timedelta(microseconds=part)} past them (showing and casting the value without "
        "it, comparing it with it): round it first, e.g. value - value % "
        f"timedelta({interval.name}s=1), or declare the field INTERVAL "
        f"{kind.split()[1]} TO SECOND"
    )


def _numpy_unit(value: np.datetime64 | np.timedelta64, arrow_type: pa.DataType) -> str | None:
    """Why a numpy datetime64 or timedelta64 in another unit than the field's cannot go
    into it: pyarrow reads the counts of a numpy array's values (in an array field) as
    counts of the field's unit (2024-01-01 in seconds became 1970-01-01T00:28:24, 1 s
    became 1 us) and refuses a single one; None if the units are the same."""
    unit, count = np.datetime_data(value.dtype)
    if (unit, count) == (arrow_type.unit, 1):
        return None
    kind = "datetime64" if isinstance(value, np.datetime64) else "timedelta64"
    return (
        f"pyarrow would read a numpy {kind}[{unit if count == 1 else f'{count}{unit}'}] as a "
        f"count of {arrow_type.unit} (or refuse it): convert it first, e.g. "
        f"values.astype('{kind}[{arrow_type.unit}]') for a numpy array"
    )


_INTEGER_NAMES = {8: "TINYINT", 16: "SMALLINT", 32: "INT", 64: "BIGINT"}  # Spark's


def _integer_range(arrow_type: pa.DataType) -> tuple[int, int, str]:
    """The smallest and largest values of an integer type, and why a value beyond them
    cannot go into it, saying what to declare."""
    bits = arrow_type.bit_width
    signed = pa.types.is_signed_integer(arrow_type)
    low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    name = _INTEGER_NAMES[bits] if signed else str(arrow_type)
    wider = [n for b, n in _INTEGER_NAMES.items() if b > bits]
    advice = (
        f"declare a wider integer type ({', '.join(wider)})"
        if wider
        else "declare the field DECIMAL(38,0), or DOUBLE if approximate will do"
    )
    article = "an" if name[0] in "AEIOU" else "a"
    return low, high, f"{article} {name} field holds whole numbers from {low} to {high}: {advice}"


def _pairs(value: Any) -> bool:
    """A list of (name, value) pairs, which pyarrow takes for a struct."""
    return isinstance(value, list) and all(
        isinstance(pair, tuple) and len(pair) == 2 for pair in value
    )


def _loss_in(check: _Check | None, value: Any) -> _Loss | None:
    """What ``check`` (a lossy check) finds in ``value``, a value pyarrow refused; None if
    nothing, or if the value is in a form the check does not read (pyarrow's error says
    what is wrong with it)."""
    if check is None or value is None:
        return None
    try:
        return check(value)
    except Exception:  # e.g. a number where a list is declared: not iterable
        return None


_ENTRY_KEYS = frozenset({"key", "value"})


def _map_entries(value: Any) -> Iterator[tuple[Any, Any]]:
    """A map value's (key, value) pairs, in each form pyarrow takes: a dict, or a list of
    (key, value) pairs or of {"key": ..., "value": ...} dicts."""
    for entry in value.items() if isinstance(value, dict) else value:
        yield (entry.get("key"), entry.get("value")) if isinstance(entry, dict) else entry


# -- NOT NULL fields ----------------------------------------------------------------------

_NOT_NULL = "the output schema declares it NOT NULL (return a value, or declare it nullable)"


@functools.lru_cache(maxsize=256)
def requires(field: pa.Field) -> bool:
    """Whether ``field``, or a field anywhere inside it, is NOT NULL (a map's keys and
    entries always are, and pyarrow refuses a null key itself: only its values, and the
    fields inside its keys, count)."""
    if pa.types.is_map(field.type):
        inside_keys = _children(field.type.key_type)
        return (
            not field.nullable
            or any(requires(child) for child in inside_keys)
            or requires(field.type.item_field)
        )
    return not field.nullable or any(requires(child) for child in _children(field.type))


def _children(arrow_type: pa.DataType) -> list[pa.Field]:
    if pa.types.is_struct(arrow_type):
        return [arrow_type.field(i) for i in range(arrow_type.num_fields)]
    if pa.types.is_map(arrow_type):  # a list of non-null (key, value) entries
        entries = pa.struct([arrow_type.key_field, arrow_type.item_field])
        return [pa.field("entries", entries, nullable=False)]
    if is_list_type(arrow_type):
        return [arrow_type.value_field]
    return []


@functools.lru_cache(maxsize=64)
def _required_fields(schema: pa.Schema) -> tuple[tuple[int, pa.Field], ...]:
    """The top-level fields that are, or hold, NOT NULL fields, with their positions."""
    return tuple((i, field) for i, field in enumerate(schema) if requires(field))


def _forbidden_null_row(
    array: pa.Array, field: pa.Field, valid: np.ndarray | None, rows: np.ndarray | None
) -> int | None:
    """The first row holding a null in ``array`` where ``field`` forbids one, or None.

    ``field``'s type gives the NOT NULL flags inside it (``array``'s own type may have
    none: Spark's are all nullable), the layouts are the same. ``valid`` marks the
    positions whose enclosing values are all non-null (a NOT NULL field of a null struct is
    fine); ``rows`` maps positions to rows (None: the identity)."""
    present = array.is_valid().to_numpy(zero_copy_only=False)
    if valid is not None:
        present &= valid
        absent = valid & ~present
    else:
        absent = ~present
    if not field.nullable and absent.any():
        at = int(absent.argmax())
        return at if rows is None else int(rows[at])
    arrow_type = field.type
    if pa.types.is_struct(arrow_type):
        for i, child in enumerate(_children(arrow_type)):
            if requires(child):
                found = _forbidden_null_row(array.field(i), child, present, rows)
                if found is not None:
                    return found
        return None
    children = _children(arrow_type)
    if not children or not requires(children[0]):
        return None
    lengths: np.ndarray  # the shape numpy's stubs give np.full and np.diff differs by version
    if pa.types.is_fixed_size_list(arrow_type):
        size = arrow_type.list_size
        values = array.values.slice(array.offset * size, len(array) * size)
        lengths = np.full(len(array), size)
    else:
        offsets = array.offsets.to_numpy()
        values = array.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        lengths = np.diff(offsets)
    parents = np.repeat(np.arange(len(array)), lengths)
    return _forbidden_null_row(
        values, children[0], present[parents], parents if rows is None else rows[parents]
    )


def first_forbidden_null(
    batch: pa.RecordBatch, fields: Iterable[pa.Field]
) -> tuple[int, str] | None:
    """The first row of ``batch`` holding a null where one of ``fields`` (its columns, by
    name, with their NOT NULL flags) forbids one, and where in the column it is (``s.a``,
    ``tags[1]``, ``m['k']``, ``m{key}.a`` in a map's key); None if there is none. A NOT
    NULL field of a null struct, list or map is not a null in it."""
    found = _first_null(batch, fields)
    return None if found is None else (found[0], found[1].name + found[2].path)


def _first_null(
    batch: pa.RecordBatch, fields: Iterable[pa.Field]
) -> tuple[int, pa.Field, _Loss] | None:
    """``first_forbidden_null``, with the field and where below it the null is."""
    for field in fields:
        column = batch.column(field.name)
        at = _forbidden_null_row(column, field, None, None)
        if at is not None:
            loss = _null_loss(column[at].as_py(), field)
            return at, field, loss or _Loss("", field.type, None, _NOT_NULL)
    return None


def _null_loss(value: Any, field: pa.Field) -> _Loss | None:
    """Where in ``value`` a NOT NULL field holds None, for the message (None: not found)."""
    if value is None:
        return None if field.nullable else _Loss("", field.type, None, _NOT_NULL)
    arrow_type = field.type
    if pa.types.is_struct(arrow_type):
        children = _children(arrow_type)
        if isinstance(value, dict):
            pairs = [(child, value.get(child.name)) for child in children]
        elif isinstance(value, tuple):  # by position, as pyarrow takes it
            padded = (*value, *[None] * (len(children) - len(value)))
            pairs = list(zip(children, padded, strict=False))
        else:
            return None
        for child, item in pairs:
            if (loss := _null_loss(item, child)) is not None:
                return loss.under(f".{child.name}")
    elif pa.types.is_map(arrow_type):
        for k, v in _map_entries(value):
            if (loss := _null_loss(k, arrow_type.key_field)) is not None:
                return loss.under("{key}")
            if (loss := _null_loss(v, arrow_type.item_field)) is not None:
                return loss.under(f"[{k!r}]")
    elif _children(arrow_type):
        for i, element in enumerate(value):
            if (loss := _null_loss(element, arrow_type.value_field)) is not None:
                return loss.under(f"[{i}]")
    return None
