"""The suite's train step in a bare process with 1, 2, 4... XLA CPU devices, the batch split data-parallel.

    python benchmarks/cpu_devices.py --devices 1 2 4 --rounds 2

One XLA CPU device runs a step's elementwise fusions on one thread; this measures what a device per core
(`JaxConfig(num_cpu_devices=N)` in a worker) gains. Each count runs in its own process (the device count is
fixed when JAX starts), interleaved over rounds. Prints tokens/s per round and writes nothing else.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(steps: int, warmup: int) -> float:
    """Runs in the child process: tokens/s of the suite's bare step, data-parallel over all its CPU devices."""
    import suite
    import suite_variants as V

    timing = V.bare_run(suite.FULL, steps, warmup, log_every=warmup, data_parallel=True)
    timed_steps, seconds = V.steady(timing["log_times"], warmup)
    return timed_steps * suite.FULL["batch"] * suite.FULL["seq"] / seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps({"tokens_per_s": measure(args.steps, args.warmup)}))
        return
    results = {n: [] for n in args.devices}
    for rnd in range(args.rounds):
        for n in args.devices:
            env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
                       XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip())
            out = subprocess.run([sys.executable, __file__, "--child", str(n), "--steps", str(args.steps),
                                  "--warmup", str(args.warmup)], env=env, check=True, capture_output=True, text=True)
            results[n].append(json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"])
            print(f"round {rnd}: {n} device(s): {results[n][-1]:.0f} tokens/s", flush=True)
    print(json.dumps({str(n): [round(v) for v in vs] for n, vs in results.items()}))


if __name__ == "__main__":
    main()
