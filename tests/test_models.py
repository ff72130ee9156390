"""Parity of the NNX Llama-family model with transformers (PyTorch, CPU, float32) and HF checkpoint I/O."""
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from ray_jax_train.config import LlamaConfig  # noqa: E402
from ray_jax_train.models import (  # noqa: E402
    LlamaForCausalLM,
    count_params,
    create_model,
    flops_per_token,
    from_pretrained,
    num_params,
    save_pretrained,
)

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=1000.0)

ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama_tied_bias": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                        {"tie_word_embeddings": True, "attention_bias": True}),
    # sliding_window shorter than the test sequence so the window mask is exercised.
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 6}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              {"tie_word_embeddings": True}),
    "llama_rope3": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 16}}),
}


@nnx.jit
def forward(model, ids, mask=None, positions=None, segment_ids=None):
    # One compiled program per test instead of eager op-by-op dispatch, which compiles every primitive.
    return model(ids, mask, positions=positions, segment_ids=segment_ids)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make_hf(name, seed=0):
    cfg_cls, model_cls, extra = ARCHS[name]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**TINY, **extra})).eval()
    # HF initialises biases to 0 and norms to 1; perturb everything so those parameters are really tested.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def random_model(cfg, seed=0):
    """Model with random weights set from numpy: skips eager JAX init, which compiles every random op."""
    model = create_model(cfg, lazy=True)
    rng = np.random.default_rng(seed)
    state = nnx.state(model)
    values = jax.tree.map(lambda x: jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype), state)
    nnx.update(model, values)
    return model


