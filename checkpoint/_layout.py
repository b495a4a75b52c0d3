"""Where checkpoints live under a location, and how to list them.

One Delta table per (job, operator, subtask)::

    <location>/<job_id>/<operator_id>/subtask=<nnnnn>/_delta_log/...

A subtask only ever commits to its own table, so commits never contend with each other
and their latency does not grow with the number of partitions (a single shared Delta log
serialises every commit). A job's checkpoints are still one directory: list it, or read all
of its tables together with ``SnapshotStore.read_job``.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any, Union
from urllib.parse import urlparse

import pyarrow.fs as pafs

from ._exceptions import CheckpointError, CheckpointLocationError

if TYPE_CHECKING:
    import pyarrow.dataset as pads
    from deltalake import DeltaTable

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=-]{0,127}$")
_SUBTASK_DIR = re.compile(r"^subtask=(\d{5,})$")


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


def normalize(location: str | os.PathLike[str]) -> str:
    text = os.fspath(location).strip()  # a pasted space is no part of a directory's name
    if is_local(text):
        # file:/abs, file:///abs and file://localhost/abs are all local paths.
        path = urlparse(text).path if urlparse(text).scheme == "file" else text
        # "~/chk" means the home directory, not a directory named "~" in the working one
        return os.path.abspath(os.path.expanduser(path))
    return text.rstrip("/")


StorageOptions = Union[dict[str, str], None]

# deltalake's (object_store's) names for S3 settings, any case, and pyarrow's for them
_S3_OPTIONS = {
    "access_key": ("aws_access_key_id", "access_key_id"),
    "secret_key": ("aws_secret_access_key", "secret_access_key"),
    "session_token": ("aws_session_token", "aws_token", "session_token", "token"),
    "region": ("aws_region", "region", "aws_default_region", "default_region"),
    "endpoint": ("aws_endpoint_url", "aws_endpoint", "endpoint_url", "endpoint"),
    "allow_http": ("aws_allow_http", "allow_http"),
    "virtual_hosted": ("aws_virtual_hosted_style_request", "virtual_hosted_style_request"),
}


def _s3_filesystem(storage_options: dict[str, str]) -> pafs.S3FileSystem:
    """pyarrow's S3 filesystem with the credentials and endpoint that ``storage_options``
    give deltalake; what they leave out comes from the environment, as for deltalake."""
    given = {key.lower(): value for key, value in storage_options.items()}

    def option(name: str) -> str | None:
        return next((given[key] for key in _S3_OPTIONS[name] if key in given), None)

    kwargs: dict[str, Any] = {}
    for name in ("access_key", "secret_key", "session_token", "region"):
        if option(name) is not None:
            kwargs[name] = option(name)
    endpoint = option("endpoint")
    if endpoint is not None:
        scheme, found, host = endpoint.partition("://")
        kwargs["endpoint_override"] = host.rstrip("/") if found else endpoint
        plain = (option("allow_http") or "").lower() == "true"
        kwargs["scheme"] = scheme if found else ("http" if plain else "https")
    if option("virtual_hosted") is not None:
        kwargs["force_virtual_addressing"] = option("virtual_hosted").lower() == "true"  # type: ignore[union-attr]
    return pafs.S3FileSystem(**kwargs)


def filesystem(uri: str, storage_options: StorageOptions = None) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem that reaches ``uri`` with ``storage_options`` (those deltalake
    takes), and the path of ``uri`` in it.

    S3 gets pyarrow's own filesystem, with the options translated: reads through
    deltalake's Python filesystem handler abort the process at exit about one run in ten
    ("terminate called without an active exception"; measured on an S3 API server with
    deltalake 1.6.6, pyarrow 26). Other stores with options are listed through that handler
    (listing alone never aborted); without options, pyarrow uses the environment's
    credentials."""
    if is_local(uri):
        return pafs.LocalFileSystem(), normalize(uri)
    scheme, _, path = uri.partition("://")
    if scheme in ("s3", "s3a") and storage_options:
        return _s3_filesystem(storage_options), path.rstrip("/")
    if storage_options:
        from deltalake.fs import DeltaStorageHandler

        return pafs.PyFileSystem(DeltaStorageHandler(uri, storage_options)), ""
    return pafs.FileSystem.from_uri(uri)


def _native(uri: str, storage_options: StorageOptions) -> pafs.FileSystem | None:
    """pyarrow's own filesystem rooted at ``uri`` (a table), where there is one: local
    paths and S3. None elsewhere."""
    scheme = urlparse(uri).scheme
    if not is_local(uri) and scheme not in ("s3", "s3a"):
        return None
    fs, path = filesystem(uri, storage_options)
    return pafs.SubTreeFileSystem(path, fs)


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
    carries their storage options), which readers filter as they would the whole table."""
    import pyarrow.dataset

    native = _native(table.table_uri, storage_options)
    if native is None:
        return table.to_pyarrow_dataset()
    return pyarrow.dataset.dataset(paths, format="parquet", filesystem=native)


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
            "credentials: the CheckpointConfig's storage_options, else the environment's."
        ) from exc
    return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)


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
