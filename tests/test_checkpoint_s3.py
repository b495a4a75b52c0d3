"""Checkpoints on an object store: a real S3 API server (moto's) on 127.0.0.1, reached
only through the storage_options a CheckpointConfig gives (the environment holds no
credentials or endpoint for it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from checkpoint import CheckpointLocationError, CheckpointRef, SnapshotStore, delta_dataset
from stateful_async import StreamRecord

SCHEMA = pa.schema([("id", pa.int64()), ("label", pa.string())])


@pytest.fixture(autouse=True)
def no_aws_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The S3 server is reached through the options a test gives (or the environment it
    sets), never through a developer's own AWS settings."""
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)


def commit(log: Any, run: str, ckpt: int, parent: CheckpointRef | None = None) -> Any:
    return log.commit(
        run,
        ckpt,
        [StreamRecord({"id": ckpt, "label": f"in flight at {ckpt}"})],
        [{"id": ckpt, "label": f"result of {ckpt}"}],
        input_schema=SCHEMA,
        output_schema=SCHEMA,
        position=ckpt,
        parent=parent,
    )


def test_a_store_on_s3_lists_restores_and_expires_with_its_storage_options(s3) -> None:
    location = f"{s3.bucket()}/checkpoints"
    store = SnapshotStore(location, s3.options)
    for operator, subtasks in (("enrich", 3), ("other", 1)):
        for subtask in range(subtasks):
            log = store.subtask("job", operator, subtask)
            parent = None
            for ckpt in (1, 2, 3):
                parent = commit(log, "run", ckpt, parent).ref
    # Listing went through pyarrow with the environment's credentials: the store could
    # write its tables (deltalake took the options) but not find them.
    assert store.jobs() == ["job"]
    assert store.operators("job") == ["enrich", "other"]
    assert store.subtasks("job", "enrich") == [0, 1, 2]
    metas = store.checkpoints("job", "enrich")
    assert sorted((m.subtask, m.checkpoint_id) for m in metas) == [
        (p, c) for p in range(3) for c in (1, 2, 3)
    ]
    point = store.restore("job", "enrich", 1, 2)
    assert [e.value for e in point.elements] == [{"id": 2, "label": "in flight at 2"}]
    assert [r.value for r in point.result_records()] == [
        {"id": c, "label": f"result of {c}"} for c in (1, 2)
    ]
    assert store.read_job("job").num_rows == 4 * 3 * 3  # (meta, record, result) x 3 x 4
    # expiry drops the state of checkpoints 1 and 2 and vacuums their files from the bucket
    report = store.expire("job", retain=1, operator_id="enrich")
    assert sorted(r.checkpoint_id for r in report.expired + report.deleted) == [1] * 3 + [2] * 3
    assert report.files_removed > 0
    assert [m.checkpoint_id for m in store.checkpoints("job", "enrich")] == [3, 3, 3]
    # a task's expiry deletes the files its commit removed, on the bucket too
    other = store.subtask("job", "other", 0)
    assert other.expire(1, run_id="run").files_removed == 2  # checkpoints 1 and 2's
    # reads use pyarrow's own S3 filesystem: deltalake's Python handler aborts a process at
    # exit about one run in ten after a read
    table = store.subtask("job", "enrich", 0)._open()
    filesystem = delta_dataset(table, s3.options).filesystem
    assert isinstance(filesystem, pafs.SubTreeFileSystem)
    assert isinstance(filesystem.base_fs, pafs.S3FileSystem)


def test_a_location_that_the_options_cannot_reach_is_named(s3) -> None:
    location = f"{s3.bucket()}/checkpoints"
    commit(SnapshotStore(location, s3.options).subtask("job", "enrich", 0), "run", 1)
    wrong = {**s3.options, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}  # nothing listens
    with pytest.raises(CheckpointLocationError, match=r"Cannot list checkpoint directory s3://"):
        SnapshotStore(location, wrong).subtasks("job", "enrich")


