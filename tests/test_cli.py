"""The stateful-async command line, on real checkpoint locations (Typer's test runner)."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import textwrap
import time
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from checkpoint import ORPHAN_GRACE, CheckpointNotFoundError, SnapshotStore, SubtaskLog
from stateful_async import AsyncWaitOperator, OutputMode, StreamRecord, Watermark
from stateful_async.cli import app
from stateful_async.testing import ControlledFunction, settle

runner = CliRunner()
INPUT = pa.schema([("id", pa.int64()), ("name", pa.string())])
OUTPUT = pa.schema([("id", pa.int64()), ("greeting", pa.string())])


def invoke(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args), terminal_width=200)


def replay(location: Path, function: str, *args: str):  # type: ignore[no-untyped-def]
    """``stateful-async replay LOCATION 2 --function FUNCTION ARGS...``"""
    return invoke("replay", str(location), "2", "--function", function, *args)


class ById(ControlledFunction):
    async def async_invoke(self, value):  # type: ignore[no-untyped-def]
        return await super().async_invoke(value["id"])


async def snapshot_mid_job(location: Path) -> list[dict]:
    """Run an operator over 8 records, complete some, and checkpoint it mid-job (two
    partitions, two checkpoints each); return partition 0's in-flight inputs at checkpoint 2."""
    store = SnapshotStore(location)
    in_flight: list[dict] = []
    for partition in (0, 1):
        fn = ById()
        emitted: list = []
        op = AsyncWaitOperator(fn, emitted.append, OutputMode.ORDERED, capacity=10)
        await op.open()
        # names in brackets: the terminal output must show them, not take them for markup
        rows = [{"id": partition * 100 + i, "name": f"[n{i}]"} for i in range(8)]
        for row in rows[:4]:
            await op.process_element(StreamRecord(row))
        await settle()
        fn.complete(partition * 100, [{"id": partition * 100, "greeting": "hi n0"}])
        await settle()
        log = store.subtask("job", "enrich", partition)
        first = log.commit(
            "run",
            1,
            op.snapshot_state(1),
            [e.value for e in emitted],
            input_schema=INPUT,
            output_schema=OUTPUT,
            position=4,
        )
        emitted.clear()
        await op.process_watermark(Watermark(50))
        for row in rows[4:]:
            await op.process_element(StreamRecord(row))
        await settle()
        fn.complete(partition * 100 + 1, [{"id": partition * 100 + 1, "greeting": "hi n1"}])
        await settle()
        snapshot = op.snapshot_state(2)
        log.commit(
            "run",
            2,
            snapshot,
            [e.value for e in emitted],
            input_schema=INPUT,
            output_schema=OUTPUT,
            position=8,
            parent=first.ref,
            properties={"owner": f"app/1/{partition}", "attempt": "0"},
        )
        if partition == 0:
            in_flight = [e.value for e in snapshot if isinstance(e, StreamRecord)]
        await op.close()
    return in_flight


@pytest.fixture
def checkpoints(tmp_path: Path) -> tuple[Path, list[dict]]:
    import asyncio

    location = tmp_path / "ckpt"
    in_flight = asyncio.run(snapshot_mid_job(location))
    return location, in_flight


REPLAY_MODULE = textwrap.dedent(
    """
    from stateful_async import AsyncFunction

    async def greet(row):
        return [{"id": row["id"], "greeting": "hello " + row["name"]}]

    class Greeter(AsyncFunction):
        async def async_invoke(self, row):
            return [{"id": row["id"], "greeting": "hey " + row["name"]}]

    def not_async(row):
        return [row]

    async def returns_a_dict(row):
        return {"id": row["id"], "greeting": "hi"}

    async def mixed_types(row):  # a str for odd ids, an int for even ones
        return [{"id": row["id"], "greeting": "odd" if row["id"] % 2 else 0}]

    async def look_up(row):  # a Spark job's function: MAP values are dicts
        return [{"id": row["id"], "greeting": row["names"]["en"]}]

    async def echo(row):
        return [row]

    async def gives_a_set(row):
        return [{1, 2}]

    async def nothing(row):
        return []

    async def fails(row):
        raise ValueError("the service said no")

    class OpenFails(AsyncFunction):
        async def open(self):
            raise ConnectionError("the service is down")

        async def async_invoke(self, row):
            return [row]

    class CloseFails(Greeter):
        async def close(self):
            raise RuntimeError("the pool was gone")

    class BothFail(CloseFails):
        async def async_invoke(self, row):
            raise ValueError("the service said no")

    NOT_A_FUNCTION = 42
    """
)


@pytest.fixture
def functions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    module = tmp_path / "mod" / "replay_functions.py"
    module.parent.mkdir()
    module.write_text(REPLAY_MODULE)
    monkeypatch.chdir(module.parent)
    return module


# -- list / show / expire --------------------------------------------------------------------


def test_list_shows_each_checkpoint_summed_over_partitions(checkpoints) -> None:
    location, _ = checkpoints
    result = invoke("checkpoints", "list", str(location))
    assert result.exit_code == 0, result.output
    lines = [line.split() for line in result.output.splitlines()]
    assert "job job, operator enrich, run run" in result.output
    rows = [line for line in lines if line and line[0] in ("1", "2")]
    # id, partitions, in flight, results, position: per partition, checkpoint 1 has 3 of 4
    # records in flight and 1 result; checkpoint 2 has 6 records and a watermark in flight.
    assert rows[0][:5] == ["1", "2", "6", "2", "8"]
    assert rows[1][:5] == ["2", "2", "14", "2", "16"]
    assert "run" in result.output and "KiB" in result.output
    # piped at 80 columns, the table keeps every column whole (a terminal wraps it itself)
    narrow = runner.invoke(app, ["checkpoints", "list", str(location)], terminal_width=80)
    assert re.search(r"created \(UTC\) +size +state", narrow.output), narrow.output
    assert len(re.findall(r" 20\d\d-\d\d-\d\d \d\d:\d\d:\d\d +\d", narrow.output)) == 2


def test_show_lists_in_flight_records_and_watermarks(checkpoints) -> None:
    location, in_flight = checkpoints
    result = invoke(
        "checkpoints", "show", str(location), "2", "--partition", "0", "--format", "json"
    )
    assert result.exit_code == 0, result.output
    (snapshot,) = json.loads(result.stdout)
    assert snapshot["partition"] == 0 and snapshot["checkpoint_id"] == 2
    kinds = [e["kind"] for e in snapshot["elements"]]
    assert kinds.count("watermark") == 1
    assert [e["value"] for e in snapshot["elements"] if e["kind"] == "record"] == in_flight
    assert snapshot["properties"] == {"owner": "app/1/0", "attempt": "0"}  # who wrote it
    assert snapshot["final"] is False  # as the table's "Checkpoint 2" (not "Final ...") says
    table = invoke("checkpoints", "show", str(location), "2")
    assert table.exit_code == 0
    assert '"name": "[n7]"' in table.output and "watermark" in table.output
    assert "partition 0" in table.output and "partition 1" in table.output


@pytest.mark.parametrize(
    ("kind", "stamp", "shown"),
    [
        (
            pa.timestamp("us", tz="UTC"),
            1_704_067_278_000_000,
            ["2024-01-01T00:01:18+00:00", "2024-01-01T00:01:17.999999+00:00"],
        ),
        (
            pa.timestamp("us"),
            1_704_067_278_000_000,
            ["2024-01-01T00:01:18", "2024-01-01T00:01:17.999999"],
        ),
        (pa.date32(), 19_723, ["2024-01-01", "2023-12-31"]),
        (pa.int16(), 1_000, ["1000", "999"]),
    ],
)
def test_show_gives_event_times_in_the_event_time_column_s_type(tmp_path, kind, stamp, shown):
    # A Spark job's checkpoints hold event times as microseconds or days since the epoch
    # and name the event_time column; show printed the integers.
    lowest = -(2**63)  # a watermark below every event time, beyond any date: kept as it is
    row = {"id": 1, "ts": None}  # what is shown is the record's timestamp
    SnapshotStore(tmp_path).subtask("job", "enrich", 0).commit(
        "run",
        1,
        [Watermark(lowest), StreamRecord(row, stamp), Watermark(stamp - 1)],
        [],
        input_schema=pa.schema([("id", pa.int64()), ("ts", kind)]),
        output_schema=OUTPUT,
        position=1,
        properties={"event_time": "ts", "max_out_of_orderness": "0"},
    )
    result = invoke("checkpoints", "show", str(tmp_path), "1")
    assert result.exit_code == 0, result.output
    rows = [line.split("│") for line in result.output.splitlines() if line.count("│") == 6]
    assert [cells[4].strip() for cells in rows] == [str(lowest), *shown]


def test_show_says_what_is_in_flight_on_one_line_and_no_empty_table(checkpoints) -> None:
    # The heading was the table's title: wrapped at the width of the table (three lines for
    # an empty one, which was still drawn), and its count mixed records and watermarks.
    location, _ = checkpoints
    log = SnapshotStore(location).subtask("job", "enrich", 1)
    run = "local-1795416418499.stage12"
    log.commit(
        run,
        3,
        [],
        [],
        input_schema=INPUT,
        output_schema=OUTPUT,
        position=8,
        parent=log.checkpoints()[-1].ref,
        final=True,
    )
    result = invoke("checkpoints", "show", str(location), "3")
    assert result.exit_code == 0, result.output
    assert result.output == (
        f"Final checkpoint 3 of job job, partition 1 (run {run}): nothing in flight at input "
        "position 8\n"
    )
    # JSON says so too (it did not: a script could not tell a final checkpoint)
    result = invoke("checkpoints", "show", str(location), "3", "--format", "json")
    assert result.exit_code == 0, result.output
    assert [s["final"] for s in json.loads(result.stdout)] == [True]
    result = invoke("checkpoints", "show", str(location), "2", "--partition", "0")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(
        "Checkpoint 2 of job job, partition 0 (run run): 6 records and 1 watermark in flight "
        "at input position 8\n"
    ), result.output


def test_expire_keeps_the_newest_and_reports(checkpoints) -> None:
    location, _ = checkpoints
    result = invoke("checkpoints", "expire", str(location), "--retain", "1")
    assert result.exit_code == 0, result.output
    assert "1 checkpoint(s) expired (2 partition snapshot(s);" in result.output
    shown = invoke("checkpoints", "show", str(location), "1")
    assert shown.exit_code == 2
    # It said "There is no checkpoint 1", which `list --all` goes on to show.
    assert "Checkpoint 1 of job job at " in shown.output
    assert "has expired: retention (the job's `retain`, or `checkpoints expire`)" in shown.output
    assert "Checkpoint ids that can still be shown: 2." in shown.output
    assert "checkpoint 7 of job job" in invoke("checkpoints", "show", str(location), "7").output


