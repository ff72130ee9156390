"""A dense layer whose backward pass computes the weight gradient in the kernel's own orientation.

JAX differentiates `x @ w` into `transpose(g^T-contracted-with-x)`: it builds the weight gradient as
`[out, in]` and transposes it. XLA:CPU then copies the large activation gradient into a transposed layout and
runs some of these dots outside its fast (YNNPACK) path. Contracting `x` with `g` straight into `[in, out]`
(the same products and sums) made the benchmark suite's whole train step about 1.2x faster on CPU
(benchmarks/README.md, session 12). The price: a `jax.custom_vjp` has no forward-mode derivative, so
`jax.jvp`/`jax.jacfwd` through the model are not available.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["Linear", "matmul"]


@jax.custom_vjp
def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w` over the last axis of `x` ([..., in] x [in, out]); see the module docstring for the backward."""
    return jnp.dot(x, w)


def _matmul_fwd(x, w):
    return jnp.dot(x, w), (x, w)


def _matmul_bwd(residuals, g):
    x, w = residuals
    leading = tuple(range(x.ndim - 1))
    dx = jax.lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())))
    dw = jax.lax.dot_general(x, g, ((leading, leading), ((), ())))  # [in, out] directly, no transpose after
    return dx.astype(x.dtype), dw.astype(w.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


class Linear(nnx.Linear):
    """`nnx.Linear` (same parameters, paths and init) computing through `matmul`.

    Only the features the models use: no `dot_general` override, `precision`, `preferred_element_type` or
    `out_sharding` (a mesh's sharding comes from the models' activation constraints).
    """

    def __init__(self, *args, **kwargs):
        dropped = [key for key in ("precision", "preferred_element_type") if kwargs.get(key) is not None]
        dropped += ["dot_general"] if kwargs.get("dot_general", jax.lax.dot_general) is not jax.lax.dot_general else []
        if dropped:
            raise ValueError(f"ray_jax_train.models.linear.Linear does not apply {dropped}; use flax.nnx.Linear for "
                             "those (its backward is JAX's own).")
        super().__init__(*args, **kwargs)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, self.kernel[...], bias), dtype=self.dtype)
        y = matmul(inputs, kernel)
        if bias is not None:
            y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y