def test_the_command_line_reads_checkpoints_on_s3_given_storage_options(s3, tmp_path) -> None:
    # A process of its own, as users run it: it must list, show and exit cleanly (0).
    location = f"{s3.bucket()}/checkpoints"
    store = SnapshotStore(location, s3.options)
    parent = None
    for ckpt in (1, 2):
        parent = commit(store.subtask("job", "enrich", 0), "run", ckpt, parent).ref
    options = [arg for key, value in s3.options.items() for arg in ("-o", f"{key}={value}")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "stateful_async.cli", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )

    listed = cli("checkpoints", "list", location, *options)
    assert listed.returncode == 0, listed.stderr
    assert "job job, operator enrich, run run" in listed.stdout
    # id, parts, in flight, results, position: one row per checkpoint
    assert re.findall(r"^\s+(\d)\s+1\s+1\s+1\s+(\d)\s", listed.stdout, re.M) == [
        ("1", "1"),
        ("2", "2"),
    ]
    shown = cli("checkpoints", "show", location, "2", "--format", "json", *options)
    assert shown.returncode == 0, shown.stderr
    [snapshot] = json.loads(shown.stdout)
    assert (snapshot["checkpoint_id"], snapshot["results_committed"]) == (2, 1)
    assert [e["value"] for e in snapshot["elements"]] == [{"id": 2, "label": "in flight at 2"}]
    bad = cli("checkpoints", "list", location, "-o", "AWS_REGION")
    assert bad.returncode == 2
    assert "--storage-option 'AWS_REGION' is not KEY=VALUE" in bad.stderr
    # A store it cannot reach: the error names the option to fix, not CheckpointConfig's.
    from stateful_async.chaos._cluster import free_port

    elsewhere = {**s3.options, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
    away = [arg for key, value in elsewhere.items() for arg in ("-o", f"{key}={value}")]
    unreachable = cli("checkpoints", "list", location, *away)
    assert unreachable.returncode == 2
    assert "Cannot list checkpoint directory s3://" in unreachable.stderr
    assert "credentials: --storage-option / -o KEY=VALUE, else the" in unreachable.stderr


def test_settings_the_options_leave_out_come_from_the_environment(s3, monkeypatch) -> None:
    # As delta-rs merges them: here the endpoint and credentials are in the environment,
    # and the options only tune how delta-rs commits. Reads went to AWS's own endpoint.
    for key, value in s3.options.items():
        monkeypatch.setenv(key, value)
    location = f"{s3.bucket()}/checkpoints"
    only = {"AWS_S3_ALLOW_UNSAFE_RENAME": "true"}
    log = SnapshotStore(location, only).subtask("job", "enrich", 0)
    commit(log, "run", 2, commit(log, "run", 1).ref)
    fresh = SnapshotStore(location, only)  # as a retried task or a new run sees it
    assert fresh.jobs() == ["job"]
    assert fresh.subtask("job", "enrich", 0).latest().checkpoint_id == 2
    assert [r.value["id"] for r in fresh.restore("job", "enrich", 0, 2).result_records()] == [1, 2]
    # an s3a:// location (Hadoop's name for S3) is the same store
    s3a = SnapshotStore(location.replace("s3://", "s3a://"), only)
    assert s3a.subtasks("job", "enrich") == [0]
    assert s3a.subtask("job", "enrich", 0).latest().checkpoint_id == 2


def test_s3_options_are_translated_for_pyarrow_or_left_to_deltalake(monkeypatch) -> None:
    from checkpoint._layout import filesystem

    def settings(options: dict[str, str]) -> dict[str, Any]:
        fs, path = filesystem("s3://bucket/chk/", options)
        assert path == "bucket/chk"
        assert isinstance(fs, pafs.S3FileSystem)
        return fs.__reduce__()[1][0]  # the arguments it was built with

    given = settings(
        {
            "aws_access_key_id": "key",
            "SECRET_ACCESS_KEY": "secret",  # any case, any of delta-rs's aliases
            "aws_token": "token",
            "region": "eu-west-1",
            "endpoint": "minio.local:9000",
            "allow_http": "TRUE",
            "aws_virtual_hosted_style_request": "true",
            "aws_conditional_put": "etag",  # for commits only
        }
    )
    assert {k: given[k] for k in ("access_key", "secret_key", "session_token", "region")} == {
        "access_key": "key",
        "secret_key": "secret",
        "session_token": "token",
        "region": "eu-west-1",
    }
    assert (given["endpoint_override"], given["scheme"]) == ("minio.local:9000", "http")
    assert given["force_virtual_addressing"] is True and given["anonymous"] is False
    https = settings({"AWS_ENDPOINT_URL": "HTTPS://s3.example:443/", "AWS_REGION": "x"})
    assert (https["endpoint_override"], https["scheme"]) == ("s3.example:443", "https")
    # credentials are the options' as a set (as in delta-rs), never mixed with the
    # environment's; and none at all with unsigned requests
    monkeypatch.setenv("AWS_SESSION_TOKEN", "sso-token")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    minio = settings({"AWS_ACCESS_KEY_ID": "minio", "AWS_SECRET_ACCESS_KEY": "pw", "region": "x"})
    assert (minio["access_key"], minio["secret_key"], minio["session_token"]) == ("minio", "pw", "")
    chain = settings({"AWS_REGION": "x"})  # the SDK's own chain finds the environment's
    assert (chain["access_key"], chain["session_token"]) == (None, None)
    unsigned = settings({"AWS_SKIP_SIGNATURE": "true", "AWS_ACCESS_KEY_ID": "k", "region": "x"})
    assert unsigned["anonymous"] is True and not unsigned["access_key"]
    # a setting pyarrow has no equivalent for: deltalake's own handler, which knows it
    fs, path = filesystem("s3://bucket/chk", {"AWS_PROFILE": "reader", "AWS_REGION": "x"})
    assert isinstance(fs, pafs.PyFileSystem) and path == ""
