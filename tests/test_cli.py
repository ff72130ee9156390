"""The `ray-jax-train` command: config errors (exit 2, key path named), overrides, plot, exit codes.

Runs in-process through `cli.main(argv)`; the real end-to-end `fit` is the job-submit test in
test_multinode.py. Only two subprocesses here, to prove the console script and `python -m` entry points.
"""
import json
import os
import time
import subprocess
import sys

import pytest
import yaml

from ray_jax_train.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "examples", "tiny_llama.yaml")


def write(tmp_path, data, name="config.yaml"):
    path = tmp_path / name
    path.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
    return str(path)


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(os.path.join(REPO, "examples")) if n.endswith(".yaml")))
def test_example_configs_are_valid(name, capsys):
    code, out, err = run(["config", "validate", os.path.join(REPO, "examples", name)], capsys)
    assert code == 0, err
    assert "valid" in out


def test_gpu_scaling_is_checked_on_the_driver(capsys):
    """A GPU user's review: `config validate` skipped every device check when scaling.use_gpu was set, so a batch
    that does not split, a mesh larger than the GPUs or a share of a GPU per worker of one job passed."""
    gpu = os.path.join(REPO, "examples", "llama_125m_gpu.yaml")
    bad = {("scaling.num_workers=3",): "does not split over the 3 batch shards",
           ("scaling.gpus_per_worker=2", "scaling.mesh={dp: 1, tp: 4}"): "multiply to 4 devices, but there are 2",
           ("scaling.num_workers=2", "scaling.mesh={dp: 1, tp: 2}"): "scaling.gpus_per_worker",
           ("scaling.num_workers=2", "scaling.gpus_per_worker=0.5"): "NCCL refuses",
           ("scaling.gpus_per_worker=1.5",): "whole number",
           ("scaling.use_gpu=false", "scaling.gpu_memory_preallocate=false"): "gpu_memory_preallocate set but",
           ("model.attention_impl=cudnn", "model.dtype=float32"): "'cudnn' cannot run: dtype=float32",
           ("model.attention_impl=cudnn", "scaling.use_gpu=false"): "runs on NVIDIA GPUs only",
           ("model.attention_impl=flash",): "model.attention_impl",
           ("training.gpus_per_worker=1",): "set it as scaling.gpus_per_worker"}
    for overrides, message in bad.items():
        argv = ["config", "validate", gpu] + [x for o in overrides for x in ("--set", o)]
        code, _, err = run(argv, capsys)
        assert code == 2 and message in err, (overrides, err)
    assert run(["config", "validate", gpu, "--set", "scaling.gpus_per_worker=0.25"], capsys)[0] == 0
    assert run(["config", "validate", gpu, "--set", "model.attention_impl=cudnn"], capsys)[0] == 0


def test_tpu_scaling_is_checked_on_the_driver(capsys, monkeypatch):
    """No TPU exists here, and no Ray starts: `config validate` and the ScalingConfig that `fit` passes to Ray, built
    from the scaling section. Ray's own ScalingConfig validation and its per-worker TPU count from the topology are
    real; the cluster is a stand-in for ray.nodes(). A v6e 4x4 slice is 4 hosts of 4 chips, 16 JAX devices (the
    config file had no TPU keys: a mesh of the wrong size failed once the slice was reserved)."""
    import ray

    from ray_jax_train.run_config import ConfigError, check_cluster_fits, load_config

    v6e = ["scaling.use_tpu=true", "scaling.topology=4x4", "scaling.accelerator_type=TPU-V6E", "scaling.num_workers=4",
           "training.batch_size=16"]
    code, out, err = run(["config", "validate", TINY] + [x for o in v6e for x in ("--set", o)], capsys)
    assert code == 0 and "valid" in out, err
    config = load_config(TINY, v6e)
    scaling = config.scaling.scaling_config()
    assert (scaling.use_tpu, scaling.topology, scaling.accelerator_type) == (True, "4x4", "TPU-V6E")
    assert scaling.resources_per_worker == {"CPU": 1, "TPU": 4}  # Ray's fill from the topology: one host each
    assert config.training_arguments().num_devices(None, scaling) == 16
    more_cpus = load_config(TINY, v6e + ["scaling.cpus_per_worker=8"]).scaling.scaling_config()
    assert more_cpus.resources_per_worker == {"CPU": 8, "TPU": 4}  # Ray fills TPU only without resources_per_worker
    bad = {("scaling.mesh={dp: 2, tp: 4}",): "multiply to 8 devices, but there are 16",
           ("scaling.mesh={dp: 4, tp: 4}",): "model/scaling: Mesh axis 'tp'=4 cannot split",
           ("scaling.use_gpu=true",): "scaling.use_tpu and scaling.use_gpu are both true",
           ("scaling.gpu_memory_fraction=0.5",): "GPU settings and the run uses TPUs",
           ("scaling.num_workers=16", "scaling.resources_per_worker={TPU: 1}"): "1 of a TPU host's 4 chips",
           ("scaling.num_workers=3",): "`num_workers` (3) must be a multiple of 4",
           ("scaling.topology=null",): "`topology` must be specified",
           ("scaling.accelerator_type=TPU-V9",): "Invalid accelerator_type: TPU-V9",
           ("scaling.use_tpu=false",): "scaling.topology='4x4' set but scaling.use_tpu is false",
           ("training.use_tpu=true",): "set it as scaling.use_tpu"}
    for overrides, message in bad.items():
        argv = ["config", "validate", TINY] + [x for o in v6e + list(overrides) for x in ("--set", o)]
        code, _, err = run(argv, capsys)
        assert code == 2 and message in err, (overrides, err)
    # Ray's generic accelerator_type, with GPUs too: passed through.
    gpu = load_config(TINY, ["scaling.use_gpu=true", "scaling.accelerator_type=A100"]).scaling.scaling_config()
    assert gpu.accelerator_type == "A100" and not gpu.use_tpu
    # Without them: CPU workers kept to A100 nodes failed once Ray was up, blaming num_workers (a CLI review).
    with pytest.raises(ConfigError, match="scaling.accelerator_type='A100' set but the workers use neither GPUs nor "
                                          "TPUs; set scaling.use_gpu: true"):
        load_config(TINY, ["scaling.accelerator_type=A100"])

    # The check before `fit` counts TPUs and the accelerator type like CPUs: 4 v6e hosts fit, 2 or CPU nodes never.
    host = {"CPU": 180.0, "TPU": 4.0, "accelerator_type:TPU-V6E": 1.0}
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": host}] * 4)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {k: 4 * v for k, v in host.items()})
    check_cluster_fits(config.scaling)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": host}] * 2)
    with pytest.raises(ConfigError, match=r"scaling.num_workers=4 can never be placed: each worker needs CPU=1, "
                                          r"TPU=4, accelerator_type:TPU-V6E=0.001 .* room for 2 worker"):
        check_cluster_fits(config.scaling)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 64.0}}] * 4)
    with pytest.raises(ConfigError, match="room for 0 worker"):
        check_cluster_fits(config.scaling)


