"""The ``stateful-async`` command line.

    stateful-async demo                                   the main job, end to end
    stateful-async checkpoints list LOCATION              what is stored
    stateful-async checkpoints show LOCATION ID           one snapshot's in-flight elements
    stateful-async checkpoints expire LOCATION --retain N
    stateful-async replay LOCATION ID --function module:attr [--output PATH]

Errors in what the user asked for (a missing location, an unknown id, a function that
cannot be imported, an output path that exists or cannot be written) and usage errors (an
unknown option, a missing argument) print one clear message and exit with status 2
(stderr's reader gone, the message is lost, the status kept); the
demo exits with status 1 if its Spark job fails (PySpark's error, then where Spark's log
is) or if a check it promises fails or cannot be made. A command whose reader stops
reading (``checkpoints list ... | head -1``, its ``--help`` too) stops quietly with status
141 (128 + SIGPIPE), as a Unix tool that SIGPIPE ends does: stdout's reader, that is; a
warning that stderr's reader cannot read does not stop the command.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import decimal
import errno
import importlib
import inspect
import io
import json
import math
import os
import re
import select
import shlex
import stat
import sys
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout, suppress
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand, TyperGroup

from ._exceptions import StatefulAsyncError, error_text, id_ranges, numpy_kind
from ._signals import sigterm_unwinds


class _Console(Console):
    """rich's Console, whose reader closing the pipe ends the command as a plain write's
    does (_quiet_when_the_reader_leaves), not with rich's own exit, status 1. Stderr's
    reader leaving ends nothing: what is said there is lost, and the command goes on to
    its own status (an error's 2, not 1 or 141; a warning does not stop it)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more from this console
        if self.stderr:
            return
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


out = _Console()
err = _Console(stderr=True)


def _say(console: Console, text: str, highlight: bool = True) -> None:
    """``text`` (markup) as one line in a pipe or file, where rich would cut it at 80
    columns mid-sentence (a path too: a log's reader, or grep, found neither whole); a
    terminal gets it wrapped at words, at its width."""
    console.print(text, highlight=highlight, soft_wrap=not console.is_terminal)


USER_ERROR = 2
# replay calls the function once per element: it has no retry strategy to give the operator
_NO_RETRY_OPTION = (
    "retry it inside the function (replay has no retry option: it makes one attempt per element)"
)
CLOSED_PIPE = 128 + 13  # SIGPIPE's number (signal.SIGPIPE, which Windows has not)


class Fail(Exception):
    """A user error, already worded for the terminal."""


@contextmanager
def _user_errors() -> Iterator[None]:
    try:
        yield
    except (Fail, StatefulAsyncError) as exc:
        from checkpoint._layout import CREDENTIALS

        from ._operator import RETRY_THIS

        # the Python API's words for what the command line has its own (or no) option for
        text = (
            str(exc)
            .replace(CREDENTIALS, "--storage-option / -o KEY=VALUE")
            .replace(RETRY_THIS, _NO_RETRY_OPTION)
        )
        err.print(f"[bold red]Error:[/] {escape(text)}", highlight=False, soft_wrap=True)
        raise typer.Exit(USER_ERROR) from None


@contextmanager
def _quiet_when_the_reader_leaves() -> Iterator[None]:
    """Stop quietly, with status CLOSED_PIPE, when what reads stdout closes it (``| head``)
    before all is written. Python ignores SIGPIPE, so the write raises BrokenPipeError:
    Click took it for a failure (status 1, no word), and what stayed in stdout's buffer
    failed again at exit ("Exception ignored ... BrokenPipeError"). A BrokenPipeError
    while stdout's reader is still there (a socket's, to a service or the JVM) is no such
    thing: its traceback is printed, with status 1, as for any other unexpected error
    (Click would exit 1 without a word)."""
    try:
        yield
        sys.stdout.flush()  # what is buffered still: the reader may have left meanwhile
    except BrokenPipeError:
        if not _stdout_reader_left():
            with suppress(OSError):  # (stderr's reader may have left)
                traceback.print_exc()
                sys.stderr.flush()
            raise typer.Exit(1) from None
        # as Python's documentation of SIGPIPE advises: stdout to /dev/null, so that the
        # flush at exit has nowhere to fail
        with suppress(OSError, ValueError):  # (a stdout with no file descriptor: a test's)
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, sys.stdout.fileno())
            finally:
                os.close(devnull)
        raise typer.Exit(CLOSED_PIPE) from None


def _stdout_reader_left() -> bool:
    """Whether stdout is a pipe (or socket) whose reader closed it: it polls as an error
    (or a hang-up) for good then. A stdout with no file descriptor (a test's) never has a
    reader leave; where poll() is missing (Windows), a broken pipe is taken for stdout's."""
    if not hasattr(select, "poll"):
        return True
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError, AttributeError):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _help_for_a_pipe(format_help: Callable[[], None]) -> None:
    """Print a command's or a group's help (``format_help``) so that a reader closing the
    pipe (``--help | head -1``) stops it as it stops a command: Typer prints the help
    through a rich console of its own, which exits with status 1 on a closed pipe. In a
    pipe or a file the help is rendered first, as it would be printed there, then written
    as a plain write, which parse_args' _quiet_when_the_reader_leaves turns into status
    CLOSED_PIPE (the help is printed while Click parses the arguments); a terminal gets it
    as Typer prints it."""
    if sys.stdout.isatty():
        format_help()
        return
    rendered = io.StringIO()
    with redirect_stdout(rendered):  # Typer's console writes to sys.stdout as it is then
        format_help()
    sys.stdout.write(rendered.getvalue())


# Click's base exception as Typer raises it: newer Typer carries its own copy of Click
_CLICK_ERROR: Any = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


