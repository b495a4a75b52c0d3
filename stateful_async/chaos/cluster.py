"""Command line of the local Spark standalone cluster (``LocalCluster``)::

    python -m stateful_async.chaos.cluster start [--workers 2] [--dir DIR]
    python -m stateful_async.chaos.cluster status [--dir DIR]
    python -m stateful_async.chaos.cluster kill-executor [--app APP_ID] [--worker N] [--dir DIR]
    python -m stateful_async.chaos.cluster kill-worker N [--dir DIR]
    python -m stateful_async.chaos.cluster start-worker N [--dir DIR]
    python -m stateful_async.chaos.cluster stop [--wait SECONDS] [--dir DIR]

``start`` launches a master and workers on free 127.0.0.1 ports, waits until they are
alive, prints the master URL and returns; the daemons keep running. Their pids, ports and
logs live in DIR (default: ``<tmp>/stateful-async-cluster-<uid>``; ``--dir`` may also come
before the command), where the other commands find them; a second ``start`` in the same
DIR is refused, also while the first is still starting, and so is a ``start-worker``
while another ``start`` or ``start-worker`` runs there. ``stop`` ends exactly the
processes the cluster started, by pid; it first waits for a ``start`` or ``start-worker``
running in DIR to be done (up to ``--wait`` seconds, 0 or more; by default until 15 s,
what the start's own clean-up may take, after the time it gives up by, by its
``--timeout``, which it writes in DIR/cluster.lock; for a start of a version that does
not, the cluster's ``--timeout`` as DIR/cluster.json records it, else 180 s, plus 15 s),
then stops what it started. Still starting after that: an error, and nothing is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from ._cluster import (
    ClusterError,
    LocalCluster,
    check_cores,
    check_memory,
    check_timeout,
    check_wait,
    check_workers,
)


def default_dir() -> Path:
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"stateful-async-cluster-{uid}"


_STOP_MARGIN = 15.0  # the stop a failed start makes takes this long (its timeout)


def _waiting(base_dir: Path, pid: str, doing: str) -> None:
    print(
        f"waiting for the {doing} running in {base_dir} (pid {pid}) to be done...", file=sys.stderr
    )


def _stop(base_dir: Path, wait: float | None) -> list[int]:
    """Wait for a start running in ``base_dir`` to be done (it may not have recorded its
    cluster yet), then stop what cluster.json records, holding the directory's lock all
    along, so that no other start begins meanwhile: one wait in all. ``ClusterError`` if
    a start still holds the lock after ``wait`` seconds (None: 15 s after the time the
    start gives up by, by its --timeout; if it names none, as ``stop()`` does, the
    cluster's startup_timeout as cluster.json records it, else 180 s, plus 15 s)."""
    if not base_dir.is_dir():  # no start to wait for: attach() says there is no cluster
        return LocalCluster.attach(base_dir).stop(wait=wait)
    try:
        probe = LocalCluster.attach(base_dir)
    except ClusterError:  # none recorded yet (or refused: attach says why after the wait)
        probe = LocalCluster(base_dir=base_dir, stop_at_exit=False)
    lock = probe._lock_stop(wait, _STOP_MARGIN, lambda pid, doing: _waiting(base_dir, pid, doing))
    try:
        return LocalCluster.attach(base_dir)._stop_holding(lock)
    finally:
        lock.close()


def _status(cluster: LocalCluster) -> dict[str, object]:
    status: dict[str, object] = {
        "master_url": cluster.master_url,
        "webui_url": cluster.webui_url,
        "master_pid": cluster.master.pid if cluster.master else None,
        "master_alive": bool(cluster.master and cluster.master.alive()),
        "workers": {
            str(i): {"pid": w.pid, "host": w.host, "port": w.port, "alive": w.record.alive()}
            for i, w in sorted(cluster.workers.items())
        },
        "executors": [
            {"pid": e.pid, "app_id": e.app_id, "executor_id": e.executor_id, "worker": e.worker}
            for e in cluster.executors()
        ],
    }
    try:
        status["active_apps"] = cluster.active_apps()
        status["alive_workers"] = len(cluster.alive_workers())
    except ClusterError as exc:
        status["master_error"] = str(exc)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stateful_async.chaos.cluster",
        description="A local Spark standalone cluster on 127.0.0.1 for chaos tests.",
    )
    parser.add_argument(
        "--dir", type=Path, default=default_dir(), help="where the cluster keeps its state"
    )
    # --dir also after the command (``stop --dir DIR``), as the docs and messages write it
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument(
        "--dir", type=Path, default=argparse.SUPPRESS, help="where the cluster keeps its state"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help, parents=[where])

    start = command("start", "start a master and workers, wait until alive")
    start.add_argument("--workers", type=int, default=2, help="at least 1")
    start.add_argument(
        "--cores", type=int, default=1, help="cores per worker, at least 1 (at most 2147483647)"
    )
    start.add_argument("--memory", default="2g", help="memory per worker, such as 512m or 2g")
    start.add_argument(
        "--timeout", type=float, default=180.0, help="seconds to start in, above 0 (default: 180)"
    )
    command("status", "print the cluster's processes and applications (JSON)")
    stop = command("stop", "stop every process the cluster started")
    stop.add_argument(
        "--wait",
        type=float,
        default=None,
        help="seconds, 0 or more, to wait for a start running in DIR to be done (default: "
        "until 15 s after it gives up, by its --timeout)",
    )
    kill_executor = command("kill-executor", "SIGKILL one executor JVM")
    kill_executor.add_argument("--app", default=None, help="an application id")
    kill_executor.add_argument("--worker", type=int, default=None, help="a worker index")
    kill_worker = command("kill-worker", "SIGKILL a worker and its executors")
    kill_worker.add_argument("index", type=int)
    start_worker = command("start-worker", "start a killed worker again")
    start_worker.add_argument("index", type=int)
    args = parser.parse_args(argv)
    if args.command == "start":
        # LocalCluster's own checks, before anything starts, naming the options (exit 2)
        try:
            check_workers("--workers", args.workers)
            check_cores("--cores", args.cores)
            args.memory = check_memory("--memory", args.memory)
            check_timeout("--timeout", args.timeout)
        except ClusterError as exc:
            start.error(str(exc))
    if args.command == "stop" and args.wait is not None:
        try:
            check_wait("--wait", args.wait)
        except ClusterError as exc:
            stop.error(str(exc))

    try:
        if args.command == "start":
            cluster = LocalCluster(
                args.workers,
                cores=args.cores,
                memory=args.memory,
                base_dir=args.dir,
                startup_timeout=args.timeout,
                stop_at_exit=False,
            ).start()
            print(cluster.master_url)
            print(f"web UI {cluster.webui_url}; state and logs in {args.dir}", file=sys.stderr)
            return 0
        if args.command == "stop":
            pids = _stop(args.dir, args.wait)
            print(f"stopped {len(pids)} processes: {' '.join(map(str, sorted(pids)))}")
            return 0
        cluster = LocalCluster.attach(args.dir)
        if args.command == "status":
            print(json.dumps(_status(cluster), indent=2))
        elif args.command == "kill-executor":
            executor = cluster.kill_executor(args.app, args.worker)
            print(
                f"killed executor {executor.executor_id} of {executor.app_id} "
                f"(pid {executor.pid}, worker {executor.worker})"
            )
        elif args.command == "kill-worker":
            pids = cluster.kill_worker(args.index)
            print(f"killed worker {args.index}: pids {' '.join(map(str, pids))}")
        elif args.command == "start-worker":
            info = cluster.start_worker(args.index)
            print(f"started worker {info.index} (pid {info.pid}, {info.host}:{info.port})")
    except (ClusterError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
