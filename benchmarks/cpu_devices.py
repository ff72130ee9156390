"""The suite's train step in a bare process with 1, 2, 4... XLA CPU devices, the batch split data-parallel.

    python benchmarks/cpu_devices.py --devices 1 2 4 --rounds 2
    python benchmarks/cpu_devices.py --devices 1 2 --xla-flags=--xla_cpu_experimental_ynn_fusion_type=+eltwise,+reduce

One XLA CPU device runs a step's elementwise fusions on one thread; this measures what a device per core
(`JaxConfig(num_cpu_devices=N)` in a worker) gains. Each count runs in its own process (the device count is
fixed when JAX starts), interleaved over rounds, the order reversed every other round. Each `--xla-flags=...` (repeatable) adds an `XLA_FLAGS` setting
to compare with the default the same way: every device count runs with the default and with every setting. Prints tokens/s per round and writes nothing else.
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
    parser.add_argument("--xla-flags", action="append", default=[],
                        help="an XLA_FLAGS setting to compare with the default (repeatable; write --xla-flags=--xla_...)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps({"tokens_per_s": measure(args.steps, args.warmup)}))
        return
    variants = [(n, flags) for flags in [""] + args.xla_flags for n in args.devices]
    results = {variant: [] for variant in variants}
    for rnd in range(args.rounds):
        # A B, then B A: whatever runs first in a round (a cooler or busier machine) favours neither setting.
        for n, flags in (variants if rnd % 2 == 0 else variants[::-1]):
            all_flags = " ".join([os.environ.get("XLA_FLAGS", ""), flags, f"--xla_force_host_platform_device_count={n}"])
            env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
                       XLA_FLAGS=all_flags.strip())
            out = subprocess.run([sys.executable, __file__, "--child", str(n), "--steps", str(args.steps),
                                  "--warmup", str(args.warmup)], env=env, check=True, capture_output=True, text=True)
            results[(n, flags)].append(json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"])
            print(f"round {rnd}: {n} device(s) {flags or '(default flags)'}: {results[(n, flags)][-1]:.0f} tokens/s",
                  flush=True)
    print(json.dumps({f"{n} {flags}".strip(): [round(v) for v in vs] for (n, flags), vs in results.items()}))


if __name__ == "__main__":
    main()
