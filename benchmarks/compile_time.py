"""Compile time of the built-in loop's two programs, the state's init and the train step, against model depth.

    python benchmarks/compile_time.py --layers 4 8 16 --rounds 3

A run's first start (and every Tune trial whose programs are new) waits for both compiles: (f) in the suite.
Each (depth, variant) compiles in its own fresh process with the persistent cache off, interleaved over rounds and
reversed every other round. Variants:
    looped   the library: each layer drawn by its own constructor (one draw per weight per layer)
    vmapped  tried, not kept: the decoder layers drawn by one vmapped constructor (one random draw per weight
             kind, with a leading layer axis), then split into the usual per-layer parameters
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
VARIANTS = ("looped", "vmapped")


def vmapped_layers(config, rngs):
    """The decoder layers from one constructor vmapped over a layer axis, split back into per-layer modules."""
    import jax
    from flax import nnx

    from ray_jax_train.models import llama

    @nnx.split_rngs(splits=config.num_hidden_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(layer_rngs):
        return llama.DecoderLayer(config, rngs=layer_rngs)

    graphdef, stacked = nnx.split(make(rngs))
    return [nnx.merge(graphdef, jax.tree.map(lambda x, i=i: x[i], stacked)) for i in range(config.num_hidden_layers)]


def measure(layers: int, variant: str) -> dict:
    """Runs in the child process: lower + compile seconds of the init program and of the train step."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import suite
    import suite_variants as V
    from ray_jax_train.config import LlamaConfig
    from ray_jax_train.lm import state as state_lib
    from ray_jax_train.lm.arguments import TrainingArguments
    from ray_jax_train.lm.step import make_optimizer, make_train_step, new_state
    from ray_jax_train.models import llama

    jax.config.update("jax_enable_compilation_cache", False)
    if variant == "vmapped":
        llama._init_layers = vmapped_layers
    size = dict(suite.FULL, layers=layers)
    config = LlamaConfig(**V.model_dict(size))
    optimizer, _ = make_optimizer(TrainingArguments(**V.lm_arguments(size, 8, 4)), 8)
    init = state_lib.new_model_state(config, lambda params, step: new_state(params, optimizer, step))

    t0 = time.perf_counter()
    compiled_init = jax.jit(init).lower().compile()
    init_s = time.perf_counter() - t0
    state = compiled_init()
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
