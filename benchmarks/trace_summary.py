"""Where a traced step's time went, per worker, from the traces `profile_start_step` or `suite.py --profile` write.

    python benchmarks/trace_summary.py bench_out/profile/scale2_12          # every worker_<rank> below it
    python benchmarks/trace_summary.py <run dir>/profile --top 8

For each executed train step (an XLA program run longer than --min-ms), it prints the wall time, the time in
collectives (all-reduce, psum, all-gather, reduce-scatter, ...: on CPU these include waiting for the other
processes), the time in other ops, and the largest ops. Two workers whose op time matches but whose collective
time differs show which one the other waits for. CPU traces have per-op events only when the run set
`--xla_cpu_enable_xprof_traceme=true` (the built-in loop does when profiling).

`--gpu` reads a GPU trace instead: how busy the GPU was between the first and last train step, each program
(XLA module) with its kernel time, the idle gaps between kernels, and what the host's Python was doing in the
longest of them (the Python tracer's frames, any thread). That splits "the loop is slower than its step run bare" into
GPU work the bare step does not have and time the GPU waits for the host.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
from typing import Dict, List

COLLECTIVE = re.compile(r"^(psum|all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|ppermute)")
RUNTIME = ("ThunkExecutor", "ThreadpoolListener", "end:")
NOISE_FRAMES = ("$builtins", "$_operator", "$<unknown>", "$inspect.py", "$threading.py", "$queue.py")


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


def _union_ns(intervals) -> int:
    busy, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            busy, end = busy + stop - start, stop
        elif stop > end:
            busy, end = busy + stop - end, stop
    return busy


def gpu_timeline(path: str, top: int = 10, min_gap_ms: float = 0.05) -> Dict:
    """The device side of a GPU trace: programs run, kernel busy time and idle gaps, and the host's Python in
    the longest gaps. Returns the figures it prints."""
    import jax

    data = jax.profiler.ProfileData.from_file(path)
    planes = list(data.planes)
    # The Python tracer's frames ("$file.py:line name") sit on lines named after their threads.
    python = [e for plane in planes if plane.name.startswith("/host")
              for line in plane.lines for e in line.events if e.name.startswith("$")]
    found = {}
    for plane in (p for p in planes if p.name.startswith("/device:GPU")):
        lines = {line.name: list(line.events) for line in plane.lines}
        kernels = sorted((e for name, events in lines.items() if name.startswith("Stream") for e in events),
                         key=lambda e: e.start_ns)
        print(f"== {plane.name}: lines {sorted(lines)}")
        if not kernels:
            print("  no kernel events")
            continue
        first, last = kernels[0].start_ns, max(e.end_ns for e in kernels)
        busy = _union_ns((e.start_ns, e.end_ns) for e in kernels)
        window = last - first
        print(f"  window {window / 1e6:.1f} ms, kernels busy {busy / 1e6:.1f} ms ({100 * busy / window:.1f}%), "
              f"{len(kernels)} kernel/copy events")
        # Kernel time per program (XLA module, from each kernel's hlo_module stat): the train step against the
        # small programs around it (metric stacking, eager arithmetic on the host's behalf).
        runs: Dict[str, List[float]] = {}
        for e in kernels:
            module = dict(e.stats).get("hlo_module") or "(copies, no module)"
            runs.setdefault(module, []).append(e.duration_ns / 1e6)
        for name, ms in sorted(runs.items(), key=lambda kv: -sum(kv[1])):
            print(f"  module {name[:60]:60s} {len(ms):6d} kernels  {sum(ms):9.2f} ms")
        copies: Dict[str, float] = {}
        for e in kernels:
            if "memcpy" in e.name.lower() or "memset" in e.name.lower():
                copies[e.name[:40]] = copies.get(e.name[:40], 0.0) + e.duration_ns / 1e6
        if copies:
            print("  copies: " + ", ".join(f"{n} {ms:.2f} ms" for n, ms in sorted(copies.items(), key=lambda kv: -kv[1])))
        gaps, end = [], kernels[0].end_ns
        for e in kernels[1:]:
            if e.start_ns - end >= min_gap_ms * 1e6:
                gaps.append((end, e.start_ns, e.name))
            end = max(end, e.end_ns)
        idle = sum(b - a for a, b, _ in gaps)
        print(f"  {len(gaps)} gaps >= {min_gap_ms} ms, {idle / 1e6:.2f} ms together ({100 * idle / window:.1f}% of the "
              "window); the longest, with the innermost host Python frames running through them:")
        for a, b, after in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
            # The innermost frames that span most of the gap: what the host was busy with (or waiting in).
            inside = sorted((e for e in python if e.start_ns <= b and e.end_ns >= a
                             and e.duration_ns >= (b - a) / 2 and not e.name.startswith(NOISE_FRAMES)),
                            key=lambda e: e.duration_ns)
            frames = "; ".join(e.name[:60] for e in inside[:3]) or "no Python frame"
            print(f"    +{(a - first) / 1e6:8.2f} ms  {(b - a) / 1e6:6.2f} ms  before {after[:30]}  [{frames}]")
        found[plane.name] = {"window_ms": window / 1e6, "busy_ms": busy / 1e6, "gap_ms": idle / 1e6,
                             "modules": {n: sum(ms) for n, ms in runs.items()}}
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", help="a profile/ directory, a worker_<rank> directory below it, or a suite --out")
    parser.add_argument("--top", type=int, default=4, help="largest ops to name per step")
    parser.add_argument("--min-ms", type=float, default=50.0, help="shorter program runs are not train steps")
    parser.add_argument("--gpu", action="store_true", help="a GPU trace: device busy time, programs, idle gaps")
    args = parser.parse_args(argv)
    for path in traces(args.root):
        if args.gpu:
            print(f"== {os.path.relpath(path, args.root)}")
            gpu_timeline(path, top=max(args.top, 10))
            continue
        steps = steps_of(path, args.min_ms)
        print(f"== {os.path.relpath(path, args.root)}: {len(steps)} steps")
        for s in steps:
            top = sorted(s["ops"].items(), key=lambda kv: -kv[1])[:args.top]
            largest = ", ".join(f"{name} {ms:.0f}" for name, ms in top)
            print(f"  wall {s['wall_ms']:7.0f} ms  collectives {s['collective_ms']:6.0f}  "
                  f"other ops {s['ops_ms']:7.0f}  {largest}")


if __name__ == "__main__":
    main()
