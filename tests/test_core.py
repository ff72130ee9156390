"""The core: real Ray workers forming one jax.distributed job on CPU, meshes, and sharded Ray Data batches."""
import json
import logging
import os
import sys
import time
import warnings

import numpy as np
import pytest
from jax.sharding import PartitionSpec
from ray.train import RunConfig, ScalingConfig

import ray_jax_train as rjt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import mlp_data_parallel as example  # noqa: E402


def _fit(loop, tmp_path, config=None, num_workers=2, jax_config=None, datasets=None):
    trainer = rjt.JaxTrainer(
        loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=num_workers),
        jax_config=jax_config,
        run_config=RunConfig(storage_path=str(tmp_path / "storage")),
        datasets=datasets,
    )
    return trainer.fit()


def _collectives_and_batches(config):
    """Runs in each worker: checks the distributed job and records what the data path yields."""
    import jax
    import jax.numpy as jnp
    import ray.data
    from jax.sharding import NamedSharding, PartitionSpec as P

    import ray_jax_train as rjt

    out = {"process_count": jax.process_count(), "device_count": jax.device_count(),
           "local_device_count": jax.local_device_count(),
           "compilation_cache_on": bool(jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir),
           "cores": sorted(os.sched_getaffinity(0))}  # read in the training thread, where XLA's threads start
    # A loop written for Ray's JaxTrainer (which sets nothing up on CPU) joins the job itself: answered as done,
    # or refused naming the fix when it asks for another job (JAX said "must be called before any JAX calls").
    jax.distributed.initialize()
    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("ray_jax_train.backend").addHandler(handler)
    jax.distributed.initialize("ignored:1234", num_processes=2, process_id=jax.process_index())
    out["coordinator_warning"] = [m for m in warned if "'ignored:1234'" in m and "is ignored" in m]
    try:
        jax.distributed.initialize(num_processes=3)
    except RuntimeError as exc:
        out["second_initialize_error"] = str(exc)
    mesh = rjt.make_mesh({"dp": 2, "tp": -1})
    # A cross-process reduction inside jit: each process contributes (rank + 1) on each local device.
    x = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P(("dp", "tp"))), np.full((jax.local_device_count(),), jax.process_index() + 1.0))
    out["psum"] = float(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x))

    # Batches from the trainer's shard: global batch of 8 over dp=2, tp replicated.
    shapes, rows = [], []
    for batch in rjt.iter_jax_batches("train", batch_size=8, mesh=mesh, columns=["id"]):
        shapes.append(list(batch["id"].shape))
        rows.append(sorted(int(v) for v in np.asarray(batch["id"].addressable_data(0))))
        out["spec"] = str(batch["id"].sharding.spec)
    out["shapes"], out["local_rows"] = shapes, rows

    # Uneven per-worker data (rank 0 has 10 rows, rank 1 has 23): equal batch counts in both modes.
    uneven = ray.data.range(10 + 13 * jax.process_index())
    out["drop_batches"] = sum(1 for _ in rjt.iter_jax_batches(uneven, batch_size=8, mesh=mesh))
    padded = list(rjt.iter_jax_batches(uneven, batch_size=8, mesh=mesh, remainder="pad"))
    out["pad_batches"] = len(padded)
    out["pad_valid_rows"] = int(sum(np.asarray(b["valid"].addressable_data(0)).sum() for b in padded))
    try:
        rjt.iter_jax_batches("valid", batch_size=8, mesh=mesh)
    except ValueError as exc:
        out["unknown_dataset_error"] = str(exc)
    # The batch-count agreement deletes a round's keys once every process is past it, so the coordinator's store
    # keeps about one round per iterator, not one per batch of the run: 17 rounds here leave at most 3 keys.
    from jax._src import distributed

    out["batches_of_64"] = sum(1 for _ in rjt.iter_jax_batches(ray.data.range(64), batch_size=8, mesh=mesh,
                                                               sync_window=1))
    out["kv_batch_keys"] = len(distributed.global_state.client.key_value_dir_get("ray_jax_train/batches/"))
    # Exact-resume batches need the same rows on every worker: per-worker rows are refused, not mixed.
    try:
        rjt.ResumableBatches({"id": np.arange(16) + jax.process_index()}, batch_size=8, mesh=mesh)
    except ValueError as exc:
        out["resumable_error"] = str(exc)
    with open(os.path.join(config["out"], f"rank{jax.process_index()}.json"), "w") as f:
        json.dump(out, f)


def _actors_started(class_name: str) -> int:
    """How many actors of the class this cluster started, dead ones included."""
    import ray._private.state

    return sum(a.get("ActorClassName") == class_name for a in ray._private.state.actors().values())


def _placement_group_cleaners() -> int:
    return _actors_started("PlacementGroupCleaner")


def test_two_cpu_workers_form_one_jax_job(ray_cluster, tmp_path):
    import ray.data

    out = tmp_path / "out"
    out.mkdir()
    cleaners, managers = _placement_group_cleaners(), _actors_started("DatasetManager")
    watchers = _actors_started("PreemptionWatcher")
    result = _fit(_collectives_and_batches, tmp_path, config={"out": str(out)},
                  jax_config=rjt.JaxConfig(num_cpu_devices=2, compilation_cache=False, cpu_affinity=True),
                  datasets={"train": ray.data.range(32)})
    assert result.error is None
    assert _actors_started("DatasetManager") == managers + 1  # Ray Train's, which hands out the shards
    # This cluster has no dashboard, so Ray Train's placement-group cleaner could only fail its State API query
    # (and log a warning) every second: none is started.
    assert _placement_group_cleaners() == cleaners
    # This process started this one-node Ray: no drain notice can come, so Train's preemption watcher (an actor
    # per worker group) is not started either; a cluster from `ray start` keeps it (test_multinode.py).
    assert _actors_started("PreemptionWatcher") == watchers
    assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in os.environ  # set for the run only
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for info in ranks:
        # Off, although the workers inherit this session's JAX_COMPILATION_CACHE_DIR (see conftest.py).
        assert info["compilation_cache_on"] is False
        assert info["process_count"] == 2
        assert info["device_count"] == 4 and info["local_device_count"] == 2
        assert info["psum"] == 2 * 1.0 + 2 * 2.0
        assert info["spec"] == str(PartitionSpec("dp"))
        assert all(shape == [8] for shape in info["shapes"])
        assert all(len(r) == 4 for r in info["local_rows"])  # each process feeds half the global batch
        # 10 and 23 rows at 4 rows per process per batch: drop keeps min(2, 5) batches, pad yields max(3, 6).
        assert info["drop_batches"] == 2
        assert info["pad_batches"] == 6
        assert info["batches_of_64"] == 16 and info["kv_batch_keys"] <= 4 * 3, info  # 4 iterators
    assert "No dataset named 'valid'" in ranks[0]["unknown_dataset_error"]
    assert "it was given ['train']" in ranks[0]["unknown_dataset_error"]  # the names that were passed, listed
    assert all("initialize(num_processes=3) in a worker" in info["second_initialize_error"] and
               "JaxConfig(distributed=False)" in info["second_initialize_error"] for info in ranks), ranks
    assert all(len(info["coordinator_warning"]) == 1 for info in ranks), ranks
    assert all("the workers hold different rows" in info.get("resumable_error", "") for info in ranks), ranks
    assert ranks[0]["pad_valid_rows"] == 10 and ranks[1]["pad_valid_rows"] == 23
    # cpu_affinity: a core of its own for each worker (1 CPU each), on this machine of 2 or more cores.
    assert len(ranks[0]["cores"]) == len(ranks[1]["cores"]) == 1
    assert ranks[0]["cores"] != ranks[1]["cores"], ranks
    # Every row of the 32-row dataset is seen exactly once across both workers.
    seen = sorted(v for info in ranks for batch in info["local_rows"] for v in batch)
    assert seen == list(range(32))
    assert len(ranks[0]["shapes"]) == len(ranks[1]["shapes"]) == 4