def test_summaries_are_whole_lines_in_a_pipe(checkpoints, functions, tmp_path) -> None:
    # rich cut them at 80 columns mid-sentence, and a path with them: "... gave \n12
    # result(s), written to /tmp/pytest-.../re\nplayed.jsonl." (a log's reader, or grep,
    # found neither whole)
    location, _ = checkpoints
    written = tmp_path / "a directory with a rather long name" / "replayed.jsonl"
    written.parent.mkdir()
    result = replay(location, "replay_functions:echo", "--output", str(written))
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "Replayed checkpoint 2 of run run: 12 in-flight record(s) of 2 partition(s) gave 12 "
        f"result(s), written to {written}."
    ]
    result = invoke("checkpoints", "expire", str(location), "--retain", "1")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        "Job job: 1 checkpoint(s) expired (2 partition snapshot(s); state dropped, results "
        "kept for later checkpoints), 0 deleted (0 partition snapshot(s)), 2 file(s) removed "
        "from storage.",
        "0 file(s) no checkpoint used (left by commits that never completed), older than 24 "
        "hour(s), deleted.",
    ]


def test_expire_deletes_files_no_checkpoint_uses_once_older_than_the_grace_period(
    checkpoints,
) -> None:
    location, _ = checkpoints
    table = location / "job" / "enrich" / "subtask=00001"
    stray = pa.table({"id": [1]})  # what a task killed mid-commit leaves
    old, fresh = table / "part-00000-old-c000.snappy.parquet", table / "part-00000-new.parquet"
    pq.write_table(stray, old)
    pq.write_table(stray, fresh)
    os.utime(old, (time.time() - 25 * 3600,) * 2)
    result = invoke("checkpoints", "expire", str(location), "--retain", "5")
    assert result.exit_code == 0, result.output
    # the default grace period is the library's
    assert ORPHAN_GRACE == dt.timedelta(hours=24)
    said = " ".join(result.output.split())
    assert "1 file(s) no checkpoint used (left by commits that never completed)" in said
    assert "older than 24 hour(s), deleted." in said
    assert not old.exists() and fresh.exists()
    result = invoke(  # half an hour is what delta-rs's vacuum can do: a whole one
        "checkpoints", "expire", str(location), "--retain", "5", "--orphans-older-than", "0.5"
    )
    assert "0 file(s) no checkpoint used" in result.output
    assert "older than 1 hour(s), deleted." in " ".join(result.output.split())
    assert fresh.exists()
    result = invoke(
        "checkpoints", "expire", str(location), "--retain", "5", "--orphans-older-than", "0"
    )
    said = " ".join(result.output.split())
    assert "1 file(s) no checkpoint used (left by commits that never completed)" in said
    assert "older than 0 hour(s), deleted." in said
    assert not fresh.exists()
    # 0 also deletes the file of a commit in progress: a running job's partition whose
    # commit then logs it can no longer be read
    assert (
        "Warning: --orphans-older-than 0 deletes the file of any commit still in progress. If "
        "a job is writing to this location, a partition whose commit logs a file deleted here "
        "can no longer be read, and its checkpoints are lost: use 0 only while no job runs."
    ) in said
    assert "Warning" not in " ".join(
        invoke("checkpoints", "expire", str(location), "--retain", "5").output.split()
    )
    assert (
        SnapshotStore(location).subtask("job", "enrich", 1).restore(2).metadata.checkpoint_id == 2
    )
    for hours in ("-1", "nan", "inf", "3e12"):  # 3e12: delta-rs's vacuum panicked
        refused = invoke(
            "checkpoints", "expire", str(location), "--retain", "0", "--orphans-older-than", hours
        )
        said = " ".join(refused.output.split())
        assert refused.exit_code == 2, refused.output
        assert "--orphans-older-than must be a number of hours from 0 up to 1,000,000; got" in (
            said
        )
    assert (
        SnapshotStore(location).subtask("job", "enrich", 1).restore(2).metadata.checkpoint_id == 2
    )


def _first_file(table: Path) -> Path:
    """The data file of a checkpoint table's first commit (its first checkpoint's)."""
    from deltalake import DeltaTable

    (uri,) = DeltaTable(str(table), version=0).file_uris()
    return Path(uri.removeprefix("file://"))


def test_expire_that_fails_in_one_partition_says_what_it_did_before_the_error(
    checkpoints,
) -> None:
    # Partition 0's checkpoint 1 was expired and partition 1's failed: the command printed
    # the error alone, as if nothing had been done.
    location, _ = checkpoints
    _first_file(location / "job" / "enrich" / "subtask=00001").write_bytes(b"garbage")
    result = invoke("checkpoints", "expire", str(location), "--retain", "1")
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    done = said.index(
        "Job job, 1 of 2 partition(s): 1 checkpoint(s) expired (1 partition snapshot(s);"
    )
    orphans = said.index("0 file(s) no checkpoint used")
    error = said.index(
        "Error: Expiring the checkpoints failed in 1 of 2 partition(s) (operator enrich, "
        "partition 1): Cannot read checkpoint table"
    )
    assert done < orphans < error, said
    assert said.endswith(
        "The other partitions' checkpoints were expired, as said above; run the command "
        "again once the cause is fixed."
    ), said
    kept = SnapshotStore(location).subtask("job", "enrich", 0).checkpoints(include_expired=False)
    assert [m.checkpoint_id for m in kept] == [2]  # partition 0's expiry was done


