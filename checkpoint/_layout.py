"""Where checkpoints live under a location, and how to list them.

One Delta table per (job, operator, subtask)::

    <location>/<job_id>/<operator_id>/subtask=<nnnnn>/_delta_log/...

A subtask only ever commits to its own table, so commits never contend with each other
and their latency does not grow with the number of partitions (a single shared Delta log
serialises every commit). A job's checkpoints are still one directory: list it, or read all
of its tables together with ``SnapshotStore.read_job``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from typing import TYPE_CHECKING, Any, Union
from urllib.parse import unquote, urlparse

import pyarrow.fs as pafs

from ._exceptions import CheckpointError, CheckpointLocationError

if TYPE_CHECKING:
    import pyarrow.dataset as pads
    from deltalake import DeltaTable

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=-]{0,127}$")
_SUBTASK_DIR = re.compile(r"^subtask=(\d{5,})$")


#: where a location's credentials come from, as errors name it (the CLI names its option)
CREDENTIALS = "the CheckpointConfig's storage_options"


def check_name(kind: str, name: str) -> str:
    """Job and operator ids become directory names: keep them portable."""
    if not isinstance(name, str) or not _NAME.match(name) or name in (".", ".."):
        raise CheckpointError(
            f"{kind} {name!r} cannot name a checkpoint directory: use 1-128 letters, digits, "
            "'.', '_', '-' or '=', starting with a letter or digit."
        )
    return name


def is_local(location: str) -> bool:
    scheme = urlparse(location).scheme
    return scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt")


#: A percent escape, which delta-rs decodes in a local table path.
_ESCAPE = re.compile("%[0-9A-Fa-f]{2}")


def local_path_escape(location: str) -> str | None:
    """The first percent escape in the path of a local ``location`` (a path, or a file: URI,
    decoded as URIs are), if it holds one. delta-rs creates a table in the directory as
    named but reads its log from the name decoded ('a%20b' as 'a b'), so the first commit
    fails ("File not found") or a later one does not find the table."""
    parsed = urlparse(location)
    if parsed.scheme == "file":
        path = unquote(parsed.path)
    elif is_local(location):
        path = location
    else:
        return None
    escape = _ESCAPE.search(path)
    return None if escape is None else escape.group()


def normalize(location: str | os.PathLike[str]) -> str:
    """``location`` as the store keeps it: a local path made absolute, or a URI without a
    trailing slash. Anything but a non-blank path or URI is refused."""
    if not isinstance(location, (str, os.PathLike)) or not isinstance(os.fspath(location), str):
        raise CheckpointLocationError(
            f"The checkpoint location must be a path or URI (a str or os.PathLike); got "
            f"{location!r}."
        )
    text = os.fspath(location).strip()  # a pasted space is no part of a directory's name
    if not text:
        raise CheckpointLocationError(
            f"The checkpoint location must be a path or URI; got {location!r} (an empty one "
            "would be the working directory)."
        )
    if is_local(text):
        # file:/abs, file:///abs and file://localhost/abs are all local paths.
        parsed = urlparse(text)
        if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
            # file://tmp/chk is a typo of file:///tmp/chk, and a path on another host is
            # not a path here: either way, not /chk
            raise CheckpointLocationError(
                f"{text!r} names the host {parsed.netloc!r}, and a file: location is on this "
                f"machine: write file:///{parsed.netloc}{parsed.path} (three slashes) or "
                f"the path /{parsed.netloc}{parsed.path}."
            )
        escaped = local_path_escape(text)
        if escaped is not None:
            raise CheckpointLocationError(
                f"The checkpoint location {text!r} is a local directory whose path holds "
                f"{escaped!r}, which delta-rs decodes (as an escaped character) when it "
                "reads a checkpoint table, so it would not find the tables it writes there. "
                "Use a directory whose path has no '%' followed by two hexadecimal digits."
            )
        # a file: URI's path is percent-decoded, as delta-rs decodes it: file:///a%20b is a b
        path = unquote(parsed.path) if parsed.scheme == "file" else text
        # "~/chk" means the home directory, not a directory named "~" in the working one
        return os.path.abspath(os.path.expanduser(path))
    return text.rstrip("/")


StorageOptions = Union[dict[str, str], None]


def check_storage_options(options: Any) -> None:
    """Storage options are None or a dict of strings to strings, as deltalake takes them."""
    if options is not None and (
        not isinstance(options, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in options.items())
    ):
        raise CheckpointError(
            f"storage_options must be a dict of strings to strings (as deltalake takes "
            f"them), or None; got {options!r}."
        )


_S3_SCHEMES = ("s3", "s3a")

# The S3 settings that decide where a read goes and as whom, by the names deltalake
# (object_store) takes them under, in any case; keyed by pyarrow's S3FileSystem's names.
_S3_OPTIONS = {
    "access_key": ("aws_access_key_id", "access_key_id"),
    "secret_key": ("aws_secret_access_key", "secret_access_key"),
    "session_token": ("aws_session_token", "aws_token", "session_token", "token"),
    "region": ("aws_region", "region", "aws_default_region", "default_region"),
    "endpoint": ("aws_endpoint_url", "aws_endpoint", "endpoint_url", "endpoint"),
    "allow_http": ("aws_allow_http", "allow_http"),
    "virtual_hosted": ("aws_virtual_hosted_style_request", "virtual_hosted_style_request"),
    "anonymous": ("aws_skip_signature", "skip_signature"),
}
# Settings of how delta-rs writes and commits, or of its client's tuning: reads and
# listings need none of them. Any other option (aws_profile, aws_request_payer, ...) has
# no pyarrow equivalent, and sends reads through deltalake's own handler instead.
_S3_WRITE_OPTIONS = frozenset(
    {
        "aws_s3_allow_unsafe_rename",
        "aws_s3_locking_provider",
        "delta_dynamo_table_name",
        "aws_copy_if_not_exists",
        "copy_if_not_exists",
        "aws_conditional_put",
        "conditional_put",
        "aws_disable_tagging",
        "aws_server_side_encryption",
        "aws_sse_kms_key_id",
        "aws_sse_bucket_key_enabled",
        "aws_checksum_algorithm",
        "aws_unsigned_payload",
        "aws_s3_pool_idle_timeout_seconds",
        "aws_sts_pool_idle_timeout_seconds",
        "aws_s3_get_internal_server_error_retries",
        "timeout",
        "connect_timeout",
        "pool_idle_timeout",
    }
)
_S3_CREDENTIALS = ("access_key", "secret_key", "session_token")
_S3_KNOWN = frozenset(name for names in _S3_OPTIONS.values() for name in names) | _S3_WRITE_OPTIONS


def _s3_filesystem(bucket: str, storage_options: StorageOptions) -> pafs.S3FileSystem | None:
    """pyarrow's S3 filesystem for ``bucket`` with the settings deltalake would use, or
    None if the options hold a setting pyarrow has no equivalent for.

    As in delta-rs: the endpoint, region and addressing come from ``storage_options`` if
    they hold them, else from the environment's ``AWS_*`` variables; credentials are the
    options' access key and secret (with their session token) as a set, or else none
    given, for the AWS SDK's own chain (the environment, a profile, a role) to find."""
    given = {key.lower(): value for key, value in (storage_options or {}).items()}
    if not given.keys() <= _S3_KNOWN:
        return None
    environment = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    env = {key.lower(): value for key, value in environment.items()}

    def setting(name: str, *sources: dict[str, str]) -> str | None:
        keys = _S3_OPTIONS[name]
        return next((source[k] for source in sources for k in keys if k in source), None)

    settings = {}
    for name in ("region", "endpoint", "allow_http", "virtual_hosted", "anonymous"):
        value = setting(name, given, env)
        if value is not None:
            settings[name] = value
    if setting("access_key", given) is not None and setting("secret_key", given) is not None:
        for name in _S3_CREDENTIALS:
            value = setting(name, given)
            if value is not None:
                settings[name] = value
    if "region" not in settings and "endpoint" not in settings:
        try:  # as pyarrow's from_uri does: the bucket's own region
            settings["region"] = _bucket_region(bucket)
        except OSError:
            pass  # the SDK's default; the read that follows reports what is wrong
    # the environment is in the key too: the SDK reads some of it (AWS_PROFILE, ...) itself
    return _cached_s3_filesystem(
        tuple(sorted(settings.items())), tuple(sorted(environment.items()))
    )


