"""The built-in causal-LM loop: accumulation, 2-worker data parallel against one process (through a kill and
resume), argument checks."""
import itertools
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from ray.train import RunConfig, ScalingConfig

import ray_jax_train as rjt
from ray_jax_train.config import LlamaConfig
from ray_jax_train.lm import TrainingArguments, make_optimizer, make_train_step, read_metrics, shard_state
from ray_jax_train.lm.loop import train_loop_per_worker
from ray_jax_train.lm.state import split_model
from ray_jax_train.plot import resumed_steps
from ray_jax_train.lm.step import new_state
from ray_jax_train.models import create_model, from_pretrained
from ray_jax_train.text import pack_documents

SEQ, VOCAB = 32, 256
CONFIG = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


def packed_rows(num_docs=120, seed=0):
    """Packed rows of random documents with a learnable rule (each token is the previous one + 1)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(num_docs):
        start, length = rng.integers(1, VOCAB), rng.integers(4, 40)
        docs.append((start + np.arange(length)) % (VOCAB - 1) + 1)
    return pack_documents(docs, SEQ)


def _flat(tree):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _max_diff(a, b):
    return max(float(jnp.max(jnp.abs(jnp.asarray(x) - jnp.asarray(y)))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_accumulated_micro_batches_equal_one_big_batch():
    rows = {k: v[:16] for k, v in packed_rows().items()}
    mesh = rjt.make_mesh({"dp": 4})
    batch = {k: jax.device_put(v, NamedSharding(mesh, PartitionSpec("dp"))) for k, v in rows.items()}
    results = {}
    for k in (1, 4):
        # adam_epsilon well above float32 rounding: Adam with eps=1e-8 turns 1e-7 relative differences in a
        # near-zero gradient into lr-sized steps, which would test the optimizer's conditioning, not accumulation.
        args = TrainingArguments(total_steps=3, batch_size=16, gradient_accumulation_steps=k, max_sequence_length=SEQ,
                                 learning_rate=1e-2, adam_epsilon=1e-4)
        optimizer, _ = make_optimizer(args, 3)
        graphdef, params = split_model(create_model(CONFIG))
        state = shard_state(new_state(params, optimizer), mesh)
        step = jax.jit(make_train_step(graphdef, optimizer, k), donate_argnums=(0,))
        losses = []
        for _ in range(3):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        results[k] = (state["params"], losses)
    assert results[1][1][0] > results[1][1][-1]  # it trains
    np.testing.assert_allclose(results[1][1], results[4][1], rtol=1e-5)
    assert _max_diff(results[1][0], results[4][0]) < 1e-5
    # Not vacuous: the params moved by far more than the tolerance.
    assert _max_diff(results[1][0], split_model(create_model(CONFIG))[1]) > 1e-3


def test_accumulation_keeps_fsdp_weights_gathered_one_at_a_time():
    """XLA hoisted the loop-invariant params' fsdp all-gathers out of the accumulation scan and held every gathered
    weight for the whole step: fsdp over 4 devices then needed 1.63x the temporary memory of one unsharded device
    (1.17x now; both compiled, not run)."""
    from jax.sharding import Mesh

    from ray_jax_train.data import batch_sharding
    from ray_jax_train.lm import state as state_lib
    from ray_jax_train.lm.step import jit_train_step
    from ray_jax_train.mesh import make_mesh

    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    args = TrainingArguments(total_steps=2, batch_size=16, gradient_accumulation_steps=2, max_sequence_length=16)
    optimizer, _ = make_optimizer(args, 2)
    graphdef, _ = state_lib.abstract_params(config)

    def temp_bytes(mesh):
        abstract = state_lib.abstract_state(config, mesh, lambda p, s: new_state(p, optimizer, s))
        step = jit_train_step(graphdef, optimizer, 2, jax.tree.map(lambda leaf: leaf.sharding, abstract), mesh)
        batch = {k: jax.ShapeDtypeStruct((16, 16), jnp.int32, sharding=batch_sharding(mesh))
                 for k in ("input_ids", "targets", "loss_mask")}
        with jax.set_mesh(mesh):
            return step.lower(abstract, batch).compile().memory_analysis().temp_size_in_bytes

    unsharded = temp_bytes(Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("dp", "fsdp")))
    assert temp_bytes(make_mesh({"fsdp": 4})) < 1.4 * unsharded


def test_micro_batch_split_changes_nothing_for_uneven_token_counts():
    """Rows with very different loss-token counts: the token-weighted mean must not depend on the split."""
    rows = {k: v[:8].copy() for k, v in packed_rows().items()}
    rows["loss_mask"][::2, SEQ // 4:] = 0  # every other row keeps a quarter of its targets
    graphdef, params = split_model(create_model(CONFIG))
    args = TrainingArguments(total_steps=1, batch_size=8, max_sequence_length=SEQ, adam_epsilon=1e-4)
    optimizer, _ = make_optimizer(args, 1)
    out = [jax.jit(make_train_step(graphdef, optimizer, k))(new_state(params, optimizer), rows)[1]["loss"]
           for k in (1, 4)]
    np.testing.assert_allclose([float(x) for x in out], float(out[0]), rtol=1e-6)


def test_each_worker_shuffles_each_epoch_with_a_seed_of_its_own():
    """With seed + epoch alone the workers shuffled alike: rows at one position of each shard met in every batch."""
    from ray_jax_train.lm.loop import shuffle_seed

    seeds = {shuffle_seed(seed, epoch, worker) for seed in range(3) for epoch in range(3) for worker in range(3)}
    assert len(seeds) == 27  # seed 1's epoch 0 is not seed 0's epoch 1 either
    assert shuffle_seed(5, 2, 1) == shuffle_seed(5, 2, 1)  # a resume shuffles as before
    assert all(0 <= s < 2**32 for s in seeds)


def test_training_arguments_reject_bad_values():
    with pytest.raises(ValueError, match="not divisible by gradient_accumulation_steps"):
        TrainingArguments(total_steps=10, batch_size=10, gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match="warmup_steps=20 is longer than total_steps=10"):
        TrainingArguments(total_steps=10, warmup_steps=20)
    with pytest.raises(ValueError, match="total_steps"):
        TrainingArguments(total_steps=0)
    with pytest.raises(ValueError, match="learning_rate"):
        TrainingArguments(learning_rate=-1.0)
    with pytest.raises(ValueError, match="not a supported dtype"):
        TrainingArguments(dtype="float8")
    with pytest.raises(ValueError, match="only one size can be inferred"):
        TrainingArguments(mesh={"dp": -1, "fsdp": -1})
    with pytest.raises(ValueError, match="no batch axis"):
        TrainingArguments(mesh={"tp": -1})
    with pytest.raises(ValueError, match="scheduler"):
        TrainingArguments(scheduler="exponential")
    with pytest.raises(ValueError, match="unknown argument 'learning_rte'; did you mean 'learning_rate'"):
        TrainingArguments(learning_rte=1e-3)
    with pytest.raises(ValueError, match="unknown argument 'max_steps'; did you mean 'total_steps'"):
        TrainingArguments(max_steps=10)  # difflib's pick was max_eval_steps: valid, and another setting
    with pytest.raises(ValueError, match="does not split over the 4 batch shards"):
        TrainingArguments(batch_size=6, mesh={"dp": -1}).check_devices(4)
    # The fix offered takes both splits: into micro-batches, and each over the batch shards.
    with pytest.raises(ValueError, match=r"micro-batch \(batch_size=3 / gradient_accumulation_steps=3\) is 1, .* "
                                         r"multiple of 6 \(e.g. 6\), or fewer gradient_accumulation_steps"):
        TrainingArguments(batch_size=3, gradient_accumulation_steps=3).check_devices(2)
    TrainingArguments(batch_size=6, gradient_accumulation_steps=3).check_devices(2)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        TrainingArguments(batch_size=64).steps_for_rows(10)
    args = TrainingArguments(num_epochs=3, batch_size=8, dtype="bf16")
    assert args.dtype == "bfloat16" and args.steps_for_rows(20) == 6


def test_rows_past_the_last_whole_batch_of_an_epoch_are_counted(caplog):
    from ray_jax_train.lm.data import _say_rows_left_out

    with caplog.at_level("INFO", logger="ray_jax_train.lm.data"):
        _say_rows_left_out(20, 8)  # 4 of 20 sit out every epoch: a fifth, a warning
        _say_rows_left_out(1000, 8)
        _say_rows_left_out(1003, 8)  # 3 of 1003: said, quietly
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said[0][0] == "WARNING" and "4 of the 20 packed training rows are left out of every epoch" in said[0][1]
    assert len(said) == 2 and said[1][0] == "INFO" and "3 of the 1003" in said[1][1], said


def test_schedule_warms_up_then_decays():
    from ray_jax_train.lm.step import make_schedule
    args = TrainingArguments(total_steps=100, learning_rate=1.0, warmup_steps=10, min_learning_rate_ratio=0.1)
    schedule = make_schedule(args, 100)
    assert float(schedule(0)) == 0.0 and float(schedule(10)) == pytest.approx(1.0)
    assert isinstance(schedule(10), np.ndarray)  # on the host: no device program per logged rate
    assert float(schedule(100)) == pytest.approx(0.1)
    assert float(schedule(5)) == pytest.approx(0.5)
    linear = make_schedule(args.model_copy(update={"scheduler": "linear"}), 100)
    assert float(linear(55)) == pytest.approx(0.55)


@pytest.mark.parametrize("scheduler", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup,total", [(0, 50), (10, 50), (50, 50), (80, 50), (0, 1), (3, 1)])
def test_schedule_equals_optax_schedules(scheduler, warmup, total):
    """The schedule computed from the optimizer state's numbers equals optax's schedules, edge cases included."""
    import optax

    from ray_jax_train.lm.step import make_schedule

    peak, end = 2e-3, 2e-4
    args = TrainingArguments(learning_rate=peak, min_learning_rate_ratio=0.1, warmup_steps=warmup, scheduler=scheduler)
    w = min(warmup, total)
    if scheduler == "cosine":
        want = optax.warmup_cosine_decay_schedule(0.0, peak, w, max(total, w + 1), end)
    else:
        decay = (optax.linear_schedule(peak, end, max(total - w, 1)) if scheduler == "linear"
                 else optax.constant_schedule(peak))
        want = decay if w == 0 else optax.join_schedules([optax.linear_schedule(0.0, peak, w), decay], [w])
    got = make_schedule(args, total)
    steps = sorted({0, 1, w - 1, w, w + 1, total // 2, total - 1, total, total + 5} - {-1})
    np.testing.assert_allclose([float(got(s)) for s in steps], [float(want(s)) for s in steps], rtol=1e-5, atol=1e-9)


def test_optimizer_numbers_are_state_so_runs_share_one_step_program():
    """Runs and Tune trials that differ only in optimizer numbers lower to the same train step (one compile, then
    cache hits), and the numbers in the state still act exactly like optax's AdamW with the same schedule."""
    import optax

    from ray_jax_train.lm.step import make_schedule

    rows = {k: jnp.asarray(v[:4]) for k, v in packed_rows(num_docs=20).items()}
    graphdef, params = split_model(create_model(CONFIG))
    base = TrainingArguments(total_steps=20, batch_size=4, max_sequence_length=SEQ, learning_rate=1e-2,
                             warmup_steps=2, weight_decay=0.1, adam_epsilon=1e-4)  # eps as in the accumulation test
    other = base.model_copy(update={"learning_rate": 3e-3, "warmup_steps": 5, "weight_decay": 0.0,
                                    "adam_beta2": 0.99, "max_grad_norm": 0.5, "min_learning_rate_ratio": 0.5})

    def program(args):
        optimizer, _ = make_optimizer(args, 20)
        return optimizer, jax.jit(make_train_step(graphdef, optimizer)).lower(new_state(params, optimizer), rows)

    optimizer, lowered = program(other)
    text = lowered.as_text()
    assert program(base)[1].as_text() == text
    assert program(base.model_copy(update={"scheduler": "linear"}))[1].as_text() != text  # structure is static

    reference = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(
        make_schedule(other, 20), b1=other.adam_beta1, b2=0.99, eps=other.adam_epsilon, weight_decay=0.0,
        mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
    ours, theirs = new_state(params, optimizer), new_state(params, reference)
    step, reference_step = lowered.compile(), jax.jit(make_train_step(graphdef, reference))
    for _ in range(3):
        ours, theirs = step(ours, rows)[0], reference_step(theirs, rows)[0]
    ref_params = theirs["params"]
    assert _max_diff(ours["params"], ref_params) < 1e-6
    assert _max_diff(params, ref_params) > 1e-4  # three steps did move the weights


def test_a_resume_takes_this_run_s_optimizer_numbers_without_building_its_starting_weights():
    """A resume restores into the abstract state, so the starting weights (a Hugging Face model read from disk) are
    not built on every restart only to be thrown away; this run's optimizer numbers still come from a program that
    makes them as a new state would, placed as that state places them."""
    from ray_jax_train.lm import state as state_lib

    mesh = rjt.make_mesh({"dp": -1})
    args = TrainingArguments(total_steps=20, batch_size=4, max_sequence_length=SEQ, learning_rate=2e-3,
                             warmup_steps=3, weight_decay=0.05)
    optimizer, _ = make_optimizer(args, 20)
    new_state_fn = lambda params, step: new_state(params, optimizer, step)  # noqa: E731
    abstract = state_lib.abstract_state(CONFIG, mesh, new_state_fn)
    fresh = state_lib.fresh_hyperparameters(abstract, new_state_fn)
    built = state_lib.initial_state({}, CONFIG, mesh, new_state_fn=new_state_fn)["opt_state"].hyperparams
    assert fresh.keys() == built.keys() and "peak_learning_rate" in fresh
    for name in built:
        assert np.asarray(fresh[name]) == np.asarray(built[name]), name
        assert fresh[name].sharding == built[name].sharding, name
    assert state_lib.fresh_hyperparameters({"opt_state": (), "params": {}}, new_state_fn) is None


def test_two_workers_match_one_process_through_a_kill(ray_cluster, tmp_path, monkeypatch):
    """2 workers x 2 CPU devices (dp=2, fsdp=2, 2 micro-batches) == the same jitted step in this process, even when
    rank 1 is SIGKILLed at step 5: the group restarts, restores the sharded state from its last registered
    checkpoint and trains on to the same final params."""
    import ray.data
    from ray.train import FailureConfig

    from ray_jax_train.checkpoint import FAULTS_ENV

    steps, record = 6, tmp_path / "record"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")  # the default: a compilation cache in the run's storage
    rows = packed_rows()
    dataset = ray.data.from_items([{k: rows[k][i] for k in rows} for i in range(len(rows["input_ids"]))])
    args = TrainingArguments(total_steps=steps, batch_size=8, gradient_accumulation_steps=2, max_sequence_length=SEQ,
                             learning_rate=3e-3, warmup_steps=2, adam_epsilon=1e-4, log_steps=1, save_steps=2,
                             mesh={"dp": 2, "fsdp": -1}, progress_bar=False, resume_if_possible=True)
    trainer = rjt.JaxTrainer(
        train_loop_per_worker,
        train_loop_config={"arguments": args.model_dump(), "model_config": CONFIG.model_dump(), "total_steps": steps,
                           "record_dir": str(record)},
        scaling_config=ScalingConfig(num_workers=2),
        # The kill fires before the step-5 save; after it the survivor's jax.distributed shutdown waits briefly (the
        # whole timeout: its peer is dead).
        jax_config=rjt.JaxConfig(num_cpu_devices=2, env_vars={FAULTS_ENV: "sigkill@5:1"}, shutdown_timeout_s=2),
        run_config=RunConfig(name="parity", storage_path=str(tmp_path / "storage"),
                             failure_config=FailureConfig(max_failures=1)),
        datasets={"train": dataset},
    )
    result = trainer.fit()
    assert result.error is None, result.error

    # The restart resumed from the step-2 or step-4 checkpoint (whichever Ray had registered), not from scratch.
    resumed = sorted(record.glob("resumed_params_*.npz"))
    assert len(resumed) == 1, resumed
    resumed_at = int(resumed[0].stem.rsplit("_", 1)[1])
    assert resumed_at in (2, 4)
    # The restart loaded its programs from the compilation cache that the first attempt left in the run's storage.
    first_steps = {int(p.stem.rsplit("_", 1)[1]): json.loads(p.read_text()) for p in record.glob("first_step_*.json")}
    assert sorted(first_steps) == [1, resumed_at + 1], first_steps
    assert first_steps[1]["compilation_cache_hits"] == 0
    assert first_steps[resumed_at + 1]["compilation_cache_hits"] >= 2, first_steps
    # Each attempt's first record says where it began: plots and the CLI's summary mark the resume there.
    assert [first_steps[s]["start_step"] for s in sorted(first_steps)] == [0, resumed_at], first_steps
    # Process 1 reads the entries process 0 wrote for the programs they share (JAX's CPU keys differ per process
    # without _cpu_cache_key, and then it loaded none); programs on its own devices alone are never written.
    restart_hits = first_steps[resumed_at + 1]["compilation_cache_hits_per_process"]
    assert len(restart_hits) == 2 and restart_hits[1] >= 2, first_steps
    assert any((tmp_path / "storage" / "parity" / "compilation_cache").iterdir())

    initial = dict(np.load(record / "initial_params.npz"))
    final = dict(np.load(record / "final_params.npz"))
    # fsdp=2: each device holds half of the params and of AdamW's two moments (norms and counters are tiny).
    replicated = 3 * sum(x.nbytes for x in initial.values())
    for first_step in first_steps.values():
        assert 0.49 < first_step["state_mb_per_device"] * 2**20 / replicated < 0.55, first_step
    # Each step's global batch as last trained on: the restart overwrote the steps it repeated.
    per_step = [dict(np.load(record / f"batch_{i:06d}.npz")) for i in range(1, steps + 1)]
    batches = {k: np.stack([b[k] for b in per_step]) for k in per_step[0]}
    assert batches["input_ids"].shape == (steps, 8, SEQ)
    # Scratch init inside jit on the mesh gives the model's own seeded init.
    graphdef, params = split_model(create_model(CONFIG))
    flat_eager = _flat(params)
    assert flat_eager.keys() == initial.keys()
    assert max(float(np.max(np.abs(flat_eager[k] - initial[k]))) for k in initial) < 1e-6

    optimizer, _ = make_optimizer(args, steps)
    step = jax.jit(make_train_step(graphdef, optimizer, 2))
    state = new_state(params, optimizer)
    losses = []
    for i in range(steps):
        if i == resumed_at:  # the restored params are exactly the ones the uninterrupted replay has here
            restored = dict(np.load(resumed[0]))
            assert max(float(np.max(np.abs(_flat(state["params"])[k] - restored[k]))) for k in restored) < 1e-6
        state, metrics = step(state, {k: v[i] for k, v in batches.items()})
        losses.append(float(metrics["loss"]))
    ref = _flat(state["params"])
    assert max(float(np.max(np.abs(ref[k] - final[k]))) for k in final) < 1e-5
    assert max(float(np.max(np.abs(ref[k] - initial[k]))) for k in final) > 1e-3  # it did train

    # Rank 0 logged steps 1-4 before the kill, and step 5 too where its metrics could still be read as the error
    # from the killed peer went by (its record waits for step 6's dispatch; the peer may die mid step 5); then the
    # resumed run logged from its checkpoint on. read_metrics keeps the last record of each step, the one that counts.
    lines = [json.loads(line) for line in open(os.path.join(result.path, "metrics.jsonl")) if line.strip()]
    # Each attempt marks its start, after its restore: the summary counts restarts that logged no step too.
    assert [line["attempt"]["start_step"] for line in lines if "attempt" in line] == [0, resumed_at]
    assert resumed_steps(open(os.path.join(result.path, "metrics.jsonl")).read()) == [resumed_at]
    records = [line for line in lines if "step" in line]
    before_kill = 5 if records[4]["step"] == 5 else 4
    assert [r["step"] for r in records] == list(range(1, before_kill + 1)) + list(range(resumed_at + 1, steps + 1))
    latest = {r["step"]: r for r in records}
    assert read_metrics(result.path) == [latest[i] for i in range(1, steps + 1)]
    np.testing.assert_allclose([latest[i]["loss"] for i in range(1, steps + 1)], losses, rtol=1e-5)
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 5 for r in records[1:4]), records
    if before_kill == 5:
        assert records[4]["loss"] > 0 and "tokens_per_s" not in records[4]  # written on the way out, not finished
    assert latest[steps]["learning_rate"] < latest[2]["learning_rate"]  # cosine decay after warmup
    assert result.metrics["step"] == steps
    # The exported final model is the trained one.
    _, exported_params = split_model(from_pretrained(os.path.join(result.path, "final_model")))
    assert _max_diff(exported_params, state["params"]) < 1e-5


