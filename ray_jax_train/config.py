"""Model configuration: a validated Llama-family config and EasyDeL-style scaled configs.

Configs are pydantic models so bad values fail at construction with a message that names the field
and the fix, instead of surfacing later as an opaque shape error inside a jitted function. Dtypes are
stored as canonical strings ("float32", "bfloat16", "float16") so a config saved to JSON loads back equal.
"""
from __future__ import annotations

import math
import os
import typing
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, field_validator, model_validator
from pydantic_core import PydanticCustomError

__all__ = [
    "DEFAULT_SCALING_VARIABLES",
    "LlamaConfig",
    "MeshSpec",
    "ModelScaling",
    "SUPPORTED_MODEL_TYPES",
    "canonical_dtype",
]

# HF model_type -> architecture name written to config.json on export.
SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

_DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "f32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
}
_CANONICAL_DTYPES = ("float32", "bfloat16", "float16")


def canonical_dtype(value: Any, field: str = "dtype") -> str:
    """Map a dtype given as a string, numpy/jnp dtype or jnp scalar type to its canonical name.

    Strings keep configs JSON-serialisable; accepting jnp types keeps EasyDeL-style
    ``dtype=jnp.bfloat16`` working.
    """
    name: Optional[str] = None
    if isinstance(value, str):
        name = value.strip().lower()
        if name.startswith("jnp.") or name.startswith("np.") or name.startswith("torch."):
            name = name.split(".", 1)[1]
    else:
        try:
            import numpy as np

            name = np.dtype(value).name
        except Exception:
            # e.g. torch.bfloat16, whose str() is "torch.bfloat16"
            name = str(value).split(".")[-1].lower() if value is not None else None
    canon = _DTYPE_ALIASES.get(name) if name is not None else None
    if canon is None:
        raise ValueError(
            f"{field}={value!r} is not a supported dtype; use one of {', '.join(_CANONICAL_DTYPES)} "
            f"(strings or the matching jnp dtypes, e.g. jnp.bfloat16)"
        )
    return canon


def _dtype_validator(field: str):
    return BeforeValidator(lambda v: canonical_dtype(v, field))


DType = Annotated[str, _dtype_validator("dtype"), PlainSerializer(lambda v: v, return_type=str)]
ParamDType = Annotated[str, _dtype_validator("param_dtype"), PlainSerializer(lambda v: v, return_type=str)]


def _takes_number(annotation: Any) -> bool:
    """Whether an int or float is part of a field's type (Optional[int], Dict[str, float], tuple[int, ...])."""
    if annotation in (int, float):
        return True
    return any(_takes_number(arg) for arg in typing.get_args(annotation))


def _holds_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, dict):
        return any(_holds_bool(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(_holds_bool(v) for v in value)


def refuse_bool_numbers(cls, value: Any, info) -> Any:
    """Every config model's field validator (``field_validator("*", mode="before")``): pydantic's lax mode reads
    true/false as 1/0 in int and float fields, so `batch_size: true` trained with a batch of 1 and said nothing."""
    if _holds_bool(value) and _takes_number(cls.model_fields[info.field_name].annotation):
        raise PydanticCustomError("number_type", "Input should be a number, not a boolean")
    return value


def _to_jnp(name: str):
    import jax.numpy as jnp

    return jnp.dtype(name)


class _Base(BaseModel):
    # frozen: configs are hashable (usable as jit static args) and cannot drift after validation.
    # allow_inf_nan: inf and NaN passed every bound (rope_theta=inf trained without rope, and was exported).
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, protected_namespaces=(),
                              allow_inf_nan=False)
    _no_bool_numbers = field_validator("*", mode="before")(refuse_bool_numbers)

    def __hash__(self) -> int:
        # Dict/list fields defeat pydantic's field hash; models keep their config as static graph data,
        # which JAX transforms hash.
        return hash((type(self).__name__, self.model_dump_json()))

    def replace(self, **changes: Any):
        """Return a copy with ``changes`` applied and re-validated (``model_copy`` would skip validation)."""
        data = self.model_dump()
        data.update(changes)
        return type(self).model_validate(data)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str):
        return cls.model_validate_json(text)

    def save_json(self, path: Union[str, os.PathLike]) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load_json(cls, path: Union[str, os.PathLike]):
        with open(path) as f:
            return cls.from_json(f.read())


