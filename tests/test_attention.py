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
from ray_jax_train.models.llama import attention_implementation, create_model

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


def test_auto_takes_xla_off_gpu_and_an_explicit_cudnn_says_why_it_cannot_run():
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
    assert cfg.replace(dtype="bfloat16").cudnn_attention_problem(use_gpu=True) is None
    assert "NVIDIA GPUs only" in cfg.replace(dtype="bfloat16").cudnn_attention_problem(use_gpu=False)
    with pytest.raises(ValueError, match="attention_impl"):
        LlamaConfig(attention_impl="flash")
    assert jax.default_backend() == "cpu"  # what makes "auto" pick xla above
    np.testing.assert_equal(cfg.replace(attention_impl="auto").attention_impl, "auto")