def _reference_run(ids: np.ndarray, steps: int, learning_rate: float):
    """The example's step in this one process, on the same global batches the workers saw."""
    import jax

    optimizer = example.make_optimizer(learning_rate)
    params = jax.tree.map(jax.numpy.asarray, example.init_params(0))
    opt_state = optimizer.init(params)
    step_fn = jax.jit(example.make_train_step(optimizer))
    losses = []
    for i in range(steps):
        batch = example.make_rows({"id": ids[i]})
        params, opt_state, loss = step_fn(params, opt_state, batch["x"], batch["y"])
        losses.append(float(loss))
    return params, losses


def test_example_two_workers_match_single_process(ray_cluster, tmp_path):
    steps, lr = 40, 3e-3
    record = tmp_path / "record"
    config = {"steps": steps, "batch_size": 32, "learning_rate": lr, "record_dir": str(record), "log_every": 10,
              "record_ids": True}
    result = _fit(example.train_loop_per_worker, tmp_path, config=config,
                  datasets={"train": example.make_dataset(4096)})
    assert result.error is None
    run = json.loads((record / "run.json").read_text())
    assert run["process_count"] == 2
    losses = run["losses"]
    assert losses[-1] < 0.7 * losses[0], losses  # the loss falls
    # No checkpoint was saved: Ray V2 alone returns metrics None; ours are the last report's.
    assert result.checkpoint is None and result.metrics == {"loss": losses[-1], "step": steps}

    ids = np.load(record / "ids.npy")
    assert ids.shape == (steps, 32)
    assert len(set(ids.ravel().tolist())) == steps * 32  # one epoch, no row repeated
    ref_params, ref_losses = _reference_run(ids, steps, lr)
    got = np.load(record / "params.npz")
    for i, layer in enumerate(ref_params):
        for key, value in layer.items():
            np.testing.assert_allclose(got[f"{i}_{key}"], np.asarray(value), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(losses[-1], ref_losses[-1], rtol=1e-5)


def _reports_three_steps(config):
    import numpy as np
    import ray.train

    for step in (1, 2, 3):
        ray.train.report({"step": step, "loss": np.float32(4.0 - step), "note": "mine"})


def test_a_loop_of_your_own_gets_a_metrics_file_that_plot_reads(ray_cluster, tmp_path):
    """A persona review: Ray V2's metrics_dataframe held only the reports with a checkpoint, and only the built-in
    loop wrote metrics.jsonl; the opt-in callback writes every report there for a loop of one's own."""
    from ray_jax_train.plot import MetricsFileCallback, plot_run, read_records

    trainer = rjt.JaxTrainer(_reports_three_steps, scaling_config=ScalingConfig(num_workers=1),
                             run_config=RunConfig(name="own", storage_path=str(tmp_path),
                                                  callbacks=[MetricsFileCallback()]))
    assert trainer.fit().error is None
    records = read_records(str(tmp_path / "own"))
    assert [(r["step"], r["loss"], r["note"]) for r in records] == [(1, 3.0, "mine"), (2, 2.0, "mine"),
                                                                   (3, 1.0, "mine")]
    assert os.path.exists(plot_run(str(tmp_path / "own")))


def test_iter_jax_batches_reads_at_once_and_stops_when_dropped(ray_cluster):
    """The read starts when the iterator is made (so a loop can overlap it with compiling), and an iterator
    dropped before its first batch does not leave its reader thread behind."""
    import gc
    import threading

    import ray.data

    def readers():
        return {t for t in threading.enumerate() if t.name == "ray_jax_train-prefetch"}

    mesh = rjt.make_mesh({"dp": -1})
    before = readers()
    batches = rjt.iter_jax_batches(ray.data.range(64), batch_size=8, mesh=mesh)
    started = readers() - before
    assert len(started) == 1, "no reader thread before the first next()"
    (thread,) = started
    del batches
    gc.collect()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the reader of a dropped iterator kept running"

    ids = [np.asarray(b["id"]) for b in rjt.iter_jax_batches(ray.data.range(64), batch_size=8, mesh=mesh)]
    assert sorted(np.concatenate(ids).tolist()) == list(range(64))
    # Two passes over one Dataset at once (an eval mid-epoch, a zip) both run to the end: only a trainer shard's
    # epochs, which Ray runs one at a time, end an earlier one (a review: the first gave 3 of 16 batches).
    data = ray.data.range(64)
    assert sum(1 for _ in zip(rjt.iter_jax_batches(data, batch_size=8, mesh=mesh),
                              rjt.iter_jax_batches(data, batch_size=8, mesh=mesh))) == 8

    # A consumer that stops while the reader, done reading, waits to hand over the end of the data behind a full
    # buffer (an eval cut short by max_eval_steps): the reader goes too, instead of waiting forever.
    before = readers()
    batches = rjt.iter_jax_batches(ray.data.range(32), batch_size=8, mesh=mesh, prefetch=2)
    (thread,) = readers() - before
    next(batches), next(batches)
    time.sleep(3)  # the last 2 of 4 batches fill the buffer; the end-of-data marker waits behind them
    batches.close()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the reader of an iterator closed after the data ended kept running"


def _epochs_cut_short(config):
    import gc

    counts = []
    for _ in range(4):  # an eval capped at max_eval_steps, every few steps: 2 of 3 runs of a 200-step job died
        batches = rjt.iter_jax_batches("train", batch_size=4, mesh=rjt.get_mesh())
        next(batches)
    abandoned = rjt.iter_jax_batches("train", batch_size=4, mesh=rjt.get_mesh())
    next(abandoned)
    batches = rjt.iter_jax_batches("train", batch_size=4, mesh=rjt.get_mesh())
    time.sleep(1)  # the next epoch has begun
    del abandoned  # closed after the next epoch began: Ray ended that next epoch instead
    gc.collect()
    counts.append(sum(1 for _ in batches))
    counts.append(sum(1 for _ in rjt.iter_jax_batches("train", batch_size=4, mesh=rjt.get_mesh())))
    with open(os.path.join(config["out"], "counts.json"), "w") as f:
        json.dump(counts, f)


def test_an_epoch_cut_short_ends_before_the_next_one_opens(ray_cluster, tmp_path):
    """Ray's split iterator ends an epoch when its reader closes, taking the epoch from the iterator object; an
    epoch abandoned by an early break and closed late ended the next one, which gave no batch ("The eval dataset
    gave no batch" after dozens of good evals)."""
    import ray.data

    result = _fit(_epochs_cut_short, tmp_path, {"out": str(tmp_path)}, num_workers=1,
                  datasets={"train": ray.data.range(4096, override_num_blocks=64)})
    assert result.error is None, result.error
    assert json.loads((tmp_path / "counts.json").read_text()) == [1024, 1024]


def test_a_short_read_first_does_not_end_the_epoch():
    """Ray Data's prefetch threads can hand over a read's short tail before the full reads (seen with 2 workers:
    reads of [5, 1024] rows). Steps are cut to exactly `rows`; only the stream's last piece may be short, because
    the multi-process agreement reads a short piece as the end of the data (it ended whole epochs at once)."""
    from ray_jax_train.data import _split_rows

    def reads(*bounds):
        return [{"id": np.arange(a, b), "twice": 2 * np.arange(a, b)} for a, b in bounds]

    pieces = list(_split_rows(reads((0, 5), (5, 21), (21, 21), (21, 24)), 8))
    assert [len(p["id"]) for p in pieces] == [8, 8, 8]
    assert np.concatenate([p["id"] for p in pieces]).tolist() == list(range(24))
    assert all((p["twice"] == 2 * p["id"]).all() for p in pieces)
    assert [len(p["id"]) for p in _split_rows(reads((0, 3), (3, 4), (4, 20)), 8)] == [8, 8, 4]


def _independent_process(config):
    """Runs in each worker with JaxConfig(distributed=False): nothing of JAX is started before the loop."""
    import jax
    import ray.train
    from jax._src import distributed, xla_bridge

    import ray_jax_train as rjt

    out = {"backend_started_before_loop": xla_bridge.backends_are_initialized(),
           "jax_distributed": distributed.global_state.client is not None,
           "jax_platforms": os.environ.get("JAX_PLATFORMS"),
           "process_count": jax.process_count(), "device_count": jax.device_count(),
           "mesh": dict(rjt.get_mesh().shape)}
    try:  # independent workers would each save alone into one directory
        rjt.JaxCheckpointer(handle_preemption=False).save(1, {"w": jax.numpy.zeros(2)})
        out["checkpointer"] = "saved"
    except RuntimeError as exc:
        out["checkpointer"] = str(exc)
    try:  # this run was given no datasets
        rjt.iter_jax_batches("train", batch_size=2, mesh=rjt.get_mesh())
    except ValueError as exc:
        out["dataset_error"] = str(exc)
    import ray.data

    out["preserve_order"] = ray.data.DataContext.get_current().execution_options.preserve_order
    rank = ray.train.get_context().get_world_rank()
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def test_distributed_false_gives_each_worker_its_own_jax(ray_cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # A 2-device mesh fits each worker; "cpu,cuda" is kept, as it leads with cpu (JAX skips CUDA where no GPU is
    # visible). The 2 devices are set by hand, as JAX's own variable (the XLA flag takes the same path), which
    # num_cpu_devices=1 overrode, and which JAX, imported before env_vars are applied, never read.
    config = rjt.JaxConfig(distributed=False, mesh={"dp": 2}, compilation_cache=False,
                           env_vars={"JAX_PLATFORMS": "cpu,cuda", "JAX_NUM_CPU_DEVICES": 2})
    import ray.data

    # Given no datasets, the run starts no DatasetManager actor (Ray Train's would only answer "not found"), while
    # the driver's DataContext still reaches the workers.
    managers, context = _actors_started("DatasetManager"), ray.data.DataContext.get_current()
    was = context.execution_options.preserve_order
    context.execution_options.preserve_order = not was
    try:
        result = _fit(_independent_process, tmp_path, config={"out": str(out)}, jax_config=config)
    finally:
        context.execution_options.preserve_order = was
    assert result.error is None
    assert _actors_started("DatasetManager") == managers
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(info["preserve_order"] is (not was) for info in ranks), ranks
    assert all("No dataset named 'train' was given to the trainer" in info["dataset_error"] for info in ranks), ranks
    for info in ranks:
        # The loop could still call jax.distributed.initialize itself: JAX's backend had not started.
        assert info["backend_started_before_loop"] is False and info["jax_distributed"] is False, info
        assert info["process_count"] == 1 and info["device_count"] == 2, info
        assert info["mesh"] == {"dp": 2}
        assert info["jax_platforms"] == "cpu,cuda"
        assert "one jax.distributed job" in info["checkpointer"], info


def _prints(config):
    """Runs in the worker: prints to stdout and stderr, and once under a redirect_stdout of its own."""
    import contextlib
    import io

    print(config["marker"], "to stdout")
    print(config["marker"], "to stderr", file=sys.stderr)
    with contextlib.redirect_stdout(io.StringIO()) as caught:
        print(config["marker"], "redirected")
    with open(config["out"], "w") as f:
        f.write(caught.getvalue())


def test_a_print_in_the_loop_shows_once(ray_cluster, tmp_path):
    """Ray 2.60's Train showed every print of a worker twice: to its logger, and again to the stream, as Ray's own
    unbuffered stream wrappers looked like a redirect. A redirect the loop makes still gets its copy."""
    import glob
    import uuid

    import ray

    marker = f"print-once-{uuid.uuid4().hex}"
    result = _fit(_prints, tmp_path, config={"marker": marker, "out": str(tmp_path / "caught.txt")}, num_workers=1)
    assert result.error is None
    assert (tmp_path / "caught.txt").read_text() == f"{marker} redirected\n"
    # What the worker wrote to its stdout and stderr, which Ray forwards to the driver line by line.
    logs = ray._private.worker.global_worker.node.get_logs_dir_path()
    shown = sorted(line.strip() for path in glob.glob(os.path.join(logs, "worker-*.[oe][ur][tr]"))
                   for line in open(path, errors="replace") if marker in line)
    assert shown == [f"{marker} redirected", f"{marker} to stderr", f"{marker} to stdout"], shown


def _opened_out_of_step(config):
    """Runs in each worker: the processes open different iterators, then one a DataConfig left unsplit."""
    import ray.train

    import ray_jax_train as rjt

    rank = ray.train.get_context().get_world_rank()
    seen = {"every_row": [[], []], "one_block": [], "one_block_batches": 0}
    # JaxDataConfig(every_row=["odd"]): all 11 rows, each on one worker (Ray's equal split dropped 1, silently);
    # read twice, as an eval every N steps reads its set.
    for epoch in range(2):
        for batch in rjt.iter_jax_batches("odd", batch_size=4, mesh=rjt.get_mesh(), remainder="pad"):
            for ids, valid in zip(batch["id"].addressable_shards, batch["valid"].addressable_shards):
                seen["every_row"][epoch] += [int(i) for i, v in zip(np.asarray(ids.data), np.asarray(valid.data))
                                             if v]
    # One block for 2 workers: one shard is empty, and pads in the other's layout (it raised "cannot build padding
    # batches", and its partner hung in the next collective).
    for batch in rjt.iter_jax_batches("one_block", batch_size=4, mesh=rjt.get_mesh(), remainder="pad"):
        seen["one_block_batches"] += 1
        for ids, valid in zip(batch["id"].addressable_shards, batch["valid"].addressable_shards):
            seen["one_block"] += [int(i) for i, v in zip(np.asarray(ids.data), np.asarray(valid.data)) if v]
    batch_size = 4 if rank == 0 else 8  # e.g. a train and an eval iterator opened in another order
    try:
        next(iter(rjt.iter_jax_batches("a", batch_size=batch_size, mesh=rjt.get_mesh())))
        seen["order"] = "no error"
    except RuntimeError as exc:
        seen["order"] = str(exc)
    try:  # another dataset on each process: Ray Data's split waited for the other reader forever (a hang)
        next(iter(rjt.iter_jax_batches("a" if rank == 0 else "b", batch_size=4, mesh=rjt.get_mesh())))
        seen["names"] = "no error"
    except RuntimeError as exc:
        seen["names"] = str(exc)
    try:  # a resume position read per worker, not from the checkpoint: the one that skipped fewer stepped alone
        next(iter(rjt.iter_jax_batches("a", batch_size=4, mesh=rjt.get_mesh(), skip_batches=rank)))
        seen["skips"] = "no error"
    except RuntimeError as exc:
        seen["skips"] = str(exc)
    try:
        rjt.iter_jax_batches("whole", batch_size=4, mesh=rjt.get_mesh())
        seen["unsplit"] = "no error"
    except ValueError as exc:
        seen["unsplit"] = str(exc)
    import logging

    import ray.data

    from ray_jax_train.data import resolve_dataset

    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("ray_jax_train.data").addHandler(handler)
    resolve_dataset(ray.data.range(4))  # every worker reads all of it: each row fed twice, silently
    seen["whole_dataset"] = warned
    try:  # one process short of a batch: the other blamed its own 40 rows and advised what did not help (a review)
        list(rjt.iter_jax_batches(ray.data.range(40 if rank == 0 else 3), batch_size=8, mesh=rjt.get_mesh()))
        seen["short_shard"] = "no error"
    except rjt.NoFullBatchError as exc:
        seen["short_shard"] = str(exc)
    # A null in one worker's integer column: its rows arrive as floats, and the global batch joined int32 bits
    # with float32 ones, silently (a data review).
    import pyarrow as pa

    ids = pa.array([11, None, 13, 14] if rank == 1 else [1, 2, 3, 4], pa.int64())
    try:
        list(rjt.iter_jax_batches(ray.data.from_arrow(pa.table({"id": ids})), batch_size=4, mesh=rjt.get_mesh()))
        seen["layouts"] = "no error"
    except ValueError as exc:
        seen["layouts"] = str(exc)
    if rank == 0:  # an eval on rank 0 only, as with torch: waited for sync_timeout_s (30 minutes) while rank 1 reported
        started = time.monotonic()
        try:
            rjt.iter_jax_batches("b", batch_size=4, mesh=rjt.get_mesh(), remainder="pad")
            seen["rank0_eval"] = "no error"
        except RuntimeError as exc:
            seen["rank0_eval"] = str(exc)
            # Without the key-value store's timeout chained on: Ray's error snippet cut off the advice after it.
            seen["rank0_eval_chained"] = exc.__cause__ is not None or not exc.__suppress_context__
        seen["rank0_eval_s"] = time.monotonic() - started
    ray.train.report({"done": 1})
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)


def test_iterators_opened_out_of_step_and_unsplit_datasets_fail_loudly(ray_cluster, tmp_path):
    import ray.data

    out = tmp_path / "out"
    out.mkdir()
    trainer = rjt.JaxTrainer(
        _opened_out_of_step, train_loop_config={"out": str(out)}, scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path / "storage")),
        datasets={**{name: ray.data.range(32) for name in ("a", "b", "whole")},
                  "odd": ray.data.range(11, override_num_blocks=3), "one_block": ray.data.range(3, override_num_blocks=1)},
        dataset_config=rjt.JaxDataConfig(datasets_to_split=["a", "b", "odd", "one_block"],
                                         every_row=["odd", "one_block"]))
    assert trainer.fit().error is None
    every_row = [json.loads((out / f"rank{rank}.json").read_text())["every_row"] for rank in range(2)]
    for epoch in range(2):
        assert sorted(every_row[0][epoch] + every_row[1][epoch]) == list(range(11)), every_row
    one_block = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert sorted(one_block[0]["one_block"] + one_block[1]["one_block"]) == [0, 1, 2], one_block
    assert [] in (one_block[0]["one_block"], one_block[1]["one_block"]), one_block  # a shard was empty
    assert one_block[0]["one_block_batches"] == one_block[1]["one_block_batches"] == 2, one_block
    for rank in range(2):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        # Before: each process agreed its batch count against the other's iterator, with no error.
        assert "opened different iterators" in seen["order"] and '["a", 4' in seen["order"], seen
        assert '["a", 8' in seen["order"]
        assert "opened different iterators" in seen["names"] and '["b", 4' in seen["names"], seen
        assert "opened different iterators" in seen["skips"] and '"skip_batches=1"]' in seen["skips"], seen
        # Before: every global batch held each row twice.
        assert "'whole' is not split" in seen["unsplit"] and "datasets_to_split" in seen["unsplit"], seen
        assert [w for w in seen["whole_dataset"] if "each row is fed 2 times" in w], seen
        assert "process(es) [1] had fewer than that" in seen["short_shard"], seen
        assert f"this one, process {rank}, read " in seen["short_shard"], seen
        assert "process 0: id:int64[]; process 1: id:float64[]" in seen["layouts"], seen
        assert "A null in an integer column" in seen["layouts"], seen
    seen = json.loads((out / "rank0.json").read_text())
    assert "process 1 will never open its matching iterator: it waits in ray.train.report" in seen["rank0_eval"], seen
    # Far below the 30-minute default, with room for a loaded CI machine, where rank 1 may reach its report late.
    assert seen["rank0_eval_s"] < 120 and not seen["rank0_eval_chained"], seen