def test_expire_stopped_by_the_user_stops_without_a_summary(
    checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, Ctrl-C in a partition's expiry was taken as that partition's failure: the
    # command printed "Job job, 0 of 2 partition(s): ..." before it stopped.
    location, _ = checkpoints

    def interrupted(self: Any, *args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(SubtaskLog, "expire", interrupted)
    result = invoke("checkpoints", "expire", str(location), "--retain", "1")
    assert result.exit_code == 130, result.output  # 128 + SIGINT, as Typer ends on Ctrl-C
    assert "partition(s)" not in result.output and "checkpoint(s) expired" not in result.output


def test_expire_whose_orphan_deletion_fails_in_one_partition_says_what_it_deleted(
    checkpoints,
) -> None:
    location, _ = checkpoints
    stray = location / "job" / "enrich" / "subtask=00000" / "part-00000-old-c000.snappy.parquet"
    pq.write_table(pa.table({"id": [1]}), stray)
    os.utime(stray, (time.time() - 25 * 3600,) * 2)
    for entry in (location / "job" / "enrich" / "subtask=00001" / "_delta_log").glob("*.json"):
        entry.write_text("not json")
    result = invoke("checkpoints", "expire", str(location), "--retain", "1")
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert said.startswith(
        "1 file(s) no checkpoint used (left by commits that never completed), older than 24 "
        "hour(s), deleted. Error: Deleting the files no checkpoint uses failed in 1 of 2 "
        "partition(s) (operator enrich, partition 1): Cannot open checkpoint table"
    ), said
    assert "No checkpoint was expired; run the command again once the cause is fixed." in said
    assert not stray.exists()
    kept = SnapshotStore(location).subtask("job", "enrich", 0).checkpoints(include_expired=False)
    assert [m.checkpoint_id for m in kept] == [1, 2]  # nothing expired


def test_show_of_a_run_whose_checkpoints_all_expired_says_they_expired(tmp_path) -> None:
    # It said the job "has no run 'early'", which `list --all` goes on to show: a run that
    # another resumed from, whose checkpoint retention expired (its results stay).
    log = SnapshotStore(tmp_path).subtask("job", "enrich", 0)
    schema = pa.schema([("id", pa.int64())])
    parent = None
    for run, ckpt in (("early", 1), ("late", 2)):
        parent = log.commit(
            run, ckpt, [StreamRecord({"id": ckpt})], [{"id": ckpt}], parent=parent,
            input_schema=schema, output_schema=schema, position=ckpt,
        ).ref  # fmt: skip
    log.expire(1)
    assert "expired" in invoke("checkpoints", "list", str(tmp_path), "--all").output
    shown = invoke("checkpoints", "show", str(tmp_path), "1", "--run", "early")
    assert shown.exit_code == 2
    assert "Checkpoint 1 of job job, run early at " in shown.output, shown.output
    assert "has expired" in shown.output


def test_list_says_how_many_partitions_expired_a_checkpoint(checkpoints) -> None:
    # Each partition expires its own checkpoints: one that only partition 1 expired was
    # shown as "expired", though partition 0 can still restore it.
    location, _ = checkpoints
    SnapshotStore(location).subtask("job", "enrich", 1).expire(1)
    result = invoke("checkpoints", "list", str(location), "--all")
    assert result.exit_code == 0, result.output
    (first,) = [line for line in result.output.splitlines() if line.strip().startswith("1 ")]
    assert first.rstrip().endswith("1 expired"), first
    assert (
        SnapshotStore(location).subtask("job", "enrich", 0).restore(1).metadata.checkpoint_id == 1
    )


def test_list_all_does_not_show_0_bytes_for_expired_checkpoints_whose_results_remain(
    checkpoints,
) -> None:
    # expire rewrites what an expired checkpoint keeps (its results, which checkpoint 2's
    # chain needs) into files shared with other checkpoints, whose bytes belong to none of
    # them: the row showed "0 B" though the results were still stored.
    location, _ = checkpoints
    store = SnapshotStore(location)
    for partition in (0, 1):  # a third checkpoint: 1 and 2 then expire into one file
        log = store.subtask("job", "enrich", partition)
        log.commit(
            "run",
            3,
            [],
            [{"id": 9, "greeting": "c"}],
            input_schema=INPUT,
            output_schema=OUTPUT,
            position=9,
            parent=log.checkpoints()[-1].ref,
        )
    assert invoke("checkpoints", "expire", str(location), "--retain", "1").exit_code == 0
    kept = store.read_job("job").filter(pc.field("kind") == "result").column("checkpoint_id")
    assert sorted(kept.to_pylist()) == [1, 1, 2, 2, 3, 3]  # results of 1 and 2 are kept
    result = invoke("checkpoints", "list", str(location), "--all")
    assert result.exit_code == 0, result.output
    rows = {
        line.split()[0]: line.split()
        for line in result.output.splitlines()
        if line[:3].strip().isdigit()
    }
    assert rows["1"][-2:] == rows["2"][-2:] == ["-", "expired"], rows
    assert rows["3"][-1] == "KiB", rows  # its own files: sized as before


@pytest.mark.parametrize("width", [60, 80])
def test_list_on_a_narrow_terminal_cuts_no_value(checkpoints, monkeypatch, width) -> None:
    # rich fitted the table to the terminal by cutting its last columns: at 80 columns
    # "expired" read "expire", "final" read "f" and the creation time lost its seconds.
    from rich.console import Console

    import stateful_async.cli as cli

    location, _ = checkpoints
    assert invoke("checkpoints", "expire", str(location), "--retain", "1").exit_code == 0
    monkeypatch.setattr(cli, "out", Console(force_terminal=True, width=width, color_system=None))
    result = invoke("checkpoints", "list", str(location), "--all")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "created (UTC) size state" in text, result.output
    assert len(re.findall(r" 20\d\d-\d\d-\d\d \d\d:\d\d:\d\d \d+\.\d KiB expired", text)) == 1
    assert len(re.findall(r" 20\d\d-\d\d-\d\d \d\d:\d\d:\d\d \d+\.\d KiB", text)) == 2
    # a table that fits is laid out at the terminal's width, its values wrapped there
    shown = invoke("checkpoints", "show", str(location), "2", "--partition", "0")
    assert shown.exit_code == 0, shown.output
    assert max(map(len, shown.output.splitlines())) <= width, shown.output
    assert '"name":' in shown.output


def test_list_after_everything_expired_says_so(checkpoints) -> None:
    location, _ = checkpoints
    assert invoke("checkpoints", "expire", str(location), "--retain", "0").exit_code == 0
    for args in ([], ["--all"]):
        result = invoke("checkpoints", "list", str(location), *args)
        assert result.exit_code == 2
        assert f"{location} holds no checkpoints." in result.output


def test_a_commit_following_a_checkpoint_expire_deleted_while_the_job_ran_names_it(
    tmp_path: Path,
) -> None:
    # `checkpoints expire --retain 0` while a job ran deleted the checkpoint a running task's
    # next one follows: that commit was refused as deleted "most likely by the retention of
    # another run of this job sharing the table", which sent the user looking for a run
    # that did not exist.
    location = tmp_path / "ckpt"
    log = SnapshotStore(location).subtask("job", "enrich", 0)
    first = log.commit("run", 1, [], [], input_schema=INPUT, output_schema=OUTPUT, position=1)
    assert invoke("checkpoints", "expire", str(location), "--retain", "0").exit_code == 0
    with pytest.raises(CheckpointNotFoundError) as refused:
        log.commit(
            "run", 2, [], [], input_schema=INPUT, output_schema=OUTPUT, position=2, parent=first.ref
        )
    said = " ".join(str(refused.value).split())
    assert "or by `stateful-async checkpoints expire` while this job ran." in said
    assert "expire a job's checkpoints only while it is not running." in said
    assert log.checkpoints() == []  # nothing written


def test_list_of_one_job_whose_checkpoints_are_all_gone_names_the_job(checkpoints) -> None:
    # It said the location held no checkpoints, though its other jobs' were there.
    location, _ = checkpoints
    SnapshotStore(location).subtask("other", "enrich", 0).commit(
        "run", 1, [], [], input_schema=INPUT, output_schema=OUTPUT, position=1
    )
    expired = invoke("checkpoints", "expire", str(location), "--job", "other", "--retain", "0")
    assert expired.exit_code == 0, expired.output
    for args in ([], ["--all"]):
        result = invoke("checkpoints", "list", str(location), "--job", "other", *args)
        assert result.exit_code == 2, result.output
        assert f"Job other has no checkpoints at {location}: none was committed" in " ".join(
            result.output.split()
        ), result.output
        assert "or all were deleted (as by `checkpoints expire --retain 0`)" in " ".join(
            result.output.split()
        ), result.output
        assert "holds no checkpoints" not in result.output
    assert "job job, operator enrich" in invoke("checkpoints", "list", str(location)).output


def test_list_of_a_job_whose_task_stopped_before_its_first_checkpoint_does_not_say_deleted(
    checkpoints,
) -> None:
    # It said "all deleted", though none had been committed: a task killed before its
    # first checkpoint leaves its subtask's directory without a Delta log.
    location, _ = checkpoints
    (Path(location) / "early" / "enrich" / "subtask=00000").mkdir(parents=True)
    result = invoke("checkpoints", "list", str(location), "--job", "early")
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert f"Job early has no checkpoints at {location}: none was committed" in said, said


def test_a_directory_inside_a_location_or_a_delta_table_is_refused_with_the_right_path(
    checkpoints, tmp_path
) -> None:
    from deltalake import write_deltalake

    location, _ = checkpoints
    (partition,) = [p for p in (location / "job" / "enrich").iterdir() if p.name.endswith("0")]
    write_deltalake(str(tmp_path / "output"), pa.table({"id": [1]}))
    cases = [
        (
            location / "job",
            f"one job's directory of a checkpoint location; pass the location "
            f"itself, one level up: {location}",
        ),
        (location / "job" / "enrich", f"two levels up: {location}"),
        (
            partition,
            f"one partition's checkpoint table; pass the checkpoint location, three "
            f"levels up: {location}",
        ),
        (tmp_path / "output", "is a Delta table, not a checkpoint location"),
    ]
    for directory, message in cases:
        for command, *rest in (["list"], ["show", "1"], ["expire", "--retain", "1"]):
            result = invoke("checkpoints", command, str(directory), *rest)
            assert result.exit_code == 2, (command, directory, result.output)
            assert message in " ".join(result.output.split()), (command, result.output)
    assert invoke("checkpoints", "list", str(location)).exit_code == 0  # nothing was changed


def test_ids_that_look_like_layout_names_and_two_operators_are_listed_and_counted(
    tmp_path,
) -> None:
    location, store = tmp_path / "ckpt", SnapshotStore(tmp_path / "ckpt")
    for operator in ("subtask=00001", "second"):  # legal ids, however odd
        log = store.subtask("subtask=00000", operator, 0)
        first = log.commit(
            "run",
            1,
            [],
            [{"id": 1, "greeting": "a"}],
            input_schema=INPUT,
            output_schema=OUTPUT,
            position=1,
        )
        log.commit(
            "run",
            2,
            [],
            [{"id": 2, "greeting": "b"}],
            input_schema=INPUT,
            output_schema=OUTPUT,
            position=2,
            parent=first.ref,
        )
    listed = invoke("checkpoints", "list", str(location))
    assert listed.exit_code == 0, listed.output
    assert "operator subtask=00001" in listed.output and "operator second" in listed.output
    expired = invoke("checkpoints", "expire", str(location), "--retain", "1")
    assert expired.exit_code == 0, expired.output
    assert "2 checkpoint(s) expired (2 partition snapshot(s);" in expired.output  # one per operator


def test_directories_that_are_not_jobs_are_left_out(checkpoints) -> None:
    location, _ = checkpoints
    for stray in ("lost+found", ".snapshot", "notes", "other/nested/deeper"):
        (location / stray).mkdir(parents=True)
    listed = invoke("checkpoints", "list", str(location))
    assert listed.exit_code == 0, listed.output
    assert "job job, operator enrich" in listed.output and "notes" not in listed.output
    shown = invoke("checkpoints", "show", str(location), "2")  # one job: no --job needed
    assert shown.exit_code == 0, shown.output
    assert SnapshotStore(location).jobs() == ["job"]


def test_the_parent_of_a_location_is_refused_with_the_location_s_path(
    checkpoints, tmp_path
) -> None:
    location, _ = checkpoints
    (tmp_path / "enriched").mkdir()  # e.g. the job's output beside its checkpoints
    for command, *rest in (["list"], ["show", "1"], ["expire", "--retain", "1"]):
        result = invoke("checkpoints", command, str(tmp_path), *rest)
        assert result.exit_code == 2, (command, result.output)
        assert f"the checkpoint location is one level down: {location}" in " ".join(
            result.output.split()
        ), result.output
    plain = tmp_path / "docs"
    (plain / "benchmarks").mkdir(parents=True)
    for command, *rest in (["show", "1"], ["expire", "--retain", "1"]):
        result = invoke("checkpoints", command, str(plain), *rest)
        assert result.exit_code == 2, (command, result.output)
        assert f"{plain} holds no checkpoints." in result.output
    assert invoke("checkpoints", "show", str(location), "1").exit_code == 0  # nothing changed


# -- replay ----------------------------------------------------------------------------------


def test_replay_gives_the_results_of_exactly_the_saved_in_flight_inputs(
    checkpoints, functions
) -> None:
    location, in_flight = checkpoints
    result = replay(location, "replay_functions:greet", "--partition", "0")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert rows == [{"id": r["id"], "greeting": "hello " + r["name"]} for r in in_flight]
    assert f"{len(in_flight)} in-flight record(s) of 1 partition(s)" in result.output


def test_replay_names_the_run_of_each_partition_it_replayed(checkpoints, functions) -> None:
    location, _ = checkpoints
    SnapshotStore(location).subtask("job", "enrich", 1).commit(
        "later",  # a newer run (a later micro-batch) reached checkpoint 2 in partition 1 only
        2,
        [StreamRecord({"id": 900, "name": "late"})],
        [],
        input_schema=INPUT,
        output_schema=OUTPUT,
        position=1,
    )
    result = replay(location, "replay_functions:greet")
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "Replayed checkpoint 2 of runs run (partitions 0), later (partitions 1):" in said
    result = replay(location, "replay_functions:greet", "--run", "run")
    assert "Replayed checkpoint 2 of run run: 12 in-flight record(s)" in " ".join(
        result.output.split()
    )


def test_replay_hands_map_values_to_the_function_as_dicts(tmp_path, functions) -> None:
    # As a Spark job's function receives them; the store gives pyarrow's (key, value) pairs.
    names = pa.map_(pa.string(), pa.string())
    SnapshotStore(tmp_path / "ckpt").subtask("job", "enrich", 0).commit(
        "run",
        2,
        [StreamRecord({"id": 7, "names": {"en": "seven", "fr": "sept"}})],
        [],
        input_schema=pa.schema([("id", pa.int64()), ("names", names)]),
        output_schema=OUTPUT,
        position=1,
    )
    result = replay(tmp_path / "ckpt", "replay_functions:look_up")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.splitlines()[0]) == {"id": 7, "greeting": "seven"}


def test_show_and_replay_write_map_values_alike(tmp_path, functions) -> None:
    # show wrote the store's (key, value) pairs, [["en", "seven"], ...], where replay wrote
    # the dict the function receives, {"en": "seven", ...}: one row, two renderings.
    by_key = pa.map_(pa.string(), pa.string())
    SnapshotStore(tmp_path / "ckpt").subtask("job", "enrich", 0).commit(
        "run",
        2,
        [StreamRecord({"id": 7, "names": {"en": "seven"}, "daily": [[(1, 1.5)]]})],
        [],
        input_schema=pa.schema(
            [
                ("id", pa.int64()),
                ("names", by_key),
                ("daily", pa.list_(pa.map_(pa.int32(), pa.float64()))),
            ]
        ),
        output_schema=OUTPUT,
        position=1,
    )
    wanted = {"id": 7, "names": {"en": "seven"}, "daily": [{"1": 1.5}]}
    replayed = replay(tmp_path / "ckpt", "replay_functions:echo")
    assert replayed.exit_code == 0, replayed.output
    assert json.loads(replayed.stdout.splitlines()[0]) == wanted
    shown = invoke("checkpoints", "show", str(tmp_path / "ckpt"), "2", "--format", "json")
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)[0]["elements"][0]["value"] == wanted
    table = invoke("checkpoints", "show", str(tmp_path / "ckpt"), "2")
    assert table.exit_code == 0, table.output
    assert json.dumps(wanted) in table.stdout


