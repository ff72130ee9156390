"""The pure pieces of a causal-LM step: optimizer, masked loss, train step with accumulation, eval step.

Nothing here knows about Ray: the loop jits these, and tests run the very same functions in one process to
check the distributed run against them.

The train state is a plain pytree `{"step", "params", "opt_state"}` with `params` a pure dict of arrays
(`nnx.to_pure_dict`), so optax, orbax and `jax.tree` treat it like any other pytree.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ray_jax_train.lm.arguments import TrainingArguments

Batch = Dict[str, jax.Array]
# Columns the model call understands besides input_ids; packed rows carry segment_ids and positions.
MODEL_INPUTS = ("attention_mask", "segment_ids", "positions")


def schedule_value(step, *, scheduler: str, peak: Any, end: Any, warmup: Any, total: Any, xp=jnp) -> jax.Array:
    """The learning rate at `step`: linear warmup from 0, then cosine/linear decay to `end`, or constant.

    Plain array arithmetic, so every number may be traced: the optimizer evaluates it from hyperparameters held in
    its state (see `make_optimizer`), and the host calls it with the same numbers, in numpy (`xp=np`), for the
    logged rate.
    """
    step = xp.asarray(step, xp.float32)
    warmup = xp.asarray(warmup, xp.float32)
    warming = peak * step / xp.maximum(warmup, 1.0)
    done = xp.clip((step - warmup) / xp.maximum(total - warmup, 1.0), 0.0, 1.0)
    if scheduler == "cosine":
        decayed = end + (peak - end) * 0.5 * (1.0 + xp.cos(xp.pi * done))
    elif scheduler == "linear":
        decayed = peak + (end - peak) * done
    else:
        decayed = xp.broadcast_to(xp.asarray(peak, xp.float32), step.shape)
    return xp.where(step < warmup, warming, decayed)


def _hyperparameters(args: TrainingArguments, total_steps: int) -> Dict[str, Any]:
    return {"peak_learning_rate": args.learning_rate, "end_learning_rate": args.learning_rate * args.min_learning_rate_ratio,
            "warmup_steps": float(min(args.warmup_steps, total_steps)), "total_steps": float(total_steps),
            "b1": args.adam_beta1, "b2": args.adam_beta2, "eps": args.adam_epsilon, "weight_decay": args.weight_decay,
            "max_grad_norm": float(args.max_grad_norm or 0.0)}


def make_schedule(args: TrainingArguments, total_steps: int) -> optax.Schedule:
    """The host-side learning-rate schedule (for logging): the same numbers the optimizer's state holds.

    In numpy: a GPU trace showed the jnp version running a dozen tiny programs on the device at every log step,
    each a dispatch the host waited on, and the step after them queued behind. A jax.Array (a traced count, as
    when it is handed to optax) still gets jnp."""
    hp = _hyperparameters(args, total_steps)
    return lambda step: schedule_value(step, scheduler=args.scheduler, peak=hp["peak_learning_rate"],
                                       end=hp["end_learning_rate"], warmup=hp["warmup_steps"], total=hp["total_steps"],
                                       xp=jnp if isinstance(step, jax.Array) else np)


def _decay_mask(params):
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def _adamw(peak_learning_rate, end_learning_rate, warmup_steps, total_steps, b1, b2, eps, weight_decay, max_grad_norm,
           *, scheduler: str, clip: bool) -> optax.GradientTransformation:
    def schedule(count):
        return schedule_value(count, scheduler=scheduler, peak=peak_learning_rate, end=end_learning_rate,
                              warmup=warmup_steps, total=total_steps)

    adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=_decay_mask)
    return optax.chain(optax.clip_by_global_norm(max_grad_norm) if clip else optax.identity(), adamw)


def make_optimizer(args: TrainingArguments, total_steps: int) -> Tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with global-norm clipping; weight decay only on matrices (not norms or biases).

    The numbers (learning rates, warmup and total steps, betas, eps, weight decay, clip norm) live in the optimizer
    state (`optax.inject_hyperparams`, in float32 whatever the param dtype), not in the compiled train step: runs
    and Tune trials that differ only in them share one step program, which the compilation cache then serves. The
    schedule kind and whether to clip at all are structure, so they stay static.
    """
    hp = _hyperparameters(args, total_steps)
    optimizer = optax.inject_hyperparams(_adamw, hyperparam_dtype=jnp.float32)(
        **hp, scheduler=args.scheduler, clip=bool(args.max_grad_norm))
    return float32_moments(optimizer), make_schedule(args, total_steps)


