"""Exporting a run's checkpoints as Hugging Face model directories (`export_checkpoint`, `ray-jax-train export`)."""
import glob
import json
import time
import os
import shutil

import jax
import numpy as np
import pytest
from ray.train import RunConfig, ScalingConfig

import ray_jax_train as rjt
from ray_jax_train.cli import main
from ray_jax_train.config import LlamaConfig
from ray_jax_train.lm import TrainingArguments, export_checkpoint
from ray_jax_train.lm.loop import DEFAULT_COLUMNS, loop_config, train_loop_per_worker
from ray_jax_train.lm.state import split_model
from ray_jax_train.models import from_pretrained, load_hf_config
from ray_jax_train.text import load_tokenizer, pack_documents, train_tokenizer

SEQ = 32
GENERATION = {"eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6}  # an instruct model's: eos + end of turn


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    """A 2-worker run of 4 steps saving at steps 2 and 4, with a tokenizer and final_model/: (run dir, tokenizer)."""
    import ray.data

    tmp = tmp_path_factory.mktemp("export")
    tokenizer = train_tokenizer(["one two three four five six seven eight"] * 50, vocab_size=280)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    rng = np.random.default_rng(0)
    rows = pack_documents([rng.integers(1, len(tokenizer), rng.integers(4, 40)) for _ in range(60)], SEQ)
    dataset = ray.data.from_items([{k: rows[k][i] for k in rows} for i in range(len(rows["input_ids"]))])
    args = TrainingArguments(total_steps=4, batch_size=4, max_sequence_length=SEQ, learning_rate=1e-2, log_steps=2,
                             save_steps=2, save_final_model=True, progress_bar=False)
    trainer = rjt.JaxTrainer(
        train_loop_per_worker,
        # As a run from a Hugging Face model with a generation_config.json carries it (see _generation_config_of).
        train_loop_config=loop_config(args, config, 4, {}, list(DEFAULT_COLUMNS), False, tokenizer=tokenizer,
                                      generation_config=json.dumps(GENERATION)),
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="export", storage_path=str(tmp)), datasets={"train": dataset})
    result = trainer.fit()
    assert result.error is None, result.error
    return result.path, tokenizer


def _params(path):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in
            jax.tree_util.tree_leaves_with_path(split_model(from_pretrained(path))[1])}


def _checkpoints(run_dir):
    return sorted(os.path.join(run_dir, d) for d in os.listdir(run_dir) if d.startswith("checkpoint_0"))


def test_checkpoints_export_as_the_final_model_with_its_tokenizer(run, tmp_path, monkeypatch):
    run_dir, tokenizer = run
    early, last = _checkpoints(run_dir)
    final = _params(os.path.join(run_dir, "final_model"))

    # The run directory means its latest checkpoint: step 4, which final_model/ holds too, bit for bit.
    out = export_checkpoint(run_dir, tmp_path / "latest")
    exported = _params(out)
    assert exported.keys() == final.keys()
    assert all(np.array_equal(exported[k], final[k]) for k in final)
    assert load_tokenizer(out)("three four")["input_ids"] == tokenizer("three four")["input_ids"]

    assert main(["export", last, str(tmp_path / "cli")]) == 0
    by_cli = _params(tmp_path / "cli")
    assert all(np.array_equal(by_cli[k], final[k]) for k in final)
    assert os.path.isfile(tmp_path / "cli" / "tokenizer.json")
    # The generation settings of the model the run started from stay with every form of the trained one: without
    # them transformers' generate would run past an instruct model's end of turn.
    for directory in (os.path.join(run_dir, "final_model"), os.path.join(run_dir, "model"), out, tmp_path / "cli"):
        assert json.loads(open(os.path.join(directory, "generation_config.json")).read()) == GENERATION, directory
        assert rjt.generation_eos_ids(directory) == [2, 3]
    assert main(["export", last, str(tmp_path / "other_tok"), "--tokenizer", out]) == 0  # another tokenizer too
    assert rjt.generation_eos_ids(tmp_path / "other_tok") == [2, 3]
    assert load_tokenizer(tmp_path / "other_tok")("three four")["input_ids"] == tokenizer("three four")["input_ids"]

    export_checkpoint(early, tmp_path / "early")
    assert not all(np.array_equal(a, final[k]) for k, a in _params(tmp_path / "early").items())
    # The ray.train.Checkpoint that fit() returns, with a relative path: export failed with Ray's "cannot use
    # Checkpoint objects directly as paths", and restore called the good checkpoint corrupt (an API review).
    from ray.train import Checkpoint

    monkeypatch.chdir(os.path.dirname(early))
    relative = Checkpoint.from_directory(os.path.basename(early))
    from_object = _params(export_checkpoint(relative, tmp_path / "early_object"))
    assert all(np.array_equal(a, from_object[k]) for k, a in _params(tmp_path / "early").items())
    restored = rjt.restore(None, relative, fallback=False)
    assert restored.path == early and restored.step == rjt.restore(None, early, fallback=False).step > 0


