"""(d) without Ray: the suite's train step in 1 and in 2 processes pinned to a core each, jax.distributed + gloo.

    python benchmarks/scale_no_ray.py --rounds 2

What the suite's scale1/scale2 would read if Ray's own processes and the trainer cost nothing: the same model,
batch 16 per process, the built-in loop's jitted step (with its one flat gradient all-reduce) and mesh
{"dp": -1}. Each process starts with the allocator settings our CPU workers get (`JaxConfig(keep_cpu_memory)`).
1 and 2 processes alternate over rounds. Prints tokens/s per round and the 2/1 ratio; writes nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(rank: int, processes: int, port: int, steps: int, warmup: int) -> None:
    os.sched_setaffinity(0, [rank % (os.cpu_count() or 1)])
    sys.path.insert(0, HERE)
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if processes > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", processes, rank)
    import suite
    import suite_variants as V

    from ray_jax_train.config import LlamaConfig
    from ray_jax_train.lm import state as state_lib
    from ray_jax_train.lm.arguments import TrainingArguments
    from ray_jax_train.lm.step import jit_train_step, make_optimizer, new_state
    from ray_jax_train.mesh import make_mesh

    size, log_every = suite.FULL, 4
    config = LlamaConfig(**V.model_dict(size))
    optimizer, _ = make_optimizer(TrainingArguments(**V.lm_arguments(size, steps, log_every, processes)), steps)
    mesh = make_mesh({"dp": -1})
    new_state_fn = lambda params, step: new_state(params, optimizer, step)  # noqa: E731
    graphdef, _ = state_lib.abstract_params(config)
    abstract = state_lib.abstract_state(config, mesh, new_state_fn)
    step_fn = jit_train_step(graphdef, optimizer, 1, jax.tree.map(lambda a: a.sharding, abstract), mesh)
    state = state_lib.initial_state({}, config, optimizer, mesh, new_state_fn=new_state_fn)
    rows = V.make_rows({"id": np.arange(steps * size["batch"] * processes)}, size["vocab"], size["seq"])
    sharding = NamedSharding(mesh, PartitionSpec("dp"))
    times = []
    with jax.set_mesh(mesh):
        for i in range(steps):
            first = (i * processes + rank) * size["batch"]
            batch = {k: jax.make_array_from_process_local_data(sharding, v[first:first + size["batch"]])
                     for k, v in rows.items()}
            state, metrics = step_fn(state, batch)
            if (i + 1) % log_every == 0:
                float(metrics["loss"])
                times.append((i + 1, time.time()))
    timed_steps, seconds = V.steady(times, warmup)
    if rank == 0:
        print(json.dumps({"tokens_per_s": timed_steps * size["batch"] * size["seq"] * processes / seconds}))


def run(processes: int, steps: int, warmup: int) -> float:
    from ray_jax_train.allocator import KEEP_CPU_MEMORY_TUNABLES

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, GLIBC_TUNABLES=KEEP_CPU_MEMORY_TUNABLES, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(rank), str(processes), str(port)]
                              + ["--steps", str(steps), "--warmup", str(warmup)],
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
    return json.loads(outputs[0].strip().splitlines()[-1])["tokens_per_s"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=8, help="a multiple of 4 (the host syncs every 4 steps)")
    parser.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child, steps=args.steps, warmup=args.warmup)
        return
    for rnd in range(args.rounds):
        result = {n: run(n, args.steps, args.warmup) for n in ((1, 2) if rnd % 2 == 0 else (2, 1))}
        print(json.dumps({"round": rnd, "tokens_per_s_1": round(result[1]), "tokens_per_s_2": round(result[2]),
                          "scaling": round(result[2] / result[1], 3)}), flush=True)


if __name__ == "__main__":
    main()