def test_replay_writes_json_for_map_values_whose_keys_are_not_strings(tmp_path, functions) -> None:
    # A Spark job's MAP<DATE, ...> (or a binary, decimal, timestamp key) reaches the function
    # as a dict with such keys: writing its results raised "keys must be str, int, float,
    # bool or None" as a traceback (exit 1), and --output left an empty file behind that
    # the next try refused as existing.
    by_day = pa.map_(pa.date32(), pa.float64())
    SnapshotStore(tmp_path / "ckpt").subtask("job", "enrich", 0).commit(
        "run",
        2,
        [StreamRecord({"id": 7, "by_day": [(dt.date(2024, 2, 29), 1.5)]})],
        [],
        input_schema=pa.schema([("id", pa.int64()), ("by_day", by_day)]),
        output_schema=OUTPUT,
        position=1,
    )
    wanted = {"id": 7, "by_day": {"2024-02-29": 1.5}}
    result = replay(tmp_path / "ckpt", "replay_functions:echo")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.splitlines()[0]) == wanted
    for suffix in (".json", ".jsonl"):
        written = tmp_path / f"replayed{suffix}"
        result = replay(tmp_path / "ckpt", "replay_functions:echo", "--output", str(written))
        assert result.exit_code == 0, result.output
        assert json.loads(written.read_text()) == ([wanted] if suffix == ".json" else wanted)


def one_row_checkpoint(location: Path) -> None:
    """Checkpoint 2 of job "job", partition 0, holding the input row {"id": 7} in flight."""
    SnapshotStore(location).subtask("job", "enrich", 0).commit(
        "run", 2, [StreamRecord({"id": 7})], [],
        input_schema=pa.schema([("id", pa.int64())]), output_schema=OUTPUT, position=1,
    )  # fmt: skip


def replayed_row(tmp_path: Path, module: Path, source: str, function: str) -> dict:
    """What replay prints (its first line, as JSON) when ``function`` of the module written
    at ``module`` from ``source`` is called again on one_row_checkpoint's row."""
    module.write_text(source)
    one_row_checkpoint(tmp_path / "ckpt")
    result = replay(tmp_path / "ckpt", f"{module.stem}:{function}")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.splitlines()[0])  # type: ignore[no-any-return]


def test_replay_writes_numpy_values_and_keys_as_the_values_they_hold(tmp_path, functions) -> None:
    # A function's numpy values were written as their str(): 7 as "7", a bool as "True"
    # (and as the key "True", where JSON writes a bool key as "true"), an array as "[1 2]".
    source = (
        "import numpy as np\n\n"
        "async def scores(row):\n"
        "    return [{'id': np.int64(row['id']), 'ok': np.bool_(True), 'x': np.float32(1.5),\n"
        "             'nan': np.float32('nan'), 'tags': np.array([1, 2]),\n"
        "             'by': {np.bool_(False): 1, np.int64(3): 2}}]\n"
    )
    assert replayed_row(tmp_path, functions.parent / "with_numpy.py", source, "scores") == {
        "id": 7, "ok": True, "x": 1.5, "nan": "NaN", "tags": [1, 2],
        "by": {"false": 1, "3": 2},
    }  # fmt: skip


def test_replay_writes_numpy_nanosecond_times_as_times_not_counts(tmp_path, functions) -> None:
    # numpy's tolist() gives a datetime64[ns] (what pandas holds) as a bare count of
    # nanoseconds, and a timedelta64[ns] as one: a time was written as 1704067200000000001,
    # and 1500 ns as 1500 where 1500 ms was 1.5 (seconds, as a timedelta is written).
    source = (
        "import numpy as np\n\n"
        "async def times(row):\n"
        "    at = np.datetime64('2024-01-01T00:00:00.000000001', 'ns')\n"
        "    return [{'id': row['id'], 'at': at, 'ats': np.array([at]), 'by': {at: 1},\n"
        "             'ns': np.timedelta64(1500, 'ns'), 'ms': np.timedelta64(1500, 'ms'),\n"
        "             'nat': np.datetime64('NaT', 'ns')}]\n"
    )
    at = "2024-01-01T00:00:00.000000001"
    assert replayed_row(tmp_path, functions.parent / "with_times.py", source, "times") == {
        "id": 7, "at": at, "ats": [at], "by": {at: 1}, "ns": 1.5e-06, "ms": 1.5, "nat": None,
    }  # fmt: skip


def test_replay_writes_sets_as_sorted_lists_and_refuses_values_json_has_no_form_for(
    tmp_path, functions
) -> None:
    # A value JSON has no type for was written as its str() without a word: a set as the
    # string "{1, 2}", a bytearray as "bytearray(b'ab')", an object as "<... at 0x...>".
    # Sets of frozensets (which compare as subsets) or with NaN kept the set's own order.
    module = functions.parent / "odd_values.py"
    source = (
        "import uuid\n\n"
        "async def kinds(row):\n"
        "    return [{'id': row['id'], 'tags': {'b', 'a'}, 'ids': frozenset({3, 1, 2}),\n"
        "             'raw': bytearray(b'ab'), 'uuid': uuid.UUID(int=5),\n"
        "             'groups': {frozenset({10}), frozenset({2}), frozenset({1, 2})},\n"
        "             'floats': {2.0, float('nan'), 1.0}}]\n\n"
        "async def complex_number(row):\n"
        "    return [{'id': row['id'], 'z': complex(1, 2)}]\n\n"
        "async def tuple_key(row):\n"
        "    return [{'id': row['id'], 'by': {(1, 2): 'x'}}]\n"
    )
    assert replayed_row(tmp_path, module, source, "kinds") == {
        "id": 7, "tags": ["a", "b"], "ids": [1, 2, 3], "raw": "YWI=",
        "uuid": "00000000-0000-0000-0000-000000000005",
        "groups": [[1, 2], [10], [2]], "floats": ["NaN", 1.0, 2.0],
    }  # fmt: skip
    for function, said in (
        ("complex_number", "A value to write as JSON, (1+2j) (complex), has no JSON form."),
        ("tuple_key", "A dict to write as JSON has the key (1, 2) (tuple), which JSON has no"),
    ):
        for output in ([], ["--output", str(tmp_path / "out.jsonl")]):
            result = replay(tmp_path / "ckpt", f"odd_values:{function}", *output)
            assert result.exit_code == 2, result.output
            assert f"Error: {said}" in " ".join(result.output.split())
            assert not result.stdout.startswith("{")  # nothing printed
            assert not (tmp_path / "out.jsonl").exists()


def test_replay_to_parquet_writes_sets_as_sorted_lists(tmp_path, functions) -> None:
    # pyarrow took a set as a list in its iteration order, which differs between processes
    # (a set of strings), where JSON output writes it sorted.
    (functions.parent / "with_sets.py").write_text(
        "async def tags(row):\n"
        "    return [{'id': row['id'], 'tags': {f't{i:02}' for i in range(30)},\n"
        "             'nested': [{'ids': frozenset(range(30, 0, -1))}]}]\n"
    )
    one_row_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out.parquet"
    result = replay(tmp_path / "ckpt", "with_sets:tags", "--output", str(out))
    assert result.exit_code == 0, result.output
    assert pq.read_table(out).to_pylist() == [
        {
            "id": 7,
            "tags": [f"t{i:02}" for i in range(30)],
            "nested": [{"ids": list(range(1, 31))}],
        }
    ]


@pytest.mark.parametrize("suffix", ["", ".jsonl", ".json"])
def test_replay_refuses_dict_keys_that_json_writes_as_one(tmp_path, functions, suffix) -> None:
    # A date key and its ISO string merged into one JSON key, the last value kept; 1 and
    # "1" were written as two keys "1", which JSON parsers read as one.
    (functions.parent / "same_keys.py").write_text(
        "import datetime as dt\n\n"
        "async def by_day(row):\n"
        "    return [{'id': row['id'], 'm': {dt.date(2024, 1, 1): 1, '2024-01-01': 2}}]\n\n"
        "async def by_number(row):\n"
        "    return [{'id': row['id'], 'm': {1: 'a', '1': 'b'}}]\n"
    )
    one_row_checkpoint(tmp_path / "ckpt")
    target = tmp_path / f"out{suffix}"
    output = ["--output", str(target)] if suffix else []
    for function, keys in (
        ("by_day", "datetime.date(2024, 1, 1) (datetime.date) and '2024-01-01' (str)"),
        ("by_number", "1 (int) and '1' (str)"),
    ):
        result = replay(tmp_path / "ckpt", f"same_keys:{function}", *output)
        assert result.exit_code == 2, result.output
        said = " ".join(result.output.split())
        assert f"Error: A dict to write as JSON has the keys {keys}, which JSON writes as the " in (
            said
        )
        assert "one would hide the other. Give that dict's keys one type" in said
        assert not result.stdout.startswith("{")  # nothing printed
        assert not target.exists()


def test_replay_that_fails_writing_its_output_leaves_no_file(
    tmp_path, functions, monkeypatch
) -> None:
    # The output file was opened before the results were turned into JSON: a failure there
    # left an empty file, and the next try was refused ("already exists").
    import stateful_async.cli as cli

    one_row_checkpoint(tmp_path / "ckpt")

    def broken(value: Any, indent: int | None = None) -> str:
        raise ValueError("cannot write this")

    monkeypatch.setattr(cli, "_to_json", broken)
    for suffix in (".json", ".jsonl"):
        written = tmp_path / f"replayed{suffix}"
        result = replay(tmp_path / "ckpt", "replay_functions:echo", "--output", str(written))
        assert result.exit_code != 0
        assert not written.exists(), suffix


def test_replay_whose_output_fails_when_closed_leaves_no_file(
    tmp_path, functions, monkeypatch
) -> None:
    # Closing the file writes what is still buffered (all of a small output), and can fail
    # (a full disk, a quota): the error was said ("They were not kept"), but the partial
    # file stayed, so replaying again to that path was refused as "already exists".
    import errno
    import io

    import stateful_async.cli as cli

    one_row_checkpoint(tmp_path / "ckpt")

    class FullDisk(io.StringIO):
        def __init__(self, path: Path, mode: str) -> None:
            super().__init__()
            self.path = Path(path)
            self.path.open(mode).close()  # the file exists from here, as with open()

        def close(self) -> None:
            if not self.closed:
                self.path.write_text(self.getvalue()[:3])  # what reached the disk
                super().close()
                raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cli, "open", FullDisk, raising=False)
    written = tmp_path / "replayed.jsonl"
    result = replay(tmp_path / "ckpt", "replay_functions:echo", "--output", str(written))
    assert result.exit_code == 2, result.output
    assert (
        f"Error: Cannot write the results to {written}: No space left on device. They were "
        "not kept; replay again with another --output."
    ) in " ".join(result.output.split())
    assert not written.exists()


