"""Model parallelism: partition rules, their errors, hybrid meshes, activation sharding in the compiled HLO,
and dp / fsdp / dp x fsdp / fsdp x tp (and sp) layouts matching a single-device run, in one process and on two
real Ray workers (whose fit also carries test_generate's generation over both processes)."""
import json
import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import ray_jax_train as rjt
from ray_jax_train import sharding as S
from ray_jax_train.config import LlamaConfig, MeshSpec
from ray_jax_train.data import batch_sharding
from ray_jax_train.mesh import make_mesh
from ray_jax_train.models.llama import create_model

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rope_theta=1000.0)
BATCH, SEQ, STEPS, LR = 8, 12, 10, 3e-3  # BATCH * SEQ is no parameter dimension
# The layouts the 2-worker run checks (4 devices), in one fit; dp2 x fsdp2 is built as a hybrid (DCN) mesh.
RAY_LAYOUTS = [{"dp": 4}, {"fsdp": 4}, {"dp": 2, "fsdp": 2}, {"fsdp": 2, "tp": 2}]


# -- the training run every layout must reproduce -----------------------------------------------------------


def tiny_config(**overrides) -> LlamaConfig:
    return LlamaConfig(**{**TINY, **overrides})


def init_params(cfg: LlamaConfig, seed: int = 0):
    """Random parameters from numpy (identical in every process, no eager JAX init to compile)."""
    graphdef, abstract = nnx.split(create_model(cfg, lazy=True), nnx.Param)
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda x: (0.05 * rng.standard_normal(x.shape)).astype(x.dtype) + (x.ndim == 1),
                          nnx.to_pure_dict(abstract))
    return graphdef, params


def global_batch(step: int, cfg: LlamaConfig) -> np.ndarray:
    """The same global batch everywhere, made from the step number (data order is not under test here)."""
    rng = np.random.default_rng(1000 + step)
    # Counting sequences with a random start: learnable within a few steps, so the loss moves.
    start = rng.integers(0, cfg.vocab_size, (BATCH, 1))
    return ((start + np.arange(SEQ + 1)) % cfg.vocab_size).astype(np.int32)


def make_loss(graphdef):
    def loss_fn(params, ids):
        logits = nnx.merge(graphdef, params)(ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    return loss_fn


def make_step(graphdef, optimizer):
    loss_fn = make_loss(graphdef)

    def step(state, ids):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], ids)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    return step


def compile_step(cfg, axes=None, *, dcn=None):
    """The train step compiled for a layout (`axes=None`: one device, no mesh) and its sharded initial state."""
    graphdef, params = init_params(cfg)
    optimizer = optax.adamw(LR, weight_decay=0.01)
    step = make_step(graphdef, optimizer)
    ids = jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)
    if axes is None:
        state = {"params": jax.tree.map(jnp.asarray, params)}
        state["opt_state"] = optimizer.init(state["params"])
        return types.SimpleNamespace(compiled=jax.jit(step).lower(state, ids).compile(), state=state, mesh=None,
                                     put=jnp.asarray)
    mesh = S.make_hybrid_mesh(axes, dcn, granule="process") if dcn else make_mesh(axes)
    S.check_llama_parallelism(cfg, mesh, batch_size=BATCH)
    params_shape = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    abstract = {"params": params_shape, "opt_state": jax.eval_shape(optimizer.init, params_shape)}
    shardings = S.shardings_for(abstract, mesh)
    params = S.shard_by_rules(params, mesh)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings["opt_state"])(params)
    data = batch_sharding(mesh)
    jitted = jax.jit(step, in_shardings=(shardings, data), out_shardings=(shardings, None), donate_argnums=0)
    with jax.set_mesh(mesh):  # the model's activation constraints resolve against this mesh
        compiled = jitted.lower(abstract, ids).compile()

    def put(batch):
        return jax.make_array_from_callback(batch.shape, data, lambda index: batch[index])

    return types.SimpleNamespace(compiled=compiled, state={"params": params, "opt_state": opt_state}, mesh=mesh,
                                 put=put)


def to_host(tree):
    """Full numpy copies of (possibly multi-process) global arrays."""
    from jax.experimental import multihost_utils

    return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)


def train(run, cfg):
    state, losses = run.state, []
    for i in range(STEPS):
        state, loss = run.compiled(state, run.put(global_batch(i, cfg)))
        losses.append(float(loss))
    return state, losses