def test_a_finished_checkpoint_ray_never_registered_resumes_at_its_data_position(ray_cluster, tmp_path):
    """With no checkpoint registered (Ray's record set aside, or a stop between a save and its registration) the loop
    adopts the newest finished one from storage: it had opened its data at the start already, so the adopted step-2
    state trained steps 3-4 on the batches of steps 1-2 (a review: 30 of 40 losses off, exit 0)."""
    import shutil

    import ray.data

    rows = packed_rows()
    dataset = ray.data.from_items([{k: rows[k][i] for k in rows} for i in range(len(rows["input_ids"]))])
    # Shuffled too: the resumed run reads the same shuffled order (a seed per epoch and process) past its skip.
    # Logged at step 3, saved at 2: the step-2 checkpoint carries step 1-2's metrics, so the resumed run's step-3
    # record covers steps 1-3 as the first run's did (it covered step 3 alone, and steps 1-2 were in no record).
    args = TrainingArguments(total_steps=4, batch_size=4, max_sequence_length=SEQ, learning_rate=1e-2, log_steps=3,
                             save_steps=2, progress_bar=False, resume_if_possible=True, save_final_model=False,
                             shuffle_buffer_size=16)

    def fit(record):
        trainer = rjt.JaxTrainer(
            train_loop_per_worker, scaling_config=ScalingConfig(num_workers=1), datasets={"train": dataset},
            train_loop_config={"arguments": args.model_dump(), "model_config": CONFIG.model_dump(), "total_steps": 4,
                               "record_dir": str(record)},
            run_config=RunConfig(name="adopt", storage_path=str(tmp_path / "storage")))
        result = trainer.fit()
        assert result.error is None, result.error
        return result

    first = fit(tmp_path / "first")
    run_dir = tmp_path / "storage" / "adopt"
    # Ray's record now names a checkpoint that is gone: set aside (Ray would refuse the run), so Ray knows none.
    for name in os.listdir(run_dir):
        if name.startswith("checkpoint_000000004"):
            shutil.rmtree(run_dir / name)
    kept = [name for name in os.listdir(run_dir) if name.startswith("checkpoint_000000002")]
    fit(tmp_path / "again")
    assert [n for n in os.listdir(run_dir) if n.startswith("checkpoint_manager_snapshot.json.broken-")]
    # The step-2 checkpoint Ray had registered outlives the new step-4 save: once adopted, it was deleted as
    # "never registered, now superseded" (a deletion-safety review: the best-scoring one with it).
    assert kept and all((run_dir / name).exists() for name in kept), os.listdir(run_dir)
    assert sorted(p.name for p in (tmp_path / "again").glob("resumed_params_*.npz")) == ["resumed_params_2.npz"]
    for step in (3, 4):  # the batches the first run trained these steps on, so the same final params
        a, b = (dict(np.load(tmp_path / run / f"batch_{step:06d}.npz")) for run in ("first", "again"))
        assert all(np.array_equal(a[k], b[k]) for k in a), step
    a, b = (dict(np.load(tmp_path / run / "final_params.npz")) for run in ("first", "again"))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    read = np.concatenate([np.load(tmp_path / "first" / f"batch_{s:06d}.npz")["input_ids"] for s in range(1, 5)])
    assert not np.array_equal(read, np.asarray(rows["input_ids"][:16])), "the shuffle left the order as it was"
    assert first.metrics["step"] == 4
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "step" in r]
    assert [r["step"] for r in records] == [3, 4, 3, 4], records
    for key in ("loss", "loss_tokens", "grad_norm", "learning_rate"):
        assert [r[key] for r in records[:2]] == [r[key] for r in records[2:]], (key, records)
    # Resumed at its end it trains nothing, and reported nothing: a Tune trial rerun so had no loss and no
    # checkpoint, and its search named another trial best (a Tune chaos review). Its last record is reported again.
    third = fit(tmp_path / "third")
    assert third.metrics["step"] == 4 and third.metrics["loss"] == first.metrics["loss"], third.metrics
    assert os.path.basename(third.metrics["checkpoint_path"]).startswith("checkpoint_000000004"), third.metrics