def test_replay_writes_parquet_and_instantiates_function_classes(
    checkpoints, functions, tmp_path
) -> None:
    location, _ = checkpoints
    target = tmp_path / "replayed.parquet"
    result = replay(location, "replay_functions:Greeter", "--output", str(target))
    assert result.exit_code == 0, result.output
    table = pq.read_table(target)
    assert table.num_rows == 12  # both partitions: 6 in-flight records each
    assert all(g.startswith("hey ") for g in table.column("greeting").to_pylist())
    # .json is one JSON document (it was JSON lines, which json.load refuses); .jsonl lines
    for suffix in (".json", ".jsonl"):
        written = tmp_path / f"replayed{suffix}"
        result = replay(location, "replay_functions:Greeter", "--output", str(written))
        assert result.exit_code == 0, result.output
        text = written.read_text()
        rows = json.loads(text) if suffix == ".json" else list(map(json.loads, text.splitlines()))
        assert rows == table.to_pylist()


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("no_such_module:greet", "Cannot import module 'no_such_module'"),
        ("replay_functions:missing", "has no attribute 'missing'"),
        ("replay_functions:not_async", "is a regular function"),
        ("replay_functions:NOT_A_FUNCTION", "Expected an AsyncFunction"),
        ("just_a_name", "must look like module:attribute"),
        ("replay_functions:returns_a_dict", "Return a list: [result] for one result"),
    ],
)
def test_replay_refuses_functions_it_cannot_use(checkpoints, functions, function, message) -> None:
    location, _ = checkpoints
    result = replay(location, function)
    assert result.exit_code == 2
    assert message in result.output


def test_a_function_that_fails_in_replay_is_not_advised_an_option_replay_lacks(
    checkpoints, functions
) -> None:
    # The operator's advice named retry=RetryStrategy(...), the Python API's option, which
    # replay cannot be given.
    location, _ = checkpoints
    result = replay(location, "replay_functions:fails")
    assert result.exit_code == 2
    assert "ValueError: the service said no" in result.output
    assert "retry=" not in result.output
    assert (
        "Fix the cause; or retry it inside the function (replay has no retry option: it "
        "makes one attempt per element); or catch it in async_invoke and return a fallback "
        "result." in " ".join(result.output.split())
    )


def test_a_function_whose_open_fails_in_replay_is_a_clear_error(checkpoints, functions) -> None:
    # before: the ConnectionError's raw traceback, status 1
    location, _ = checkpoints
    result = replay(location, "replay_functions:OpenFails")
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "The function's open() raised ConnectionError: the service is down; nothing was " in said
    assert "Traceback" not in result.output


@pytest.mark.parametrize("suffix", [None, ".jsonl"])
def test_a_function_whose_close_fails_in_replay_keeps_its_results(
    checkpoints, functions, tmp_path, suffix
) -> None:
    # before: a raw traceback, status 1, and the results computed (requests paid for) lost
    location, _ = checkpoints
    args = [] if suffix is None else ["--output", str(tmp_path / f"out{suffix}")]
    result = replay(location, "replay_functions:CloseFails", *args)
    assert result.exit_code == 2, result.output
    lines = result.stdout if suffix is None else (tmp_path / f"out{suffix}").read_text()
    greetings = sorted(json.loads(line)["greeting"] for line in lines.splitlines())
    kept = replay(location, "replay_functions:Greeter")  # the same class, closing cleanly
    assert kept.exit_code == 0, kept.output
    assert greetings == sorted(json.loads(line)["greeting"] for line in kept.stdout.splitlines())
    assert len(greetings) == 12
    said = " ".join(result.output.split())
    assert "The function's close() raised RuntimeError: the pool was gone (in 2 of the 2 " in said
    assert "the results are whole and were kept" in said
    assert "Traceback" not in result.output


def test_a_failure_in_replay_is_not_replaced_by_the_close_that_follows_it(
    checkpoints, functions
) -> None:
    # before: close()'s RuntimeError, raised in a finally, replaced the call's ValueError
    location, _ = checkpoints
    result = replay(location, "replay_functions:BothFail")
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "ValueError: the service said no" in said
    assert "close() raised RuntimeError: the pool was gone too." in said


@pytest.mark.parametrize("timeout", ["0", "-1", "inf"])
def test_replay_refuses_a_timeout_that_is_not_positive(checkpoints, functions, timeout) -> None:
    location, _ = checkpoints
    result = replay(location, "replay_functions:greet", "--timeout", timeout)
    assert result.exit_code == 2
    assert "--timeout must be a finite number of seconds > 0" in result.output
    assert "Omit it for no timeout." in result.output  # not the Python API's timeout=None


def test_replay_refuses_an_output_path_that_exists(checkpoints, functions, tmp_path) -> None:
    location, _ = checkpoints
    existing = tmp_path / "out.jsonl"
    existing.write_text("keep me\n")
    result = replay(location, "replay_functions:greet", "--output", str(existing))
    assert result.exit_code == 2
    assert "already exists; choose a new one" in result.output
    assert existing.read_text() == "keep me\n"


def test_replay_refuses_an_output_directory_that_does_not_exist_before_calling(
    checkpoints, functions, tmp_path
) -> None:
    location, _ = checkpoints
    target = tmp_path / "no-such-dir" / "out.jsonl"
    calls = tmp_path / "calls"
    functions.write_text(
        functions.read_text()
        + f"\nasync def counted(row):\n    open({str(calls)!r}, 'a').write('x')\n"
        "    return [row]\n"
    )
    result = replay(location, "replay_functions:counted", "--output", str(target))
    assert result.exit_code == 2, result.output
    assert "is in a directory that does not exist: create" in " ".join(result.output.split())
    assert not calls.exists()  # refused before any call to the function


@pytest.mark.parametrize("below", ["", "sub/"])
def test_replay_refuses_an_output_path_under_a_file_saying_so_not_that_it_is_missing(
    checkpoints, functions, tmp_path, below
) -> None:
    # The output's directory, or one above it, is a regular file: the message said the
    # directory did not exist, and to create it.
    location, _ = checkpoints
    a_file = tmp_path / "a-file"
    a_file.write_text("keep me\n")
    target = a_file / f"{below}out.jsonl"
    result = replay(location, "replay_functions:greet", "--output", str(target))
    assert result.exit_code == 2, result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert error == [
        f"Error: The output path {target} is under {a_file}, which is not a directory; "
        "choose another path."
    ], result.output
    assert a_file.read_text() == "keep me\n"


def test_replay_refuses_an_output_directory_it_may_not_enter_saying_permission_denied(
    checkpoints, functions, tmp_path, monkeypatch
) -> None:
    # Python 3.14's Path.exists(), is_dir() and is_symlink() are os.path's, which read any
    # error as "no such path": an existing directory that cannot be searched was called
    # missing. Root is denied nothing, so the OS's answer for a directory without search
    # permission (PermissionError from stat/lstat of anything below it) is given here.
    location, _ = checkpoints
    locked = tmp_path / "locked"
    (locked / "sub").mkdir(parents=True)
    target = locked / "sub" / "out.jsonl"
    real_stat, real_lstat = os.stat, os.lstat

    def denied(real):
        def check(path, *args, **kwargs):
            if str(path).startswith(f"{locked}{os.sep}"):
                raise PermissionError(13, "Permission denied", str(path))
            return real(path, *args, **kwargs)

        return check

    monkeypatch.setattr(os, "stat", denied(real_stat))
    monkeypatch.setattr(os, "lstat", denied(real_lstat))
    monkeypatch.setattr(Path, "exists", lambda self: os.path.exists(self))
    monkeypatch.setattr(Path, "is_dir", lambda self: os.path.isdir(self))
    monkeypatch.setattr(Path, "is_symlink", lambda self: os.path.islink(self))
    result = replay(location, "replay_functions:greet", "--output", str(target))
    monkeypatch.undo()
    assert result.exit_code == 2, result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert error == [
        f"Error: Cannot write to the output path {target}: Permission denied. Choose another path."
    ], result.output
    assert list((locked / "sub").iterdir()) == []


def test_replay_refuses_an_output_path_it_cannot_create_before_calling(
    checkpoints, functions, tmp_path
) -> None:
    # A name longer than the filesystem takes ended in a traceback (OSError: [Errno 36]).
    location, _ = checkpoints
    calls = tmp_path / "calls"
    functions.write_text(
        functions.read_text()
        + f"\nasync def counted(row):\n    open({str(calls)!r}, 'a').write('x')\n"
        "    return [row]\n"
    )
    target = tmp_path / ("x" * 300 + ".jsonl")
    result = replay(location, "replay_functions:counted", "--output", str(target))
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # no traceback
    said = " ".join(result.output.split())
    assert f"Cannot write to the output path {target}: File name too long. Choose another" in said
    assert not calls.exists()  # refused before any call to the function
    assert list(tmp_path.glob("x*")) == []


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_replay_that_cannot_write_its_results_says_where_and_why_in_one_line(
    checkpoints, functions, tmp_path, suffix
) -> None:
    # The output's directory is deleted while the function runs: writing raised
    # FileNotFoundError, a traceback.
    location, _ = checkpoints
    directory = tmp_path / "out"
    directory.mkdir()
    target = directory / f"replayed{suffix}"
    module = f"remover_{suffix[1:]}"  # a module of its own: imported modules are cached
    (functions.parent / f"{module}.py").write_text(
        "import shutil\n\n"
        f"async def remove(row):\n    shutil.rmtree({str(directory)!r}, ignore_errors=True)\n"
        "    return [row]\n"
    )
    result = replay(location, f"{module}:remove", "--output", str(target))
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # no traceback
    error = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert error == [
        f"Error: Cannot write the results to {target}: No such file or directory. They were "
        "not kept; replay again with another --output."
    ], result.output
    assert not target.exists()


def test_replay_to_parquet_of_results_with_mixed_types_says_to_use_json_lines(
    checkpoints, functions, tmp_path
) -> None:
    location, _ = checkpoints
    target = tmp_path / "out.parquet"
    result = replay(location, "replay_functions:mixed_types", "--output", str(target))
    assert result.exit_code == 2, result.output
    assert "do not fit one Parquet schema" in result.output
    assert "(--output with .jsonl)" in " ".join(result.output.split())
    assert not target.exists()
    # results that are no dicts: a traceback of pyarrow's ("'set' object has no attribute
    # 'keys'"), status 1
    result = replay(location, "replay_functions:gives_a_set", "--output", str(target))
    assert result.exit_code == 2, result.output
    assert (
        "A Parquet file takes results that are dicts, one a row; the function gave a set: "
        "{1, 2}. Return dicts, or write the results as JSON lines instead (--output with .jsonl)."
    ) in " ".join(result.output.split())
    assert not target.exists()


def test_show_and_replay_write_standard_json_for_floats_json_has_no_number_for(
    tmp_path, functions
) -> None:
    # Python's json writes bare NaN / Infinity, which strict JSON parsers refuse.
    values = [float("nan"), float("inf"), float("-inf"), 1.5]
    SnapshotStore(tmp_path / "ckpt").subtask("job", "enrich", 0).commit(
        "run",
        2,
        [StreamRecord({"id": i, "x": x}) for i, x in enumerate(values)],
        [],
        input_schema=pa.schema([("id", pa.int64()), ("x", pa.float64())]),
        output_schema=OUTPUT,
        position=4,
    )

    def strict(text: str) -> Any:
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name}"))

    wanted = ["NaN", "Infinity", "-Infinity", 1.5]
    shown = invoke("checkpoints", "show", str(tmp_path / "ckpt"), "2", "--format", "json")
    assert shown.exit_code == 0, shown.output
    elements = strict(shown.stdout)[0]["elements"]
    assert [e["value"]["x"] for e in elements] == wanted
    replayed = replay(tmp_path / "ckpt", "replay_functions:echo")
    assert replayed.exit_code == 0, replayed.output
    rows = [strict(line) for line in replayed.stdout.splitlines() if line.startswith("{")]
    assert [r["x"] for r in rows] == wanted


