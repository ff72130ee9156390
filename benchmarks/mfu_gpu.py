"""Model FLOPs utilisation of the built-in Llama training on one accelerator, in bf16.

MFU = tokens/s x `flops_per_token(config, seq)` / the device's dense bf16 peak. The step is the whole training
step (forward, backward, AdamW update) on synthetic tokens, jitted with donated state; time is measured over
steady-state steps after compile and warm-up, each step's loss fetched so nothing is left queued.

    python benchmarks/mfu_gpu.py --sizes 125m 1b --out bench_out/mfu_gpu.json     # on a GPU
    python benchmarks/mfu_gpu.py --smoke                                           # tiny, CPU: checks it runs

Sizes: "125m" is GPT-2-small shaped (hidden 768, 12 layers, 12 heads, 134M params with untied 32k embeddings);
"1b" is TinyLlama-1.1B shaped (hidden 2048, 22 layers, GQA 32/4 heads). Parameters are float32 master weights
with bf16 compute (`--param-dtype bfloat16` for pure bf16).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# Dense (non-sparse) bf16 peak FLOP/s per device, matched as a substring of `device.device_kind`, most
# specific first. Vendor datasheet figures.
PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("V100", 125e12),  # fp16 tensor cores; no bf16
    ("TPU v6", 918e12),
    ("TPU v5p", 459e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v4", 275e12),
)

SIZES = {
    "125m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=12),
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4),
    "smoke": dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2),
}


def peak_flops(device, override_tflops=None):
    """(peak FLOP/s, source) for `device`; None when unknown (e.g. CPU) and no override was given."""
    if override_tflops:
        return override_tflops * 1e12, "--peak-tflops"
    kind = getattr(device, "device_kind", "")
    for name, flops in PEAK_BF16_FLOPS:
        if name.lower() in kind.lower():
            return flops, f"table: {name}"
    return None, f"unknown device kind {kind!r}"


def build(size: str, seq: int, param_dtype: str, remat: bool, vocab_size=None, attention: str = "auto"):
    from ray_jax_train.config import LlamaConfig

    shape = dict(SIZES[size], **({"vocab_size": vocab_size} if vocab_size else {}))
    return LlamaConfig(**shape, max_position_embeddings=max(seq, 64), dtype="bfloat16",
                       param_dtype=param_dtype, remat=remat, tie_word_embeddings=False, attention_impl=attention)


def plain_step(cfg, batch: int, seq: int, total_steps: int):
    """(init, step, batch maker) of a minimal step: AdamW on the mean cross-entropy of random tokens."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    from ray_jax_train.models.llama import create_model

    graphdef = nnx.split(create_model(cfg, lazy=True), nnx.Param)[0]
    optimizer = optax.adamw(1e-4, weight_decay=0.1)

    def init():  # eagerly: XLA:GPU took minutes to compile this whole random init as one program
        params = nnx.to_pure_dict(nnx.state(create_model(cfg), nnx.Param))
        return {"params": params, "opt_state": optimizer.init(params)}

    def loss_fn(params, ids):
        logits = nnx.merge(graphdef, params)(ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    def step(state, ids):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], ids)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    def rows(rng):
        return rng.integers(0, cfg.vocab_size, (batch, seq + 1), dtype=np.int32)

    return init, step, rows


