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
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(devices: int, steps: int, warmup: int) -> float:
    """Runs in the child process: tokens/s of the built-in train step over `devices` CPU devices."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import suite
    import suite_variants as V
    from ray_jax_train.config import LlamaConfig
    from ray_jax_train.lm import state as state_lib
    from ray_jax_train.lm.arguments import TrainingArguments
    from ray_jax_train.lm.step import make_optimizer, make_train_step, new_state
    from ray_jax_train.models import create_model

    size = suite.FULL
    optimizer, _ = make_optimizer(TrainingArguments(**V.lm_arguments(size, steps, 1)), steps)
    graphdef, params = state_lib.split_model(create_model(LlamaConfig(**V.model_dict(size))))
    mesh = Mesh(np.array(jax.devices()), ("dp",))
    state = jax.device_put(new_state(params, optimizer), NamedSharding(mesh, P()))
    rows = V.make_rows({"id": np.arange(steps * size["batch"])}, size["vocab"], size["seq"])
    step_fn = jax.jit(make_train_step(graphdef, optimizer), donate_argnums=(0,))
    with jax.set_mesh(mesh):
        for i in range(steps):
            batch = {k: jax.device_put(v[i * size["batch"]:(i + 1) * size["batch"]], NamedSharding(mesh, P("dp")))
                     for k, v in rows.items()}
            state, metrics = step_fn(state, batch)
            if i + 1 == warmup:
                float(metrics["loss"])
                start = time.time()
        float(metrics["loss"])
    return (steps - warmup) * size["batch"] * size["seq"] / (time.time() - start)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps({"tokens_per_s": measure(args.child, args.steps, args.warmup)}))
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
