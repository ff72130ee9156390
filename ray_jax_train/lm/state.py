"""Where the weights come from, and how the train state is placed on the mesh.

Starting points, in the order `RayDistributedTrainer.train` picks them (see `init_spec`):

1. a given state (`{"params", optional "opt_state", "step"}`), shipped once through the object store;
2. a given model, whose parameters become that state;
3. a checkpoint path: a ray_jax_train checkpoint directory, or a local Hugging Face model directory;
4. a new model from the config, initialised inside `jit` straight into its shardings (no host copy).
"""
from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any, Dict, Optional

import jax
import numpy as np
from flax import nnx

from ray_jax_train.config import LlamaConfig
from ray_jax_train.lm.step import keep_hyperparameters
from ray_jax_train.models import create_model
from ray_jax_train.models.llama import init_parts

logger = logging.getLogger(__name__)

SOURCES = ("state", "model", "checkpoint", "hf", "scratch")


# -- sharding ---------------------------------------------------------------------------------------------


def state_shardings(state, mesh):
    """A pytree of NamedShardings matching `state` (arrays or ShapeDtypeStructs), from the Llama partition rules.

    The rules match the trailing parameter names, so optimizer moments are split exactly like their params
    (FSDP over `fsdp`, tensor parallelism over `tp`; axes the mesh lacks are simply not used).
    """
    from ray_jax_train.sharding import llama_partition_rules, shardings_for

    return shardings_for(state, mesh, llama_partition_rules())


def shard_state(state, mesh):
    """Place `state` (numpy, local or global jax arrays) on `mesh` with `state_shardings`.

    Host values become global arrays through `make_array_from_callback`: each process fills only the shards
    its devices hold and nothing is communicated, which works the same for one process or many (every
    process must hold the same values, as it does for a state shipped from the driver).
    """
    shardings = state_shardings(state, mesh)

    def place(x, sharding):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x if x.sharding == sharding else jax.jit(lambda y: y, out_shardings=sharding)(x)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(place, state, shardings)


def new_model_state(config: LlamaConfig, new_state_fn):
    """`() -> state` of a new model from `config`, params and optimizer state in one function: what `eval_shape`
    describes (`abstract_state`). The library builds the values part by part instead (`init_params`)."""
    return lambda: new_state_fn(split_model(create_model(config))[1], 0)


def abstract_state(config: LlamaConfig, mesh, new_state_fn):
    """ShapeDtypeStructs, with their shardings on `mesh`, of the train state a new model starts from."""
    from ray_jax_train.checkpoint import abstract_state as with_shardings

    tree = jax.eval_shape(new_model_state(config, new_state_fn))
    return with_shardings(tree, state_shardings(tree, mesh))


def fresh_hyperparameters(abstract, new_state_fn):
    """A new state's optimizer hyperparameters (an `inject_hyperparams` state's `hyperparams`), or None.

    What a resume keeps from this run's config, without building the params it would throw away (a Hugging
    Face model read from disk, for one): the program makes zero params, but only the scalars leave it, so XLA
    drops the rest. Placed as `abstract` (from `abstract_state`) places them.
    """
    import jax.numpy as jnp

    hyperparams = getattr(abstract["opt_state"], "hyperparams", None)
    if hyperparams is None:
        return None

    def make():
        params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract["params"])
        return new_state_fn(params, 0)["opt_state"].hyperparams

    return jax.jit(make, out_shardings=jax.tree.map(lambda a: a.sharding, hyperparams))()


def init_params(config: LlamaConfig, mesh):
    """A new model's parameters, born in their shardings (no host copy): ``create_model(config)``'s, to within one
    float32 rounding of each random weight (the separate programs round the init's scaling differently).

    One program per kind of part (``init_parts``), not one for the whole model: threefry's CPU lowering gives
    every random weight its own loop, so a whole-model program compiles for about 0.5-0.8 s more per layer on
    2 CPU cores, while here all decoder layers reuse one program. The rng stream's count is threaded from part
    to part (a replicated scalar, so every input is a global array under multi-process meshes too).
    """
    shardings = state_shardings(abstract_params(config)[1], mesh)
    count_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    programs, params, count = {}, {}, None
    for path, make in init_parts(config):
        out = _at(shardings, path)
        key = (make, count is None, jax.tree_util.tree_structure(out), tuple(jax.tree.leaves(out)))
        if key not in programs:
            programs[key] = jax.jit(partial(_init_part, config.seed, make), out_shardings=(out, count_sharding))
        part, count = programs[key]() if count is None else programs[key](count)
        _at(params, path[:-1], create=True)[path[-1]] = part
    return params