def test_validate_reads_the_data_columns_and_the_chat_template_without_ray(capsys, tmp_path):
    """A fine-tuner's review: `config validate` passed data without its text column and conversations for a
    tokenizer with no chat template; `fit` said so only once Ray was up and reading (~20 s). Now the first rows of
    local files are read on the driver, before Ray starts (fit and tune call the same check)."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    from ray_jax_train.text import train_tokenizer

    (tmp_path / "body.jsonl.gz").write_bytes(gzip.compress(b'{"body": "a"}\n' * 3))
    pq.write_table(pa.table({"body": ["a"], "id": [1]}), tmp_path / "body.parquet")
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    (tmp_path / "chat.jsonl").write_text(json.dumps(chat) + "\n")
    plain = tmp_path / "plain_tokenizer"
    train_tokenizer(["hello world"] * 20, vocab_size=300, save_dir=str(plain), chat_template=None)

    def validate(*overrides):
        return run(["config", "validate", TINY] + [x for o in overrides for x in ("--set", o)], capsys)

    (tmp_path / "body.csv").write_text("body,id\na,1\n")
    for name in ("body.jsonl.gz", "body.parquet", "body.csv"):
        code, _, err = validate(f"data.source={tmp_path / name}")
        assert code == 2 and "data.source" in err and "its columns are ['body'" in err and "text_column" in err, err
        assert validate(f"data.source={tmp_path / name}", "training.text_column=body")[0] == 0
    code, _, err = validate(f"data.eval_source={tmp_path / 'body.parquet'}", "data.eval_fraction=0")
    assert code == 2 and "data.eval_source" in err and "its columns are ['body'" in err, err
    code, _, err = validate(f"data.source={tmp_path / 'chat.jsonl'}", f"tokenizer.path={plain}")
    assert code == 2 and "holds conversations in 'messages'" in err and "no chat template" in err, err
    assert validate(f"data.source={tmp_path / 'chat.jsonl'}")[0] == 0  # a trained tokenizer gets a template
    # One shard of many with its text under another name: its rows read as null text and were dropped unsaid.
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):
        (shards / f"part-{i}.jsonl").write_text(json.dumps({"text" if i != 1 else "content": "words"}) + "\n")
    code, _, err = validate(f"data.source={shards}")
    assert code == 2 and "part-1.jsonl differs from" in err and "its columns are ['content']" in err, err


def test_show_applies_overrides_and_fills_defaults(capsys, tmp_path):
    # A data URI is not looked for on the driver's disk (it is listed when the data is read).
    assert run(["config", "validate", TINY, "--set", "data.source=gs://bucket/corpus"], capsys)[0] == 0
    code, out, _ = run(["config", "show", TINY, "--set", "training.learning_rate=1e-4", "--set",
                        "scaling.mesh={dp: 1}", "--set", "run.name=other"], capsys)
    assert code == 0
    shown = yaml.safe_load(out)
    assert shown["training"]["learning_rate"] == 1e-4
    assert shown["scaling"]["mesh"] == {"dp": 1}
    assert shown["run"]["name"] == "other" and shown["run"]["max_failures"] == 0
    # JSON configs too; the shown YAML is itself a valid config.
    as_json = write(tmp_path, yaml.safe_load(open(TINY)), "config.json")
    assert run(["config", "validate", as_json], capsys)[0] == 0
    shown_path = tmp_path / "shown.yaml"
    shown_path.write_text(out)
    assert run(["config", "validate", str(shown_path)], capsys)[0] == 0
    # Defaults the file leaves out are shown with the values the run will use; the vocabulary is the tokenizer's.
    assert shown["training"]["weight_decay"] == 0.01 and shown["training"]["scheduler"] == "cosine"
    assert shown["model"]["rope_theta"] == 10000.0 and shown["model"]["head_dim"] == 16
    assert shown["model"]["vocab_size"] is None and "num_workers" not in shown["training"]


BAD = [
    # (config patch, --set flags, expected fragments of the message)
    ({"trainig": {}}, [], ["trainig: unknown key", "did you mean 'training'"]),
    ({"training": {"learnin_rate": 1e-3}}, [], ["training.learnin_rate: unknown key", "'learning_rate'"]),
    ({"model": {"hiden_size": 32}}, [], ["model.hiden_size", "'hidden_size'"]),
    ({"scaling": {"num_workers": "two"}}, [], ["scaling.num_workers: wrong type", "integer"]),
    ({"scaling": {"placement_strategy": "ANY"}}, [], ["scaling.placement_strategy", "'STRICT_SPREAD'"]),
    ({"training": {"num_workers": 2}}, [], ["num_workers", "scaling.num_workers"]),
    ({"data": {"source": "missing.jsonl"}}, [], ["data.source", "missing.jsonl", "does not exist"]),
    ({}, ["run.name=glob ä"], ["run.name: 'glob ä' has characters other than ASCII", "Ray Train tags its metrics"]),
    ({}, ["run.storage_path=file:///tmp/a dir"], ["run.storage_path: 'file:///tmp/a dir' is not a valid URI", "%20"]),
    ({}, ["data.source=file:///nowhere/x.txt"], ["data.source: 'file:///nowhere/x.txt': file does not exist"]),
    ({"model": {"hidden_size": 33}}, [], ["model", "hidden_size=33", "num_attention_heads"]),
    ({}, ["training.bach_size=4"], ["--set training.bach_size", "'batch_size'"]),
    ({}, ["run.name.first=4"], ["--set run.name.first", "no sub-keys"]),
    ({}, ["training.batch_size"], ["expected KEY=VALUE"]),
    ({}, ["training.batch_size=abc"], ["training.batch_size: wrong type"]),
    ({"training": {"batch_size": True}}, [], ["training.batch_size: wrong type", "not a boolean"]),  # was read as 1
    ({}, ["scaling.num_workers=true"], ["scaling.num_workers: wrong type", "not a boolean"]),
    ({"tune": {"param_space": {"scaling.num_workers": {"choice": [1, 2]}}}}, [],
     ["scaling.num_workers", "not tunable"]),
    ({"tune": {"param_space": {"training.learning_rat": {"choice": [1e-3]}}}}, [],
     ["tune.param_space", "learning_rat", "'learning_rate'"]),
    ({"tune": {"param_space": {"training.learning_rate": {"logunifrom": [1e-4, 1e-2]}}}}, [],
     ["not a search space", "loguniform"]),
    ({"tune": {"param_space": {"training.learning_rate": {"quniform": [1e-4, 1e-2]}}}}, [],
     ["quniform", "expected [low, high, q]"]),
    ({"tune": {"param_space": {"training.learning_rate": {"choice": [1e-3, "fast"]}}}}, [],
     ["tune.param_space.training.learning_rate: trials given 'fast' would fail", "training.learning_rate"]),
    ({"training": {"total_steps": 50}, "tune": {"param_space": {"training.warmup_steps": {"randint": [1, 101]}}}},
     [], ["trials given 100 would fail", "warmup_steps=100"]),
    ({"training": {"total_steps": 50}, "tune": {"param_space": {"training.warmup_steps": {"choice": [10, 300]},
                                                                "training.total_steps": {"choice": [100, 200]}}}},
     [], ["trials given 300 would fail", "warmup_steps=300"]),
    ({"scaling": {"cpus_per_worker": 0}}, [], ["scaling", "no resources at all", "cpus_per_worker > 0"]),
    # Its ends are whole numbers, the values Tune samples are not (every trial failed once Ray was up).
    ({"tune": {"param_space": {"training.warmup_steps": {"uniform": [0, 10]}}}}, [],
     ["training.warmup_steps: trials given 3.7 would fail", "valid integer", '{"randint": [0, 11]}']),
    ({"training": {"total_steps": 200}, "tune": {"param_space": {"training.warmup_steps": {"uniform": [0, 100]}}}}, [],
     ["training.warmup_steps: trials given 37.5 would fail", '{"randint": [0, 101]}']),
    # A grid runs every combination: (32, 3) cannot be valid, though each value is with the other's other value.
    ({"tune": {"param_space": {"model.hidden_size": {"grid_search": [32, 48]},
                               "model.num_attention_heads": {"grid_search": [2, 3]}}}}, [],
     ["the grid runs every combination", "model.hidden_size=32, model.num_attention_heads=3", "not divisible"]),
    ({"tune": {"param_space": {"training.lr": {"choice": [1e-3]}}}}, [], ["training.lr: unknown key",
                                                                          "did you mean 'learning_rate'"]),
    ({"tune": {"param_space": {"learning_rate": {"choice": [1e-3]}}}}, [], ["did you mean 'training.learning_rate'"]),
    ({"tune": {"metric": "tokens_per_s"}}, [], ["tune.mode: 'min' would pick", "lowest tokens_per_s", "mode: max"]),
    ({"training": {"total_steps": 60}, "tune": {"scheduler": {"grace_period": 100}}}, [],
     ["grace_period=100 is not below", "(60)", "stop none"]),
]


def test_a_search_valid_only_with_its_other_values_passes(tmp_path, capsys):
    # warmup 100 is longer than the base total_steps of 50, but every trial's total_steps is at least 200.
    data = yaml.safe_load(open(TINY))
    data["training"]["total_steps"] = 50
    data["tune"] = {"param_space": {"training.total_steps": {"choice": [200, 400]},
                                    "training.warmup_steps": {"choice": [10, 100]}}}
    code, _, err = run(["config", "validate", write(tmp_path, data)], capsys)
    assert code == 0, err
    data["tune"] = {"param_space": {"training.total_steps": 200, "training.warmup_steps": {"choice": [100]}}}
    code, _, err = run(["config", "validate", write(tmp_path, data)], capsys)
    assert code == 0, err
    # A random key next to a grid needs only some of its values to work with each grid point.
    data["tune"] = {"param_space": {"model.hidden_size": {"choice": [32, 48]},
                                    "model.num_attention_heads": {"grid_search": [2, 3]}}}
    code, _, err = run(["config", "validate", write(tmp_path, data)], capsys)
    assert code == 0, err


@pytest.mark.parametrize("patch,flags,fragments", BAD)
def test_bad_config_exits_2_naming_the_key(patch, flags, fragments, tmp_path, capsys):
    data = yaml.safe_load(open(TINY))
    for section, values in patch.items():
        data.setdefault(section, {}).update(values)
    argv = ["config", "validate", write(tmp_path, data)]
    for flag in flags:
        argv += ["--set", flag]
    code, _, err = run(argv, capsys)
    assert code == 2, err
    for fragment in fragments:
        assert fragment in err, err


def test_init_from_a_run_directory_exits_2_naming_its_checkpoint(tmp_path, capsys):
    run_dir = tmp_path / "run"
    for step in (10, 20):
        (run_dir / f"checkpoint_{step:09d}_0a1b2c3d").mkdir(parents=True)
        (run_dir / f"checkpoint_{step:09d}_0a1b2c3d" / "_CHECKPOINT_METADATA").write_text("{}")
    code, _, err = run(["config", "validate", TINY, "--set", f"model.init_from={run_dir}"], capsys)
    assert code == 2, err
    assert "model.init_from" in err and "neither a Hugging Face model directory" in err, err
    assert "the latest is " + str(run_dir / "checkpoint_000000020_0a1b2c3d") in err, err
    # One of its checkpoints is accepted once the tokenizer its run used is known: one trained now (the config's
    # tokenizer.path is null) would give the same ids other meanings, at the same size (a review: it trained so).
    code, _, err = run(["config", "validate", TINY, "--set",
                        f"model.init_from={run_dir / 'checkpoint_000000020_0a1b2c3d'}"], capsys)
    assert code == 2 and "kept no tokenizer beside it" in err and "Set tokenizer.path" in err, err
    from ray_jax_train.run_config import init_tokenizer_dir, load_config
    from ray_jax_train.text import train_tokenizer

    trained = train_tokenizer(["some text to learn from"] * 20, vocab_size=300, save_dir=str(run_dir / "tokenizer"))
    code, _, err = run(["config", "validate", TINY, "--set",
                        f"model.init_from={run_dir / 'checkpoint_000000020_0a1b2c3d'}"], capsys)
    assert code == 0, err
    starting = load_config(TINY, [f"model.init_from={run_dir / 'checkpoint_000000020_0a1b2c3d'}"])
    assert init_tokenizer_dir(starting) == str(run_dir / "tokenizer")
    trained.save_pretrained(str(run_dir / "model"))  # what a run with save_steps keeps: preferred
    assert init_tokenizer_dir(starting) == str(run_dir / "model")
    # One that records its model (as this package's checkpoints do) meets the model section on the driver: a norm
    # that differs would load without a shape error and compute other logits.
    from ray_jax_train.checkpoint.core import META_FILE
    from ray_jax_train.lm.export import HF_CONFIG_KEY

    checkpoint = run_dir / "checkpoint_000000020_0a1b2c3d"
    # Its vocabulary (311: a tokenizer trained to 400 may come out shorter) is the tokenizer's, known only once the
    # run is built: a placeholder size at parse time refused every such checkpoint (a review).
    recorded = load_config(TINY, []).llama_config().replace(vocab_size=311, rms_norm_eps=1e-5).to_hf_dict()
    (checkpoint / META_FILE).parent.mkdir(parents=True)
    (checkpoint / META_FILE).write_text(json.dumps({HF_CONFIG_KEY: recorded}))
    code, _, err = run(["config", "validate", TINY, "--set", f"model.init_from={checkpoint}"], capsys)
    assert code == 2 and "model.init_from: The checkpoint" in err, err
    assert "rms_norm_eps=1e-06 (the weights': 1e-05)" in err and "set them in the model section: 'rms_norm_eps'" in err
    code, _, err = run(["config", "validate", TINY, "--set", f"model.init_from={checkpoint}",
                        "--set", "model.rms_norm_eps=1e-5"], capsys)
    assert code == 0, err


def test_unreadable_input_exits_2(tmp_path, capsys):
    code, _, err = run(["config", "validate", str(tmp_path / "nope.yaml")], capsys)
    assert code == 2 and "does not exist" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    code, _, err = run(["fit", str(broken)], capsys)
    assert code == 2 and "not valid YAML" in err
    code, _, err = run(["plot", str(tmp_path)], capsys)
    assert code == 2 and "metrics.jsonl" in err and "rjt.plot.MetricsFileCallback()" in err, err  # a loop of one's own
    (tmp_path / "a-run").mkdir()
    (tmp_path / "a-run" / "metrics.jsonl").write_text("")
    code, _, err = run(["plot", str(tmp_path)], capsys)  # the storage path, not a run: its runs are named
    assert code == 2 and f"the runs in it: {tmp_path / 'a-run'}" in err, err
    assert run(["frobnicate"], capsys)[0] == 2  # argparse usage error


def test_an_address_nothing_answers_at_or_a_dashboard_url_is_refused_before_ray_init():
    """An ops review: --address host:port with nothing there retried for ever; a dashboard URL gave a traceback."""
    import socket

    from ray_jax_train.cli import _check_address
    from ray_jax_train.run_config import ConfigError

    with socket.socket() as sock:  # a port that was free a moment ago, with nothing listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConfigError, match=rf"--address 127.0.0.1:{port}: nothing answers there"):
        _check_address(f"127.0.0.1:{port}", "--address")
    with pytest.raises(ConfigError, match=r"RAY_ADDRESS http://127.0.0.1:8265 is a dashboard URL.*ray job submit"):
        _check_address("http://127.0.0.1:8265", "RAY_ADDRESS")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        _check_address(f"127.0.0.1:{server.getsockname()[1]}", "--address")  # something answers: Ray's turn
    _check_address("auto", "--address")


def test_workers_the_cluster_can_never_place_exit_2_up_front(ray_cluster, capsys):
    # The session cluster has 4 CPUs: 9 one-CPU workers can never be placed; nor can 3 on 2 GPUs.
    code, _, err = run(["fit", TINY, "--set", "scaling.num_workers=9", "--set", "training.batch_size=18"], capsys)
    assert code == 2 and "scaling.num_workers=9 can never be placed" in err and "CPU=4" in err, err
    code, _, err = run(["fit", TINY, "--set", "scaling.num_workers=3", "--set", "scaling.use_gpu=true",
                        "--set", "training.batch_size=6"], capsys)
    assert code == 2 and "GPU=2" in err, err
    code, _, err = run(["fit", TINY, "--set", "scaling.num_workers=2", "--set",
                        "scaling.placement_strategy=STRICT_SPREAD"], capsys)
    assert code == 2 and "1 node(s)" in err, err
    # A Tune trial's own process holds CPU beside its workers: 4 workers fit `fit` here, not a trial (an ops
    # review: the search waited for ever, and killing it left the cluster's CPUs reserved).
    search = os.path.join(REPO, "examples", "tune_tiny_llama.yaml")
    code, _, err = run(["tune", search, "--set", "scaling.num_workers=4", "--set", "training.batch_size=8"], capsys)
    assert code == 2 and "room for 3 worker(s)" in err and "tune.trial_cpus=0.1 CPU" in err, err
    code, _, err = run(["tune", search, "--set", "tune.trial_cpus=8"], capsys)
    assert code == 2 and "tune.trial_cpus=8 can never be placed" in err, err


def test_data_without_the_text_exits_2_naming_the_column_to_set(ray_cluster, capsys, tmp_path):
    from ray_jax_train.text import local_corpus, train_tokenizer

    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hello world"}\n')
    base = ["fit", TINY, "--set", f"data.source={data}", "--set", f"run.storage_path={tmp_path}"]
    # A tokenizer trained at run time: the message said only "set tokenizer.path", where the column was the mistake.
    code, _, err = run(base + ["--set", "training.text_column=body"], capsys)
    assert code == 2 and "neither a text column 'body'" in err and "its columns are ['text']" in err, err
    assert "Name the right one with training.text_column" in err, err
    # Every row empty (was an IndexError from a worker, exit 1).
    data.write_text('{"text": ""}\n' * 3)
    train_tokenizer(local_corpus(max_total_chars=4000), vocab_size=300, save_dir=str(tmp_path / "tok"))
    code, _, err = run(base + ["--set", f"tokenizer.path={tmp_path / 'tok'}"], capsys)
    assert code == 2 and "data.source: no row has non-empty text in column 'text'" in err, err


def test_warmup_longer_than_the_counted_epochs_exits_2_before_workers(ray_cluster, capsys, tmp_path):
    # With num_epochs the step count is only known once the data is tokenised on the driver; the check runs then.
    code, _, err = run(["fit", TINY, "--set", "training.total_steps=null", "--set", "training.num_epochs=1",
                        "--set", "training.warmup_steps=100000", "--set", f"run.storage_path={tmp_path}"], capsys)
    assert code == 2 and "warmup_steps=100000 exceeds the" in err and "training steps" in err, err
    code, _, err = run(["fit", TINY, "--set", "training.total_steps=null", "--set", "training.num_epochs=1",
                        "--set", "training.profile_start_step=100000", "--set", f"run.storage_path={tmp_path}"], capsys)
    assert code == 2 and "profile_start_step=100000 is after the last step" in err, err


def test_a_profiled_cli_run_turns_on_xla_cpu_op_events(ray_cluster, tmp_path):
    from ray_jax_train.lm.profiling import CPU_TRACE_FLAG
    from ray_jax_train.run_config import build_trainer, load_config

    built = []

    def flags(*overrides):
        trainer, _ = build_trainer(load_config(TINY, [f"run.storage_path={tmp_path}", *overrides]))
        built.append(trainer)
        return list(trainer.jax_config.xla_flags)

    assert CPU_TRACE_FLAG in flags("training.profile_start_step=2")
    assert CPU_TRACE_FLAG not in flags()
    # The shards keep the prepared rows' order: Ray Train's default DataConfig turned preserve_order off and split
    # by who asked first, and about 1 fresh 2-worker run in 4 trained on other batches (a review).
    options = built[-1].data_config._resolve_execution_options("train")
    assert options.preserve_order is True


def test_training_failure_exits_1_with_a_short_message(monkeypatch, ray_cluster, capsys, tmp_path):
    import ray_jax_train.run_config as run_config

    class Failing:
        def fit(self):
            raise RuntimeError("worker 0 died\nCaused by: ValueError: loss is nan")

    info = {"name": "x", "run_dir": str(tmp_path), "total_steps": 1}
    monkeypatch.setattr(run_config, "build_trainer", lambda config, **kw: (Failing(), info))
    code, _, err = run(["fit", TINY], capsys)
    assert code == 1
    assert "training failed: RuntimeError: Caused by: ValueError: loss is nan" in err and str(tmp_path) in err
    assert f"resume:  ray-jax-train fit {TINY} --set run.name=x" in err  # e.g. once a lost node is back
    assert "after fixing the cause" not in err and "re-run with --verbose" in err
    # An error every attempt repeats: the resume line says the cause comes first; --verbose has the traceback, and
    # no longer ends by advising it.
    from ray_jax_train.lm import NonFiniteLossError

    class GoesNaN:
        def fit(self):
            raise NonFiniteLossError("Step 2 gave loss nan")

    monkeypatch.setattr(run_config, "build_trainer", lambda config, **kw: (GoesNaN(), info))
    code, _, err = run(["-v", "fit", TINY], capsys)
    assert code == 1 and "(after fixing the cause: as it is, it stops the same way)" in err, err
    assert "re-run with --verbose" not in err and "Traceback" in err
    monkeypatch.setattr(run_config, "build_trainer", lambda config, **kw: (Failing(), info))
    # The run's directory keeps its effective config, paths absolute, which reads back as the same run.
    from ray_jax_train.run_config import dump, load_config

    kept = (tmp_path / "config.yaml").read_text()
    assert kept == dump(load_config(TINY).with_absolute_paths()) == dump(load_config(str(tmp_path / "config.yaml")))

    # Ray cuts the middle out of long worker errors in WorkerGroupError's text: the workers' own error is named.
    from ray.train import WorkerGroupError

    from ray_jax_train.checkpoint import CheckpointMismatchError

    real = CheckpointMismatchError("/runs/x/checkpoint_000000030 holds a different train state than this run builds")
    Failing.fit = lambda self: (_ for _ in ()).throw(
        WorkerGroupError("Training failed...\n...tate than this run builds", {1: real, 0: real}))
    code, _, err = run(["fit", TINY], capsys)
    assert code == 1 and "training failed: CheckpointMismatchError: /runs/x/checkpoint_000000030 holds" in err, err


def test_plot_draws_one_labelled_panel_per_metric(tmp_path, capsys, monkeypatch):
    import matplotlib.image

    rng = __import__("random").Random(0)
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(2, 202, 2):
            record = {"step": step, "loss": 6.0 * 0.99 ** step + rng.random() * 0.3,
                      "learning_rate": 3e-3 * min(1.0, step / 20), "tokens_per_s": 900 + rng.random() * 100}
            if step % 50 == 0:
                record["eval_loss"] = record["loss"] + 0.1
            f.write(json.dumps(record) + "\n")
        f.write('{"step": 204, "loss": \n')  # a line cut short by a killed run is skipped
    code, out, _ = run(["plot", str(tmp_path), "--smoothing", "0.8"], capsys)
    assert code == 0 and out.strip() == str(tmp_path / "curves.png")
    image = matplotlib.image.imread(out.strip())
    assert image.shape[1] > 2.5 * image.shape[0]  # three panels side by side
    assert run(["plot", str(tmp_path), "--smoothing", "1.5"], capsys)[0] == 2
    # -o without a suffix, or naming a directory: the path printed is the file written (savefig added ".png" to
    # both, so "-o out" printed "out" and "-o adir" wrote adir.png beside the directory; a CLI review).
    (tmp_path / "adir").mkdir()
    for given, written in (("out", "out.png"), ("adir", "adir/curves.png"), ("c.svg", "c.svg")):
        code, out, _ = run(["plot", str(tmp_path), "-o", str(tmp_path / given)], capsys)
        assert code == 0 and out.strip() == str(tmp_path / written) and (tmp_path / written).is_file(), out
    code, _, err = run(["plot", str(tmp_path), "-o", str(tmp_path / "c.xyz")], capsys)
    assert code == 2 and "cannot write .xyz images" in err and not (tmp_path / "c.xyz").exists()
    # A run in storage given as a URI: its curves go beside its metrics there (savefig took the URI for a local path).
    (tmp_path / "curves.png").unlink()
    code, out, _ = run(["plot", f"file://{tmp_path}"], capsys)
    assert code == 0 and out.strip() == f"file://{tmp_path}/curves.png" and (tmp_path / "curves.png").exists()
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "metrics.jsonl").write_text("")  # a run that has logged nothing yet
    code, _, err = run(["plot", str(tmp_path / "fresh")], capsys)
    assert code == 2 and "no loss, learning_rate or tokens_per_s records yet" in err and "Traceback" not in err
    # A resumed run logs steps after its checkpoint twice: the curves keep the later record of each step.
    from ray_jax_train.plot import read_records

    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("\n" + "\n".join(json.dumps({"step": s, "loss": 1.0}) for s in (198, 200, 202)) + "\n")
    records = read_records(str(tmp_path))
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)) and steps[-3:] == [198, 200, 202]
    assert [r["loss"] for r in records[-3:]] == [1.0, 1.0, 1.0]
    # Killed again and resumed at step 148, now at 152: the abandoned attempt's steps 154-202 are not kept either.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("null\n" + json.dumps({"loss": 9.0}) + "\n")  # lines with no step to draw them at are skipped
        f.write("\n".join(json.dumps({"step": s, "loss": 2.0}) for s in (150, 152)) + "\n")
    steps = [r["step"] for r in read_records(str(tmp_path))]
    assert steps[-4:] == [146, 148, 150, 152] and steps == sorted(set(steps))
    # Each later attempt's first logged step is marked on every panel: a jump there is a resume, not training.
    from ray_jax_train.plot import draw_curves, resumed_steps

    (tmp_path / "resumed").mkdir()
    attempts = [{"step": 2, "loss": 3.0, "startup_s": 9.0}, {"step": 4, "loss": 2.5}, {"step": 6, "loss": 2.4},
                {"step": 4, "loss": 2.6, "startup_s": 5.0}, {"step": 6, "loss": 2.3}, {"step": 8, "loss": 2.2}]
    (tmp_path / "resumed" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in attempts))
    text = (tmp_path / "resumed" / "metrics.jsonl").read_text()
    assert resumed_steps(text) == [4]  # the first attempt is no resume
    fig = draw_curves(read_records(str(tmp_path / "resumed")), resumed_steps(text))
    marks = [line for line in fig.axes[0].lines if line.get_linestyle() == ":"]
    assert [line.get_xdata()[0] for line in marks] == [4]
    assert "resumed" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert run(["plot", str(tmp_path / "resumed")], capsys)[0] == 0 and (tmp_path / "resumed" / "curves.png").exists()
    # A metrics.jsonl named by a bare relative path: the curves go beside it (the directory was "metrics.jsonl").
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(["plot", "metrics.jsonl"], capsys)
    assert code == 0 and out.strip() == "./curves.png" and (tmp_path / "curves.png").exists()


def test_plot_of_a_search_draws_every_trial_s_loss_together(tmp_path, capsys):
    """`plot <search dir>` was refused ("RUN_DIR must be a training run directory"), though export and generate take
    one: the trials' losses side by side are what a search is run for. Laid out as Tune and our trials lay it out."""
    import matplotlib.image

    from ray_jax_train.plot import search_trials

    search = tmp_path / "lr-search"
    search.mkdir()
    (search / "search_config.json").write_text("{}")
    for n, (trial_id, lr) in enumerate((("86706_00000", "0.0030"), ("86706_00001", "0.0000"), ("86706_00002", "1"))):
        trial = search / f"trial_{trial_id}_{n}_learning_rate={lr}_2026-11-26_13-58-58"
        trial.mkdir()
        if n == 1:  # Tune's directory name rounds 1e-05 and 1e-06 alike to 0.0000; its params.json does not
            (trial / "params.json").write_text(json.dumps({"training": {"learning_rate": 1e-05}}))
        if n == 2:
            continue  # a trial that failed before it logged: no curve, no error
        (tmp_path / f"lr-search-{trial_id}").mkdir()
        (tmp_path / f"lr-search-{trial_id}" / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "loss": 6.0 - s * (0.1 if n == 0 else 0.01)}) + "\n" for s in range(1, 31)))
    (search / "best.json").write_text(json.dumps({"run_dir": str(tmp_path / "lr-search-86706_00000")}))
    trials = search_trials(str(search))
    assert [(t["label"], t["best"]) for t in trials] == [("learning_rate=0.0030", True),
                                                          ("learning_rate=1e-05", False), ("learning_rate=1", False)]
    here = os.getcwd()
    try:  # a relative path, as typed: best.json's absolute one matched no trial (a review)
        os.chdir(tmp_path)
        assert [t["best"] for t in search_trials("lr-search")] == [True, False, False]
    finally:
        os.chdir(here)
    code, out, _ = run(["plot", str(search)], capsys)
    assert code == 0 and out.strip() == str(search / "trials.png")
    assert matplotlib.image.imread(out.strip()).shape[0] > 100
    empty = tmp_path / "empty-search"
    empty.mkdir()
    (empty / "search_config.json").write_text("{}")
    code, _, err = run(["plot", str(empty)], capsys)
    assert code == 2 and "no trial has logged a step to metrics.jsonl yet" in err