def test_export_says_what_it_needs(run, tmp_path, capsys):
    run_dir, _ = run
    # A directory with files in it (a base model, a mistyped path) is refused before anything is read or written.
    base = tmp_path / "base_model"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"the user's own weights")
    with pytest.raises(FileExistsError, match="holds files already .* overwrite=True"):
        export_checkpoint(run_dir, base)
    assert main(["export", run_dir, str(base)]) == 2
    err = capsys.readouterr().err
    assert "or pass --overwrite." in err and "overwrite=True" not in err, err  # the CLI's own flag, not Python's
    # Not into the run itself, even with --overwrite: that mixed an HF model's files into the checkpoint it read.
    early, last = _checkpoints(run_dir)
    before = sorted(os.listdir(last))
    for inside, what in ((last, "is the checkpoint it exports"), (os.path.join(last, "hf"), "is inside the checkpoint"),
                         (run_dir, "is the run's directory"), (os.path.join(run_dir, "model"), "is the run's model/")):
        assert main(["export", run_dir, inside, "--overwrite"]) == 2
        assert what in capsys.readouterr().err
    assert sorted(os.listdir(last)) == before
    assert (base / "model.safetensors").read_bytes() == b"the user's own weights"
    (base / "generation_config.json").write_text("{}")  # the earlier model's; this run has its own
    assert main(["export", run_dir, str(base), "--overwrite"]) == 0
    assert _params(base).keys() == _params(os.path.join(run_dir, "final_model")).keys()
    # A dtype that cannot be refused before anything is written: the tokenizer's files were, and the retry with a
    # good one was refused for them (a CLI review).
    assert main(["export", run_dir, str(tmp_path / "int8"), "--dtype", "int8"]) == 2
    assert "int8" in capsys.readouterr().err and not os.path.exists(tmp_path / "int8")
    assert main(["export", run_dir, str(tmp_path / "int8"), "--dtype", "bfloat16"]) == 0
    assert rjt.generation_eos_ids(base) == [2, 3]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_checkpoint(tmp_path / "nothing", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="neither a ray_jax_train checkpoint .* It is a Hugging Face model "
                                                "directory already"):
        export_checkpoint(os.path.join(run_dir, "final_model"), tmp_path / "out")
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "nor a Ray Train run directory" in capsys.readouterr().err

    # A checkpoint from before configs were saved in checkpoints, of a run from before model/ was saved: it
    # needs the model config given by hand.
    old = tmp_path / "old_run" / os.path.basename(_checkpoints(run_dir)[-1])
    shutil.copytree(_checkpoints(run_dir)[-1], old)
    meta = json.loads((old / "meta" / "metadata").read_text())
    del meta["hf_config"]
    (old / "meta" / "metadata").write_text(json.dumps(meta))
    with pytest.raises(FileNotFoundError, match="no model/config.json.*model_config=<a directory with its "
                                                "config.json"):
        export_checkpoint(old, tmp_path / "out")
    final = os.path.join(run_dir, "final_model")
    assert main(["export", str(old), str(tmp_path / "old_out"), "--model-config", final, "--tokenizer", final]) == 0
    assert os.path.isfile(tmp_path / "old_out" / "tokenizer.json")
    final_params = _params(final)
    assert all(np.array_equal(a, final_params[k]) for k, a in _params(tmp_path / "old_out").items())
    # A config of another model is refused by the restore's shape check.
    other = tmp_path / "other"
    rjt.save_pretrained(rjt.create_model(load_hf_config(final).replace(hidden_size=64)), other)
    assert main(["export", str(old), str(tmp_path / "out"), "--model-config", str(other)]) == 2
    assert "holds a different train state" in capsys.readouterr().err
    # A damaged checkpoint (its metadata file gone) is named as such by the restore, not a bare file error.
    (old / "meta" / "metadata").unlink()
    with pytest.raises(Exception, match="meta/metadata is missing"):
        export_checkpoint(old, tmp_path / "out", model_config=final)


