"""What checkpointing costs a training run: throughput with periodic saves vs none, and save/restore MB/s.

One JaxTrainer run on CPU workers. Workloads:
  lm   (default) the built-in causal-LM train step on the suite's GPT-2-shaped Llama, AdamW state FSDP-sharded
       over all devices (63 MB), `--lm-batch` rows of 128 tokens per worker;
  mlp  a stress case: an MLP with Adam whose 50 MB state is large for its ~80 ms of compute per step.
After one warm-up save and some settling steps, phases alternate, no-save / save-every-N, `--rounds` times,
each of `--phase-steps` steps, so load drift on a shared machine hits both kinds alike; saves fall half an
interval into a phase, as in a long run. The ratio is (steps/s with saves) / (steps/s without), as mean and
median over the phases. Then, outside the step loop: the time `save` blocks the loop, the time until it is
committed on storage, and the time to restore into the same shardings, as MB/s of the global state. Times
are measured and printed, never asserted.

    python benchmarks/checkpoint_cost.py --workers 2 --save-every 50                 # ~12 min on 2 cores
    python benchmarks/checkpoint_cost.py --workers 2 --save-every 50 --workload mlp  # ~2 min
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def _mlp_workload(config):
    """A stress case: an MLP whose state is large for its compute (a 50 MB state, tens of ms per step)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import ray_jax_train as rjt

    mesh = rjt.get_mesh()
    n = mesh.devices.size
    hidden, layers, batch = config["hidden"], config["layers"], config["batch"]
    rng = np.random.default_rng(0)
    params = [{"w": (rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(np.float32),
               "b": np.zeros((hidden,), np.float32)} for _ in range(layers)]
    optimizer = optax.adam(1e-3)

    def place(x):
        spec = P("dp") if x.ndim and x.shape[0] % n == 0 else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    state = jax.tree.map(place, {"params": params, "opt_state": optimizer.init(params)})

    def loss_fn(p, x):
        h = x
        for layer in p:
            h = jnp.tanh(h @ layer["w"] + layer["b"])
        return jnp.mean(h ** 2)

    def step(state, x):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    x = jax.device_put(rng.standard_normal((batch, hidden)).astype(np.float32), NamedSharding(mesh, P("dp")))
    return state, jax.jit(step, donate_argnums=(0,)), x


def _lm_workload(config):
    """The built-in causal-LM train step on the suite's GPT-2-shaped Llama (4.2M params, AdamW: a 50 MB state),
    with params and moments FSDP-sharded over all devices, so each worker writes its own half."""
    import jax
    import numpy as np
    import optax

    import ray_jax_train as rjt
    from ray_jax_train.config import LlamaConfig
    from ray_jax_train.lm.state import initial_state, split_model
    from ray_jax_train.lm.step import make_train_step, new_state
    from ray_jax_train.models import create_model

    mesh = rjt.make_mesh({"fsdp": -1})
    vocab, seq, batch = 4096, 128, config["lm_batch"] * jax.process_count()
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, max_position_embeddings=seq, tie_word_embeddings=False)
    optimizer = optax.adamw(3e-4)
    graphdef, _ = split_model(create_model(cfg))
    state = initial_state({}, cfg, mesh, new_state_fn=lambda p, s: new_state(p, optimizer, s))
    tokens = np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    rows = {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.ones((batch, seq), np.int32),
            "segment_ids": np.ones((batch, seq), np.int32),
            "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy()}
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    batch_arrays = {k: jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i]) for k, v in rows.items()}
    step = make_train_step(graphdef, optimizer)

    def step_fn(state, batch):
        with jax.set_mesh(mesh):
            return compiled(state, batch)

    compiled = jax.jit(step, donate_argnums=(0,))
    return state, step_fn, batch_arrays


def _scalar_loss(out) -> float:
    return float(out["loss"] if isinstance(out, dict) else out)