def test_replay_of_no_results_to_parquet_writes_no_file_and_says_so(
    checkpoints, functions, tmp_path
) -> None:
    location, _ = checkpoints
    target = tmp_path / "out.parquet"
    result = replay(location, "replay_functions:nothing", "--output", str(target))
    assert result.exit_code == 0, result.output
    assert not target.exists()  # before: a Parquet file without columns
    said = " ".join(result.output.split())
    assert "No results, so no Parquet file was written to" in said
    assert "gave 0 result(s)." in said


@pytest.mark.parametrize(("suffix", "written"), [(".jsonl", ""), (".json", "[]\n")])
def test_replay_of_no_results_to_json_says_where_it_wrote_the_empty_file(
    checkpoints, functions, tmp_path, suffix, written
) -> None:
    # before: "gave 0 result(s)." alone, as if no file had been written, as for Parquet;
    # the same --output again was then refused as existing
    location, _ = checkpoints
    target = tmp_path / f"out{suffix}"
    result = replay(location, "replay_functions:nothing", "--output", str(target))
    assert result.exit_code == 0, result.output
    assert target.read_text() == written
    assert f"gave 0 result(s), written to {target}." in " ".join(result.output.split())


# -- errors shared by every subcommand ----------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["checkpoints", "list"],
        ["checkpoints", "show", "{}", "1"],
        ["checkpoints", "expire", "--retain", "1"],
    ],
)
def test_an_unknown_location_is_a_clear_error(tmp_path, command) -> None:
    missing = str(tmp_path / "[/nowhere]")  # brackets: printed as they are, not as markup
    args = [missing if a == "{}" else a for a in command]
    if "{}" not in command:
        args.insert(2, missing)
    result = invoke(*args)
    assert result.exit_code == 2
    assert f"The checkpoint location {missing} does not exist." in result.output
    # A file where the location should be is named as such, not as missing.
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    result = invoke(*[str(a_file) if a == missing else a for a in args])
    assert result.exit_code == 2
    assert f"The checkpoint location {a_file} is a file, not a directory." in result.output


@pytest.mark.parametrize(
    "command",
    [
        ["checkpoints", "list", "{}"],
        ["checkpoints", "show", "{}", "2"],
        ["checkpoints", "show", "{}", "2", "--format", "json"],
        ["replay", "{}", "2", "--function", "replay_functions:echo"],
        # the help, which Typer prints through a rich console that exits 1 on a closed pipe
        ["--help"],
        [],  # no command: the help too
        ["checkpoints", "--help"],
        ["checkpoints"],
        ["checkpoints", "list", "--help"],
        ["replay", "{}", "-1", "--help"],
    ],
)
def test_a_command_whose_reader_closes_the_pipe_stops_quietly_with_sigpipe_s_status(
    checkpoints, functions, command
) -> None:
    # `stateful-async checkpoints list ... | head -1`: the command exited with status 1, as
    # for a failure, where a Unix tool stops with 141 (128 + SIGPIPE); and what was left in
    # stdout's buffer could fail again at exit ("Exception ignored ... BrokenPipeError").
    # `stateful-async --help | head -1` did so after the commands no longer did.
    import signal
    import subprocess
    import sys

    location, _ = checkpoints
    read, write = os.pipe()
    os.close(read)  # a reader that has left before the first line
    try:
        args = [str(location) if a == "{}" else a for a in command]
        done = subprocess.run(
            [sys.executable, "-m", "stateful_async.cli", *args],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (128 + signal.SIGPIPE, "")


def _run_with_readers_gone(args: list[str], stdout_gone: bool) -> tuple[int, str]:
    """The command line run with stderr a pipe whose reader has left, and stdout one too
    (``stdout_gone``) or a pipe read to its end: its status, and what it wrote to stdout."""
    import subprocess
    import sys

    err_read, err_write = os.pipe()
    os.close(err_read)
    out_read, out_write = os.pipe()
    if stdout_gone:
        os.close(out_read)
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "stateful_async.cli", *args], stdout=out_write, stderr=err_write
        )
    finally:
        os.close(out_write)
        os.close(err_write)
    written = b""
    if not stdout_gone:
        with os.fdopen(out_read, "rb") as reader:
            written = reader.read()
    return process.wait(timeout=120), written.decode()


@pytest.mark.parametrize("stdout_gone", [False, True], ids=["stderr-gone", "both-gone"])
def test_an_error_whose_message_cannot_be_written_keeps_its_status(
    checkpoints, stdout_gone
) -> None:
    # The error's message failing to reach stderr gave status 1 (a traceback it could not
    # print either), or 141 when stdout's reader had left too: never the error's 2.
    location, _ = checkpoints
    status, _ = _run_with_readers_gone(["checkpoints", "show", str(location), "7"], stdout_gone)
    assert status == 2


@pytest.mark.parametrize("stdout_gone", [False, True], ids=["stderr-gone", "both-gone"])
@pytest.mark.parametrize(
    "args",
    [
        ["checkpoints", "list", "--no-such-option", "{}"],
        ["checkpoints", "show"],
        ["checkpoints", "show", "{}", "abc"],
        ["no-such-command"],
    ],
    ids=["unknown-option", "missing-argument", "bad-value", "unknown-command"],
)
def test_a_usage_error_whose_message_cannot_be_written_keeps_its_status(
    checkpoints, args, stdout_gone
) -> None:
    # Click's own usage errors exit 2, but 1 when their message could not reach stderr
    # (Typer's exit for the failed write), unlike the command line's other errors.
    location, _ = checkpoints
    args = [str(location) if a == "{}" else a for a in args]
    assert _run_with_readers_gone(args, stdout_gone)[0] == 2


def test_a_warning_that_cannot_be_written_does_not_stop_the_command(checkpoints) -> None:
    # `checkpoints list LOCATION -o KEY=VALUE 2>&-`-like: the warning that the storage
    # option is unused failed to reach stderr, which ended the command, status 1, no table.
    location, _ = checkpoints
    args = ["checkpoints", "list", str(location), "-o", "AWS_REGION=eu-west-1"]
    status, written = _run_with_readers_gone(args, stdout_gone=False)
    assert (status, "job job, operator enrich, run run" in written) == (0, True)


def test_a_broken_pipe_that_is_not_stdout_s_is_reported(checkpoints) -> None:
    # Any BrokenPipeError (a socket's, to a service or the JVM) was taken for stdout's
    # reader leaving: status 141, no word, and stdout sent to /dev/null.
    import subprocess
    import sys

    location, _ = checkpoints
    code = (
        "import errno, stateful_async.cli as cli\n"
        "def store(*args):\n"
        "    raise BrokenPipeError(errno.EPIPE, 'the service closed the connection')\n"
        "cli._store = store\n"
        "cli.main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "checkpoints", "list", str(location)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "BrokenPipeError: [Errno 32] the service closed the connection" in done.stderr


def test_an_unknown_id_lists_the_ids_that_exist(checkpoints) -> None:
    location, _ = checkpoints
    result = invoke("checkpoints", "show", str(location), "7")
    assert result.exit_code == 2
    assert "There is no checkpoint 7 of job job" in result.output
    assert "Checkpoint ids that exist: 1-2." in result.output


def test_show_of_one_partition_reads_that_partition_alone(checkpoints) -> None:
    # A job may have thousands of partitions: showing one read every one's table (15 s at
    # 1,000). Shown here by a broken table of another partition, which it must not open.
    location, _ = checkpoints
    [other] = [p for p in location.rglob("subtask=00001")]
    for entry in (other / "_delta_log").glob("*.json"):
        entry.write_text("not json")
    result = invoke("checkpoints", "show", str(location), "2", "--partition", "0")
    assert result.exit_code == 0, result.output
    assert "partition 0" in result.output
    result = invoke("checkpoints", "show", str(location), "2")  # every partition: it says so
    assert result.exit_code == 2
    assert "subtask=00001" in result.output


def test_an_unknown_run_or_an_id_missing_from_a_run_says_which(checkpoints) -> None:
    location, _ = checkpoints
    result = invoke("checkpoints", "show", str(location), "2", "--run", "nope")
    assert result.exit_code == 2
    assert "Job job has no run 'nope'; its runs: run." in result.output
    store = SnapshotStore(location)
    log = store.subtask("job", "enrich", 1)
    log.commit(
        "run",
        3,
        [],
        [],
        input_schema=INPUT,
        output_schema=OUTPUT,
        position=8,
        parent=log.checkpoints()[-1].ref,
    )
    result = invoke("checkpoints", "show", str(location), "3", "--partition", "0")
    assert result.exit_code == 2
    assert "There is no checkpoint 3 of job job, partition 0" in result.output
    assert "Checkpoint ids that exist: 1-2." in result.output  # partition 0's, not 1's
    result = invoke("checkpoints", "show", str(location), "2", "--partition", "0", "--run", "r")
    assert result.exit_code == 2
    assert "Job job, partition 0, has no run 'r'; its runs: run." in result.output
    result = invoke("checkpoints", "show", str(location), "2", "--partition", "7")
    assert result.exit_code == 2
    assert "Job job has no partition 7; it has partitions 0-1." in result.output


@pytest.mark.parametrize("command", ["show", "replay"])
@pytest.mark.parametrize("given", [["-1"], ["0"], ["--", "-12"]])
def test_a_checkpoint_id_below_1_is_refused_saying_what_ids_are(
    checkpoints, functions, command, given
) -> None:
    # A negative id was taken by Click for an unknown option: "No such option: -1".
    location, _ = checkpoints
    args = ["checkpoints", "show"] if command == "show" else ["replay"]
    extra = ["--function", "replay_functions:greet"] if command == "replay" else []
    result = invoke(*args, str(location), *extra, *given)
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert f"A checkpoint id is a whole number from 1 up; got {int(given[-1])}." in said
    assert "`checkpoints list LOCATION` shows the ids there." in said
    assert "No such option" not in said
    # a negative number that is an option's value is that option's (and its own error)
    result = invoke("checkpoints", "show", str(location), "2", "--partition", "-1")
    assert result.exit_code == 2
    assert "Job job has no partition -1; it has partitions 0-1." in result.output


@pytest.mark.parametrize("command", [["checkpoints", "show"], ["replay"]])
@pytest.mark.parametrize("given", [["LOC", "-1", "--help"], ["--help", "LOC", "-3"]])
def test_help_asked_with_a_negative_checkpoint_id_is_the_help(command, given) -> None:
    # With --help the pre-scan stood aside, and Click took the id for an unknown option:
    # "No such option: -1" (where an id of 0, or 2, gave the help).
    help_text = invoke(*command, "LOC", "2", "--help")
    assert help_text.exit_code == 0
    assert "Usage:" in help_text.output
    result = invoke(*command, *given)
    assert result.exit_code == 0, result.output
    assert result.output == help_text.output


@pytest.mark.parametrize("command", [["checkpoints", "show"], ["replay"]])
def test_help_is_asked_by_the_name_typed_whatever_help_option_object_click_gives(
    command, monkeypatch
) -> None:
    # Click before 8.1.8 (which typer 0.16 may be paired with) makes a new help option at
    # every get_help_option() call: the pre-scan looked for the very object get_params()
    # had given, never found it, and refused the negative id though --help was given.
    from stateful_async.cli import _Command

    help_text = invoke(*command, "LOC", "2", "--help")
    assert help_text.exit_code == 0 and "Usage:" in help_text.output
    uncached = _Command.get_help_option

    def new_each_time(self, ctx):  # type: ignore[no-untyped-def]
        self._help_option = None
        return uncached(self, ctx)

    monkeypatch.setattr(_Command, "get_help_option", new_each_time)
    result = invoke(*command, "LOC", "-1", "--help")
    assert result.exit_code == 0, result.output
    assert result.output == help_text.output


def test_a_location_that_looks_like_a_negative_number_is_no_checkpoint_id(functions) -> None:
    # After --, Click takes a LOCATION named -1 (a relative directory); the pre-scan took
    # every negative number among the positional arguments for a checkpoint id.
    import asyncio

    asyncio.run(snapshot_mid_job(functions.parent / "-1"))  # in the working directory
    result = invoke("checkpoints", "show", "--format", "json", "--partition", "0", "--", "-1", "2")
    assert result.exit_code == 0, result.output
    assert [s["partition"] for s in json.loads(result.stdout)] == [0]
    result = invoke("replay", "--function", "replay_functions:greet", "--", "-1", "2")
    assert result.exit_code == 0, result.output
    result = invoke("checkpoints", "show", "--", "-1", "-2")  # the id's place is checked
    assert result.exit_code == 2
    assert "A checkpoint id is a whole number from 1 up; got -2." in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["checkpoints", "expire", "{}", "--retain", "-1"],
            "--retain must be 0 or more (the checkpoints to keep per partition); got -1.",
        ),
        (
            ["checkpoints", "expire", "{}", "--retain", "1", "--orphans-older-than", "-1"],
            "--orphans-older-than must be a number of hours from 0 up to 1,000,000; got -1.0.",
        ),
        (
            ["replay", "{}", "2", "--function", "replay_functions:greet", "--capacity", "0"],
            "--capacity must be 1 or more (the calls in flight at once); got 0.",
        ),
        (
            ["demo", "--capacity", "-3"],
            "--capacity must be 1 or more (the requests in flight per task); got -3.",
        ),
        (
            ["demo", "--partitions", "0"],
            "--partitions must be 1 or more (the Spark partitions, one task each); got 0.",
        ),
        (["demo", "--rows", "-5"], "--rows must be 100 or more (the records to enrich); got -5."),
    ],
)
def test_a_count_below_its_least_is_refused_saying_what_to_pass(
    checkpoints, functions, args, message
) -> None:
    # Click's message was "Invalid value for '--retain': Input should be greater than or
    # equal to 0", in a box under the usage line.
    location, _ = checkpoints
    result = invoke(*[str(location) if a == "{}" else a for a in args])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("Error: "), result.output
    assert message in " ".join(result.output.split()), result.output
    assert invoke("checkpoints", "show", str(location), "1").exit_code == 0  # nothing expired