def hf_logits(model, ids, mask=None):
    with torch.no_grad():
        if mask is None:
            return model(torch.as_tensor(ids)).logits.numpy()
        mask_t = torch.as_tensor(mask)
        # HF forward does not derive positions from the mask (generate does); pass them as generate would.
        pos = (mask_t.cumsum(-1) - 1).masked_fill(mask_t == 0, 1)
        return model(torch.as_tensor(ids), attention_mask=mask_t, position_ids=pos).logits.numpy()


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, TINY["vocab_size"], size=(2, 12)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, :4] = 0  # left padding on the second row
    return ids, mask


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Each architecture saved once by transformers (the Llama one sharded, to exercise the index path)."""
    out = {}
    for name in ARCHS:
        model = make_hf(name)
        d = tmp_path_factory.mktemp(name)
        shard = {"max_shard_size": "40KB"} if name == "llama" else {}
        model.save_pretrained(d, **shard)
        out[name] = (model, d)
    return out


@pytest.mark.parametrize("name", list(ARCHS))
def test_logits_match_transformers(name, hf_dirs, batch):
    hf_model, d = hf_dirs[name]
    if name == "llama":
        assert (d / "model.safetensors.index.json").is_file(), "fixture should have produced a sharded checkpoint"
    ids, mask = batch
    ours = from_pretrained(d)
    assert isinstance(ours, LlamaForCausalLM)
    assert ours.config.model_type == name.split("_")[0]

    out = np.asarray(forward(ours, jnp.asarray(ids)))
    assert out.dtype == np.float32 and out.shape == (2, 12, TINY["vocab_size"])
    assert rel_err(out, hf_logits(hf_model, ids)) < 1e-4

    out_m = np.asarray(forward(ours, jnp.asarray(ids), jnp.asarray(mask)))
    ref_m = hf_logits(hf_model, ids, mask)
    keep = mask.astype(bool)
    assert np.isfinite(out_m).all()
    assert rel_err(out_m[keep], ref_m[keep]) < 1e-4
    # The padded row must not just equal the unpadded computation, or the mask test proved nothing.
    assert rel_err(out_m[1, 4:], out[1, 4:]) > 1e-3


def test_qwen2_has_qkv_bias_only(hf_dirs):
    ours = from_pretrained(hf_dirs["qwen2"][1])
    attn = ours.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    assert ours.config.tie_word_embeddings and not hasattr(ours, "lm_head")


def test_export_round_trip_loads_in_transformers(hf_dirs, batch, tmp_path):
    ids, mask = batch
    for name in ("llama", "qwen2", "llama_tied_bias"):
        hf_model, d = hf_dirs[name]
        ours = from_pretrained(d)
        out_dir = tmp_path / name
        save_pretrained(ours, out_dir, max_shard_size="30KB" if name == "qwen2" else None)
        cfg = json.loads((out_dir / "config.json").read_text())
        assert cfg["architectures"] == [type(hf_model).__name__]
        reloaded = type(hf_model).from_pretrained(out_dir).eval()
        assert rel_err(hf_logits(reloaded, ids, mask)[mask.astype(bool)],
                       hf_logits(hf_model, ids, mask)[mask.astype(bool)]) < 1e-6
        # And our own loader reads our export back to identical parameters.
        again = from_pretrained(out_dir)
        for (p1, v1), (p2, v2) in zip(nnx.to_flat_state(nnx.state(ours)), nnx.to_flat_state(nnx.state(again))):
            assert p1 == p2
            np.testing.assert_array_equal(np.asarray(v1.get_value()), np.asarray(v2.get_value()))
    # Saved again unsharded over the sharded export: its shards go, a file of the user's beside them stays.
    (tmp_path / "qwen2" / "model_ema.safetensors").write_bytes(b"mine")
    save_pretrained(from_pretrained(tmp_path / "qwen2"), tmp_path / "qwen2")
    assert sorted(p.name for p in (tmp_path / "qwen2").glob("*.safetensors")) == ["model.safetensors",
                                                                                "model_ema.safetensors"]


def test_segment_ids_match_separate_documents():
    model = random_model(LlamaConfig(**TINY))
    rng = np.random.default_rng(1)
    doc_a = rng.integers(0, 128, size=5)
    doc_b = rng.integers(0, 128, size=4)
    packed = np.concatenate([doc_a, doc_b, [0, 0]])[None]  # two docs + 2 pad tokens
    seg = np.array([[1] * 5 + [2] * 4 + [0, 0]])
    out = np.asarray(forward(model, jnp.asarray(packed), segment_ids=jnp.asarray(seg)))
    # Both documents alone, as one right-padded batch (one compiled program instead of two).
    alone = np.stack([doc_a, np.concatenate([doc_b, [0]])])
    alone_mask = np.array([[1] * 5, [1] * 4 + [0]])
    ref = np.asarray(forward(model, jnp.asarray(alone), jnp.asarray(alone_mask)))
    ref_a, ref_b = ref[0], ref[1, :4]
    assert rel_err(out[0, :5], ref_a) < 1e-5
    assert rel_err(out[0, 5:9], ref_b) < 1e-5
    # Explicit positions give the same answer as the ones derived from segment_ids.
    pos = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 0]])
    out_p = np.asarray(forward(model, jnp.asarray(packed), segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos)))
    np.testing.assert_allclose(out_p[0, :9], out[0, :9], rtol=1e-6, atol=1e-6)
    # Without segment_ids, doc_b would see doc_a: the logits must differ.
    plain = np.asarray(forward(model, jnp.asarray(packed)))
    assert rel_err(plain[0, 5:9], ref_b) > 1e-3


def test_remat_and_bf16(hf_dirs):
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 128, size=(2, 8)))
    # One layer keeps the two gradient compiles cheap; remat wraps each layer the same way regardless.
    cfg = LlamaConfig(**{**TINY, "num_hidden_layers": 1})
    base, remat = random_model(cfg), random_model(cfg.replace(remat=True))

    def loss(m):
        return jnp.mean(jax.nn.log_softmax(m(ids))[..., 0])

    g1, g2 = nnx.jit(lambda a, b: (nnx.grad(loss)(a), nnx.grad(loss)(b)))(base, remat)
    for (p1, a), (p2, b) in zip(nnx.to_flat_state(g1), nnx.to_flat_state(g2)):
        assert p1 == p2
        np.testing.assert_allclose(np.asarray(a.get_value()), np.asarray(b.get_value()), rtol=1e-4, atol=1e-6)

    hf_model, d = hf_dirs["llama"]
    bf = from_pretrained(d, param_dtype="bfloat16")
    assert bf.config.dtype == "bfloat16"
    assert bf.layers[0].mlp.up_proj.kernel.get_value().dtype == jnp.bfloat16
    out = forward(bf, ids)
    assert out.dtype == jnp.float32
    assert rel_err(out, hf_logits(hf_model, np.array(ids))) < 0.05  # same weights up to bf16 rounding


def test_param_paths_are_hf_like_2d_kernels():
    cfg = LlamaConfig(**TINY, attention_bias=True)
    model = create_model(cfg, lazy=True)
    shapes = {"/".join(map(str, p)): tuple(v.get_value().shape)
              for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    # lazy model: abstract shapes, nothing allocated
    assert isinstance(model.embed_tokens.embedding.get_value(), jax.ShapeDtypeStruct)
    assert shapes["embed_tokens/embedding"] == (128, 64)
    assert shapes["layers/1/self_attn/q_proj/kernel"] == (64, 64)
    assert shapes["layers/1/self_attn/k_proj/kernel"] == (64, 32)
    assert shapes["layers/1/self_attn/k_proj/bias"] == (32,)
    assert shapes["layers/0/mlp/gate_proj/kernel"] == (64, 96)
    assert shapes["layers/0/mlp/down_proj/kernel"] == (96, 64)
    assert shapes["layers/0/input_layernorm/weight"] == (64,)
    assert shapes["norm/weight"] == (64,)
    assert shapes["lm_head/kernel"] == (64, 128)
    assert all(len(s) == 2 for k, s in shapes.items() if k.endswith("kernel"))


@pytest.mark.parametrize("extra", [{}, {"tie_word_embeddings": True, "attention_bias": True,
                                       "attention_out_bias": True, "head_dim": 32}])
def test_param_count_and_flops(extra):
    cfg = LlamaConfig(**TINY, **extra)
    assert num_params(create_model(cfg, lazy=True)) == count_params(cfg)
    if not extra:
        # embeddings 2*128*64, per layer: q,o 64*64, k,v 64*32, mlp 3*64*96, two norms; final norm
        assert count_params(cfg) == 2 * 128 * 64 + 2 * (2 * 4096 + 2 * 2048 + 3 * 64 * 96 + 128) + 64
        matmul = 2 * (2 * 4096 + 2 * 2048 + 3 * 64 * 96) + 128 * 64
        assert flops_per_token(cfg, 32) == 6 * matmul + 12 * 2 * 4 * 16 * 32
    assert flops_per_token(cfg, 64) > flops_per_token(cfg, 32)
    # A sliding window caps the keys each query attends to, so the attention term stops growing at the window.
    windowed = cfg.replace(model_type="mistral", sliding_window=8, attention_bias=False, attention_out_bias=False)
    plain = windowed.replace(sliding_window=None)
    assert flops_per_token(windowed, 32) == flops_per_token(plain, 8)  # same matmuls, 8 keys per query
    assert flops_per_token(windowed, 4) == flops_per_token(plain, 4)


def test_from_pretrained_errors(tmp_path, hf_dirs):
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        from_pretrained(tmp_path / "nope")
    with pytest.raises(ValueError, match="config.json is missing"):
        from_pretrained(tmp_path)
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"gpt2.*supported model types: llama.*mistral.*qwen2"):
        from_pretrained(bad)
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    (noweights / "config.json").write_text((hf_dirs["mistral"][1] / "config.json").read_text())
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        from_pretrained(noweights)
    # Damaged files (a copy cut short): named with the fix, not a bare JSONDecodeError, KeyError or SafetensorError.
    damaged = tmp_path / "damaged"
    shutil.copytree(hf_dirs["mistral"][1], damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file .*Copy the directory"):
        from_pretrained(damaged)
    (damaged / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"index.json is damaged: .*KeyError: 'weight_map'"):
        from_pretrained(damaged)


def test_create_model_initialises_from_seed():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, initializer_range=0.1, seed=5)
    m1, m2 = create_model(cfg), create_model(cfg)
    k1 = np.asarray(m1.layers[0].mlp.up_proj.kernel.get_value())
    np.testing.assert_array_equal(k1, np.asarray(m2.layers[0].mlp.up_proj.kernel.get_value()))
    assert abs(k1.std() - 0.1) < 0.02
    # Each layer gets its own values.
    k2 = np.asarray(m1.layers[1].mlp.up_proj.kernel.get_value())
    assert k2.shape == k1.shape and abs(k2.std() - 0.1) < 0.02 and np.abs(k1 - k2).max() > 0.1
    np.testing.assert_array_equal(np.asarray(m1.norm.weight.get_value()), np.ones(32, np.float32))
    out = forward(m1, jnp.zeros((1, 4), jnp.int32))
    assert out.shape == (1, 4, 64) and np.isfinite(np.asarray(out)).all()
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, seq\], got shape \(4,\); .* ids\[None\]"):
        m1(jnp.zeros(4, jnp.int32))  # was "not enough values to unpack"


def test_from_pretrained_places_params_with_given_sharding(hf_dirs):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    seen = []

    def sharding(path, shape):
        seen.append(path)
        return NamedSharding(mesh, PartitionSpec("fsdp") if len(shape) == 2 else PartitionSpec())

    model = from_pretrained(hf_dirs["mistral"][1], sharding=sharding)
    kernel = model.layers[0].self_attn.q_proj.kernel.get_value()
    assert kernel.sharding.spec == PartitionSpec("fsdp")
    assert ("layers", 1, "mlp", "down_proj", "kernel") in seen and ("lm_head", "kernel") in seen
    ref = hf_dirs["mistral"][0].model.layers[0].self_attn.q_proj.weight.detach().numpy().T
    np.testing.assert_array_equal(np.asarray(kernel), ref)


# Small configs for the HF-compatibility checks below (2 layers, hidden 32, a few tokens).
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, rope_theta=1000.0)


def test_qwen2_sliding_window_export_matches_transformers(tmp_path):
    ids = np.random.default_rng(3).integers(0, 64, size=(1, 8))
    cfg = LlamaConfig(**SMALL, model_type="qwen2", sliding_window=3)
    model = random_model(cfg)
    save_pretrained(model, tmp_path)
    hf_model = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    # The export must put the window on every layer (it used to write use_sliding_window=False).
    assert hf_model.config.layer_types == ["sliding_attention"] * 2 and hf_model.config.sliding_window == 3
    ours = np.asarray(forward(model, jnp.asarray(ids)))
    assert rel_err(ours, hf_logits(hf_model, ids)) < 1e-4
    # The window matters over 8 tokens, so the match above is not the full-attention one.
    full = np.asarray(forward(random_model(cfg.replace(sliding_window=None)), jnp.asarray(ids)))
    assert rel_err(full, ours) > 1e-3
    assert from_pretrained(tmp_path).config == cfg


def test_tied_config_with_distinct_lm_head_loads_untied_like_transformers(tmp_path):
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(**SMALL, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path)
    cfg_json = json.loads((tmp_path / "config.json").read_text())
    cfg_json["tie_word_embeddings"] = True  # a wrong flag next to a real, different lm_head.weight
    (tmp_path / "config.json").write_text(json.dumps(cfg_json))
    hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert hf_model.lm_head.weight.data_ptr() != hf_model.model.embed_tokens.weight.data_ptr()
    ours = from_pretrained(tmp_path)
    assert not ours.config.tie_word_embeddings
    ids = np.random.default_rng(4).integers(0, 64, size=(1, 6))
    assert rel_err(forward(ours, jnp.asarray(ids)), hf_logits(hf_model, ids)) < 1e-4


def test_llama3_rope_without_original_max_positions_matches_transformers(tmp_path, hf_dirs):
    # The fixture's llama3 rope has original_max_position_embeddings=16; a config.json that leaves it out and
    # has max_position_embeddings=16 gets the same value from transformers (and must from us: it was a KeyError).
    src = hf_dirs["llama_rope3"][1]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg_json = json.loads((tmp_path / "config.json").read_text())
    del cfg_json["rope_parameters"]["original_max_position_embeddings"]
    cfg_json["max_position_embeddings"] = 16
    (tmp_path / "config.json").write_text(json.dumps(cfg_json))
    hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert hf_model.config.rope_parameters["original_max_position_embeddings"] == 16
    ours = from_pretrained(tmp_path)
    assert ours.config.rope_scaling["original_max_position_embeddings"] == 16
    ids = np.random.default_rng(5).integers(0, TINY["vocab_size"], size=(1, 12))
    assert rel_err(forward(ours, jnp.asarray(ids)), hf_logits(hf_model, ids)) < 1e-4


def test_padding_queries_see_only_themselves_and_untrained_targets_cannot_poison_the_loss():
    from ray_jax_train.lm.step import loss_sums
    from ray_jax_train.models.llama import make_attention_mask

    allowed = np.asarray(make_attention_mask(1, 4, None, jnp.asarray([[0, 0, 1, 1]])))[0]
    # Before: padding rows allowed no key, so softmax spread them over every key, the future included.
    np.testing.assert_array_equal(allowed, [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]])
    cfg = LlamaConfig(**TINY)
    graphdef, params = nnx.split(create_model(cfg), nnx.Param)
    batch = {"input_ids": jnp.asarray([[3, 4, 5, 0]]), "targets": jnp.asarray([[4, 5, cfg.vocab_size + 7, 0]]),
             "loss_mask": jnp.asarray([[1, 1, 0, 0]]), "segment_ids": jnp.asarray([[1, 1, 1, 0]]),
             "positions": jnp.asarray([[0, 1, 2, 0]])}
    total, tokens = loss_sums(graphdef, params, batch)  # an id past the vocabulary where nothing is trained
    assert np.isfinite(float(total)) and float(tokens) == 2.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_gradients_equal_plain_matmul_gradients(dtype):
    """`models.linear.matmul` only reorients the backward's dots: values and gradients equal `jnp.dot`'s, for the
    3-D activations the model feeds it and for a transposed weight view (the tied head)."""
    from ray_jax_train.models.linear import Linear, matmul

    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (3, 5, 8), dtype)
    w = jax.random.normal(kw, (8, 6), dtype)
    g = jax.random.normal(kg, (3, 5, 6), dtype)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for f in (lambda x, w: jnp.sum(matmul(x, w) * g), lambda x, w: jnp.sum(matmul(x, w.T.T) * g)):
        ours = jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)
        plain = jax.grad(lambda x, w: jnp.sum(jnp.dot(x, w) * g), argnums=(0, 1))(x, w)
        for a, b in zip(ours, plain):
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol, atol=tol)
    layer = Linear(8, 6, use_bias=True, dtype=dtype, rngs=nnx.Rngs(0))
    reference = nnx.Linear(8, 6, use_bias=True, dtype=dtype, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(np.float32(layer(x)), np.float32(reference(x)))
    grads = [nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32) * g))(m) for m in (layer, reference)]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match=r"does not apply \['precision'\]"):
        Linear(8, 6, precision=jax.lax.Precision.HIGHEST, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("theta,head_dim", [(1e4, 64), (5e5, 128), (1e6, 128)])
def test_rotary_frequencies_are_transformers_own(theta, head_dim):
    """numpy's float32 power was 1-2 ulp off torch's for a quarter of the frequencies: a phase error that grows
    with position (2.7e-3 in the logits of HF weights at position 2048, 1e-4 with transformers' frequencies)."""
    from ray_jax_train.models.llama import rope_inv_freq

    hf_config = transformers.LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, rope_theta=theta)
    theirs = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config).inv_freq.numpy()
    ours = rope_inv_freq(LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, rope_theta=theta))
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    ulps = np.abs(ours.view(np.int32).astype(np.int64) - theirs.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1 and np.mean(ulps == 0) > 0.9, ulps


def test_starting_from_hf_weights_is_said_and_uses_them(tmp_path, caplog):
    """A run from model.init_from never said the weights were loaded (a fine-tuning user checked with lr=1e-9)."""
    import logging

    import optax

    from ray_jax_train import make_mesh
    from ray_jax_train.lm.state import initial_state
    from ray_jax_train.lm.step import new_state

    cfg = LlamaConfig(**TINY)
    source = create_model(cfg)
    save_pretrained(source, tmp_path)
    with caplog.at_level(logging.INFO, logger="ray_jax_train.lm.state"):
        state = initial_state({"source": "hf", "path": str(tmp_path)}, cfg, make_mesh({"dp": -1}),
                              new_state_fn=lambda p, step: new_state(p, optax.sgd(0.1), step))
    assert f"Initial weights: the Hugging Face model in {tmp_path}." in caplog.text
    want = nnx.to_pure_dict(nnx.state(source, nnx.Param))
    got = state["params"]
    assert len(jax.tree.leaves(want)) == len(jax.tree.leaves(got)) > 0
    assert all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)))