def bench_loop(config):
    import jax
    import numpy as np

    from ray_jax_train.checkpoint import JaxCheckpointer, abstract_state

    state, step_fn, batch = (_lm_workload if config["workload"] == "lm" else _mlp_workload)(config)
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    state, loss = step_fn(state, batch)  # compile
    jax.block_until_ready(loss)

    ckpt = JaxCheckpointer(save_every=config["save_every"], handle_preemption=False)
    # Start half an interval in, so a save phase never ends exactly on a save: in a long run each save has
    # `save_every` steps to reach storage before the next, and a save forced to finish at a phase boundary
    # would charge its whole background write to the phase instead.
    global_step = config["save_every"] // 2
    ckpt.save(global_step, state)  # warm-up: compiles the checksum programs, opens orbax, as any first save does
    ckpt.wait()
    for _ in range(config["phase_steps"] // 2):  # settle: the first steps after start-up run slow, for both kinds
        state, loss = step_fn(state, batch)
    jax.block_until_ready(loss)
    phases = []
    for kind in ["none", "save"] * config["rounds"]:
        t0 = time.perf_counter()
        for _ in range(config["phase_steps"]):
            state, loss = step_fn(state, batch)
            global_step += 1
            if kind == "save":
                ckpt.maybe_save(global_step, state, metrics=lambda: {"loss": _scalar_loss(loss)})
        jax.block_until_ready(loss)
        ckpt.wait()  # a phase ends with its saves on storage, so their cost is not pushed into the next phase
        phases.append((kind, config["phase_steps"] / (time.perf_counter() - t0)))

    # Save and restore costs, alone.
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    ckpt.save(global_step + 1, state)
    blocking = time.perf_counter() - t0
    ckpt.wait()
    committed = time.perf_counter() - t0
    path = ckpt.location.child(ckpt._name(global_step + 1))
    target = abstract_state(state)
    t0 = time.perf_counter()
    restored = ckpt.restore(target, path)
    jax.block_until_ready(restored.state)
    restore_s = time.perf_counter() - t0

    if jax.process_index() == 0:
        none = [v for k, v in phases if k == "none"]
        save = [v for k, v in phases if k == "save"]
        out = {
            "workload": config["workload"], "workers": jax.process_count(), "devices": jax.device_count(),
            "state_mb": state_bytes / 1e6, "save_every": config["save_every"], "phase_steps": config["phase_steps"],
            "steps_per_s_no_save": none, "steps_per_s_with_saves": save,
            "throughput_ratio_mean": (sum(save) / len(save)) / (sum(none) / len(none)),
            "throughput_ratio_median": float(np.median(save) / np.median(none)),
            "save_blocking_s": blocking, "save_committed_s": committed, "restore_s": restore_s,
            "save_mb_per_s": state_bytes / 1e6 / committed, "restore_mb_per_s": state_bytes / 1e6 / restore_s,
        }
        with open(config["out"], "w") as f:
            json.dump(out, f, indent=1)


def main(argv=None):
    import ray
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig

    import ray_jax_train as rjt

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--workload", choices=["lm", "mlp"], default="lm",
                        help="lm: the built-in Llama train step (suite model); mlp: a state-heavy stress case")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="mlp: global batch")
    parser.add_argument("--lm-batch", type=int, default=4, help="lm: rows of 128 tokens per worker and step")
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--phase-steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3, help="no-save/save phase pairs")
    parser.add_argument("--storage-path", default=None)
    parser.add_argument("--num-cpus", type=int, default=None)
    args = parser.parse_args(argv)

    storage = args.storage_path or tempfile.mkdtemp(prefix="ckpt_bench_")
    out = os.path.join(storage, "checkpoint_cost.json")
    ray.init(ignore_reinit_error=True, include_dashboard=False, num_cpus=args.num_cpus or max(4, args.workers),
             runtime_env={"env_vars": {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}})
    trainer = rjt.JaxTrainer(
        bench_loop,
        train_loop_config={"workload": args.workload, "lm_batch": args.lm_batch, "hidden": args.hidden, "layers": args.layers, "batch": args.batch,
                           "save_every": args.save_every, "phase_steps": args.phase_steps, "rounds": args.rounds,
                           "out": out},
        scaling_config=ScalingConfig(num_workers=args.workers),
        run_config=RunConfig(name="checkpoint_cost", storage_path=storage,
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )
    result = trainer.fit()
    if result.error:
        raise result.error
    with open(out) as f:
        figures = json.load(f)
    print(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
