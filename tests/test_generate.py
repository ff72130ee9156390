"""Text generation: the KV-cached decode against full forward passes and transformers, sampling, errors and the CLI."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ray_jax_train.cli import main
from ray_jax_train.config import LlamaConfig
from ray_jax_train.models import create_model, generate, generate_text, save_pretrained
from ray_jax_train.text import local_corpus, train_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Grouped-query attention (4 query heads share 2 key/value heads).
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rope_theta=1000.0)


def random_model(seed=0, **overrides):
    """Random weights set from numpy: skips eager JAX init, which compiles every random op."""
    model = create_model(LlamaConfig(**{**TINY, **overrides}), lazy=True)
    rng = np.random.default_rng(seed)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype),
                                   nnx.state(model)))
    return model


def left_padded(lengths, width, vocab=TINY["vocab_size"], seed=1):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, size=(len(lengths), width)).astype(np.int32)
    mask = (np.arange(width)[None, :] >= width - np.asarray(lengths)[:, None]).astype(np.int32)
    return np.where(mask == 1, ids, 0), mask


@pytest.fixture(scope="module")
def model():
    return random_model()


@pytest.fixture(scope="module")
def prompts():
    return left_padded([7, 3, 5], 7)


@pytest.fixture(scope="module")
def greedy(model, prompts):
    return np.asarray(generate(model, *prompts, max_new_tokens=12))


@nnx.jit
def forward(model, ids, mask):
    return model(ids, mask)


def test_cached_greedy_equals_recomputing_the_whole_sequence():
    # A window shorter than the sequences, so the cache's window mask is exercised too.
    model = random_model(seed=3, model_type="mistral", sliding_window=5)
    ids, mask = left_padded([7, 2, 5], 7)
    n = 10
    out = np.asarray(generate(model, ids, mask, max_new_tokens=n))
    # The reference re-runs the full forward pass on one fixed-width buffer: the still-empty columns lie in every
    # earlier position's causal future, so they change nothing, and one compiled program serves every step.
    buf = np.concatenate([ids, np.zeros((3, n), np.int32)], axis=1)
    buf_mask = np.concatenate([mask, np.ones((3, n), np.int32)], axis=1)
    for t in range(n):
        logits = np.asarray(forward(model, jnp.asarray(buf), jnp.asarray(buf_mask)))
        buf[:, 7 + t] = logits[:, 6 + t].argmax(-1)
    np.testing.assert_array_equal(out, buf[:, 7:])
    assert len(set(out[0].tolist())) > 1, "degenerate reference: the model repeats one token"


def test_greedy_tokens_match_transformers_generate(model, prompts, greedy, tmp_path):
    # Imported here, not at the top: the 2 Ray workers of tests/test_sharding.py import this module (its model and
    # prompts, for generation over both), and torch with transformers took each of them over a second.
    import torch
    import transformers

    save_pretrained(model, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids, mask = prompts
    with torch.no_grad():
        hf_out = hf.generate(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask),
                             max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    np.testing.assert_array_equal(greedy, hf_out[:, ids.shape[1]:].numpy())


def test_a_model_sharded_over_a_mesh_generates_the_same_tokens(model, prompts, greedy):
    # Weights sharded the way training leaves them (FSDP x TP over the test process's 4 CPU devices).
    from ray_jax_train import llama_partition_rules, make_mesh, shard_by_rules

    graphdef, state = nnx.split(model)
    sharded = nnx.merge(graphdef, shard_by_rules(state, make_mesh({"fsdp": 2, "tp": 2}), llama_partition_rules()))
    assert {len(x.sharding.device_set) for x in jax.tree.leaves(nnx.state(sharded))} == {4}
    np.testing.assert_array_equal(np.asarray(generate(sharded, *prompts, max_new_tokens=12)), greedy)


def test_eos_ends_a_row_and_pads_after_it(model, prompts, greedy):
    eos = int(greedy[0, 2])
    out = np.asarray(generate(model, *prompts, max_new_tokens=12, eos_token_id=[127, eos], pad_token_id=-1))
    for row, ref in zip(out, greedy):
        hits = np.flatnonzero((ref == eos) | (ref == 127))
        end = hits[0] + 1 if len(hits) else len(ref)
        np.testing.assert_array_equal(row[:end], ref[:end])
        assert (row[end:] == -1).all()
    assert (out[0, 3:] == -1).all()
    # Like transformers' generate, the config's eos is the default; [] never stops (it ran past the config's eos).
    # Both on with_eos (the same weights, that eos in its config), so one compiled program serves the two calls.
    with_eos = random_model(eos_token_id=eos)
    stopped = np.asarray(generate(with_eos, *prompts, max_new_tokens=12, eos_token_id=eos, pad_token_id=-1))
    assert (stopped == -1).any()  # the eos does come up, so the default below is seen to stop
    np.testing.assert_array_equal(np.asarray(generate(with_eos, *prompts, max_new_tokens=12, pad_token_id=-1)),
                                  stopped)
    np.testing.assert_array_equal(np.asarray(generate(with_eos, *prompts, max_new_tokens=12, eos_token_id=[])), greedy)


def test_sampling_is_seeded_and_narrows_to_greedy(model, prompts, greedy):
    a = np.asarray(generate(model, *prompts, max_new_tokens=12, temperature=1.0, seed=3))
    np.testing.assert_array_equal(a, generate(model, *prompts, max_new_tokens=12, temperature=1.0, seed=3))
    assert not np.array_equal(a, generate(model, *prompts, max_new_tokens=12, temperature=1.0, seed=4))
    assert not np.array_equal(a, greedy)
    np.testing.assert_array_equal(greedy, generate(model, *prompts, max_new_tokens=12, temperature=0.7, top_k=1))
    # A nucleus this small holds only the likeliest token.
    np.testing.assert_array_equal(greedy, generate(model, *prompts, max_new_tokens=12, temperature=2.0,
                                                   top_p=1e-6, seed=5))
    # Below float32's smallest normal a temperature is 0 to XLA: greedy, not logits / 0. numpy numbers are numbers.
    np.testing.assert_array_equal(greedy, generate(model, *prompts, max_new_tokens=12, temperature=1e-40))
    np.testing.assert_array_equal(a, generate(model, *prompts, max_new_tokens=12, temperature=np.float32(1.0),
                                              top_p=np.float64(1.0), seed=3))


def test_a_cache_too_small_is_refused_not_overwritten(model):
    from ray_jax_train.models import KVCache

    cache = KVCache.create(model.config, 1, 4)
    _, cache = model.decode(jnp.array([[1, 2, 3]]), cache)
    with pytest.raises(ValueError, match=r"4 slots \(3 filled\), too few for 3 more tokens"):
        model.decode(jnp.array([[4, 5, 6]]), cache)


@pytest.mark.parametrize("change, message", [
    (dict(max_new_tokens=62), "exceeds the model's max_position_embeddings=64"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(temperature=True), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=0), "top_k must be a positive integer"),
    (dict(top_p=0.5), "narrows sampling, and temperature=0 decodes greedily"),  # was ignored without a word
    (dict(seed=None), "seed must be an integer"),
    (dict(input_ids=np.zeros((2, 0), np.int32)), "at least one column"),
    (dict(attention_mask=np.array([[0, 0, 0], [1, 1, 1]])), r"rows \[0\] have an empty prompt"),
    (dict(attention_mask=np.array([[1, 1, 0], [1, 1, 1]])), "must be left-padded"),
    (dict(input_ids=np.array([[1, 2, 128], [1, 2, 3]])), "outside \\[0, vocab_size=128\\)"),
])
def test_bad_arguments_are_refused_before_compiling(model, change, message):
    kwargs = {**dict(input_ids=np.array([[1, 2, 3], [4, 5, 6]]), attention_mask=None, max_new_tokens=4), **change}
    with pytest.raises(ValueError, match=message):
        generate(model, **kwargs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A run directory with a final_model/ as the LM loop writes it: HF safetensors plus the tokenizer."""
    tokenizer = train_tokenizer(local_corpus(max_total_chars=20_000), vocab_size=300)
    run = tmp_path_factory.mktemp("run")
    model = random_model(seed=2, vocab_size=len(tokenizer))
    save_pretrained(model, run / "final_model")
    tokenizer.save_pretrained(run / "final_model")
    return run, model, tokenizer