def test_a_loss_gone_nan_stops_the_run_before_it_is_trained_on_or_saved(ray_cluster, tmp_path, capfd):
    """A learning rate far too high makes step 2 NaN. Logged every 4 steps and saved every step, the run stops at the
    step-2 save, on both workers, naming the step and the likely causes; step 1's checkpoint stays registered and no
    NaN checkpoint is written. Before, it trained on NaN weights to the end and saved them over the good ones."""
    import ray.data
    from ray.train import CheckpointConfig, FailureConfig, Result, TrainingFailedError

    rows = packed_rows(40)
    dataset = ray.data.from_items([{k: rows[k][i] for k in rows} for i in range(len(rows["input_ids"]))])
    args = TrainingArguments(total_steps=6, batch_size=4, max_sequence_length=SEQ, learning_rate=1e10,
                             scheduler="constant", log_steps=4, save_steps=1, save_final_model=False,
                             progress_bar=False, resume_if_possible=True)
    trainer = rjt.JaxTrainer(
        train_loop_per_worker,
        train_loop_config={"arguments": args.model_dump(), "model_config": CONFIG.model_dump(), "total_steps": 6},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="nan", storage_path=str(tmp_path), checkpoint_config=CheckpointConfig(num_to_keep=1),
                             failure_config=FailureConfig(max_failures=3)),
        datasets={"train": dataset})
    # Not retried (retries are for lost workers): resumed at step 1, it would only train into the NaN again.
    with pytest.raises(TrainingFailedError, match=r"Step 2 gave loss nan") as failed:
        trainer.fit()
    assert "NonFiniteLossError" in str(failed.value) and "learning rate too high" in str(failed.value)
    saved = sorted(p.name for p in (tmp_path / "nan").glob("checkpoint_0*"))
    assert len(saved) == 1 and saved[0].startswith("checkpoint_000000001_"), saved
    # Registered with Ray (an unregistered one is deleted as an orphan by the next attempt) and finite.
    registered = Result.from_path(str(tmp_path / "nan")).checkpoint
    assert registered is not None and registered.path.endswith(saved[0]), registered
    params = rjt.checkpoint.restore(rjt.abstract_state({"params": split_model(create_model(CONFIG))[1]}),
                                    registered, partial=True).state["params"]
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
    # Ray ends a failed run's workers with SIGTERM, which the checkpointer took for a preemption: "a checkpoint will
    # be saved at the next preemption check" followed every failure. (The workers' output reaches the driver
    # asynchronously; it had long arrived by now: the restore above took seconds.)
    captured = capfd.readouterr()
    assert "SIGTERM received" not in captured.out + captured.err


