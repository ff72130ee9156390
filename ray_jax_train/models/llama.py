"""A Llama-family causal LM (Llama, Mistral, Qwen2) in Flax NNX.

Parameter paths mirror Hugging Face names (``embed_tokens``, ``layers[i].self_attn.q_proj``,
``layers[i].mlp.gate_proj``, ``input_layernorm``, ``norm``, ``lm_head``) and every projection is an
unfused 2-D ``[in, out]`` kernel, so checkpoint conversion is a rename plus transpose and sharding rules
can be written as regexes over these paths.
"""
from __future__ import annotations

import math
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ray_jax_train.config import LlamaConfig, cudnn_refusal
from ray_jax_train.models.linear import Linear, matmul
from ray_jax_train.sharding import constrain

__all__ = [
    "Attention",
    "DecoderLayer",
    "KVCache",
    "LlamaForCausalLM",
    "MLP",
    "RMSNorm",
    "attention_implementation",
    "count_params",
    "create_model",
    "flops_per_token",
    "fused_attention",
    "init_parts",
    "make_attention_mask",
    "materialised_attention",
    "num_params",
    "positions_from_mask",
    "positions_from_segments",
    "rope_inv_freq",
]

# Finite instead of -inf so that rows with no visible key (pad queries under left padding) softmax to a
# harmless uniform distribution rather than NaN, which would poison gradients through the whole batch.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32 (as HF does) and scaled by a learnt ``weight``."""

    def __init__(self, dim: int, eps: float, *, dtype: Any, param_dtype: Any):
        self.eps = eps
        self.dtype = dtype
        self.weight = nnx.Param(jnp.ones((dim,), dtype=param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        y = (x32 * jax.lax.rsqrt(var + self.eps)).astype(self.dtype)
        return self.weight[...].astype(self.dtype) * y


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """Inverse rotary frequencies [head_dim/2], including Llama-3 frequency scaling when configured."""
    dim = config.head_dim
    # The power in float64 on transformers' float32 exponents, rounded once: numpy's float32 power was 1-2 ulp off
    # torch's for a quarter of the frequencies, a phase error growing with position (2.7e-3 in logits at 2048).
    exponents = (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)).astype(np.float64)
    inv_freq = np.float32(1.0) / (np.float64(config.rope_theta) ** exponents).astype(np.float32)
    rs = config.rope_scaling
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor = rs["factor"]
        low, high = rs["low_freq_factor"], rs["high_freq_factor"]
        old_ctx = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def _rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray):
    """cos and sin [b, s, 1, d/2]: each frequency once, as both halves of a head share them."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [b, s, d/2]
    return jnp.cos(freqs)[:, :, None, :], jnp.sin(freqs)[:, :, None, :]


def _apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    # HF's rotate-half layout (first half / second half), not interleaved pairs, so HF weights need no permutation.
    # Rotating each half and concatenating once is HF's x * cos + rotate_half(x) * sin without building the
    # rotated copy: XLA:CPU ran the suite's step 2-4% faster this way (benchmarks/README.md, session 12).
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """Positions that skip padding (cumsum of the mask - 1), as HF generation computes them."""
    mask = attention_mask.astype(jnp.int32)
    pos = jnp.cumsum(mask, axis=-1) - 1
    return jnp.where(mask == 0, 1, pos)


def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
    """Positions restarting at 0 at each new segment of a packed row (segments are contiguous runs)."""
    seq = segment_ids.shape[-1]
    idx = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), segment_ids.shape)
    prev = jnp.concatenate([jnp.full_like(segment_ids[:, :1], -1), segment_ids[:, :-1]], axis=-1)
    starts = jnp.where(segment_ids != prev, idx, 0)
    return idx - jax.lax.cummax(starts, axis=1)


def make_attention_mask(batch: int, seq: int, attention_mask: Optional[jax.Array] = None,
                        segment_ids: Optional[jax.Array] = None,
                        sliding_window: Optional[int] = None) -> jax.Array:
    """Boolean [batch, q, k] mask: causal, minus padded keys, minus other segments, minus out-of-window keys."""
    q_idx = jnp.arange(seq)[:, None]
    k_idx = jnp.arange(seq)[None, :]
    allowed = k_idx <= q_idx
    if sliding_window is not None:
        allowed = allowed & (k_idx > q_idx - sliding_window)
    allowed = jnp.broadcast_to(allowed[None], (batch, seq, seq))
    if attention_mask is not None:
        allowed = allowed & (attention_mask[:, None, :] != 0)
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        allowed = allowed & same & (segment_ids[:, None, :] != 0)
        # A padding query (segment 0) sees only itself: with no key at all, its softmax would spread evenly over
        # every key, future ones included, and leak them into a row that numbers a real document 0.
        padding_query = (segment_ids == 0)[:, :, None] & (q_idx == k_idx)[None]
        allowed = allowed | padding_query
    return allowed


def _dense(cfg: LlamaConfig, din: int, dout: int, bias: bool, rngs: nnx.Rngs) -> Linear:
    return Linear(
        din, dout, use_bias=bias, dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype,
        kernel_init=nnx.initializers.normal(cfg.initializer_range), bias_init=nnx.initializers.zeros_init(),
        rngs=rngs,
    )


class Attention(nnx.Module):
    """Grouped-query self-attention with rotary embeddings; separate q/k/v/o projections."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.dtype = cfg.jnp_dtype
        self.attention_impl = cfg.attention_impl
        self.sliding_window = cfg.sliding_window
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = _dense(cfg, h, self.num_heads * d, cfg.attention_bias, rngs)
        self.k_proj = _dense(cfg, h, self.num_kv_heads * d, cfg.attention_bias, rngs)
        self.v_proj = _dense(cfg, h, self.num_kv_heads * d, cfg.attention_bias, rngs)
        self.o_proj = _dense(cfg, self.num_heads * d, h, cfg.attention_out_bias, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array) -> jax.Array:
        q, k, v = self._project(x, cos, sin)
        if attention_implementation(self.attention_impl, q.shape, self.dtype) == "cudnn":
            out = fused_attention(q, k, v, mask, self.sliding_window, implementation="cudnn")
            return self.o_proj(out.reshape(*x.shape[:2], self.num_heads * self.head_dim))
        return self._attend(q, k, v, mask)

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array, keys: jax.Array,
               values: jax.Array, index: jax.Array) -> Tuple[jax.Array, jax.Array, jax.Array]:
        """Attention of the new tokens ``x`` over a layer's cache ``[b, slots, kv, d]``, after writing their keys
        and values at slot ``index``; ``mask`` is ``[b, s, slots]``. Returns (output, keys, values)."""
        q, k, v = self._project(x, cos, sin)
        keys = jax.lax.dynamic_update_slice_in_dim(keys, k.astype(keys.dtype), index, axis=1)
        values = jax.lax.dynamic_update_slice_in_dim(values, v.astype(values.dtype), index, axis=1)
        return self._attend(q, keys, values, mask), keys, values

    def _project(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        b, s, _ = x.shape
        kv, d = self.num_kv_heads, self.head_dim
        groups = self.num_heads // kv
        q = _apply_rope(self.q_proj(x).reshape(b, s, self.num_heads, d), cos, sin)
        k = _apply_rope(self.k_proj(x).reshape(b, s, kv, d), cos, sin)
        v = self.v_proj(x).reshape(b, s, kv, d)
        # Query heads h = kv_head * groups + g, matching HF's repeat_kv ordering.
        # Under a mesh: batch stays on dp/fsdp, heads on tp; queries keep their sp shard while keys and values
        # are gathered over sp only (every query needs every key), never over the batch.
        q = constrain(q.reshape(b, s, kv, groups, d), ("batch", "seq", "heads", None, None))
        k = constrain(k, ("batch", None, "heads", None))
        v = constrain(v, ("batch", None, "heads", None))
        return q, k, v

    def _attend(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
        out = materialised_attention(q, k, v, mask, self.dtype)
        return self.o_proj(out.reshape(*q.shape[:2], self.num_heads * self.head_dim))


def materialised_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, dtype: Any) -> jax.Array:
    """Attention with float32 scores ``[b, kv, groups, q, k]`` in memory; runs on every backend and mesh.
    ``q`` [b, s, kv, groups, d], ``k``/``v`` [b, slots, kv, d], ``mask`` [b, s, slots]; returns [b, s, kv * groups, d]."""
    b, s, kv, groups, d = q.shape
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
    scores = constrain(scores * (d ** -0.5), ("batch", "heads", None, "seq", None))
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    out = constrain(out, ("batch", "seq", "heads", None, None))
    return out.reshape(b, s, kv * groups, d)


def _mesh_splits(logical: str) -> int:
    """Into how many pieces the mesh set with `jax.set_mesh` splits a logical activation dimension (1 without one)."""
    from ray_jax_train.sharding import ACTIVATION_AXES

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return math.prod(sizes.get(axis, 1) for axis in ACTIVATION_AXES.get(logical, ()))


def cudnn_attention_problem(q_shape: Tuple[int, ...], dtype: Any) -> Optional[str]:
    """Why cuDNN's fused attention cannot run this attention here (None: it can). ``q_shape`` is
    ``[batch, seq, kv_heads, groups, head_dim]``; checked at trace time, against the default backend and the mesh
    set with `jax.set_mesh` (a model whose arrays were put on the CPU of a GPU host is traced for the GPU: set
    attention_impl="xla" for it)."""
    import jax.extend

    if jax.default_backend() != "gpu" or "cuda" not in jax.extend.backend.get_backend().platform_version.lower():
        return f"the backend is {jax.default_backend()!r}, not an NVIDIA GPU"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"the compute dtype is {jnp.dtype(dtype).name}; cuDNN's fused attention needs bfloat16 or float16"
    seq, head_dim = q_shape[1], q_shape[-1]
    capability = tuple(int(x) for x in str(getattr(jax.devices()[0], "compute_capability", "0.0")).split("."))
    if capability < (8, 0):  # JAX does not check this; cuDNN itself would fail
        return f"the GPU's compute capability is {'.'.join(map(str, capability))}; cuDNN's fused attention needs 8.0+"
    max_head_dim = 256 if capability >= (9, 0) else 128
    if head_dim % 8 or head_dim > max_head_dim:
        return f"head_dim={head_dim}; cuDNN needs a multiple of 8 up to {max_head_dim} on this GPU"
    if seq % 2:
        return f"the sequence length {seq} is odd; cuDNN's fused attention with a mask needs an even one"
    if _mesh_splits("seq") > 1 or _mesh_splits("heads") > 1:
        # cuDNN's partitioner refuses a sharded sequence, and needs queries and keys sharded alike over heads,
        # which grouped-query heads split by tensor parallelism need not be.
        return "the mesh shards the sequence or the heads (sp/tp > 1); cuDNN's attention here runs on dp/fsdp meshes"
    return None


def attention_implementation(requested: str, q_shape: Tuple[int, ...], dtype: Any) -> str:
    """``"xla"`` or ``"cudnn"`` for a config's ``attention_impl``: "auto" takes cuDNN wherever it can run, and an
    explicit "cudnn" that cannot run fails here, at trace time, saying why, rather than deep inside XLA."""
    if requested == "xla":
        return "xla"
    problem = cudnn_attention_problem(q_shape, dtype)
    if problem is None:
        return "cudnn"
    if requested == "cudnn":
        raise ValueError(cudnn_refusal(problem))
    return "xla"


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, sliding_window: Optional[int], *,
                    implementation: str) -> jax.Array:
    """``jax.nn.dot_product_attention`` on the model's layout: ``q`` [b, s, kv, groups, d], ``k``/``v`` [b, s, kv, d],
    ``mask`` [b, q, k]; returns [b, s, kv * groups, d]. Causal (and the window) are passed as such so cuDNN skips the
    blocks they exclude; the mask, which adds padding and packed segments, goes in as a bias."""
    b, s, kv, groups, d = q.shape
    # Query heads are kv_head * groups + g here and in jax.nn's grouped-query layout alike.
    q = q.reshape(b, s, kv * groups, d)
    # A query that sees no key at all (padding under left padding) sees itself instead: cuDNN's softmax over a
    # row of equal large negatives is not guaranteed finite, and such a row's output is never used.
    eye = jnp.eye(mask.shape[-2], mask.shape[-1], dtype=bool)[None]
    mask = mask | (eye & ~mask.any(axis=-1, keepdims=True))
    window = (sliding_window - 1, 0) if sliding_window is not None else None
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=d ** -0.5, is_causal=True,
                                        local_window_size=window, implementation=implementation)


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _dense(cfg, h, i, False, rngs)
        self.up_proj = _dense(cfg, h, i, False, rngs)
        self.down_proj = _dense(cfg, i, h, False, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        # The intermediate activation is split over tp like the gate/up columns (Megatron MLP).
        hidden = constrain(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x), ("batch", "seq", "ff"))
        return self.down_proj(hidden)


