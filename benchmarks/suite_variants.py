"""The variants `suite.py` interleaves: what runs in each Ray worker (or in the bare process) and how it is timed.

Every variant trains the same model shapes on the same synthetic packed rows and records wall-clock times at
the same cadence (one host sync every `log_every` steps), so steady-state tokens/s is
`tokens per step x steps / seconds` between the sync at `warmup` and the last one, compile and warm-up excluded.
Workers write their timings as JSON into `timing_dir` (a local path: the suite runs on one node).

This module is shipped to the workers by value (`register_pickle_by_value`), so it must import nothing from
`benchmarks/` at module level.
"""
from __future__ import annotations

import json
import os
import resource
import time
from typing import Any, Dict, List, Tuple

import numpy as np

COLUMNS = ("input_ids", "targets", "loss_mask", "segment_ids", "positions")


def model_dict(size: Dict[str, int]) -> Dict[str, Any]:
    """LlamaConfig fields for the benchmark model (GPT-2-shaped small Llama: no biases, untied head)."""
    return {"vocab_size": size["vocab"], "hidden_size": size["d"], "intermediate_size": size["ffn"],
            "num_hidden_layers": size["layers"], "num_attention_heads": size["heads"],
            "max_position_embeddings": size["seq"], "tie_word_embeddings": False}


def make_rows(batch: Dict[str, np.ndarray], vocab: int, seq: int) -> Dict[str, np.ndarray]:
    """Packed rows from row ids: random tokens seeded by the id, one segment per row, every token a loss token."""
    ids = np.asarray(batch["id"])
    tokens = np.stack([np.random.default_rng(int(i)).integers(0, vocab, seq + 1) for i in ids]).astype(np.int32)
    n = len(ids)
    return {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.ones((n, seq), np.int32),
            "segment_ids": np.ones((n, seq), np.int32),
            "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (n, seq)).copy()}


def steady(log_times: List[Tuple[int, float]], warmup: int) -> Tuple[int, float]:
    """(timed steps, seconds) between the first sync at/after `warmup` and the last sync."""
    points = [(s, t) for s, t in log_times if s >= warmup]
    (s0, t0), (s1, t1) = points[0], points[-1]
    return s1 - s0, t1 - t0


def _thread_cpu_ticks() -> Dict[str, int]:
    """User + system clock ticks of each of this process's threads, keyed "name/tid"."""
    ticks = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                name, rest = f.read().rsplit(")", 1)
            fields = rest.split()
            ticks[f"{name.split('(', 1)[1]}/{task}"] = int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):  # a thread that ended while we read
            pass
    return ticks


def steady_rusage(log_rusage: List[Tuple], warmup: int, seconds: float) -> Dict[str, Any]:
    """Over `steady`'s window (`seconds` long): minor page faults and involuntary context switches per step, and
    the share of the wall time each busy thread ran (the compute thread first): on a pinned core, what the step's
    thread gives up to the others, and (1 - their sum) the time the core sat idle, waiting."""
    points = [p for p in log_rusage if p[0] >= warmup]
    (s0, f0, c0, t0), (s1, f1, c1, t1) = points[0], points[-1]
    hz = os.sysconf("SC_CLK_TCK")
    shares = sorted(((ticks - t0.get(name, 0)) / hz / seconds, name) for name, ticks in t1.items())[::-1]
    return {"minor_faults_per_step": round((f1 - f0) / (s1 - s0)), "preempted_per_step": round((c1 - c0) / (s1 - s0)),
            "thread_busy": {name: round(share, 3) for share, name in shares if share >= 0.005},
            "idle": round(1 - sum(share for share, _ in shares), 3)}


def _write(timing_dir: str, name: str, record: Dict[str, Any]) -> None:
    os.makedirs(timing_dir, exist_ok=True)
    with open(os.path.join(timing_dir, name), "w") as f:
        json.dump(record, f)


# -- (a) the built-in loop, bare and on our JaxTrainer ------------------------------------------------------