# Written out here, not imported, so a wrong value in the library cannot pass as the reference.
_REFERENCE_TUNABLES = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1125899906842624"


def _glibc_probe():
    """What glibc does with a 128 MB block from a new thread (as XLA's pool threads allocate): bytes mapped while
    it is held, and free bytes the arenas hold once it is freed. Kept apart from ray_jax_train.allocator's own
    check on purpose: it is what that check is verified against."""
    import ctypes
    import threading

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    seen = {}

    def allocate_and_free():
        before = libc.mallinfo2()
        block = libc.malloc(128 << 20)
        seen["mapped"] = libc.mallinfo2().hblkhd - before.hblkhd
        libc.free(block)
        seen["kept"] = libc.mallinfo2().fordblks  # free bytes the arenas hold, the block among them

    thread = threading.Thread(target=allocate_and_free)
    thread.start()
    thread.join()
    return seen


def _allocator_probe(config):
    """Runs in the worker: the environment the process started with, the backend's own check, glibc's handling of
    a 128 MB block, and the page faults of a jitted call with a 128 MB temporary."""
    import resource

    import jax
    import jax.numpy as jnp

    from ray_jax_train.allocator import keep_cpu_memory_problem

    glibc = _glibc_probe()
    step = jax.jit(lambda x, w, v: jnp.tanh(x @ w) @ v)  # x @ w: a [8192, 4096] float32 temporary
    args = (jnp.ones((8192, 64)), jnp.full((64, 4096), 0.01), jnp.ones((4096, 1)))
    jax.block_until_ready(step(*args))
    faults = []
    for _ in range(8):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        jax.block_until_ready(step(*args))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    # The environment the process was exec'd with (glibc rewrites the variable's value in place as it parses it,
    # so only its presence is read there; os.environ holds the value).
    with open("/proc/self/environ", "rb") as f:
        at_start = any(item.startswith(b"GLIBC_TUNABLES=") for item in f.read().split(b"\0"))
    with open(config["out"], "w") as f:
        json.dump({**glibc, "step_faults": min(faults), "all_faults": faults, "tunables_at_start": at_start,
                   "tunables": os.environ.get("GLIBC_TUNABLES"),
                   "problem": keep_cpu_memory_problem() if os.environ.get("GLIBC_TUNABLES") else None}, f)