class DecoderLayer(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        kw = dict(dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        x = constrain(x, _RESIDUAL)
        return constrain(x + self.mlp(self.post_attention_layernorm(x)), _RESIDUAL)

    def decode(self, x, cos, sin, mask, keys, values, index):
        """``__call__`` on new tokens against this layer's KV cache (see ``Attention.decode``)."""
        h, keys, values = self.self_attn.decode(self.input_layernorm(x), cos, sin, mask, keys, values, index)
        x = constrain(x + h, _RESIDUAL)
        return constrain(x + self.mlp(self.post_attention_layernorm(x)), _RESIDUAL), keys, values


def init_parts(config: LlamaConfig) -> List[Tuple[Tuple[Any, ...], Callable[[nnx.Rngs], nnx.Module]]]:
    """The model's constructor cut into parts: (path in the params, ``make(rngs) -> module``), in draw order.

    ``LlamaForCausalLM.__init__`` builds exactly these, in this order, from one rng stream. So a caller may build
    each part in a program of its own, threading the stream's count from one to the next, and get the same
    values; every decoder layer shares one ``make``, so such a caller compiles one init program for all layers
    (``ray_jax_train.lm.state.init_params``).
    """
    kw = dict(dtype=config.jnp_dtype, param_dtype=config.jnp_param_dtype)

    def embed(rngs: nnx.Rngs) -> nnx.Embed:
        return nnx.Embed(config.vocab_size, config.hidden_size,
                         embedding_init=nnx.initializers.normal(config.initializer_range), rngs=rngs, **kw)

    def layer(rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(config, rngs=rngs)

    def norm(rngs: nnx.Rngs) -> RMSNorm:
        return RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)

    def lm_head(rngs: nnx.Rngs) -> Linear:
        return _dense(config, config.hidden_size, config.vocab_size, False, rngs)

    parts = [(("embed_tokens",), embed)]
    parts += [(("layers", i), layer) for i in range(config.num_hidden_layers)]
    parts.append((("norm",), norm))
    if not config.tie_word_embeddings:
        parts.append((("lm_head",), lm_head))
    return parts


# The residual stream [batch, seq, hidden]: batch over dp/fsdp, sequence over sp, hidden whole.
_RESIDUAL = ("batch", "seq", None)


def _run_layer(layer: DecoderLayer, x, cos, sin, mask):
    return layer(x, cos, sin, mask)


# Rematerialised variant: activations inside each layer are recomputed in the backward pass, trading
# ~1/3 more compute for memory that no longer grows with the per-layer intermediates.
_run_layer_remat = nnx.remat(_run_layer)


class KVCache(NamedTuple):
    """Keys and values of the tokens seen so far, in a fixed number of slots so that decoding never changes shape.

    ``keys``/``values``: one ``[batch, slots, kv_heads, head_dim]`` array per layer; ``mask``: ``[batch, slots]``,
    1 where a slot holds a real token; ``index``: the next slot to fill. One index serves the whole batch:
    prompts are left-padded, so every row's next token goes to the same slot.
    """

    keys: Tuple[jax.Array, ...]
    values: Tuple[jax.Array, ...]
    mask: jax.Array
    index: jax.Array

    @classmethod
    def create(cls, config: LlamaConfig, batch: int, slots: int) -> "KVCache":
        shape = (batch, slots, config.num_key_value_heads, config.head_dim)
        layers = config.num_hidden_layers
        return cls(keys=tuple(jnp.zeros(shape, config.jnp_dtype) for _ in range(layers)),
                   values=tuple(jnp.zeros(shape, config.jnp_dtype) for _ in range(layers)),
                   mask=jnp.zeros((batch, slots), jnp.int32), index=jnp.zeros((), jnp.int32))


def _cache_attention_mask(slot_mask: jax.Array, index: jax.Array, seq: int,
                          sliding_window: Optional[int]) -> jax.Array:
    """Boolean [batch, seq, slots] mask of new tokens (in slots index, index+1, ...) over the cache slots:
    causal and windowed by slot, as ``make_attention_mask`` is by column, minus slots without a real token."""
    q_idx = index + jnp.arange(seq)[:, None]
    k_idx = jnp.arange(slot_mask.shape[1])[None, :]
    allowed = k_idx <= q_idx
    if sliding_window is not None:
        allowed = allowed & (k_idx > q_idx - sliding_window)
    return allowed[None] & (slot_mask[:, None, :] != 0)


class LlamaForCausalLM(nnx.Module):
    """Decoder-only LM returning float32 logits ``[batch, seq, vocab]``.

    Call: ``model(input_ids, attention_mask=None, *, positions=None, segment_ids=None)``.
    ``attention_mask`` is HF's [batch, seq] 1/0 padding mask (left or right padding); positions then
    skip the padding like HF generation. ``segment_ids`` (0 = padding) makes attention block-diagonal
    for packed rows, and positions restart per segment unless ``positions`` is given.
    ``decode`` runs new tokens against a ``KVCache``, for generation (``ray_jax_train.models.generate``).
    Ids must lie in [0, vocab_size): the call cannot check them inside jit, and XLA's lookup gives NaN for an id
    past the table (and through attention, for every position of its row) and the last row for a negative one.
    The training and generation paths check their ids before they get here.
    """

    def __init__(self, config: LlamaConfig, *, rngs: Optional[nnx.Rngs] = None):
        if rngs is None:
            rngs = nnx.Rngs(config.seed)
        self.config = config
        built = {path: make(rngs) for path, make in init_parts(config)}
        self.embed_tokens = built[("embed_tokens",)]
        self.layers = nnx.List([built[("layers", i)] for i in range(config.num_hidden_layers)])
        self.norm = built[("norm",)]
        if not config.tie_word_embeddings:
            self.lm_head = built[("lm_head",)]

    def _embed(self, input_ids: jax.Array) -> jax.Array:
        return _embed_lookup(self.embed_tokens, input_ids)

    def __call__(self, input_ids: jax.Array, attention_mask: Optional[jax.Array] = None, *,
                 positions: Optional[jax.Array] = None, segment_ids: Optional[jax.Array] = None) -> jax.Array:
        cfg = self.config
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}; for one sequence "
                             "pass ids[None]")
        b, s = input_ids.shape
        if positions is None:
            if segment_ids is not None:
                positions = positions_from_segments(segment_ids)
            elif attention_mask is not None:
                positions = positions_from_mask(attention_mask)
            else:
                positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        mask = constrain(make_attention_mask(b, s, attention_mask, segment_ids, cfg.sliding_window),
                         ("batch", "seq", None))
        cos, sin = _rope_cos_sin(positions, rope_inv_freq(cfg))

        # With a mesh set (`jax.set_mesh`), constraints keep activations batch-sharded: without them XLA may
        # gather the whole batch next to an FSDP-sharded weight instead of gathering the (smaller) weight.
        x = constrain(self._embed(input_ids).astype(cfg.jnp_dtype), _RESIDUAL)
        run = _run_layer_remat if cfg.remat else _run_layer
        for layer in self.layers:
            x = run(layer, x, cos, sin, mask)
        return self._logits(x)

    def decode(self, input_ids: jax.Array, cache: KVCache,
               attention_mask: Optional[jax.Array] = None) -> Tuple[jax.Array, KVCache]:
        """Run ``input_ids`` [batch, s] after the tokens in ``cache``: a left-padded prompt, then one token a step.

        Returns the float32 logits of the last token [batch, vocab] and the cache with these tokens added.
        ``attention_mask`` marks padding among ``input_ids`` (default: none); positions continue each row's count
        of real tokens, as ``positions_from_mask`` numbers the whole sequence. The cache must have room for them:
        a write past its last slot would be clamped over earlier tokens (XLA's rule for out-of-range slices).
        """
        cfg = self.config
        b, s = input_ids.shape
        slots = cache.mask.shape[1]
        filled = 0 if isinstance(cache.index, jax.core.Tracer) else int(cache.index)  # known outside jit only
        if filled + s > slots:
            raise ValueError(f"the KV cache has {slots} slots ({filled} filled), too few for {s} more tokens; make "
                             "it with KVCache.create(config, batch, slots) large enough for the prompt and every "
                             "token to come")
        new = jnp.ones((b, s), jnp.int32) if attention_mask is None else attention_mask.astype(jnp.int32)
        positions = jnp.sum(cache.mask, axis=1, keepdims=True) + jnp.cumsum(new, axis=1) - 1
        positions = jnp.where(new == 0, 1, positions)
        slot_mask = jax.lax.dynamic_update_slice_in_dim(cache.mask, new, cache.index, axis=1)
        mask = _cache_attention_mask(slot_mask, cache.index, s, cfg.sliding_window)
        cos, sin = _rope_cos_sin(positions, rope_inv_freq(cfg))

        x = constrain(self._embed(input_ids).astype(cfg.jnp_dtype), _RESIDUAL)
        keys, values = [], []
        for layer, k, v in zip(self.layers, cache.keys, cache.values):
            x, k, v = layer.decode(x, cos, sin, mask, k, v, cache.index)
            keys.append(k)
            values.append(v)
        # Only the last token's logits: a prompt's full [batch, s, vocab] would be most of prefill's memory.
        logits = self._logits(x[:, -1:])[:, 0]
        return logits, KVCache(tuple(keys), tuple(values), slot_mask, cache.index + s)

    def _logits(self, x: jax.Array) -> jax.Array:
        x = self.norm(x)
        if self.config.tie_word_embeddings:
            logits = _embed_attend(self.embed_tokens, x)
        else:
            logits = self.lm_head(x)
        return constrain(logits.astype(jnp.float32), ("batch", "seq", "vocab"))