def _init_part(seed: int, make, count=None):
    rngs = nnx.Rngs(seed)
    if count is not None:
        rngs.default.count[...] = count
    module = make(rngs)
    return nnx.to_pure_dict(nnx.state(module, nnx.Param)), rngs.default.count[...]


def _at(tree, path, create: bool = False):
    for key in path:
        if create:
            tree = tree.setdefault(key, {})
        else:
            tree = tree[key]
    return tree


# -- parameters -------------------------------------------------------------------------------------------


def split_model(model):
    """(graphdef, params as a pure dict). The model holds no state besides Params (no dropout, no caches)."""
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, nnx.to_pure_dict(params)


def abstract_params(config: LlamaConfig):
    """(graphdef, ShapeDtypeStruct pure dict) of a model with `config`, allocating nothing."""
    return split_model(create_model(config, lazy=True))


def params_to_numpy(model_or_params) -> Dict[str, Any]:
    """An nnx model, nnx.State or pure dict -> a pure dict of numpy arrays (what travels to the workers)."""
    if isinstance(model_or_params, nnx.Module):
        model_or_params = nnx.state(model_or_params, nnx.Param)
    if isinstance(model_or_params, nnx.State):
        model_or_params = nnx.to_pure_dict(model_or_params)
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), model_or_params)


def check_params_match(params, expected, what: str,
                       fix: str = "Pass the scaling_index (or config) the state was made with.") -> None:
    """Raise a readable error when `params` do not have the model's structure and shapes."""
    got = {jax.tree_util.keystr(p): np.shape(x) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    want = {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(expected)}
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    wrong = sorted(k for k in set(want) & set(got) if tuple(got[k]) != want[k])
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        if extra:
            parts.append(f"unexpected {extra[:4]}{' ...' if len(extra) > 4 else ''}")
        if wrong:
            parts.append("shape " + ", ".join(f"{k}: {tuple(got[k])} != {want[k]}" for k in wrong[:4]))
        raise ValueError(f"The {what} does not fit the model config: {'; '.join(parts)}. {fix}")


def cast_params(params, config: LlamaConfig):
    """Cast float parameters to the config's param_dtype (e.g. bf16 weights into float32 master weights)."""
    dtype = config.jnp_param_dtype

    def cast(x):
        x = np.asarray(x)
        return x.astype(dtype) if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x

    return jax.tree.map(cast, params)


def is_hf_model_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        name.endswith(".safetensors") for name in os.listdir(path))


# Fields that change what the weights compute without changing their shapes: a mismatch loads fine and is wrong.
FUNCTION_FIELDS = ("rope_theta", "rope_scaling", "rms_norm_eps", "sliding_window")
# How the projections split into heads: 4 heads of 64 and 2 of 128 hold the same arrays, so only these tell them
# apart. Never a choice: weights read with another split compute other attention.
HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim")


def check_hf_dir_fits(path: str, config: LlamaConfig, fix: str, **kwargs) -> None:
    """On the driver: the HF directory's config.json against the model to be built (see `check_weights_fit`)."""
    from ray_jax_train.models import load_hf_config

    check_weights_fit(load_hf_config(path), f"Hugging Face model in {path}", config, fix, **kwargs)


def check_checkpoint_fits(path: str, config: LlamaConfig, fix: str, *, vocabulary_known: bool = True,
                          **kwargs) -> None:
    """On the driver: the model config a checkpoint of this package records against the model to be built. One
    that records none (an older or foreign checkpoint) is left to the restore, which compares the arrays. Before
    the tokenizer is loaded (`vocabulary_known=False`) the vocabulary is left out: a placeholder size refused every
    checkpoint trained with a real tokenizer (a review)."""
    from ray_jax_train.lm.export import _checkpoint_hf_config

    saved = _checkpoint_hf_config(path)
    if isinstance(saved, dict):
        theirs = LlamaConfig.from_hf(saved)
        if not vocabulary_known:
            config = config.replace(vocab_size=theirs.vocab_size)
        check_weights_fit(theirs, f"checkpoint {path}", config, fix, **kwargs)