@functools.lru_cache(maxsize=256)
def _bucket_region(bucket: str) -> str:
    """A bucket's region (a request; a failure is not kept, and is tried again)."""
    return pafs.resolve_s3_region(bucket)


@functools.lru_cache(maxsize=64)
def _cached_s3_filesystem(
    settings: tuple[tuple[str, str], ...], environment: tuple[tuple[str, str], ...]
) -> pafs.S3FileSystem:
    """One filesystem per settings: a listing of a job's tables makes hundreds of calls."""
    given = dict(settings)
    kwargs: dict[str, Any] = {
        name: given[name]
        for name in ("access_key", "secret_key", "session_token", "region")
        if name in given
    }
    endpoint = given.get("endpoint")
    if endpoint is not None:
        scheme, found, host = endpoint.partition("://")
        kwargs["endpoint_override"] = host.rstrip("/") if found else endpoint
        plain = given.get("allow_http", "").lower() == "true"
        kwargs["scheme"] = scheme.lower() if found else ("http" if plain else "https")
    if "virtual_hosted" in given:
        kwargs["force_virtual_addressing"] = given["virtual_hosted"].lower() == "true"
    if given.get("anonymous", "").lower() == "true":  # unsigned requests: no credentials
        kwargs = {k: v for k, v in kwargs.items() if k not in _S3_CREDENTIALS}
        kwargs["anonymous"] = True
    return pafs.S3FileSystem(**kwargs)


