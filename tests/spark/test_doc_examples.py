"""The code in README.md and docs/delta_sink.md, run as written: only the service URL and
the paths are replaced, and the names an example says are yours are given."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from checkpoint import delta_dataset
from stateful_async.chaos import MockService, ServiceConfig, expected_enrichment

pytestmark = pytest.mark.spark

ROOT = Path(__file__).resolve().parents[2]


def python_blocks(doc: str, count: int) -> list[str]:
    """The ```python blocks of ``doc`` (relative to the repository), which must be ``count``."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), flags=re.DOTALL)
    assert len(blocks) == count, f"{doc} has {len(blocks)} python blocks; this test knows {count}"
    return blocks


def substitute(code: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        assert old in code, f"the example no longer contains {old!r}"
        code = code.replace(old, new)
    return code


def ids(path: Path) -> list[int]:
    rows = delta_dataset(DeltaTable(str(path))).to_table(columns=["id"]).to_pylist()
    return sorted(row["id"] for row in rows)


def test_the_quickstart_runs_then_resumes_from_its_checkpoints(spark: Any, tmp_path: Path) -> None:
    users = [{"id": i, "name": f"user-{i}"} for i in range(300)]
    spark.createDataFrame(users, "id long, name string").repartition(2).write.parquet(
        str(tmp_path / "users")
    )
    expected = []
    for user in users:
        answer = expected_enrichment(str(user["id"]))
        expected.append({**user, "score": answer["score"], "label": answer["label"]})
    paths = {
        '"/data/users"': repr(str(tmp_path / "users")),
        '"/data/checkpoints"': repr(str(tmp_path / "checkpoints")),
    }
    with MockService(ServiceConfig(latency_ms=1)) as service:
        paths["http://127.0.0.1:8099"] = service.url
        first = substitute(
            python_blocks("README.md", 2)[0],
            {**paths, '"/data/users_scored"': repr(str(tmp_path / "first"))},
        )
        exec(compile(first, "README.md quickstart", "exec"), {})
        assert service.counts() == {str(user["id"]): 1 for user in users}

        # The README's advice after a driver crash: the same job with restore_from="latest".
        again = substitute(
            first,
            {
                "interval_records=10_000)": 'interval_records=10_000, restore_from="latest")',
                repr(str(tmp_path / "first")): repr(str(tmp_path / "again")),
            },
        )
        exec(compile(again, "README.md quickstart, resumed", "exec"), {})
        assert service.counts() == {str(user["id"]): 1 for user in users}, (
            "the resumed run called the service for results its checkpoints hold"
        )
        # A driver that died after its write had committed: the same re-run into the same
        # table adds nothing (the write's app transaction), where a plain append doubled it.
        rewrite = substitute(again, {repr(str(tmp_path / "again")): repr(str(tmp_path / "first"))})
        exec(compile(rewrite, "README.md quickstart, resumed after its write", "exec"), {})
        assert DeltaTable(str(tmp_path / "first")).version() == 0

    for output in ("first", "again"):
        written = delta_dataset(DeltaTable(str(tmp_path / output))).to_table().to_pylist()
        assert sorted(written, key=lambda r: r["id"]) == expected, output


def test_the_operator_example_runs_without_spark() -> None:
    namespace: dict[str, Any] = {}
    exec(compile(python_blocks("README.md", 2)[1], "README.md operator example", "exec"), namespace)

    async def lookup(row: int) -> list[int]:
        await asyncio.sleep(0.001 * (row % 7))  # later rows often finish first
        return [row * 10]

    rows = list(range(250))
    assert asyncio.run(namespace["run"](rows, lookup)) == [row * 10 for row in rows]


def test_the_sink_examples_write_each_row_once(spark: Any, tmp_path: Path) -> None:
    first, each_batch, _signature = python_blocks("docs/delta_sink.md", 3)
    source = tmp_path / "source"
    spark.range(5, 10).write.json(str(source))
    events = spark.readStream.schema("id long").json(str(source))
    namespace: dict[str, Any] = {"spark": spark, "enriched": spark.range(5), "events": events}
    table = tmp_path / "enriched"
    code = substitute(
        first,
        {
            '"/data/enriched"': repr(str(table)),
            '"/chk/enriched"': repr(str(tmp_path / "chk")),
            "(events.writeStream": "query = (events.writeStream",
        },
    )
    exec(compile(code, "delta_sink.md example", "exec"), namespace)
    namespace["query"].processAllAvailable()
    namespace["query"].stop()
    assert ids(table) == list(range(10))  # the batch write's rows, then the stream's
    assert DeltaTable(str(table)).version() == 1  # one commit each

    # foreachBatch's function, called as Spark calls it: the batch id is the txnVersion, so
    # a micro-batch run again adds nothing, and the next one adds its rows
    code = substitute(each_batch, {'"/data/enriched"': repr(str(tmp_path / "per_batch"))})
    exec(compile(code, "delta_sink.md foreachBatch example", "exec"), namespace)
    namespace["each_batch"](spark.range(3), 0)
    namespace["each_batch"](spark.range(3), 0)  # Spark re-running micro-batch 0
    namespace["each_batch"](spark.range(3, 5), 1)
    assert ids(tmp_path / "per_batch") == list(range(5))