def function_differences(before: LlamaConfig, now: LlamaConfig) -> list:
    """[(field, before's value, now's value)] of the FUNCTION_FIELDS in which two model configs differ."""
    import math

    def same(a, b) -> bool:
        if isinstance(a, float) and isinstance(b, float):
            return math.isclose(a, b, rel_tol=1e-9)
        return a == b

    return [(k, getattr(before, k), getattr(now, k)) for k in FUNCTION_FIELDS
            if not same(getattr(before, k), getattr(now, k))]


def check_weights_fit(theirs: LlamaConfig, where: str, config: LlamaConfig, fix: str, *, chosen=(),
                      chosen_how: str = "", warn: bool = True) -> None:
    """Starting weights made for `theirs` against the model to be built. Shapes: in the worker the same mismatch
    came after Ray's start, tokenising and the train step's compile (of a model that may be huge). Rope and norm
    settings: a model built with other ones loaded the weights without a word and computed other logits (a review:
    1.6e-2 off Hugging Face's where 3e-7 is the norm). Those among `chosen` (set on purpose, e.g. a larger
    rope_theta for a longer context) are only said (`warn`); others are refused, `chosen_how` naming how to set
    them."""
    check_params_match(abstract_params(theirs)[1], abstract_params(config)[1], where, fix)
    heads = [(k, getattr(theirs, k), getattr(config, k)) for k in HEAD_FIELDS
             if getattr(theirs, k) != getattr(config, k)]
    if heads:
        raise ValueError(
            f"The {where} splits attention into other heads than the model to be built: "
            + ", ".join(f"{k}={ours!r} (the weights': {t!r})" for k, t, ours in heads)
            + ". The arrays have the same shapes, so they would load and compute other logits, silently. "
            + fix)

    def listed(items) -> str:
        return ", ".join(f"{k}={ours!r} (the weights': {t!r})" for k, t, ours in items)

    differ = function_differences(theirs, config)
    chosen_here = [d for d in differ if d[0] in set(chosen)]
    if chosen_here and warn:
        logger.warning("Training the weights of the %s with %s, as set: they were trained with other values.",
                       where, listed(chosen_here))
    refused = [d for d in differ if d[0] not in set(chosen)]
    if refused:
        wanted = ", ".join(f"{k!r}: {t!r}" for k, t, _ in refused)
        raise ValueError(
            f"The {where} was trained with other rope or norm settings than the model to be built: "
            f"{listed(refused)}. Its weights would load and compute other logits, silently. Build the model with "
            f"the weights' values ({chosen_how.format(wanted=wanted) if chosen_how else wanted}), or set them "
            "explicitly to train with others on purpose.")


def load_hf_params(path: str, config: LlamaConfig) -> Dict[str, Any]:
    """Weights of a local HF directory as a numpy pure dict, checked against `config`."""
    from ray_jax_train.models import from_pretrained

    model = from_pretrained(path, dtype=config.dtype, param_dtype=config.param_dtype)
    params = params_to_numpy(model)
    check_params_match(params, abstract_params(config)[1], f"Hugging Face model in {path}")
    return params


