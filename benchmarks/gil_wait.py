"""How long a helper thread waits for the GIL while the training thread runs forward's Python.

cswap's sender thread waits for an encode's sizes with the GIL released (an event wait),
then needs the GIL to make the header and queue the copy out. On the H200 that took 2.6-4.4 ms
whenever the training thread was running forward (benchmarks/send_gaps.py). This measures the
mechanism on any machine: a training loop that alternates Python (`--python-us` of it, as
module calls and hooks) with a small torch op (which releases the GIL, as every aten call
does), and a helper that sleeps `--wait-ms` with the GIL released, then times how long it took
to get it back, under each of Python's switch intervals (sys.setswitchinterval). A control
runs the longest Python gap with no torch op, so that the loop never lets the GIL go itself.
It also reports the training loop's rate against the loop alone. Measured, on the machine it
runs on.

    python benchmarks/gil_wait.py
    python benchmarks/gil_wait.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from common import environment, write_results

RESULTS = Path(__file__).resolve().parent / "results" / "gil-wait"


def _python(iterations: int) -> int:
    total = 0
    for i in range(iterations):
        total += i
    return total


def iterations_per_us() -> float:
    """How many iterations of the Python work make a microsecond on this machine."""
    n = 200_000
    start = time.perf_counter()
    _python(n)
    return n / ((time.perf_counter() - start) * 1e6)


def measure(interval_s: float, python_iterations: int, seconds: float, wait_s: float, helper: bool = True,
            op: bool = True):
    """(training-loop steps per second, the helper's waits for the GIL in seconds, sorted);
    `op`: the loop calls a torch op after its Python (which lets the GIL go while it runs)."""
    saved = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    stop, waits = threading.Event(), []

    def helper_loop():
        while not stop.is_set():
            start = time.perf_counter()
            time.sleep(wait_s)  # (the GIL released, as an event wait releases it)
            waits.append(time.perf_counter() - start - wait_s)
            _python(100)  # (the header and the copy call: a few microseconds of Python)

    x, steps = torch.zeros(256), 0
    thread = threading.Thread(target=helper_loop, daemon=True) if helper else None
    try:
        if thread is not None:
            thread.start()
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            _python(python_iterations)
            if op:
                x.add_(1)
            steps += 1
        elapsed = time.perf_counter() - start
    finally:
        stop.set()
        if thread is not None:
            thread.join()
        sys.setswitchinterval(saved)
    return steps / elapsed, sorted(waits)


def idle_waits(wait_s: float, count: int) -> list[float]:
    """The sleep's own overshoot, no other thread running: the floor of every wait."""
    waits = []
    for _ in range(count):
        start = time.perf_counter()
        time.sleep(wait_s)
        waits.append(time.perf_counter() - start - wait_s)
    return sorted(waits)


def _summary(waits: list[float]) -> dict:
    return {"waits": len(waits), "median_ms": 1e3 * statistics.median(waits),
            "p90_ms": 1e3 * waits[int(0.9 * (len(waits) - 1))], "max_ms": 1e3 * waits[-1]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python-us", type=float, nargs="+", default=[2.0, 8.0, 40.0],
                   help="microseconds of Python between two torch ops in the training loop")
    p.add_argument("--intervals-ms", type=float, nargs="+", default=[5.0, 1.0, 0.2, 0.02],
                   help="switch intervals to try (Python's default: 5 ms)")
    p.add_argument("--seconds", type=float, default=1.5, help="per measurement")
    p.add_argument("--wait-ms", type=float, default=2.0, help="the helper's wait with the GIL released")
    p.add_argument("--quick", action="store_true", help="0.2 s per measurement, two gaps, two intervals")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.seconds, args.python_us, args.intervals_ms = 0.2, [2.0, 40.0], [5.0, 0.2]
    torch.set_num_threads(1)
    per_us = iterations_per_us()
    wait_s = args.wait_ms / 1e3
    idle = _summary(idle_waits(wait_s, max(10, int(args.seconds / wait_s / 4))))
    print(f"# the helper's wait alone (its sleep's overshoot): median {idle['median_ms']:.2f} ms")
    print(f"{'python us':>9} {'torch op':>8} {'interval ms':>11} {'wait median ms':>14} {'p90 ms':>7} {'max ms':>7} "
          f"{'loop x alone':>12}")
    rows = []
    for python_us, op in [(us, True) for us in args.python_us] + [(max(args.python_us), False)]:
        iterations = max(1, round(python_us * per_us))
        alone, _ = measure(0.005, iterations, args.seconds, wait_s, helper=False, op=op)
        for interval_ms in args.intervals_ms:
            rate, waits = measure(interval_ms / 1e3, iterations, args.seconds, wait_s, op=op)
            row = {"python_us": python_us, "torch_op": op, "interval_ms": interval_ms, **_summary(waits),
                   "loop_x_alone": rate / alone}
            rows.append(row)
            print(f"{python_us:9.1f} {'yes' if op else 'no':>8} {interval_ms:11.2f} {row['median_ms']:14.2f} "
                  f"{row['p90_ms']:7.2f} {row['max_ms']:7.2f} {row['loop_x_alone']:12.3f}")
    cpu = torch.device("cpu")
    env = environment(cpu, what="measured: a helper thread's wait for the GIL after a GIL-free sleep, while the "
                                "training loop runs Python and torch ops", torch_threads=1, idle=idle)
    write_results(rows, env, args, args.out, cpu, "gil_wait")
    return {"environment": env, "rows": rows}


if __name__ == "__main__":
    main()
