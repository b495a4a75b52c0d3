"""This process's peak resident set size, for the benchmarks that measure memory in a child
process of their own.

Not ``resource.getrusage(RUSAGE_SELF).ru_maxrss``: Linux carries the peak of the memory a
process had before it called ``exec`` into it, and Python starts children with ``vfork``,
whose pre-``exec`` memory is the parent's. A child started by a 500 MiB parent reports a
``ru_maxrss`` of 500 MiB whatever it uses itself (measured here: 511 MiB against its own
11 MiB). ``VmHWM`` in ``/proc/self/status`` is the peak of this process's own memory since
its ``exec``.
"""

from __future__ import annotations

import resource


def peak_rss_mib() -> float:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: KiB on most