def initial_state(init: Dict[str, Any], config: LlamaConfig, mesh, *, new_state_fn):
    """The sharded train state for the starting point `init` (see the module docstring).

    `new_state_fn(params, step) -> state` builds the optimizer state; it runs under jit so every leaf of
    the state (optimizer moments, counters) is born on the mesh.
    """
    import ray

    source = init.get("source", "scratch")
    if source not in SOURCES:
        raise ValueError(f"Unknown init source {source!r}; use one of {SOURCES}.")
    _, expected = abstract_params(config)
    step, opt_state = 0, None
    if source == "scratch":
        params = init_params(config, mesh)
    elif source in ("state", "model"):
        given = ray.get(init["ref"]) if isinstance(init["ref"], ray.ObjectRef) else init["ref"]
        params = cast_params(given["params"], config)
        check_params_match(params, expected, f"given {source}")
        step, opt_state = int(given.get("step") or 0), given.get("opt_state")
        params = shard_state(params, mesh)
    elif source == "hf":
        _check_visible_here(init["path"])
        params = shard_state(load_hf_params(init["path"], config), mesh)
    else:
        _check_visible_here(init["path"])
        params = restore_params(init["path"], config, mesh)
    if source != "scratch" and jax.process_index() == 0:  # else nothing said the starting weights were used
        where = {"hf": "the Hugging Face model in", "checkpoint": "the checkpoint"}.get(source)
        logger.info("Initial weights: %s.", f"{where} {init['path']}" if where else f"the given {source}")

    shardings = state_shardings(jax.eval_shape(lambda p: new_state_fn(p, 0), params), mesh)
    # Params made here are donated: the state's params alias them instead of holding a second copy at start-up.
    # A given state's arrays may still be the caller's, so those are not.
    donate = () if source in ("state", "model") else (0,)
    state = jax.jit(lambda p: new_state_fn(p, step), out_shardings=shardings, donate_argnums=donate)(params)
    if opt_state is not None:
        given_def = jax.tree_util.tree_structure(opt_state)
        if given_def != jax.tree_util.tree_structure(state["opt_state"]):
            raise ValueError("The given state's opt_state does not match this optimizer's state structure (different "
                             "optimizer settings?). Pass only {'params': ...} to start a fresh optimizer.")
        state["opt_state"] = keep_hyperparameters(shard_state(opt_state, mesh), state["opt_state"])
    return state


def _check_opt_state_counts_the_step(opt_state, step: int) -> None:
    """optax's `count`s (Adam's, the schedule's) are the steps the optimizer has taken: a state given with its
    opt_state but no step (or another one) trained on at learning rates `count` steps into the schedule, warmup
    skipped, while the run counted, and logged the rate, from `step` (a loop review)."""
    counts = {int(x) for path, x in jax.tree_util.tree_leaves_with_path(opt_state)
              if jax.tree_util.keystr(path).endswith(".count") and np.ndim(x) == 0}
    if counts and counts != {step}:
        raise ValueError(
            f"The given state's opt_state has taken {max(counts)} steps (its optax count), but its step is {step}: "
            "the learning-rate schedule would run that far ahead of the run's steps. Pass the state's own step with "
            f"it (state={{'params': ..., 'opt_state': ..., 'step': {max(counts)}}}), or leave out opt_state to start "
            "a fresh optimizer from these params.")


def restore_params(path: str, config: LlamaConfig, mesh=None):
    """Parameters from a ray_jax_train checkpoint directory: only the params are read, so the checkpoint may come
    from a run with other optimizer settings (or an older optimizer state layout), and no optimizer is built.

    Placed on `mesh` by the partition rules; without one, on one device of this process, in host memory where
    there is a CPU backend (an export gathers every weight to the host anyway, and an accelerator may not hold the
    whole model)."""
    from ray_jax_train.checkpoint import abstract_state, restore

    _, expected = abstract_params(config)
    if mesh is not None:
        shardings = state_shardings(expected, mesh)
    else:
        try:
            device = jax.local_devices(backend="cpu")[0]
        except RuntimeError:
            device = jax.local_devices()[0]
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), expected)
    restored = restore({"params": abstract_state(expected, shardings)}, checkpoint=path, fallback=False,
                       partial=True)
    if restored is None:
        raise FileNotFoundError(f"No checkpoint found at {path}.")
    logger.info("Restored the params of step %d from %s.", restored.step, path)
    return restored.state["params"]


