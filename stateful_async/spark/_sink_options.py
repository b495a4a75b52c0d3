"""Options of the ``delta_rs`` sink, parsed once and shipped (pickled) with the writer.

The option names are documented in ``stateful_async.spark._sink``. Spark hands a data
source its options in a case-insensitive dict whose keys are lower-cased, so every name
here is compared in lower case.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlparse

from checkpoint._layout import local_path_escape

from .._exceptions import ConfigurationError

#: Prefix of the options passed on to the object store (``storage.AWS_REGION`` ...).
STORAGE_PREFIX = "storage."

#: Parquet codecs accepted by ``compression`` and the suffix they give file names.
CODECS = {
    "snappy": "snappy.",
    "zstd": "zstd.",
    "gzip": "gz.",
    "lz4": "lz4.",
    "brotli": "br.",
    "none": "",
    "uncompressed": "",
}

#: Options Spark itself adds (``save(path)``, ``checkpointLocation``, ``queryName``).
_SPARK_OPTIONS = {"path", "checkpointlocation", "queryname"}

_BOOLEAN = {"true": True, "false": False}

#: The largest Delta app-transaction version (a signed 64-bit long, as Spark's batch ids)
#: and the bound of maxCommitRetries (delta-rs fails from 2**64 - 1): past them delta-rs
#: failed at commit time, after every file was written, with a bare OverflowError.
MAX_LONG = 2**63 - 1

# Spark lower-cases option keys; errors name an option as the docs spell it.
_OPTION_NAMES = {
    name.lower(): name
    for name in (
        "partitionBy",
        "mergeSchema",
        "appId",
        "txnAppId",
        "txnVersion",
        "cleanOrphans",
        "orphanRetentionSeconds",
        "maxRecordsPerFile",
        "compression",
        "maxCommitRetries",
    )
}


def _name(key: str) -> str:
    return _OPTION_NAMES.get(key, key)


@dataclass(frozen=True)
class SinkOptions:
    """The sink's options after validation (see the ``_sink`` module docstring)."""

    table_uri: str
    storage_options: dict[str, str] = field(default_factory=dict)
    partition_by: tuple[str, ...] = ()
    #: the option partitionBy as given (None if it was not)
    partition_by_option: str | None = None
    merge_schema: bool = False
    app_id: str | None = None
    txn_version: int | None = None
    clean_orphans: bool = False
    orphan_retention_seconds: float = 3600.0
    max_records_per_file: int = 0
    compression: str = "snappy"
    max_commit_retries: int = 100

    @property
    def is_local(self) -> bool:
        """True for a local absolute path, False for a URI (``s3://``, ``file://`` ...)."""
        return not is_uri(self.table_uri)

    @classmethod
    def parse(cls, options: Mapping[str, str], *, streaming: bool) -> SinkOptions:
        """Validate Spark's options for a batch (``streaming=False``) or streaming write."""
        opts = {str(k).lower(): str(v) for k, v in options.items()}
        known = set(_OPTION_NAMES)
        unknown = sorted(
            k
            for k in opts
            if k not in known and k not in _SPARK_OPTIONS and not k.startswith(STORAGE_PREFIX)
        )
        if unknown:
            raise ConfigurationError(
                f"The delta_rs sink does not know the option(s) {', '.join(unknown)}. "
                "Known options: partitionBy, mergeSchema, txnAppId (or appId), txnVersion, "
                "cleanOrphans, orphanRetentionSeconds, maxRecordsPerFile, compression, "
                "maxCommitRetries and storage.<key> for object-store settings; check the "
                "spelling (see docs/delta_sink.md)."
            )
        table_uri = _table_uri(opts.get("path"))
        if "appid" in opts and "txnappid" in opts and opts["appid"] != opts["txnappid"]:
            raise ConfigurationError(
                "The options appId and txnAppId are two names for the same setting but were "
                "given different values; set only one of them."
            )
        app_id = opts.get("txnappid", opts.get("appid"))
        if app_id is not None and not app_id.strip():
            raise ConfigurationError(
                "The option txnAppId (appId) is empty; give a non-empty application id or "
                "leave the option out."
            )
        txn_version = _int(opts, "txnversion", minimum=0, maximum=MAX_LONG)
        if streaming and txn_version is not None:
            raise ConfigurationError(
                "The option txnVersion applies to batch writes only: a streaming write uses "
                "the micro-batch id as the transaction version. Remove txnVersion."
            )
        if not streaming and (app_id is None) != (txn_version is None):
            raise ConfigurationError(
                "An idempotent batch write needs both txnAppId (or appId) and txnVersion; "
                "give both options, or neither for a plain write."
            )
        compression = opts.get("compression", "snappy").lower()
        if compression not in CODECS:
            raise ConfigurationError(
                f"The compression {compression!r} is not supported; use one of "
                f"{', '.join(sorted(CODECS))}."
            )
        partition_by = _columns(opts.get("partitionby"))
        retention = _float(opts, "orphanretentionseconds", 3600.0)
        return cls(
            table_uri=table_uri,
            storage_options={
                k[len(STORAGE_PREFIX) :]: v for k, v in opts.items() if k.startswith(STORAGE_PREFIX)
            },
            partition_by=partition_by,
            partition_by_option=opts.get("partitionby"),
            merge_schema=_bool(opts, "mergeschema"),
            app_id=app_id,
            txn_version=txn_version,
            clean_orphans=_bool(opts, "cleanorphans"),
            orphan_retention_seconds=retention,
            max_records_per_file=_int(opts, "maxrecordsperfile", minimum=0) or 0,
            compression=compression,
            max_commit_retries=_int(opts, "maxcommitretries", minimum=1, maximum=MAX_LONG) or 100,
        )