def bare_run(size: Dict[str, int], steps: int, warmup: int, log_every: int,
             data_parallel: bool = False) -> Dict[str, Any]:
    """The built-in loop's jitted train step in this process, no Ray: the overhead baseline.

    Same optimizer, state and step function as `ray_jax_train.lm.loop`; batches are host int32 arrays put on
    device each step (the trainer's data path does the same), losses fetched only at sync points.
    `data_parallel` replicates the state over all of this process's devices and splits each batch over them
    (`cpu_devices.py`); otherwise everything lives on the default device.
    """
    import contextlib

    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from ray_jax_train.config import LlamaConfig
    from ray_jax_train.lm import state as state_lib
    from ray_jax_train.lm.arguments import TrainingArguments
    from ray_jax_train.lm.step import make_optimizer, make_train_step, new_state
    from ray_jax_train.models import create_model

    cfg = LlamaConfig(**model_dict(size))
    args = TrainingArguments(**lm_arguments(size, steps, log_every))
    optimizer, _ = make_optimizer(args, steps)
    graphdef, params = state_lib.split_model(create_model(cfg))
    state = new_state(params, optimizer)
    mesh = Mesh(np.array(jax.devices()), ("dp",)) if data_parallel else None
    batch_sharding = NamedSharding(mesh, PartitionSpec("dp")) if data_parallel else None
    if data_parallel:
        state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
    step_fn = jax.jit(make_train_step(graphdef, optimizer), donate_argnums=(0,))
    rows = make_rows({"id": np.arange(steps * size["batch"])}, size["vocab"], size["seq"])
    batches = ({k: jax.device_put(v[i * size["batch"]:(i + 1) * size["batch"]], batch_sharding)
                for k, v in rows.items()} for i in range(steps))
    with jax.set_mesh(mesh) if data_parallel else contextlib.nullcontext():
        return _timed_steps(step_fn, state, batches, log_every)


def _timed_steps(step_fn, state, batches, log_every: int) -> Dict[str, Any]:
    """Run the steps; stamp the first finished step and each host sync (the loss fetched every `log_every`)."""
    import jax

    log_times, log_rusage, first = [], [], None
    for i, batch in enumerate(batches):
        state, metrics = step_fn(state, batch)
        if first is None:
            jax.block_until_ready(metrics)
            first = time.time()
        if (i + 1) % log_every == 0:
            float(metrics["loss"])
            log_times.append((i + 1, time.time()))
            usage = resource.getrusage(resource.RUSAGE_SELF)
            log_rusage.append((i + 1, usage.ru_minflt, usage.ru_nivcsw, _thread_cpu_ticks()))
    # Page faults (the heap growing: a step that faults in 300 MB runs ~35% slower), involuntary context
    # switches and CPU per thread (threads sharing a pinned core) at each sync, for `steady_rusage`.
    return {"log_times": log_times, "log_rusage": log_rusage, "first_step_time": first}


def in_worker_loop(config: Dict[str, Any]) -> None:
    """`bare_run`, unchanged, inside a JaxTrainer worker with no dataset: what Ray alone costs the same loop."""
    _write(config["timing_dir"], "timing.json",
           bare_run(config["size"], config["steps"], config["warmup"], config["log_every"]))