def float32_moments(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` with its state initialised from float32 copies of low-precision params.

    The step's gradients are float32 (divided by a float32 token count), so moments that start as bfloat16
    zeros would be float32 after the first update: the state would change type and the donated step would
    compile twice. Float32 moments are also what mixed-precision training wants.
    """
    def upcast(params):
        return jax.tree.map(lambda p: p.astype(jnp.float32)
                            if jnp.issubdtype(p.dtype, jnp.floating) and jnp.finfo(p.dtype).bits < 32 else p, params)

    return optax.GradientTransformation(lambda params: inner.init(upcast(params)), inner.update)


def keep_hyperparameters(restored_opt_state, current_opt_state):
    """`restored_opt_state` with the hyperparameters of `current_opt_state`: a resumed run, or one started from a
    given state, trains with its own settings (those its schedule logs), not with those the state was saved with."""
    if hasattr(restored_opt_state, "hyperparams") and hasattr(current_opt_state, "hyperparams"):
        return restored_opt_state._replace(hyperparams=current_opt_state.hyperparams)
    return restored_opt_state


def hyperparameter_values(opt_state) -> Dict[str, float]:
    """The optimizer numbers an `inject_hyperparams` state holds, as host floats (replicated: any local copy)."""
    def value(leaf) -> float:
        return float(np.asarray(leaf.addressable_data(0) if isinstance(leaf, jax.Array) else leaf))

    return {name: value(leaf) for name, leaf in getattr(opt_state, "hyperparams", {}).items()}


def changed_hyperparameters(restored_opt_state, current_opt_state) -> Dict[str, Tuple[float, float]]:
    """{name: (saved, this run's)} for the optimizer numbers `keep_hyperparameters` is about to replace."""
    saved, current = hyperparameter_values(restored_opt_state), hyperparameter_values(current_opt_state)
    return {name: (saved[name], new) for name, new in current.items()
            if name in saved and not np.isclose(saved[name], new, rtol=1e-6, atol=0.0)}


def loss_sums(graphdef, params, batch: Batch) -> Tuple[jax.Array, jax.Array]:
    """(sum of masked next-token cross-entropy, number of loss tokens) for one batch.

    Sums, not means: the caller divides once by the token count of the whole (accumulated) batch, which is
    what makes k micro-batches add up to exactly one big batch even when they hold different token counts.
    """
    model = nnx.merge(graphdef, params)
    inputs = {key: batch[key] for key in MODEL_INPUTS if key in batch}
    logits = model(batch["input_ids"], inputs.pop("attention_mask", None), **inputs)
    mask = batch["loss_mask"].astype(jnp.float32)
    # Untrained targets (padding) become 0: an id past the vocabulary gives a NaN loss, and NaN * 0 is NaN.
    targets = jnp.where(batch["loss_mask"] != 0, batch["targets"], 0)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    if "valid" in batch:  # padding rows of a padded eval batch
        mask = mask * batch["valid"].astype(jnp.float32)[:, None]
    return jnp.sum(losses * mask), jnp.sum(mask)


def _micro_batches(batch: Batch, k: int) -> Batch:
    """[B, ...] -> [k, B/k, ...] taking every k-th row, so each device's rows feed every micro-batch equally.

    Splitting into contiguous blocks instead would put micro-batch j on a few devices only and force XLA to
    move rows between devices; strided rows keep each micro-batch sharded exactly like the big batch.
    """
    def split(x):
        return jnp.swapaxes(x.reshape((x.shape[0] // k, k) + x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def jit_train_step(graphdef, optimizer: optax.GradientTransformation, accumulation_steps: int, state_shardings,
                   mesh) -> Callable:
    """The jitted step, donating the state and handing it back sharded as it came in (`state_shardings`).

    Left to itself, XLA gave an fsdp-only mesh with gradient accumulation its norm weights (and their moments)
    back fsdp-sharded instead of replicated: the step compiled a second time, and the donation missed.
    """
    from jax.sharding import NamedSharding, PartitionSpec

    step = make_train_step(graphdef, optimizer, accumulation_steps,
                           one_all_reduce_over=one_all_reduce_axes(mesh, state_shardings))
    return jax.jit(step, donate_argnums=(0,), out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())))


def one_all_reduce_axes(mesh, state_shardings) -> Tuple[str, ...]:
    """The mesh axes to sum gradients over in one flat all-reduce, or () to leave the reduction to XLA.

    XLA:CPU runs the all-reduce of a gradient pytree as one gloo call per array, and each call costs a round trip:
    39 arrays of the suite's model (20 MB) took 171 ms against 27 ms as one buffer, which cost 2 workers a fifth of
    their step. So on CPU, with the state replicated (pure data parallelism over processes), the step sums the
    gradients itself in one buffer. GPUs and TPUs batch their collectives already; sharded states keep XLA's plan.
    """
    from ray_jax_train.mesh import BATCH_AXES

    devices = mesh.devices.flat
    if jax.process_count() == 1 or any(d.platform != "cpu" for d in devices):
        return ()
    if any(not s.is_fully_replicated for s in jax.tree.leaves(state_shardings)):
        return ()
    if any(size > 1 and name not in BATCH_AXES for name, size in mesh.shape.items()):
        return ()
    # In BATCH_AXES order, as iter_jax_batches splits the batch, so each shard keeps its own rows.
    return tuple(name for name in BATCH_AXES if mesh.shape.get(name, 1) > 1)


def make_train_step(graphdef, optimizer: optax.GradientTransformation, accumulation_steps: int = 1, *,
                    one_all_reduce_over: Tuple[str, ...] = ()) -> Callable:
    """`train_step(state, batch) -> (state, metrics)`; metrics are device scalars (no host sync).

    `one_all_reduce_over` (mesh axes, under `jax.set_mesh`): each shard of the batch computes its own gradients and
    they are summed over those axes in one flat all-reduce (`one_all_reduce_axes` says when that pays).
    """
    grad_fn = jax.value_and_grad(lambda p, b: loss_sums(graphdef, p, b), has_aux=True)

    def summed_grads(params, batch: Batch):
        """(loss sum, loss tokens, gradient sums) over the batch, micro-batch by micro-batch."""
        if accumulation_steps == 1:
            (loss_sum, tokens), grads = grad_fn(params, batch)
            return loss_sum, tokens, grads

        def accumulate(carry, micro):
            # The params are loop-invariant, so XLA hoisted their fsdp all-gathers out of the scan and held every
            # gathered weight for the whole step: more memory per device with accumulation than unsharded. Tied to
            # each micro-batch here, each is gathered where it is used, as without accumulation.
            p, micro = jax.lax.optimization_barrier((params, micro))
            (loss_sum, tokens), grads = grad_fn(p, micro)
            acc_grads, acc_loss, acc_tokens = carry
            acc_grads = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc_grads, grads)
            return (acc_grads, acc_loss + loss_sum, acc_tokens + tokens), None

        # float32 sums, whatever the weights' dtype: bf16 sums of k micro-batch gradients lose their low bits
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        carry = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
        (grads, loss_sum, tokens), _ = jax.lax.scan(accumulate, carry, _micro_batches(batch, accumulation_steps))
        return loss_sum, tokens, grads

    if one_all_reduce_over:
        summed_grads = _in_one_all_reduce(summed_grads, tuple(one_all_reduce_over))

    def train_step(state, batch: Batch):
        params = state["params"]
        loss_sum, tokens, grads = summed_grads(params, batch)
        denom = jnp.maximum(tokens, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
                     "opt_state": opt_state}
        return new_state, {"loss": loss_sum / denom, "grad_norm": grad_norm, "tokens": tokens}

    return train_step


def _in_one_all_reduce(summed_grads: Callable, axes: Tuple[str, ...]) -> Callable:
    """`summed_grads` run on each batch shard, its outputs summed over `axes` as one float32 buffer."""
    from jax.flatten_util import ravel_pytree
    from jax.sharding import PartitionSpec

    def local(params, batch):
        out = summed_grads(params, batch)
        flat, unflatten = ravel_pytree(jax.tree.map(lambda x: x.astype(jnp.float32), out))
        summed = unflatten(jax.lax.psum(flat, axes))
        return jax.tree.map(lambda total, x: total.astype(x.dtype), summed, out)

    def run(params, batch):
        # check_vma=False: with it, differentiating replicated params against sharded activations would insert a
        # psum per gradient array, the very all-reduces this replaces.
        return jax.shard_map(local, in_specs=(PartitionSpec(), PartitionSpec(axes)), out_specs=PartitionSpec(),
                             check_vma=False)(params, batch)

    return run


def make_eval_step(graphdef) -> Callable:
    """`eval_step(params, batch) -> (loss_sum, tokens)`, summed so batches of any fill average correctly."""
    return lambda params, batch: loss_sums(graphdef, params, batch)


def new_state(params, optimizer: optax.GradientTransformation, step: int = 0) -> Dict[str, Any]:
    return {"step": jnp.asarray(step, jnp.int32), "params": params, "opt_state": optimizer.init(params)}
