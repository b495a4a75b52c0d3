"""The code in README.md and docs/delta_sink.md, run as written: only the service URL and
the paths are replaced, and the names an example says are yours are given. The code that
cannot run here (docs/chaos.md's, which needs a cluster and your driver program), the
signatures the docs quote, the sink's options table and the commands the docs show are
checked against the code: the names they import and call, the parameters and defaults,
and the options each command takes."""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
import shlex
import subprocess
import sys
from datetime import timedelta
from importlib import import_module
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from checkpoint import delta_dataset
from stateful_async.chaos import MockService, ServiceConfig, expected_enrichment

ROOT = Path(__file__).resolve().parents[2]


def python_blocks(doc: str, count: int) -> list[str]:
    """The ```python blocks of ``doc`` (relative to the repository), which must be ``count``."""
    return code_blocks(doc, "python", count)


def code_blocks(doc: str, language: str, count: int | None = None) -> list[str]:
    """The ```language blocks of ``doc``; with ``count``, there must be that many."""
    text = (ROOT / doc).read_text()
    blocks = re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)
    if count is not None:
        assert len(blocks) == count, (
            f"{doc} has {len(blocks)} {language} blocks; this test knows {count}"
        )
    return blocks


def substitute(code: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        assert old in code, f"the example no longer contains {old!r}"
        code = code.replace(old, new)
    return code


def ids(path: Path) -> list[int]:
    rows = delta_dataset(DeltaTable(str(path))).to_table(columns=["id"]).to_pylist()
    return sorted(row["id"] for row in rows)


@pytest.mark.spark
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


@pytest.mark.spark
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


def documented_signature(block: str, namespace: dict[str, Any]) -> tuple[str, inspect.Signature]:
    """The name and signature a doc quotes as ``[obj.]name(params) -> result``."""
    match = re.match(r"\s*(?:\w+\.)?(\w+)\((.*)\)\s*(?:#\s*)?->", block, flags=re.DOTALL)
    assert match, f"not a quoted signature: {block!r}"
    name, params = match.groups()
    exec(f"def {name}({params}): pass", namespace)
    return name, inspect.signature(namespace[name])


def plain(signature: inspect.Signature) -> list[tuple[str, Any, Any]]:
    """Parameter names, kinds and defaults (no annotations, no ``self``)."""
    return [(p.name, p.kind, p.default) for p in signature.parameters.values() if p.name != "self"]


@pytest.mark.parametrize(
    ("doc", "index", "count", "target"),
    [
        ("docs/checkpointing.md", 0, 1, "checkpoint:SubtaskLog.commit"),
        ("docs/delta_sink.md", 2, 3, "stateful_async.spark:clean_orphan_files"),
    ],
)
def test_the_quoted_signatures_are_the_code_s(
    doc: str, index: int, count: int, target: str
) -> None:
    module, _, attribute = target.partition(":")
    actual: Any = import_module(module)
    for part in attribute.split("."):
        actual = getattr(actual, part)
    name, quoted = documented_signature(python_blocks(doc, count)[index], {"timedelta": timedelta})
    assert name == actual.__name__
    assert plain(quoted) == plain(inspect.signature(actual)), f"{doc} quotes {name} otherwise"


def test_the_sink_options_table_names_every_option_and_its_default() -> None:
    from stateful_async.spark._sink_options import _OPTION_NAMES, SinkOptions

    text = (ROOT / "docs/delta_sink.md").read_text()
    section = text.split("## Options", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    documented = {}
    for row in rows:
        name_cell, meaning = row.strip("|").split(" | ", 1)
        for name in re.findall(r"`([^`]+)`", name_cell):
            documented[name] = meaning
    assert set(documented) == {*_OPTION_NAMES.values(), "path", "storage.<key>"}

    defaults = SinkOptions.parse({"path": "/tmp/table"}, streaming=False)
    attributes = {
        "mergeSchema": "merge_schema",
        "cleanOrphans": "clean_orphans",
        "orphanRetentionSeconds": "orphan_retention_seconds",
        "maxRecordsPerFile": "max_records_per_file",
        "compression": "compression",
        "maxCommitRetries": "max_commit_retries",
    }
    for name, attribute in attributes.items():
        said = re.search(r"[Dd]efault `([^`]+)`|`([^`]+)` \(default\)", documented[name])
        assert said, f"docs/delta_sink.md gives no default of {name}"
        value = getattr(defaults, attribute)
        text_default = said.group(1) or said.group(2)
        if isinstance(value, bool):
            assert text_default == str(value).lower(), name
        elif isinstance(value, (int, float)):
            assert float(text_default) == value, name
        else:
            assert text_default == value, name


def imported_names(tree: ast.AST) -> dict[str, Any]:
    """What the block's ``from ... import ...`` statements bind, each imported for real."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = import_module(node.module or "")
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
                names[alias.asname or alias.name] = getattr(module, alias.name)
    return names


def check_calls(code: str, where: str) -> int:
    """Bind every call of an imported name, and of a method of an object made by one (``x =
    Cls(...)``, ``with Cls(...) as x``), to the code's signature; return how many."""
    tree = ast.parse(code)
    names = imported_names(tree)
    made: dict[str, Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            made_by = node.value.func
            if isinstance(made_by, ast.Name) and isinstance(names.get(made_by.id), type):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        made[target.id] = names[made_by.id]
        if isinstance(node, ast.withitem) and isinstance(node.context_expr, ast.Call):
            made_by = node.context_expr.func
            if isinstance(made_by, ast.Name) and isinstance(node.optional_vars, ast.Name):
                if isinstance(names.get(made_by.id), type):
                    made[node.optional_vars.id] = names[made_by.id]
    checked = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func, args = node.func, list(node.args)
        if isinstance(func, ast.Name) and func.id in names:
            target, label = names[func.id], func.id
        elif isinstance(func, ast.Attribute) and getattr(func.value, "id", None) in made:
            owner = made[func.value.id]  # type: ignore[attr-defined]
            assert hasattr(owner, func.attr), f"{where}: {owner.__name__} has no {func.attr}"
            target, label = getattr(owner, func.attr), f"{owner.__name__}.{func.attr}"
            if inspect.isfunction(target):  # a method, called on an object: its self
                args.insert(0, func.value)
        else:
            continue
        try:
            inspect.signature(target).bind(*args, **{k.arg: None for k in node.keywords if k.arg})
        except TypeError as exc:
            raise AssertionError(
                f"{where}: {ast.unparse(node)} does not fit {label}: {exc}"
            ) from None
        checked += 1
    return checked


def test_the_chaos_examples_call_what_the_code_has() -> None:
    # They need a cluster and your own driver program, so they are not run: every name they
    # import exists, and every call of it (and of its objects' methods) fits its signature.
    template, local_cluster = python_blocks("docs/chaos.md", 2)
    assert check_calls(template, "docs/chaos.md template") >= 12
    assert check_calls(local_cluster, "docs/chaos.md local cluster") == 2


def documented_commands(doc: str) -> list[list[str]]:
    """The commands of ``doc``'s ```bash blocks, continuation lines joined, comments cut."""
    commands = []
    for block in code_blocks(doc, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def help_text(program: list[str]) -> str:
    done = subprocess.run(
        [*program, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("doc", ["docs/chaos.md", "docs/delta_sink.md", "docs/benchmarks.md"])
def test_the_commands_the_docs_show_take_the_options_they_give(doc: str) -> None:
    from stateful_async.chaos._job import parse_args

    checked = 0
    for words in documented_commands(doc):
        if words[:3] == ["python", "-m", "stateful_async.chaos.job"]:
            # the master is what `cluster start` prints; the rest must pass the job's checks
            argv = [w if not w.startswith("$(") else "spark://127.0.0.1:7077" for w in words[3:]]
            parse_args(argv)
            checked += 1
            continue
        if words[:3] == ["python", "-m", "stateful_async.chaos.cluster"] and len(words) > 3:
            program = [sys.executable, "-m", words[2], words[3]]
        elif words[:2] == ["python", "-m"]:
            program = [sys.executable, "-m", words[2]]
        elif words[0].endswith("python") and words[1].startswith("benchmarks/"):
            program = [sys.executable, words[1]]
        elif words[:2] == ["./dev", "bench"]:
            program = [sys.executable, "benchmarks/run_all.py"]
        else:
            continue
        text = help_text(program)
        for option in re.findall(r"(?<![\w-])--[a-z][\w-]*", " ".join(words)):  # [--x] too
            assert re.search(rf"{re.escape(option)}(?![\w-])", text), f"{doc}: {' '.join(words)}"
        checked += 1
    assert checked, f"{doc} shows no command this test knows"


def test_the_readme_command_table_gives_options_the_cli_takes() -> None:
    import typer.main

    from stateful_async.cli import app

    root = typer.main.get_command(app)
    table = (ROOT / "README.md").read_text().split("## Command line", 1)[1].split("\n\n")[1]
    rows = re.findall(r"^\| `stateful-async ([^`]+)` \|", table, flags=re.MULTILINE)
    assert len(rows) == 5
    for row in rows:
        words = row.replace("\\|", "|").split()
        command: Any = root
        while words and getattr(command, "commands", None) and words[0] in command.commands:
            command = command.commands[words.pop(0)]
        assert not getattr(command, "commands", None), f"README names no command: {row}"
        options = {opt for param in command.params for opt in [*param.opts, *param.secondary_opts]}
        for option in re.findall(r"(--?[a-z][a-z-]*)", " ".join(words)):
            assert option in options, f"README: stateful-async {row}: {option} is not an option"