def dp_bare_run(size: Dict[str, int], steps: int, log_every: int) -> Dict[str, Any]:
    """The built-in loop's data-parallel step over every process jax.distributed joined, no data path, no loop.

    Mesh {"dp": -1}, the state from `ray_jax_train.lm.state`, `jit_train_step` with its one flat gradient
    all-reduce; each process puts its own `size["batch"]` rows in every step. With one process it is `bare_run`
    through the same sharded program. Run by `scale_no_ray.py` (processes of its own) and by `in_worker_dp_loop`
    (inside JaxTrainer workers), so the two differ only in what surrounds the loop.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from ray_jax_train.config import LlamaConfig
    from ray_jax_train.lm import state as state_lib
    from ray_jax_train.lm.arguments import TrainingArguments
    from ray_jax_train.lm.step import jit_train_step, make_optimizer, new_state
    from ray_jax_train.mesh import make_mesh

    processes, rank = jax.process_count(), jax.process_index()
    config = LlamaConfig(**model_dict(size))
    optimizer, _ = make_optimizer(TrainingArguments(**lm_arguments(size, steps, log_every, processes)), steps)
    mesh = make_mesh({"dp": -1})
    new_state_fn = lambda params, step: new_state(params, optimizer, step)  # noqa: E731
    graphdef, _ = state_lib.abstract_params(config)
    abstract = state_lib.abstract_state(config, mesh, new_state_fn)
    step_fn = jit_train_step(graphdef, optimizer, 1, jax.tree.map(lambda a: a.sharding, abstract), mesh)
    state = state_lib.initial_state({}, config, mesh, new_state_fn=new_state_fn)
    rows = make_rows({"id": np.arange(steps * size["batch"] * processes)}, size["vocab"], size["seq"])
    sharding = NamedSharding(mesh, PartitionSpec("dp"))
    starts = ((i * processes + rank) * size["batch"] for i in range(steps))
    batches = ({k: jax.make_array_from_process_local_data(sharding, v[start:start + size["batch"]])
                for k, v in rows.items()} for start in starts)
    with jax.set_mesh(mesh):
        return _timed_steps(step_fn, state, batches, log_every)


def in_worker_dp_loop(config: Dict[str, Any]) -> None:
    """`dp_bare_run` inside JaxTrainer workers (pinned, one CPU each): what Ray alone costs (d)'s 2-worker loop."""
    import jax

    record = dp_bare_run(config["size"], config["steps"], config["log_every"])
    if jax.process_index() == 0:
        _write(config["timing_dir"], "timing.json", record)


def lm_arguments(size: Dict[str, int], steps: int, log_every: int, workers: int = 1) -> Dict[str, Any]:
    """TrainingArguments for the built-in loop: AdamW, no eval, no checkpoints, no final model, no bar."""
    return {"total_steps": steps, "batch_size": size["batch"] * workers, "max_sequence_length": size["seq"],
            "learning_rate": 3e-4, "scheduler": "constant", "warmup_steps": 0, "log_steps": log_every, "save_final_model": False,
            "progress_bar": False, "resume_if_possible": False, "num_workers": workers}


def ours_loop(config: Dict[str, Any]) -> None:
    """`ray_jax_train.lm.train_loop_per_worker`, unchanged, with its sync points timestamped.

    `ray.train.report` is called right after each log step's host sync, and `Throughput.start` right after the
    first (compiling) step has finished; both are looked up at call time, so wrapping them here times the real
    loop without touching it. The first record also says how many MB of the train state the fullest device
    holds (what FSDP cuts).
    """
    import jax
    import ray.train

    from ray_jax_train.lm import loop as lm_loop
    from ray_jax_train.lm.metrics import Throughput

    log_times: List[Tuple[int, float]] = []
    first: List[float] = []
    state_mb: List[float] = []
    report, start = ray.train.report, Throughput.start

    def timed_report(metrics, *a, **kw):
        log_times.append((int(metrics["step"]), time.time()))
        if "state_mb_per_device" in metrics:  # the first record's start-up facts
            state_mb.append(metrics["state_mb_per_device"])
        return report(metrics, *a, **kw)

    def timed_start(self):
        if not first:
            first.append(time.time())
        return start(self)

    ray.train.report, Throughput.start = timed_report, timed_start
    lm_loop._LOG_AFTER_NEXT_DISPATCH = not config.get("sync_log")  # ours_synclog: the loop before session 29
    try:
        lm_loop.train_loop_per_worker({k: v for k, v in config.items() if k not in ("timing_dir", "sync_log")})
    finally:
        ray.train.report, Throughput.start = report, start
        lm_loop._LOG_AFTER_NEXT_DISPATCH = True
    if jax.process_index() == 0:
        _write(config["timing_dir"], "timing.json", {"log_times": log_times, "first_step_time": first[0],
                                                     "state_mb_per_device": state_mb[0]})


