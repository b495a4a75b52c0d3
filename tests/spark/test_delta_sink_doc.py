"""docs/delta_sink.md's code, run as written: only the paths are replaced, and the names
its first example says are yours (spark, enriched, events) are given."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from checkpoint import delta_dataset

pytestmark = pytest.mark.spark

DOC = Path(__file__).resolve().parents[2] / "docs" / "delta_sink.md"


def python_blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    assert len(blocks) == 3, f"delta_sink.md has {len(blocks)} python blocks; this test knows 3"
    return blocks


def substitute(code: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        assert old in code, f"the example no longer contains {old!r}"
        code = code.replace(old, new)
    return code


def ids(path: Path) -> list[int]:
    rows = delta_dataset(DeltaTable(str(path))).to_table(columns=["id"]).to_pylist()
    return sorted(row["id"] for row in rows)


def test_the_sink_examples_write_each_row_once(spark: Any, tmp_path: Path) -> None:
    first, each_batch, _signature = python_blocks()
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