def init_spec(*, state=None, model=None, checkpoint_path: Optional[str] = None) -> Dict[str, Any]:
    """Driver side: pick the starting point (state > model > checkpoint path > scratch) and ship it.

    Arrays go to the object store once, as numpy, so N workers fetch them instead of each unpickling a copy
    from the train-loop config.
    """
    import ray

    if state is not None:
        if hasattr(state, "state") and hasattr(state, "step") and not isinstance(state, dict):
            state = {"params": state.state["params"], "opt_state": state.state.get("opt_state"), "step": state.step}
        if isinstance(state, (nnx.State, nnx.Module)) or (isinstance(state, dict) and "params" not in state):
            state = {"params": state}
        payload = {"params": params_to_numpy(state["params"]), "step": int(np.asarray(state.get("step") or 0))}
        if payload["step"] and state.get("opt_state") is None:
            raise ValueError(
                f"The given state has step={payload['step']} but no opt_state: the optimizer and its learning-rate "
                f"schedule would start over while the steps count on from {payload['step']}. Pass the state's "
                "opt_state to continue it, or leave out step to start a fresh optimizer from these params.")
        if state.get("opt_state") is not None:
            payload["opt_state"] = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), state["opt_state"])
            _check_opt_state_counts_the_step(payload["opt_state"], payload["step"])
        return {"source": "state", "ref": ray.put(payload)}
    if model is not None:
        if not isinstance(model, nnx.Module):
            raise TypeError(f"model must be a Flax NNX model (e.g. LlamaForCausalLM), got {type(model).__name__}.")
        return {"source": "model", "ref": ray.put({"params": params_to_numpy(model)})}
    if checkpoint_path is not None:
        path = os.fspath(checkpoint_path)
        if "://" not in path:
            path = os.path.abspath(path)
        return {"source": weights_dir_kind(path), "path": path}
    return {"source": "scratch"}


def _check_visible_here(path: str) -> None:
    """The driver checked the starting weights exist; a worker on another node may still not see them."""
    if "://" in path or os.path.exists(path):
        return
    import socket

    import jax

    raise FileNotFoundError(
        f"{path}: the starting weights are not on this worker's node ({socket.gethostname()}, process "
        f"{jax.process_index()}), though the driver found them. On a multi-node cluster put them where every node "
        "reads them: a shared mount, or a gs:// / s3:// URI for an orbax checkpoint.")


def weights_dir_kind(path: str) -> str:
    """"hf" or "checkpoint" for a directory to start from; otherwise FileNotFoundError saying what to give.

    Checked on the driver, so a run directory given instead of one of its checkpoints fails before workers start
    and names the checkpoint that was probably meant. A URI (gs://, s3://) is looked up the same way: a typo in
    it would otherwise surface as a TensorStore error on every worker, after the cluster started.
    """
    import pyarrow.fs as pafs

    from ray_jax_train.storage import filesystem, is_uri, join

    fs, fs_path = filesystem(path)
    kind = fs.get_file_info(fs_path).type
    if kind != pafs.FileType.Directory:
        what = "is a file, not a directory" if kind == pafs.FileType.File else "does not exist"
        raise FileNotFoundError(f"{path} {what}: give a Hugging Face model directory or a checkpoint directory "
                                "(<run>/checkpoint_...) to start from.")
    names = {os.path.basename(info.path.rstrip("/")): info.type
             for info in fs.get_file_info(pafs.FileSelector(fs_path))}
    if "config.json" in names and any(name.endswith(".safetensors") for name in names):
        if is_uri(path):
            raise FileNotFoundError(f"{path} is a Hugging Face model directory in remote storage, which is read "
                                    "from local disk only: copy it to a path every node reads, or start from a "
                                    "ray_jax_train checkpoint (<run>/checkpoint_...), which is read from a URI.")
        return "hf"
    if "_CHECKPOINT_METADATA" in names:
        return "checkpoint"
    inside = sorted(name for name, kind in names.items() if name.startswith("checkpoint_")
                    and kind == pafs.FileType.Directory
                    and fs.get_file_info(join(fs_path, name, "_CHECKPOINT_METADATA")).type == pafs.FileType.File)
    hint = f" It holds checkpoints; the latest is {join(path, inside[-1])}." if inside else ""
    raise FileNotFoundError(
        f"{path} is neither a Hugging Face model directory (config.json and *.safetensors) nor a ray_jax_train "
        f"checkpoint (no _CHECKPOINT_METADATA).{hint}")
