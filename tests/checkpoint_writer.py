"""A checkpoint-writing process for the crash, concurrency and race tests.

    python checkpoint_writer.py loop  LOCATION SUBTASK RUN ELEMENTS   # commit until killed
    python checkpoint_writer.py batch LOCATION SUBTASK RUN COUNT ELEMENTS
    python checkpoint_writer.py race  LOCATION RUN ID GO_FILE
    python checkpoint_writer.py read  LOCATION RUN                     # restore, then exit

Prints one line per step, flushed: "begin <id>" before a commit, "committed <id>" after
(and, in loop mode, "writing <id>" once its rows are built, before the Delta write).
Not a test module (pytest only collects test_*.py).
"""

from __future__ import annotations

import os
import sys
import time

import pyarrow as pa

from checkpoint import CheckpointConflictError, SnapshotStore, _faults
from stateful_async import StreamRecord, Watermark

INPUT = pa.schema([("id", pa.int64()), ("payload", pa.string()), ("tags", pa.list_(pa.string()))])
OUTPUT = pa.schema([("id", pa.int64()), ("score", pa.float64())])
JOB, OPERATOR = "job", "enrich"


def elements(checkpoint_id: int, count: int) -> list:
    items: list = []
    for i in range(count):
        items.append(
            StreamRecord({"id": i, "payload": f"c{checkpoint_id}-{i}" * 3, "tags": ["a", "b"]}, i)
        )
        if i % 100 == 99:
            items.append(Watermark(i))
    return items


def results(checkpoint_id: int, count: int) -> pa.Table:
    return pa.table(
        {"id": pa.array(range(count), pa.int64()), "score": pa.array([checkpoint_id + 0.5] * count)}
    )


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def commit_next(log, run: str, count: int, parent) -> object:
    checkpoint_id = 1 if parent is None else parent.checkpoint_id + 1
    say(f"begin {checkpoint_id}")
    meta = log.commit(
        run,
        checkpoint_id,
        elements(checkpoint_id, count),
        results(checkpoint_id, count // 4),
        input_schema=INPUT,
        output_schema=OUTPUT,
        position=checkpoint_id * count,
        fingerprint=f"{checkpoint_id}",
        parent=parent,
    )
    say(f"committed {checkpoint_id}")
    return meta.ref


def main(argv: list[str]) -> None:
    mode, location = argv[0], argv[1]
    store = SnapshotStore(location)
    if mode == "loop":
        # "writing <id>": the checkpoint's rows are built; its Delta write and commit follow
        _faults.install(
            lambda point, context: (
                say(f"writing {context['meta'].checkpoint_id}")
                if point == "before_delta_commit"
                else None
            )
        )
        subtask, run, count = int(argv[2]), argv[3], int(argv[4])
        log = store.subtask(JOB, OPERATOR, subtask)
        latest = log.latest(run_id=run)
        parent = latest.ref if latest else None
        while True:
            parent = commit_next(log, run, count, parent)
    elif mode == "batch":
        subtask, run, total, count = int(argv[2]), argv[3], int(argv[4]), int(argv[5])
        log = store.subtask(JOB, OPERATOR, subtask)
        parent = None
        for _ in range(total):
            parent = commit_next(log, run, count, parent)
    elif mode == "race":
        run, checkpoint_id, go_file = argv[2], int(argv[3]), argv[4]
        log = store.subtask(JOB, OPERATOR, 0)
        log.checkpoints()  # load the table now, so both racers start from the same snapshot
        say("ready")
        give_up = time.monotonic() + 120  # the test failed before saying go
        while not os.path.exists(go_file):
            if time.monotonic() > give_up:
                raise SystemExit("no go file within 120 s")
            time.sleep(0.001)
        try:
            log.commit(
                run,
                checkpoint_id,
                elements(checkpoint_id, 50),
                None,
                input_schema=INPUT,
                output_schema=OUTPUT,
                position=1,
            )
            say("landed")
        except CheckpointConflictError as exc:
            say(f"refused {exc}")
    elif mode == "read":
        restored = store.subtask(JOB, OPERATOR, 0).restore(2, run_id=argv[2])
        say(f"restored {len(restored.elements)} {store.read_job(JOB).num_rows}")
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