def flat(tree):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def assert_same_run(params, losses, reference, atol=1e-5):
    ref_params, ref_losses = reference
    np.testing.assert_allclose(losses, ref_losses, atol=atol, rtol=0)
    ref = flat(ref_params)
    got = flat(params)
    assert got.keys() == ref.keys()
    for key in ref:
        np.testing.assert_allclose(got[key], ref[key], atol=atol, rtol=0, err_msg=key)


@pytest.fixture(scope="module")
def reference():
    """The single-device run (no mesh, so no sharding constraints are active) every layout must match."""
    cfg = tiny_config()
    state, losses = train(compile_step(cfg), cfg)
    assert losses[-1] < losses[0]
    return to_host(state["params"]), losses


# -- HLO: activations are never gathered over the batch ----------------------------------------------------


def batch_gathers(hlo: str, batch: int, seqs) -> list:
    """Collectives whose result is activation-shaped with the full global batch: [batch, seq, ...]."""
    found = []
    for line in hlo.splitlines():
        match = re.search(r"= \(?(\w+)\[([\d,]*)\][^=]*? (all-gather|all-to-all|collective-permute)\(", line)
        if not match:
            continue
        dims = [int(d) for d in match.group(2).split(",") if d]
        if len(dims) >= 2 and dims[0] == batch and dims[1] in seqs or batch * SEQ in dims:
            found.append(f"{match.group(3)} {match.group(1)}{dims}")
    return found


def weight_gathers(hlo: str) -> list:
    return re.findall(r"= (f32\[\d+,\d+\])\S* all-gather\(", hlo)


# -- rules ------------------------------------------------------------------------------------------------


def specs_by_path(tree, mesh, rules=None):
    return {S.path_str(p): s for p, s in jax.tree_util.tree_leaves_with_path(
        S.partition_specs(tree, mesh, rules), is_leaf=lambda x: isinstance(x, P))}


def test_llama_rules_cover_params_and_optimizer_state():
    mesh = jax.sharding.AbstractMesh((1, 2, 2), ("dp", "fsdp", "tp"))
    for cfg in (tiny_config(), tiny_config(tie_word_embeddings=True, attention_bias=True, attention_out_bias=True)):
        _, params = init_params(cfg)
        state = {"step": np.int32(0), "params": params,
                 "opt_state": jax.eval_shape(optax.adamw(1e-3).init, params)}
        specs = specs_by_path(state, mesh)
        assert specs["step"] == P()
        assert specs["params/embed_tokens/embedding"] == P("tp", "fsdp")
        assert specs["params/layers/1/self_attn/k_proj/kernel"] == P("fsdp", "tp")
        assert specs["params/layers/0/self_attn/o_proj/kernel"] == P("tp", "fsdp")
        assert specs["params/layers/0/mlp/up_proj/kernel"] == P("fsdp", "tp")
        assert specs["params/layers/0/mlp/down_proj/kernel"] == P("tp", "fsdp")
        assert specs["params/layers/0/post_attention_layernorm/weight"] == P()
        assert specs["params/norm/weight"] == P()
        if cfg.tie_word_embeddings:
            assert specs["params/layers/0/self_attn/q_proj/bias"] == P("tp")
            assert specs["params/layers/0/self_attn/o_proj/bias"] == P()
            assert not any("lm_head" in k for k in specs)
        else:
            assert specs["params/lm_head/kernel"] == P("fsdp", "tp")
        # Adam's moments take their parameter's spec, by the trailing path.
        for key, spec in specs.items():
            if key.startswith("params/"):
                name = key[len("params/"):]
                assert specs[f"opt_state/0/mu/{name}"] == spec
                assert specs[f"opt_state/0/nu/{name}"] == spec
        assert specs["opt_state/0/count"] == P()