def test_a_private_ray_sized_past_the_machine_says_the_workers_share_its_cores():
    """The private Ray is sized to fit the workers, so cpus_per_worker=16 on 2 cores ran without a word."""
    from ray_jax_train.cli import _more_cpus_than_cores

    assert _more_cpus_than_cores(2, 2) is None
    assert "ask for 32 CPUs in all" in _more_cpus_than_cores(32, 2) and "machine has 2 cores" in \
        _more_cpus_than_cores(32, 2)


def test_a_failed_trial_s_error_is_shortened_at_a_sentence_end():
    from ray_jax_train.cli import _shortened

    advice = ("NonFiniteLossError: Step 2 gave loss nan. Lower learning_rate, add warmup_steps or set max_grad_norm; "
              "check the data for empty rows. ") * 3
    cut = _shortened(advice, 150)
    assert cut.endswith(". [...]") and len(cut) <= 157 and advice.startswith(cut[:-6])
    assert _shortened("short", 150) == "short"
    assert _shortened("x" * 20 + " word" * 60, 100).endswith("word [...]")


def test_a_worker_that_died_is_named_with_its_process_and_ray_s_reason():
    """Ray's WorkerHealthCheckFailedError's first line (all the summary kept) named no rank, pid, node or cause (an
    ops review). The errors are Ray's own classes, built as its controller builds them."""
    from ray.exceptions import RayActorError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError
    from ray.train.v2.api.exceptions import WorkerGroupError

    from ray_jax_train.cli import _error_line

    died = RayActorError(error_msg="The actor died unexpectedly before finishing this task.\n\tclass_name: "
                                   "RayTrainWorker\n\tpid: 4242\n\tip: 10.0.0.7\nThe actor is dead because its worker "
                                   "process has died. Worker exit type: UNEXPECTED_SYSTEM_EXIT Worker exit detail: "
                                   "Worker unexpectedly exits with a connection error code 2.")
    lost = WorkerHealthCheckFailedError("A worker health check failed.", failure=died)
    line = _error_line(WorkerGroupError("...", {1: lost}))
    assert line.startswith("WorkerHealthCheckFailedError: A worker health check failed. ..."), line
    assert "Worker 1 (pid 4242 on 10.0.0.7): The actor is dead because its worker process has died." in line, line
    assert "a lost node" in line
    plain = _error_line(WorkerGroupError("...", {0: ValueError("bad batch\nmore")}))
    assert plain == "ValueError: bad batch ...", plain
    # The controller killed: Ray's text blamed a worker's process and the OOM killer (a failure-injection review).
    controller = RayActorError(error_msg=died.error_msg.replace("RayTrainWorker", "TrainController"))
    line = _error_line(controller)
    assert line.startswith("RayActorError: the run's controller (Ray Train's TrainController actor, pid 4242) died, "
                           "and the workers with it; the checkpoints saved so far stand."), line