def test_the_allocator_check_names_why_keep_cpu_memory_does_nothing():
    """The check each CPU worker makes, in fresh processes: glibc given the settings passes; glibc's defaults, and
    the settings under another malloc (Ray's own jemalloc, preloaded), are each named, the latter with a warning."""
    import subprocess

    import ray

    from ray_jax_train.allocator import KEEP_CPU_MEMORY_TUNABLES

    code = ("import logging, os; logging.basicConfig()\n"
            "from ray_jax_train.allocator import check_worker_allocator, keep_cpu_memory_problem\n"
            "print(repr(check_worker_allocator() if os.environ.get('GLIBC_TUNABLES') else keep_cpu_memory_problem()))")

    def check(**env):
        env = dict({k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}, **env)
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        return done.stdout.strip(), done.stderr

    assert check(GLIBC_TUNABLES=KEEP_CPU_MEMORY_TUNABLES)[0] == "None"
    assert "was mapped" in check()[0]
    jemalloc = os.path.join(os.path.dirname(ray.__file__), "core", "libjemalloc.so")
    assert os.path.exists(jemalloc)
    problem, log = check(GLIBC_TUNABLES=KEEP_CPU_MEMORY_TUNABLES, LD_PRELOAD=jemalloc)
    assert "not glibc's" in problem and "libjemalloc.so" in problem, problem
    assert "keep_cpu_memory has no effect in this worker" in log, log


