"""(a)'s Ray-worker gap without Ray: the bare step beside synthetic load shaped like a Ray node's.

    python benchmarks/background_load.py --rounds 4

In the suite, (a)'s baseline `bare` runs while the suite's Ray cluster is up but idle; `in_worker` runs the same
loop in a JaxTrainer worker, while the TrainController, the worker actor's own threads and Train's and Data's
helper actors are also up. Counted from `/proc` on the 2-core VM (voluntary + involuntary context switches and
CPU time of every Ray process's threads over 20 s): the idle cluster wakes about 670 times a second for 0.02
cores; during a 1-worker run that is not computing, about 1,900 times a second for 0.07 cores, about 40 us a wake.
So the gap is a few hundredths of a core, cut into over a thousand short pieces a second.

The guess this tests: on 2 cores the bare step's two XLA threads work in lock-step (each op is split between them
and joined), so every wake-up that takes one of their cores stalls both, and short frequent wake-ups cost more
than the CPU they use. With no Ray running, conditions alternate over rounds (reversed on odd rounds):
  quiet    the bare step alone
  wakers   --processes processes (12), each waking --rate times a second (160; Ray's shape: ~1,900 a second)
  hog      one process using, in one burst a second, the CPU `wakers` use on an idle machine
Prints tokens/s per condition and round, each loaded condition's ratio to `quiet` in the same round, and the
cores the load processes used (from /proc) during the step's run; writes nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, Iterator, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import suite  # noqa: E402
import suite_variants as V  # noqa: E402


def load_child(rate: float, burst_us: float) -> None:
    """Wake `rate` times a second (from a random phase) and spin `burst_us` each time, until killed."""
    period, burst = 1.0 / rate, burst_us * 1e-6
    wake = time.perf_counter() + random.random() * period
    while True:
        delay = wake - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        end = time.perf_counter() + burst
        while time.perf_counter() < end:
            pass
        wake += period


def _cpu_seconds(pid: int) -> float:
    """CPU time of a (single-threaded) process in ns resolution: /proc/PID/stat counts 10 ms ticks."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) * 1e-9


@contextlib.contextmanager
def _load(shape: List[Dict[str, float]]) -> Iterator[Callable[[], float]]:
    """Runs `shape`'s load processes on settled cores; yields a function giving the cores they used since."""
    suite.settle()
    loads = [subprocess.Popen([sys.executable, __file__, "--load", str(p["rate"]), str(p["burst_us"])])
             for p in shape]
    try:
        time.sleep(1.0 if loads else 0)  # past the load processes' interpreter start-up
        cpu0, t0 = sum(_cpu_seconds(p.pid) for p in loads), time.time()
        yield lambda: (sum(_cpu_seconds(p.pid) for p in loads) - cpu0) / (time.time() - t0)
    finally:
        for p in loads:
            p.kill()
            p.wait()


def idle_cores(shape: List[Dict[str, float]], seconds: float = 5.0) -> float:
    """Cores `shape`'s load processes use on an otherwise idle machine (how Ray's were counted)."""
    with _load(shape) as cores:
        time.sleep(seconds)
        return cores()


def run_condition(shape: List[Dict[str, float]], size: Dict[str, int], steps: int, warmup: int,
                  log_every: int) -> Dict[str, float]:
    """The bare step's tokens/s with `shape`'s load processes running, and the cores those used meanwhile."""
    with _load(shape) as cores:
        timing = suite.bare_process(size, steps, warmup, log_every)
        load_cores = cores()
    timed, seconds = V.steady(timing["log_times"], warmup)
    return {"tokens_per_s": timed * size["batch"] * size["seq"] / seconds, "load_cores": load_cores}


def shapes(processes: int, rate: float, burst_us: float) -> Dict[str, List[Dict[str, float]]]:
    """Each condition's load processes; `hog` spins, once a second, for as long as `wakers` used CPU in a second
    of an idle machine (measured: a Python wake-up costs tens of microseconds beyond its burst)."""
    wakers = [{"rate": rate, "burst_us": burst_us}] * processes
    cores = idle_cores(wakers)
    print(json.dumps({"wakers_idle_machine_cores": round(cores, 3)}), flush=True)
    return {"quiet": [], "wakers": wakers, "hog": [{"rate": 1.0, "burst_us": cores * 1e6}]}


def main(argv=None) -> Dict[str, Dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=4, help="a multiple of --log-every")
    parser.add_argument("--log-every", type=int, default=4)
    parser.add_argument("--processes", type=int, default=12, help="wakers: load processes")
    parser.add_argument("--rate", type=float, default=160.0, help="wakers: wake-ups per second, per process")
    parser.add_argument("--burst-us", type=float, default=0.0,
                        help="wakers: spin per wake-up beyond Python's own wake-up cost, microseconds")
    parser.add_argument("--smoke", action="store_true", help="the suite's tiny model: does it still run?")
    parser.add_argument("--load", nargs=2, type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.load:
        load_child(*args.load)
        return {}
    size = suite.SMOKE if args.smoke else suite.FULL
    conditions = shapes(args.processes, args.rate, args.burst_us)
    rounds = []
    for rnd in range(args.rounds):
        order = list(conditions) if rnd % 2 == 0 else list(conditions)[::-1]
        result = {name: run_condition(conditions[name], size, args.steps, args.warmup, args.log_every)
                  for name in order}
        rounds.append(result)
        print(json.dumps({"round": rnd, **{name: {k: round(v, 3) for k, v in r.items()}
                                           for name, r in result.items()}}), flush=True)
    summary = {}
    for name in conditions:
        if name == "quiet":
            continue
        ratios = [r[name]["tokens_per_s"] / r["quiet"]["tokens_per_s"] for r in rounds]
        cores = [r[name]["load_cores"] for r in rounds]
        summary[name] = {"vs_quiet": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                         "load_cores": statistics.median(cores)}
    print(json.dumps({"summary": {k: {m: round(v, 3) for m, v in s.items()} for k, s in summary.items()}}))
    return summary


if __name__ == "__main__":
    main()
