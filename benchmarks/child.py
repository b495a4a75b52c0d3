"""Runs one of a benchmark script's child processes (a memory, CPU or committer figure
measured in a process of its own) and returns what it printed."""

from __future__ import annotations

import subprocess
import sys


def child_output(args: list[str]) -> str:
    """The standard output of ``python *args``. A child that fails raises with the end of
    its standard error, its traceback: ``CalledProcessError`` names only the command and
    the exit status, so a benchmark's report said a part failed and never why."""
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-3:] or ["no output on standard error"]
        raise RuntimeError(
            f"the child {' '.join(args[:2])} failed (exit {done.returncode}): " + " | ".join(tail)
        )
    return done.stdout