def is_uri(path: str) -> bool:
    """True if ``path`` has a URI scheme (two letters or more, so ``C:`` is not one)."""
    return len(urlparse(path).scheme) > 1


def _table_uri(path: str | None) -> str:
    if path is None or not path.strip():
        raise ConfigurationError(
            "The delta_rs sink needs the table location: df.write.format('delta_rs')"
            ".save('/abs/path/to/table') or writeStream...start('/abs/path/to/table')."
        )
    path = os.path.expanduser(path.strip())  # on the driver: its home, as CheckpointConfig's
    escaped = local_path_escape(path)
    if escaped is not None:
        raise ConfigurationError(
            f"The table path {path!r} names a local directory whose path holds "
            f"{escaped!r}, which delta-rs decodes (as an escaped character) when it "
            "reads the table, so it would not find the table it wrote there. Use a directory "
            "whose path has no '%' followed by two hexadecimal digits."
        )
    if is_uri(path):
        return path.rstrip("/")
    if not os.path.isabs(path):
        # Python workers do not run in the driver's working directory, so a relative path
        # would land somewhere else on every process.
        raise ConfigurationError(
            f"The table path {path!r} is relative; give an absolute path or a URI "
            "(file:///..., s3://...), because Spark's Python workers do not share the "
            "driver's working directory."
        )
    return os.path.normpath(path)


def _columns(value: str | None) -> tuple[str, ...]:
    if value is None:
        return ()
    columns = tuple(c.strip() for c in value.split(",") if c.strip())
    if len(set(columns)) != len(columns):
        raise ConfigurationError(
            f"The option partitionBy={value!r} names a column twice; list each partition "
            "column once, separated by commas."
        )
    return columns


def _bool(opts: Mapping[str, str], key: str) -> bool:
    value = opts.get(key, "false").strip().lower()
    if value not in _BOOLEAN:
        raise ConfigurationError(
            f"The option {_name(key)} must be true or false, not {opts[key]!r}."
        )
    return _BOOLEAN[value]


def _int(
    opts: Mapping[str, str], key: str, *, minimum: int, maximum: int | None = None
) -> int | None:
    if key not in opts:
        return None
    try:
        value = int(opts[key].strip())
    except ValueError as exc:
        raise ConfigurationError(
            f"The option {_name(key)} must be a whole number, not {opts[key]!r}."
        ) from exc
    if value < minimum:
        raise ConfigurationError(
            f"The option {_name(key)} must be at least {minimum}, not {value}."
        )
    if maximum is not None and value > maximum:
        raise ConfigurationError(
            f"The option {_name(key)} must be at most {maximum} (2**63 - 1, the largest "
            f"signed 64-bit integer, which delta-rs takes), not {value}."
        )
    return value


def _float(opts: Mapping[str, str], key: str, default: float) -> float:
    if key not in opts:
        return default
    try:
        value = float(opts[key].strip())
    except ValueError as exc:
        raise ConfigurationError(
            f"The option {_name(key)} must be a number of seconds, not {opts[key]!r}."
        ) from exc
    if not value >= 0:
        raise ConfigurationError(
            f"The option {_name(key)} must be zero or more seconds, not {value}."
        )
    return value