def test_an_option_that_selects_one_thing_given_twice_is_refused(
    checkpoints, functions, tmp_path
) -> None:
    # Click kept the last: `--partition 0 --partition 1` showed partition 1 alone, and
    # `--output a.jsonl --output b.parquet` wrote b.parquet alone, without a word.
    location, _ = checkpoints
    result = invoke("checkpoints", "show", str(location), "2", "--partition", "0", "--partition=1")
    assert result.exit_code == 2, result.output
    assert (
        "--partition was given twice (0, 1), and it takes one partition: run the command once "
        "per partition, or leave --partition out for all of them."
    ) in " ".join(result.output.split())
    first, second = tmp_path / "a.jsonl", tmp_path / "b.parquet"
    calls = tmp_path / "calls"
    functions.write_text(
        functions.read_text()
        + f"\nasync def counted(row):\n    open({str(calls)!r}, 'a').write('x')\n"
        "    return [row]\n"
    )
    result = replay(
        location, "replay_functions:counted", "--output", str(first), "--output", str(second)
    )
    assert result.exit_code == 2, result.output
    assert (
        f"--output was given twice ({first}, {second}), and it takes one output file: replay "
        "again for another."
    ) in " ".join(result.output.split())
    assert not first.exists() and not second.exists() and not calls.exists()
    result = invoke("checkpoints", "expire", str(location), "--retain", "0", "--job", "job",
                    "--job", "other")  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "--job was given twice (job, other), and it takes one job" in result.output
    assert invoke("checkpoints", "show", str(location), "1").exit_code == 0  # nothing expired
    # the same value twice is no ambiguity; a setting that tunes (--format) keeps the last
    result = invoke(
        "checkpoints", "show", str(location), "2", "--partition", "0", "--partition", "0",
        "--format", "table", "--format", "json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert [s["partition"] for s in json.loads(result.stdout)] == [0]


def test_an_option_given_twice_with_one_value_written_two_ways_is_taken(
    checkpoints, functions
) -> None:
    # The check compared the text typed: --partition 0 --partition 00 (one partition) and
    # --output out.jsonl --output ./out.jsonl (one file) were refused as "given twice".
    location, _ = checkpoints
    result = invoke(
        "checkpoints", "show", str(location), "2", "--partition", "0", "--partition", "00",
        "--format", "json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert [s["partition"] for s in json.loads(result.stdout)] == [0]
    output = ["--output", "out.jsonl", "--output", "./out.jsonl"]  # in the cwd: functions'
    result = replay(location, "replay_functions:greet", *output)
    assert result.exit_code == 0, result.output
    assert (functions.parent / "out.jsonl").exists()


def test_a_storage_option_given_twice_with_different_values_is_refused(checkpoints) -> None:
    location, _ = checkpoints
    result = invoke(
        "checkpoints", "list", str(location), "-o", "AWS_SECRET_ACCESS_KEY=s3cr3t-1",
        "-oAWS_SECRET_ACCESS_KEY=s3cr3t-2",
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert (
        "--storage-option AWS_SECRET_ACCESS_KEY was given twice, with different values; give "
        "each key once."
    ) in " ".join(result.output.split())
    assert "s3cr3t" not in result.output  # values may be secrets
    same = ["-o", "AWS_REGION=eu-west-1", "-o", "AWS_REGION=eu-west-1"]
    assert invoke("checkpoints", "list", str(location), *same).exit_code == 0


def test_a_storage_option_on_a_local_location_is_said_to_be_unused(checkpoints) -> None:
    # -o settings with a local location (a mistyped URI, maybe) were dropped without a word.
    location, _ = checkpoints
    options = ["-o", "AWS_REGION=eu-west-1", "-o", "AWS_SECRET_ACCESS_KEY=s3cr3t"]
    for command in (["checkpoints", "list"], ["checkpoints", "show", "--format", "json"]):
        args = [*command[:2], str(location), *(["2"] if "show" in command else []), *command[2:]]
        result = invoke(*args, *options)
        assert result.exit_code == 0, result.output
        assert " ".join(result.stderr.split()) == (
            "Warning: the --storage-option (-o) settings AWS_REGION, AWS_SECRET_ACCESS_KEY "
            f"are not used: {location} is a local directory, and storage options are for "
            "object stores. Leave -o out, or give the location as the store's URI "
            "(s3://bucket/path, ...)."
        )
        assert "s3cr3t" not in result.output  # values may be secrets
    assert json.loads(result.stdout)[0]["checkpoint_id"] == 2  # stdout: the JSON alone
    assert invoke("checkpoints", "list", str(location)).stderr == ""  # no -o, no warning


def test_an_unknown_job_lists_the_jobs(checkpoints) -> None:
    location, _ = checkpoints
    for other in ("other", ""):  # an empty one (a script's unset variable) too: it listed all
        result = invoke("checkpoints", "list", str(location), "--job", other)
        assert result.exit_code == 2, result.output
        assert f"Job '{other}' has no checkpoints" in result.output
        assert "Jobs there: job" in result.output


def test_help_names_every_command() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("demo", "checkpoints", "replay"):
        assert command in result.output


def test_help_lists_each_command_by_its_summary_on_one_line() -> None:
    # Before, Typer's rich help kept the line breaks of a docstring wrapped in the source:
    # "...against the mock service (a child process)," then "with checkpoints; ..." below it.
    for group, summary in [
        (
            [],
            "Enrich a generated dataset on local Spark against the mock service (a child "
            "process), with checkpoints; crash one task mid-way, recover, and check the "
            "output is exactly once.",
        ),
        (
            ["checkpoints"],
            "Keep the newest N checkpoints of every partition; drop and vacuum the rest, and "
            "delete the files no checkpoint uses once older than --orphans-older-than.",
        ),
    ]:
        result = runner.invoke(app, [*group, "--help"], env={"COLUMNS": "300"})
        assert result.exit_code == 0, result.output
        assert summary in result.output


# -- demo (what is refused before Spark starts; the run itself is in tests/spark) ------------


@pytest.mark.parametrize("latency", ["0", "-5", "inf", "nan"])
def test_demo_refuses_a_latency_that_is_not_positive(latency) -> None:
    result = invoke("demo", "--latency-ms", latency)
    assert result.exit_code == 2, result.output
    assert f"--latency-ms must be a finite number of milliseconds > 0; got {float(latency)}" in (
        result.output
    )


def test_demo_refuses_a_workdir_it_cannot_create(tmp_path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for workdir in (a_file, a_file / "sub"):
        result = invoke("demo", "--workdir", str(workdir))
        assert result.exit_code == 2, result.output
        assert f"Cannot use {workdir} as the demo's --workdir" in " ".join(result.output.split())


def test_demo_without_java_says_so_before_starting_anything(tmp_path) -> None:
    # before: Spark's JAVA_GATEWAY_EXITED, the cause only in the demo's spark.log
    result = runner.invoke(
        app,
        ["demo", "--rows", "1000", "--workdir", str(tmp_path / "run")],
        env={"PATH": str(tmp_path), "JAVA_HOME": ""},
        terminal_width=200,
    )
    assert result.exit_code == 2, result.output
    assert "Spark needs Java (17, 21 or 25), and there is no java on the PATH" in result.output
    assert not (tmp_path / "run").exists()


def _no_mock_service(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The demo's mock service fails to start, so the demo stops before Spark."""
    from stateful_async.chaos import MockServiceError
    from stateful_async.chaos._process import MockService

    def no_service(self: MockService, timeout: float = 30.0) -> MockService:
        raise MockServiceError("The mock service did not start: no port in this test")

    monkeypatch.setattr(MockService, "start", no_service)
    monkeypatch.setenv("JAVA_HOME", str(tmp_path))  # (not used: Spark is never reached)


def test_a_demo_whose_service_does_not_start_leaves_no_workdir_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: the workdir stayed behind holding only log4j2.properties
    import tempfile

    _no_mock_service(monkeypatch, tmp_path)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    given = tmp_path / "given"
    given.mkdir()
    for workdir in ([], ["--workdir", str(tmp_path / "new")], ["--workdir", str(given)]):
        result = invoke("demo", "--rows", "1000", *workdir)
        assert result.exit_code == 2, result.output
        assert "The mock service did not start: no port in this test" in result.output
    assert list(temp.iterdir()) == []  # the default temporary workdir
    assert not (tmp_path / "new").exists()  # a --workdir the demo created
    assert given.is_dir() and list(given.iterdir()) == []  # one that existed: as it was


def test_a_demo_neither_overwrites_nor_deletes_a_log4j2_properties_it_did_not_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: a --workdir's own log4j2.properties was overwritten, and deleted when the
    # mock service did not start
    _no_mock_service(monkeypatch, tmp_path)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "log4j2.properties").write_text("rootLogger.level = info\n")
    result = invoke("demo", "--rows", "1000", "--workdir", str(theirs))
    assert result.exit_code == 2, result.output
    assert "holds a log4j2.properties that the demo did not write" in " ".join(
        result.output.split()
    )
    assert (theirs / "log4j2.properties").read_text() == "rootLogger.level = info\n"
    # the demo's own, left by a run whose Spark did not start, is taken and left as it was
    from stateful_async._demo import _LOG4J

    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "log4j2.properties").write_text(_LOG4J)
    result = invoke("demo", "--rows", "1000", "--workdir", str(ours))
    assert result.exit_code == 2, result.output
    assert "The mock service did not start: no port in this test" in result.output
    assert (ours / "log4j2.properties").read_text() == _LOG4J


def test_a_demo_workdir_the_checkpoints_cannot_use_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: refused by CheckpointConfig only once the service and Spark had started (~20 s)
    _no_mock_service(monkeypatch, tmp_path)  # and would say so
    workdir = tmp_path / "a%20b"
    result = invoke("demo", "--rows", "1000", "--workdir", str(workdir))
    assert result.exit_code == 2, result.output
    assert "holds '%20', which delta-rs decodes" in " ".join(result.output.split())
    assert not workdir.exists()
    # the default workdir, a temporary directory under such a path: not left behind
    import tempfile

    temp = tmp_path / "temp%41"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    result = invoke("demo", "--rows", "1000")
    assert result.exit_code == 2, result.output
    assert "holds '%41', which delta-rs decodes" in " ".join(result.output.split())
    assert list(temp.iterdir()) == []


def _demo_without_spark(monkeypatch: pytest.MonkeyPatch, save: Callable[[str], None]) -> None:
    """The demo's Spark part replaced: its job is ``save(output_path)``."""
    from types import SimpleNamespace

    import stateful_async.spark as spark_api

    class Writer:
        def format(self, name: str) -> Writer:
            return self

        def mode(self, name: str) -> Writer:
            return self

        def save(self, path: str) -> None:
            save(path)

    session = SimpleNamespace(
        sparkContext=SimpleNamespace(setLogLevel=lambda level: None),
        range=lambda *args, **kwargs: SimpleNamespace(selectExpr=lambda *columns: None),
        stop=lambda: None,
    )
    monkeypatch.setattr(spark_api, "local_session", lambda *args, **kwargs: session)
    monkeypatch.setattr(spark_api, "register_delta_sink", lambda spark: None)
    monkeypatch.setattr(spark_api, "EnrichmentMetrics", lambda spark: SimpleNamespace(value={}))
    enriched = SimpleNamespace(write=Writer())
    monkeypatch.setattr(spark_api, "ordered_wait", lambda *args, **kwargs: enriched)
    monkeypatch.setenv("JAVA_HOME", "/nowhere")  # (not used: no JVM starts)
    monkeypatch.delenv("STATEFUL_ASYNC_TASK_LOG", raising=False)


def test_a_demo_whose_spark_job_fails_says_where_spark_s_log_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: PySpark's error alone (an uncaught exception), no word of the log
    def fail(path: str) -> None:
        raise RuntimeError("Job aborted due to stage failure: Task 0 failed 3 times")

    _demo_without_spark(monkeypatch, fail)
    result = invoke("demo", "--rows", "1000", "--workdir", str(tmp_path / "run"))
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "RuntimeError: Job aborted due to stage failure: Task 0 failed 3 times" in (
        result.output
    )
    assert f"The Spark job failed (above); Spark's log: {tmp_path}/run/spark.log\n" in (
        result.output
    )
    assert (tmp_path / "run" / "spark.log").exists()
    # The demo turned the task log off in this process's environment for good: a cluster
    # started later in the process (the chaos suite's) had executors that logged nothing.
    assert "STATEFUL_ASYNC_TASK_LOG" not in os.environ


def _demo_writing_every_result_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's Spark job replaced by one writing each of 1,000 records' result once, into
    a location without checkpoints."""
    from deltalake import write_deltalake

    import checkpoint
    from stateful_async.chaos import expected_enrichment

    def write(path: str) -> None:  # every record's result, once
        answers = [expected_enrichment(str(i)) for i in range(1000)]
        rows = [
            {"id": i, "name": f"user{i}", "score": a["score"], "label": a["label"]}
            for i, a in enumerate(answers)
        ]
        write_deltalake(path, pa.Table.from_pylist(rows))

    _demo_without_spark(monkeypatch, write)
    no_checkpoints = type("Store", (), {"checkpoints": lambda self, *args, **kwargs: []})
    monkeypatch.setattr(checkpoint, "SnapshotStore", lambda location: no_checkpoints())


def test_a_demo_whose_service_cannot_be_queried_after_the_job_checks_the_output_still(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: the failed counts call ended the run with that error alone, no output check
    from stateful_async.chaos import MockServiceError
    from stateful_async.chaos._process import MockService

    def gone(self: MockService) -> dict[str, Any]:
        raise MockServiceError("The mock service at x does not answer GET /admin/counts")

    _demo_writing_every_result_once(monkeypatch)
    monkeypatch.setattr(MockService, "stats", gone)
    result = invoke("demo", "--rows", "1000", "--no-crash", "--workdir", str(tmp_path / "run"))
    output = " ".join(re.sub(r"[│┃┌┐└┘├┤─━┬┴┼┏┓┗┛]", " ", result.output).split())
    assert "held: every record's result exactly once (1,000 rows in the Delta table)" in output
    assert "requests unknown: the mock service could not be queried after the job" in output
    assert (
        "FAILED: the re-request bound was not checked: the mock service could not be queried "
        "for its request counts after the job (The mock service at x does not answer GET "
        "/admin/counts)" in output
    )
    assert result.exit_code == 1, result.output


def test_the_demo_s_command_to_look_inside_is_quoted_for_the_shell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: a --workdir with a space gave "checkpoints list /x/a run/checkpoints", which a
    # shell takes as two locations
    _demo_writing_every_result_once(monkeypatch)
    result = invoke("demo", "--rows", "1000", "--no-crash", "--workdir", str(tmp_path / "a run"))
    assert result.exit_code == 0, result.output
    assert f" checkpoints list '{tmp_path}/a run/checkpoints'\n" in result.output
    # and the program, where it is named by its path
    from stateful_async.cli import _this_program

    python = tmp_path / "my env" / "python"  # no stateful-async script beside it
    monkeypatch.setattr("sys.executable", str(python))
    assert _this_program() == f"'{python}' -m stateful_async.cli"
    (python.parent).mkdir()
    (python.parent / "stateful-async").touch()
    assert _this_program() == f"'{python.parent}/stateful-async'"


def test_a_sigterm_during_the_demo_unwinds_it_like_ctrl_c() -> None:
    # so that the demo's `with` blocks stop the mock service and Spark (a SIGTERM ended the
    # process on the spot, and the service lived on)
    import os
    import signal

    from stateful_async._signals import sigterm_unwinds

    before = signal.getsignal(signal.SIGTERM)
    interrupted: list[int] = []

    def on_interrupt(signum: int, frame: Any) -> None:  # as PySpark's: cancel, then raise
        interrupted.append(signum)
        raise KeyboardInterrupt

    on_sigint = signal.signal(signal.SIGINT, on_interrupt)
    try:
        with pytest.raises(SystemExit) as info, sigterm_unwinds():
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0.5)  # let the handler run (it runs between bytecodes)
    finally:
        signal.signal(signal.SIGINT, on_sigint)
    assert info.value.code == 128 + signal.SIGTERM
    assert interrupted == [signal.SIGINT]  # what Ctrl-C does came first (Spark's jobs cancelled)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_sigterm_does_not_stop_the_clean_up_of_the_first() -> None:
    # before: it raised SystemExit again, in the middle of the finally blocks the first one
    # ran (a group's SIGTERM, then the parent's own, as run_all sends to its benchmarks)
    import os
    import signal

    from stateful_async._signals import sigterm_unwinds

    before = signal.getsignal(signal.SIGTERM)
    cleaned = []
    with pytest.raises(SystemExit), sigterm_unwinds():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0.5)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0.5)
            cleaned.append(True)
    assert cleaned == [True]
    assert signal.getsignal(signal.SIGTERM) is before


def test_demo_refuses_partitions_too_small_to_crash_one() -> None:
    result = invoke("demo", "--rows", "150", "--partitions", "2")
    assert result.exit_code == 2, result.output
    assert "150 records in 2 partitions: give every partition at least 100 records" in " ".join(
        result.output.split()
    )
    # as the help says (it said "100 or more", which 150 is)
    shown = " ".join(re.sub("[│╭╮╰╯─]", " ", invoke("demo", "--help").output).split())
    assert "--rows <int> Records to enrich (100 or more per partition)." in shown


def test_demo_fails_when_the_crash_did_not_happen_or_repeats_pass_the_bound() -> None:
    from stateful_async._demo import DemoResult, DemoSettings

    def result(**changes: Any) -> DemoResult:
        fields: dict[str, Any] = dict(
            settings=DemoSettings(rows=1000, capacity=10),
            workdir="w",
            output_path="o",
            checkpoint_location="c",
            spark_log="l",
            seconds=1.0,
            output_rows=1000,
            missing=0,
            duplicated=0,
            wrong=0,
            checkpoints=10,
            requests=1010,
            re_requested=10,
            crash_record=300,
            crash_partition=0,
            recovered_from="checkpoint 2",
            retried_attempts=1,
        )
        return DemoResult(**{**fields, **changes})

    assert result().failures == []
    assert result(retried_attempts=0).failures == [
        "the injected crash left no retried attempt in the checkpoints"
    ]
    bound = 10 + 100  # capacity + interval
    assert result(re_requested=bound).failures == []
    assert result(re_requested=bound + 1).failures == [
        f"{bound + 1} records re-requested, above the bound {bound}"
    ]
    assert result(missing=1).failures == ["exactly-once: 1 missing, 0 duplicated, 0 wrong"]
    assert result(crash_record=None, retried_attempts=0).failures == []
