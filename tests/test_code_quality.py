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
