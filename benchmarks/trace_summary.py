"""Where a traced step's time went, per worker, from the traces `profile_start_step` or `suite.py --profile` write.

    python benchmarks/trace_summary.py bench_out/profile/scale2_12          # every worker_<rank> below it
    python benchmarks/trace_summary.py <run dir>/profile --top 8

For each executed train step (an XLA program run longer than --min-ms), it prints the wall time, the time in
collectives (all-reduce, psum, all-gather, reduce-scatter, ...: on CPU these include waiting for the other
processes), the time in other ops, and the largest ops. Two workers whose op time matches but whose collective
time differs show which one the other waits for. CPU traces have per-op events only when the run set
`--xla_cpu_enable_xprof_traceme=true` (the built-in loop does when profiling).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
from typing import Dict, List

COLLECTIVE = re.compile(r"^(psum|all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|ppermute)")
RUNTIME = ("ThunkExecutor", "ThreadpoolListener", "end:")


def traces(root: str) -> List[str]:
    found = sorted(glob.glob(os.path.join(root, "**", "*.xplane.pb"), recursive=True))
    if not found:
        raise SystemExit(f"No *.xplane.pb under {root}: point at a run's profile/ directory (or one worker_<rank>).")
    return found


def steps_of(path: str, min_ms: float) -> List[Dict]:
    """Each long program execution on the XLA:CPU client's thread, split into collectives and other ops."""
    import jax

    data = jax.profiler.ProfileData.from_file(path)
    out = []
    for plane in data.planes:
        for line in plane.lines:
            events = list(line.events)
            runs = [e for e in events if e.name == "ThunkExecutor::Execute" and e.duration_ns >= min_ms * 1e6]
            for run in runs:
                inner = [e for e in events if run.start_ns <= e.start_ns and e.end_ns <= run.end_ns
                         and not e.name.startswith(RUNTIME)]
                ops: Dict[str, float] = {}
                for e in inner:
                    ops[e.name] = ops.get(e.name, 0.0) + e.duration_ns / 1e6
                collective = sum(ms for name, ms in ops.items() if COLLECTIVE.match(name))
                out.append({"start_s": run.start_ns / 1e9, "wall_ms": run.duration_ns / 1e6,
                            "collective_ms": collective, "ops_ms": sum(ops.values()) - collective, "ops": ops})
    return sorted(out, key=lambda s: s["start_s"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", help="a profile/ directory, a worker_<rank> directory below it, or a suite --out")
    parser.add_argument("--top", type=int, default=4, help="largest ops to name per step")
    parser.add_argument("--min-ms", type=float, default=50.0, help="shorter program runs are not train steps")
    args = parser.parse_args(argv)
    for path in traces(args.root):
        steps = steps_of(path, args.min_ms)
        print(f"== {os.path.relpath(path, args.root)}: {len(steps)} steps")
        for s in steps:
            top = sorted(s["ops"].items(), key=lambda kv: -kv[1])[:args.top]
            largest = ", ".join(f"{name} {ms:.0f}" for name, ms in top)
            print(f"  wall {s['wall_ms']:7.0f} ms  collectives {s['collective_ms']:6.0f}  "
                  f"other ops {s['ops_ms']:7.0f}  {largest}")


if __name__ == "__main__":
    main()