def restart_loop(config: Dict[str, Any]) -> None:
    """`ours_loop` SIGKILLed at its first report, to time a restart: the kill -> the restarted loop's first step.

    The first attempt leaves `killed_at.json`; the attempt Ray starts after the kill sees it and times its first
    finished step. Nothing is checkpointed, so the restart starts at step 0: what is timed is start-up alone
    (Ray's new worker group, `jax.distributed`, the state, the compile or the cache load).
    """
    import signal

    import ray.train

    from ray_jax_train.lm import loop as lm_loop
    from ray_jax_train.lm.metrics import Throughput

    timing_dir = config["timing_dir"]
    restarted = os.path.exists(os.path.join(timing_dir, "killed_at.json"))
    report, start = ray.train.report, Throughput.start

    def kill_at_first_report(metrics, *a, **kw):
        _write(timing_dir, "killed_at.json", {"time": time.time()})
        os.kill(os.getpid(), signal.SIGKILL)

    def timed_start(self):
        if not os.path.exists(os.path.join(timing_dir, "timing.json")):
            _write(timing_dir, "timing.json", {"first_step_time": time.time()})
        return start(self)

    if restarted:
        Throughput.start = timed_start
    else:
        ray.train.report = kill_at_first_report
    try:
        lm_loop.train_loop_per_worker({k: v for k, v in config.items() if k != "timing_dir"})
    finally:
        ray.train.report, Throughput.start = report, start


# -- (e) the input pipeline alone ---------------------------------------------------------------------------


def data_only_loop(config: Dict[str, Any]) -> None:
    """The built-in loop's data path (`iter_jax_batches` over packed rows, int32, on the mesh) with no step.

    Each batch is waited on (`block_until_ready`), so this is what the pipeline can deliver, not a queue fill.
    """
    import jax

    import ray_jax_train as rjt

    mesh = rjt.make_mesh({"dp": -1})
    log_times, step = [], 0
    for _ in range(config["epochs"]):
        for batch in rjt.iter_jax_batches("train", batch_size=config["batch_size"], mesh=mesh, columns=list(COLUMNS),
                                          dtypes=np.int32):
            jax.block_until_ready(batch)
            step += 1
            log_times.append((step, time.time()))
    if jax.process_index() == 0:
        _write(config["timing_dir"], "timing.json", {"log_times": log_times})


# -- (c) Ray's own JaxTrainer with a hand-written step --------------------------------------------------------


def _time_steps(config: Dict[str, Any], batches, run_step) -> Tuple[List[Tuple[int, float]], float]:
    """Run `run_step(batch) -> loss` for `config["steps"]` batches; the host syncs (reads the loss) after the
    first step and every `log_every` steps and timestamps it. Returns (log times, first-step time)."""
    log_times, first, i = [], None, 0
    for batch in batches:
        loss = run_step(batch)
        i += 1
        if first is None:
            float(loss)
            first = time.time()
        if i % config["log_every"] == 0:
            float(loss)
            log_times.append((i, time.time()))
        if i >= config["steps"]:
            break
    return log_times, first