def filesystem(uri: str, storage_options: StorageOptions = None) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem that reaches ``uri`` with ``storage_options`` (those deltalake
    takes), and the path of ``uri`` in it.

    S3 gets pyarrow's own filesystem, with the settings translated: reads through
    deltalake's Python filesystem handler abort the process at exit about one run in ten
    ("terminate called without an active exception"; measured on an S3 API server with
    deltalake 1.6.6, pyarrow 26). Options pyarrow has no equivalent for, and other stores'
    options, go through that handler (listing alone never aborted); other stores without
    options get pyarrow's filesystem for their scheme, with the environment's credentials."""
    if is_local(uri):
        return pafs.LocalFileSystem(), normalize(uri)
    scheme, _, path = uri.partition("://")
    if scheme.lower() in _S3_SCHEMES:
        s3 = _s3_filesystem(path.split("/", 1)[0], storage_options)
        if s3 is not None:
            return s3, path.rstrip("/")
    if storage_options:
        from deltalake.fs import DeltaStorageHandler

        return pafs.PyFileSystem(DeltaStorageHandler(uri, storage_options)), ""
    return pafs.FileSystem.from_uri(uri)


def _native(uri: str, storage_options: StorageOptions) -> pafs.FileSystem | None:
    """pyarrow's own filesystem rooted at ``uri`` (a table), where there is one: local
    paths, and S3 unless the options hold a setting pyarrow has no equivalent for. None
    elsewhere."""
    if not is_local(uri) and urlparse(uri).scheme.lower() not in _S3_SCHEMES:
        return None
    fs, path = filesystem(uri, storage_options)
    return None if isinstance(fs, pafs.PyFileSystem) else pafs.SubTreeFileSystem(path, fs)


def delta_dataset(table: DeltaTable, storage_options: StorageOptions = None) -> pads.Dataset:
    """The current files of a Delta table as a pyarrow dataset, read through pyarrow's own
    filesystem where there is one (local and S3 tables).

    deltalake's default dataset reads through a Python filesystem handler over delta-rs, and
    a process that used one aborts at exit about one run in two on local disk ("terminate
    called without an active exception", SIGABRT), after all its work is done: measured
    with deltalake 1.6.6 and pyarrow 21, 24 and 26. Other stores keep deltalake's handler,
    which carries their storage options.
    """
    native = _native(table.table_uri, storage_options)
    if native is None:
        return table.to_pyarrow_dataset()
    return table.to_pyarrow_dataset(filesystem=native)


def files_dataset(
    table: DeltaTable, paths: list[str], storage_options: StorageOptions = None
) -> pads.Dataset:
    """Some of a Delta table's current files (paths relative to its root) as a pyarrow
    dataset; on stores without a pyarrow filesystem, all of them (deltalake's dataset
    carries their storage options), which readers filter as they would the whole table.
    Its schema is the table's, not the first file's (delta-rs writes some with string_view
    columns): every file's columns are cast to it as they are read."""
    import pyarrow as pa
    import pyarrow.dataset

    native = _native(table.table_uri, storage_options)
    if native is None:
        return table.to_pyarrow_dataset()
    schema = pa.schema(table.schema().to_arrow())
    return pyarrow.dataset.dataset(paths, schema=schema, format="parquet", filesystem=native)


def subtask_dir(location: str, job_id: str, operator_id: str, subtask: int) -> str:
    return f"{location}/{job_id}/{operator_id}/subtask={subtask:05d}"


def _listing(path: str, storage_options: StorageOptions) -> list[pafs.FileInfo]:
    """What is directly in ``path`` (nothing if it does not exist)."""
    fs, root = filesystem(path, storage_options)
    return fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))