def test_rules_on_nnx_state_and_abstract_shapes_give_named_shardings():
    mesh = make_mesh({"fsdp": 2, "tp": 2})
    state = nnx.state(create_model(tiny_config(), lazy=True), nnx.Param)
    shardings = S.shardings_for(state, mesh)  # nnx.State of ShapeDtypeStructs, Variables descended into
    q = shardings["layers"][0]["self_attn"]["q_proj"]["kernel"]
    q = q.get_value() if isinstance(q, nnx.Variable) else q
    assert isinstance(q, NamedSharding) and q.spec == P("fsdp", "tp")
    # A user's own model and rules: strict, every axis must exist; a PartitionRules may mark axes optional.
    tree = {"encoder": {"w": np.zeros((8, 4), np.float32)}, "head": np.zeros((4,), np.float32)}
    rules = [(r"encoder/w$", P("fsdp", "tp")), (r"head$", P())]
    placed = S.shard_by_rules(tree, mesh, rules)
    assert placed["encoder"]["w"].sharding.spec == P("fsdp", "tp")
    assert {s.data.shape for s in placed["encoder"]["w"].addressable_shards} == {(4, 2)}
    dp_only = make_mesh({"dp": 4})
    with pytest.raises(ValueError, match=r"mesh axis 'fsdp'.*only axes \('dp',\)"):
        S.partition_specs(tree, dp_only, rules)
    lenient = S.PartitionRules(tuple(rules), optional_axes=("fsdp", "tp"))
    assert specs_by_path(tree, dp_only, lenient)["encoder/w"] == P()
    # User rules first, built-in Llama rules after: the first match wins.
    combined = S.PartitionRules([(r"lm_head/kernel$", P())]) + S.llama_partition_rules()
    assert specs_by_path(state, mesh, combined)["lm_head/kernel"] == P()


def test_new_model_init_by_parts_equals_one_program(monkeypatch):
    """The scratch init builds the model part by part (all layers sharing one program) straight into FSDP x TP
    shardings, with the same values as one program over the whole model, and traces the layer constructor once."""
    from ray_jax_train.lm import state as state_lib
    from ray_jax_train.models import llama

    mesh = make_mesh({"fsdp": 2, "tp": 2})
    real_parts = llama.init_parts
    traced = []

    def counting_parts(config):
        parts, wrapped = real_parts(config), {}
        for _, make in parts:
            wrapped.setdefault(make, lambda rngs, make=make: traced.append(make.__name__) or make(rngs))
        return [(path, wrapped[make]) for path, make in parts]

    monkeypatch.setattr(state_lib, "init_parts", counting_parts)
    cfg = tiny_config(num_hidden_layers=3)  # untied: the head draws after the layers
    params = state_lib.init_params(cfg, mesh)
    assert sorted(traced) == ["embed", "layer", "lm_head", "norm"]
    whole = lambda: state_lib.split_model(llama.LlamaForCausalLM(cfg))[1]  # noqa: E731
    expected = jax.jit(whole, out_shardings=state_lib.state_shardings(jax.eval_shape(whole), mesh))()
    assert jax.tree.structure(params) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(expected)):
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    kernel = params["layers"][2]["mlp"]["up_proj"]["kernel"]
    assert kernel.sharding.spec == P("fsdp", "tp") and kernel.addressable_shards[0].data.shape[0] * 2 == kernel.shape[0]
    # The layers differ: the stream's count moved on from program to program.
    assert np.abs(np.asarray(params["layers"][0]["mlp"]["up_proj"]["kernel"]) - np.asarray(kernel)).max() > 0.01


def test_nnx_objects_inside_a_state_dict_are_placed_in_place():
    """{"model": model, "opt": opt} came back as new objects, placed, and the caller's own stayed unplaced: their
    save was then refused, pointing back to shard_by_rules (a review). Rules see the container's paths."""
    mesh = make_mesh({"dp": 4})
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    rules = [(r"^model/kernel$", P("dp")), (r".*", P())]
    state = {"model": model, "opt": opt, "step": np.int32(3)}
    placed = S.shard_by_rules(state, mesh, rules)
    assert placed["model"] is model and placed["opt"] is opt
    assert model.kernel[...].sharding == NamedSharding(mesh, P("dp"))  # the "model/..." path, as in the dict
    # The moments of the kernel live under "opt/...": the catch-all, replicated on the mesh.
    assert {x.sharding for x in jax.tree.leaves(nnx.state(opt))} == {NamedSharding(mesh, P())}
    assert isinstance(placed["step"], jax.Array) and placed["step"].sharding.spec == P()


