"""(d) without Ray: the suite's train step in 1 and in 2 processes pinned to a core each, jax.distributed + gloo.

    python benchmarks/scale_no_ray.py --rounds 2

What the suite's scale1/scale2 would read if Ray's own processes and the trainer cost nothing: the same model,
batch 16 per process, the built-in loop's jitted step (with its one flat gradient all-reduce) and mesh
{"dp": -1}. Each process starts with the allocator settings our CPU workers get (`JaxConfig(keep_cpu_memory)`).
1 and 2 processes alternate over rounds. Prints tokens/s per round and the 2/1 ratio; writes nothing.

`--independent` also runs 2 processes that share nothing (each the 1-process program, no jax.distributed, no
all-reduce), summed: what the two cores give the step when only the machine is shared (caches, memory bus), so
(d)'s gap splits into the machine's part and the collective's part.

`SCALE_NO_RAY_FIRST_CPU=N` pins rank r to the (N+r)-th usable CPU instead of the r-th (is CPU 0, which takes the
host's interrupts, the slow one? Session 35: no).

Each round's line also has, per process, its CPU, minor page faults and preemptions per timed step, and the share
of the wall time each busy thread ran: the step's thread, gloo's, XLA's pool; `idle` is the core's time with none
of them running (waiting for the other process). `jax.profiler` is no help here: its buffers grow the heap, so its
steps fault in 40-60k pages each and the 2-process step doubles.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))


def child(rank: int, processes: int, port: int, steps: int, warmup: int, log_every: int, size: dict,
          independent: bool = False) -> None:
    usable = sorted(os.sched_getaffinity(0))  # in a container held to cores 4-7, core 0 is not ours
    first = int(os.environ.get("SCALE_NO_RAY_FIRST_CPU", "0"))  # which usable CPU rank 0 gets (CPU 0 takes IRQs)
    os.sched_setaffinity(0, [usable[(first + rank) % len(usable)]])
    if independent:  # each process trains alone on its core; only the machine is shared
        rank, processes = 0, 1
    sys.path.insert(0, HERE)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if processes > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", processes, rank)
    import suite_variants as V

    record = V.dp_bare_run(size, steps, log_every)
    timed_steps, seconds = V.steady(record["log_times"], warmup)
    if rank == 0:
        print(json.dumps({"tokens_per_s": timed_steps * size["batch"] * size["seq"] * processes / seconds}))
    print(json.dumps({"process": {"cpu": os.sched_getaffinity(0).pop(), **V.steady_rusage(record["log_rusage"], warmup, seconds)}}))


def run(processes: int, steps: int, warmup: int, independent: bool = False, size: Optional[dict] = None,
        log_every: int = 4, processes_out: Optional[list] = None) -> float:
    """Tokens/s of `processes` pinned processes (summed over them when `independent`). `size` defaults to the
    suite's full model; `suite.py`'s bare1 / bare2 variants call this too. `processes_out` gets each process's
    CPU, page faults and preemptions per step."""
    from ray_jax_train.allocator import KEEP_CPU_MEMORY_TUNABLES

    if size is None:
        import suite

        size = suite.FULL
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, GLIBC_TUNABLES=KEEP_CPU_MEMORY_TUNABLES, JAX_PLATFORMS="cpu")
    options = ["--steps", str(steps), "--warmup", str(warmup), "--log-every", str(log_every),
               "--size", json.dumps(size)] + ["--independent"] * independent
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(rank), str(processes), str(port)] + options,
                              env=env, stdout=subprocess.PIPE, text=True)  # stderr shows, for failures
             for rank in range(processes)]
    try:
        outputs = [p.communicate(timeout=600)[0] for p in procs]
    finally:  # one rank that died leaves the others waiting for it in jax.distributed
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a child process failed: {[p.returncode for p in procs]}")
    rates = [json.loads(line)["tokens_per_s"] for out in outputs for line in out.splitlines()
             if line.startswith('{"tokens_per_s"')]
    if processes_out is not None:
        processes_out.extend(json.loads(line)["process"] for out in outputs for line in out.splitlines()
                             if line.startswith('{"process"'))
    return sum(rates)  # rank 0 alone prints for a collective run; every process does when independent


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=8, help="a multiple of --log-every")
    parser.add_argument("--independent", action="store_true",
                        help="also run 2 processes that share no collective (each trains alone), summed")
    parser.add_argument("--log-every", type=int, default=4, help="host syncs every this many steps")
    parser.add_argument("--size", type=json.loads, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child, steps=args.steps, warmup=args.warmup, log_every=args.log_every, size=args.size,
              independent=args.independent)
        return
    for rnd in range(args.rounds):
        order = [(1, False), (2, False)] + [(2, True)] * args.independent
        stats = {key: [] for key in order}
        result = {key: run(key[0], args.steps, args.warmup, key[1], log_every=args.log_every,
                           processes_out=stats[key])
                  for key in (order if rnd % 2 == 0 else order[::-1])}
        line = {"round": rnd, "tokens_per_s_1": round(result[1, False]), "tokens_per_s_2": round(result[2, False]),
                "scaling": round(result[2, False] / result[1, False], 3)}
        if args.independent:
            line.update(tokens_per_s_2_independent=round(result[2, True]),
                        scaling_independent=round(result[2, True] / result[1, False], 3))
        line["processes"] = {f"{n}{'_independent' * alone}": stats[n, alone] for n, alone in order}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