def test_cpu_workers_keep_the_memory_a_step_frees(ray_cluster, tmp_path):
    """The default `keep_cpu_memory` starts CPU workers with glibc set to serve big blocks from one arena that
    never maps or trims, so XLA's per-step temporaries are reused instead of mapped, faulted in and unmapped.

    Asserted: the variable is in the environment the worker process started with (glibc reads it only then), and
    glibc in the worker keeps a 128 MB block wherever it does so in a plain process given the same settings;
    where this machine's glibc ignores them, the worker says so. The page faults of a jitted call's 128 MB
    temporary are reported, not asserted: in a worker, other threads' small allocations can split the freed block,
    so some calls still fault a fresh one in (a CI machine saw two such calls in a row after one warm-up call), and
    the speed effect over a whole run is measured in benchmarks/."""
    import inspect
    import subprocess

    from ray_jax_train.allocator import KEEP_CPU_MEMORY_TUNABLES

    block = 128 << 20
    reference = subprocess.run(
        [sys.executable, "-c", inspect.getsource(_glibc_probe) + "\nimport json; print(json.dumps(_glibc_probe()))"],
        env=dict(os.environ, GLIBC_TUNABLES=_REFERENCE_TUNABLES), capture_output=True, text=True, check=True)
    reference = json.loads(reference.stdout)
    glibc_honours_them = reference["mapped"] < block // 2 and reference["kept"] >= block * 0.9
    seen = {}
    for keep in (True, False):
        out = tmp_path / f"keep_{keep}.json"
        result = _fit(_allocator_probe, tmp_path, config={"out": str(out)}, num_workers=1,
                      jax_config=rjt.JaxConfig(keep_cpu_memory=keep, compilation_cache=False))
        assert result.error is None
        seen[keep] = json.loads(out.read_text())
    seen["reference"] = reference
    assert KEEP_CPU_MEMORY_TUNABLES == _REFERENCE_TUNABLES
    assert seen[True]["tunables"] == KEEP_CPU_MEMORY_TUNABLES and seen[True]["tunables_at_start"], seen
    assert seen[False]["tunables"] is None and not seen[False]["tunables_at_start"], seen
    # glibc's defaults: a new thread's arena maps the block and unmaps it on free.
    assert seen[False]["mapped"] >= block and seen[False]["kept"] < block // 2, seen
    if glibc_honours_them:
        # With the settings: the main arena's heap serves the block and keeps it once freed.
        assert seen[True]["problem"] is None, seen
        assert seen[True]["mapped"] < block // 2 and seen[True]["kept"] >= block * 0.9, seen
        if seen[True]["step_faults"] >= 0.5 * seen[False]["step_faults"]:
            warnings.warn(f"keep_cpu_memory: glibc kept the block, yet the jitted call's temporary still cost "
                          f"{seen[True]['step_faults']} page faults per call against {seen[False]['step_faults']} "
                          f"without the settings on this machine: {seen}")
    else:
        assert seen[True]["problem"] and "GLIBC_TUNABLES" in seen[True]["problem"], seen
        warnings.warn(f"keep_cpu_memory: this machine's glibc ignores GLIBC_TUNABLES even in a plain process; the "
                      f"worker reported it: {seen}")
    with pytest.raises(ValueError, match="worker_runtime_env"):
        rjt.JaxConfig(env_vars={"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})


_FAIL_SETUP_ONCE = '''
import os
_marker = os.environ["RJT_TEST_SETUP_MARKER"]
import jax
_initialize = jax.distributed.initialize


def _fail_once(*args, **kwargs):
    if kwargs.get("process_id") == 1 and not os.path.exists(_marker):
        open(_marker, "w").close()
        if os.environ["RJT_TEST_SETUP_FAULT"] == "exit":
            os._exit(1)  # a worker lost while rank 0 waits for it in initialize
        raise ConnectionError("injected: the coordinator could not be reached")
    return _initialize(*args, **kwargs)


jax.distributed.initialize = _fail_once
'''


@pytest.mark.parametrize("fault", ["exit", "raise"])
def test_a_worker_lost_or_failing_in_jax_distributed_setup_is_retried_and_releases_its_group(
        ray_cluster, tmp_path, fault):
    """Rank 1 fails once in jax.distributed.initialize (injected through a sitecustomize in the workers: a transient
    coordinator failure cannot be produced on demand). A lost worker left the group's placement group held and rank
    0 waiting in initialize; a raised error ended the run at once whatever FailureConfig said."""
    import ray
    from ray.train import FailureConfig, RunConfig
    from ray.util import placement_group_table

    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(_FAIL_SETUP_ONCE)
    env = {"PYTHONPATH": str(tmp_path / "inject"), "RJT_TEST_SETUP_MARKER": str(tmp_path / "fired"),
           "RJT_TEST_SETUP_FAULT": fault}

    def loop():
        import jax

        assert jax.process_count() == 2

    before = {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] == "CREATED"}
    result = rjt.JaxTrainer(loop, scaling_config=ScalingConfig(num_workers=2),
                            run_config=RunConfig(name=f"setup-{fault}", storage_path=str(tmp_path / "runs"),
                                                 failure_config=FailureConfig(max_failures=1),
                                                 worker_runtime_env={"env_vars": env})).fit()
    assert result.error is None, result.error
    assert (tmp_path / "fired").exists()  # the fault did fire: the run is the restarted group's

    def held():  # placement groups and CPUs still taken; Ray releases the finished group's a moment after fit()
        left = {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] == "CREATED"} - before
        return left, ray.cluster_resources()["CPU"] - ray.available_resources().get("CPU", 0)

    deadline = time.monotonic() + 60  # a leaked group holds its CPUs for good, not for a minute
    while held() != (set(), 0) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert held() == (set(), 0), held()