def list_dirs(location: str, *parts: str, storage_options: StorageOptions = None) -> list[str]:
    """Names of the subdirectories of ``location/parts...`` (empty if it does not exist)."""
    path = "/".join([location, *parts])
    if is_local(location):
        try:
            return sorted(e.name for e in os.scandir(path) if e.is_dir())
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise CheckpointLocationError(
                f"Cannot list checkpoint directory {path}: {exc}"
            ) from exc
    try:
        infos = _listing(path, storage_options)
    except Exception as exc:  # pyarrow raises several types for remote stores
        raise CheckpointLocationError(
            f"Cannot list checkpoint directory {path}: {exc}. Check the location and the "
            f"credentials: {CREDENTIALS}, else the environment's."
        ) from exc
    return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)


def table_files(table: DeltaTable) -> set[str]:
    """The paths (relative to its root, decoded) of the data files ``table`` uses."""
    import pyarrow as pa

    paths = pa.table(table.get_add_actions(flatten=True)).column("path").to_pylist()
    return {unquote(path) for path in paths}


def data_files(table_uri: str, storage_options: StorageOptions = None) -> set[str] | None:
    """Names of the files at the root of a table (its data: checkpoint tables are not
    partitioned), or None where they cannot be listed."""
    try:
        if is_local(table_uri):
            return {e.name for e in os.scandir(normalize(table_uri)) if e.is_file()}
        infos = _listing(table_uri, storage_options)
    except Exception:  # pyarrow raises several types for remote stores
        return None
    return {i.base_name for i in infos if i.type == pafs.FileType.File}


def delete_removed_files(
    table_uri: str, storage_options: StorageOptions, version: int
) -> list[str]:
    """Delete the data files that commit ``version`` of a table removed (its ``remove``
    actions: no later version can use them again, names being unique) and return their
    names: what a vacuum would delete of that commit's, without listing the directory or
    logging the vacuum's two commits."""
    fs, root = filesystem(table_uri, storage_options)
    log = f"_delta_log/{version:020d}.json"
    with fs.open_input_stream(f"{root}/{log}" if root else log) as stream:
        actions = [json.loads(line) for line in stream.read().decode().splitlines() if line.strip()]
    names = [unquote(a["remove"]["path"]) for a in actions if "remove" in a]
    # a file deleted already (a vacuum, an earlier try) is not counted
    return [os.path.basename(n) for n in delete_files(table_uri, storage_options, names)]


def stale_files(
    table_uri: str, storage_options: StorageOptions, older_than_seconds: float
) -> list[str]:
    """The Parquet files at the root of a table directory that has no Delta log yet (its
    first commit never landed) that were last written more than ``older_than_seconds``
    ago; their names."""
    fs, root = filesystem(table_uri, storage_options)
    cutoff = time.time() - older_than_seconds
    return [
        info.base_name
        for info in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
        if info.type == pafs.FileType.File
        and info.base_name.endswith(".parquet")
        and info.mtime is not None
        and info.mtime.timestamp() < cutoff
    ]


def delete_files(table_uri: str, storage_options: StorageOptions, names: list[str]) -> list[str]:
    """Delete these files (paths relative to the table's root) and return those that were
    there."""
    fs, root = filesystem(table_uri, storage_options)
    deleted = []
    for name in names:
        try:
            fs.delete_file(f"{root}/{name}" if root else name)
        except FileNotFoundError:
            continue
        deleted.append(name)
    return deleted


def subtask_numbers(names: list[str]) -> list[int]:
    numbers = []
    for name in names:
        match = _SUBTASK_DIR.match(name)
        if match:
            numbers.append(int(match.group(1)))
    return sorted(numbers)


def location_exists(location: str, storage_options: StorageOptions = None) -> bool:
    if is_local(location):
        return os.path.isdir(location)
    try:
        fs, root = filesystem(location, storage_options)
        return fs.get_file_info(root).type != pafs.FileType.NotFound
    except Exception:
        return True  # cannot tell: let the read that follows report the real error


def missing_location(location: str) -> str:
    """Why ``location_exists`` is False, for an error message."""
    if is_local(location) and os.path.exists(location):
        return (
            f"The checkpoint location {location} is a file, not a directory. Give the "
            "directory the job's CheckpointConfig names."
        )
    return (
        f"The checkpoint location {location} does not exist. Check the path (it is created "
        "by the first checkpoint a job commits)."
    )