def test_each_checkpoint_exports_with_the_config_it_was_trained_with(run, tmp_path):
    run_dir, _ = run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    trained = json.loads((copy / "model" / "config.json").read_text())
    # A resume that changed a setting the restore's shape check cannot see rewrites model/config.json ...
    (copy / "model" / "config.json").write_text(json.dumps({**trained, "rope_theta": 1234.0}))
    early = _checkpoints(copy)[0]
    # (The data position is saved with the batch size it counts in, for a resume with another batch_size.)
    assert json.loads(open(os.path.join(early, "meta", "metadata")).read())["data_state"]["batch_size"] == 4
    out = export_checkpoint(early, tmp_path / "early")
    # ... but the earlier checkpoint keeps its own config, and model/ still gives the tokenizer.
    assert json.loads((tmp_path / "early" / "config.json").read_text())["rope_theta"] == trained["rope_theta"]
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))

    # A checkpoint alone, with no model/ beside it, exports too.
    alone = tmp_path / "alone" / os.path.basename(early)
    shutil.copytree(early, alone)
    export_checkpoint(alone, tmp_path / "alone_out")
    assert load_hf_config(tmp_path / "alone_out") == load_hf_config(tmp_path / "early")
    assert not os.path.isfile(tmp_path / "alone_out" / "tokenizer.json")
    # A model config given by hand that splits the same arrays into other heads (4 of 8 for 2 of 16): the restore
    # accepted it and the export computed other logits (a review); the checkpoint's own config refuses it.
    regrouped = load_hf_config(tmp_path / "early").replace(num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    with pytest.raises(ValueError, match=r"splits attention into other heads .*num_attention_heads=4 \(the "
                                         r"weights': 2\).*leave model_config out"):
        export_checkpoint(alone, tmp_path / "regrouped", model_config=regrouped)
    # model/ holds only whole files (they are written aside, then moved in).
    assert sorted(os.listdir(copy / "model")) == sorted(n for n in os.listdir(copy / "model") if not n.startswith("."))


def test_a_run_stopped_before_ray_registered_its_last_save_exports_that_save(run, tmp_path):
    """`ray job stop` can end a run after a save finished on storage and before Ray registered it: the run's
    newest state, which its next start resumes from, so exporting the run directory exports it too. A newer
    directory missing a file the restore needs (here its checksums) is not such a save."""
    run_dir, _ = run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    early, last = _checkpoints(copy)
    unregistered = copy / f"checkpoint_000000006_{os.path.basename(early)[-8:]}"
    shutil.copytree(early, unregistered)  # step 2's state under a newer step's name: which one was exported shows
    meta = json.loads((unregistered / "meta" / "metadata").read_text())
    (unregistered / "meta" / "metadata").write_text(json.dumps({**meta, "time": time.time()}))  # saved after step 4
    early_params = _params(export_checkpoint(early, tmp_path / "early"))
    exported = _params(export_checkpoint(copy, tmp_path / "newest"))
    assert all(np.array_equal(exported[k], early_params[k]) for k in early_params)
    final = _params(os.path.join(run_dir, "final_model"))
    # Saved before Ray's latest: an attempt's abandoned save that a later attempt, resuming from an older
    # checkpoint, overtook. And a newer save missing a file the restore needs is unfinished. Neither is exported.
    (unregistered / "meta" / "metadata").write_text(json.dumps(meta))
    exported = _params(export_checkpoint(copy, tmp_path / "older"))
    assert all(np.array_equal(exported[k], final[k]) for k in final)
    (unregistered / "meta" / "metadata").write_text(json.dumps({**meta, "time": time.time()}))
    (unregistered / "checksums.json").unlink()
    exported = _params(export_checkpoint(copy, tmp_path / "registered"))
    assert all(np.array_equal(exported[k], final[k]) for k in final)


def test_a_resume_with_another_model_is_refused_on_the_driver(run, tmp_path, caplog):
    """A resumed CLI run with another base model failed ~40 s in, in the workers, exit 1, listing optimizer arrays;
    the checkpoint records its model config, so the driver says it first (exit 2 through ConfigError)."""
    from ray_jax_train.run_config import ConfigError, check_resumed_model

    run_dir, tokenizer = run
    same = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    latest = _checkpoints(run_dir)[-1]
    with caplog.at_level("WARNING", logger="ray_jax_train.run_config"):
        assert check_resumed_model(run_dir, same) == latest  # the run's own model resumes
        assert "rope or norm" not in caplog.text
        # Shapes alike: it resumes, and says that the weights compute other logits from here on.
        assert check_resumed_model(run_dir, same.replace(rope_theta=500.0)) == latest
    assert "with other rope or norm settings than it trained with (rope_theta 10000.0 -> 500.0)" in caplog.text
    assert check_resumed_model(str(tmp_path / "new-run"), same.replace(hidden_size=64)) is None  # a new run
    with pytest.raises(ConfigError, match=r"hidden_size 32 -> 64; intermediate_size 64 -> 96.*--set run.name"):
        check_resumed_model(run_dir, same.replace(hidden_size=64, intermediate_size=96))
    # The params' dtype too: the workers' restore refused it ~100 s in (a review), on the driver now.
    with pytest.raises(ConfigError, match=r"\(param_dtype 'float32' -> 'bfloat16'\)"):
        check_resumed_model(run_dir, same.replace(param_dtype="bfloat16"))


def test_a_cli_resume_with_another_model_is_refused_before_ray_starts(run, capsys, monkeypatch):
    """`fit` found it 12-16 s in, once Ray was up (a CLI review); the run's tokenizer and checkpoint are on disk,
    so it is said before Ray starts."""
    import ray_jax_train.cli as cli

    run_dir, _ = run

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started before the resume was checked")

    monkeypatch.setattr(cli, "_connect", no_ray)
    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "tiny_llama.yaml")
    resume = ["fit", tiny, "--set", f"run.storage_path={os.path.dirname(run_dir)}", "--set",
              f"run.name={os.path.basename(run_dir)}", "--set", f"tokenizer.path={os.path.join(run_dir, 'model')}",
              "--set", "model.num_hidden_layers=1"]
    assert main(resume + ["--set", "model.hidden_size=64", "--set", "model.head_dim=32"]) == 2
    err = capsys.readouterr().err
    assert "whose model differs from the one the config builds now (hidden_size 32 -> 64" in err, err
    with pytest.raises(AssertionError, match="Ray was started"):  # the run's own model passes on to Ray
        main(resume)
    # At total_steps already, with final_model/ from that step: a rerun started Ray and a worker (30 s) to write it
    # again, and its summary counted the no-op as a restart (a new user's walkthrough). Now nothing starts.
    capsys.readouterr()
    assert main(resume + ["--set", "training.total_steps=4"]) == 0
    err = capsys.readouterr().err
    assert "is at step 4 already" in err and "Ray was not started" in err and "final_model" in err, err
    # A final_model/ older than the latest checkpoint (a run stopped between them) is written again, by the run.
    weights = glob.glob(os.path.join(run_dir, "final_model", "*.safetensors"))
    times = [(os.stat(w).st_atime, os.stat(w).st_mtime) for w in weights]
    try:
        for w in weights:
            os.utime(w, (0, 0))
        with pytest.raises(AssertionError, match="Ray was started"):
            main(resume + ["--set", "training.total_steps=4"])
    finally:
        for w, t in zip(weights, times):
            os.utime(w, t)