def test_generate_text_for_text_and_chat_prompts(model_dir):
    _, model, tokenizer = model_dir
    chat = [{"role": "user", "content": "What is JAX?"}]
    text, answer = generate_text(model, tokenizer, ["Once upon a time", chat], max_new_tokens=8)
    assert generate_text(model, tokenizer, "Once upon a time", max_new_tokens=8) == text
    assert generate_text(model, tokenizer, chat, max_new_tokens=8) == answer
    prompt = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True,
                                           add_generation_prompt=True)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(prompt[-1]) == "<|assistant|>"
    ids = np.asarray(generate(model, np.array([prompt]), max_new_tokens=8, eos_token_id=tokenizer.eos_token_id))[0]
    ids = ids[:list(ids).index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ids else ids
    assert answer == tokenizer.decode(ids, skip_special_tokens=True)
    with pytest.raises(ValueError, match="no prompts"):
        generate_text(model, tokenizer, [], max_new_tokens=8)
    # One message alone had its keys completed as two text prompts; a tokenizer directory is loaded.
    with pytest.raises(ValueError, match="got one message .* a conversation is a list of them"):
        generate_text(model, tokenizer, chat[0], max_new_tokens=8)
    with pytest.raises(ValueError, match="message 0 of the conversation needs a string 'role' and 'content'"):
        generate_text(model, tokenizer, [{"role": "user"}], max_new_tokens=8)
    assert generate_text(model, str(model_dir[0] / "final_model"), chat, max_new_tokens=8) == answer


def test_cli_generate_prints_the_completion(model_dir, capsys):
    run, model, tokenizer = model_dir
    expected = generate_text(model, tokenizer, "Once upon a time", max_new_tokens=6)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-m", "ray_jax_train", "generate", str(run), "--prompt", "Once upon a time",
                           "--max-new-tokens", "6"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"
    # The model directory itself works as well; mistakes exit 2 with a message.
    chat_hi = ["--prompt", "Hi", "--chat", "--max-new-tokens", "4"]  # the calls below reuse its compiled program
    assert main(["generate", str(run / "final_model"), *chat_hi]) == 0
    assert main(["generate", str(run), "--prompt", "Hi", "--top-p", "2"]) == 2
    assert main(["generate", str(run) + "-typo", "--prompt", "Hi"]) == 2
    assert "-typo does not exist: give a run directory" in capsys.readouterr().err
    # Without --max-new-tokens: 64, or what max_position_embeddings (64 here) leaves after the prompt.
    assert main(["generate", str(run), "--prompt", "Once upon a time"]) == 0
    assert main(["generate", str(run / "missing"), "--prompt", "Hi"]) == 2
    # As the summary of a run with file:// storage names it, and with a quoted `~` (a review: both were refused).
    assert main(["generate", (run / "final_model").as_uri(), *chat_hi]) == 0
    home = os.path.dirname(str(run))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", home)
        assert main(["generate", "~/" + run.name, *chat_hi]) == 0
    assert main(["generate", "s3://bucket/run", "--prompt", "Hi"]) == 2


def test_generation_config_eos_ends_the_cli_completion(model_dir, tmp_path, capsys):
    """An instruct model whose end-of-turn token only generation_config.json names (Llama 3's <|eot_id|>) kept
    talking past its answer: the CLI read config.json alone. The token the model says third now ends the text."""
    import json
    import shutil

    from ray_jax_train.models import generation_eos_ids

    run, model, tokenizer = model_dir
    full = generate_text(model, tokenizer, "Once upon a time", max_new_tokens=6)
    prompt = [tokenizer.bos_token_id] + tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
    tokens = np.asarray(generate(model, np.array([prompt]), max_new_tokens=6, eos_token_id=[]))[0]
    stop = int(tokens[2])
    assert stop not in tokens[:2] and stop not in (tokenizer.eos_token_id, model.config.eos_token_id), tokens
    expected = tokenizer.decode(tokens[:2], skip_special_tokens=True)
    assert expected != full
    instruct = tmp_path / "instruct"
    shutil.copytree(run / "final_model", instruct)
    (instruct / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop, 1]}))
    assert generation_eos_ids(instruct) == [stop, 1] and generation_eos_ids(run / "final_model") == []
    capsys.readouterr()
    assert main(["generate", str(instruct), "--prompt", "Once upon a time", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == expected + "\n"
    (instruct / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    assert main(["generate", str(instruct), "--prompt", "Hi"]) == 2
    assert "generation_config.json: eos_token_id '</s>' is not a token id" in capsys.readouterr().err


# Generation over two worker processes (weights split over both, the decode's collectives through gloo):
# test_a_model_sharded_over_two_worker_processes_generates_the_same_tokens in tests/test_sharding.py, whose 2-worker
# fit runs it beside the layouts, with this module's model and prompts.