@pytest.mark.parametrize("total_steps,save_steps", [(3, 1), (1, 2)], ids=["periodic-save", "final-save-and-model"])
def test_an_update_that_overflows_is_not_saved_although_its_loss_was_finite(ray_cluster, tmp_path, total_steps,
                                                                             save_steps):
    """Weight decay times a huge (float32-finite) learning rate leaves step 1's loss and gradient norm finite (they
    come before the update) and its weights infinite. The save of step 1 checks the state itself and stops; before,
    that checkpoint was written and registered as the latest, so every resume restored infinite weights. Numbers
    that cannot be float32 at all are refused with the arguments."""
    import ray.data
    from ray.train import TrainingFailedError

    rows = packed_rows(16)
    dataset = ray.data.from_items([{k: rows[k][i] for k in rows} for i in range(len(rows["input_ids"]))])
    with pytest.raises(ValueError, match="learning_rate=1e[+]39 is beyond float32's range"):
        TrainingArguments(learning_rate=1e39)
    with pytest.raises(ValueError, match="adam_epsilon=1e-45 is below float32's smallest normal"):
        TrainingArguments(adam_epsilon=1e-45)
    args = TrainingArguments(total_steps=total_steps, batch_size=4, max_sequence_length=SEQ, learning_rate=1e30,
                             weight_decay=1e12, scheduler="constant", log_steps=4, save_steps=save_steps,
                             save_final_model=True, progress_bar=False)
    trainer = rjt.JaxTrainer(
        train_loop_per_worker,
        train_loop_config={"arguments": args.model_dump(), "model_config": CONFIG.model_dump(),
                           "total_steps": total_steps},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="overflow", storage_path=str(tmp_path)), datasets={"train": dataset})
    with pytest.raises(TrainingFailedError, match=r"At step 1 the weights or optimizer state are no longer finite, "
                                                  r"although the loss and gradient norm of every step so far "
                                                  r"were") as failed:
        trainer.fit()
    assert "NonFiniteLossError" in str(failed.value)
    assert not list((tmp_path / "overflow").glob("checkpoint_0*"))
    assert not (tmp_path / "overflow" / "final_model").exists()