def test_a_dtypes_key_naming_no_column_is_refused():
    """A misspelt column in dtypes kept the real column's dtype, silently (a data review); columns= already
    refused a misspelt name."""
    from ray_jax_train.data import _select

    batch = {"id": np.arange(4), "x": np.ones((4, 2))}
    assert _select(batch, None, {"x": np.float16})["x"].dtype == np.float16
    with pytest.raises(ValueError, match=r"dtypes names columns \['idd'\]"):
        _select(batch, None, {"idd": np.int8})
    with pytest.raises(ValueError, match=r"dtypes names columns \['x'\]"):
        _select(batch, ["id"], {"x": np.float16})  # a column left out by columns= is none of the batch's


def test_integers_that_would_wrap_on_the_way_to_the_devices_are_refused(caplog):
    """int64 ids past int32 became other numbers without a word: JAX (x64 off) and numpy's astype both wrap."""
    import jax
    import jax.numpy as jnp

    from ray_jax_train.data import _select

    big = np.array([3, 2**31 + 5], np.int64)
    assert int(jax.device_put(big)[1]) != 2**31 + 5  # what happened before: a silently different number
    with pytest.raises(ValueError, match=r"Column 'ids' holds int64 values from 3 to 2147483653, outside int32"):
        _select({"ids": big}, None, None)
    with pytest.raises(ValueError, match=r"jax_enable_x64.*not a float dtype"):
        _select({"ids": big}, None, None)
    with pytest.raises(ValueError, match=r"outside uint8's range.*an integer dtypes entry that holds them"):
        _select({"ids": np.array([-1, 4])}, None, {"ids": np.uint8})
    fine = _select({"ids": np.array([0, 2**31 - 1], np.int64), "y": np.array([1.5, 2.0])}, None, None)
    assert fine["ids"].dtype == np.int64 and fine["y"].dtype == np.float64  # in range: passed on unchanged
    # To a float: allowed (features), but ids past its exact range would merge, so it is said once per column.
    with caplog.at_level(logging.WARNING, logger="ray_jax_train.data"):
        assert _select({"big": big}, None, {"big": np.float32})["big"].dtype == np.float32
        _select({"big": big}, None, {"big": np.float32})
        _select({"small": np.arange(5)}, None, {"small": np.float32})
    assert caplog.text.count("past float32's exact range (+-16777216)") == 1, caplog.text
    with pytest.raises(ValueError, match=r"outside int32.*jax_enable_x64"):  # JAX narrows an explicit int64 too
        _select({"ids": big}, None, {"ids": np.int64})
    with caplog.at_level(logging.WARNING, logger="ray_jax_train.data"):  # bf16 (numpy kind "V") is exact to 256
        _select({"bf": np.arange(300)}, None, {"bf": jnp.bfloat16})
    assert "past bfloat16's exact range (+-256)" in caplog.text


def test_columns_that_cannot_become_an_array_say_what_they_hold():
    """A struct column was "dict values of varying shape", a null in a list column "NoneType values", and a numpy
    text column passed on to fail inside device_put (a data review)."""
    from ray_jax_train.data import _select

    def ragged(*rows):
        column = np.empty(len(rows), dtype=object)
        column[:] = rows
        return column

    cases = [
        (ragged({"a": 1, "b": [1.0]}, {"a": 2, "b": [2.0]}), r"nested records \(dicts with keys \['a', 'b'\]\).*"
                                                           r"batch\['c_a'\]"),
        (ragged("ab", "c"), r"holds text \(str\).*Tokenise"),
        (np.array(["ab", "c"]), r"holds text \(<U2\)"),
        (ragged(np.arange(2), np.arange(3)), r"rows of different shapes \(\(2,\), \(3,\)\).*Pad them"),
        (ragged(np.arange(2), None, None), r"nulls \(None, in 2 of the 3 rows"),
    ]
    for column, message in cases:
        with pytest.raises(TypeError, match=message):
            _select({"c": column, "id": np.arange(len(column))}, None, None)
    with pytest.raises(TypeError, match=r"rows of different shapes \(\(1, 1\), ragged list of 2\)"):
        _select({"c": ragged([[1, 2], [3]], [[1]])}, None, None)  # numpy cannot even give the first a shape
    # Numbers written as text convert where a dtypes entry says to what; without one they are named.
    assert _select({"c": np.array(["1.5", "2"])}, None, {"c": np.float32})["c"].tolist() == [1.5, 2.0]
    with pytest.raises(TypeError, match=r"holds numbers written as text \(<U3\).*dtypes=\{'c': 'float32'\}"):
        _select({"c": np.array(["1.5", "2"])}, None, None)
    with pytest.raises(TypeError, match=r"holds text \(<U2\)"):
        _select({"c": np.array(["ab", "c"])}, None, {"c": np.float32})
    stacked = _select({"c": ragged(np.arange(2), np.arange(2, 4))}, None, None)["c"]
    assert stacked.dtype.kind == "i" and stacked.tolist() == [[0, 1], [2, 3]]