class LlamaConfig(_Base):
    """Config of a Llama-family decoder (Llama, Mistral, Qwen2 share this shape).

    ``attention_bias`` adds biases to q/k/v (as Qwen2 does); ``attention_out_bias`` adds one to o_proj
    too (HF Llama's ``attention_bias=True`` sets both). ``head_dim`` defaults to hidden_size / heads.
    """

    model_type: str = "llama"
    vocab_size: int = Field(32000, gt=0)
    hidden_size: int = Field(4096, gt=0)
    intermediate_size: int = Field(11008, gt=0)
    num_hidden_layers: int = Field(32, gt=0)
    num_attention_heads: int = Field(32, gt=0)
    num_key_value_heads: Optional[int] = Field(None, gt=0)
    head_dim: Optional[int] = Field(None, gt=0)
    rms_norm_eps: float = Field(1e-6, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    # HF rope_parameters for non-default rope types (only "llama3" is implemented).
    rope_scaling: Optional[dict[str, Any]] = None
    max_position_embeddings: int = Field(2048, gt=0)
    # Mistral-style: a token attends only to the previous `sliding_window` tokens (None = unlimited).
    sliding_window: Optional[int] = Field(None, gt=0)
    initializer_range: float = Field(0.02, ge=0)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    dtype: DType = "float32"
    param_dtype: ParamDType = "float32"
    remat: bool = False
    # How attention is computed: "xla" materialises the scores (runs anywhere); "cudnn" is cuDNN's fused (flash)
    # kernel, which never materialises them (NVIDIA GPUs, bf16/fp16); "auto" takes cudnn where it applies.
    attention_impl: Literal["auto", "xla", "cudnn"] = "auto"
    seed: int = 0
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, list[int]]] = None
    pad_token_id: Optional[int] = None

    def replace(self, **changes: Any) -> "LlamaConfig":
        """A copy with ``changes``; fields that were derived from the changed ones are derived again (kept as they
        were, ``replace(hidden_size=...)`` left a stale head_dim, and ``replace(num_attention_heads=...)`` turned
        multi-head attention into grouped-query)."""
        data = self.model_dump()
        if ("head_dim" not in changes and {"hidden_size", "num_attention_heads"} & set(changes)
                and self.head_dim * self.num_attention_heads == self.hidden_size):
            del data["head_dim"]
        if ("num_key_value_heads" not in changes and "num_attention_heads" in changes
                and self.num_key_value_heads == self.num_attention_heads):
            del data["num_key_value_heads"]
        data.update(changes)
        return type(self).model_validate(data)

    @model_validator(mode="before")
    @classmethod
    def _derive(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("model_type") == "qwen2" and data.get("attention_bias") is None:
            data["attention_bias"] = True  # Qwen2's q/k/v biases: a qwen2 model without them cannot be exported
        rs = data.get("rope_scaling")
        if (isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) == "llama3"
                and rs.get("original_max_position_embeddings") is None):
            # transformers' rope standardisation fills the pre-extension length from max_position_embeddings.
            max_pos = data.get("max_position_embeddings", cls.model_fields["max_position_embeddings"].default)
            data["rope_scaling"] = {**rs, "original_max_position_embeddings": max_pos}
        heads = data.get("num_attention_heads", cls.model_fields["num_attention_heads"].default)
        hidden = data.get("hidden_size", cls.model_fields["hidden_size"].default)
        if data.get("num_key_value_heads") is None:
            data["num_key_value_heads"] = heads
        if data.get("head_dim") is None and isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
            if hidden % heads != 0:
                raise ValueError(
                    f"hidden_size={hidden} is not divisible by num_attention_heads={heads}; choose a "
                    f"hidden_size that is a multiple of num_attention_heads (e.g. {heads * max(1, round(hidden / heads))}) "
                    f"or set head_dim explicitly"
                )
            data["head_dim"] = hidden // heads
        return data

    @model_validator(mode="after")
    def _check(self) -> "LlamaConfig":
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} does not divide num_attention_heads="
                f"{self.num_attention_heads}; grouped-query attention needs each KV head shared by the same "
                f"number of query heads, so pick num_key_value_heads from the divisors of num_attention_heads "
                f"({', '.join(str(d) for d in _divisors(self.num_attention_heads))})"
            )
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={self.model_type!r} is not supported; use one of {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings: make hidden_size / "
                             f"num_attention_heads ({self.hidden_size} / {self.num_attention_heads}) even, or set an "
                             "even head_dim")
        if self.rope_scaling:
            rtype = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            settings = [k for k in self.rope_scaling if k not in ("rope_type", "type")]
            if rtype is None:  # read as default rope: {factor: 8.0} trained and exported without scaling
                raise ValueError(
                    f"rope_scaling {self.rope_scaling} names no rope_type, so its {', '.join(settings)} would be "
                    f"ignored; add rope_type: 'llama3' (supported: 'default', 'llama3'), or remove rope_scaling"
                )
            if rtype not in ("default", "llama3"):
                raise ValueError(
                    f"rope_scaling type {rtype!r} is not implemented; supported: 'default', 'llama3'"
                )
            if rtype == "default" and settings:
                raise ValueError(
                    f"rope_scaling {self.rope_scaling} is rope_type 'default', which takes no settings, so "
                    f"{', '.join(settings)} would be ignored; remove them, or use rope_type: 'llama3'"
                )
            if rtype == "llama3":
                missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor")
                           if not _positive_number(self.rope_scaling.get(k))]
                if missing:
                    raise ValueError(
                        f"rope_scaling {self.rope_scaling} is llama3 but lacks numeric {', '.join(missing)} (positive, "
                        f"finite); llama3 rope needs factor, low_freq_factor and high_freq_factor (Llama 3.1 uses 8.0, "
                        f"1.0, 4.0)"
                    )
                if self.rope_scaling["high_freq_factor"] <= self.rope_scaling["low_freq_factor"]:
                    raise ValueError(
                        f"rope_scaling {self.rope_scaling}: high_freq_factor must be above low_freq_factor (the "
                        f"frequencies between them are interpolated; Llama 3.1 uses 1.0 and 4.0)"
                    )
                if self.rope_scaling.get("partial_rotary_factor", 1.0) != 1.0:
                    raise ValueError(
                        f"rope_scaling partial_rotary_factor={self.rope_scaling['partial_rotary_factor']} is not "
                        f"implemented (rotary embeddings cover the whole head); remove it or set it to 1.0"
                    )
        out_of_vocabulary = [f"{name}={value}" for name in ("bos_token_id", "eos_token_id", "pad_token_id")
                             for value in _token_ids(getattr(self, name)) if not 0 <= value < self.vocab_size]
        if out_of_vocabulary:  # an embedding lookup past the table gives NaN; the export wrote them as they were
            raise ValueError(
                f"{', '.join(out_of_vocabulary)} outside the vocabulary (vocab_size={self.vocab_size}: ids 0 to "
                f"{self.vocab_size - 1}); set an id of the tokenizer, or leave it out (the tokenizer's is used)"
            )
        if self.sliding_window is not None and self.model_type == "llama":
            # Exporting would silently drop the window: HF's LlamaForCausalLM attends to the whole sequence.
            raise ValueError(
                f"sliding_window={self.sliding_window} with model_type='llama': HF Llama has no sliding window, so "
                f"the exported model would compute differently; use model_type='mistral' (or 'qwen2'), or "
                f"sliding_window=None"
            )
        if self.model_type == "mistral" and (self.attention_bias or self.attention_out_bias):
            raise ValueError(
                "model_type='mistral' with attention biases: MistralForCausalLM has no attention biases; use "
                "model_type='llama' (biases on q/k/v/o) or 'qwen2' (q/k/v only), or set attention_bias=False"
            )
        return self

    # Derived quantities -------------------------------------------------------------------------
    @property
    def jnp_dtype(self):
        return _to_jnp(self.dtype)

    @property
    def jnp_param_dtype(self):
        return _to_jnp(self.param_dtype)

    @property
    def num_key_value_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    # Hugging Face interop ----------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: Any, **overrides: Any) -> "LlamaConfig":
        """Build from a transformers ``PretrainedConfig`` or a config.json dict; ``overrides`` win.

        A dict is first passed through transformers' own config class, so keys config.json leaves out get that
        class's defaults (a Mistral config without ``sliding_window`` gets 4096) and the rope fields are resolved
        by its rules (``rope_scaling`` over ``rope_parameters``, whose ``rope_theta`` beats the top-level one):
        the model we build is the one ``transformers`` builds from the same file. What it would compute but we
        cannot (per-layer attention mixes, attention dropout, biases Mistral ignores) is refused here.
        """
        d = _transformers_config_dict(hf)
        model_type = d.get("model_type")
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act={act!r} is not supported; only SwiGLU ('silu') MLPs are implemented")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported; only bias-free MLPs are implemented")
        if d.get("attention_dropout"):
            raise ValueError(
                f"attention_dropout={d['attention_dropout']} is not supported (attention dropout is not "
                f"implemented, so training would differ from transformers); set attention_dropout=0.0"
            )

        rope = dict(d.get("rope_parameters") or {})
        if any(isinstance(v, dict) for v in rope.values()):
            raise ValueError(
                f"rope_parameters={rope} gives each layer type its own rope; only one rope for all layers is "
                f"implemented"
            )
        rope_theta = rope.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None
        if rope_type != "default":
            rope_scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")}

        if model_type == "qwen2":
            qkv_bias, out_bias = True, False
            # Qwen2Config has already turned use_sliding_window / max_window_layers into per-layer types, and
            # set sliding_window to None unless use_sliding_window.
            layer_types, window = d.get("layer_types") or [], d.get("sliding_window")
            if set(layer_types) <= {"full_attention"}:
                sliding = None
            elif set(layer_types) == {"sliding_attention"} and window is not None:
                sliding = window
            else:
                raise ValueError(
                    f"Qwen2 layer_types={layer_types} (use_sliding_window={d.get('use_sliding_window')}, "
                    f"max_window_layers={d.get('max_window_layers')}, sliding_window={window}) is not supported: "
                    f"every layer here uses the same attention, so a Qwen2 config must make all layers full "
                    f"(use_sliding_window=False, or max_window_layers >= num_hidden_layers) or all sliding "
                    f"(use_sliding_window=True, max_window_layers=0, a sliding_window set)"
                )
        elif model_type == "mistral":
            if d.get("attention_bias"):
                raise ValueError(
                    "attention_bias=True with model_type='mistral': MistralForCausalLM has no attention biases "
                    "(transformers ignores the flag and drops the bias tensors); use model_type='llama'"
                )
            qkv_bias = out_bias = False
            sliding = d.get("sliding_window")
        else:
            qkv_bias = out_bias = bool(d.get("attention_bias", False))
            sliding = None  # LlamaForCausalLM ignores any sliding_window key

        dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
        try:
            dtype = canonical_dtype(dtype)
        except ValueError:
            dtype = "float32"
        fields = dict(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads"),
            head_dim=d.get("head_dim"),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d["max_position_embeddings"],
            sliding_window=sliding,
            initializer_range=d.get("initializer_range", 0.02),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            attention_out_bias=out_bias,
            dtype=dtype,
            param_dtype=dtype,
            # Hugging Face configs write -1 for "no such token" (early Llama ones as pad_token_id): that is None here,
            # where a negative id is refused as outside the vocabulary.
            bos_token_id=_none_if_negative(d.get("bos_token_id")),
            eos_token_id=_none_if_negative(d.get("eos_token_id")),
            pad_token_id=_none_if_negative(d.get("pad_token_id")),
        )
        fields.update(overrides)
        return cls(**fields)

    def cudnn_attention_problem(self, *, use_gpu: bool, seq_len: Optional[int] = None) -> Optional[str]:
        """Why ``attention_impl='cudnn'`` cannot run for this config, as far as the config alone says (None: it may;
        the backend, GPU generation and mesh are checked again when the model is traced)."""
        if not use_gpu:
            return "the run uses CPUs, and cuDNN's fused attention runs on NVIDIA GPUs only"
        if seq_len is not None and seq_len % 2:
            return f"the sequence length {seq_len} is odd; cuDNN's fused attention with a mask needs an even one"
        if self.dtype not in ("bfloat16", "float16"):
            return f"dtype={self.dtype}; cuDNN's fused attention computes in bfloat16 or float16"
        if self.head_dim % 8 or self.head_dim > 256:
            return f"head_dim={self.head_dim}; cuDNN needs a multiple of 8, at most 256 (128 before Hopper)"
        return None

    def check_cudnn_attention(self, *, use_gpu: bool, seq_len: Optional[int] = None) -> None:
        """On the driver: an explicit ``attention_impl='cudnn'`` that the run cannot give raises, saying why."""
        problem = self.cudnn_attention_problem(use_gpu=use_gpu, seq_len=seq_len)
        if self.attention_impl == "cudnn" and problem:
            raise ValueError(cudnn_refusal(problem))

    def hf_export_problem(self) -> Optional[str]:
        """Why `to_hf_dict` would refuse this config, or None. Runs ask before training: the export comes after
        the last step, so a refused config must fail first, not once the training is done."""
        try:
            self.to_hf_dict()
        except ValueError as exc:
            return str(exc)
        return None

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json contents that transformers loads as the matching ``*ForCausalLM``."""
        mt = self.model_type
        if mt == "qwen2":
            if not self.attention_bias or self.attention_out_bias:
                raise ValueError(
                    "model_type='qwen2' requires attention_bias=True and attention_out_bias=False "
                    "(Qwen2 has q/k/v biases only); use model_type='llama' for other bias layouts"
                )
        elif self.attention_bias != self.attention_out_bias:
            raise ValueError(
                f"model_type={mt!r} has either biases on all of q/k/v/o or none, but attention_bias="
                f"{self.attention_bias} and attention_out_bias={self.attention_out_bias}; use model_type='qwen2' "
                f"for q/k/v-only biases"
            )
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}
        d: dict[str, Any] = {
            "architectures": [SUPPORTED_MODEL_TYPES[mt]],
            "model_type": mt,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": self.param_dtype,
        }
        if mt == "llama":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        elif mt == "mistral":
            d["sliding_window"] = self.sliding_window
        elif mt == "qwen2":
            # Qwen2Config makes layers i >= max_window_layers sliding, so 0 puts the window on every layer,
            # as ours does.
            d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
            d["max_window_layers"] = 0 if self.sliding_window is not None else self.num_hidden_layers
        return d

    def to_hf_config(self):
        """A transformers ``PretrainedConfig`` of the matching class (imports transformers lazily)."""
        from transformers import AutoConfig

        d = self.to_hf_dict()
        d.pop("architectures")
        mt = d.pop("model_type")
        cfg = AutoConfig.for_model(mt, **d)
        cfg.architectures = [SUPPORTED_MODEL_TYPES[mt]]
        return cfg


def _transformers_config_dict(hf: Any) -> dict[str, Any]:
    """``hf`` as the dict transformers' config class for its model_type makes of it (its defaults filled in)."""
    is_hf_config = hasattr(hf, "to_dict")  # a transformers config object has been through its class already
    d = hf.to_dict() if is_hf_config else dict(hf)
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type={model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if is_hf_config:
        return d
    import copy

    from transformers import CONFIG_MAPPING  # local classes only: nothing is downloaded

    hf_cls = CONFIG_MAPPING[model_type]
    try:
        # deepcopy: the class standardises rope_parameters in place.
        return hf_cls.from_dict(copy.deepcopy(d)).to_dict()
    except Exception as e:  # transformers' strict-dataclass errors are not ValueErrors
        raise ValueError(f"transformers' {hf_cls.__name__} refuses this config: {e}") from e


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _none_if_negative(value: Any) -> Any:
    if isinstance(value, list):
        kept = [v for v in value if not (isinstance(v, int) and v < 0)]
        return kept or None
    return None if isinstance(value, int) and not isinstance(value, bool) and value < 0 else value


def _token_ids(value: Union[None, int, list[int]]) -> list[int]:
    return [] if value is None else list(value) if isinstance(value, list) else [value]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# Scaled configs ---------------------------------------------------------------------------------

DEFAULT_SCALING_VARIABLES: dict[str, int] = {
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}

_SCALABLE_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                    "num_hidden_layers", "head_dim", "vocab_size")
_FIXED_FIELDS = ("dtype", "param_dtype", "seed", "max_position_embeddings", "initializer_range")


