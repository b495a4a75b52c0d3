"""Operator overhead: AsyncWaitOperator vs a hand-written bounded asyncio loop.

Both run the same async function with the same capacity, in the same process, one after
the other, repeated; the best run of each is kept and the ratio printed
(operator elements/s divided by hand-written elements/s; 1.0 = no overhead).

    python benchmarks/operator_bench.py            # the issue's figures
    python benchmarks/operator_bench.py --quick    # a fast smoke run
    python benchmarks/operator_bench.py --json out.json   # the figures as JSON too

Memory: peak RSS of a fresh process that streams N elements through the operator
(capacity 1000), for N = 10k and 1M: flat means memory is bounded by capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from collections import deque
from typing import Any, Awaitable, Callable

from child import child_output  # benchmarks/ is on sys.path: these are scripts
from options import output_file
from peak_rss import peak_rss_mib

from stateful_async import AsyncWaitOperator, OutputMode, StreamRecord

Fn = Callable[[int], Awaitable[list[int]]]


async def noop(value: int) -> list[int]:
    return [value]


async def sleep_20ms(value: int) -> list[int]:
    await asyncio.sleep(0.02)
    return [value]


FUNCTIONS: dict[str, Fn] = {"noop": noop, "sleep20ms": sleep_20ms}


# -- the hand-written loops users write ----------------------------------------------------


async def handwritten_ordered(fn: Fn, n: int, capacity: int) -> int:
    """A deque of tasks: start up to `capacity`, await the oldest, emit in order."""
    emitted = 0
    pending: deque[asyncio.Future[list[int]]] = deque()
    for i in range(n):
        if len(pending) >= capacity:
            emitted += len(await pending.popleft())
        pending.append(asyncio.ensure_future(fn(i)))
    while pending:
        emitted += len(await pending.popleft())
    return emitted


async def handwritten_unordered(fn: Fn, n: int, capacity: int) -> int:
    """A semaphore bounds the tasks in flight; results are taken as they complete."""
    emitted = 0
    semaphore = asyncio.Semaphore(capacity)

    async def run(i: int) -> None:
        nonlocal emitted
        try:
            results = await fn(i)  # not `emitted += len(await ...)`: that reads before awaiting
            emitted += len(results)
        finally:
            semaphore.release()

    tasks = set()
    for i in range(n):
        await semaphore.acquire()
        task = asyncio.ensure_future(run(i))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    while tasks:
        await asyncio.gather(*tasks)
    return emitted


async def with_operator(fn: Fn, n: int, capacity: int, mode: OutputMode) -> int:
    emitted = 0

    def output(element: Any) -> None:
        nonlocal emitted
        emitted += 1

    op = AsyncWaitOperator(fn, output, mode, capacity=capacity)
    await op.open()
    process = op.process_element
    for i in range(n):
        await process(StreamRecord(i))
    await op.finish()
    await op.close()
    return emitted


def timed(coro_factory: Callable[[], Awaitable[int]], n: int) -> float:
    gc.collect()  # every run starts from the same collector state, not the last run's garbage
    start = time.perf_counter()
    emitted = asyncio.run(coro_factory())  # type: ignore[arg-type]
    elapsed = time.perf_counter() - start
    if emitted != n:
        raise AssertionError(f"emitted {emitted} of {n} results")
    return n / elapsed


def compare(function: str, mode: OutputMode, n: int, capacity: int, repeat: int) -> dict[str, Any]:
    fn = FUNCTIONS[function]
    handwritten = handwritten_ordered if mode is OutputMode.ORDERED else handwritten_unordered
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(repeat):  # interleaved so drifting machine load hits both alike
        theirs.append(timed(lambda: handwritten(fn, n, capacity), n))
        ours.append(timed(lambda: with_operator(fn, n, capacity, mode), n))
    return {
        "function": function,
        "mode": mode.value,
        "capacity": capacity,
        "elements": n,
        "operator_per_s": max(ours),
        "handwritten_per_s": max(theirs),
        "ratio": max(ours) / max(theirs),
    }


# -- memory --------------------------------------------------------------------------------


def _rss_child(n: int, capacity: int, mode: str) -> None:
    async def main() -> None:
        count = 0

        def output(element: Any) -> None:
            nonlocal count
            count += 1

        op = AsyncWaitOperator(noop, output, OutputMode(mode), capacity=capacity)
        await op.open()
        for i in range(n):  # inputs are generated, never held in a list
            await op.process_element(StreamRecord(i))
        await op.finish()
        await op.close()
        assert count == n

    asyncio.run(main())
    print(json.dumps({"peak_rss_mib": peak_rss_mib()}))


def peak_rss(n: int, capacity: int, mode: str) -> float:
    out = child_output([__file__, "--rss-child", str(n), str(capacity), mode])
    return float(json.loads(out.strip().splitlines()[-1])["peak_rss_mib"])


def run(quick: bool = False) -> dict[str, Any]:
    capacity = 1000
    sizes = {"noop": 20_000 if quick else 200_000, "sleep20ms": 10_000 if quick else 100_000}
    repeat = 1 if quick else 5
    rows = [
        compare(function, mode, sizes[function], capacity, repeat)
        for function in ("noop", "sleep20ms")
        for mode in (OutputMode.ORDERED, OutputMode.UNORDERED)
    ]
    memory = []
    for mode in ("ordered", "unordered"):
        small = peak_rss(10_000, capacity, mode)
        large = peak_rss(100_000 if quick else 1_000_000, capacity, mode)
        memory.append(
            {
                "mode": mode,
                "rss_10k_mib": small,
                "rss_large_mib": large,
                "large_elements": 100_000 if quick else 1_000_000,
                "ratio": large / small,
            }
        )
    return {"throughput": rows, "memory": memory}


def report(result: dict[str, Any]) -> str:
    lines = ["function   mode       capacity  elements  operator/s  hand-written/s  ratio"]
    for r in result["throughput"]:
        lines.append(
            f"{r['function']:<10} {r['mode']:<10} {r['capacity']:>8} {r['elements']:>9} "
            f"{r['operator_per_s']:>11,.0f} {r['handwritten_per_s']:>15,.0f} {r['ratio']:>6.2f}x"
        )
    lines.append("")
    lines.append("mode       peak RSS 10k  peak RSS large (n)      ratio")
    for m in result["memory"]:
        lines.append(
            f"{m['mode']:<10} {m['rss_10k_mib']:>9.1f} MiB {m['rss_large_mib']:>9.1f} MiB "
            f"({m['large_elements']:,}) {m['ratio']:>6.2f}x"
        )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rss-child":
        _rss_child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller inputs, one repetition")
    parser.add_argument(
        "--json", metavar="PATH", type=output_file, help="also write the figures as JSON"
    )
    args = parser.parse_args()
    result = run(quick=args.quick)
    if args.json:  # as the other benchmark scripts' --json: a file, the table printed
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    print(report(result))


if __name__ == "__main__":
    main()