def test_numbers_that_would_overflow_to_inf_on_the_way_to_the_devices_are_refused():
    """float64 features narrowed to float16 (largest 65504) became inf with only numpy's warning; the loss went
    inf steps later (a data review). NaN and inf already there pass: they are the data's own."""
    import jax.numpy as jnp

    from ray_jax_train.data import _select

    with pytest.raises(ValueError, match=r"Column 'x' holds float64 values up to 70000, past float16's largest"):
        _select({"x": np.array([1.0, 7e4])}, None, {"x": np.float16})
    with pytest.raises(ValueError, match=r"holds int64 values up to 70000, past float16's largest"):
        _select({"n": np.array([-7e4, 3]).astype(np.int64)}, None, {"n": np.float16})
    with pytest.raises(ValueError, match=r"past float32's largest.*jax_enable_x64"):  # JAX narrows float64
        _select({"x": np.array([1e39])}, None, None)
    with pytest.raises(ValueError, match=r"past bfloat16's largest.*dtypes=\{'x': 'float32'\}"):
        _select({"x": np.array([1e39])}, None, {"x": jnp.bfloat16})
    with pytest.raises(ValueError, match=r"holds bfloat16 values up to 70144, past float16's largest"):
        _select({"x": np.array([7e4]).astype(jnp.bfloat16)}, None, {"x": np.float16})
    # Up to half an ulp past the largest, values round down to it: not inf, so not refused.
    assert _select({"x": np.array([65519.0])}, None, {"x": np.float16})["x"][0] == np.float16(65504)
    with pytest.raises(ValueError, match=r"values up to 65520, past float16's largest"):
        _select({"x": np.array([65520.0])}, None, {"x": np.float16})
    kept = _select({"x": np.array([np.inf, np.nan, 6e4]), "y": np.array([1e6], np.float32)}, None,
                   {"x": np.float16, "y": jnp.bfloat16})
    assert np.isinf(kept["x"][0]) and np.isnan(kept["x"][1]) and kept["x"][2] == np.float16(6e4)
    assert kept["y"].dtype == jnp.bfloat16


def test_a_worker_group_ray_cannot_place_says_what_it_waits_for(ray_cluster, caplog):
    """Ray retries a placement that times out every minute without end (a lost node, another job holding the CPUs);
    the controller said nothing of ours, and a quiet run printed Ray's traceback twice a minute (an ops review). The
    callback is driven here with Ray's own state and error objects; the controller calls it the same way."""
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    from ray.train.v2._internal.execution.controller.state import ReschedulingState, RunningState
    from ray.train.v2.api.config import LoggingConfig
    from ray.train.v2.api.exceptions import ControllerError

    from ray_jax_train.trainer import _CONTROLLER_LOGGERS, SaysWhyItWaits

    class Context:  # what the controller passes: the run's scaling and run configs
        scaling_config = ScalingConfig(num_workers=3, resources_per_worker={"CPU": 2})
        run_config = RunConfig(logging_config=LoggingConfig(log_level="WARNING"))

    callback = SaysWhyItWaits()
    callback.after_controller_start(Context())
    waiting = ReschedulingState(ControllerError(WorkerGroupStartupTimeoutError(3)))
    with caplog.at_level("WARNING", logger="ray_jax_train.trainer"):
        callback.after_controller_state_update(None, waiting)
        callback.after_controller_state_update(waiting, waiting)
        callback.after_controller_state_update(waiting, RunningState())
        callback.after_controller_state_update(None, waiting)
    said = [r.getMessage() for r in caplog.records if r.name == "ray_jax_train.trainer"]
    assert len(said) == 3 and "the workers cannot be placed (2 attempt(s), one every 60 s): 3 x {'CPU': 2} needed" \
        in said[1] and "live node(s) have {'CPU': " in said[1], said
    assert "(1 attempt(s)" in said[2]  # counted afresh once the group had started
    # Ray's traceback of the same timeout is left out of a quiet run's log; its other errors are not.
    logger = logging.getLogger(_CONTROLLER_LOGGERS[0])
    try:
        timed_out = logger.makeRecord(logger.name, logging.ERROR, __file__, 1, "Error in control loop iteration: %s",
                                      (WorkerGroupStartupTimeoutError(3),), None)
        other = logger.makeRecord(logger.name, logging.ERROR, __file__, 1, "Error: %s", ("disk full",), None)
        stopped = logger.makeRecord(logger.name, logging.ERROR, __file__, 1, "Error in control loop iteration: %s", (
            "The actor died unexpectedly\n\tclass_name: _QueueActor\n... Worker exit detail: Destroying worker since "
            "its placement group was removed.",), None)  # a Tune trial its scheduler stopped
        assert not logger.filter(timed_out) and not logger.filter(stopped) and logger.filter(other)
    finally:
        for name in _CONTROLLER_LOGGERS:
            for f in list(logging.getLogger(name).filters):
                logging.getLogger(name).removeFilter(f)