def _embed_lookup(embed: nnx.Embed, ids: jax.Array) -> jax.Array:
    """``embed(ids)``, but with the table gathered over the FSDP axes first when a mesh is set.

    A lookup into a table split along the hidden dimension lets XLA move the whole batch of token ids and
    gradients to the table's shards instead; gathering the (small) table, as FSDP does for every weight, keeps
    the lookup local, and its transpose turns the gradient into a reduce-scatter. The vocabulary stays on tp.

    The rows are taken from a float32 view of the (bf16) table: the lookup's gradient adds up every occurrence of
    a token into its row, and summed in bf16 a frequent token's row (EOS, a space) lost half its gradient and
    more (a numerics review). The view changes no value forward, and the table still travels in bf16.
    """
    (table,) = embed.promote_dtype((_gathered_table(embed),), dtype=embed.dtype, inexact=False)
    wide = jnp.promote_types(table.dtype, jnp.float32)
    return jnp.take(table.astype(wide), ids, axis=0).astype(table.dtype)


def _gathered_table(embed: nnx.Embed) -> jax.Array:
    return constrain(embed.embedding[...], ("vocab", None))


def _embed_attend(embed: nnx.Embed, x: jax.Array) -> jax.Array:
    """``embed.attend(x)`` (tied lm_head) on the FSDP-gathered table, so logits stay batch-sharded."""
    x, table = embed.promote_dtype((x, _gathered_table(embed)), dtype=embed.dtype)
    return matmul(x, table.T)


