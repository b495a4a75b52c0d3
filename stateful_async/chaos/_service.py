"""A mock enrichment service: aiohttp on 127.0.0.1, in its own process.

It answers ``GET /enrich?key=K`` with ``{"key": K, "score": ..., "label": ...}`` (a pure
function of the key, see ``expected_enrichment``) after a configurable latency, and can be
told to misbehave: random or deterministic 5xx errors, error bursts, latency spikes and
hangs. It counts requests per key, so a test can tell exactly which keys were requested
more than once, and the requests it is handling at once (in flight: from arrival to answer,
latency and hangs included), so a test can check a client's concurrency limit.

Admin API (JSON):

* ``GET /admin/counts`` — ``{"counts": {key: n}, "total": N, "errors": E, "hangs": H,
  "in_flight": F, "peak_in_flight": P}``: ``F`` requests being handled now, ``P`` the most
  handled at once since the last reset (``/enrich`` requests only)
* ``POST /admin/reset`` — zero every counter (the peak restarts from the requests in flight;
  a request that arrived before the reset is not counted after it, errors included)
* ``GET|POST /admin/config`` — read / merge the fault configuration (``ServiceConfig``); a
  setting it cannot honour is refused with 400 and the configuration is left as it was;
  the random sequence restarts only when ``seed`` is among the settings posted
* ``GET /health``

Run it with ``MockService`` (``stateful_async.chaos``), or from a shell:
``python -m stateful_async.chaos.service --port 8099``.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import math
import random
import signal
import sys
import threading
import zlib
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from aiohttp import web

from .._exceptions import ConfigurationError


def expected_enrichment(key: str) -> dict[str, Any]:
    """What the service returns for ``key`` (without faults): reference results are
    computed with this, never by calling the service."""
    digest = zlib.crc32(str(key).encode())
    return {"key": str(key), "score": (digest % 10_000) / 100.0, "label": f"L{digest % 97:02d}"}


@dataclass
class ServiceConfig:
    """How the service behaves. Every field has a harmless default.

    Requests to ``/enrich`` are numbered from 1: the first one after the service started,
    or after the last reset, is request 1.

    Latency: ``latency_ms`` with ``distribution`` ``constant``, ``uniform`` (between
    ``latency_min_ms`` and ``latency_max_ms``), ``exponential`` (mean ``latency_ms``) or
    ``lognormal`` (median ``latency_ms``, ``latency_sigma`` at most 10); every
    ``spike_every``-th request takes ``spike_ms`` longer.

    Errors: each request fails with ``error_status`` (an error status, 400-599) with
    probability ``error_rate``; requests number ``burst_start`` .. ``burst_start +
    burst_length - 1`` all fail (``burst_start`` >= 1, by default 1: a ``burst_length``
    alone fails the first requests); the first ``fail_first[key]`` requests of a key fail.
    Hangs: with probability ``hang_rate``, or for the first ``hang_first[key]`` requests of
    a key, the service never answers (the client's timeout decides).

    Randomness: the random draws (which requests fail with ``error_rate`` or hang with
    ``hang_rate``, and the ``uniform``, ``exponential`` and ``lognormal`` latencies) come
    from one sequence seeded with ``seed`` (a whole number), each request all its draws as
    it arrives, so the same requests arriving in the same order meet the same faults on
    every run, however many are in flight at once. The sequence starts from ``seed`` when
    the service starts, and again whenever the admin API is given ``seed`` (even the same
    one); changing other settings, and a reset, go on with it where it is.

    Numbers must be finite. A setting out of range raises ``ConfigurationError`` (a
    ``ValueError``), here, in ``--config`` and in the admin API (400).
    """

    latency_ms: float = 0.0
    distribution: str = "constant"
    latency_min_ms: float = 0.0
    latency_max_ms: float = 0.0
    latency_sigma: float = 0.5
    spike_every: int = 0
    spike_ms: float = 0.0
    error_rate: float = 0.0
    error_status: int = 503
    burst_start: int = 1
    burst_length: int = 0
    fail_first: dict[str, int] = field(default_factory=dict)
    hang_rate: float = 0.0
    hang_first: dict[str, int] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        # checked here, so that a bad setting is refused when it is made (by the admin API,
        # --config or in Python), not by a 500 on every request after it
        for name in ("latency_ms", "latency_min_ms", "latency_max_ms", "spike_ms"):
            _check_number(name, getattr(self, name), low=0.0)
        # Bounded so that exp() of the lognormal's exponent cannot overflow: random.gauss
        # stays within 8.6 sigma (Box-Muller on 53-bit floats), and exp(86) is finite.
        _check_number("latency_sigma", self.latency_sigma, low=0.0, high=MAX_LATENCY_SIGMA)
        for name in ("error_rate", "hang_rate"):
            _check_number(name, getattr(self, name), low=0.0, high=1.0)
        for name in ("spike_every", "burst_length"):
            _check_int(name, getattr(self, name), low=0)
        _check_int("burst_start", self.burst_start)
        if self.burst_start < 1:
            raise ConfigurationError(
                f"burst_start must be at least 1: it is the number of the burst's first "
                f"request, and requests are numbered from 1 (since the service started or "
                f"was last reset); got {self.burst_start!r}."
            )
        # ServiceEnrichment (and any client) takes only >= 400 for an error; an 1xx, 2xx or
        # 3xx "failure" would break the connection or pass an error body off as an answer
        _check_int("error_status", self.error_status, low=400, high=599)
        _check_int("seed", self.seed)
        for name in ("fail_first", "hang_first"):
            _check_counts(name, getattr(self, name))
        if self.distribution not in DISTRIBUTIONS:
            raise ConfigurationError(
                f"Unknown latency distribution {self.distribution!r}: "
                f"use one of {', '.join(DISTRIBUTIONS)}."
            )
        if self.latency_min_ms > self.latency_max_ms and self.distribution == "uniform":
            raise ConfigurationError(
                f"latency_min_ms ({self.latency_min_ms}) is above latency_max_ms "
                f"({self.latency_max_ms})."
            )

    def merged(self, changes: dict[str, Any]) -> ServiceConfig:
        if not isinstance(changes, dict):
            raise ConfigurationError(
                f"Service settings are a JSON object of name: value; got {changes!r}."
            )
        unknown = set(changes) - set(asdict(self))
        if unknown:
            raise ConfigurationError(
                f"Unknown service settings: {', '.join(sorted(unknown))}; the settings are "
                f"{', '.join(f.name for f in fields(self))}."
            )
        return ServiceConfig(**{**asdict(self), **changes})


DISTRIBUTIONS = ("constant", "uniform", "exponential", "lognormal")
MAX_LATENCY_SIGMA = 10.0


def _check_number(name: str, value: Any, low: float, high: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"{name} must be a number; got {value!r}.")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond any float
        finite = False
    if not finite:
        raise ConfigurationError(f"{name} must be a finite number; got {value!r}.")
    if value < low or (high is not None and value > high):
        bounds = f"at least {low:g}" if high is None else f"between {low:g} and {high:g}"
        raise ConfigurationError(f"{name} must be {bounds}; got {value!r}.")


def _check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"{name} must be a whole number; got {value!r}.")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"between {low} and {high}"
        raise ConfigurationError(f"{name} must be {bounds}; got {value!r}.")


def _check_counts(name: str, value: Any) -> None:
    if not isinstance(value, dict) or not all(
        isinstance(key, str) and isinstance(n, int) and not isinstance(n, bool) and n >= 0
        for key, n in value.items()
    ):
        raise ConfigurationError(
            f"{name} must map keys (strings) to request counts (whole numbers >= 0), "
            f'like {{"7": 2}}; got {value!r}.'
        )


class _State:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.random = random.Random(config.seed)
        self.in_flight = 0  # not reset: requests still being handled will finish
        # Bumped by every reset. A request remembers the generation it arrived in and
        # updates counters only while it is still current: a request counted before a
        # reset must not count an error after it (errors > total).
        self.generation = 0
        self.reset()

    def reset(self) -> None:
        self.generation += 1
        self.counts: dict[str, int] = {}
        self.total = 0
        self.errors = 0
        self.hangs = 0
        self.peak_in_flight = self.in_flight

    def latency(self, number: int) -> float:
        c = self.config
        if c.distribution == "uniform":
            ms = self.random.uniform(c.latency_min_ms, c.latency_max_ms)
        elif c.distribution == "exponential":
            ms = self.random.expovariate(1.0 / c.latency_ms) if c.latency_ms > 0 else 0.0
        elif c.distribution == "lognormal":
            ms = (
                c.latency_ms * math.exp(self.random.gauss(0.0, c.latency_sigma))
                if c.latency_ms > 0
                else 0.0
            )
        else:
            ms = c.latency_ms
        if c.spike_every > 0 and number % c.spike_every == 0:
            ms += c.spike_ms
        return ms / 1000.0


async def _enrich(request: web.Request) -> web.StreamResponse:
    state: _State = request.app["state"]
    state.in_flight += 1
    state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
    try:
        return await _answer(request, state)
    finally:  # also when a hung request is cancelled
        state.in_flight -= 1


async def _answer(request: web.Request, state: _State) -> web.StreamResponse:
    key = request.query.get("key") or request.match_info.get("key")
    if key is None:
        return web.json_response({"error": "pass ?key=..."}, status=400)
    generation = state.generation
    state.total += 1
    number = state.total
    seen = state.counts.get(key, 0) + 1
    state.counts[key] = seen
    c = state.config
    if seen <= c.hang_first.get(key, 0) or (c.hang_rate and state.random.random() < c.hang_rate):
        state.hangs += 1
        await asyncio.Event().wait()  # never answers; the client gives up
    delay = state.latency(number)
    # Decided on arrival, with the other draws, not after the latency: requests in flight
    # at once end in an order that timing decides, and would take each other's draws.
    failing = (
        seen <= c.fail_first.get(key, 0)
        or (c.burst_length > 0 and c.burst_start <= number < c.burst_start + c.burst_length)
        or (c.error_rate and state.random.random() < c.error_rate)
    )
    if delay > 0:
        await asyncio.sleep(delay)
    if failing:
        if state.generation == generation:  # not reset while this request waited
            state.errors += 1
        return web.json_response({"error": "injected failure", "key": key}, status=c.error_status)
    return web.json_response(expected_enrichment(key))


async def _counts(request: web.Request) -> web.Response:
    state: _State = request.app["state"]
    return web.json_response(
        {
            "counts": state.counts,
            "total": state.total,
            "errors": state.errors,
            "hangs": state.hangs,
            "in_flight": state.in_flight,
            "peak_in_flight": state.peak_in_flight,
        }
    )


async def _reset(request: web.Request) -> web.Response:
    request.app["state"].reset()
    return web.json_response({"ok": True})


async def _config(request: web.Request) -> web.Response:
    state: _State = request.app["state"]
    if request.method == "POST":
        try:
            changes = await request.json()
            state.config = state.config.merged(changes)
        except (ValueError, TypeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        # Only a seed given restarts the random sequence: another setting changed mid-run
        # (error_rate, say) must not hand the following requests the run's first draws.
        if "seed" in changes:
            state.random = random.Random(state.config.seed)
    return web.json_response(asdict(state.config))


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def make_app(config: ServiceConfig | None = None) -> web.Application:
    app = web.Application()
    app["state"] = _State(config or ServiceConfig())
    app.router.add_get("/enrich", _enrich)
    app.router.add_get("/enrich/{key}", _enrich)
    app.router.add_get("/admin/counts", _counts)
    app.router.add_post("/admin/reset", _reset)
    app.router.add_get("/admin/config", _config)
    app.router.add_post("/admin/config", _config)
    app.router.add_get("/health", _health)
    return app


async def serve(
    port: int, config: ServiceConfig, host: str = "127.0.0.1", stop_on_eof: bool = False
) -> None:
    # A hung request is cancelled when its client gives up, instead of piling up.
    runner = web.AppRunner(
        make_app(config), access_log=None, handler_cancellation=True, shutdown_timeout=1.0
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"listening on {host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if stop_on_eof:
        # Standard input is a pipe from the process that started this one: it closes when
        # that process ends, however it ends (SIGKILL included), and this one stops too.
        def wait_for_eof() -> None:
            try:
                while sys.stdin.buffer.read(4096):
                    pass
            except (OSError, ValueError):
                pass
            loop.call_soon_threadsafe(stop.set)

        threading.Thread(target=wait_for_eof, name="stdin-eof", daemon=True).start()
    await stop.wait()
    await runner.cleanup()


def _config_help() -> str:
    """--config's settings and their defaults, with ServiceConfig's own description."""
    defaults = ServiceConfig()
    lines = [f"  {f.name} (default {getattr(defaults, f.name)!r})" for f in fields(ServiceConfig)]
    description = inspect.cleandoc(ServiceConfig.__doc__ or "")
    return "--config settings:\n" + "\n".join(lines) + "\n\n" + description


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"a TCP port is a number from 0 to 65535 (0 picks a free one); got {text!r}"
        )
    return port


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m stateful_async.chaos.service",
        description="The stateful-async mock enrichment service.",
        epilog=_config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--port", type=_port, default=0, help="0 picks a free port (printed)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--config",
        default="{}",
        help='initial settings as JSON, e.g. \'{"latency_ms": 20, "error_rate": 0.01}\'',
    )
    parser.add_argument(
        "--stop-on-stdin-eof",
        action="store_true",
        help="stop when standard input closes (MockService passes it: the service ends "
        "with the process that started it)",
    )
    args = parser.parse_args(argv)
    try:
        config = ServiceConfig().merged(json.loads(args.config))
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    try:
        asyncio.run(serve(args.port, config, args.host, args.stop_on_stdin_eof))
    except KeyboardInterrupt:
        pass
    except OSError as exc:  # the port is taken, or the host is not an address of this machine
        parser.exit(1, f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