def test_a_fit_under_a_used_name_says_it_resumes_and_when_nothing_is_left(run, capsys):
    """It resumed without a word on the driver and, at or past total_steps, 'finished' at once with exit 0 and the
    earlier run's numbers (a user had changed the data and kept the name)."""
    from ray_jax_train.cli import _say_it_resumes
    from ray_jax_train.run_config import checkpoint_step

    latest = _checkpoints(run[0])[-1]
    assert checkpoint_step(latest) == 4 and checkpoint_step(None) is None
    _say_it_resumes({"name": "export", "resumes_from": latest, "resumes_at": 4, "total_steps": 10})
    out, err = capsys.readouterr()
    assert "run export exists: it resumes from its latest checkpoint, at step 4" in out and not err
    _say_it_resumes({"name": "export", "resumes_from": latest, "resumes_at": 4, "total_steps": 4})
    assert "at step 4 already, at or past training.total_steps=4: nothing is left to train" in capsys.readouterr().err
    _say_it_resumes({"name": "new", "resumes_from": None, "resumes_at": None, "total_steps": 4})
    assert capsys.readouterr() == ("", "")


def test_a_run_from_a_hugging_face_model_keeps_its_generation_config(tmp_path):
    """Read on the driver from the starting model's directory (the one place every node's run can get it from)."""
    from ray_jax_train.lm.loop import _generation_config_of

    (tmp_path / "generation_config.json").write_text(json.dumps(GENERATION))
    assert json.loads(_generation_config_of({"source": "hf", "path": str(tmp_path)})) == GENERATION
    assert _generation_config_of({"source": "hf", "path": str(tmp_path / "none")}) is None
    assert _generation_config_of({"source": "checkpoint", "path": str(tmp_path)}) is None
    assert _generation_config_of({}) is None


def test_generate_on_a_search_says_when_its_best_run_trained_on_after_it(run, tmp_path, capsys):
    """`generate <search dir>` uses the best trial's final_model/, `export <search dir>` its recorded checkpoint: they
    silently differed once the trial's run was continued after the search."""
    run_dir, _ = run
    early, last = _checkpoints(run_dir)
    search = tmp_path / "search"
    search.mkdir()
    for recorded, warned in ((last, False), (early, True)):
        (search / "best.json").write_text(json.dumps({"run_dir": run_dir, "checkpoint": recorded}))
        assert main(["generate", str(search), "--prompt", "one two", "--max-new-tokens", "2"]) == 0
        err = capsys.readouterr().err
        assert ("trained on after the search" in err) is warned, err
        assert ("ray-jax-train export " + str(search)) in err if warned else True