def test_a_failed_run_s_line_keeps_the_cause_in_sight_and_names_a_bad_row_met_while_training(tmp_path, capsys):
    """The CLI's one line ended inside TensorStore's object text, before the advice (a chaos review); a bad row met
    while the data streamed was not searched for: Ray's first line has none of the words (a review)."""
    import ray.exceptions
    from ray.train.v2.api.exceptions import WorkerGroupError

    from ray_jax_train.checkpoint.core import _brief
    from ray_jax_train.cli import _training_failed
    from ray_jax_train.run_config import load_config

    tensorstore = ("Exception: Encountered error while reading array index: (slice(0, 32, 1),). See full TensorStore "
                   "details: <bound method pybind11_detail_function_record_v1.spec of TensorStore({")
    assert _brief(tensorstore) == "Exception: Encountered error while reading array index: (slice(0, 32, 1),)."
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": 7}) + "\n")
    config = load_config(TINY, [f"data.source={data}"])
    worker = ray.exceptions.RayTaskError(
        "submit", "Traceback (most recent call last):\nray_jax_train.text.errors.TextDataError: column 'text' holds "
        "an int (7), not text.", ray.exceptions.UserCodeException("UDF failed")).as_instanceof_cause()
    _training_failed(WorkerGroupError("...", {0: worker}), False, "/runs/r", resume="ray-jax-train fit c.yaml",
                     config=config)
    err = capsys.readouterr().err
    assert f"The first row that cannot be read as a document: {data}, line 2: 'text' holds an int (7)" in err, err
    assert "resume:  ray-jax-train fit c.yaml" in err
    _training_failed(WorkerGroupError("...", {0: ValueError("controller gone")}), False, "/runs/r", config=config)
    assert "first row" not in capsys.readouterr().err  # not about rows ("role" is in "controller"): no search


