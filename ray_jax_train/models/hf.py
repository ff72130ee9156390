"""Load and save Hugging Face Llama/Mistral/Qwen2 checkpoints (local directories only).

Weights are read tensor by tensor with ``safetensors.numpy`` into an abstract model, so peak host memory
is roughly one copy of the weights and no PyTorch is needed. Linear weights are transposed between HF's
``[out, in]`` and our ``[in, out]`` kernels; everything else is a rename.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ray_jax_train.config import SUPPORTED_MODEL_TYPES, LlamaConfig, canonical_dtype
from ray_jax_train.models.llama import LlamaForCausalLM, create_model

__all__ = ["from_pretrained", "generation_eos_ids", "hf_name", "load_hf_config", "save_pretrained"]

_ARCH_TO_TYPE = {arch: mt for mt, arch in SUPPORTED_MODEL_TYPES.items()}
# Checkpoint entries that carry no learnt state (old Llama exports saved the rotary buffer).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_INDEX = "model.safetensors.index.json"
_EMBED, _LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"

PathLike = Union[str, os.PathLike]


def hf_name(path: tuple) -> tuple[str, bool]:
    """Map one of our parameter paths to its HF tensor name; also say whether it needs a transpose."""
    parts = [str(p) for p in path]
    leaf = parts[-1]
    transpose = leaf == "kernel"
    if leaf in ("kernel", "embedding"):
        parts[-1] = "weight"
    name = ".".join(parts)
    if parts[0] != "lm_head":
        name = "model." + name
    return name, transpose


def _not_a_model_dir(path: Path, why: str) -> ValueError:
    return ValueError(
        f"{path} is not a Hugging Face model directory ({why}); from_pretrained needs a local directory "
        f"with config.json and model*.safetensors (hub ids are not downloaded). Supported model types: "
        f"{', '.join(SUPPORTED_MODEL_TYPES)}"
    )


def load_hf_config(path: PathLike, **overrides: Any) -> LlamaConfig:
    """Read ``path/config.json`` into a ``LlamaConfig`` (dispatching on model_type / architectures)."""
    path = Path(path)
    if not path.is_dir():
        raise _not_a_model_dir(path, "no such directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise _not_a_model_dir(path, "config.json is missing")
    with open(cfg_file) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as exc:  # bare, it named neither the file nor what to do
            raise ValueError(f"{cfg_file} is not valid JSON ({exc}): the file is damaged or cut short; put back the "
                             "model's config.json") from None
    model_type = d.get("model_type")
    if model_type is None:
        for arch in d.get("architectures") or []:
            if arch in _ARCH_TO_TYPE:
                model_type = d["model_type"] = _ARCH_TO_TYPE[arch]
                break
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{cfg_file}: model_type={model_type!r} (architectures={d.get('architectures')}) is not supported; "
            f"supported model types: {', '.join(f'{k} ({v})' for k, v in SUPPORTED_MODEL_TYPES.items())}"
        )
    try:
        return LlamaConfig.from_hf(d, **overrides)
    except ValueError as e:
        raise ValueError(f"{cfg_file}: {e}") from e


def generation_eos_ids(path: PathLike) -> list[int]:
    """The eos ids of ``path/generation_config.json`` ([] without one). An instruct model may end its turns with a
    token that only this file names (Llama 3's ``<|eot_id|>``); transformers' ``generate`` stops at it too."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return []
    try:
        with open(file) as f:
            value = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{file} is not a JSON object ({exc}); fix or remove it") from None
    ids = [value] if isinstance(value, int) else list(value or [])
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{file}: eos_token_id {value!r} is not a token id or a list of them")
    return ids


def _weight_files(path: Path) -> list[Path]:
    index = path / _INDEX
    if index.is_file():
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted({path / name for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index} is damaged: not a JSON object with a 'weight_map' of tensor name to shard "
                             f"file ({type(exc).__name__}: {exc}). Copy the directory again from its source.") from None
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shard files that do not exist: {missing}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    hint = " (found PyTorch .bin weights; convert them to safetensors first)" if list(path.glob("*.bin")) else ""
    raise _not_a_model_dir(path, f"no *.safetensors weights{hint}")


def _open_weights(file: Path):
    """A safetensors file's handle; a damaged one (cut short in a copy, empty) named, not a bare SafetensorError."""
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="np")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError, OSError, ...
        raise ValueError(f"{file} is not a readable safetensors file ({type(exc).__name__}: {exc}): damaged or cut "
                         "short? Copy the directory again from its source.") from None