def builtin_step(cfg, batch: int, seq: int, total_steps: int):
    """(init, step, batch maker) of the built-in loop's own train step, built as the loop builds it: its optimizer
    (clipped AdamW with a warm-up, the settings `gpu_session.py`'s loop stage uses), its init and its jitted step
    (`jit_train_step`, state shardings, a 1-device mesh), on packed rows (segment ids, positions, loss mask). The
    step returns every metric and all are fetched, so nothing the loop computes is left out of the program.
    Against the plain step it says what the loop's step itself costs."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from ray_jax_train.lm import state as state_lib
    from ray_jax_train.lm.arguments import TrainingArguments
    from ray_jax_train.lm.step import jit_train_step, make_optimizer, new_state

    args = TrainingArguments(total_steps=total_steps, batch_size=batch, max_sequence_length=seq, learning_rate=3e-4,
                             warmup_steps=2)
    optimizer, _ = make_optimizer(args, total_steps)
    mesh = Mesh(np.array(jax.devices()[:1]), ("dp",))
    new_state_fn = lambda params, step: new_state(params, optimizer, step)  # noqa: E731
    graphdef, _ = state_lib.abstract_params(cfg)
    abstract = state_lib.abstract_state(cfg, mesh, new_state_fn)
    jitted = jit_train_step(graphdef, optimizer, 1, jax.tree.map(lambda leaf: leaf.sharding, abstract), mesh)
    rows_sharding = NamedSharding(mesh, PartitionSpec("dp"))

    def init():
        return state_lib.initial_state({}, cfg, mesh, new_state_fn=new_state_fn)

    def rows(rng):
        tokens = rng.integers(0, cfg.vocab_size, (batch, seq + 1), dtype=np.int32)
        host = {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.ones((batch, seq), np.int32),
                "segment_ids": np.ones((batch, seq), np.int32),
                "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy()}
        return jax.device_put(host, rows_sharding)

    class Step:  # the loop runs its step under the mesh; measure() lowers and calls it like a jitted function
        def lower(self, state, batch_):
            with jax.set_mesh(mesh):
                return jitted.lower(state, batch_)

    return init, Step(), rows


def measure(size: str, *, batch: int, seq: int, steps: int, warmup: int, param_dtype: str = "float32",
            remat: bool = False, peak_tflops=None, vocab_size=None, step_kind: str = "plain",
            attention: str = "auto") -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from ray_jax_train.models.llama import attention_implementation, create_model, flops_per_token, num_params

    cfg = build(size, seq, param_dtype, remat, vocab_size, attention)
    # Resolved as the step resolves it (on one device, no mesh): what "auto" ran is part of the figure.
    attention_used = attention_implementation(
        attention, (batch, seq, cfg.num_key_value_heads, cfg.num_key_value_groups, cfg.head_dim), cfg.jnp_dtype)
    graphdef, abstract = nnx.split(create_model(cfg, lazy=True), nnx.Param)
    make = builtin_step if step_kind == "builtin" else plain_step
    init, step, rows = make(cfg, batch, seq, warmup + steps + 1)
    device = jax.devices()[0]
    t0 = time.perf_counter()
    state = init()
    step_fn = step if hasattr(step, "lower") else jax.jit(step, donate_argnums=0)
    rng = np.random.default_rng(0)
    batches = [jax.device_put(rows(rng), device) if step_kind == "plain" else rows(rng) for _ in range(2)]
    compiled = step_fn.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t0

    def loss_of(out):  # the built-in step returns all its metrics: fetch them all, as the loop does at a log step
        return float(jax.device_get(out)["loss"]) if isinstance(out, dict) else float(out)

    for i in range(warmup):
        state, out = compiled(state, batches[i % 2])
        loss_of(out)
    times, losses = [], []
    for i in range(steps):
        start = time.perf_counter()
        state, out = compiled(state, batches[i % 2])
        losses.append(loss_of(out))  # waits for the step, so each time is a whole step
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tokens_per_s = batch * seq / step_s
    fpt = flops_per_token(cfg, seq)
    peak, peak_source = peak_flops(device, peak_tflops)
    memory = device.memory_stats() if hasattr(device, "memory_stats") else None
    return {
        "size": size,
        "step": step_kind,
        "vocab_size": cfg.vocab_size,
        "params": num_params(nnx.merge(graphdef, abstract)),
        "device": getattr(device, "device_kind", str(device)),
        "platform": device.platform,
        "batch": batch,
        "seq": seq,
        "dtype": "bfloat16",
        "param_dtype": param_dtype,
        "remat": remat,
        "attention": attention_used,
        "compile_s": round(compile_s, 2),
        "step_s_median": step_s,
        "step_s_mean": statistics.mean(times),  # beside the median: a GPU's clock may sag over a longer run
        "step_s_min": min(times),
        "step_s_max": max(times),
        "tokens_per_s": tokens_per_s,
        "flops_per_token": fpt,
        "model_tflops_per_s": tokens_per_s * fpt / 1e12,
        "peak_tflops": peak / 1e12 if peak else None,
        "peak_source": peak_source,
        "mfu": tokens_per_s * fpt / peak if peak else None,
        "peak_bytes_in_use": (memory or {}).get("peak_bytes_in_use"),
        "final_loss": losses[-1],
        "finite": bool(np.isfinite(losses).all()),
    }


DEFAULT_BATCH = {"125m": 16, "1b": 8, "smoke": 2}


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["125m", "1b"], choices=sorted(SIZES))
    parser.add_argument("--smoke", action="store_true", help="tiny model, few steps: runs anywhere, e.g. CPU CI")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default per size)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--remat", action="store_true", help="recompute layer activations in the backward pass")
    parser.add_argument("--vocab", type=int, default=None,
                        help="override the size's vocabulary, e.g. to match a run's trained tokenizer")
    parser.add_argument("--step", default="plain", choices=["plain", "builtin"],
                        help="plain: a minimal AdamW step; builtin: the built-in loop's own step (ray_jax_train.lm)")
    parser.add_argument("--attention", nargs="+", default=["auto"], choices=["auto", "xla", "cudnn"],
                        help="model.attention_impl; several are measured one after the other")
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the device's bf16 peak")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.seq, args.steps, args.warmup = ["smoke"], min(args.seq, 32), min(args.steps, 3), 1

    results = []
    for size in args.sizes:
        for attention in args.attention:
            result = measure(size, batch=args.batch or DEFAULT_BATCH[size], seq=args.seq, steps=args.steps,
                             warmup=args.warmup, param_dtype=args.param_dtype, remat=args.remat,
                             peak_tflops=args.peak_tflops, vocab_size=args.vocab,
                             step_kind=args.step, attention=attention)
            results.append(result)
            mfu = f"{100 * result['mfu']:.1f}%" if result["mfu"] is not None else "n/a (no peak for this device)"
            print(f"{size}: {result['params'] / 1e6:.1f}M params on {result['device']}, batch {result['batch']} x "
                  f"{result['seq']}, attention {result['attention']}: {result['tokens_per_s']:,.0f} tokens/s, "
                  f"{result['model_tflops_per_s']:.1f} model TFLOP/s, MFU {mfu}", flush=True)
            if args.out:  # after each figure: a later one that runs out of time must not take this one with it
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    sys.exit(0 if all(r["finite"] for r in main()) else 1)