def test_entry_points(tmp_path):
    script = os.path.join(os.path.dirname(sys.executable), "ray-jax-train")
    done = subprocess.run([script, "config", "validate", TINY], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([sys.executable, "-m", "ray_jax_train", "config", "validate", TINY, "--set", "x.y=1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "x: unknown key" in done.stderr


def test_config_mistakes_that_passed_silently_or_failed_late(tmp_path, monkeypatch, caplog):
    from ray_jax_train.run_config import ConfigError, ensure_tokenizer, parse_config, read_file

    # A section given twice was last-wins: its first half vanished with "valid".
    (tmp_path / "twice.yaml").write_text("training:\n  learning_rate: 0.01\nmodel:\n  type: llama\ntraining:\n  total_steps: 3\n")
    with pytest.raises(ConfigError, match=r"'training' \(line 5\) is given twice"):
        read_file(str(tmp_path / "twice.yaml"))
    (tmp_path / "twice.json").write_text('{"training": {"total_steps": 3, "total_steps": 4}}')
    with pytest.raises(ConfigError, match="'total_steps' is given twice"):
        read_file(str(tmp_path / "twice.json"))
    # Tune checks that failed only after Ray, a tokenizer and a trial's compile (or never: a wrong metric).
    space = {"training.learning_rate": {"choice": [1e-3, 3e-3]}}
    steps = {"training": {"total_steps": 4}}  # ASHA needs them (or tune.scheduler.max_t)
    with pytest.raises(ConfigError, match="'eval_los' is not a metric .* did you mean 'eval_loss'"):
        parse_config({**steps, "tune": {"metric": "eval_los", "param_space": space}})
    with pytest.raises(ConfigError, match="'eval_loss' needs eval data"):
        parse_config({**steps, "tune": {"metric": "eval_loss", "param_space": space}})
    parse_config({**steps, "tune": {"metric": "eval_loss", "param_space": space}, "data": {"eval_fraction": 0.1}})
    for bad, message in [({"loguniform": [0, 1e-2]}, "must be > 0"), ({"randint": [3, 1]}, "must be below high"),
                         ({"quniform": [1e-3, 1e-2, 0]}, "q 0 must be > 0")]:
        with pytest.raises(ConfigError, match=message):
            parse_config({**steps, "tune": {"param_space": {"training.learning_rate": bad}}})
    # Start-up facts are in an attempt's first record only: the search ran every trial, then found no best.
    with pytest.raises(ConfigError, match="'startup_s' is not a metric a search can rank trials by"):
        parse_config({**steps, "tune": {"metric": "startup_s", "param_space": space}})
    # training.seed seeds only the shuffle buffer: with it off, N identical trials.
    with pytest.raises(ConfigError, match="training.seed seeds only the shuffle buffer.*model.seed"):
        parse_config({**steps, "tune": {"param_space": {"training.seed": {"choice": [1, 2]}}}})
    parse_config({"training": {"total_steps": 4, "shuffle_buffer_size": 64},
                  "tune": {"param_space": {"training.seed": {"choice": [1, 2]}}}})
    # training.dtype / param_dtype reach the model (fit and every trial trained float32 whatever they said).
    assert parse_config({"training": {"dtype": "bf16"}}).llama_config().dtype == "bfloat16"
    assert parse_config({"training": {"param_dtype": "bfloat16"}}).llama_config().param_dtype == "bfloat16"
    # `~` was expanded only in run.storage_path.
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "corpus.txt").write_text("some text\n")
    assert parse_config({"data": {"source": "~/corpus.txt"}}).data.paths() == [str(tmp_path / "corpus.txt")]
    # A resumed run keeps its tokenizer: one trained again on changed data has the same size and other ids.
    first = parse_config({"data": {"max_docs": 20}, "tokenizer": {"vocab_size": 300}})
    saved = ensure_tokenizer(first, str(tmp_path / "tok"))
    changed = parse_config({"data": {"max_docs": 60}, "tokenizer": {"vocab_size": 300}})
    text = "Return the number of items in the container."
    assert ensure_tokenizer(changed, str(tmp_path / "tok"), reuse=True)(text)["input_ids"] == saved(text)["input_ids"]
    retrained = ensure_tokenizer(changed, str(tmp_path / "tok2"))
    assert retrained(text)["input_ids"] != saved(text)["input_ids"]  # what a resume used to get
    assert sorted(os.listdir(tmp_path / "tok2")) == sorted(os.listdir(tmp_path / "tok"))  # no staging left behind
    # A save cut short (the process killed mid-write) leaves no tokenizer.json for the next run to reuse: it is
    # written beside and moved in last. The failure is injected into the real save, after its first file.
    import ray_jax_train.text as text_lib

    real_save = text_lib.train_tokenizer

    def killed_mid_save(texts, vocab_size, save_dir):
        real_save(texts, vocab_size=vocab_size, save_dir=save_dir)
        raise KeyboardInterrupt

    monkeypatch.setattr(text_lib, "train_tokenizer", killed_mid_save)
    with pytest.raises(KeyboardInterrupt):
        ensure_tokenizer(changed, str(tmp_path / "tok3"))
    assert os.listdir(tmp_path / "tok3") == []
    monkeypatch.setattr(text_lib, "train_tokenizer", real_save)
    # Another tokenizer.vocab_size is refused on resume: the reused tokenizer silently ignored it.
    bigger = parse_config({"data": {"max_docs": 20}, "tokenizer": {"vocab_size": 400}})
    with pytest.raises(ConfigError, match=r"tokenizer.vocab_size is 400, but .* vocab_size 300.* back to 300"):
        ensure_tokenizer(bigger, str(tmp_path / "tok"), reuse=True)
    # A new Tune search under an old name (new trials, no old ids to keep) gets a tokenizer of its own settings
    # beside the old one, which the earlier search's best.json still names; its own settings find it again.
    from ray_jax_train.run_config import trained_tokenizer_dir

    assert trained_tokenizer_dir(first, str(tmp_path / "tok")) == str(tmp_path / "tok")
    other = trained_tokenizer_dir(bigger, str(tmp_path / "tok"))
    assert other.startswith(str(tmp_path / "tok-"))
    assert len(ensure_tokenizer(bigger, other, reuse=True)) > 300
    assert trained_tokenizer_dir(bigger, str(tmp_path / "tok")) == other
    assert len(ensure_tokenizer(first, str(tmp_path / "tok"), reuse=True)) <= 300
    # A Tune trial's run keeps the search's tokenizer in <run>/model/ only: continued under its name with fit, it
    # trained a new one (same size, other ids) over it (an upgrade review).
    saved.save_pretrained(str(tmp_path / "trial" / "model"))
    reused = ensure_tokenizer(changed, str(tmp_path / "trial" / "tokenizer"), reuse=True)
    assert reused(text)["input_ids"] == saved(text)["input_ids"] and not (tmp_path / "trial" / "tokenizer").exists()
    # A tokenizer.vocab_size beside a ready tokenizer sizes nothing: said, not dropped without a word.
    ready = parse_config({"tokenizer": {"path": str(tmp_path / "tok"), "vocab_size": 4000}})
    caplog.clear()
    with caplog.at_level("WARNING", logger="ray_jax_train.run_config"):
        assert len(ensure_tokenizer(ready, str(tmp_path / "unused"))) == len(saved)
        ensure_tokenizer(parse_config({"tokenizer": {"path": str(tmp_path / "tok")}}), str(tmp_path / "unused"))
    said = [r.getMessage() for r in caplog.records if "is ignored" in r.getMessage()]
    assert len(said) == 1 and "tokenizer.vocab_size=4000 is ignored" in said[0], said
    assert not (tmp_path / "unused").exists()


def test_validate_runs_the_checks_fit_runs_and_refuses_settings_that_would_be_ignored(tmp_path):
    from ray_jax_train.run_config import ConfigError, parse_config, read_file

    # Checked only when `fit` built the trainer before: `config validate` said "valid", a Tune search failed every trial.
    with pytest.raises(ConfigError, match=r"training/scaling: Mesh axes \{'dp': 3\} multiply to 3 devices"):
        parse_config({"scaling": {"mesh": {"dp": 3}}})
    with pytest.raises(ConfigError, match="max_sequence_length=128 exceeds model.max_position_embeddings=64"):
        parse_config({"training": {"max_sequence_length": 128}, "model": {"max_position_embeddings": 64}})
    with pytest.raises(ConfigError, match="scaling.use_gpu is false"):  # it ran on CPUs
        parse_config({"scaling": {"gpus_per_worker": 0.5}})
    with pytest.raises(ConfigError, match="an empty list"):  # it trained on the stdlib corpus
        parse_config({"data": {"source": []}})
    tune_tiny = yaml.safe_load(open(os.path.join(REPO, "examples", "tune_tiny_llama.yaml")))
    by_epochs = {**tune_tiny, "training": {**tune_tiny["training"], "total_steps": None, "num_epochs": 1}}
    with pytest.raises(ConfigError, match="tune.scheduler.max_t: set it"):  # found once Ray and a tokenizer were up
        parse_config(by_epochs)
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ConfigError, match="the file is empty"):  # Llama's default sizes: 4096 wide, 32 layers
        read_file(str(tmp_path / "empty.yaml"))


def test_the_model_meets_the_mesh_and_its_hf_starting_weights_on_the_driver(tmp_path, caplog):
    from ray_jax_train.config import LlamaConfig
    from ray_jax_train.models import create_model, save_pretrained
    from ray_jax_train.run_config import ConfigError, parse_config

    tiny = yaml.safe_load(open(TINY))
    # Before, these passed `config validate` and failed in the workers after start-up.
    with pytest.raises(ConfigError, match="model/scaling: Mesh axis 'tp'=2 cannot split the model's 1 key/value heads"):
        parse_config({**tiny, "scaling": {"cpu_devices_per_worker": 2, "mesh": {"dp": 1, "tp": 2}}})
    # tp across workers: found only after the workers started (a review).
    with pytest.raises(ConfigError, match=r"training/scaling: Mesh \{'dp': 1, 'fsdp': 1, 'tp': 2\} does not give each "
                                          r"of the 2 workers its own block .*their product must divide 1"):
        parse_config({**tiny, "scaling": {"num_workers": 2, "mesh": {"dp": 1, "fsdp": 1, "tp": 2}}})
    with pytest.raises(ConfigError, match="model/scaling: intermediate_size=63 is not divisible by mesh axis 'tp'=2"):
        parse_config({**tiny, "model": {**tiny["model"], "num_key_value_heads": 2, "intermediate_size": 63},
                      "scaling": {"cpu_devices_per_worker": 2, "mesh": {"dp": 1, "tp": 2}}})
    hf_dir = tmp_path / "hf"
    hf = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64)
    save_pretrained(create_model(hf), hf_dir)
    with pytest.raises(ConfigError, match=r"model.init_from: .*\(300, 64\) != \(300, 32\).*leave them out"):
        parse_config({**tiny, "model": {**tiny["model"], "init_from": str(hf_dir)}})
    # Weights without their tokenizer: one trained at run time would give the ids other meanings (it was silent).
    with pytest.raises(ConfigError, match=r"model.init_from: .* has model weights but no tokenizer.*tokenizer.path"):
        parse_config({**tiny, "model": {"init_from": str(hf_dir)}})
    from ray_jax_train.text import train_tokenizer
    from ray_jax_train.run_config import init_tokenizer_dir

    train_tokenizer(["some text to learn from"] * 20, vocab_size=300, save_dir=str(hf_dir))
    # A type contradicting config.json, and an architecture there is no model for: config errors, exit 2 (the second
    # was a traceback).
    with pytest.raises(ConfigError, match=r"model.type: 'qwen2' contradicts model.init_from's config.json"):
        parse_config({**tiny, "model": {"init_from": str(hf_dir), "type": "qwen2"}})
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    (gpt2 / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"model.init_from: .*model_type='gpt2' .* is not supported"):
        parse_config({**tiny, "model": {"init_from": str(gpt2)}, "tokenizer": {"path": str(hf_dir)}})
    # Sizes left out come from its config.json: that model is the one fine-tuned.
    config = parse_config({**tiny, "model": {"init_from": str(hf_dir), "remat": True}})
    assert config.llama_config() == hf.replace(remat=True)
    # Rope set in the model section differs from config.json's on purpose (a longer context): said, not refused.
    from ray_jax_train.run_config import check_hf_init_dir

    with caplog.at_level("WARNING", logger="ray_jax_train.lm.state"):
        longer = parse_config({**tiny, "model": {"init_from": str(hf_dir), "rope_theta": 5e5}})
        assert "rope_theta" not in caplog.text  # said once, when the run is built
        check_hf_init_dir(longer, longer.llama_config())
    assert "with rope_theta=500000.0 (the weights': 10000.0), as set" in caplog.text
    # 2 heads of 32 hold the same arrays as config.json's 4 of 16: they loaded and computed other logits (a review).
    with pytest.raises(ConfigError, match=r"model.init_from: .* splits attention into other heads .*"
                                          r"num_attention_heads=2 \(the weights': 4\), num_key_value_heads=1 .*"
                                          r"head_dim=32 \(the weights': 16\)"):
        parse_config({**tiny, "model": {"init_from": str(hf_dir), "num_attention_heads": 2, "num_key_value_heads": 1,
                                        "head_dim": 32}})
    # A bf16 checkpoint (most are) trains float32 master weights, as through RayDistributedTrainer; asked, bf16.
    bf16_dir = tmp_path / "hf_bf16"
    save_pretrained(create_model(hf.replace(dtype="bfloat16", param_dtype="bfloat16")), bf16_dir)
    with_tokenizer = {"path": str(hf_dir)}
    loaded = parse_config({**tiny, "model": {"init_from": str(bf16_dir)}, "tokenizer": with_tokenizer}).llama_config()
    assert (loaded.param_dtype, loaded.dtype) == ("float32", "bfloat16")
    kept = parse_config({**tiny, "model": {"init_from": str(bf16_dir)}, "tokenizer": with_tokenizer,
                         "training": {**tiny["training"], "param_dtype": "bf16"}})
    assert kept.llama_config().param_dtype == "bfloat16"
    # A search from a directory with its own tokenizer gives the trials that tokenizer (they looked for one in the
    # search's directory, which nothing wrote: every trial failed).
    assert init_tokenizer_dir(config) == str(hf_dir)
    trial = parse_config({**tiny, "model": {"init_from": str(hf_dir)}, "tokenizer": {"path": str(hf_dir)}})
    assert trial.llama_config().hidden_size == 64


