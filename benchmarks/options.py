"""Command-line values the benchmark scripts share, checked by argparse before anything
runs: a bad one is refused at once (exit 2, the option named) rather than partway through
a run of many minutes, or taken for the default (``--rows 0``)."""

from __future__ import annotations

import argparse
import os


def positive_int(text: str) -> int:
    """A count (rows, capacity, partitions): an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"an integer >= 1 is needed; got {text!r}")
    return value


def output_file(text: str) -> str:
    """Where a script writes its figures at the end of its run: a file in an existing,
    writable directory, so that the figures of a long run are not lost to a typo."""
    directory = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name")
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(
            f"the directory of {text!r} does not exist; create it first"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"the directory of {text!r} is not writable")
    return text