def _hand_written_step(model_config: Dict[str, Any]):
    """(params, opt_state, step): the plain causal-LM step a user writes first, shared by both (c) variants.

    Same model class, AdamW with global-norm clipping, mean cross-entropy; causal attention without segment
    ids (every row is one segment, so the maths is that of the built-in loop).
    """
    import jax
    import optax
    from flax import nnx

    from ray_jax_train.config import LlamaConfig
    from ray_jax_train.models import create_model

    graphdef, params = nnx.split(create_model(LlamaConfig(**model_config)), nnx.Param)
    params = nnx.to_pure_dict(params)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.01))

    def loss_fn(p, ids, targets):
        logits = nnx.merge(graphdef, p)(ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @jax.jit
    def step(p, o, ids, targets):
        loss, grads = jax.value_and_grad(loss_fn)(p, ids, targets)
        updates, o = optimizer.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss

    return params, optimizer.init(params), step


def _time_hand_written(config: Dict[str, Any], batches) -> None:
    params, opt_state, step = _hand_written_step(config["model_config"])

    def run(batch):
        nonlocal params, opt_state
        params, opt_state, loss = step(params, opt_state, batch["input_ids"], batch["targets"])
        return loss

    log_times, first = _time_steps(config, batches, run)
    _write(config["timing_dir"], "timing.json", {"log_times": log_times, "first_step_time": first})


def ray_jax_loop(config: Dict[str, Any]) -> None:
    """What a user writes for `ray.train.v2.jax.JaxTrainer`: Ray's `iter_jax_batches` and a plain jitted step."""
    import jax.numpy as jnp
    import ray.train

    shard = ray.train.get_dataset_shard("train")
    _time_hand_written(config, shard.iter_jax_batches(batch_size=config["batch_size"], dtypes=jnp.int32,
                                                      drop_last=True))


def ours_step_loop(config: Dict[str, Any]) -> None:
    """The same hand-written step on our JaxTrainer and our `iter_jax_batches`: the trainers alone compared."""
    import ray_jax_train as rjt

    _time_hand_written(config, rjt.iter_jax_batches("train", batch_size=config["batch_size"],
                                                    mesh=rjt.make_mesh({"dp": -1}),
                                                    columns=["input_ids", "targets"], dtypes=np.int32))


# -- (b) TorchTrainer with an equivalent PyTorch Llama --------------------------------------------------------


def torch_llama(vocab: int, d: int, ffn: int, layers: int, heads: int, seq: int):
    """A Llama-style decoder in PyTorch with the built-in JAX model's shapes and parameter count.

    RMSNorm (eps 1e-6) -> causal self-attention with rotary embeddings (no biases) -> RMSNorm -> SwiGLU MLP,
    pre-norm residuals, final RMSNorm, untied lm_head. Defined in a function so importing this module does
    not import torch.
    """
    import torch
    import torch.nn.functional as F
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    head_dim = d // heads
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), inv_freq)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rope(x):
        x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = RMSNorm(), RMSNorm()
            self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
            self.gate, self.up = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
            self.down = nn.Linear(ffn, d, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            h = self.norm1(x)
            q, k, v = (proj(h).view(b, s, heads, head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
            a = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
            h = self.norm2(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = RMSNorm()
            self.lm_head = nn.Linear(d, vocab, bias=False)
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)

        def forward(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.norm(x))

    return Llama()


def torch_loop(config: Dict[str, Any]) -> None:
    """The same training under `ray.train.torch.TorchTrainer`: AdamW + clipping, Ray's `iter_torch_batches`.

    torch gets the same cores as XLA (`torch.set_num_threads` = the cores this process may use), since Ray
    sets OMP_NUM_THREADS=1 in workers and XLA's CPU runtime ignores it.
    """
    import torch
    import ray.train
    import ray.train.torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    size = config["size"]
    model = ray.train.torch.prepare_model(torch_llama(size["vocab"], size["d"], size["ffn"], size["layers"],
                                                      size["heads"], size["seq"]))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    shard = ray.train.get_dataset_shard("train")

    def run(batch):
        logits = model(batch["input_ids"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.detach()

    log_times, first = _time_steps(
        config, shard.iter_torch_batches(batch_size=config["batch_size"], dtypes=torch.long, drop_last=True), run)
    if ray.train.get_context().get_world_rank() == 0:
        _write(config["timing_dir"], "timing.json",
               {"log_times": log_times, "first_step_time": first,
                "params": sum(p.numel() for p in model.parameters()), "threads": torch.get_num_threads()})