def test_set_names_the_space_yaml_needs_after_a_colon():
    from ray_jax_train.run_config import ConfigError, apply_overrides

    with pytest.raises(ConfigError, match=r"space after each colon.*--set 'scaling.mesh=\{dp: 1, fsdp: 1, tp: 2\}'"):
        apply_overrides({}, ["scaling.mesh={dp:1,fsdp:1,tp:2}"])
    assert apply_overrides({}, ["scaling.mesh={dp: 1, tp: 2}"])["scaling"]["mesh"] == {"dp": 1, "tp": 2}


def test_set_reaches_a_dotted_search_key():
    from ray_jax_train.run_config import load_config

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = load_config(os.path.join(here, "examples", "tune_tiny_llama.yaml"),
                         ["tune.param_space.training.learning_rate={choice: [0.001, 0.003]}"])
    # Before: split at every dot, it failed with "'training' is not tunable".
    assert config.tune.param_space["training.learning_rate"] == {"choice": [0.001, 0.003]}


def test_storage_the_driver_cannot_write_exits_2_and_the_resume_hint_pastes_back(tmp_path, capsys, monkeypatch):
    import shlex
    from types import SimpleNamespace

    from ray_jax_train.cli import _resume_hint

    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the storage directory should go")
    # Before: the tokenizer's save raised NotADirectoryError/PermissionError as a traceback, exit 1, after Ray was up;
    # then "[Errno 2] No such file or directory" seconds in, naming no key. Now said before Ray starts.
    for command, config in (("fit", TINY), ("tune", os.path.join(REPO, "examples", "tune_tiny_llama.yaml"))):
        code, _, err = run([command, config, "--set", f"run.storage_path={blocked}"], capsys)
        assert code == 2 and f"run.storage_path: {blocked} is a file" in err, err
    code, _, err = run(["fit", TINY, "--set", f"run.storage_path={blocked / 'runs'}"], capsys)
    assert code == 2 and f"run.storage_path: {blocked} is a file; runs are directories under {blocked / 'runs'}" \
        in err, err
    # `config validate` says so too (it said "valid" for what fit refuses; a CLI review), and makes nothing.
    for storage in (blocked, blocked / "runs"):
        code, _, err = run(["config", "validate", TINY, "--set", f"run.storage_path={storage}"], capsys)
        assert code == 2 and f"run.storage_path: {blocked} is a file" in err, err
    code, out, _ = run(["config", "validate", TINY, "--set", f"run.storage_path={tmp_path / 'new' / 'runs'}"], capsys)
    assert code == 0 and "valid" in out and not (tmp_path / "new").exists()
    code, _, err = run(["config", "validate", TINY, "--set", f"run.storage_path=file://{blocked}"], capsys)
    assert code == 2 and f"run.storage_path: {blocked} is a file" in err, err  # a file:// URI is a local path
    # The stdlib corpus's text is in 'text': another text_column failed once Ray had read it (a CLI review).
    code, _, err = run(["config", "validate", TINY, "--set", "training.text_column=body"], capsys)
    assert code == 2 and "training.text_column='body', but data.source is the built-in stdlib corpus" in err, err
    # fit of a search's config trains once with its own values: said (it was silent; a CLI review).
    code, _, err = run(["fit", os.path.join(REPO, "examples", "tune_tiny_llama.yaml"), "--set",
                        f"run.storage_path={blocked}"], capsys)
    assert code == 2 and "has a tune section, which fit does not read" in err, err
    # generate --tokenizer naming nothing: said so (it said the directory "holds no tokenizer; pass --tokenizer").
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    code, _, err = run(["generate", str(tmp_path / "model"), "--prompt", "x", "--tokenizer", str(tmp_path / "no")],
                       capsys)
    assert code == 2 and f"--tokenizer {tmp_path / 'no'}: no such directory" in err, err
    hint = _resume_hint(SimpleNamespace(config="my config.yaml", overrides=["scaling.mesh={dp: 2}"]), "exp 2")
    assert shlex.split(hint)[2:] == ["my config.yaml", "--set", "scaling.mesh={dp: 2}", "--set", "run.name=exp 2"]
    # As a job's entrypoint (Ray sets this variable there) the resume is a job too: run by hand on the head, the
    # command would start a private Ray beside the cluster's.
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_1.zip"}}))
    hint = _resume_hint(SimpleNamespace(config="c.yaml", overrides=[]), "exp")
    assert hint == "ray job submit --working-dir . -- ray-jax-train fit c.yaml --set run.name=exp", hint
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {}}))
    assert _resume_hint(SimpleNamespace(config="c.yaml", overrides=[]), "exp").startswith("ray job submit -- ray-jax")


def test_tune_resume_without_a_stable_search_name_exits_2_before_ray_starts(tmp_path, capsys):
    """`tune --resume` finds the search by its name; with neither tune.name nor run.name, every search is named
    by the clock, so there is never one to resume."""
    data = yaml.safe_load(open(os.path.join(REPO, "examples", "tune_tiny_llama.yaml")))
    del data["tune"]["name"]
    data["run"]["storage_path"] = str(tmp_path)
    code, _, err = run(["tune", write(tmp_path, data), "--resume"], capsys)
    assert code == 2 and "set tune.name" in err, err


