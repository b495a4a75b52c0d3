"""Structured Streaming: a file source through ordered_wait into the exactly-once Delta
sink; the query is stopped in the middle of a micro-batch and restarted from its
checkpoint location."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

import pytest
from deltalake import DeltaTable

from checkpoint import SnapshotStore, delta_dataset
from stateful_async.chaos import MockService, ServiceConfig, ServiceEnrichment, expected_enrichment
from stateful_async.spark import CheckpointConfig, ordered_wait, register_delta_sink

pytestmark = pytest.mark.spark

SCHEMA = "id long, name string, score double, label string"
FILES, ROWS_PER_FILE, CAPACITY, INTERVAL = 4, 600, 10, 100


def reference(i: int) -> tuple:
    answer = expected_enrichment(str(i))
    return (i, f"user{i}", answer["score"], answer["label"])


def test_a_query_stopped_mid_batch_resumes_and_writes_every_result_once(spark, tmp_path) -> None:
    register_delta_sink(spark)
    source = tmp_path / "in"
    source.mkdir()
    for f in range(FILES):
        with open(source / f"part-{f}.json", "w") as handle:
            for i in range(f * ROWS_PER_FILE, (f + 1) * ROWS_PER_FILE):
                handle.write(json.dumps({"id": i, "name": f"user{i}"}) + "\n")
    table, stream_ckpt, snapshots = tmp_path / "out", tmp_path / "stream", tmp_path / "snapshots"

    with MockService(ServiceConfig(latency_ms=10)) as service:

        def start():  # type: ignore[no-untyped-def]
            df = (
                spark.readStream.schema("id long, name string")
                .option("maxFilesPerTrigger", 1)
                .json(str(source))
            )
            enriched = ordered_wait(
                df,
                ServiceEnrichment(service.url),
                SCHEMA,
                capacity=CAPACITY,
                timeout=30.0,
                checkpoint=CheckpointConfig(
                    str(snapshots), "stream", interval_records=INTERVAL, retain=100
                ),
            )
            return (
                enriched.writeStream.format("delta_rs")
                .option("checkpointLocation", str(stream_ckpt))
                .start(str(table))
            )

        query = start()
        store = SnapshotStore(snapshots)
        deadline = time.monotonic() + 180
        interrupted_run = None
        while time.monotonic() < deadline and interrupted_run is None:
            if (snapshots / "stream").exists():
                metas = store.checkpoints("stream")
                finished = {m.run_id for m in metas if m.final}
                started = [m for m in metas if m.run_id not in finished and m.checkpoint_id >= 2]
                if finished and started:  # one batch done, the next one half way
                    interrupted_run = started[0].run_id
            time.sleep(0.05)
        assert interrupted_run is not None, "the query never reached its second batch"
        query.stop()  # mid-batch: the running batch is cancelled and not committed
        stopped_at = datetime.now(timezone.utc)
        written_before = delta_dataset(DeltaTable(str(table))).to_table().num_rows
        assert 0 < written_before < FILES * ROWS_PER_FILE
        before = service.counts()

        query = start()  # same checkpoint location: the interrupted batch runs again
        query.processAllAvailable()
        query.stop()

        rows = delta_dataset(DeltaTable(str(table))).to_table().to_pylist()
        got = sorted((r["id"], r["name"], r["score"], r["label"]) for r in rows)
        assert got == [reference(i) for i in range(FILES * ROWS_PER_FILE)]  # each exactly once

        # The re-run batch resumed from the interrupted attempt's checkpoints: its requests
        # repeated only what was in flight at the restored checkpoint or read after it.
        after = service.counts()
        repeated = [k for k in after if after[k] > 1]
        assert all(after[k] <= 2 for k in after)
        assert len(repeated) <= CAPACITY + INTERVAL
        assert before  # the interrupted attempt had made requests
        finals = [m for m in store.checkpoints("stream") if m.run_id == interrupted_run and m.final]
        assert len(finals) == 1
        chain = store.subtask("stream", "enrich", finals[0].subtask).chain(finals[0])
        assert any(m.created_at < stopped_at for m in chain[:-1])  # resumed, not restarted
        assert chain[-1].created_at > stopped_at
        assert [m.checkpoint_id for m in chain] == list(range(1, len(chain) + 1))
