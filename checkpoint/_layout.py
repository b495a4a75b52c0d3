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
from typing import TYPE_CHECKING
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


def delta_dataset(table: DeltaTable) -> pads.Dataset:
    """The current files of a Delta table as a pyarrow dataset, read through pyarrow's own
    filesystem when the table is local.

    deltalake's default dataset reads through a Python filesystem handler over delta-rs, and
    a process that used one aborts at exit about one run in two ("terminate called without
    an active exception", SIGABRT), after all its work is done: measured with deltalake
    1.6.6 and pyarrow 21, 24 and 26. Remote tables keep deltalake's handler, which carries
    their storage options.
    """
    uri = table.table_uri
    if not is_local(uri):
        return table.to_pyarrow_dataset()
    root = normalize(uri)
    return table.to_pyarrow_dataset(filesystem=pafs.SubTreeFileSystem(root, pafs.LocalFileSystem()))


def files_dataset(table: DeltaTable, paths: list[str]) -> pads.Dataset:
    """Some of a Delta table's current files (paths relative to its root) as a pyarrow
    dataset; a remote table gives all of them (deltalake's dataset carries its storage
    options), which readers filter as they would the whole table."""
    import pyarrow.dataset

    uri = table.table_uri
    if not is_local(uri):
        return table.to_pyarrow_dataset()
    filesystem = pafs.SubTreeFileSystem(normalize(uri), pafs.LocalFileSystem())
    return pyarrow.dataset.dataset(paths, format="parquet", filesystem=filesystem)


def subtask_dir(location: str, job_id: str, operator_id: str, subtask: int) -> str:
    return f"{location}/{job_id}/{operator_id}/subtask={subtask:05d}"


def list_dirs(location: str, *parts: str) -> list[str]:
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
        fs, root = pafs.FileSystem.from_uri(path)
        infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    except Exception as exc:  # pyarrow raises several types for remote stores
        raise CheckpointLocationError(
            f"Cannot list checkpoint directory {path}: {exc}. Object-store listing uses "
            "pyarrow's filesystems and the environment's credentials."
        ) from exc
    return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)


def data_files(table_uri: str) -> set[str] | None:
    """Names of the files at the root of a table (its data: checkpoint tables are not
    partitioned), or None where they cannot be listed (a remote store that pyarrow cannot
    reach with the environment's credentials)."""
    try:
        if is_local(table_uri):
            return {e.name for e in os.scandir(normalize(table_uri)) if e.is_file()}
        fs, root = pafs.FileSystem.from_uri(table_uri)
        infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
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


def location_exists(location: str) -> bool:
    if is_local(location):
        return os.path.isdir(location)
    try:
        fs, root = pafs.FileSystem.from_uri(location)
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
