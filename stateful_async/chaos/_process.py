"""``MockService``: the mock enrichment service in a child process, stopped by pid."""

from __future__ import annotations

import json
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from typing import IO, Any

from .._exceptions import StatefulAsyncError, as_int
from ._cluster import _is_seconds, _owner_pipes, no_stop_at_exit, stop_at_exit
from ._service import ServiceConfig


class MockServiceError(StatefulAsyncError):
    """The mock service could not be started, or an admin call failed."""


class MockService:
    """Starts the mock enrichment service on 127.0.0.1 (a free port) in its own process.

    Use it as a context manager, or call ``start()`` and ``stop()``. ``stop()`` ends only
    the process this object started, by pid.

    ``port=0`` (the default) picks a free port on every ``start()``, so a service started
    again after ``stop()`` may listen on another port (read ``url`` after starting it). The
    counters live in the service process: a restart begins them at zero, with the last
    configuration (``config``, as ``configure()`` left it).

        with MockService(ServiceConfig(latency_ms=20)) as service:
            service.url        # "http://127.0.0.1:<port>"
            service.counts()   # {"key": requests, ...}
    """

    def __init__(self, config: ServiceConfig | None = None, port: int = 0) -> None:
        self.config = config or ServiceConfig()
        checked = as_int(port)
        if checked is None or not 0 <= checked <= 65535:
            raise MockServiceError(
                "port is a TCP port, a number from 0 to 65535 (0, the default, picks a free "
                f"one on every start()); got {port!r}."
            )
        self.requested_port = port = checked  # 0: a free port, picked again on every start()
        self.port = port  # the port it listens on, once started
        self.process: subprocess.Popen[str] | None = None
        self._stderr: IO[str] | None = None

    @property
    def url(self) -> str:
        if self.process is None:
            raise MockServiceError("The mock service is not running: call start() first.")
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self, timeout: float = 30.0) -> MockService:
        """Start the service and wait up to ``timeout`` seconds (a finite number above 0)
        until it answers; a ``timeout`` that is not raises ``MockServiceError`` before
        anything starts. Does nothing if it is running."""
        if self.process is not None:
            return self
        if not _is_seconds(timeout) or not 0 < timeout < math.inf:
            raise MockServiceError(
                f"timeout must be a finite number of seconds above 0, the time the service "
                f"gets to start; got {timeout!r}."
            )
        self._stderr = stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "stateful_async.chaos.service",
                "--port",
                str(self.requested_port),
                "--config",
                json.dumps(asdict(self.config)),
                "--stop-on-stdin-eof",
            ],
            # a pipe this process holds open: should it die without stop() (SIGKILL, or a
            # SIGTERM nobody handles), the pipe closes and the service stops
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # a file, not a pipe nobody reads: a service that logs a lot must never block
            stderr=stderr,
            text=True,
        )
        # stopped when this interpreter exits, if nobody did (a child left listening would
        # outlive its test or script)
        stop_at_exit(self.stop)
        assert self.process.stdin is not None and self.process.stdout is not None
        _owner_pipes.add(self.process.stdin)  # not held open by a child forked without exec
        deadline = time.monotonic() + timeout
        # "listening on 127.0.0.1:<port>", printed and flushed at once; waited for with the
        # deadline (a service that hangs before printing it must not hang its caller)
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else f"nothing printed within {timeout} s"
        if not line.startswith("listening on"):
            stderr.seek(0)
            error = stderr.read()
            self.stop()
            said = " ".join(part for part in (line.strip(), error.strip()) if part)
            raise MockServiceError(f"The mock service did not start: {said}")
        self.port = int(line.rsplit(":", 1)[1])
        while time.monotonic() < deadline:
            try:
                self._call("GET", "/health")
                return self
            except MockServiceError:
                time.sleep(0.05)
        self.stop()
        raise MockServiceError(f"The mock service did not answer /health within {timeout} s.")

    def stop(self) -> None:
        process, self.process = self.process, None
        stderr, self._stderr = self._stderr, None
        if stderr is not None:
            stderr.close()
        if process is None:
            return
        no_stop_at_exit(self.stop)
        if process.stdin is not None:
            _owner_pipes.discard(process.stdin)
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()

    def __enter__(self) -> MockService:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- admin ------------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """Requests received per key since the last reset."""
        return dict(self.stats()["counts"])

    def stats(self) -> dict[str, Any]:
        """``counts`` plus ``total``, ``errors``, ``hangs``, ``in_flight`` and
        ``peak_in_flight`` (see ``stateful_async.chaos._service``)."""
        return self._call("GET", "/admin/counts")

    def reset(self) -> None:
        self._call("POST", "/admin/reset")

    def configure(self, **changes: Any) -> ServiceConfig:
        """Change the fault configuration (fields of ``ServiceConfig``); returns the new one."""
        self.config = ServiceConfig(**self._call("POST", "/admin/config", changes))
        return self.config

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise MockServiceError(
                f"The mock service refused {method} {path}: {exc.read().decode(errors='replace')}"
            ) from exc
        except OSError as exc:  # URLError included: nothing listens there any more
            status = None if self.process is None else self.process.poll()
            raise MockServiceError(
                f"The mock service at {self.url} does not answer {method} {path}"
                + ("" if status is None else f" (its process exited with status {status})")
                + f": {getattr(exc, 'reason', exc)}."
            ) from exc