def test_an_annotated_model_placed_by_rules_carries_their_layout_to_what_flax_builds_next():
    """Flax builds from `nnx.with_partitioning` annotations, not from the arrays: an nnx.Optimizer made after
    shard_by_rules put Adam's moments where the stale annotation said, twice the size the rules meant (a review)."""
    mesh = make_mesh({"fsdp": 2, "tp": 2})
    annotated = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "tp"))
    with jax.set_mesh(mesh):
        model = nnx.Linear(8, 8, kernel_init=annotated, rngs=nnx.Rngs(0))
    S.shard_by_rules({"model": model}, mesh, [(r"kernel$", P("fsdp", "tp")), (r".*", P())])
    assert model.kernel.get_metadata("out_sharding") == ("fsdp", "tp")
    assert model.bias.get_metadata("out_sharding", None) is None  # none before: none added
    with jax.set_mesh(mesh):
        opt = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    assert opt.opt_state[0].mu["kernel"][...].sharding.spec == P("fsdp", "tp")


def test_absent_and_size_one_axes():
    _, params = init_params(tiny_config())
    dp_only = specs_by_path(params, jax.sharding.AbstractMesh((4,), ("dp",)))
    assert set(dp_only.values()) == {P()}  # fsdp/tp/sp absent: replicated, nothing to split
    sized_one = specs_by_path(params, jax.sharding.AbstractMesh((4, 1, 1), ("dp", "fsdp", "tp")))
    assert sized_one["lm_head/kernel"] == P("fsdp", "tp")  # size-1 axes are harmless
    with_sp = specs_by_path(params, jax.sharding.AbstractMesh((2, 2), ("fsdp", "sp")))
    assert with_sp["layers/0/mlp/gate_proj/kernel"] == P(("fsdp", "sp"))  # sp devices hold weight shards too


def test_optional_axes_that_miss_the_mesh_s_names_are_said(caplog):
    """Optional axes the mesh lacks split nothing: a mesh named the common JAX way ({"data", "model"}), or a typo
    ("fdsp"), replicated every leaf on every device without a word (a review)."""
    _, params = init_params(tiny_config())

    def warned(axes, sizes, rules=None):
        caplog.clear()
        specs_by_path(params, jax.sharding.AbstractMesh(sizes, axes), rules)
        return [r.getMessage() for r in caplog.records if r.name == "ray_jax_train.sharding"]

    said = warned(("data", "model"), (2, 2))
    assert len(said) == 1 and "no rule names the mesh's axes {'model': 2}" in said[0] and "'tp'" in said[0], said
    typo = S.PartitionRules(((r"kernel$", P("fdsp")), (r".*", P())), optional_axes=("fdsp",))
    assert "{'fsdp': 4}" in "".join(warned(("fsdp",), (4,), typo))
    for axes, sizes in ((("dp",), (4,)), (("data",), (4,)), (("dp", "fsdp"), (2, 2)), (("fsdp", "tp"), (2, 2)),
                        (("dp", "model"), (4, 1))):  # batch axes, named axes, and a size-1 axis split nothing anyway
        assert warned(axes, sizes) == [], (axes, sizes)


def test_bad_input_errors():
    cfg = tiny_config()
    _, params = init_params(cfg)
    mesh = jax.sharding.AbstractMesh((4,), ("fsdp",))
    with pytest.raises(ValueError, match=r"No partition rule matches 'lm_head/kernel' \(shape \(32, 128\)\)"):
        S.partition_specs(params, mesh, S.PartitionRules(S.llama_partition_rules().rules[:-1], ("tp", "sp")))
    # A model of one's own under the default (Llama) rules: the error says how to replicate it (a torch user's review).
    with pytest.raises(ValueError, match=r"'l1/bias'.*built-in Llama rules \(rules=None\).*\[\(r'\.\*', "
                                         r"PartitionSpec\(\)\)\] to replicate every leaf"):
        S.partition_specs({"l1": {"bias": np.zeros(4)}}, mesh)
    with pytest.raises(ValueError, match=r"mesh axis 'model'.*only axes \('fsdp',\)"):
        S.partition_specs(params, mesh, [(r".*", P("model"))])
    odd = {"layers": {"0": {"mlp": {"down_proj": {"kernel": np.zeros((64, 30), np.float32)}}}}}
    with pytest.raises(ValueError, match=r"'layers/0/mlp/down_proj/kernel' \(shape \(64, 30\)\): dimension 1 of size "
                                         r"30 is not divisible by 4, the product of mesh axes \{'fsdp': 4\}"):
        S.partition_specs(odd, mesh)
    with pytest.raises(ValueError, match=r"gives 'norm/weight' the spec .* 2 entries, but the array has shape \(32,\)"):
        S.partition_specs({"norm": {"weight": np.zeros(32)}}, mesh, [(r"weight$", P("fsdp", None))])
    with pytest.raises(ValueError, match=r"Mesh axis 'tp'=4 cannot split the model's 2 key/value heads.*\[1, 2\]"):
        S.check_llama_parallelism(cfg, jax.sharding.AbstractMesh((4,), ("tp",)))
    with pytest.raises(ValueError, match=r"Global batch_size=6 is not divisible by the 4 batch shards"):
        S.check_llama_parallelism(cfg, jax.sharding.AbstractMesh((2, 2, 1), ("dp", "fsdp", "tp")), batch_size=6)
    with pytest.raises(ValueError, match="regex"):
        S.PartitionRules([("(", P())])