class _Group(TyperGroup):
    """A group whose help (--help, or no command given) stops quietly when the reader of
    its output leaves, as a command does."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        with _quiet_when_the_reader_leaves():
            result: list[str] = super().parse_args(ctx, args)
            return result

    def format_help(self, ctx: Any, formatter: Any) -> None:
        _help_for_a_pipe(lambda: super(_Group, self).format_help(ctx, formatter))

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """Click's own usage errors (an unknown option, a missing argument) keep their
        status, 2, when their message cannot be written (stderr's reader gone), as the
        command line's other errors do: Typer exits 1 for the write failing instead."""
        try:
            return super().main(*args, **kwargs)
        except SystemExit as exc:
            context: Any = exc.__context__
            while context is not None and not isinstance(context, _CLICK_ERROR):
                context = context.__context__
            if exc.code == 1 and context is not None:  # its message failed, not it
                raise SystemExit(context.exit_code) from None
            raise


app = typer.Typer(
    cls=_Group,
    help="Flink's async I/O operator for PySpark, with durable snapshots in Delta tables.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
checkpoints_app = typer.Typer(
    cls=_Group, help="Inspect and maintain a checkpoint location.", no_args_is_help=True
)
app.add_typer(checkpoints_app, name="checkpoints")


class _Command(TyperCommand):
    """A command that reads its arguments once before Click does, to refuse with a clear
    message what Click would refuse with a puzzling one (a negative checkpoint id, which
    Click takes for an unknown option: "No such option: -1") or take without a word (an
    option that selects one thing given twice, of which Click keeps the last). With --help,
    nothing is refused: the help is printed, for a negative id too. It stops quietly when
    the reader of its output (its help's too) leaves (_quiet_when_the_reader_leaves)."""

    def invoke(self, ctx: Any) -> Any:
        with _quiet_when_the_reader_leaves():
            return super().invoke(ctx)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        _help_for_a_pipe(lambda: super(_Command, self).format_help(ctx, formatter))

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        with _quiet_when_the_reader_leaves():  # (the help is printed here)
            return self._parse_args(ctx, args)

    def _parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if not ctx.resilient_parsing:  # (shell completion parses leniently)
            options, positional = _scan(self.get_params(ctx), args)
            # by the name typed: Click before 8.1.8 makes a new help option at each call
            # of get_help_option(), so the one get_params() gave is not the same object
            help_names = set(self.get_help_option_names(ctx)) if self.add_help_option else set()
            help_option = next((p for p, name, _ in options if name in help_names), None)
            if help_option is None:
                with _user_errors():
                    _check_arguments(self, positional)
                    _check_given_once(ctx, options)
            elif _NEGATIVE.fullmatch(_id_token(self, positional) or ""):
                # the help, as for any other id (Click would stop at "No such option: -1")
                help_option.callback(ctx, help_option, True)  # prints it, and exits
        result: list[str] = super().parse_args(ctx, args)
        return result


_NEGATIVE = re.compile(r"-\d+")
_INTEGER = re.compile(r"[-+]?\d+")  # as Click's INT takes it


def _scan(params: list[Any], args: list[str]) -> tuple[list[tuple[Any, str, str]], list[str]]:
    """``args`` as Click's parser reads them: the options given, as (parameter, name as
    typed, value: '' for a flag), and the positional arguments, where a negative number
    that is not an option's value is one (Click would take it for an unknown option).
    Unknown options are left out (Click refuses them)."""
    names: dict[str, Any] = {}
    for param in params:
        if param.param_type_name == "option":
            for name in (*param.opts, *param.secondary_opts):
                names[name] = param
    options: list[tuple[Any, str, str]] = []
    positional: list[str] = []
    tokens = iter(args)
    for token in tokens:
        if token == "--":
            positional.extend(tokens)
            break
        if not token.startswith("-") or token == "-" or _NEGATIVE.fullmatch(token):
            positional.append(token)
            continue
        if token.startswith("--"):
            name, inline, value = token.partition("=")
        else:  # -oVALUE, or -o VALUE
            name, value = token[:2], token[2:]
            inline = "=" if value else ""
        param = names.get(name)
        if param is None:
            continue
        if param.is_flag or param.count:
            options.append((param, name, ""))
            continue
        if not inline:
            value = next(tokens, "")
        options.append((param, name, value))
    return options, positional


def _check_arguments(command: Any, positional: list[str]) -> None:
    # Every id below 1 is refused here, 0 too, so the commands need no check of their own.
    token = _id_token(command, positional)
    if token is not None and _INTEGER.fullmatch(token):
        _check_checkpoint_id(int(token))


def _id_token(command: Any, positional: list[str]) -> str | None:
    """The token in the checkpoint id's place, if the command takes one and it is given.
    Only that one: another negative number (a LOCATION after --, a directory named -1) is
    not an id, and is Click's to take or refuse."""
    arguments = [p.name for p in command.params if p.param_type_name == "argument"]
    if "checkpoint_id" not in arguments:
        return None
    index = arguments.index("checkpoint_id")
    return positional[index] if index < len(positional) else None


# Options that select one thing, or name one output: given twice, the second would not add
# to the first (Click keeps the last), which a user may well expect. Others (--capacity,
# --format, ...) keep the last, as command lines do, so that a wrapper can override them.
_ONE_ONLY = {
    "job": "one job: run the command once per job",
    "partition": "one partition: run the command once per partition, or leave --partition "
    "out for all of them",
    "run": "one run: run the command once per run",
    "operator": "one operator: run the command once per operator",
    "output": "one output file: replay again for another",
    "function": "one function: replay again for another",
}


def _check_given_once(ctx: Any, options: list[tuple[Any, str, str]]) -> None:
    given: dict[Any, list[str]] = {}
    for param, _, value in options:
        if param.name in _ONE_ONLY:
            given.setdefault(param, []).append(value)
    for param, values in given.items():
        if len({_as_taken(ctx, param, value) for value in values}) > 1:
            times = "twice" if len(values) == 2 else f"{len(values)} times"
            raise Fail(
                f"{param.opts[0]} was given {times} ({', '.join(values)}), and it takes "
                f"{_ONE_ONLY[param.name]}."
            )


def _as_taken(ctx: Any, param: Any, value: str) -> Any:
    """``value`` as the option takes it (so --partition 0 and --partition 00 are one
    partition), or as typed if it does not take it (Click will say so)."""
    try:
        runtime = getattr(param, "get_runtime_param", None)
        if runtime is not None:  # newer Typer's conversion: its parameters carry no Click type
            return runtime().coerce(value, param=param, ctx=ctx)
        taken = param.type_cast_value(ctx, value)  # Click's, as Typer 0.16 gives it
        # Typer makes a Path of what Click's path type gives as typed (./out.jsonl)
        return Path(taken) if isinstance(param.type, click.Path) else taken
    except Exception:
        return value


def _check_checkpoint_id(checkpoint_id: int) -> None:
    if checkpoint_id < 1:
        raise Fail(
            f"A checkpoint id is a whole number from 1 up; got {checkpoint_id}. "
            "`checkpoints list LOCATION` shows the ids there."
        )


def _check_at_least(option: str, value: int, lowest: int, meaning: str) -> None:
    if value < lowest:
        raise Fail(f"{option} must be {lowest} or more ({meaning}); got {value}.")


class Mode(str, Enum):
    ordered = "ordered"
    unordered = "unordered"


class Format(str, Enum):
    table = "table"
    json = "json"


_PROBED_SUBDIRS = 20  # subdirectories looked into for a location one level down

# The arguments and options the checkpoint commands share.
LocationArg = Annotated[str, typer.Argument(metavar="LOCATION", help="The checkpoint location.")]
CheckpointIdArg = Annotated[int, typer.Argument(metavar="ID", help="The checkpoint id.")]
JobOpt = Annotated[str | None, typer.Option(help="The job (if the location holds several).")]
PartitionOpt = Annotated[int | None, typer.Option(help="Only this partition.")]
RunOpt = Annotated[
    str | None,
    typer.Option(help="The run (default: per partition, the newest run with this id)."),
]
OperatorOpt = Annotated[str | None, typer.Option(help="The operator id.")]
StorageOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--storage-option",
        "-o",
        metavar="KEY=VALUE",
        help="An object store setting, as CheckpointConfig's storage_options take it (e.g. "
        "AWS_REGION=eu-west-1); repeat for several. Default: the environment's.",
    ),
]


# -- demo ------------------------------------------------------------------------------------