def test_a_reader_waiting_on_a_process_that_stopped_ends_when_its_consumer_does():
    """Two processes whose evals stop at max_eval_steps can stop a window apart: this one's reader then waits in the
    next round of the batch-count agreement for a process that will never join it. It waited for the whole sync
    timeout (30 minutes), holding Ray's reader open that long, and close() stalled the loop 30 s (a review). The
    agreement's key-value store is this process's stand-in for jax.distributed's, which needs a second process."""
    import threading

    from ray_jax_train import data as D

    class KeyValueStore:
        def __init__(self):
            self.values = {}

        def key_value_set(self, key, value):
            self.values[key] = value

        def key_value_delete(self, key):
            self.values.pop(key, None)

        def blocking_key_value_get(self, key, timeout_ms):
            deadline = time.monotonic() + timeout_ms / 1000
            while time.monotonic() < deadline:
                if key in self.values:
                    return self.values[key]
                time.sleep(0.01)
            raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")

    store = KeyValueStore()
    agreement = D._Agreement.__new__(D._Agreement)
    agreement.__dict__.update(_client=store, _prefix="eval", _rank=0, _size=2, _timeout_ms=600_000, _round=0,
                              _opened="", first_counts=None)
    store.key_value_set("eval/0/1", "4")  # the other process's first window; it stops before its second
    stop = threading.Event()
    agreement.stop = stop
    rows = ({"x": np.zeros((2, 1), np.float32)} for _ in range(100))
    before = set(threading.enumerate())
    batches = D._prefetched(D._synchronised(rows, 2, "pad", "valid", agreement, 4), 2, stop)
    (reader,) = [t for t in set(threading.enumerate()) - before if t.name == "ray_jax_train-prefetch"]
    assert len([next(batches) for _ in range(4)]) == 4
    started = time.monotonic()
    batches.close()
    assert time.monotonic() - started < 5 and not reader.is_alive()


_NOTEBOOK_SESSION = r'''
import os, signal, sys, threading, time
import ray
import ray_jax_train as rjt
from ray.train import RunConfig, ScalingConfig

storage, progress = sys.argv[1], os.path.join(sys.argv[1], "progress")

def loop(config):
    import os
    import time
    import ray.train
    for i in range(1000):
        with open(config["progress"] + ".part", "w") as f:
            f.write(str(i))
        os.replace(config["progress"] + ".part", config["progress"])  # whole: a read met it emptied (a CI run)
        ray.train.report({"i": i})
        time.sleep(0.1)

# A first fit() from a thread of the user's starts Ray there; Linux ended Ray's node processes with that thread.
starter = threading.Thread(target=rjt.init_ray, kwargs={"num_cpus": 2, "include_dashboard": False})
starter.start()
starter.join()
time.sleep(1.5)  # the kernel ends a dead thread's children at once
assert ray.get(ray.remote(lambda: 7).remote(), timeout=60) == 7
print("ray outlived the thread that started it", flush=True)
# Its GCS keeps 10,000 task records, not Ray's 100,000 (~350 MB, reached after 80 minutes of status polls).
gcs = ray._private.worker._global_node.all_processes["gcs_server"][0].process.pid
with open(f"/proc/{gcs}/environ", "rb") as f:
    assert b"RAY_task_events_max_num_task_in_gcs=10000" in f.read().split(b"\0")
assert "RAY_task_events_max_num_task_in_gcs" not in os.environ  # set only while Ray started

# No autoscaler grows the Ray that init_ray started: workers it cannot place are refused, not retried for ever.
try:
    rjt.JaxTrainer(loop, scaling_config=ScalingConfig(num_workers=1, use_gpu=True),
                   run_config=RunConfig(name="gpu", storage_path=storage)).fit()
    sys.exit("fit() returned with a GPU worker on a machine without one")
except ValueError as exc:
    assert "asks its 1 worker(s) for {'GPU': 1.0} in all" in str(exc) and "wait for ever" in str(exc), exc
from ray_jax_train.trainer import ensure_ray_leaves_cpu_for_data
try:  # workers holding every CPU of it leave Ray Data none: still said on a Ray that init_ray started
    ensure_ray_leaves_cpu_for_data(ScalingConfig(num_workers=2), has_datasets=True)
    sys.exit("workers that take every CPU passed")
except ValueError as exc:
    assert "Ray Data would have no CPU" in str(exc), exc
print("a GPU worker was refused", flush=True)

# Ctrl-C while the workers wait for CPUs another actor holds: Ray's controller never took the abort up, and the
# process hung until a third Ctrl-C (a Python API review).
@ray.remote(num_cpus=2)
class Holder:
    def ready(self):
        return True

holder = Holder.remote()
ray.get(holder.ready.remote())

def ctrl_c_soon():
    time.sleep(4)  # the controller is up and waiting to place the worker by then
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

threading.Thread(target=ctrl_c_soon, daemon=True).start()
started = time.time()
try:
    rjt.JaxTrainer(loop, train_loop_config={"progress": progress}, scaling_config=ScalingConfig(num_workers=1),
                   run_config=RunConfig(name="waits", storage_path=storage)).fit()
    sys.exit("fit() returned while its worker could not be placed")
except KeyboardInterrupt:
    pass
print(f"a run waiting for CPUs was interrupted in {time.time() - started:.0f} s", flush=True)
ray.kill(holder)

# A KeyboardInterrupt raised past Ray's SIGINT handler (a timer's handler: a notebook cell's time limit).
def timer(signum, frame):
    raise KeyboardInterrupt("the cell's time is up")

def interrupt_once_training():
    while not (os.path.exists(progress) and open(progress).read().strip() not in ("", "0", "1", "2")):
        time.sleep(0.1)
    signal.pthread_kill(threading.main_thread().ident, signal.SIGALRM)

signal.signal(signal.SIGALRM, timer)
before = signal.getsignal(signal.SIGINT)
threading.Thread(target=interrupt_once_training, daemon=True).start()
trainer = rjt.JaxTrainer(loop, train_loop_config={"progress": progress}, scaling_config=ScalingConfig(num_workers=1),
                         run_config=RunConfig(name="cell", storage_path=storage))
try:
    trainer.fit()
    sys.exit("fit() returned: no interrupt")
except KeyboardInterrupt:
    pass
assert signal.getsignal(signal.SIGINT) is before, signal.getsignal(signal.SIGINT)  # Ray's stayed after fit()
time.sleep(2)
stopped_at = int(open(progress).read())
time.sleep(2)  # 20 reports' time
assert int(open(progress).read()) == stopped_at, "the interrupted run trained on"
print("the run was aborted at", stopped_at, flush=True)
'''


def test_a_notebook_s_fit_from_a_thread_or_cut_by_a_timer_leaves_ray_and_ctrl_c_working(tmp_path):
    """A notebook review: Ray started by a first fit() in a thread died with that thread (and the kernel a minute
    later); a KeyboardInterrupt not sent as SIGINT left the run training in the background; Ray's SIGINT handler
    outlived fit(), so later Ctrl-Cs interrupted nothing and then raised SystemExit. Its own private Ray."""
    import subprocess

    script = tmp_path / "session.py"
    script.write_text(_NOTEBOOK_SESSION)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.abspath(__file__)), env.get("PYTHONPATH")) if p)
    env["RAY_JAX_TRAIN_ABORT_WAIT_S"] = "2"
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "storage")], env=env, capture_output=True,
                          text=True, timeout=400, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    assert "ray outlived the thread that started it" in out and "the run was aborted at" in out, out[-5000:]
    assert "a GPU worker was refused" in out and "a run waiting for CPUs was interrupted in" in out, out[-5000:]
