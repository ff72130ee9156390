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
import optax
from flax import nnx

from ray_jax_train.lm.arguments import TrainingArguments

Batch = Dict[str, jax.Array]
# Columns the model call understands besides input_ids; packed rows carry segment_ids and positions.
MODEL_INPUTS = ("attention_mask", "segment_ids", "positions")


def make_schedule(args: TrainingArguments, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0, then cosine/linear decay to `min_learning_rate_ratio * lr`, or constant."""
    peak, warmup = args.learning_rate, min(args.warmup_steps, total_steps)
    end = peak * args.min_learning_rate_ratio
    if args.scheduler == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(total_steps, warmup + 1), end)
    if args.scheduler == "linear":
        decay = optax.linear_schedule(peak, end, max(total_steps - warmup, 1))
    else:
        decay = optax.constant_schedule(peak)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def make_optimizer(args: TrainingArguments, total_steps: int) -> Tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with global-norm clipping; weight decay only on matrices (not norms or biases)."""
    schedule = make_schedule(args, total_steps)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    adamw = optax.adamw(schedule, b1=args.adam_beta1, b2=args.adam_beta2, eps=args.adam_epsilon,
                        weight_decay=args.weight_decay, mask=decay_mask)
    clip = optax.clip_by_global_norm(args.max_grad_norm) if args.max_grad_norm else optax.identity()
    return float32_moments(optax.chain(clip, adamw)), schedule


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


def loss_sums(graphdef, params, batch: Batch) -> Tuple[jax.Array, jax.Array]:
    """(sum of masked next-token cross-entropy, number of loss tokens) for one batch.

    Sums, not means: the caller divides once by the token count of the whole (accumulated) batch, which is
    what makes k micro-batches add up to exactly one big batch even when they hold different token counts.
    """
    model = nnx.merge(graphdef, params)
    inputs = {key: batch[key] for key in MODEL_INPUTS if key in batch}
    logits = model(batch["input_ids"], inputs.pop("attention_mask", None), **inputs)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"].astype(jnp.float32)
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


def make_train_step(graphdef, optimizer: optax.GradientTransformation, accumulation_steps: int = 1) -> Callable:
    """`train_step(state, batch) -> (state, metrics)`; metrics are device scalars (no host sync)."""
    grad_fn = jax.value_and_grad(lambda p, b: loss_sums(graphdef, p, b), has_aux=True)

    def train_step(state, batch: Batch):
        params = state["params"]
        if accumulation_steps == 1:
            (loss_sum, tokens), grads = grad_fn(params, batch)
        else:
            def accumulate(carry, micro):
                (loss_sum, tokens), grads = grad_fn(params, micro)
                acc_grads, acc_loss, acc_tokens = carry
                return (jax.tree.map(jnp.add, acc_grads, grads), acc_loss + loss_sum, acc_tokens + tokens), None

            zeros = jax.tree.map(jnp.zeros_like, params)
            carry = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
            (grads, loss_sum, tokens), _ = jax.lax.scan(accumulate, carry, _micro_batches(batch, accumulation_steps))
        denom = jnp.maximum(tokens, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
                     "opt_state": opt_state}
        return new_state, {"loss": loss_sum / denom, "grad_norm": grad_norm, "tokens": tokens}

    return train_step


def make_eval_step(graphdef) -> Callable:
    """`eval_step(params, batch) -> (loss_sum, tokens)`, summed so batches of any fill average correctly."""
    return lambda params, batch: loss_sums(graphdef, params, batch)


def new_state(params, optimizer: optax.GradientTransformation, step: int = 0) -> Dict[str, Any]:
    return {"step": jnp.asarray(step, jnp.int32), "params": params, "opt_state": optimizer.init(params)}