def test_throughput_leaves_out_a_save(monkeypatch):
    """An ops review: tokens/s swung by 2x between log intervals with a checkpoint save and those without."""
    from ray_jax_train.lm import metrics

    clock = iter([0.0, 10.0, 10.0, 16.0, 20.0, 20.0, 30.0, 30.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    meter = metrics.Throughput(flops_per_token=1.0, tokens_per_step=100, num_devices=1, peak_per_device=1.0)
    meter.start()  # 0
    meter.step()
    meter.step()
    assert meter.read()["tokens_per_s"] == pytest.approx(200 / 10.0)  # at 10, the interval reopens at 10
    meter.restart_if_just_read()  # a save at that log step ended at 16: the next interval opens there
    meter.step()
    assert meter.read()["tokens_per_s"] == pytest.approx(100 / 4.0)  # at 20, reopened at 20
    meter.step()
    meter.restart_if_just_read()  # a save between log steps stays in: a step ran since the read
    assert meter.read()["tokens_per_s"] == pytest.approx(100 / 10.0)  # at 30


def test_a_measured_peak_is_taken_once_where_asked_and_the_interval_reopens(monkeypatch):
    """A review: with log steps finished after the next step's dispatch, the first read would time the CPU's peak
    matmul beside a running step (peak low, every MFU high); the loop measures it at the first step's sync."""
    from ray_jax_train.lm import metrics

    clock = iter([0.0, 5.0, 9.0, 9.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    calls = []
    meter = metrics.Throughput(flops_per_token=1.0, tokens_per_step=100, num_devices=2,
                               peak_per_device=lambda: calls.append(1) or 50.0)
    meter.start()  # 0
    meter.measure_peak()  # took until 5: the interval reopens there
    meter.step()
    read = meter.read()  # at 9
    assert read["tokens_per_s"] == pytest.approx(100 / 4.0) and read["mfu"] == pytest.approx(25.0 / 100.0)
    meter.measure_peak()
    assert calls == [1] and meter.peak == 100.0


def test_a_log_step_cut_off_by_a_failure_is_still_written():
    """A log step's record is finished after the next step's dispatch; a failure in between (the data iterator,
    the dispatch) still leaves it in metrics.jsonl, without reporting it."""
    from ray_jax_train.lm.loop import _to_host_soon, _write_unfinished
    from ray_jax_train.lm.step import make_schedule

    pending = [{"loss": jnp.float32(2.0), "grad_norm": jnp.float32(1.0), "tokens": jnp.float32(10.0)},
               {"loss": jnp.float32(4.0), "grad_norm": jnp.float32(3.0), "tokens": jnp.float32(30.0)}]
    entry = {"record": {"step": 8, "epoch": 0}, "due_eval": False, "stacked": _to_host_soon(pending)}
    schedule = make_schedule(rjt.lm.TrainingArguments(learning_rate=1e-3, warmup_steps=0, scheduler="constant"), 10)
    lines = []
    out = type("MetricsFile", (), {"append": lambda self, line: lines.append(line)})()
    _write_unfinished(entry, out, schedule)
    _write_unfinished({"record": {"step": 9}, "stacked": {"loss": "not an array"}}, out, schedule)  # logged, not raised
    records = [json.loads(line) for line in lines]
    assert len(records) == 1 and records[0]["step"] == 8
    assert records[0]["loss"] == pytest.approx((2.0 * 10 + 4.0 * 30) / 40) and records[0]["grad_norm"] == 3.0
    assert records[0]["learning_rate"] == pytest.approx(1e-3)


def test_epoch_batches_resume_at_an_epoch_end_and_reject_empty_data():
    """A checkpoint taken on an epoch's last batch resumes at the next epoch's first; an epoch that yields nothing
    from its start is the only error."""
    from ray_jax_train.lm.loop import epoch_batches

    def open_epoch(epoch, skip):  # 3 batches an epoch, named by (epoch, index)
        return iter([(epoch, i) for i in range(3)][skip:])

    def take(n, epoch, skip):
        return list(itertools.islice(epoch_batches(open_epoch, epoch, skip, batch_size=8), n))

    assert take(4, 0, 0) == [(0, 1, (0, 0)), (0, 2, (0, 1)), (0, 3, (0, 2)), (1, 1, (1, 0))]
    assert take(2, 1, 3) == [(2, 1, (2, 0)), (2, 2, (2, 1))]  # saved at epoch 1's end
    assert take(2, 1, 2) == [(1, 3, (1, 2)), (2, 1, (2, 0))]
    with pytest.raises(RuntimeError, match="Epoch 0 yielded no full global batch of 8 rows"):
        list(itertools.islice(epoch_batches(lambda e, s: iter(()), 0, 0, 8), 1))
    with pytest.raises(RuntimeError, match="Epoch 2 yielded no full global batch"):  # data gone after a resume
        list(itertools.islice(epoch_batches(lambda e, s: iter(([1] if e < 2 else [])[s:]), 1, 1, 8), 1))


def test_a_resume_with_another_batch_size_skips_the_rows_trained_on(caplog):
    """The saved position counts batches: read with a new batch_size as it was, 10 batches of 4 rows skipped 80
    rows where 40 were trained on."""
    from ray_jax_train.lm.loop import resume_position

    assert resume_position({"epoch": 1, "batch": 10, "batch_size": 4}, 4) == {"epoch": 1, "batch": 10}
    assert resume_position({"epoch": 1, "batch": 10}, 8) == {"epoch": 1, "batch": 10}  # saved before sizes were
    with caplog.at_level(logging.WARNING, logger="ray_jax_train.lm.loop"):
        assert resume_position({"epoch": 1, "batch": 10, "batch_size": 4}, 8) == {"epoch": 1, "batch": 5}
        assert resume_position({"epoch": 0, "batch": 5, "batch_size": 4}, 8) == {"epoch": 0, "batch": 2}
        assert resume_position({"epoch": 0, "batch": 3, "batch_size": 8}, 4) == {"epoch": 0, "batch": 6}
    assert "skipping the 20 rows of epoch 0 it had trained on (4 of them are trained on again" in caplog.text


def test_loop_without_total_steps_fails_clearly():
    # Checked before the loop touches Ray or JAX, so calling it directly shows what a worker would raise.
    args = TrainingArguments(batch_size=2, max_sequence_length=SEQ, num_epochs=1)
    with pytest.raises(ValueError, match="needs total_steps"):
        train_loop_per_worker({"arguments": args.model_dump(), "model_config": CONFIG.model_dump()})


def test_bf16_params_keep_one_state_layout_with_float32_moments():
    """bf16 weights: the optimizer moments start and stay float32, so every step takes and returns the same
    types and the donated step compiles once."""
    config = CONFIG.model_copy(update={"dtype": "bfloat16", "param_dtype": "bfloat16"})
    graphdef, params = split_model(create_model(config))
    optimizer, _ = make_optimizer(TrainingArguments(total_steps=2, batch_size=4, learning_rate=1e-2), 2)
    state = new_state(params, optimizer)
    types = jax.tree.map(lambda x: x.dtype, state)
    assert {x.dtype for x in jax.tree.leaves(state["opt_state"]) if x.ndim} == {jnp.dtype(jnp.float32)}
    step = jax.jit(make_train_step(graphdef, optimizer), donate_argnums=0)
    rows = {k: v[:4] for k, v in packed_rows().items()}
    for _ in range(2):
        state, metrics = step(state, rows)
        assert jax.tree.map(lambda x: x.dtype, state) == types
    assert step._cache_size() == 1
    assert np.isfinite(float(metrics["loss"]))


def test_bf16_compute_keeps_float32_master_weights():
    from ray_jax_train.lm.distributed_trainer import RayDistributedTrainer

    trainer = RayDistributedTrainer(config_variables={"vocab_size": VOCAB, "num_hidden_layers": 1},
                                    config_scaling_variables={"hidden_size": 32, "intermediate_size": 64,
                                                              "num_attention_heads": 2, "num_key_value_heads": 1})
    args = TrainingArguments(total_steps=2, batch_size=4, max_sequence_length=SEQ, dtype="bf16", param_dtype="float32",
                             learning_rate=1e-2)
    config = trainer._train_config(1, args, None)
    assert (config.dtype, config.param_dtype) == ("bfloat16", "float32")
    graphdef, params = split_model(create_model(config))
    optimizer, _ = make_optimizer(args, 2)
    state = new_state(params, optimizer)
    rows = {k: v[:4] for k, v in packed_rows().items()}
    step = jax.jit(make_train_step(graphdef, optimizer))
    state, first = step(state, rows)
    state, second = step(state, rows)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state["params"]))
    assert np.isfinite(float(second["loss"])) and float(second["loss"]) < float(first["loss"])
    assert _max_diff(state["params"], params) > 1e-3


def test_the_step_hands_the_state_back_sharded_as_it_came_in():
    from ray_jax_train.lm import state as state_lib
    from ray_jax_train.lm.step import jit_train_step

    # Micro-batches of 2 rows over 4 fsdp shards (the driver refuses this for the built-in loop; a hand-written
    # loop calling the step can still run it): before, XLA gave the norm weights and their moments back
    # fsdp-sharded, so the second step compiled again and could not reuse the donated buffers.
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    rows = {k: np.minimum(v[:4], 63) for k, v in packed_rows().items()}
    mesh = rjt.make_mesh({"fsdp": 4})
    batch = {k: jax.device_put(v, NamedSharding(mesh, PartitionSpec("fsdp"))) for k, v in rows.items()}
    args = TrainingArguments(total_steps=3, batch_size=4, gradient_accumulation_steps=2, max_sequence_length=SEQ)
    optimizer, _ = make_optimizer(args, 3)
    graphdef, params = split_model(create_model(config))
    shardings = state_lib.state_shardings(jax.eval_shape(lambda p: new_state(p, optimizer), params), mesh)
    state = jax.jit(lambda p: new_state(p, optimizer), out_shardings=shardings)(params)
    step = jit_train_step(graphdef, optimizer, 2, shardings, mesh)
    with jax.set_mesh(mesh):
        for _ in range(3):
            state, _ = step(state, batch)
    expected = dict(jax.tree_util.tree_leaves_with_path(shardings))
    changed = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(state)
               if not x.sharding.is_equivalent_to(expected[p], x.ndim)]
    assert not changed, changed
    assert step._cache_size() == 1


def test_mesh_axes_the_loop_cannot_use_are_refused():
    # An axis the partition rules never name would give its devices the same work (e.g. 'model' for 'tp').
    with pytest.raises(ValueError, match="mesh axis 'model'=4 is not one the built-in Llama loop splits over"):
        TrainingArguments(total_steps=1, mesh={"dp": 2, "model": 4})
    TrainingArguments(total_steps=1, mesh={"dp": 1, "fsdp": -1, "ep": 1, "tp": 1})  # size 1: harmless
    args = TrainingArguments(total_steps=1, batch_size=8, max_sequence_length=6, mesh={"fsdp": -1, "sp": 4})
    with pytest.raises(ValueError, match="max_sequence_length=6 does not split over mesh axis 'sp'=4"):
        args.check_devices(8)  # the activation constraint would silently drop sp


def test_the_loop_takes_its_mesh_from_jax_config_and_refuses_what_it_cannot_honour(ray_cluster, tmp_path):
    """A hand-built JaxTrainer around the built-in loop: JaxConfig's mesh and dcn_mesh reach it (dp across the two
    processes, fsdp within each, where a plain mesh of these axes would put fsdp across them), the state is split
    over fsdp, and settings the loop cannot honour fail naming the fix instead of training something else."""
    import ray.data
    from ray.train import TrainingFailedError

    from ray_jax_train.backend import _state as backend_state
    from ray_jax_train.lm.loop import _loop_mesh

    record = tmp_path / "record"
    rows = packed_rows(40)
    dataset = ray.data.from_items([{k: rows[k][i] for k in rows} for i in range(len(rows["input_ids"]))])
    args = TrainingArguments(total_steps=2, batch_size=8, max_sequence_length=SEQ, log_steps=1, save_final_model=False,
                             progress_bar=False, resume_if_possible=False)
    loop_config = {"arguments": args.model_dump(), "model_config": CONFIG.model_dump(), "total_steps": 2,
                   "record_dir": str(record)}

    def fit(jax_config, name):
        return rjt.JaxTrainer(train_loop_per_worker, train_loop_config=loop_config,
                              scaling_config=ScalingConfig(num_workers=2), jax_config=jax_config,
                              run_config=RunConfig(name=name, storage_path=str(tmp_path / "storage")),
                              datasets={"train": dataset}).fit()

    result = fit(rjt.JaxConfig(num_cpu_devices=2, mesh={"fsdp": 2, "dp": 2}, dcn_mesh={"dp": 2}), "hybrid")
    assert result.error is None, result.error
    mesh = json.loads((record / "mesh.json").read_text())
    assert mesh["shape"] == {"fsdp": 2, "dp": 2}
    assert mesh["processes"] == [[0, 1], [0, 1]]  # rows are fsdp, columns dp: each process is one dp column
    replicated = 3 * sum(x.nbytes for x in np.load(record / "initial_params.npz").values())
    first_step = json.loads(next(record.glob("first_step_*.json")).read_text())
    assert 0.49 < first_step["state_mb_per_device"] * 2**20 / replicated < 0.55, first_step

    with pytest.raises(TrainingFailedError, match=r"distributed=False\) makes each of the 2 workers a JAX job"):
        fit(rjt.JaxConfig(distributed=False), "separate")

    # Two meshes that disagree (checked in the worker: the driver knows only TrainingArguments.mesh).
    saved = backend_state.config
    try:
        backend_state.config = rjt.JaxConfig(mesh={"dp": 1, "fsdp": -1})
        with pytest.raises(ValueError, match=r"TrainingArguments\(mesh=\{'dp': -1\}\) and JaxConfig\(mesh="):
            _loop_mesh(args.model_copy(update={"mesh": {"dp": -1}}))
        assert dict(_loop_mesh(args).shape) == {"dp": 1, "fsdp": 4}
        with pytest.raises(ValueError, match="disagree"):  # the same sizes in another order split other devices
            _loop_mesh(args.model_copy(update={"mesh": {"fsdp": -1, "dp": 1}}))
        backend_state.config = rjt.JaxConfig(mesh={"dp": 2, "model": 2})
        with pytest.raises(ValueError, match="mesh axis 'model'=2 is not one the built-in Llama loop splits over"):
            _loop_mesh(args)
    finally:
        backend_state.config = saved


@pytest.mark.parametrize("accumulation", [1, 2])
def test_gradients_summed_in_one_flat_all_reduce_equal_xla_s_reduction(accumulation):
    """The CPU data-parallel step that sums its gradients itself, in one buffer, trains exactly like the step XLA
    partitions (4 devices here; across processes that one buffer is one gloo call instead of one per array)."""
    from ray_jax_train.lm.step import one_all_reduce_axes

    rows = {k: v[:8] for k, v in packed_rows().items()}
    mesh = rjt.make_mesh({"dp": 4})
    batch = {k: jax.device_put(v, NamedSharding(mesh, PartitionSpec("dp"))) for k, v in rows.items()}
    args = TrainingArguments(total_steps=3, batch_size=8, gradient_accumulation_steps=accumulation,
                             max_sequence_length=SEQ, learning_rate=1e-2, adam_epsilon=1e-4)
    optimizer, _ = make_optimizer(args, 3)
    graphdef, params = split_model(create_model(CONFIG))
    results = {}
    for axes in ((), ("dp",)):
        state = shard_state(new_state(params, optimizer), mesh)
        step = jax.jit(make_train_step(graphdef, optimizer, accumulation, one_all_reduce_over=axes))
        with jax.set_mesh(mesh):
            if axes:
                hlo = step.lower(state, batch).compile().as_text()
                reduces = [line for line in hlo.splitlines() if " all-reduce(" in line or " all-reduce-start(" in line]
                assert len(reduces) == 1 and reduces[0].split("=")[1].strip().startswith("f32["), reduces
            losses = []
            for _ in range(3):
                state, metrics = step(state, batch)
                losses.append(float(metrics["loss"]))
        results[axes] = (state["params"], losses)
    np.testing.assert_allclose(results[()][1], results[("dp",)][1], rtol=1e-6)
    assert _max_diff(results[()][0], results[("dp",)][0]) < 1e-6
    assert _max_diff(results[()][0], params) > 1e-3  # it trained
    # One process: XLA's in-process reduction is a copy, so the step is left to XLA.
    assert one_all_reduce_axes(mesh, jax.tree.map(lambda x: x.sharding, state)) == ()


def test_step_profiler_window_resume_and_a_trace_already_running(tmp_path, caplog):
    """No Ray: which steps a StepProfiler traces, that a resumed run never traces its compiling step, and that a
    trace the user already runs is neither broken into nor stopped (the loop trains on, untraced)."""
    from ray_jax_train.lm.profiling import StepProfiler

    add = jax.jit(lambda x: x + 1)
    profiler = StepProfiler(2, 2, str(tmp_path / "profile"), rank=1)
    x = jnp.zeros(4)
    for step in range(1, 6):
        profiler.before_step(step)
        x = add(x)
        profiler.after_step(step, x)
    profiler.stop()
    traces = list((tmp_path / "profile" / "worker_1").rglob("*.xplane.pb"))
    assert len(traces) == 1
    events = [e.name for plane in jax.profiler.ProfileData.from_file(str(traces[0])).planes
              for line in plane.lines for e in line.events]
    assert events.count("train") == 2  # steps 2 and 3, not 1, 4 or 5

    for resumed_after, kept in ((3, False), (4, False), (2, True), (0, True)):  # window 4-5
        p = StepProfiler(4, 2, str(tmp_path / "resumed"))
        p.skip_resumed(resumed_after)
        assert (p.start_step == 4) is kept, resumed_after  # resumed after 3: step 4 compiles

    jax.profiler.start_trace(str(tmp_path / "users_own"))
    try:
        theirs = StepProfiler(1, 1, str(tmp_path / "ours"))
        theirs.before_step(1)  # cannot start a second trace: logged, not raised
        theirs.after_step(1, add(x))
        theirs.stop()
        assert theirs.start_step is None and "Could not start the profile" in caplog.text
    finally:
        jax.profiler.stop_trace()  # still running: ours did not stop it (this would raise otherwise)


def test_data_with_no_token_to_learn_stops_the_run_and_its_retries(ray_cluster, tmp_path):
    """Chat data with no assistant turn (or rows whose loss_mask is all 0) trained "successfully" before: loss and
    grad norm 0 at every step, weights unchanged, exit 0."""
    import ray.data
    from ray.train import FailureConfig, TrainingFailedError

    rows = packed_rows(16)
    rows["loss_mask"] = np.zeros_like(rows["loss_mask"])
    dataset = ray.data.from_items([{k: rows[k][i] for k in rows} for i in range(len(rows["input_ids"]))])
    args = TrainingArguments(total_steps=6, batch_size=4, max_sequence_length=SEQ, log_steps=2,
                             save_final_model=False, progress_bar=False)
    trainer = rjt.JaxTrainer(
        train_loop_per_worker,
        train_loop_config={"arguments": args.model_dump(), "model_config": CONFIG.model_dump(), "total_steps": 6},
        scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(name="nothing", storage_path=str(tmp_path), failure_config=FailureConfig(max_failures=1)),
        datasets={"train": dataset})
    # Checked once 20 steps (or all of a shorter run) have trained, and not retried: a retry would repeat it.
    with pytest.raises(TrainingFailedError, match=r"No token of the 6 steps trained so far counted for the "
                                                  r"loss") as failed:
        trainer.fit()
    assert "NoLossTokensError" in str(failed.value)
    records = [json.loads(line) for line in (tmp_path / "nothing" / "metrics.jsonl").read_text().splitlines()]
    assert [r["attempt"]["start_step"] for r in records if "attempt" in r] == [0]
    records = [r for r in records if "step" in r]
    # One attempt's records: a retry (from scratch: no checkpoint) would have logged steps 2 and 4 again.
    assert [r["step"] for r in records] == [2, 4] and {r["loss_tokens"] for r in records} == {0.0}
    # Where the driver holds the rows anyway (materialized, as the CLI and Tune trials do), it says so at once.
    from ray_jax_train.lm import NoLossTokensError
    from ray_jax_train.lm.data import prepare_lm_datasets

    with pytest.raises(NoLossTokensError, match="data.source: no token of any row counts for the loss"):
        prepare_lm_datasets(dataset, None, None, args, materialize=True, names=("data.source", "data.eval_source"))
    rows["loss_mask"][-1, -1] = 1  # one token to learn is enough to pass
    one = ray.data.from_items([{k: rows[k][i] for k in rows} for i in range(len(rows["input_ids"]))])
    prepare_lm_datasets(one, None, None, args, materialize=True)


def test_the_eval_set_is_read_once_and_kept_while_small():
    """Every eval read its set again, a Ray Data execution each time, and each left about 1 MB for good in Ray's
    stats actor and dashboard agent (a soak review). The batches are kept after the first read, up to a size per
    device; a set over it, or a read cut short by an error, is read again."""
    import jax.numpy as jnp

    from ray_jax_train.lm.loop import EvalBatches

    opened = []

    def open_batches(n=5):
        opened.append(1)
        return ({"ids": jnp.full((4, 8), i, jnp.int32)} for i in range(n))  # closable, as iter_jax_batches is

    kept = EvalBatches(open_batches, max_steps=3)
    first = [int(b["ids"][0, 0]) for b in kept()]
    assert first == [0, 1, 2] and [int(b["ids"][0, 0]) for b in kept()] == first and len(opened) == 1
    # 128 bytes a batch, 640 the set, on one device; the limit is per device, the same in every process.
    too_big = EvalBatches(open_batches, max_bytes=600)
    assert len(list(too_big())) == 5 and len(list(too_big())) == 5 and len(opened) == 3
    fits = EvalBatches(open_batches, max_bytes=640)
    assert len(list(fits())) == 5 and len(list(fits())) == 5 and len(opened) == 4
    cut = EvalBatches(open_batches)
    for _ in zip(range(2), cut()):  # the pass ends early (an eval step raised, say): nothing half kept
        pass
    assert len(list(cut())) == 5 and len(opened) == 6 and len(list(cut())) == 5 and len(opened) == 6
    # On a tp mesh a batch is whole on every device: 4 devices hold 512 bytes each of a 512-byte set, not 128.
    whole = NamedSharding(rjt.make_mesh({"dp": 1, "tp": 4}), PartitionSpec())
    replicated = EvalBatches(lambda: ({"ids": jax.device_put(jnp.zeros((4, 8), jnp.int32), whole)} for _ in range(4)),
                             max_bytes=500)
    assert len(list(replicated())) == 4 and replicated._kept is None


def test_workers_get_the_tokenizer_as_files_that_need_no_transformers(tmp_path):
    """Unpickling the tokenizer object imported transformers in rank 0 of every run (about 4 s of a CPU); the
    files its save_pretrained writes load back as the same tokenizer, and their object unpickles without it."""
    import pickle
    import subprocess
    import sys

    from ray_jax_train.lm.loop import TokenizerFiles
    from ray_jax_train.text import load_tokenizer, train_tokenizer

    tokenizer = train_tokenizer([f"doc {i}: the quick brown fox" for i in range(50)], vocab_size=300)
    files = TokenizerFiles.of(tokenizer)
    assert TokenizerFiles.of(files) is files and "tokenizer.json" in files.files
    probe = ("import pickle, sys; files = pickle.loads(sys.stdin.buffer.read()); files.save_pretrained(sys.argv[1]); "
             "assert 'transformers' not in sys.modules, 'transformers imported'")
    done = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], input=pickle.dumps(files),
                          capture_output=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    again = load_tokenizer(str(tmp_path))
    text = "<|user|>the quick doc 7<|eos|>"
    assert again(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert again.chat_template == tokenizer.chat_template and len(again) == len(tokenizer)
