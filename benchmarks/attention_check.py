"""Does the fused attention compute what the model's materialised attention computes? Outputs and gradients, per mask
case (causal, packed segments with padding, a sliding window, left padding), with grouped-query heads.

    python benchmarks/attention_check.py                       # on an NVIDIA GPU: cuDNN against the materialised path
    python benchmarks/attention_check.py --implementation xla  # anywhere (tests/test_attention.py runs this on CPU)

Each case reports the relative error of the fused path against the materialised one in the same dtype, and both
against a float32 materialised reference: in bf16, the fused path should be about as close to float32 as the
materialised one is. Exits non-zero when it is not (more than 2x the materialised path's error, plus 1e-3).
"""
from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ray_jax_train.models.llama import fused_attention, make_attention_mask, materialised_attention

BATCH, SEQ, KV_HEADS, GROUPS, HEAD_DIM = 2, 128, 2, 2, 64
CASES = {
    "causal": dict(),
    "packed": dict(segments=True),
    "window": dict(segments=True, window=24),
    "window_only": dict(window=24),  # with drop_mask, is_causal and local_window_size alone must give the window
    "left_padding": dict(left_padding=True),
}


def case_inputs(case: str):
    """(q, k, v, mask, window, rows) in float32, where `rows` marks the query rows whose output counts (padding
    queries under left padding attend to nothing, and their outputs are never used)."""
    spec = CASES[case]
    rng = np.random.default_rng(0)
    q = rng.standard_normal((BATCH, SEQ, KV_HEADS, GROUPS, HEAD_DIM), np.float32)
    k = rng.standard_normal((BATCH, SEQ, KV_HEADS, HEAD_DIM), np.float32)
    v = rng.standard_normal((BATCH, SEQ, KV_HEADS, HEAD_DIM), np.float32)
    segment_ids = attention_mask = None
    rows = np.ones((BATCH, SEQ), bool)
    if spec.get("segments"):  # three documents in row 0, two and a padded tail in row 1
        segment_ids = np.zeros((BATCH, SEQ), np.int32)
        segment_ids[0, :40], segment_ids[0, 40:90], segment_ids[0, 90:] = 1, 2, 3
        segment_ids[1, :70], segment_ids[1, 70:110] = 1, 2
    if spec.get("left_padding"):
        attention_mask = np.ones((BATCH, SEQ), np.int32)
        attention_mask[0, :30] = 0
        rows = attention_mask.astype(bool)
    window = spec.get("window")
    mask = make_attention_mask(BATCH, SEQ, None if attention_mask is None else jnp.asarray(attention_mask),
                               None if segment_ids is None else jnp.asarray(segment_ids), window)
    return q, k, v, mask, window, rows


def _rel(a, b, rows) -> float:
    a, b = np.asarray(a, np.float32)[rows], np.asarray(b, np.float32)[rows]
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def compare(case: str, *, implementation: str, dtype=jnp.bfloat16, drop_mask: bool = False) -> dict:
    """Relative errors of the fused path ("out", "grads": against the materialised path in `dtype`; "*_vs_f32": each
    path against float32 materialised). `drop_mask` passes an all-true mask to the fused call (the check must see it)."""
    q, k, v, mask, window, rows = case_inputs(case)
    fused_mask = jnp.ones_like(mask) if drop_mask else mask
    cotangent = np.random.default_rng(1).standard_normal((BATCH, SEQ, KV_HEADS * GROUPS, HEAD_DIM), np.float32)
    cotangent = cotangent * rows[:, :, None, None]  # gradients through unused rows do not count either

    def run(fn, dt):
        def loss(q_, k_, v_):
            out = fn(q_.astype(dt), k_.astype(dt), v_.astype(dt))
            return jnp.sum(out.astype(jnp.float32) * cotangent), out
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return np.asarray(out, np.float32), [np.asarray(g, np.float32) for g in grads]

    fused = lambda q_, k_, v_: fused_attention(q_, k_, v_, fused_mask, window, implementation=implementation)  # noqa: E731
    ref32 = run(lambda q_, k_, v_: materialised_attention(q_, k_, v_, mask, jnp.float32), jnp.float32)
    mat = run(lambda q_, k_, v_: materialised_attention(q_, k_, v_, mask, dtype), dtype)
    got = run(fused, dtype)

    def grad_err(a, b):
        return max(_rel(x, y, np.ones(x.shape[:2], bool)) for x, y in zip(a[1], b[1]))

    return {"case": case, "implementation": implementation, "dtype": jnp.dtype(dtype).name,
            "out": _rel(got[0], mat[0], rows), "grads": grad_err(got, mat),
            "out_vs_f32": _rel(got[0], ref32[0], rows), "grads_vs_f32": grad_err(got, ref32),
            "materialised_out_vs_f32": _rel(mat[0], ref32[0], rows), "materialised_grads_vs_f32": grad_err(mat, ref32)}


def acceptable(r: dict) -> bool:
    return all(r[f"{what}_vs_f32"] <= 2 * r[f"materialised_{what}_vs_f32"] + 1e-3 for what in ("out", "grads"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--implementation", default="cudnn", choices=["cudnn", "xla"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    results = []
    for case in CASES:
        try:
            r = compare(case, implementation=args.implementation, dtype=jnp.dtype(args.dtype))
            r["ok"] = acceptable(r)
        except Exception as exc:  # one case's failure (e.g. a cuDNN refusal) must not hide the others'
            r = {"case": case, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
        results.append(r)
        print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(jax.devices()[0].device_kind), "results": results}, f, indent=2)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