def from_pretrained(path: PathLike, dtype: Any = None, param_dtype: Any = None, *,
                    sharding: Optional[Callable[[tuple, tuple], Optional[jax.sharding.Sharding]]] = None,
                    **config_overrides: Any) -> LlamaForCausalLM:
    """Load a local HF ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` directory.

    ``param_dtype`` defaults to the checkpoint's dtype and ``dtype`` (compute) to ``param_dtype``.
    ``config_overrides`` set other ``LlamaConfig`` fields (e.g. ``remat=True``). ``sharding(path, shape)``
    may return a ``jax.sharding.Sharding`` per parameter; each process then materialises only its own
    shards, which is what makes multi-host loading of large models possible. As in transformers, a
    ``tie_word_embeddings=True`` checkpoint whose ``lm_head.weight`` differs from the embedding loads untied.
    """
    path = Path(path)
    overrides = dict(config_overrides)
    if param_dtype is not None:
        overrides["param_dtype"] = canonical_dtype(param_dtype, "param_dtype")
    if dtype is not None:
        overrides["dtype"] = canonical_dtype(dtype, "dtype")
    config = load_hf_config(path, **overrides)
    if dtype is None and param_dtype is not None:
        config = config.replace(dtype=config.param_dtype)
    files = _weight_files(path)
    handles = [_open_weights(f) for f in files]
    where: dict[str, Any] = {}
    for h in handles:
        for k in h.keys():
            where[k] = h

    if config.tie_word_embeddings and _EMBED in where and _LM_HEAD in where \
            and not _same_tensor(where[_EMBED], where[_LM_HEAD], _EMBED, _LM_HEAD):
        # transformers (PreTrainedModel.tie_weights) does not tie when the checkpoint holds both tensors with
        # different values: it keeps lm_head. Do the same, or the logits would silently differ.
        config = config.replace(tie_word_embeddings=False)

    abstract = create_model(config, lazy=True)
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    used: set[str] = set()
    missing: list[str] = []
    for p, var in flat:
        name, transpose = hf_name(p)
        if name not in where:
            missing.append(name)
            continue
        arr = where[name].get_tensor(name)
        if transpose:
            arr = arr.T
        want = tuple(var.shape)
        if arr.shape != want:
            raise ValueError(
                f"{path}: tensor {name} has shape {arr.shape} (after transpose: {transpose}) but the model "
                f"built from config.json expects {want}; config.json and the weights disagree"
            )
        target = var.dtype
        sh = sharding(p, want) if sharding is not None else None
        if sh is None:
            value = jnp.asarray(arr, dtype=target)
        else:
            host = arr
            value = jax.make_array_from_callback(want, sh, lambda idx, host=host: np.asarray(host[idx], dtype=target))
        var.set_value(value)
        used.add(name)
    if missing:
        raise ValueError(f"{path}: checkpoint is missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    unexpected = [k for k in where if k not in used and not _IGNORED.match(k)
                  and not (config.tie_word_embeddings and k == "lm_head.weight")]
    if unexpected:
        raise ValueError(
            f"{path}: checkpoint has tensors this architecture does not use: {sorted(unexpected)[:8]}; "
            f"the config.json probably describes a different architecture"
        )
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _same_tensor(h1: Any, h2: Any, name1: str, name2: str, rows: int = 4096) -> bool:
    """Whether two checkpoint tensors are exactly equal, compared in row blocks (not two full copies)."""
    s1, s2 = h1.get_slice(name1), h2.get_slice(name2)
    shape = s1.get_shape()
    if shape != s2.get_shape():
        return False
    for i in range(0, shape[0], rows):
        j = min(i + rows, shape[0])  # safetensors refuses slices past the end
        if not np.array_equal(s1[i:j], s2[i:j]):
            return False
    return True


def _parse_size(size: Union[int, str]) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", size, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size={size!r} is not a size; use bytes (int) or e.g. '500MB', '5GB'")
    unit = (m.group(2) or "B").upper()
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(m.group(1)) * mult)


def _to_host(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def _save_readable(save_file, tensors, file: Path, metadata) -> None:
    """safetensors writes through a private temporary file (mode 0600); give the weights the mode every other file
    of the directory gets, or a serving job under another user on shared storage cannot read them."""
    save_file(tensors, str(file), metadata=metadata)
    try:  # config.json, written just before by open(), has the mode the umask gives
        os.chmod(file, os.stat(file.parent / "config.json").st_mode & 0o777)
    except OSError:  # a filesystem without modes (some FUSE mounts): the weights are written all the same
        pass


def save_pretrained(model: LlamaForCausalLM, path: PathLike, *, dtype: Any = None,
                    max_shard_size: Union[int, str, None] = None) -> Path:
    """Write ``config.json`` + safetensors with HF names so ``transformers`` can load the directory.

    ``dtype`` casts the saved weights (default: the parameter dtype). ``max_shard_size`` splits weights into
    ``model-0000i-of-0000n.safetensors`` plus an index, as HF does for large models. With multi-host
    sharded parameters every process must call this (the gather is collective); only process 0 writes.
    """
    from safetensors.numpy import save_file

    config: LlamaConfig = model.config
    out_dtype = canonical_dtype(dtype) if dtype is not None else config.param_dtype
    np_dtype = jnp.dtype(out_dtype)
    hf_cfg = config.to_hf_dict()
    hf_cfg["dtype"] = out_dtype

    tensors: dict[str, np.ndarray] = {}
    for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, transpose = hf_name(p)
        arr = _to_host(var.get_value())
        if transpose:
            arr = arr.T
        tensors[name] = np.ascontiguousarray(arr.astype(np_dtype))

    path = Path(path)
    if jax.process_index() != 0:
        return path
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "config.json", "w") as f:
        json.dump(hf_cfg, f, indent=2)
    # Stale shards from an earlier save with a different layout would be picked up by loaders.
    # Only the names a save writes: a user's model_ema.safetensors beside them is not ours to delete.
    shards = [p for p in path.glob("model*.safetensors")
              if p.name == "model.safetensors" or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", p.name)]
    for old in shards + [path / _INDEX]:
        if old.exists():
            old.unlink()

    meta = {"format": "pt"}  # transformers refuses safetensors files without a known format tag
    if max_shard_size is None:
        _save_readable(save_file, tensors, path / "model.safetensors", meta)
        return path
    limit = _parse_size(max_shard_size)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        _save_readable(save_file, shard, path / fname, meta)
        weight_map.update({k: fname for k in shard})
    with open(path / _INDEX, "w") as f:
        json.dump({"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
                   "weight_map": weight_map}, f, indent=2)
    return path