def test_a_quiet_driver_shows_one_line_of_a_worker_ended_because_its_peer_died():
    """A worker SIGKILLed mid-run: JAX's coordination service ends its peer, which printed 25 lines (a C++ stack
    trace, the SIGABRT report, Python's fatal-error dump) that read like a crash of their own, in a run that resumed
    fine (a soak review). The lines are the ones that run printed; the workers' log files keep them all."""
    from ray_jax_train.quiet import WorkerLines

    ending = [
        "E1127 13:40:24.538966   25379 preemption_sync_manager.cc:159] Failed to cancel preemption barrier: "
        "FAILED_PRECONDITION: Tried to cancel non-existent barrier PREEMPTION_SYNC_BARRIER.",
        "E1127 13:40:24.539024   25379 coordination_service_agent.cc:289] Polled an error from coordination service "
        "(this can be an error from this or another task).",
        "F1127 13:40:24.539032   25379 client.h:80] Terminating process because the JAX distributed service detected "
        "fatal errors. This most likely indicates that another task died; see the other task logs for more details.",
        "Additional GRPC error information from remote target coordination_service while calling "
        "/xla.coordination.CoordinationService/PollForError:",
        "*** Check failure stack trace: ***",
        "    @     0x7fae84740634  absl::lts_20260107::log_internal::LogMessage::SendToLog()",
        "*** SIGABRT received at time=1795786824 on cpu 1 ***", "Fatal Python error: Aborted", "",
        "Extension modules: msgpack._cmsgpack, google._upb._message, psutil._psutil_linux"]
    keep = WorkerLines()
    assert keep(25054, ending[:4]) == [ending[2]] and keep(25054, ending[4:]) == []
    shown = ["Resuming at step 2000 from /runs/kill2/checkpoint_000002000_5f5c3f99.", "*** Check failure stack trace: ***"]
    assert keep(27362, shown) == shown  # another worker's lines, a crash of its own included, all stay
    assert keep(1, ["[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"]) == []


def test_the_driver_s_own_ray_log_level_line_is_left_out_of_a_quiet_cli_s_stderr():
    """Ray's C++ logging announced RAY_BACKEND_LOG_LEVEL on the driver's stderr as ray.init started, the first
    line of every quiet run (a new user's walkthrough); no logger setting reaches it. Written to the descriptor, as
    C++ does; everything else passes, in order, and stderr is the terminal's again after."""
    script = (
        "import os, sys\n"
        "from ray_jax_train.quiet import without_ray_start_line\n"
        "with without_ray_start_line():\n"
        "    os.write(2, b'before\\n[2026-12-03 12:24:35,150 I 1855 1855] logging.cc:303: Set ray log level from '\n"
        "             b'environment variable RAY_BACKEND_LOG_LEVEL to 3\\nafter\\n')\n"
        "    print('from python', file=sys.stderr)\n"
        "    os.write(2, b'no newline')\n"
        "os.write(2, b'\\nrestored\\n')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr
    assert done.stderr == b"before\nafter\nfrom python\nno newline\nrestored\n", done.stderr


def test_quiet_workers_silence_ray_loggers_named_by_file_path():
    # Train logs "Reporting training result N: TrainingReport(...)" once per report through
    # logging.getLogger(__file__): a path, which the match on "ray.*" names missed.
    import logging
    import warnings

    from absl import logging as absl_logging
    from ray.train.v2._internal.execution import context

    from ray_jax_train.quiet import quiet_worker

    def loggers():
        return [v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger)]

    saved = {logger: logger.level for logger in loggers()}
    verbosity = absl_logging.get_verbosity()
    context.logger.setLevel(logging.INFO)  # as in a Ray worker
    try:
        with warnings.catch_warnings():
            quiet_worker()
        assert not context.logger.isEnabledFor(logging.INFO)
    finally:
        for logger in loggers():  # other tests read these loggers' INFO lines
            logger.setLevel(saved.get(logger, logging.NOTSET))
        absl_logging.set_verbosity(verbosity)