def test_a_frequent_tokens_embedding_gradient_is_summed_in_float32_under_bf16_compute():
    """The lookup's gradient adds every occurrence of a token into its row. Summed in bf16 (the table cast before
    the lookup), the row of a token at half the positions came out 29% off the float32 model's here (52% at 4,096
    tokens); other weights are within a few percent (a numerics review)."""
    from ray_jax_train.lm.state import split_model
    from ray_jax_train.lm.step import loss_sums

    rng = np.random.default_rng(0)
    ids = rng.integers(3, 64, (4, 512)).astype(np.int32)
    ids[rng.random(ids.shape) < 0.5] = 5
    batch = {"input_ids": jnp.asarray(ids), "targets": jnp.asarray(np.roll(ids, -1, 1)),
             "loss_mask": jnp.ones(ids.shape, jnp.int32)}
    grads = {}
    for dtype in ("float32", "bfloat16"):
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          attention_impl="xla", dtype=dtype, param_dtype="float32")
        graphdef, params = split_model(create_model(cfg))
        grad = jax.jit(jax.grad(lambda p: loss_sums(graphdef, p, batch)[0] / ids.size))(params)
        grads[dtype] = np.asarray(grad["embed_tokens"]["embedding"])
    row, exact = grads["bfloat16"][5], grads["float32"][5]
    assert np.linalg.norm(exact) > 0
    assert np.linalg.norm(row - exact) / np.linalg.norm(exact) < 0.03