def test_hybrid_mesh_plan_simulated():
    """SIMULATED multi-slice: fake devices carrying slice_index, since a CPU host has no TPU slices."""
    fake = [types.SimpleNamespace(id=i, process_index=i // 2, slice_index=i // 4, platform="cpu", device_kind="cpu")
            for i in range(8)]
    grid, sizes = S.hybrid_device_grid(MeshSpec(axis_names=("dp", "fsdp", "tp"), axis_dims=(2, -1, 1)),
                                       {"dp": 2}, fake)
    assert sizes == {"dp": 2, "fsdp": 4, "tp": 1} and grid.shape == (2, 4, 1)
    assert [{d.slice_index for d in grid[i].ravel()} for i in range(2)] == [{0}, {1}]  # dp crosses slices only
    grid, _ = S.hybrid_device_grid({"dp": 2, "fsdp": 4}, (1, -1), fake)  # fsdp spans the two slices
    assert [[d.slice_index for d in row] for row in grid] == [[0, 0, 1, 1], [0, 0, 1, 1]]
    grid, _ = S.hybrid_device_grid({"dp": 4, "fsdp": 2}, {"dp": 4}, fake, granule="process")  # hosts as granules
    assert [[d.process_index for d in row] for row in grid] == [[0, 0], [1, 1], [2, 2], [3, 3]]
    with pytest.raises(ValueError, match=r"multiply to 4, but the devices form 2 slice"):
        S.hybrid_device_grid({"dp": 4, "fsdp": 2}, {"dp": 4}, fake)
    with pytest.raises(ValueError, match=r"dp=2 are not divisible by their dcn sizes dp=4"):
        S.hybrid_device_grid({"dp": 2, "fsdp": 4}, {"dp": 4}, fake, granule="process")
    with pytest.raises(ValueError, match=r"not mesh axes"):
        S.hybrid_device_grid({"dp": 2, "fsdp": 4}, {"data": 2}, fake)
    with pytest.raises(ValueError, match=r"dcn_mesh=\{'tp': 2\}\) names axes \['tp'\] that are not in mesh"):
        rjt.JaxConfig(mesh={"dp": -1}, dcn_mesh={"tp": 2})
    # One slice: the ordinary mesh.
    assert S.make_hybrid_mesh({"dp": 2, "fsdp": 2}, {"dp": 1}).shape == {"dp": 2, "fsdp": 2}
    # On CPU/GPU the granules are the worker processes, known on the driver: said there, not by every worker.
    from ray.train import ScalingConfig

    from ray_jax_train.backend import resolve_jax_config

    two = ScalingConfig(num_workers=2)
    for dcn in ({"dp": 3}, {"dp": 2, "fsdp": 2}):
        with pytest.raises(ValueError, match=r"spans \d+ processes, but the run has 2 workers"):
            resolve_jax_config(rjt.JaxConfig(mesh={"dp": -1, "fsdp": 1}, dcn_mesh=dcn), two)
    for dcn in ({"dp": 2}, {"dp": -1}):
        resolve_jax_config(rjt.JaxConfig(mesh={"dp": -1, "fsdp": 1}, dcn_mesh=dcn), two)
    # The mesh itself too, with dcn_mesh set (it was checked only without one): its size, and dcn's blocks.
    for mesh, error in (({"dp": 3, "tp": -1}, "does not fit the 4 devices"), ({"dp": 2, "tp": 3}, "does not fit"),
                        ({"dp": 1, "tp": 4}, r"gives dp=1, not divisible by dcn_mesh's dp=2")):
        with pytest.raises(ValueError, match=error):
            resolve_jax_config(rjt.JaxConfig(num_cpu_devices=2, mesh=mesh, dcn_mesh={"dp": 2}), two)
    resolve_jax_config(rjt.JaxConfig(num_cpu_devices=2, mesh={"dp": 2, "tp": 2}, dcn_mesh={"dp": 2}), two)
    with pytest.raises(ValueError, match=r"with distributed=False each worker's mesh spans only its own devices"):
        resolve_jax_config(rjt.JaxConfig(distributed=False, mesh={"dp": -1}, dcn_mesh={"dp": 2}), two)


# -- in-process layouts: HLO and numerics -----------------------------------------------------------------


def test_sequence_parallel_layout_matches_single_device(reference):
    """dp2 x sp2 in this process (the dp/fsdp/tp layouts run on two Ray workers below)."""
    cfg = tiny_config()
    run = compile_step(cfg, {"dp": 2, "sp": 2})
    hlo = run.compiled.as_text()
    assert batch_gathers(hlo, BATCH, {SEQ, SEQ // 2}) == []
    # Keys/values are gathered over sp along the sequence, for this dp shard's rows only.
    assert batch_gathers(hlo, BATCH // 2, {SEQ})
    state, losses = train(run, cfg)
    assert_same_run(to_host(state["params"]), losses, reference)


def test_hlo_check_catches_gathers_without_the_model_constraints():
    """A/B on the forward loss under FSDP: with no mesh in context (so no constraints), XLA gathers whole-batch
    activations next to the sharded weights; with `jax.set_mesh` the model's constraints prevent it."""
    cfg = tiny_config()
    graphdef, params = init_params(cfg)
    mesh = make_mesh({"fsdp": 4})
    params = S.shard_by_rules(params, mesh)
    ids = jax.device_put(global_batch(0, cfg), batch_sharding(mesh))
    loss = jax.jit(make_loss(graphdef))
    assert batch_gathers(loss.lower(params, ids).compile().as_text(), BATCH, {SEQ})
    with jax.set_mesh(mesh):
        assert batch_gathers(loss.lower(params, ids).compile().as_text(), BATCH, {SEQ}) == []


# -- two real Ray workers x 2 CPU devices -----------------------------------------------------------------


def layouts_loop(config):
    """Runs in each worker: every layout in turn, with the results written by rank 0 (bytes by every rank); then
    `generate_over_both_processes` (a 2-worker fit costs seconds before its loop starts: one carries both)."""
    cfg = tiny_config()
    mesh = rjt.get_mesh()  # JaxConfig(mesh=..., dcn_mesh=...) reaches the loop as a hybrid mesh over hosts
    assert dict(mesh.shape) == dict(config["layouts"][0])
    assert [d.process_index for d in mesh.devices.ravel()] == [0, 0, 1, 1]
    out = {"process_count": jax.process_count(), "layouts": []}
    for axes in config["layouts"]:
        dcn = {"dp": 2} if axes == {"dp": 2, "fsdp": 2} else None
        run = compile_step(cfg, axes, dcn=dcn)
        hlo = run.compiled.as_text()
        replicated = sum(x.nbytes for x in jax.tree.leaves(run.state))
        state, losses = train(run, cfg)
        per_device = S.bytes_per_device(state)
        out["layouts"].append({"axes": axes, "losses": losses, "replicated_bytes": replicated,
                               "device_bytes": sorted(per_device.values()),
                               "mesh_devices": [d.process_index for d in run.mesh.devices.ravel()],
                               "batch_gathers": batch_gathers(hlo, BATCH, {SEQ}),
                               "weight_gathers": weight_gathers(hlo)})
        params = to_host(state["params"])
        if jax.process_index() == 0:
            np.savez(os.path.join(config["out"], f"params{len(out['layouts']) - 1}.npz"), **flat(params))
    out["batch_axes_errors"] = batch_axes_errors()
    with open(os.path.join(config["out"], f"rank{jax.process_index()}.json"), "w") as f:
        json.dump(out, f)
    generate_over_both_processes(os.path.join(config["out"], "tokens.npy"))


def batch_axes_errors():
    """What a batch sharded over axes that stay within each process is told: the batch axes named, and the axes
    that do span the processes offered (it was advice about axis order, for batch_axes=("tp",) too)."""
    from ray_jax_train.data import process_rows

    errors = {}
    for name, axes, batch_axes in [("tp_as_batch", {"fsdp": 2, "tp": 2}, ("tp",)),
                                   ("tp_first", {"tp": 2, "fsdp": 2}, None)]:
        try:
            process_rows(batch_sharding(make_mesh(axes), batch_axes), BATCH)
            errors[name] = None
        except ValueError as exc:
            errors[name] = str(exc)
    errors["fine"] = process_rows(batch_sharding(make_mesh({"fsdp": 2, "tp": 2}), ("fsdp", "tp")), BATCH)
    return errors


def generate_over_both_processes(out: str):
    """Each worker builds test_generate's weights, shards them over both processes' devices and generates."""
    from jax.experimental import multihost_utils

    import test_generate as G

    graphdef, state = nnx.split(G.random_model())
    sharded = nnx.merge(graphdef, S.shard_by_rules(state, make_mesh({"fsdp": -1}), S.llama_partition_rules()))
    leaves = jax.tree.leaves(nnx.state(sharded))
    assert {len(x.sharding.device_set) for x in leaves} == {jax.device_count()}  # 2 per process here
    assert {d.process_index for x in leaves for d in x.sharding.device_set} == {0, 1}
    tokens = G.generate(sharded, *G.left_padded([7, 3, 5], 7), max_new_tokens=12)
    tokens = np.asarray(multihost_utils.process_allgather(tokens, tiled=True))
    if jax.process_index() == 0:
        np.save(out, tokens)


@pytest.fixture(scope="module")
def two_workers(ray_cluster, tmp_path_factory):
    """One fit of `layouts_loop` on 2 workers x 2 CPU devices; its outputs directory."""
    from ray.train import RunConfig, ScalingConfig

    tmp = tmp_path_factory.mktemp("two_workers")
    out = tmp / "out"
    out.mkdir()
    trainer = rjt.JaxTrainer(
        layouts_loop, train_loop_config={"out": str(out), "layouts": RAY_LAYOUTS},
        scaling_config=ScalingConfig(num_workers=2),
        jax_config=rjt.JaxConfig(num_cpu_devices=2, mesh=RAY_LAYOUTS[0], dcn_mesh={"dp": 2}),
        run_config=RunConfig(storage_path=str(tmp / "storage")))
    result = trainer.fit()
    assert result.error is None
    return out


def test_two_workers_four_layouts_match_single_device(two_workers, reference):
    out = two_workers
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    ref_params, ref_losses = reference
    for i, axes in enumerate(RAY_LAYOUTS):
        for info in ranks:
            layout = info["layouts"][i]
            assert info["process_count"] == 2 and layout["axes"] == axes
            np.testing.assert_allclose(layout["losses"], ref_losses, atol=1e-5, rtol=0)
            assert layout["mesh_devices"] == [0, 0, 1, 1]  # each process owns a contiguous block
            # The compiled train step never gathers activations over the whole global batch; with the weights
            # split, it gathers weights instead (so the check is not vacuous).
            assert layout["batch_gathers"] == [], (axes, layout["batch_gathers"])
            assert bool(layout["weight_gathers"]) == (axes != {"dp": 4}), axes
        got = dict(np.load(out / f"params{i}.npz"))
        ref = flat(ref_params)
        assert got.keys() == ref.keys()
        for key in ref:
            np.testing.assert_allclose(got[key], ref[key], atol=1e-5, rtol=0, err_msg=f"{axes} {key}")
    # FSDP over 4 devices: each device holds a quarter of params + Adam state (+10% for norms and counters).
    fsdp = ranks[0]["layouts"][RAY_LAYOUTS.index({"fsdp": 4})]
    for info in ranks:
        layout = info["layouts"][RAY_LAYOUTS.index({"fsdp": 4})]
        assert len(layout["device_bytes"]) == 2
        assert max(layout["device_bytes"]) <= fsdp["replicated_bytes"] / 4 * 1.1, layout
    dp = ranks[0]["layouts"][RAY_LAYOUTS.index({"dp": 4})]
    assert min(dp["device_bytes"]) == dp["replicated_bytes"]  # the unsharded figure it is compared against
    for info in ranks:
        errors = info["batch_axes_errors"]
        assert errors["fine"] == BATCH // 2
        assert "batch axes ('tp',) lie within each process" in errors["tp_as_batch"], errors
        assert "the axes that span the processes are ['fsdp']. Shard the batch over the data axes that span the " \
               "processes: batch_axes=('fsdp',)" in errors["tp_as_batch"], errors
        assert "batch axes ('fsdp',) lie within each process" in errors["tp_first"], errors
        assert "are ['tp']. List the data axes first in the mesh (e.g. {'fsdp': ..., 'tp': ...})" in errors["tp_first"]


def test_a_model_sharded_over_two_worker_processes_generates_the_same_tokens(two_workers):
    """Generation in a 2-process jax.distributed job (a loop sampling from its model mid-training): the weights
    split over both workers, the KV-cached decode's collectives go through gloo. Checked by hand before. (A test of
    tests/test_generate.py, here because it rides on the fit above.)"""
    import test_generate as G

    greedy = G.generate(G.random_model(), *G.left_padded([7, 3, 5], 7), max_new_tokens=12)  # one process
    np.testing.assert_array_equal(np.load(two_workers / "tokens.npy"), np.asarray(greedy))


def test_mfu_benchmark_smoke(tmp_path):
    """benchmarks/mfu_gpu.py --smoke on CPU, so the GPU benchmark cannot rot unnoticed."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "mfu_gpu.py")
    spec = importlib.util.spec_from_file_location("mfu_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    [result] = bench.main(["--smoke", "--out", str(tmp_path / "mfu.json")])
    assert result["finite"] and result["tokens_per_s"] > 0 and result["flops_per_token"] > 0
    assert result["mfu"] is None and "unknown device kind" in result["peak_source"]  # CPU has no table entry
    assert json.loads((tmp_path / "mfu.json").read_text())[0]["size"] == "smoke"
    h100 = types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")
    assert bench.peak_flops(h100) == (989e12, "table: H100")
    assert bench.peak_flops(types.SimpleNamespace(device_kind="NVIDIA H100 PCIe"))[0] == 756e12


def test_single_slice_tpu_meshes_have_auto_axes_like_every_other_mesh():
    """`make_mesh` lays a single TPU slice out with `jax.make_mesh`, which defaults to Explicit axes; there the
    model's constraints fail. No TPU here: the layout function runs on the 4 CPU devices, and the step that picks
    it by platform is the one part not exercised."""
    from jax.sharding import AxisType

    from ray_jax_train.mesh import _torus_mesh

    mesh = _torus_mesh({"fsdp": 2, "tp": 2}, jax.devices()[:4])
    assert dict(mesh.shape) == {"fsdp": 2, "tp": 2}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert make_mesh({"dp": 4}).axis_types == (AxisType.Auto,)


def test_a_cpu_devices_peak_is_its_share_of_the_process(monkeypatch):
    """One CPU device's matmul runs on all the process's cores: with 4 devices each has a quarter of that peak (it
    was the whole peak each, so MFU read 4x too low)."""
    import jax

    from ray_jax_train.lm import metrics

    monkeypatch.setattr(metrics, "_measured", {})
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda device=None, **kw: 100e9)
    assert len(jax.local_devices()) == 4
    assert metrics.peak_flops_per_device() == 25e9


def test_tpu_peaks_are_per_jax_device():
    """On v2, v3 and TPU7x each of a chip's two TensorCores is a JAX device, so its peak is half the chip's; TPU7x
    matched no entry and MFU was taken against a measured matmul. No TPU here: the devices are stand-ins that carry
    the device_kind strings JAX gives on those machines."""
    import types

    from ray_jax_train.lm import metrics

    def peak(kind):
        return metrics.peak_flops_per_device(types.SimpleNamespace(device_kind=kind, platform="tpu"))

    assert peak("TPU7x") == 2307e12 / 2 and peak("TPU v3") == 123e12 / 2 and peak("TPU v2") == 23e12
    assert peak("TPU v4") == 275e12 and peak("TPU v5") == 459e12 and peak("TPU v5 lite") == 197e12
    assert peak("TPU v6 lite") == 918e12


def test_bytes_per_device_counts_device_arrays_and_skips_host_values():
    """A restore gives numpy for process-local leaves; bytes_per_device(restored.state) raised AttributeError."""
    import jax.numpy as jnp

    counted = S.bytes_per_device({"a": jnp.ones(3, jnp.float32), "host": np.zeros(5), "n": 3})
    assert counted == {jax.devices()[0]: 12}
