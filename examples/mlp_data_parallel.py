"""Data-parallel MLP regression on 2 CPU workers: the smallest complete ray_jax_train program.

Each worker reads its Ray Data shard through `iter_jax_batches` into a global batch sharded over a `dp` mesh;
the jitted step sees one global array, so XLA inserts the cross-process gradient all-reduce itself.

    python examples/mlp_data_parallel.py --num-workers 2 --steps 200
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Dict

import numpy as np

FEATURES = 8


def make_rows(batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Features and target are a fixed function of the row id, so any process can rebuild any batch."""
    ids = batch["id"].astype(np.int64)
    phase = (ids[:, None] * 0.37 + np.arange(FEATURES)[None, :] * 1.3) % (2 * np.pi)
    x = np.sin(phase).astype(np.float32)
    weights = np.linspace(-1.0, 1.0, FEATURES, dtype=np.float32)
    y = (np.tanh(x @ weights) + 0.5 * x[:, 0] * x[:, 1]).astype(np.float32)[:, None]
    return {"id": ids.astype(np.int32), "x": x, "y": y}


def make_dataset(num_rows: int):
    import ray.data

    return ray.data.range(num_rows).map_batches(make_rows)


def init_params(seed: int = 0, hidden: int = 64):
    rng = np.random.default_rng(seed)
    sizes = [FEATURES, hidden, hidden, 1]
    return [
        {"w": (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32), "b": np.zeros((b,), np.float32)}
        for a, b in zip(sizes[:-1], sizes[1:])
    ]


def loss_fn(params, x, y):
    import jax.numpy as jnp

    h = x
    for layer in params[:-1]:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    pred = h @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean((pred - y) ** 2)


def make_optimizer(learning_rate: float):
    import optax

    return optax.adam(learning_rate)


def make_train_step(optimizer):
    import jax
    import optax

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def train_loop_per_worker(config: dict):
    import jax
    import ray.train
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec

    import ray_jax_train as rjt

    mesh = rjt.get_mesh()  # a 1-D "dp" mesh over every device of every worker
    replicated = NamedSharding(mesh, PartitionSpec())
    optimizer = make_optimizer(config["learning_rate"])
    params = jax.device_put(init_params(config.get("seed", 0)), replicated)
    opt_state = jax.device_put(optimizer.init(params), replicated)
    step_fn = jax.jit(make_train_step(optimizer), donate_argnums=(0, 1))

    record_dir = config.get("record_dir")
    seen_ids, losses, step, step_times = [], [], 0, []
    t_first = None
    while step < config["steps"]:
        batches = rjt.iter_jax_batches("train", batch_size=config["batch_size"], mesh=mesh, columns=["id", "x", "y"])
        for batch in batches:
            params, opt_state, loss = step_fn(params, opt_state, batch["x"], batch["y"])
            step += 1
            if config.get("record_ids"):
                # A test compares against one process on the same global batches: gather the row ids.
                seen_ids.append(np.asarray(multihost_utils.process_allgather(batch["id"], tiled=True)))
            if t_first is None:
                loss.block_until_ready()
                t_first = time.time()
            if step % config.get("log_every", 10) == 0 or step == config["steps"]:
                loss_value = float(loss)  # the only host sync: once per log interval
                step_times.append((step, time.time()))
                losses.append(loss_value)
                if jax.process_index() == 0:
                    print(f"step {step:5d}  loss {loss_value:.5f}", flush=True)
                ray.train.report({"loss": loss_value, "step": step})
            if step >= config["steps"]:
                break

    if record_dir and jax.process_index() == 0:
        os.makedirs(record_dir, exist_ok=True)
        flat = {f"{i}_{k}": np.asarray(v.addressable_data(0)) for i, layer in enumerate(params) for k, v in layer.items()}
        np.savez(os.path.join(record_dir, "params.npz"), **flat)
        if seen_ids:
            np.save(os.path.join(record_dir, "ids.npy"), np.stack(seen_ids))
        with open(os.path.join(record_dir, "run.json"), "w") as f:
            json.dump({"losses": losses, "first_step_done": t_first, "log_times": step_times,
                       "process_count": jax.process_count(), "device_count": jax.device_count()}, f)


def main(argv=None):
    from ray.train import RunConfig, ScalingConfig

    import ray_jax_train as rjt

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--storage-path", default=os.path.abspath("runs"))
    parser.add_argument("--record-dir", default=None)
    args = parser.parse_args(argv)

    # A private local Ray with logical CPUs for the workers plus Ray Data's read tasks, or, under `ray job submit`,
    # the cluster the job runs on.
    rjt.init_ray(num_cpus=max(os.cpu_count() or 1, args.num_workers + 2), include_dashboard=False)
    trainer = rjt.JaxTrainer(
        train_loop_per_worker,
        train_loop_config={"steps": args.steps, "batch_size": args.batch_size, "learning_rate": args.learning_rate,
                           "record_dir": args.record_dir, "log_every": 20},
        scaling_config=ScalingConfig(num_workers=args.num_workers),
        run_config=RunConfig(name="mlp_data_parallel", storage_path=args.storage_path),
        datasets={"train": make_dataset(args.rows)},
    )
    result = trainer.fit()
    if result.error:
        raise result.error
    print(f"done: {args.num_workers} workers, {args.steps} steps; run stored under {result.path}")
    return result


if __name__ == "__main__":
    main()
