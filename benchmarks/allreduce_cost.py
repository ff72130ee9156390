"""(d)'s collective alone: the built-in step's one flat gradient all-reduce, between 2 pinned processes (gloo).

    python benchmarks/allreduce_cost.py                     # the suite model's gradient size, float32 and bfloat16
    python benchmarks/allreduce_cost.py --mb 1 20 80

Each process is pinned to a core of its own and joins a jax.distributed job, as `scale_no_ray.py`'s are; a jitted
`psum` over the 2-process mesh sums a flat buffer, as `lm.step`'s `_in_one_all_reduce` does. Prints the median and
min-max milliseconds per call, per size and dtype, and the CPU the calling process used in them: on a core of its
own, an all-reduce's time is taken from the step, since XLA:CPU runs it after the backward pass. Asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

GRADIENT_MB = 20.1  # the suite model's float32 gradients (5.26M parameters, 39 arrays)


def child(rank: int, port: int, sizes_mb, calls: int) -> None:
    usable = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, [usable[rank % len(usable)]])
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, rank)
    mesh = jax.make_mesh((2,), ("dp",))
    for mb in sizes_mb:
        for dtype in (jnp.float32, jnp.bfloat16):
            n = int(mb * 2**20 / 4)  # elements of the float32 gradient; bfloat16 sends half the bytes
            local = np.ones((1, n), dtype)
            x = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("dp")), local)
            summed = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "dp"), mesh=mesh, in_specs=PartitionSpec("dp"),
                                           out_specs=PartitionSpec()))
            jax.block_until_ready(summed(x))  # compile, and the first call's connection set-up
            times, cpu0 = [], time.process_time()
            for _ in range(calls):
                start = time.perf_counter()
                jax.block_until_ready(summed(x))
                times.append((time.perf_counter() - start) * 1000)
            cpu_ms = (time.process_time() - cpu0) * 1000 / calls
            if rank == 0:
                print(json.dumps({"gradient_mb": mb, "dtype": jnp.dtype(dtype).name,
                                  "ms_median": round(statistics.median(times), 1),
                                  "ms_min": round(min(times), 1), "ms_max": round(max(times), 1),
                                  "cpu_ms_per_call": round(cpu_ms, 1)}), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[GRADIENT_MB], help="float32 gradient sizes, MB")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child, args.mb, args.calls)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    options = ["--mb", *map(str, args.mb), "--calls", str(args.calls)]
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(rank), str(port)] + options, env=env)
             for rank in range(2)]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:  # one that died leaves the other waiting in jax.distributed
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        raise SystemExit(f"a child process failed: {codes}")


if __name__ == "__main__":
    main()
