"""The code stays lint-clean and type-checked (our style: type hints everywhere, mypy clean)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_ruff_finds_nothing() -> None:
    paths = [
        p
        for p in ("stateful_async", "checkpoint", "tests", "integration", "benchmarks")
        if (ROOT / p).exists()
    ]
    result = _run("ruff", "check", *paths)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean() -> None:
    result = _run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_wheel_marks_its_packages_typed(tmp_path: Path) -> None:
    # Without PEP 561's py.typed an installed copy is "missing library stubs" to users'
    # type checkers, and every hint above is lost on them.
    import shutil
    import zipfile

    source = tmp_path / "source"  # a copy: pip builds in the tree it is given, and keeps build/
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__")
    )
    result = _run("pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(source))
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = tmp_path.glob("stateful_async-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"stateful_async/py.typed", "checkpoint/py.typed"} <= names