def create_model(config: LlamaConfig, *, lazy: bool = False, rngs: Optional[nnx.Rngs] = None) -> LlamaForCausalLM:
    """Build the model (seeded by ``config.seed`` unless ``rngs`` is given).

    ``lazy=True`` gives an abstract model (ShapeDtypeStructs, no device memory), from which shardings
    can be derived before weights are materialised or loaded.
    """
    if lazy:
        seed = config.seed
        return nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(seed)))
    return LlamaForCausalLM(config, rngs=rngs)


def count_params(config: LlamaConfig, *, include_embeddings: bool = True) -> int:
    """Analytic parameter count (matches the model's state; tied lm_head counted once)."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    nq, nkv = config.num_attention_heads, config.num_key_value_heads
    attn = h * nq * d + 2 * h * nkv * d + nq * d * h
    if config.attention_bias:
        attn += nq * d + 2 * nkv * d
    if config.attention_out_bias:
        attn += h
    per_layer = attn + 3 * h * i + 2 * h
    total = config.num_hidden_layers * per_layer + h
    if include_embeddings:
        total += config.vocab_size * h
        if not config.tie_word_embeddings:
            total += config.vocab_size * h
    return total


def num_params(model: nnx.Module) -> int:
    """Number of parameters actually held by ``model`` (works on lazy/abstract models too)."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token for MFU: 6 * (matmul params) + 12 * layers * heads * head_dim * seq_len.

    Matmul params are every projection plus the output projection (vocab x hidden, tied or not); the
    embedding lookup and norms do no matmul work. The attention term counts QK^T and AV forward and
    backward over the full (non-causally-halved) sequence, the PaLM/Megatron convention, so numbers are
    comparable with published MFU figures. With a sliding window shorter than ``seq_len`` each query sees at
    most ``sliding_window`` keys, so the window replaces the sequence length there.
    """
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    nq, nkv = config.num_attention_heads, config.num_key_value_heads
    per_layer = h * nq * d + 2 * h * nkv * d + nq * d * h + 3 * h * i
    matmul_params = config.num_hidden_layers * per_layer + config.vocab_size * h
    keys = seq_len if config.sliding_window is None else min(seq_len, config.sliding_window)
    attention = 12 * config.num_hidden_layers * nq * d * keys
    return float(6 * matmul_params + attention)