class MeshSpec(_Base):
    """Named device-mesh axes; one size may be -1, meaning "all remaining devices"."""

    axis_names: tuple[str, ...] = ("dp", "fsdp", "tp")
    axis_dims: tuple[int, ...] = (1, -1, 1)

    @model_validator(mode="after")
    def _check(self) -> "MeshSpec":
        if len(self.axis_names) != len(self.axis_dims):
            raise ValueError(
                f"axis_names {self.axis_names} and axis_dims {self.axis_dims} must have the same length"
            )
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"axis_names {self.axis_names} contain duplicates; each mesh axis needs a unique name")
        if sum(d == -1 for d in self.axis_dims) > 1:
            raise ValueError(f"axis_dims {self.axis_dims} has more than one -1; at most one axis can be inferred")
        bad = [d for d in self.axis_dims if d != -1 and d < 1]
        if bad:
            raise ValueError(f"axis_dims {self.axis_dims} contains {bad}; sizes must be >= 1, or -1 to infer")
        return self

    def resolve(self, num_devices: int) -> tuple[int, ...]:
        """Concrete axis sizes for ``num_devices`` devices, filling in the -1 axis."""
        known = math.prod(d for d in self.axis_dims if d != -1)
        if -1 in self.axis_dims:
            if num_devices % known != 0:
                raise ValueError(
                    f"cannot infer the -1 axis of {dict(zip(self.axis_names, self.axis_dims))}: {num_devices} "
                    f"devices are not divisible by the product of the fixed sizes ({known})"
                )
            return tuple(num_devices // known if d == -1 else d for d in self.axis_dims)
        if known != num_devices:
            raise ValueError(
                f"mesh {dict(zip(self.axis_names, self.axis_dims))} needs {known} devices but {num_devices} "
                f"are available; set one axis size to -1 to infer it"
            )
        return tuple(self.axis_dims)

    def shape(self, num_devices: int) -> dict[str, int]:
        return dict(zip(self.axis_names, self.resolve(num_devices)))


def cudnn_refusal(problem: str) -> str:
    return (f"attention_impl='cudnn' cannot run: {problem}. Use attention_impl='auto' (cuDNN where it can run, XLA "
            "elsewhere) or 'xla'.")


class ModelScaling(_Base):
    """A family of model sizes indexed by ``scaling_index`` (EasyDeL's RayDistributedTrainer convention).

    ``scaling_variables`` are multiplied by the index (so head_dim stays fixed as width grows);
    ``dtype``/``param_dtype``/``seed``/``max_position_embeddings``/``initializer_range`` and ``mesh`` are
    the same at every scale; ``base`` holds any other (unscaled) ``LlamaConfig`` fields such as
    vocab_size or num_hidden_layers.
    """

    model_type: str = "llama"
    base: dict[str, Any] = Field(default_factory=dict)
    scaling_variables: dict[str, int] = Field(default_factory=lambda: dict(DEFAULT_SCALING_VARIABLES))
    dtype: DType = "bfloat16"
    # float32 master weights: optimizer updates are far smaller than bf16 resolution at typical LRs.
    param_dtype: ParamDType = "float32"
    seed: int = 0
    max_position_embeddings: int = Field(8192, gt=0)
    initializer_range: float = Field(0.02, ge=0)
    mesh: MeshSpec = Field(default_factory=MeshSpec)

    @model_validator(mode="before")
    @classmethod
    def _accept_easydel_names(cls, data: Any) -> Any:
        # EasyDeL spells these config_scaling_variables / sharding_axis_*; accept both spellings.
        if isinstance(data, dict):
            data = dict(data)
            if "config_scaling_variables" in data:
                data["scaling_variables"] = data.pop("config_scaling_variables")
            if "config_variables" in data:
                # EasyDeL mixes fixed fields and other model fields in one dict; split them.
                base = dict(data.get("base") or {})
                for k, v in dict(data.pop("config_variables")).items():
                    if k in _FIXED_FIELDS or k in ("sharding_axis_names", "sharding_axis_dims"):
                        data.setdefault(k, v)
                    else:
                        base[k] = v
                data["base"] = base
            names, dims = data.pop("sharding_axis_names", None), data.pop("sharding_axis_dims", None)
            if names is not None or dims is not None:
                mesh = dict(data.get("mesh") or {})
                if names is not None:
                    mesh["axis_names"] = tuple(names)
                if dims is not None:
                    mesh["axis_dims"] = tuple(dims)
                data["mesh"] = mesh
        return data

    @model_validator(mode="after")
    def _check(self) -> "ModelScaling":
        for k, v in self.scaling_variables.items():
            if k not in _SCALABLE_FIELDS:
                raise ValueError(
                    f"scaling variable {k!r} cannot be scaled; scalable fields are {', '.join(_SCALABLE_FIELDS)}"
                )
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"scaling variable {k}={v!r} must be a positive integer")
        for k in self.base:
            if k not in LlamaConfig.model_fields:
                raise ValueError(f"base field {k!r} is not a LlamaConfig field")
            if k in self.scaling_variables or k in _FIXED_FIELDS or k == "model_type":
                raise ValueError(
                    f"base field {k!r} is also set as a scaling or fixed variable; set it in one place only"
                )
        if "num_key_value_heads" in self.scaling_variables and "num_attention_heads" not in self.scaling_variables:
            # kv heads growing past fixed query heads: grouped-query at index 1, multi-head at some larger index,
            # then refused; the architecture would depend on the size.
            raise ValueError("num_key_value_heads is a scaling variable but num_attention_heads is not; scale both "
                             "(the grouping stays the same at every size) or put num_key_value_heads in base")
        self.create_config(1)  # surfaces inconsistent head counts now, not at train time
        return self

    def create_config(self, scaling_index: int = 1) -> LlamaConfig:
        """The ``LlamaConfig`` at ``scaling_index`` (1 = the base sizes, 2 = twice as wide, ...)."""
        if isinstance(scaling_index, bool) or not isinstance(scaling_index, int) or scaling_index < 1:
            raise ValueError(
                f"scaling_index={scaling_index!r} is invalid; it must be an integer >= 1 "
                f"(1 gives the base sizes, k multiplies every scaling variable by k)"
            )
        fields = dict(self.base)
        fields.update({k: v * scaling_index for k, v in self.scaling_variables.items()})
        fields.update(
            model_type=self.model_type,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            seed=self.seed,
            max_position_embeddings=self.max_position_embeddings,
            initializer_range=self.initializer_range,
        )
        if "head_dim" not in fields:
            fields["head_dim"] = None
        return LlamaConfig(**fields)

    def create_model(self, config: Optional[LlamaConfig] = None, *, scaling_index: int = 1, lazy: bool = False,
                     rngs=None):
        """Instantiate the model for ``config`` (or ``create_config(scaling_index)``).

        ``lazy=True`` returns an abstract model (shapes/dtypes only, nothing allocated), e.g. to derive
        shardings before materialising weights.
        """
        from ray_jax_train.models.llama import create_model

        if config is None:
            config = self.create_config(scaling_index)
        return create_model(config, lazy=lazy, rngs=rngs)