@app.command(cls=_Command)
def demo(
    rows: Annotated[
        int, typer.Option(help="Records to enrich (100 or more per partition).")
    ] = 50_000,
    latency_ms: Annotated[float, typer.Option(help="Mock service latency per request.")] = 20.0,
    mode: Annotated[Mode, typer.Option(help="Output order.")] = Mode.ordered,
    capacity: Annotated[int, typer.Option(help="Requests in flight per task (1 or more).")] = 100,
    partitions: Annotated[int, typer.Option(help="Spark partitions (tasks), 1 or more.")] = 2,
    crash: Annotated[bool, typer.Option(help="Crash one task mid-way and recover.")] = True,
    workdir: Annotated[
        Path | None,
        typer.Option(
            help="Where the output, checkpoints and Spark's log go (default: a new temp dir)."
        ),
    ] = None,
) -> None:
    """Enrich a generated dataset on local Spark against the mock service (a child process),
    with checkpoints; crash one task mid-way, recover, and check the output is exactly once."""
    from ._demo import DemoJobFailed, DemoSettings, run_demo

    with _user_errors():
        _check_at_least("--rows", rows, 100, "the records to enrich")
        if not 0 < latency_ms < math.inf:
            raise Fail(
                f"--latency-ms must be a finite number of milliseconds > 0; got {latency_ms}."
            )
        _check_at_least("--capacity", capacity, 1, "the requests in flight per task")
        _check_at_least("--partitions", partitions, 1, "the Spark partitions, one task each")
    settings = DemoSettings(
        rows=rows,
        partitions=partitions,
        capacity=capacity,
        latency_ms=latency_ms,
        mode=mode.value,
        crash=crash,
        workdir=str(workdir) if workdir else None,
    )
    out.print(
        f"[bold]stateful-async demo[/]: {rows:,} records, {partitions} partitions, capacity "
        f"{capacity}, {latency_ms:g} ms per request, {mode.value} output"
        + (", one task crash injected" if crash else "")
    )
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=out,
        transient=False,
    )
    # A SIGTERM (timeout, a CI job cancelled, kill) unwinds like Ctrl-C, so that the demo
    # stops the service and Spark it started instead of leaving them running.
    try:
        with sigterm_unwinds(), _user_errors(), progress:
            steps = progress.add_task("preparing", total=None)
            requests = progress.add_task("requests to the service", total=rows, visible=False)

            def on_start(text: str) -> None:
                progress.update(steps, description=text)
                if text.startswith("enriching"):
                    progress.reset(requests, visible=True)

            def on_progress(count: int) -> None:
                progress.update(requests, completed=count, total=max(rows, count))

            result = run_demo(settings, on_start, on_progress)
            progress.update(steps, description="done", total=1, completed=1)
    except DemoJobFailed as failed:
        # PySpark's error as it was, then where Spark (and Java, and the Python workers)
        # wrote what led to it: the demo sends their output to that log, not the terminal
        with suppress(OSError):  # (stderr's reader may have left: the status says it still)
            traceback.print_exception(failed.__cause__ or failed)
            sys.stderr.flush()
        err.print(
            f"[bold red]The Spark job failed[/] (above); Spark's log: {escape(failed.spark_log)}",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(1) from None

    table = Table(title="Summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("records", f"{rows:,} in {partitions} partitions")
    table.add_row(
        "throughput",
        f"{result.throughput:,.0f} records/s in {result.seconds:.1f} s "
        f"(service bound: {partitions * capacity / (latency_ms / 1000):,.0f}/s = "
        "partitions x capacity / latency)",
    )
    table.add_row(
        "checkpoints taken",
        f"{result.checkpoints} (every {settings.interval:,} records per partition)",
    )
    if result.crash_recovered:
        table.add_row(
            "task crash",
            f"partition {result.crash_partition} died at record {result.crash_record:,} "
            f"(attempt 0); attempt 1 resumed from {result.recovered_from}",
        )
    if result.requests is None or result.re_requested is None:
        table.add_row("requests", "unknown: the mock service could not be queried after the job")
    else:
        table.add_row(
            "requests",
            f"{result.requests:,} in all; {result.re_requested:,} records re-requested after "
            f"the crash (bound: capacity + interval = {result.repeat_bound:,})"
            if crash
            else f"{result.requests:,} in all; {result.re_requested:,} records requested twice",
        )
    counts = result.metrics
    if counts:
        resumed = (
            f"; {counts['resumed_tasks']} resumed: {counts['restored_results']:,} results "
            f"re-emitted from checkpoints, {counts['restored_in_flight']:,} in flight re-invoked, "
            f"{counts['skipped_inputs']:,} inputs skipped"
            if counts["resumed_tasks"]
            else ""
        )
        table.add_row(
            "job metrics",
            f"{counts['tasks']} tasks finished: {counts['records']:,} records invoked, "
            f"{counts['results']:,} results, {counts['retries']:,} retries, "
            f"{counts['timeouts']:,} timeouts{resumed} (EnrichmentMetrics)",
        )
    verdict = (
        "[bold green]held[/]: every record's result exactly once"
        if result.exactly_once
        else f"[bold red]FAILED[/]: {result.missing} missing, {result.duplicated} duplicated, "
        f"{result.wrong} wrong"
    )
    table.add_row(
        "exactly-once",
        f"{verdict} ({result.output_rows:,} rows in the Delta table)",
    )
    table.add_row("output", escape(f"{result.output_path} (Delta)"))
    table.add_row("checkpoints", escape(result.checkpoint_location))
    table.add_row("Spark's log", escape(result.spark_log))
    out.print(table)
    look = escape(f"{_this_program()} checkpoints list {shlex.quote(result.checkpoint_location)}")
    out.print(f"Look inside: [bold]{look}[/]", soft_wrap=True)  # whole, to copy and paste
    for failure in result.failures:
        err.print(f"[bold red]FAILED[/]: {escape(failure)}", highlight=False, soft_wrap=True)
    if result.failures:
        raise typer.Exit(1)


# -- checkpoints -------------------------------------------------------------------------------


def _store(location: str, storage_option: list[str] | None = None) -> Any:
    from checkpoint import SnapshotStore
    from checkpoint._layout import is_local, location_exists, missing_location

    options: dict[str, str] = {}
    for setting in storage_option or []:
        key, equals, value = setting.partition("=")
        if not equals or not key.strip():
            raise Fail(
                f"--storage-option {setting!r} is not KEY=VALUE (e.g. AWS_REGION=eu-west-1)."
            )
        if options.get(key.strip(), value) != value:  # (values unsaid: secrets, maybe)
            raise Fail(
                f"--storage-option {key.strip()} was given twice, with different values; "
                "give each key once."
            )
        options[key.strip()] = value
    store = SnapshotStore(location, options or None)
    if options and is_local(store.location):  # (a mistyped URI, maybe: s3:/bucket/...)
        _say(
            err,
            escape(
                f"Warning: the --storage-option (-o) settings {', '.join(options)} are not "
                f"used: {store.location} is a local directory, and storage options are for "
                "object stores. Leave -o out, or give the location as the store's URI "
                "(s3://bucket/path, ...)."
            ),
            highlight=False,
        )
    if not location_exists(store.location, store.storage_options):
        raise Fail(missing_location(store.location))
    _check_layout(store)
    return store


def _jobs(store: Any) -> list[str]:
    """The location's jobs; none is an error that says where the checkpoints may be."""
    from checkpoint import SnapshotStore

    jobs: list[str] = store.jobs()
    if jobs:
        return jobs
    # The parent of a location? Looked for in a few subdirectories only: on an object
    # store every listing is a request, and a mistyped bucket root may hold thousands.
    below = [
        n
        for n in store._dirs()[:_PROBED_SUBDIRS]
        if SnapshotStore(f"{store.location}/{n}", store.storage_options).jobs()
    ]
    if below:
        paths = ", ".join(f"{store.location}/{n}" for n in below)
        raise Fail(
            f"{store.location} holds no checkpoints itself; the checkpoint location is one "
            f"level down: {paths}"
        )
    raise Fail(f"{store.location} holds no checkpoints.")


def _check_layout(store: Any) -> None:
    """Refuse, with the right path, a directory inside or beside a checkpoint location
    (which holds <job_id>/<operator_id>/subtask=<n> tables)."""
    from checkpoint._layout import subtask_numbers

    location = store.location
    list_dirs = store._dirs

    def up(levels: int) -> str:
        return location.rsplit("/", levels)[0] or "/"

    def tables(*parts: str) -> list[str]:  # the subtask tables directly under location/parts
        names = list_dirs(*parts)
        return [n for n in names if subtask_numbers([n]) and "_delta_log" in list_dirs(*parts, n)]

    top = list_dirs()
    if "_delta_log" in top and subtask_numbers([location.rsplit("/", 1)[-1]]):
        raise Fail(
            f"{location} is one partition's checkpoint table; pass the checkpoint location, "
            f"three levels up: {up(3)}"
        )
    if "_delta_log" in top:
        raise Fail(
            f"{location} is a Delta table, not a checkpoint location. Pass the directory given "
            "to CheckpointConfig as location (it holds <job_id>/<operator_id>/subtask=<n> "
            "tables)."
        )
    if tables():
        raise Fail(
            f"{location} is one operator's directory of a checkpoint location; pass the "
            f"location itself, two levels up: {up(2)}"
        )
    if any(tables(name) for name in top):
        raise Fail(
            f"{location} is one job's directory of a checkpoint location; pass the location "
            f"itself, one level up: {up(1)}"
        )


def _job(store: Any, job: str | None) -> str:
    jobs = _jobs(store)
    if job is not None:
        if job not in jobs:
            raise Fail(
                f"Job {job!r} has no checkpoints at {store.location}. Jobs there: "
                f"{', '.join(jobs)}."
            )
        return job
    if len(jobs) > 1:
        raise Fail(f"{store.location} holds several jobs ({', '.join(jobs)}): pass --job.")
    return str(jobs[0])


def _print_table(table: Table) -> None:
    """A terminal gets the table at its width if its cells can wrap to fit it; otherwise,
    and in a pipe or file, every column is printed whole (rich would cut cells, and drop
    the last columns, to fit the terminal or 80 columns: "final" read "f")."""
    measure = out.measure(table, options=out.options.update_width(10_000))
    # rich's minimum counts a no_wrap cell at its longest word, not at its whole text
    needed = measure.maximum if all(c.no_wrap for c in table.columns) else measure.minimum
    if out.is_terminal and needed <= out.width:
        out.print(table)
        return
    _Console(width=max(out.width, measure.maximum)).print(table)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@checkpoints_app.command("list", cls=_Command)
def list_checkpoints(
    location: LocationArg,
    job: Annotated[str | None, typer.Option(help="Only this job.")] = None,
    include_expired: Annotated[bool, typer.Option("--all", help="Show expired ones too.")] = False,
    storage_option: StorageOpt = None,
) -> None:
    """A table of checkpoints: one row per (job, run, id), summed over partitions."""
    with _user_errors():
        store = _store(location, storage_option)
        jobs = _jobs(store) if job is None else [_job(store, job)]
        groups: dict[tuple[str, str, str, int], dict[str, Any]] = {}
        for name in jobs:
            found = store.map_subtasks(
                name, None, lambda log: (log.sizes(), log.checkpoints(include_expired))
            )
            for sizes, metas in found:
                for meta in metas:
                    key = (name, meta.operator_id, meta.run_id, meta.checkpoint_id)
                    g = groups.setdefault(
                        key,
                        {
                            "partitions": 0,
                            "in_flight": 0,
                            "results": 0,
                            "position": 0,
                            "created": meta.created_at,
                            "size": 0,
                            "unsized": 0,
                            "final": 0,
                            "expired": 0,
                        },
                    )
                    g["partitions"] += 1
                    g["in_flight"] += meta.in_flight
                    g["results"] += meta.result_count
                    g["position"] += meta.position
                    g["created"] = max(g["created"], meta.created_at)
                    if meta.ref in sizes:
                        g["size"] += sizes[meta.ref]
                    else:  # in files `expire` rewrote, shared with other checkpoints
                        g["unsized"] += 1
                    g["final"] += meta.final
                    g["expired"] += meta.expired
        if not groups and job is not None:  # the location may hold other jobs' checkpoints
            raise Fail(
                f"Job {job} has no checkpoints at {store.location}: none was committed (a "
                "task stopped before its first checkpoint leaves an empty table), or all were "
                "deleted (as by `checkpoints expire --retain 0`)."
            )
        if not groups:  # e.g. all deleted by `checkpoints expire --retain 0`
            raise Fail(f"{store.location} holds no checkpoints.")
        runs: dict[tuple[str, str, str], list[tuple[int, dict[str, Any]]]] = {}
        for (name, operator, run, ckpt), g in groups.items():
            runs.setdefault((name, operator, run), []).append((ckpt, g))
        ordered = sorted(runs.items(), key=lambda kv: min(g["created"] for _, g in kv[1]))
        for (name, operator, run), rows in ordered:
            table = Table(
                title=escape(f"job {name}, operator {operator}, run {run}"),
                title_justify="left",
                box=box.SIMPLE_HEAD,
                pad_edge=False,
                padding=(0, 1, 0, 0),  # two spaces between columns: 80 wide, as a rule
            )
            for column in (
                "id",
                "parts",
                "in flight",
                "results",
                "position",
                "created (UTC)",
                "size",
                "state",
            ):
                table.add_column(
                    column,
                    no_wrap=True,
                    min_width=len(column),
                    justify="left" if column in ("created (UTC)", "state") else "right",
                )
            for ckpt, g in sorted(rows, key=lambda r: r[0]):
                if g["expired"] == g["partitions"]:
                    state = "expired"
                elif g["final"] == g["partitions"] and not g["expired"]:
                    state = "final"
                else:  # some partitions only (each expires its own)
                    state = ", ".join(f"{g[key]} {key}" for key in ("final", "expired") if g[key])
                table.add_row(
                    str(ckpt),
                    str(g["partitions"]),
                    f"{g['in_flight']:,}",
                    f"{g['results']:,}",
                    f"{g['position']:,}",
                    g["created"].strftime("%Y-%m-%d %H:%M:%S"),
                    "-" if g["unsized"] else _size(g["size"]),
                    state,
                )
            _print_table(table)


@checkpoints_app.command("show", cls=_Command)
def show_checkpoint(
    location: LocationArg,
    checkpoint_id: CheckpointIdArg,
    job: JobOpt = None,
    partition: PartitionOpt = None,
    run: RunOpt = None,
    operator: OperatorOpt = None,
    format: Annotated[Format, typer.Option("--format", help="Output format.")] = Format.table,
    storage_option: StorageOpt = None,
) -> None:
    """The in-flight records and watermarks of one snapshot."""
    with _user_errors():
        store = _store(location, storage_option)
        snapshots = _snapshots(store, _job(store, job), checkpoint_id, operator, partition, run)
        # each row as replay gives it to the function (MAP values as dicts), so that the two
        # write a value alike
        shown = [(s, _as_the_function_sees_them(store, s)) for s in snapshots]
        if format is Format.json:
            payload = [
                {
                    "job": s.metadata.job_id,
                    "operator": s.metadata.operator_id,
                    "partition": s.metadata.subtask,
                    "run": s.metadata.run_id,
                    "checkpoint_id": s.metadata.checkpoint_id,
                    "final": s.metadata.final,  # the table says "Final checkpoint"
                    "position": s.metadata.position,
                    "results_committed": s.metadata.result_count,
                    "properties": dict(s.metadata.properties),
                    "elements": [
                        {
                            "kind": "watermark" if _is_watermark(e) else "record",
                            "input_seq": seq,
                            "timestamp": e.timestamp,
                            "value": None if _is_watermark(e) else e.value,
                        }
                        for e, seq in zip(elements, s.input_seqs, strict=True)
                    ],
                }
                for s, elements in shown
            ]
            sys.stdout.write(_to_json(payload, indent=2) + "\n")
            return
        for s, elements in shown:
            m = s.metadata
            watermarks = sum(map(_is_watermark, s.elements))
            records = len(s.elements) - watermarks
            counts = [
                f"{n} {kind}{'s' if n != 1 else ''}"
                for n, kind in ((records, "record"), (watermarks, "watermark"))
                if n
            ]
            # a line of its own (a table's title wraps at the table's width)
            _say(
                out,
                escape(
                    f"{'Final checkpoint' if m.final else 'Checkpoint'} {m.checkpoint_id} of job "
                    f"{m.job_id}, partition {m.subtask} (run {m.run_id}): "
                    f"{' and '.join(counts) or 'nothing'} in flight at input position "
                    f"{m.position:,}"
                ),
                highlight=False,
            )
            if not s.elements:
                continue
            when = _event_time_text(store, m)
            table = Table()
            for column in ("#", "kind", "input seq", "timestamp", "value"):
                table.add_column(column)
            for i, (e, seq) in enumerate(zip(elements, s.input_seqs, strict=True)):
                table.add_row(
                    str(i),
                    "watermark" if _is_watermark(e) else "record",
                    "" if seq is None else str(seq),
                    "" if e.timestamp is None else when(e.timestamp),
                    Text("" if _is_watermark(e) else _to_json(e.value)),
                )
            _print_table(table)


@checkpoints_app.command(
    "expire",
    cls=_Command,
    help=(
        "Keep the newest N checkpoints of every partition; drop and vacuum the rest, and "
        "delete the files no checkpoint uses once older than --orphans-older-than.\n\n"
        "Run it while the job is not running: against a running job it competes with the "
        "tasks' commits (it retries, then gives up saying so); a task reading files its vacuum "
        "deletes reads the table's newer version instead, and fails (Spark retries it) only if "
        "the checkpoint it reads was expired meanwhile; a task whose last checkpoint it deletes "
        "(--retain 0) fails its next commit, and Spark's retry starts its partition over."
    ),
)
def expire_checkpoints(
    location: LocationArg,
    retain: Annotated[
        int,
        typer.Option(help="Checkpoints to keep per partition: 0 or more (0 deletes them all)."),
    ],
    job: JobOpt = None,
    storage_option: StorageOpt = None,
    orphans_older_than: Annotated[
        float,
        typer.Option(
            metavar="HOURS",
            help="Also delete the files no checkpoint uses (left by commits that never "
            "completed: a task killed mid-commit) once they are this many hours old (rounded "
            "up to whole hours); newer ones may belong to a commit still running, so 0 is "
            "only for a job that is not running.",
        ),
    ] = 24.0,  # checkpoint.ORPHAN_GRACE (not imported here: it loads deltalake)
) -> None:
    """Keep the newest N checkpoints of every partition; drop and vacuum the rest."""
    with _user_errors():
        _check_at_least("--retain", retain, 0, "the checkpoints to keep per partition")
        from checkpoint import CheckpointError
        from checkpoint._store import _MAX_GRACE_HOURS, grace_hours

        try:
            hours = grace_hours(orphans_older_than * 3600)
        except CheckpointError:
            raise Fail(
                f"--orphans-older-than must be a number of hours from 0 up to "
                f"{_MAX_GRACE_HOURS:,}; got {orphans_older_than}."
            ) from None
        store = _store(location, storage_option)
        name = _job(store, job)
        if hours == 0:
            _say(
                err,
                "Warning: --orphans-older-than 0 deletes the file of any commit still in "
                "progress. If a job is writing to this location, a partition whose commit "
                "logs a file deleted here can no longer be read, and its checkpoints are "
                "lost: use 0 only while no job runs.",
            )
        # Each partition's table on its own, so that what was done before an error is said
        orphans, failed = _each_table(store, name, lambda log: log.remove_orphans(hours * 3600))
        orphan_line = (
            f"{sum(map(len, orphans.values()))} file(s) no checkpoint used (left by commits "
            f"that never completed), older than {hours} hour(s), deleted."
        )
        if failed:
            _say(out, orphan_line)
            _fail_in_tables(
                failed,
                len(orphans) + len(failed),
                "Deleting the files no checkpoint uses",
                "No checkpoint was expired",
            )
        done, failed = _each_table(store, name, lambda log: log.expire(retain))
        # per operator, so checkpoints are counted as `list` shows them: one per run and id
        expired: dict[str, list[Any]] = {}
        deleted: dict[str, list[Any]] = {}
        for log, report in done.items():
            expired.setdefault(log.operator_id, []).extend(report.expired)
            deleted.setdefault(log.operator_id, []).extend(report.deleted)
        whose = f"Job {name}" + (
            f", {len(done)} of {len(done) + len(failed)} partition(s)" if failed else ""
        )
        _say(
            out,
            f"{escape(whose)}: {sum(len(set(e)) for e in expired.values())} checkpoint(s) "
            f"expired ({sum(map(len, expired.values()))} partition snapshot(s); state dropped, "
            f"results kept for later checkpoints), {sum(len(set(d)) for d in deleted.values())} "
            f"deleted ({sum(map(len, deleted.values()))} partition snapshot(s)), "
            f"{sum(r.files_removed for r in done.values())} file(s) removed from storage.",
        )
        _say(out, orphan_line)
        if failed:
            _fail_in_tables(
                failed,
                len(done) + len(failed),
                "Expiring the checkpoints",
                "The other partitions' checkpoints were expired, as said above",
            )


def _each_table(
    store: Any, job: str, work: Callable[[Any], Any]
) -> tuple[dict[Any, Any], dict[Any, BaseException]]:
    """``work`` on each partition's table of the job: what it returned, per table (in
    operator and partition order), and the error of each table where it failed (the
    others are done all the same)."""

    def attempt(log: Any) -> tuple[Any, Any, BaseException | None]:
        try:
            return log, work(log), None
        except (KeyboardInterrupt, SystemExit):
            raise  # the user stopping the command: no summary of a half-done expiry first
        except BaseException as exc:  # (a delta-rs panic is one): said after what was done
            return log, None, exc

    done: dict[Any, Any] = {}
    failed: dict[Any, BaseException] = {}
    for log, result, error in store.map_subtasks(job, None, attempt):
        if error is None:
            done[log] = result
        else:
            failed[log] = error
    return done, failed


def _fail_in_tables(
    failed: dict[Any, BaseException], tables: int, doing: str, meanwhile: str
) -> None:
    """Raise the error of the first table that failed: as it is if it is no user error,
    else as a Fail that says which partitions failed and what to do."""
    for error in failed.values():
        if not isinstance(error, StatefulAsyncError):
            raise error
    by_operator: dict[str, list[int]] = {}
    for log in failed:
        by_operator.setdefault(log.operator_id, []).append(log.subtask)
    where = "; ".join(
        f"operator {op}, partition{'s' if len(parts) > 1 else ''} {id_ranges(parts)}"
        for op, parts in by_operator.items()
    )
    first = str(next(iter(failed.values())))
    raise Fail(
        f"{doing} failed in {len(failed)} of {tables} partition(s) ({where}): {first}"
        f"{'' if first.endswith('.') else '.'} {meanwhile}; run the command again once the "
        "cause is fixed."
    )


# -- replay ------------------------------------------------------------------------------------


@app.command(cls=_Command)
def replay(
    location: LocationArg,
    checkpoint_id: CheckpointIdArg,
    function: Annotated[str, typer.Option(help="The async function, as module:attribute.")],
    output: Annotated[
        Path | None,
        typer.Option(
            help="Write results here (.jsonl: one JSON object per line; .json: one JSON "
            "array of them; .parquet); default: stdout, as JSON lines."
        ),
    ] = None,
    job: JobOpt = None,
    partition: PartitionOpt = None,
    run: RunOpt = None,
    operator: OperatorOpt = None,
    capacity: Annotated[int, typer.Option(help="Calls in flight (1 or more).")] = 100,
    timeout: Annotated[
        float | None,
        typer.Option(help="Per-element timeout, seconds > 0 (default: none)."),
    ] = None,
    mode: Annotated[Mode, typer.Option(help="Output order.")] = Mode.ordered,
    storage_option: StorageOpt = None,
) -> None:
    """Restore the operator from a snapshot and invoke the function again on the elements
    it had in flight; print or write the results."""
    with _user_errors():
        _check_at_least("--capacity", capacity, 1, "the calls in flight at once")
        if timeout is not None and not 0 < timeout < math.inf:
            raise Fail(
                f"--timeout must be a finite number of seconds > 0; got {timeout}. Omit it "
                "for no timeout."
            )
        if output is not None:
            _check_output(output)
        fn = _import_function(function)
        store = _store(location, storage_option)
        snapshots = _snapshots(store, _job(store, job), checkpoint_id, operator, partition, run)
        results: list[Any] = []
        close_errors: list[Exception] = []
        for s in snapshots:
            elements = _as_the_function_sees_them(store, s)
            replayed, close_error = asyncio.run(
                _replay(fn, elements, capacity, timeout, mode.value)
            )
            results.extend(replayed)
            if close_error is not None:
                close_errors.append(close_error)
        if output is None:
            for line in [_to_json(row) for row in results]:  # none printed if one fails
                sys.stdout.write(line + "\n")
        elif output.suffix == ".parquet" and not results:
            # no rows, no schema: an empty file without columns would only mislead
            _say(err, f"No results, so no Parquet file was written to {escape(str(output))}.")
        elif output.suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            row = next((r for r in results if not isinstance(r, dict)), None)
            if row is not None:  # (pyarrow: "'set' object has no attribute 'keys'")
                raise Fail(
                    f"A Parquet file takes results that are dicts, one a row; the function "
                    f"gave a {type(row).__name__}: {row!r:.200}. Return dicts, or write the "
                    "results as JSON lines instead (--output with .jsonl)."
                )
            try:
                table = pa.Table.from_pylist([_sets_sorted(row) for row in results])
            except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
                raise Fail(
                    f"The results do not fit one Parquet schema ({exc}); write them as JSON "
                    "lines instead (--output with .jsonl)."
                ) from exc
            _write(output, "xb", lambda handle: pq.write_table(table, handle))
        else:
            lines = [_to_json(row) for row in results]  # first: a failure leaves no file
            if output.suffix == ".json":  # one document: an array, an object a line
                text = "[\n" + ",\n".join(lines) + "\n]\n" if lines else "[]\n"
            else:
                text = "".join(line + "\n" for line in lines)
            _write(output, "x", lambda handle: handle.write(text))
        records = sum(1 for s in snapshots for e in s.elements if not _is_watermark(e))
        _say(
            err,
            f"Replayed checkpoint {checkpoint_id} {_of_runs(snapshots)}: {records} in-flight "
            "record(s) of "
            f"{len(snapshots)} partition(s) gave {len(results)} result(s)"
            + (f", written to {escape(str(output))}." if output and output.exists() else "."),
        )
        if close_errors:  # the results are whole and kept: the function's clean-up failed
            error = close_errors[0]
            raise Fail(
                f"The function's close() raised {type(error).__name__}: {error_text(error)} "
                f"(in {len(close_errors)} of the {len(snapshots)} partition(s) replayed), after "
                "every result was computed: the results are whole and were kept, but the "
                "function may not have released what it holds (connections, clients). Fix "
                "its close()."
            )


def _check_output(output: Path) -> None:
    """Refuse, before the function is called, an output path replay cannot write to."""
    if output.suffix not in (".jsonl", ".json", ".parquet"):
        raise Fail(f"The output path {output} must end in .jsonl, .json or .parquet.")
    # os.stat, not Path.exists() / is_dir(): those take a directory that is a file for a
    # missing one, and (Python 3.14's) one that cannot be searched too
    directory = output.absolute().parent
    try:
        try:
            os.lstat(output)  # a symbolic link too, even one to nothing
        except (FileNotFoundError, NotADirectoryError):
            pass
        else:
            raise Fail(f"The output path {output} already exists; choose a new one.")
        for above in (*reversed(directory.parents), directory):  # the first that is no folder
            try:
                mode = os.stat(above).st_mode
            except FileNotFoundError:
                raise Fail(
                    f"The output path {output} is in a directory that does not exist: create "
                    f"{directory} first, or choose another path."
                ) from None
            if not stat.S_ISDIR(mode):
                raise Fail(
                    f"The output path {output} is under {above}, which is not a directory; "
                    "choose another path."
                )
        output.open("x").close()  # e.g. a read-only directory, a name too long
        output.unlink()
    except OSError as exc:
        raise Fail(
            f"Cannot write to the output path {output}: {_os_reason(exc)}. Choose another path."
        ) from None


def _write(output: Path, mode: str, write: Callable[[Any], object]) -> None:
    """``write`` the results to a new file at ``output``; an error leaves no file there."""
    try:
        handle = open(output, mode)  # noqa: SIM115 - closed below, its failure included
    except OSError as exc:  # (FileExistsError too: that file is not ours to remove)
        raise _not_written(output, exc) from None
    try:
        with handle:  # closing writes what is buffered: it can fail too (a full disk)
            write(handle)
    except BaseException as exc:
        with suppress(OSError):
            output.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _not_written(output, exc) from None
        raise


def _not_written(output: Path, exc: OSError) -> Fail:
    return Fail(
        f"Cannot write the results to {output}: {_os_reason(exc)}. They were not kept; "
        "replay again with another --output."
    )


def _os_reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _as_the_function_sees_them(store: Any, snapshot: Any) -> list[Any]:
    """A snapshot's elements with each record's row as a Spark job's function receives it
    (what replay calls the function with, and show writes): the store gives ``MAP`` values
    as pyarrow does, as lists of (key, value) pairs."""
    from . import StreamRecord
    from .spark._task import _argument_maker

    schema = _input_schema(store, snapshot.metadata)
    if schema is None:
        return list(snapshot.elements)
    argument = _argument_maker(schema)
    return [
        e if _is_watermark(e) else StreamRecord(argument(e.value), e.timestamp)
        for e in snapshot.elements
    ]


async def _replay(
    fn: Any, elements: list[Any], capacity: int, timeout: float | None, mode: str
) -> tuple[list[Any], Exception | None]:
    """The results of the function called again on ``elements``, and what its ``close()``
    raised after every one of them was computed (None: nothing), which does not make them
    any less whole. A failure before that is raised; a ``close()`` failing after it too is
    only said, so that the failure is what the error names (as a Spark task does)."""
    from . import AsyncWaitOperator, StreamRecord

    results: list[Any] = []

    def collect(element: Any) -> None:
        if isinstance(element, StreamRecord):
            results.append(element.value)

    operator = AsyncWaitOperator(fn, collect, mode, capacity=capacity, timeout=timeout)
    try:
        try:
            await operator.open(restored=elements)
        except StatefulAsyncError:
            raise
        except Exception as exc:
            raise Fail(
                f"The function's open() raised {type(exc).__name__}: {error_text(exc)}; nothing "
                "was replayed. Fix the cause (a service or credentials it needs that this "
                "machine lacks?) and replay again."
            ) from exc
        await operator.finish()
    except BaseException:
        try:
            await operator.close()
        except Exception as exc:
            _say(
                err,
                f"[yellow]Warning:[/] the function's close() raised {type(exc).__name__}: "
                f"{escape(error_text(exc))} too.",
                highlight=False,
            )
        raise
    try:
        await operator.close()
    except Exception as exc:
        return results, exc
    return results, None


def _import_function(spec: str) -> Any:
    from ._function import AsyncFunction, as_async_function

    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise Fail(f"--function must look like module:attribute (e.g. myjob:enrich); got {spec!r}.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise Fail(
            f"Cannot import module {module_name!r} for --function: {type(exc).__name__}: {exc}."
        ) from exc
    try:
        target = getattr(module, attribute)
    except AttributeError:
        raise Fail(
            f"Module {module_name!r} has no attribute {attribute!r} (from --function {spec})."
        ) from None
    if isinstance(target, type) and issubclass(target, AsyncFunction):
        try:
            target = target()
        except TypeError as exc:
            raise Fail(
                f"{spec} is an AsyncFunction class that needs arguments ({exc}); point "
                "--function at an instance instead."
            ) from exc
    try:
        return as_async_function(target)
    except StatefulAsyncError as exc:
        raise Fail(f"--function {spec}: {exc}") from exc


def _snapshots(
    store: Any,
    job: str,
    checkpoint_id: int,
    operator: str | None,
    partition: int | None,
    run: str | None,
) -> list[Any]:
    operators = store.operators(job)
    if operator is None:
        if len(operators) != 1:
            raise Fail(
                f"Job {job} has several operators ({', '.join(operators)}): pass --operator."
            )
        operator = operators[0]
    elif operator not in operators:
        raise Fail(f"Job {job} has no operator {operator!r}; it has {', '.join(operators)}.")
    subtasks = store.subtasks(job, operator)
    if partition is not None and partition not in subtasks:
        raise Fail(
            f"Job {job} has no partition {partition}; it has partitions {id_ranges(subtasks)}."
        )
    # one partition's table alone when one is asked for: a job may have thousands
    every = (  # expired ones too: for the message
        store.checkpoints(job, operator, include_expired=True)
        if partition is None
        else store.subtask(job, operator, partition).checkpoints(include_expired=True)
    )
    runs = sorted({m.run_id for m in every})
    if run is not None and run not in runs:
        whose = f"Job {job}" + (f", partition {partition}," if partition is not None else "")
        raise Fail(f"{whose} has no run {run!r}; its runs: {', '.join(runs) or 'none'}.")
    chosen = [m for m in every if run is None or m.run_id == run]
    metas = [m for m in chosen if m.checkpoint_id == checkpoint_id and not m.expired]
    if not metas:
        ids = sorted({m.checkpoint_id for m in chosen if not m.expired})
        where = (
            f"job {job}"
            + (f", partition {partition}" if partition is not None else "")
            + (f", run {run}" if run else "")
        )
        if any(m.checkpoint_id == checkpoint_id for m in chosen):
            raise Fail(
                f"Checkpoint {checkpoint_id} of {where} at {store.location} has expired: "
                "retention (the job's `retain`, or `checkpoints expire`) deleted the "
                "in-flight records it held; `checkpoints list --all` shows it. Checkpoint "
                f"ids that can still be shown: {id_ranges(ids)}."
            )
        raise Fail(
            f"There is no checkpoint {checkpoint_id} of {where} at {store.location}. "
            f"Checkpoint ids that exist: {id_ranges(ids)}."
        )
    newest: dict[int, Any] = {}
    for m in metas:  # sorted oldest first: the newest with this id wins per partition
        newest[m.subtask] = m
    return [
        store.subtask(job, operator, p).load(m.checkpoint_id, m.run_id)
        for p, m in sorted(newest.items())
    ]


def _of_runs(snapshots: list[Any]) -> str:
    """Which run each replayed snapshot is of: without ``--run``, each partition's newest
    run with the id, so one replay can span runs (a streaming query's micro-batches)."""
    runs: dict[str, list[int]] = {}
    for s in snapshots:
        runs.setdefault(s.metadata.run_id, []).append(s.metadata.subtask)
    if len(runs) == 1:
        return escape(f"of run {next(iter(runs))}")
    return escape(
        "of runs "
        + ", ".join(f"{run} (partitions {id_ranges(parts)})" for run, parts in runs.items())
    )


def _input_schema(store: Any, meta: Any) -> Any:
    """The input schema a checkpoint's partition was written with (None if unreadable)."""
    schemas = store.subtask(meta.job_id, meta.operator_id, meta.subtask).schemas()
    return None if schemas is None else schemas[0]


def _event_time_text(store: Any, meta: Any) -> Callable[[int], str]:
    """How to show a snapshot's timestamps: the event times of a Spark job's timestamp or
    date ``event_time`` column are held as microseconds or days since the epoch (its
    checkpoints name the column; their input schema gives its type); anything else, or
    a value beyond the type's range (the lowest watermark), as the integer it is."""
    from .spark._task import EVENT_TIME_PROPERTY

    column = meta.properties.get(EVENT_TIME_PROPERTY)
    schema = None if column is None else _input_schema(store, meta)
    if schema is None or column not in schema.names:
        return str
    import pyarrow.types as pa_types

    kind = schema.field(column).type
    epoch = dt.datetime(1970, 1, 1)
    if pa_types.is_timestamp(kind):
        zone = dt.timezone.utc if kind.tz else None

        def convert(value: int) -> str:
            return (epoch + dt.timedelta(microseconds=value)).replace(tzinfo=zone).isoformat()

    elif pa_types.is_date(kind):

        def convert(value: int) -> str:
            return (epoch.date() + dt.timedelta(days=value)).isoformat()

    else:
        return str

    def text(value: int) -> str:
        try:
            return convert(value)
        except OverflowError:
            return str(value)

    return text


def _is_watermark(element: Any) -> bool:
    from . import Watermark

    return isinstance(element, Watermark)


def _to_json(value: Any, indent: int | None = None) -> str:
    """``value`` as standard JSON: dates and times as ISO strings, decimals and UUIDs as
    strings, bytes as base64, durations as seconds, sets as sorted lists, numpy values as
    the Python values they hold (not as their ``str``: "5", "True"), and floats that JSON
    has no number for (NaN, +-infinity) as the strings ``"NaN"``, ``"Infinity"``,
    ``"-Infinity"`` (Python would write bare ``NaN``, which strict parsers refuse). A value
    of any other type (an object, a complex number) is refused (Fail), where its ``str``
    ("{1, 2}" for a set, "<... object at 0x...>") was written as if it were a string."""
    return json.dumps(_finite(value), default=_json_default, indent=indent, allow_nan=False)


def _finite(value: Any) -> Any:
    value = _plain(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):  # keys as JSON writes them (a MAP<DATE, ...>'s dates too)
        written: dict[str, Any] = {}  # each key's text in JSON: the key it is from
        for k in value:
            text = _key_text(_json_key(k))
            if text in written:
                raise Fail(_same_json_key(written[text], k, text))
            written[text] = k
        return {_json_key(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, (set, frozenset)):  # a list, as pyarrow takes one; no order of its own
        return [_finite(v) for v in _sorted_set(value)]
    return value


def _sorted_set(items: set[Any] | frozenset[Any]) -> list[Any]:
    """A set's items in a stable order (a set of strings iterates in another order in each
    process): numbers or strings sorted, any others by their JSON text, for they may not
    compare (1 and "a"), or compare in part only, so that sorted() keeps the set's order
    (frozensets, which compare as subsets; NaN, which compares with nothing)."""
    plain = [_plain(item) for item in items]
    if all(isinstance(item, str) for item in plain) or all(
        isinstance(item, (int, float)) and item == item  # (not NaN)
        for item in plain
    ):
        return sorted(plain)
    return sorted(plain, key=_to_json)


def _sets_sorted(value: Any) -> Any:
    """``value`` with its sets, at any depth, as the lists JSON output writes them (see
    ``_sorted_set``), for Parquet: pyarrow takes a set as a list in its iteration order,
    which differs from one process to the next."""
    if isinstance(value, (set, frozenset)):
        return [_sets_sorted(item) for item in _sorted_set(value)]
    if isinstance(value, dict):
        return {key: _sets_sorted(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):  # a tuple is a struct's fields, by position
        items = [_sets_sorted(item) for item in value]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def _json_key(key: Any) -> Any:
    """A dict key as JSON writes it: keys json takes as they are, others as their values
    are written (a date as its ISO string, bytes as base64, ...)."""
    key = _plain(key)
    if key is None or isinstance(key, (str, int, bool)):
        return key
    if isinstance(key, float):
        return _finite(key)
    if isinstance(key, (tuple, frozenset)):  # a value JSON writes as a list, no key's text
        raise Fail(
            f"A dict to write as JSON has the key {key!r:.200} ({_type_name(key)}), which "
            "JSON has no key for: its keys are strings, and numbers, booleans, dates, "
            "decimals and bytes are written as their text. Give that dict keys of those "
            "types (in replay, in the function's results)."
        )
    return str(_finite(_json_default(key)))


def _key_text(key: Any) -> str:
    """The text JSON writes for a key _json_key gave."""
    if isinstance(key, str):
        return key
    return json.dumps(key)  # True as true, None as null, 1.5 as 1.5


def _type_name(value: Any) -> str:
    cls = type(value)
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


def _same_json_key(first: Any, second: Any, text: str) -> str:
    return (
        f"A dict to write as JSON has the keys {first!r} ({_type_name(first)}) and {second!r} "
        f"({_type_name(second)}), which JSON writes as the same key {json.dumps(text)}: one "
        "would hide the other. Give that dict's keys one type (in replay, in the "
        "function's results)."
    )


def _plain(value: Any) -> Any:
    """A numpy scalar or array as the Python value it holds (np.int64 an int, np.bool_ a
    bool, an array a list), as pyarrow takes it for Parquet; anything else as it is. A
    datetime64 or timedelta64 that no datetime or timedelta holds (nanoseconds, for which
    numpy's tolist() gives a bare count) as the ISO string, or the seconds, JSON writes of
    those."""
    if type(value).__module__ != "numpy" or not hasattr(value, "tolist"):
        return value
    kind = numpy_kind(value)
    if kind not in ("M", "m"):
        return value.tolist()
    if getattr(value, "ndim", 0):  # an array of them: each as a scalar
        return [_plain(item) for item in value]
    if getattr(value, "shape", None) == ():  # a 0-d array: its scalar
        value = value[()]
    plain = value.tolist()  # a date, datetime or timedelta; None for NaT; else an int
    if not isinstance(plain, int):
        return plain
    import numpy as np

    if kind == "M":
        return str(np.datetime_as_string(value))
    try:
        return float(value / np.timedelta64(1, "s"))
    except TypeError:  # months or years: no fixed number of seconds
        return str(value)


def _json_default(value: Any) -> Any:
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, uuid.UUID):
        return str(value)
    raise Fail(
        f"A value to write as JSON, {value!r:.200} ({_type_name(value)}), has no JSON form. "
        "JSON holds dicts, lists, strings, numbers, booleans and null; dates and times are "
        "written as ISO strings, decimals and UUIDs as strings, bytes as base64, durations "
        "as seconds, sets as sorted lists. Convert it to one of those (in replay, in the "
        "function's results)."
    )


def _this_program() -> str:
    """How to run this command line again from any shell: the ``stateful-async`` next to
    this Python (a virtualenv's bin/, which need not be on the PATH), or ``python -m``;
    quoted for the shell (a path may hold spaces)."""
    import shutil

    script = Path(sys.executable).with_name("stateful-async")
    if script.exists():
        if shutil.which("stateful-async") == str(script):
            return "stateful-async"
        return shlex.quote(str(script))
    return f"{shlex.quote(sys.executable)} -m stateful_async.cli"


def _summaries_on_one_line(*apps: typer.Typer) -> None:
    """Set each command's summary, which a group's help lists, to its help's first paragraph
    on one line: Typer's rich help keeps that paragraph's line breaks there, so a docstring
    wrapped in the source showed as ragged lines, broken mid-sentence."""
    for typer_app in apps:
        for info in typer_app.registered_commands:
            text = info.help or inspect.getdoc(info.callback) or ""
            info.short_help = info.short_help or " ".join(text.split("\n\n")[0].split())


_summaries_on_one_line(app, checkpoints_app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
