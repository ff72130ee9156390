"""Model parallelism: regex partition rules for parameters and optimizer state, activation constraints, and
hybrid (ICI x DCN) meshes for multi-slice TPU.

Rules are ordered `(regex, PartitionSpec)` pairs searched against a leaf's path written with slashes
(`layers/0/self_attn/q_proj/kernel`). Optimizer state mirrors the parameter paths under a prefix
(`opt_state/inner_state/1/0/mu/layers/0/...`), so rules that anchor on the trailing parameter path (`...kernel$`) shard the
Adam moments exactly like the weights they belong to, with no extra rules.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ray_jax_train.errors import UsageTypeError, UsageValueError
from ray_jax_train.mesh import BATCH_AXES, make_mesh, resolve_axes, validate_axes

__all__ = [
    "ACTIVATION_AXES",
    "LLAMA_AXES",
    "PartitionRules",
    "ProcessCopiesDifferError",
    "bytes_per_device",
    "check_llama_parallelism",
    "constrain",
    "hybrid_device_grid",
    "llama_partition_rules",
    "make_hybrid_mesh",
    "partition_specs",
    "path_str",
    "shard_by_rules",
    "shardings_for",
    "spec_for",
]

# The axes the built-in rules know. A mesh may leave any of them out; that axis then has size 1.
LLAMA_AXES = ("dp", "fsdp", "tp", "sp")

# Logical activation dimension -> mesh axes that split it (those the mesh lacks are skipped).
ACTIVATION_AXES: Dict[str, Tuple[str, ...]] = {
    "batch": BATCH_AXES,  # dp, fsdp, data
    "seq": ("sp",),
    "heads": ("tp",),
    "ff": ("tp",),
    "vocab": ("tp",),
}

RuleList = Sequence[Tuple[str, Any]]


@dataclasses.dataclass(frozen=True)
class PartitionRules:
    """Ordered `(regex, PartitionSpec)` rules; the first whose regex `re.search`es a leaf's path wins.

    `optional_axes` may be missing from the mesh (they then mean "not split"), so one rule set serves a
    dp-only mesh and a dp x fsdp x tp x sp one. Any other axis a matching rule names must be in the mesh,
    which catches typos such as "model" vs "tp" instead of silently replicating.
    """

    rules: Tuple[Tuple[str, Any], ...]
    optional_axes: Tuple[str, ...] = ()

    def __post_init__(self):
        from jax.sharding import PartitionSpec

        rules = []
        for item in self.rules:
            try:
                pattern, spec = item
            except (TypeError, ValueError):
                raise UsageValueError(f"A partition rule is a (regex, PartitionSpec) pair, got {item!r}.") from None
            try:
                compiled = re.compile(pattern)
            except re.error as exc:
                raise UsageValueError(f"Partition rule regex {pattern!r} does not compile: {exc}.") from None
            if spec is None:
                spec = PartitionSpec()
            elif not isinstance(spec, PartitionSpec):
                if isinstance(spec, (tuple, list)):
                    spec = PartitionSpec(*spec)
                else:
                    raise UsageValueError(f"Partition rule {pattern!r} maps to {spec!r}; use a "
                                          "jax.sharding.PartitionSpec.")
            rules.append((compiled.pattern, spec))
        object.__setattr__(self, "rules", tuple(rules))
        object.__setattr__(self, "optional_axes", tuple(self.optional_axes))
        object.__setattr__(self, "_compiled", tuple((re.compile(p), s) for p, s in rules))

    @classmethod
    def of(cls, rules: Union["PartitionRules", RuleList, None]) -> "PartitionRules":
        """Accept a PartitionRules, a plain list of pairs (strict: every axis must be in the mesh), or None
        (the built-in Llama rules)."""
        if rules is None:
            return llama_partition_rules()
        if isinstance(rules, PartitionRules):
            return rules
        return cls(tuple(rules))

    def __add__(self, other) -> "PartitionRules":
        """`my_rules + llama_partition_rules()`: earlier rules take precedence."""
        other = PartitionRules.of(other)
        optional = tuple(dict.fromkeys(self.optional_axes + other.optional_axes))
        return PartitionRules(self.rules + other.rules, optional)

    def match(self, path: str):
        for compiled, spec in self._compiled:
            if compiled.search(path):
                return compiled.pattern, spec
        return None


def llama_partition_rules(fsdp_axes: Sequence[str] = ("fsdp", "sp"), tp_axis: str = "tp") -> PartitionRules:
    """Rules for the built-in Llama family (Llama, Mistral, Qwen2), Megatron-style TP plus FSDP.

    Every [in, out] kernel splits one dimension over the FSDP axes (gathered just before use) and the other
    over `tp`: q/k/v and gate/up split their output (heads, intermediate) over tp, o/down their input, so
    each attention head / MLP column lives on one tp shard and a layer needs one reduction over tp. `sp`
    joins the FSDP axes for weights, so sequence-parallel devices do not hold replicated copies. The
    embedding and lm_head split the vocabulary over tp, which keeps logits vocab-sharded. Norm weights and
    the o_proj bias are tiny and replicated. dp is never named: it only replicates.
    """
    from jax.sharding import PartitionSpec as P

    f = tuple(fsdp_axes)
    fsdp = f[0] if len(f) == 1 else f
    tp = tp_axis
    rules = (
        (r"(^|/)embed_tokens/embedding$", P(tp, fsdp)),
        (r"(^|/)self_attn/(q_proj|k_proj|v_proj)/kernel$", P(fsdp, tp)),
        (r"(^|/)self_attn/(q_proj|k_proj|v_proj)/bias$", P(tp)),
        (r"(^|/)self_attn/o_proj/kernel$", P(tp, fsdp)),
        (r"(^|/)self_attn/o_proj/bias$", P()),
        (r"(^|/)mlp/(gate_proj|up_proj)/kernel$", P(fsdp, tp)),
        (r"(^|/)mlp/down_proj/kernel$", P(tp, fsdp)),
        (r"(^|/)(input_layernorm|post_attention_layernorm|norm)/weight$", P()),
        (r"(^|/)lm_head/kernel$", P(fsdp, tp)),
    )
    optional = tuple(dict.fromkeys(("dp",) + f + (tp,)))
    return PartitionRules(rules, optional)


# -- paths ----------------------------------------------------------------------------------------------


def path_str(path) -> str:
    """A key path as `a/b/0/c`; a trailing nnx Variable `.value` is dropped so nnx.State matches pure dicts."""
    from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

    parts = []
    for key in path:
        if isinstance(key, DictKey):
            parts.append(str(key.key))
        elif isinstance(key, SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, FlattenedIndexKey):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    if parts and parts[-1] in ("value", "raw_value") and path and isinstance(path[-1], GetAttrKey):
        parts.pop()
    return "/".join(parts)


# -- rules -> specs ---------------------------------------------------------------------------------------


def _mesh_sizes(mesh) -> Dict[str, int]:
    return dict(zip(mesh.axis_names, getattr(mesh, "axis_sizes", None) or mesh.devices.shape))


def _entry_axes(entry) -> Tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def spec_for(path: str, shape: Sequence[int], mesh, rules: Union[PartitionRules, RuleList, None] = None):
    """The PartitionSpec of one leaf, checked against the mesh; raises ValueError naming the leaf otherwise."""
    from jax.sharding import PartitionSpec

    rules = PartitionRules.of(rules)
    shape = tuple(int(d) for d in shape)
    if len(shape) == 0:
        return PartitionSpec()  # scalars (step counters, Adam's count) are always replicated
    found = rules.match(path)
    if found is None:
        tail = "/".join(path.split("/")[-2:]) or path
        default = (" These are the built-in Llama rules (rules=None): for a model of your own pass rules, e.g. "
                   "[(r'.*', PartitionSpec())] to replicate every leaf (data parallel)."
                   if rules.rules == llama_partition_rules().rules else "")
        raise UsageValueError(
            f"No partition rule matches {path!r} (shape {shape}). Add a (regex, PartitionSpec) rule for it, "
            f"e.g. (r'{tail}$', PartitionSpec()) to replicate it; rules tried: {[p for p, _ in rules.rules]}.{default}"
        )
    pattern, spec = found
    sizes = _mesh_sizes(mesh)
    if len(spec) > len(shape):
        raise UsageValueError(
            f"Rule {pattern!r} gives {path!r} the spec {spec} with {len(spec)} entries, but the array has shape "
            f"{shape} ({len(shape)} dims). Write a rule for this leaf with at most {len(shape)} entries."
        )
    used, out = set(), []
    for dim, (size, entry) in enumerate(zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)))):
        axes = []
        for axis in _entry_axes(entry):
            if axis not in sizes:
                if axis in rules.optional_axes:
                    continue
                raise UsageValueError(
                    f"Rule {pattern!r} shards {path!r} (shape {shape}) over mesh axis {axis!r}, but the mesh has "
                    f"only axes {tuple(sizes)}. Add {axis!r} to the mesh (size 1 is fine) or fix the rule."
                )
            if axis in used:
                raise UsageValueError(f"Rule {pattern!r} uses mesh axis {axis!r} twice in {spec} for {path!r}.")
            used.add(axis)
            axes.append(axis)
        split = math.prod(sizes[a] for a in axes)
        if size % split:
            raise UsageValueError(
                f"Cannot shard {path!r} (shape {shape}): dimension {dim} of size {size} is not divisible by "
                f"{split}, the product of mesh axes {dict((a, sizes[a]) for a in axes)} (rule {pattern!r} -> {spec}). "
                "Choose mesh sizes that divide it, or a rule that does not split this dimension."
            )
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def _map(fn, tree):
    """tree_map_with_path over array leaves; nnx Variables are descended into, keeping the State structure."""
    import jax

    return jax.tree_util.tree_map_with_path(lambda p, x: fn(path_str(p), x), tree)


# Axes that by convention split only the batch: no parameter rule names them.
_DATA_ONLY_AXES = ("dp", "data", "batch")


def _warn_if_axes_pass_each_other(rules: PartitionRules, mesh) -> None:
    """Optional axes missing from the mesh mean "not split": rules over ("fsdp", "tp") on a mesh named
    {"data": 2, "model": 2}, or with "fdsp" for "fsdp", replicated every leaf on every device without a word (a
    review). Said when some of the rules' axes are not in the mesh while a mesh axis that splits something is named
    by no rule."""
    sizes = _mesh_sizes(mesh)
    named = {axis for _, spec in rules.rules for entry in spec for axis in _entry_axes(entry)}
    absent = sorted(named - set(sizes))
    idle = [axis for axis, size in sizes.items() if size > 1 and axis not in named and axis not in _DATA_ONLY_AXES]
    if absent and idle:
        import logging

        logging.getLogger(__name__).warning(
            "The partition rules name axes %s, which the mesh lacks (they are optional, so they split nothing), and "
            "no rule names the mesh's axes %s: those replicate every leaf. Name the mesh's axes as the rules do (or "
            "the rules' as the mesh does): mesh axes %s.", absent, {a: sizes[a] for a in idle}, dict(sizes))


def partition_specs(tree, mesh, rules: Union[PartitionRules, RuleList, None] = None):
    """A pytree of PartitionSpecs for `tree` (arrays, numpy, ShapeDtypeStructs, nnx.State, optax state)."""
    rules = PartitionRules.of(rules)
    _warn_if_axes_pass_each_other(rules, mesh)
    return _map(lambda path, x: spec_for(path, np.shape(x), mesh, rules), tree)


def shardings_for(tree, mesh, rules: Union[PartitionRules, RuleList, None] = None):
    """A pytree of NamedShardings for `tree`, e.g. `jax.jit(init, out_shardings=shardings_for(
    jax.eval_shape(init), mesh))` to create a state directly in its shards. `rules=None`: the Llama rules."""
    from jax.sharding import NamedSharding

    rules = PartitionRules.of(rules)
    _warn_if_axes_pass_each_other(rules, mesh)
    return _map(lambda path, x: NamedSharding(mesh, spec_for(path, np.shape(x), mesh, rules)), tree)


def shard_by_rules(tree, mesh, rules: Union[PartitionRules, RuleList, None] = None):
    """Place every array of `tree` on `mesh` according to `rules`; an nnx object (a Module, an `nnx.Optimizer`),
    alone or inside a container (`{"model": model, "opt": opt}`), is updated in place and returned as itself.

    Host values (numpy, or arrays every process holds in full) become global arrays through
    `make_array_from_callback`: each process fills only its own shards, so nothing is communicated. Global
    arrays already on the mesh are resharded inside jit. Typed PRNG keys (an `nnx.Rngs` stream) are placed
    through their key data.
    """
    import jax

    if _is_nnx_object(tree):
        from flax import nnx

        nnx.update(tree, shard_by_rules(nnx.state(tree), mesh, rules))
        _annotate_as_placed(tree)
        return tree
    parts, structure = jax.tree_util.tree_flatten(tree, is_leaf=_is_nnx_object)
    if any(_is_nnx_object(part) for part in parts):
        # Inside a container ({"model": model, "opt": opt}) too: JAX rebuilt them as new objects, placed, and left
        # the caller's own unplaced; a save of those was then refused, pointing back here (a review). Placed as
        # their states, so rules see the same paths ("model/...") as for the state of the whole container.
        from flax import nnx

        states = structure.unflatten([nnx.state(p) if _is_nnx_object(p) else p for p in parts])
        placed = structure.flatten_up_to(shard_by_rules(states, mesh, rules))
        for part, state in zip(parts, placed):
            if _is_nnx_object(part):
                nnx.update(part, state)
                _annotate_as_placed(part)
        return structure.unflatten([p if _is_nnx_object(p) else q for p, q in zip(parts, placed)])
    shardings = shardings_for(tree, mesh, rules)
    single = jax.process_count() == 1
    digests: Dict[str, str] = {}  # of the host values placed, by leaf: every process must give the same

    def place(x, sharding, path=""):
        if isinstance(x, jax.Array):
            if x.is_fully_addressable and single:
                return jax.device_put(x, sharding)
            if not x.is_fully_addressable:
                return x if x.sharding == sharding else jax.jit(lambda y: y, out_shardings=sharding)(x)
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # numpy cannot hold a typed key
                data = place(jax.random.key_data(x), sharding, path)
                return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        host = np.asarray(x)
        if not single:
            digests[path] = array_digest(host)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    def place_leaf(path, x, sharding):
        if isinstance(x, str):
            return x  # a run tag: nothing to place, and save() keeps it as it is
        if not isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, bool)):
            raise UsageTypeError(f"shard_by_rules: the leaf {jax.tree_util.keystr(path) or '(the tree itself)'} is a "
                                 f"{type(x).__module__}.{type(x).__qualname__}, not an array: JAX sees it as one "
                                 f"opaque value, with nothing to place.{unregistered_class_hint(x)}")
        return place(x, sharding, path_str(path))

    placed = jax.tree_util.tree_map_with_path(place_leaf, tree, shardings)
    if digests:
        _check_processes_placed_the_same(digests)
    return placed


class ProcessCopiesDifferError(ValueError):
    """Processes gave `shard_by_rules` different values for one array (see `_check_processes_placed_the_same`)."""

    retry_repeats_it = True  # FailureConfig does not retry it (ray_jax_train.retries): every attempt inits alike


def _check_processes_placed_the_same(digests: Dict[str, str]) -> None:
    """Each process fills its own shards from its own host values, so values that differ between processes (a model
    initialised from a per-worker seed, as DDP users may, since DDP copies rank 0's weights) made one "replicated"
    array whose copies disagreed: it trained on without a word, and every checkpoint saved from it failed its
    checksums on restore (a review). `jax.device_put` refuses such values; this is the same check, by digest."""
    from ray_jax_train.checkpoint import _sync

    differ = _sync.keys_that_differ("shard_by_rules", digests, rule=_COLLECTIVE)
    if differ:
        raise ProcessCopiesDifferError(
            f"shard_by_rules: the value{'s' if len(differ) > 1 else ''} of {_sync.differ_between_processes(differ)}, "
            "which would each fill their own shards of one array from their own copy. "
            "Initialise the state the same way on every worker (the same seed: nnx.Rngs(seed), not seed + rank), "
            "or create it directly in its shards: jax.jit(init, out_shardings=rjt.shardings_for(...)).")


_COLLECTIVE = ("shard_by_rules is collective in a job of several processes: call it on every worker, in the same "
               "order")


def array_digest(value) -> str:
    """A short digest of an array's dtype, shape and values; -0.0 and 0.0, and NaNs of other payloads, count as
    the same value."""
    import hashlib

    import jax

    leaf = np.asarray(value)
    if jax.dtypes.issubdtype(leaf.dtype, np.inexact):  # bfloat16 too, which numpy does not call floating
        leaf = np.where(np.isnan(leaf), np.nan, leaf + 0).astype(leaf.dtype)
    digest = hashlib.sha1(f"{leaf.dtype.str}{leaf.dtype.name}{leaf.shape}".encode())
    digest.update(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8))  # bytes: bfloat16 has no buffer format
    return digest.hexdigest()[:16]


def _annotate_as_placed(obj) -> None:
    """A Variable's `nnx.with_partitioning` annotation (`out_sharding`) set to where the rules placed it. Flax reads
    the annotation, not the array, for what it builds later: an `nnx.Optimizer` made after the placement put Adam's
    moments where the stale annotation said, twice the size the rules meant (a review). Only annotations there
    already are changed."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding

    for _, node in nnx.iter_graph(obj):
        if not isinstance(node, nnx.Variable) or node.get_metadata("out_sharding", None) is None:
            continue
        value = node.get_value() if hasattr(node, "get_value") else node.value
        if isinstance(value, jax.Array) and isinstance(value.sharding, NamedSharding):
            spec = tuple(value.sharding.spec)
            node.set_metadata("out_sharding", spec + (None,) * (value.ndim - len(spec)))


def unregistered_class_hint(leaf) -> str:
    """Why a leaf that should be a pytree is not: a class from the driver's `__main__` reaches Ray's workers
    rebuilt by value, without the `jax.tree_util` registration the script made at import (a review: porting a
    pure-JAX loop; the errors told the user to register what they had registered)."""
    if type(leaf).__module__ != "__main__":
        return ""
    return (" Its class is defined in the driver script (__main__). If the script registers it as a pytree "
            "(register_dataclass, register_pytree_node, flax.struct.dataclass), that registration does not reach "
            "Ray's workers, which rebuild such a class without it, so JAX sees one opaque object there: define the "
            "class in a module the workers import (a file beside the script, which runtime_env={'working_dir': "
            "'.'} ships), or register it inside the training function.")


def _is_nnx_object(value) -> bool:
    """An nnx Module or Optimizer: a Python object whose arrays `nnx.state` collects. A user's own `nnx.Pytree`
    container (a train state class) is left as the pytree it is: orbax saves and restores it as that class."""
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is a dependency
        return False
    return isinstance(value, (nnx.Module, nnx.Optimizer))


def bytes_per_device(tree) -> Dict[Any, int]:
    """Bytes each addressable device holds for the arrays of `tree` (what FSDP is meant to cut). Host values
    (numpy arrays, Python numbers, as a restore may give for process-local leaves) are on no device."""
    import jax

    out: Dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


# -- checks for the LM path -------------------------------------------------------------------------------


def check_llama_parallelism(config, mesh, batch_size: Optional[int] = None, *, tp_axis: str = "tp",
                            batch_axes: Optional[Sequence[str]] = None,
                            rules: Union[PartitionRules, RuleList, None] = None) -> None:
    """Fail early, with the fix in the message, when a Llama config cannot be split over `mesh`.

    Tensor parallelism splits whole KV heads, so tp must divide num_key_value_heads (tp larger than the
    KV-head count would split a head across devices); the global batch must split over dp x fsdp.
    """
    sizes = _mesh_sizes(mesh)
    tp = sizes.get(tp_axis, 1)
    if tp > 1:
        kv = config.num_key_value_heads
        if tp > kv or kv % tp:
            divisors = [d for d in range(1, kv + 1) if kv % d == 0]
            raise UsageValueError(
                f"Mesh axis {tp_axis!r}={tp} cannot split the model's {kv} key/value heads "
                f"(num_attention_heads={config.num_attention_heads}): tensor parallelism keeps whole heads on a "
                f"device, so {tp_axis} must divide num_key_value_heads. Use {tp_axis} in {divisors} and put the "
                "other devices on dp/fsdp."
            )
        for name in ("intermediate_size", "vocab_size"):
            value = getattr(config, name)
            if value % tp:
                fix = (f"for a model trained from scratch, a padded vocabulary: model.vocab_size (LlamaConfig."
                       f"vocab_size) {-(-value // tp) * tp}, a multiple of {tp} (rows no token id uses)"
                       if name == "vocab_size" else
                       f"use a multiple of {tp} for {name}")
                raise UsageValueError(f"{name}={value} is not divisible by mesh axis {tp_axis!r}={tp}: tensor "
                                      f"parallelism splits it evenly over the {tp} devices. Set {tp_axis}=1 (dp/fsdp "
                                      f"instead), or {fix}.")
    if batch_size is not None:
        from ray_jax_train.data import check_batch_size

        check_batch_size(batch_size, mesh, batch_axes)
    # Every parameter dimension against the mesh, with the parameter named on failure.
    from flax import nnx

    from ray_jax_train.models.llama import create_model

    partition_specs(nnx.state(create_model(config, lazy=True), nnx.Param), mesh, rules)


# -- activations ------------------------------------------------------------------------------------------


def constrain(x, logical: Sequence[Optional[str]]):
    """`with_sharding_constraint` by logical dimension names, against the mesh set with `jax.set_mesh`.

    Without a mesh in context this is the identity, so the model runs unsharded on one device. Axes the mesh
    lacks, manual (shard_map) axes, and axes that do not divide a dimension are skipped, so a batch of 1 at
    generation time or an odd sequence length never fails here.
    """
    import jax
    from jax.sharding import PartitionSpec

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    used, spec = set(), []
    for dim, name in zip(x.shape, logical):
        axes, split = [], 1
        for axis in ACTIVATION_AXES.get(name, ()) if name else ():
            if axis in sizes and axis not in manual and axis not in used and dim % (split * sizes[axis]) == 0:
                axes.append(axis)
                split *= sizes[axis]
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    if manual:
        return x  # inside shard_map the caller owns the layout
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


# -- hybrid meshes (multi-slice) --------------------------------------------------------------------------


def _granule_key(device, granule: str) -> int:
    return getattr(device, "slice_index", 0) if granule == "slice" else device.process_index


def _pick_granule(devices, granule: str) -> str:
    if granule not in ("auto", "slice", "process"):
        raise UsageValueError(f"granule={granule!r}; use 'auto', 'slice' (TPU slices) or 'process' (hosts).")
    if granule != "auto":
        return granule
    slices = {getattr(d, "slice_index", None) for d in devices}
    return "slice" if None not in slices and len(slices) > 1 else "process"




def _plural(granule: str) -> str:
    return granule + ("es" if granule.endswith("s") else "s")


def hybrid_device_grid(axes, dcn: Optional[Union[Mapping[str, int], Sequence[int]]], devices: Sequence,
                       granule: str = "auto") -> Tuple[np.ndarray, Dict[str, int]]:
    """(device grid, resolved total axis sizes) for a mesh spanning several slices (or hosts).

    `axes` are TOTAL sizes (one may be -1); `dcn` says how many slices each axis spans (a mapping, or a
    sequence aligned with `axes`; one may be -1; missing axes span 1). Each axis is then `dcn` blocks of
    `axes / dcn` devices within a slice, so only the axes named in `dcn` (usually dp) cross the slow
    data-center network. Pure in `devices`, so the plan can be checked without a TPU pod.
    """
    from jax.experimental import mesh_utils

    sizes = resolve_axes(validate_axes(axes), len(devices))
    names = list(sizes)
    if dcn is None:
        dcn = {}
    if not isinstance(dcn, Mapping):
        dcn = list(dcn)
        if len(dcn) != len(names):
            raise UsageValueError(f"dcn sizes {dcn} must align with the mesh axes {names} (one size per axis).")
        dcn = dict(zip(names, dcn))
    unknown = [name for name in dcn if name not in sizes]
    if unknown:
        raise UsageValueError(f"dcn names axes {unknown} that are not mesh axes {names}.")
    granule = _pick_granule(devices, granule)
    num_granules = len({_granule_key(d, granule) for d in devices})
    dcn = dict(dcn)
    dcn_known = math.prod(v for v in dcn.values() if v != -1)
    inferred = [n for n, v in dcn.items() if v == -1]
    if len(inferred) > 1:
        raise UsageValueError(f"dcn sizes {dcn}: only one can be -1.")
    if inferred:
        if num_granules % dcn_known:
            raise UsageValueError(f"dcn sizes {dcn} cannot be inferred for {num_granules} {_plural(granule)}.")
        dcn[inferred[0]] = num_granules // dcn_known
    dcn_shape = [int(dcn.get(name, 1)) for name in names]
    if any(v < 1 for v in dcn_shape) or math.prod(dcn_shape) != num_granules:
        raise UsageValueError(
            f"dcn sizes {dict(zip(names, dcn_shape))} multiply to {math.prod(dcn_shape)}, but the devices form "
            f"{num_granules} {_plural(granule)}. Make the dcn sizes multiply to the number of {_plural(granule)}."
        )
    bad = {n: (sizes[n], d) for n, d in zip(names, dcn_shape) if sizes[n] % d}
    if bad:
        raise UsageValueError(
            f"Mesh axes {', '.join(f'{n}={s}' for n, (s, _) in bad.items())} are not divisible by their dcn sizes "
            f"{', '.join(f'{n}={d}' for n, (_, d) in bad.items())}; each axis is dcn blocks of equal size."
        )
    ici_shape = [sizes[n] // d for n, d in zip(names, dcn_shape)]
    ordered = sorted(devices, key=lambda d: (_granule_key(d, granule), d.process_index, d.id))
    if num_granules == 1:
        return np.array(ordered, dtype=object).reshape([sizes[n] for n in names]), sizes
    grid = mesh_utils.create_hybrid_device_mesh(
        ici_shape, dcn_shape, ordered, process_is_granule=(granule == "process"))
    return grid, sizes


def make_hybrid_mesh(axes, dcn=None, devices: Optional[Sequence] = None, granule: str = "auto"):
    """A Mesh whose `dcn` axes cross slices (multi-slice TPU) or hosts (`granule='process'`, e.g. GPU nodes).

    With one slice, or no dcn sizes, this is `make_mesh(axes)`. `axes` may be a mapping or a `MeshSpec`.
    """
    import jax
    from jax.sharding import Mesh

    devices = list(jax.devices() if devices is None else devices)
    if not dcn or all(v == 1 for v in (dcn.values() if isinstance(dcn, Mapping) else dcn)):
        return make_mesh(validate_axes(axes), devices)
    grid, sizes = hybrid_device_grid(axes, dcn, devices, granule)
    return Mesh(grid, tuple(sizes))