def test_ctrl_c_or_ray_job_stop_during_fit_exits_130_with_the_resume_command(tmp_path):
    """Ray Train's SIGINT handler aborted the run and ended in sys.exit(0), which left the process with exit 1 and
    no word; the README promises 130, "interrupted" and the command that resumes. `ray job stop` sends SIGTERM,
    which ended the log in a C++ signal dump (an ops review): it now takes Ctrl-C's path, which it is sent here."""
    import signal
    import time

    command = [sys.executable, "-m", "ray_jax_train", "fit", TINY, "--address", "local", "--set", "run.name=sigint",
               "--set", f"run.storage_path={tmp_path}", "--set", "training.total_steps=5000",
               "--set", "training.log_steps=2", "--set", "data.max_docs=30", "--set", "training.quiet=true"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = tmp_path / "fit.log"
    started = time.time()
    with open(log, "w") as out:
        fit = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        try:
            while not (tmp_path / "sigint" / "metrics.jsonl").exists():
                assert fit.poll() is None, log.read_text()[-5000:]
                assert time.time() - started < 240, log.read_text()[-5000:]
                time.sleep(0.2)
            fit.send_signal(signal.SIGTERM)
            assert fit.wait(timeout=120) == 130, log.read_text()[-5000:]
        finally:
            if fit.poll() is None:
                fit.kill()
    text = log.read_text()
    assert "ray-jax-train: interrupted" in text and "resume:" in text and "run.name=sigint" in text, text[-3000:]
    assert "stopping on SIGTERM (`ray job stop`?); resume: ray-jax-train fit" in text, text[-3000:]
    assert "*** SIGTERM received at time" not in text, text[-3000:]
    assert "[train" not in text, text[-3000:]  # training.quiet: no progress lines
    assert "command above: no checkpoint saved yet" in text or "command above: from the checkpoint of step" in text, \
        text[-3000:]
    assert text.count("--set run.name=sigint") == 1, text[-3000:]  # the command, said once: at the SIGTERM
    # Ray aborts the run by killing its workers: no preemption notice promising a checkpoint that never comes.
    assert "SIGTERM received" not in text, text[-3000:]


def test_a_private_ray_names_its_dashboard_to_its_own_processes():
    """Train's placement-group cleaner asks the state API, and with several Ray instances on one machine Ray's
    address lookup refused to pick one: the cleaner died with a traceback (a review, Python API runs)."""
    import importlib.util

    from ray_jax_train.trainer import with_named_dashboard

    assert with_named_dashboard({"include_dashboard": False}) == {"include_dashboard": False}
    if not all(importlib.util.find_spec(m) for m in ("aiohttp", "aiohttp_cors", "opencensus")):
        assert with_named_dashboard({}) == {}  # no dashboard can start: nothing to name
        return
    given = {"runtime_env": {"env_vars": {"A": "1"}, "pip": ["x"]}, "dashboard_port": 8999}
    named = with_named_dashboard(given)
    assert named["runtime_env"] == {"env_vars": {"A": "1", "RAY_API_SERVER_ADDRESS": "http://127.0.0.1:8999"},
                                    "pip": ["x"]}
    assert given["runtime_env"]["env_vars"] == {"A": "1"}  # the caller's dict is left alone
    assert isinstance(with_named_dashboard({})["dashboard_port"], int)
    assert isinstance(with_named_dashboard({"dashboard_port": None})["dashboard_port"], int)
    remote = with_named_dashboard({"dashboard_host": "10.1.2.3", "dashboard_port": 8265})
    assert remote["runtime_env"]["env_vars"]["RAY_API_SERVER_ADDRESS"] == "http://10.1.2.3:8265"


def test_the_summary_counts_restarts_from_the_steps_logged_again(tmp_path, capsys):
    """A run whose group failed and resumed logs the steps after its checkpoint again; the summary says so (a
    fault-tolerance review: nothing in the output told a restarted run from a clean one)."""
    import argparse
    import time
    import types

    from ray_jax_train.cli import _summary

    steps = [2, 4, 6, 4, 6, 8, 8, 10]  # resumed at 2 (step 4 logged again), then at 6 (step 8 again)
    firsts = {0: 0, 3: 3, 6: 0}  # each attempt's first record carries its start-up facts: where it started from
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 5.0 - s / 10, **({"startup_s": 3.0, "start_step": firsts[i]}
                                                        if i in firsts else {})}) + "\n"
        for i, s in enumerate(steps)))
    args = argparse.Namespace(config="c.yaml", overrides=[])
    _summary(args, types.SimpleNamespace(checkpoint=None), {"run_dir": str(tmp_path), "name": "r"}, time.time())
    out = capsys.readouterr().out
    assert "restarts:    2 (from step 3, the start)" in out, out  # the second one had no checkpoint to resume
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0, **({"startup_s": 1.0} if s == 2
                                                                                       else {})}) + "\n" for s in (2, 4)))
    _summary(args, types.SimpleNamespace(checkpoint=None), {"run_dir": str(tmp_path), "name": "r"}, time.time())
    assert "restarts" not in capsys.readouterr().out
    # The loop marks each attempt as it starts: two that died before their first log step count too (an OOM in
    # the first compile restarted the group twice, and the summary said no restart).
    from ray_jax_train.plot import attempt_line

    lines = [attempt_line(0), json.dumps({"step": 2, "loss": 1.0, "startup_s": 1.0, "start_step": 0}),
             attempt_line(2), attempt_line(2), json.dumps({"step": 4, "loss": 0.9, "startup_s": 1.0, "start_step": 2})]
    (tmp_path / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    _summary(args, types.SimpleNamespace(checkpoint=None), {"run_dir": str(tmp_path), "name": "r"}, time.time())
    out = capsys.readouterr().out
    assert "restarts:    2 (from step 2, step 2)" in out and "1.000 (step 2) -> 0.900 (step 4)" in out, out


def test_model_scaling_index_multiplies_the_widths_and_can_be_searched(tmp_path, capsys):
    """EasyDeL's scaling_index in a config file, as RayDistributedTrainer.train takes it (a Tune review: model size
    could not be searched in one key, and the error suggested 'sliding_window')."""
    base = yaml.safe_load(run(["config", "show", TINY], capsys)[1])["model"]
    code, out, err = run(["config", "show", TINY, "--set", "model.scaling_index=2"], capsys)
    assert code == 0, err
    scaled = yaml.safe_load(out)["model"]
    for name in ("hidden_size", "intermediate_size", "num_attention_heads"):
        assert scaled[name] == 2 * base[name], (name, base, scaled)
    assert scaled["head_dim"] == base["head_dim"] and scaled["num_hidden_layers"] == base["num_hidden_layers"]
    assert "scaling_index" not in yaml.safe_load(out)["model"]  # shown scaled once: it reads back as the same run
    data = yaml.safe_load(open(TINY))
    data["tune"] = {"param_space": {"model.scaling_index": {"grid_search": [1, 2]}}}
    code, _, err = run(["config", "validate", write(tmp_path, data)], capsys)
    assert code == 0, err
    # `config show` of a search over the model reads back as the same search: shown scaled (scaling_index 2, then
    # each trial's index on top) or with the base's head_dim, a trial got another model (a config review).
    from ray_jax_train.run_config import load_config

    data["model"]["scaling_index"] = 2
    searched = write(tmp_path, data)
    code, out, err = run(["config", "show", searched], capsys)
    assert code == 0, err
    (tmp_path / "shown.yaml").write_text(out)
    again, given = load_config(str(tmp_path / "shown.yaml")), load_config(searched)
    assert again.model == given.model and again.tune == given.tune


def test_a_bad_row_found_while_ray_data_tokenises_is_named_not_ray_s_retry_advice():
    """A row past the first ones the driver checks fails inside a Ray Data map task: `fit` printed 60 lines of
    traceback and exited 1, and the error's last line was Ray Data's retry advice, not the row's problem."""
    import ray.exceptions

    from ray_jax_train.run_config import read_error

    traceback_text = (
        "Traceback (most recent call last):\n"
        '  File "ray_jax_train/text/encode.py", line 81, in check_roles\n'
        "ray_jax_train.text.errors.TextDataError: message 0 of a conversation has no string 'role' ({'content': "
        "'x'}): each message needs a role.\n\nThe above exception was the direct cause of the following exception:\n\n"
        "ray::MapWorker(MapBatches(TokenizeAndPack)).submit() (pid=7627)\n"
        "ray.exceptions.UserCodeException: UDF failed to process a data block.\n"
        "Failed to apply UDF transform after 1/1 attempts (total backoff 0.0s).\n"
        "To change retry attempts, configure `ray.data.DataContext.get_current()` if you believe this to be "
        "transient.")
    exc = ray.exceptions.RayTaskError("submit", traceback_text,
                                      ray.exceptions.UserCodeException("UDF failed")).as_instanceof_cause()
    assert read_error(exc) == ("message 0 of a conversation has no string 'role' ({'content': 'x'}): each message "
                               "needs a role.")
    assert read_error(ValueError("plain")) == "plain"
    # A JSON lines shard cut short: Arrow's words ("when decoding") got no hint at the formats.
    cut = ray.exceptions.RayTaskError("read", "Traceback\npyarrow.lib.ArrowInvalid: JSON parse error: Unmatched '\"' "
                                      "when decoding 'string' at position 5280", ValueError("x")).as_instanceof_cause()
    assert "JSON parse error: Unmatched" in read_error(cut) and "JSON lines (.jsonl" in read_error(cut)


def test_paths_that_are_files_or_hold_no_tokenizer_exit_2_saying_so(tmp_path, capsys):
    """A file was "does not exist"; a directory without a tokenizer failed in transformers, which named no key and
    advised installing sentencepiece (a review)."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    cases = [("tokenizer.path", tmp_path / "file", "is a file, not a tokenizer directory"),
             ("tokenizer.path", tmp_path / "empty", "holds no tokenizer; set it to a directory saved with"),
             ("model.init_from", tmp_path / "file", "is a file, not a directory")]
    cases.append(("run.name", "../escaped", "must name one directory under the storage path"))  # wrote outside it
    from ray_jax_train.text import train_tokenizer

    train_tokenizer(["some words to learn here and there"] * 30, vocab_size=300, save_dir=str(tmp_path / "tok"))
    code, _, err = run(["config", "validate", TINY, "--set", f"tokenizer.path={tmp_path / 'tok'}", "--set",
                        "model.vocab_size=100"], capsys)  # said 30 s into `fit`, with Ray up
    assert code == 2 and "model.vocab_size: The tokenizer gives ids up to" in err, err
    # The same for a tokenizer trained at run time, up to tokenizer.vocab_size: it failed 20-30 s into `fit`.
    code, _, err = run(["config", "validate", TINY, "--set", "model.vocab_size=299"], capsys)  # TINY's: 300
    assert code == 2 and "model.vocab_size=299 is below tokenizer.vocab_size=300" in err, err
    assert run(["config", "validate", TINY, "--set", "model.vocab_size=300"], capsys)[0] == 0
    for key, path, said in cases:
        code, _, err = run(["config", "validate", TINY, "--set", f"{key}={path}"], capsys)
        assert code == 2 and key in err and said in err, err


def test_data_files_that_hold_nothing_to_read_exit_2_before_ray(tmp_path, capsys):
    """Empty files, an empty directory, a directory of no data format: `config validate` said valid, and `fit` said
    so 10-30 s later, once Ray was up (a review). A listing tells."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "nothing").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.md").write_text("# notes")
    cases = {"empty.jsonl": "every file in", "nothing": "no files found under", "notes": "cannot tell the file format"}
    # JSON lines are read line by line: a line that is not one JSON object, or a byte-order mark, failed the read
    # once Ray was up (a CLI review). Arrow reads a .json, which may spread an object over lines or start with a BOM.
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{"text": "b", cut\n{"text": "c"}\n')
    (tmp_path / "bom.jsonl").write_text('{"text": "a"}\n', encoding="utf-8-sig")
    cases["broken.jsonl"] = (f"The first row that cannot be read as a document: {tmp_path / 'broken.jsonl'}, line 2: "
                             "not a JSON object")
    cases["bom.jsonl"] = f"{tmp_path / 'bom.jsonl'} starts with a UTF-8 byte-order mark"
    for name, said in cases.items():
        code, _, err = run(["config", "validate", TINY, "--set", f"data.source={tmp_path / name}"], capsys)
        assert code == 2 and f"data.source: {said}" in err, err
    (tmp_path / "fine").mkdir()
    (tmp_path / "fine" / "spread.json").write_text('{\n  "text": "a"\n}\n', encoding="utf-8-sig")
    assert run(["config", "validate", TINY, "--set", f"data.source={tmp_path / 'fine'}"], capsys)[0] == 0


def test_a_run_stopped_before_ray_registered_a_checkpoint_resumes_from_its_finished_one(tmp_path, capsys):
    """A second Ctrl-C can end the driver before Ray registers the first save: no record, one finished checkpoint.
    The next start resumes from it; the driver said "(no checkpoint saved yet: it starts over)", and export
    found nothing (a review)."""
    import time

    from ray_jax_train.checkpoint.core import FORMAT, META_FILE, STATE_ITEM
    from ray_jax_train.cli import _resume_point

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 20, "loss": 5.0}\n')
    assert _resume_point(str(run_dir)) == "(no checkpoint saved yet: it starts over)"
    for step, finished in ((20, True), (30, False)):  # the step-30 save was cut off: not offered
        checkpoint = run_dir / f"checkpoint_{step:09d}_0a1b2c3d"
        (checkpoint / META_FILE).parent.mkdir(parents=True)
        (checkpoint / META_FILE).write_text(json.dumps({"format": FORMAT, "step": step, "time": time.time()}))
        (checkpoint / "_CHECKPOINT_METADATA").write_text("{}")
        if finished:
            (checkpoint / STATE_ITEM).mkdir()
            (checkpoint / STATE_ITEM / "_METADATA").write_text("{}")
    assert _resume_point(str(run_dir)) == "(from the checkpoint of step 20)"
    # Starting this run over beside its checkpoint trained a new tokenizer over the one the checkpoint needs (a
    # review: an export of it then paired its weights with other ids). Refused before Ray starts.
    code, _, err = run(["fit", TINY, "--set", f"run.storage_path={tmp_path}", "--set", "run.name=run",
                        "--set", "training.resume_if_possible=false"], capsys)
    assert code == 2 and "would start run 'run' over" in err and "checkpoint_000000020_0a1b2c3d" in err, err
    assert "another run.name, or move" in err, err
    assert not (run_dir / "tokenizer").exists()
    # A file where final_model/ goes failed the run as training ended, with a bare FileExistsError, and it
    # restarted (a review). Refused before Ray starts; with the final model off, nothing is in the way.
    (run_dir / "final_model").write_text("notes")
    code, _, err = run(["fit", TINY, "--set", f"run.storage_path={tmp_path}", "--set", "run.name=run"], capsys)
    assert code == 2 and f"run.name: {run_dir / 'final_model'} is a file, where this run writes" in err, err
    assert "training.save_final_model=false" in err, err
    from ray_jax_train.lm.export import final_model_blocked

    assert final_model_blocked(str(tmp_path)) is None and final_model_blocked(str(run_dir))


def test_the_summary_gives_the_median_speed_of_the_log_steps(tmp_path, capsys):
    """It gave the last log step's tokens/s: 801 or 10550 where the run's median was about 4400 (a review)."""
    from types import SimpleNamespace

    from ray_jax_train.cli import _summary

    rates = [4400, 4300, 4500, 801]  # the last interval held an eval and a save
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": 10 * (i + 1), "loss": 5.0 - i, "tokens_per_s": r}) + "\n" for i, r in enumerate(rates)))
    args = SimpleNamespace(config="c.yaml", overrides=[])
    _summary(args, SimpleNamespace(checkpoint=None), {"name": "x", "run_dir": str(tmp_path)}, time.time())
    assert "; 4400 tokens/s (median of 4 log steps)" in capsys.readouterr().out
