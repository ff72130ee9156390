"""Model zoo: Llama-family causal LMs in Flax NNX and Hugging Face checkpoint conversion."""
from ray_jax_train.models.generation import generate, generate_text
from ray_jax_train.models.hf import from_pretrained, generation_eos_ids, load_hf_config, save_pretrained
from ray_jax_train.models.llama import (
    KVCache,
    LlamaForCausalLM,
    count_params,
    create_model,
    flops_per_token,
    num_params,
)

__all__ = [
    "KVCache",
    "LlamaForCausalLM",
    "count_params",
    "create_model",
    "flops_per_token",
    "from_pretrained",
    "generate",
    "generate_text",
    "generation_eos_ids",
    "load_hf_config",
    "num_params",
    "save_pretrained",
]
