"""The fused-attention path (`attention_impl`): its layout, masks and grouped-query mapping against the model's own
materialised attention, through `jax.nn.dot_product_attention`'s XLA implementation on CPU. cuDNN itself needs an
NVIDIA GPU: `benchmarks/attention_check.py` runs the same comparison with cuDNN there (a lent GPU machine; see
benchmarks/README.md for the last run)."""
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ray_jax_train.config import LlamaConfig
from ray_jax_train.models.llama import attention_implementation, create_model, fused_attention, make_attention_mask

_spec = importlib.util.spec_from_file_location(
    "attention_check", os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "attention_check.py"))
attention_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(attention_check)
CASES, compare = attention_check.CASES, attention_check.compare


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_attention_matches_the_materialised_one(case):
    errors = compare(case, implementation="xla", dtype=jnp.float32)
    assert errors["out"] < 1e-5 and errors["grads"] < 1e-5, errors


def test_compare_catches_a_wrong_mask():
    # The check can fail: a fused call that drops the packing mask is told apart from the model's attention.
    errors = compare("packed", implementation="xla", dtype=jnp.float32, drop_mask=True)
    assert errors["out"] > 1e-2


@pytest.mark.parametrize("case", ["causal", "window_only"])
def test_causality_and_the_window_hold_without_the_mask(case):
    """What cuDNN uses to skip blocks (is_causal, local_window_size) must itself be the model's causality and
    window: with the mask dropped, the fused call still matches."""
    errors = compare(case, implementation="xla", dtype=jnp.float32, drop_mask=True)
    assert errors["out"] < 1e-5 and errors["grads"] < 1e-5, errors


def test_a_query_that_sees_no_key_attends_to_itself():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32))
               for shape in ((1, 8, 2, 2, 8), (1, 8, 2, 8), (1, 8, 2, 8)))
    mask = make_attention_mask(1, 8).at[0, 3].set(False)  # query 3 sees nothing
    out = fused_attention(q, k, v, mask, None, implementation="xla")
    # Query head n reads kv head n // groups.
    np.testing.assert_allclose(out[0, 3], np.repeat(np.asarray(v[0, 3]), 2, axis=0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("remat", [False, True])
def test_the_model_on_the_fused_path_matches_the_materialised_one(monkeypatch, remat):
    """The model's own cuDNN branch (layout back to [b, s, heads * d], o_proj), run through XLA's implementation
    since CPU has no cuDNN: packed rows with padding, grouped-query heads, a sliding window, with and without remat."""
    from ray_jax_train.models import llama

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, model_type="mistral",
                      num_attention_heads=4, num_key_value_heads=2, sliding_window=5, remat=remat)
    ids = jnp.asarray(np.random.default_rng(1).integers(1, 64, (2, 16)))
    segments = jnp.asarray([[1] * 6 + [2] * 8 + [0] * 2, [1] * 16])
    # Two models with the same weights: JAX caches what remat traced, so the patched run needs a model of its own.
    want = np.asarray(create_model(cfg.replace(attention_impl="xla"))(ids, segment_ids=segments))
    model = create_model(cfg)
    used = []
    original = llama.fused_attention

    def through_xla(*args, **kwargs):
        used.append(kwargs["implementation"])
        return original(*args, **dict(kwargs, implementation="xla"))

    monkeypatch.setattr(llama, "attention_implementation", lambda *args: "cudnn")
    monkeypatch.setattr(llama, "fused_attention", through_xla)
    got = np.asarray(model(ids, segment_ids=segments))
    assert used and set(used) == {"cudnn"}  # the fused branch ran, once per layer call
    real = np.asarray(segments) != 0  # padding queries' outputs are never used (and differ by design)
    np.testing.assert_allclose(got[real], want[real], rtol=2e-5, atol=2e-5)


def test_auto_takes_xla_off_gpu_and_an_explicit_cudnn_says_why_it_cannot_run():
    if jax.default_backend() != "cpu":
        pytest.skip("what 'auto' picks off a GPU; this machine has another backend")
    q_shape = (2, 16, 2, 2, 8)
    assert attention_implementation("auto", q_shape, jnp.bfloat16) == "xla"
    assert attention_implementation("xla", q_shape, jnp.bfloat16) == "xla"
    with pytest.raises(ValueError, match="attention_impl='cudnn' cannot run: the backend is 'cpu'"):
        attention_implementation("cudnn", q_shape, jnp.bfloat16)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, attention_impl="cudnn")
    with pytest.raises(ValueError, match="cannot run"):
        create_model(cfg)(jnp.zeros((1, 8), jnp.int32))
    assert "attention_impl" not in cfg.to_hf_dict()
    assert cfg.cudnn_attention_problem(use_gpu=True).startswith("dtype=float32")
    assert "odd" in cfg.replace(dtype="bfloat16").cudnn_attention_problem(use_gpu=True, seq_len=127)
    assert cfg.replace(dtype="bfloat16").cudnn_attention_problem(use_gpu=True) is None
    assert "NVIDIA GPUs only" in cfg.replace(dtype="bfloat16").cudnn_attention_problem(use_gpu=False)
    with pytest.raises(ValueError, match="attention_impl"):
        LlamaConfig(attention_impl="flash")
    np.testing.assert_equal(cfg.replace(attention_impl="auto").attention_impl, "auto")
