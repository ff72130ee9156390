"""Compile time of the built-in loop's two programs, the state's init and the train step, against model depth.

    python benchmarks/compile_time.py --layers 4 8 16 --rounds 3

A run's first start (and every Tune trial whose programs are new) waits for both compiles: (f) in the suite.
Each (depth, variant) runs in its own fresh process with the persistent cache off, interleaved over rounds and
reversed every other round. The init is timed from the call to its ready arrays (compile + run; the run is under
0.1 s here), the step's compile alone. Variants:
    parts  the library (session 8): one program per kind of model part, all decoder layers sharing one
           (`ray_jax_train.lm.state.init_params`), then the optimizer state
    whole  sessions 4-7: one program that draws every weight of every layer and builds the optimizer state
Prints seconds per round and a JSON summary; writes nothing else.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("parts", "whole")


def measure(layers: int, variant: str) -> dict:
    """Runs in the child process: seconds to a ready new state (compile + run), and the train step's compile."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import suite
    import suite_variants as V
    from ray_jax_train.config import LlamaConfig
    from ray_jax_train.lm import state as state_lib
    from ray_jax_train.lm.arguments import TrainingArguments
    from ray_jax_train.lm.step import make_optimizer, make_train_step, new_state
    from ray_jax_train.mesh import make_mesh
    from ray_jax_train.models import llama

    jax.config.update("jax_enable_compilation_cache", False)
    size = dict(suite.FULL, layers=layers)
    config = LlamaConfig(**V.model_dict(size))
    optimizer, _ = make_optimizer(TrainingArguments(**V.lm_arguments(size, 8, 4)), 8)
    new_state_fn = lambda params, step: new_state(params, optimizer, step)  # noqa: E731
    mesh = make_mesh({"dp": -1})

    t0 = time.perf_counter()
    if variant == "parts":
        state = state_lib.initial_state({}, config, mesh, new_state_fn=new_state_fn)
    else:
        init = state_lib.new_model_state(config, new_state_fn)
        state = jax.jit(init, out_shardings=state_lib.state_shardings(jax.eval_shape(init), mesh))()
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    rows = V.make_rows({"id": list(range(size["batch"]))}, size["vocab"], size["seq"])
    batch = {k: jnp.asarray(v) for k, v in rows.items()}
    graphdef = nnx.graphdef(llama.create_model(config, lazy=True))
    t0 = time.perf_counter()
    jax.jit(make_train_step(graphdef, optimizer), donate_argnums=(0,)).lower(state, batch).compile()
    step_s = time.perf_counter() - t0
    return {"init_s": init_s, "step_s": step_s}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(int(args.child[0]), args.child[1])))
        return
    runs = [(n, v) for n in args.layers for v in VARIANTS]
    results = {run: [] for run in runs}
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    for rnd in range(args.rounds):
        for n, variant in (runs if rnd % 2 == 0 else runs[::-1]):
            out = subprocess.run([sys.executable, __file__, "--child", str(n), variant], env=env, check=True,
                                 capture_output=True, text=True)
            results[(n, variant)].append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = results[(n, variant)][-1]
            print(f"round {rnd}: {n} layers, {variant}: init {r['init_s']:.2f} s, step {r['step_s']:.2f} s", flush=True)
    summary = {f"{n} layers {v}": {key: round(statistics.median(r[key] for r in rs), 2) for key in ("init_s", "step_s")}
               for (n, v), rs in results.items()}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
