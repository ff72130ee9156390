"""LlamaConfig validation / HF conversion and EasyDeL-style scaled configs."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from pydantic import ValidationError

from ray_jax_train.config import DEFAULT_SCALING_VARIABLES, LlamaConfig, MeshSpec, ModelScaling, canonical_dtype


def test_derived_fields_and_dtypes():
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, dtype=jnp.bfloat16, param_dtype="fp32")
    assert cfg.head_dim == 16 and cfg.num_key_value_heads == 4 and cfg.num_key_value_groups == 1
    assert cfg.dtype == "bfloat16" and cfg.param_dtype == "float32"
    assert cfg.jnp_dtype == jnp.bfloat16 and cfg.jnp_param_dtype == jnp.float32
    assert canonical_dtype(np.float16) == "float16"
    assert canonical_dtype(jnp.dtype("bfloat16")) == "bfloat16"
    # Explicit head_dim lifts the divisibility requirement (Mistral/Qwen3-style layouts).
    assert LlamaConfig(hidden_size=60, num_attention_heads=4, head_dim=32).head_dim == 32
    # usable as static jit data
    hash(LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0}))


def test_replace_derives_derived_fields_again():
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4)
    wider = cfg.replace(hidden_size=128)
    assert wider.head_dim == 32  # was 16: q_proj then gave 64 features for a 128-wide model
    more_heads = cfg.replace(num_attention_heads=8)
    assert (more_heads.num_key_value_heads, more_heads.head_dim) == (8, 8)  # still multi-head, not GQA
    gqa = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    assert gqa.replace(num_attention_heads=8).num_key_value_heads == 2  # a chosen grouping is kept
    fixed = LlamaConfig(hidden_size=60, num_attention_heads=4, head_dim=32)
    assert fixed.replace(hidden_size=120).head_dim == 32  # an explicit head_dim is not derived: kept
    assert cfg.replace(hidden_size=128, head_dim=8).head_dim == 8


def test_hidden_not_divisible_by_heads():
    with pytest.raises(ValidationError, match=r"hidden_size=100 is not divisible by num_attention_heads=8.*head_dim"):
        LlamaConfig(hidden_size=100, num_attention_heads=8)


def test_kv_heads_must_divide_heads():
    with pytest.raises(ValidationError, match=r"num_key_value_heads=3 does not divide num_attention_heads=8.*1, 2, 4, 8"):
        LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=3)


@pytest.mark.parametrize("bad", ["float33", "int8", "complex64", 3])
def test_bad_dtype(bad):
    with pytest.raises(ValidationError, match=r"dtype=.* is not a supported dtype; use one of float32, bfloat16, float16"):
        LlamaConfig(dtype=bad)
    with pytest.raises(ValidationError, match=r"param_dtype="):
        LlamaConfig(param_dtype=bad)


def test_unknown_field_and_model_type_rejected():
    with pytest.raises(ValidationError, match="hidden_sise"):
        LlamaConfig(hidden_sise=64)
    with pytest.raises(ValidationError, match=r"model_type='gpt2' is not supported; use one of llama, mistral, qwen2"):
        LlamaConfig(model_type="gpt2")


def test_json_round_trip_exact(tmp_path):
    cfg = LlamaConfig(vocab_size=100, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      dtype=jnp.bfloat16, param_dtype=jnp.float16, eos_token_id=[1, 2], remat=True,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    cfg.save_json(tmp_path / "c.json")
    back = LlamaConfig.load_json(tmp_path / "c.json")
    assert back == cfg
    assert back.dtype == "bfloat16" and back.param_dtype == "float16"
    assert json.loads((tmp_path / "c.json").read_text())["dtype"] == "bfloat16"


def test_hf_conversion_round_trip():
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, rope_theta=5000.0,
                                  tie_word_embeddings=True)
    cfg = LlamaConfig.from_hf(hf)
    assert (cfg.model_type, cfg.attention_bias, cfg.attention_out_bias) == ("qwen2", True, False)
    assert cfg.rope_theta == 5000.0 and cfg.tie_word_embeddings and cfg.head_dim == 16
    back = cfg.to_hf_config()
    assert type(back) is transformers.Qwen2Config
    assert back.rope_parameters["rope_theta"] == 5000.0 and back.num_key_value_heads == 2
    assert LlamaConfig.from_hf(back.to_dict()) == cfg
    # A qwen2 config built by hand (scaling, the CLI) gets Qwen2's q/k/v biases unless told otherwise.
    built = LlamaConfig(model_type="qwen2", vocab_size=128, hidden_size=64, num_attention_heads=4)
    assert (built.attention_bias, built.attention_out_bias) == (True, False) and built.to_hf_dict()
    # Llama's attention_bias means biases on q/k/v *and* o.
    llama = LlamaConfig.from_hf(transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, attention_bias=True))
    assert llama.attention_bias and llama.attention_out_bias
    with pytest.raises(ValueError, match="model_type='qwen2'"):
        llama.replace(attention_out_bias=False).to_hf_dict()
    with pytest.raises(ValueError, match="gpt2.*supported model types"):
        LlamaConfig.from_hf({"model_type": "gpt2"})


def test_scaling_dimensions():
    scaling = ModelScaling(base={"vocab_size": 1000, "num_hidden_layers": 2})
    assert scaling.scaling_variables == DEFAULT_SCALING_VARIABLES
    c1, c3 = scaling.create_config(1), scaling.create_config(3)
    assert (c1.hidden_size, c1.intermediate_size, c1.num_attention_heads, c1.num_key_value_heads) == (256, 1024, 2, 1)
    assert (c3.hidden_size, c3.intermediate_size, c3.num_attention_heads, c3.num_key_value_heads) == (768, 3072, 6, 3)
    assert c1.head_dim == c3.head_dim == 128
    for c in (c1, c3):  # fixed variables do not scale
        assert (c.vocab_size, c.num_hidden_layers, c.max_position_embeddings) == (1000, 2, 8192)
        assert (c.dtype, c.param_dtype, c.seed, c.initializer_range) == ("bfloat16", "float32", 0, 0.02)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_scaling_index_must_be_positive_int(bad):
    with pytest.raises(ValueError, match=r"scaling_index=.* must be an integer >= 1"):
        ModelScaling().create_config(bad)


def test_scaling_json_round_trip_exact(tmp_path):
    scaling = ModelScaling(
        model_type="mistral", base={"vocab_size": 512, "num_hidden_layers": 3, "tie_word_embeddings": True},
        config_scaling_variables={"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                  "num_key_value_heads": 2},
        dtype=jnp.float16, param_dtype=jnp.bfloat16, seed=654, max_position_embeddings=2048,
        initializer_range=0.01, sharding_axis_names=("dp", "fsdp", "sp", "tp"), sharding_axis_dims=(2, -1, 1, 2),
    )
    scaling.save_json(tmp_path / "s.json")
    back = ModelScaling.load_json(tmp_path / "s.json")
    assert back == scaling
    assert back.create_config(2) == scaling.create_config(2)
    assert (back.dtype, back.param_dtype) == ("float16", "bfloat16")
    assert back.mesh.axis_names == ("dp", "fsdp", "sp", "tp") and back.mesh.axis_dims == (2, -1, 1, 2)


def test_easydel_style_config_variables():
    scaling = ModelScaling(config_variables={"dtype": jnp.float32, "seed": 654, "vocab_size": 300,
                                             "num_hidden_layers": 1, "sharding_axis_dims": (1, 1, -1)})
    assert scaling.dtype == "float32" and scaling.seed == 654 and scaling.mesh.axis_dims == (1, 1, -1)
    assert scaling.base == {"vocab_size": 300, "num_hidden_layers": 1}
    with pytest.raises(ValidationError, match="'attn_mechanism' is not a LlamaConfig field"):
        ModelScaling(config_variables={"attn_mechanism": "flash"})


def test_scaling_rejects_inconsistent_variables():
    with pytest.raises(ValidationError, match="num_key_value_heads=2 does not divide num_attention_heads=3"):
        ModelScaling(scaling_variables={"hidden_size": 96, "intermediate_size": 64, "num_attention_heads": 3,
                                        "num_key_value_heads": 2})
    # kv heads scaled over fixed query heads: GQA at index 1, MHA at 2, refused at 3.
    with pytest.raises(ValidationError, match="num_key_value_heads is a scaling variable but num_attention_heads"):
        ModelScaling(base={"num_attention_heads": 4}, scaling_variables={"hidden_size": 64, "num_key_value_heads": 2})
    with pytest.raises(ValidationError, match="'rms_norm_eps' cannot be scaled"):
        ModelScaling(scaling_variables={**DEFAULT_SCALING_VARIABLES, "rms_norm_eps": 1})
    with pytest.raises(ValidationError, match="'dtype' is also set"):
        ModelScaling(base={"dtype": "float32"})


def test_mesh_inference_and_errors():
    assert MeshSpec().shape(8) == {"dp": 1, "fsdp": 8, "tp": 1}
    assert MeshSpec(axis_names=("dp", "tp"), axis_dims=(-1, 2)).resolve(8) == (4, 2)
    with pytest.raises(ValueError, match="not divisible"):
        MeshSpec(axis_dims=(1, -1, 3)).resolve(8)
    with pytest.raises(ValidationError, match="more than one -1"):
        MeshSpec(axis_dims=(-1, -1, 1))
    with pytest.raises(ValidationError, match="same length"):
        MeshSpec(axis_dims=(1, -1))


def test_create_model_lazy_has_no_arrays():
    import jax
    from flax import nnx

    from ray_jax_train.models import count_params, num_params

    scaling = ModelScaling(base={"vocab_size": 1000, "num_hidden_layers": 2})
    model = scaling.create_model(scaling_index=2, lazy=True)
    leaves = jax.tree.leaves(nnx.state(model))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert model.layers[0].self_attn.q_proj.kernel.get_value().shape == (512, 512)
    assert model.layers[0].self_attn.q_proj.kernel.get_value().dtype == jnp.float32  # param_dtype
    assert num_params(model) == count_params(scaling.create_config(2))


SMALL_HF = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)


def test_hf_import_uses_transformers_defaults_and_rope_precedence():
    transformers = pytest.importorskip("transformers")
    # config.json without sliding_window: MistralConfig's default window (4096), not "no window".
    assert LlamaConfig.from_hf({"model_type": "mistral", **SMALL_HF}).sliding_window == 4096
    assert LlamaConfig.from_hf({"model_type": "mistral", **SMALL_HF, "sliding_window": None}).sliding_window is None
    # rope_parameters' rope_theta beats the top-level one; rope_scaling beats rope_parameters (transformers' rules).
    d = {"model_type": "llama", **SMALL_HF, "max_position_embeddings": 64, "rope_theta": 1e6,
         "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert LlamaConfig.from_hf(d).rope_theta == 5e5 == transformers.LlamaConfig(**d).rope_parameters["rope_theta"]
    l3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    cfg = LlamaConfig.from_hf({**d, "rope_scaling": dict(l3)})
    assert cfg.rope_scaling == {**l3, "original_max_position_embeddings": 64}  # filled as transformers does
    # rope_scaling replaced rope_parameters whole, so the top-level rope_theta applies.
    ref = transformers.LlamaConfig(**{**d, "rope_scaling": dict(l3)}).rope_parameters
    assert cfg.rope_theta == ref["rope_theta"] == 1e6 and ref["rope_type"] == "llama3"
    with pytest.raises(ValueError, match=r"attention_dropout=0.1 is not supported.*set attention_dropout=0.0"):
        LlamaConfig.from_hf({"model_type": "llama", **SMALL_HF, "attention_dropout": 0.1})


def test_qwen2_sliding_window_import_and_export():
    transformers = pytest.importorskip("transformers")
    base = {"model_type": "qwen2", **SMALL_HF, "sliding_window": 8, "use_sliding_window": True}
    # transformers makes layers i >= max_window_layers sliding: >= num_hidden_layers means all full.
    assert LlamaConfig.from_hf({**base, "max_window_layers": 2}).sliding_window is None
    cfg = LlamaConfig.from_hf({**base, "max_window_layers": 0})
    assert cfg.sliding_window == 8
    hf = cfg.to_hf_config()
    assert hf.layer_types == ["sliding_attention"] * 2 and hf.sliding_window == 8
    assert LlamaConfig.from_hf(hf) == cfg
    with pytest.raises(ValueError, match=r"Qwen2 layer_types=\['full_attention', 'sliding_attention'\].*all sliding"):
        LlamaConfig.from_hf({**base, "max_window_layers": 1})
    assert transformers.Qwen2Config(**{k: v for k, v in base.items() if k != "model_type"},
                                    max_window_layers=1).layer_types[1] == "sliding_attention"


def test_configs_transformers_would_compute_differently_are_refused():
    with pytest.raises(ValidationError, match=r"HF Llama has no sliding window.*model_type='mistral'"):
        LlamaConfig(sliding_window=4)
    assert LlamaConfig(model_type="mistral", sliding_window=4).sliding_window == 4
    with pytest.raises(ValidationError, match=r"MistralForCausalLM has no attention biases.*model_type='llama'"):
        LlamaConfig(model_type="mistral", attention_bias=True, attention_out_bias=True)
    with pytest.raises(ValueError, match=r"MistralForCausalLM has no attention biases.*model_type='llama'"):
        LlamaConfig.from_hf({"model_type": "mistral", **SMALL_HF, "attention_bias": True})
    with pytest.raises(ValidationError, match=r"lacks numeric low_freq_factor, high_freq_factor"):
        LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0})
    # llama3 without original_max_position_embeddings takes max_position_embeddings, as in transformers.
    cfg = LlamaConfig(max_position_embeddings=128, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    assert cfg.rope_scaling["original_max_position_embeddings"] == 128


def test_cli_config_that_cannot_be_exported_fails_at_parse_time():
    # The final export runs after the last step; `ray-jax-train fit` must not train first and fail there.
    from ray_jax_train.run_config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="exporting a Hugging Face model"):
        parse_config({"model": {"type": "qwen2", "attention_bias": False}})


def test_booleans_are_refused_where_a_number_is_expected():
    # pydantic's lax mode read `batch_size: true` as 1: the run trained with another batch size and said nothing.
    from ray_jax_train.lm.arguments import TrainingArguments
    from ray_jax_train.run_config import ConfigError, parse_config

    for section, key in [("training", "batch_size"), ("training", "learning_rate"), ("scaling", "num_workers"),
                         ("model", "hidden_size"), ("data", "eval_fraction"), ("tune", "num_samples")]:
        with pytest.raises(ConfigError, match=rf"{section}\.{key}: wrong type: .*not a boolean"):
            parse_config({section: {key: True}})
    with pytest.raises(ConfigError, match=r"scaling\.mesh: wrong type: .*not a boolean"):
        parse_config({"scaling": {"mesh": {"dp": True}}})
    for build in (lambda: LlamaConfig(num_hidden_layers=False), lambda: MeshSpec(axis_dims=(1, True, 1)),
                  lambda: TrainingArguments(warmup_steps=True)):
        with pytest.raises(ValidationError, match="not a boolean"):
            build()
    # Numbers parse as before (an int in a float field, a whole float from a Tune quniform in an int field), and
    # boolean fields take booleans.
    config = parse_config({"training": {"batch_size": 4, "learning_rate": 1, "total_steps": 6.0, "progress_bar": False},
                           "scaling": {"cpus_per_worker": 2, "use_gpu": False}})
    args = config.training_arguments()
    assert (args.batch_size, args.learning_rate, args.total_steps, args.progress_bar) == (4, 1.0, 6, False)
    assert config.scaling.cpus_per_worker == 2.0
    assert LlamaConfig(rope_theta=500000, tie_word_embeddings=True).rope_theta == 500000.0


def test_gpu_extras_pin_the_same_jax_as_the_core_dependency():
    """`pip install '.[cuda12]'` must not pull a JAX other than the pinned one (the CUDA plugin matches jaxlib)."""
    import pathlib
    import re
    import tomllib

    project = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    core = next(d for d in project["dependencies"] if re.match(r"jax\s*[><=]", d))
    pin = core[len("jax"):]
    for extra in ("cuda12", "cuda13"):
        assert project["optional-dependencies"][extra] == [f"jax[{extra}]{pin}"]
    assert project["optional-dependencies"]["tpu"][0] == f"jax[tpu]{pin}"


def test_scheduler_settings_the_chosen_scheduler_would_ignore_are_refused():
    """`median` has no reduction_factor or max_t and `fifo` no grace_period either: they were accepted and ignored (a
    docs review). A full dump of the config, as a resumed search reads back, still parses."""
    from ray_jax_train.run_config import SchedulerSection

    with pytest.raises(ValidationError, match=r"reduction_factor, max_t set, but the median scheduler does not use "
                                              r"them .*use type: asha"):
        SchedulerSection(type="median", reduction_factor=3, max_t=10)
    with pytest.raises(ValidationError, match=r"grace_period set, but the fifo scheduler does not use it"):
        SchedulerSection(type="fifo", grace_period=5)
    for kind in ("asha", "median", "fifo"):
        SchedulerSection.model_validate(SchedulerSection(type=kind).model_dump())
    SchedulerSection(type="median", grace_period=3)


def test_a_name_from_another_trainer_is_pointed_at_ours_before_a_look_alike():
    """difflib's closest match was a valid key that does something else: max_steps -> max_eval_steps (the run then
    trained the config's total_steps), per_device_train_batch_size -> eval_batch_size, vocab_size under training
    -> eval_batch_size (a review)."""
    from ray_jax_train.run_config import ConfigError, apply_overrides, parse_config

    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "tiny_llama.yaml")
    import yaml

    base = yaml.safe_load(open(tiny))
    cases = {"training.max_steps=5": "'total_steps'", "training.per_device_train_batch_size=4": "'batch_size'",
             "training.block_size=32": "'max_sequence_length'", "training.vocab_size=300": "'model.vocab_size'",
             "model.max_seq_len=32": "'training.max_sequence_length'", "model.heads=2": "'num_attention_heads'",
             "training.max_eval_step=2": "'max_eval_steps'", "max_steps=3": "'training.total_steps'"}
    for flag, meant in cases.items():
        with pytest.raises(ConfigError, match=f"did you mean {meant}"):
            parse_config(apply_overrides(base, [flag]))


def test_a_training_precision_over_the_model_sections_is_said(caplog):
    """model.dtype: float32 with training.dtype: bfloat16 trained in bf16 without a word (a review)."""
    from ray_jax_train.run_config import load_config

    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "tiny_llama.yaml")
    with caplog.at_level("WARNING", logger="ray_jax_train.run_config"):
        assert load_config(tiny, ["training.dtype=bf16"]).llama_config(warn=True).dtype == "bfloat16"
        load_config(tiny, ["training.dtype=float32"]).llama_config(warn=True)
    assert caplog.text.count("overrides model.") == 1
    assert "training.dtype=bfloat16 overrides model.dtype=float32 for this run" in caplog.text


def test_a_yaml_number_with_a_leading_zero_is_refused_not_read_as_octal(tmp_path):
    """YAML 1.1 reads 012 as 10: total_steps: 012 trained 10 steps (a review)."""
    from ray_jax_train.run_config import ConfigError, apply_overrides, read_file

    path = tmp_path / "c.yaml"
    path.write_text("training:\n  total_steps: 012\n  batch_size: 0x10\n")
    with pytest.raises(ConfigError, match=r"012 \(line 2\) reads as the octal number 10 in YAML"):
        read_file(str(path))
    with pytest.raises(ConfigError, match=r"'run.name=010': 010 reads as the octal number 8 .*quoted, '010', for "):
        apply_overrides({}, ["run.name=010"])
    # Where octal and decimal agree (00, 07) nothing is refused (a review); a key given twice in --set is.
    assert apply_overrides({}, ["run.name='010'", "training.total_steps=07", "training.eval_steps=00"]) == {
        "run": {"name": "010"}, "training": {"total_steps": 7, "eval_steps": 0}}
    with pytest.raises(ConfigError, match=r"key 'dp' .* is given twice"):
        apply_overrides({}, ["scaling.mesh={dp: 2, dp: 4}"])
    path.write_text("training:\n  total_steps: 12\n  batch_size: 0x10\n")
    assert read_file(str(path))["training"] == {"total_steps": 12, "batch_size": 16}


def _example(name):
    import yaml

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "examples", name)) as f:
        return yaml.safe_load(f)


def test_a_malformed_searched_total_steps_is_a_config_error_not_a_traceback():
    """trial_lengths read training.total_steps' search space before it was checked: {} was a StopIteration,
    {uniform: 5} a TypeError, {randint: [3]} an IndexError, a string an int() ValueError (a review)."""
    from ray_jax_train.run_config import ConfigError, apply_overrides, parse_config

    base = _example("tune_tiny_llama.yaml")
    cases = {"{}": r"\{\} is not a search space; use one of", "{uniform: 5}": r"uniform: expected a non-empty list",
             "{randint: [3]}": r"randint: expected \[low, high\], got \[3\]",
             "{choice: 5}": r"choice: expected a non-empty list",
             "{choice: [a, b]}": r"(?s)training\.total_steps: trials given 'a' would fail: .*got 'a'",
             "abc": r"training\.total_steps: trials given 'abc' would fail"}
    for value, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            parse_config(apply_overrides(base, [f"tune.param_space.training.total_steps={value}"]))


def test_infinite_and_nan_numbers_are_refused_in_every_section():
    """`rope_theta: .inf` trained without rope and was exported as Infinity; `cpus_per_worker: .inf` passed validate
    and crashed in Ray (a review)."""
    from ray_jax_train.run_config import ConfigError, apply_overrides, parse_config

    base = _example("tiny_llama.yaml")
    for flag in ("model.rope_theta=.inf", "model.rms_norm_eps=.nan", "model.initializer_range=.inf",
                 "scaling.cpus_per_worker=.inf", "scaling.resources_per_worker={CPU: .inf}"):
        key = flag.split("=")[0].replace("={CPU", "")
        with pytest.raises(ConfigError, match=rf"{key}(\.CPU)?: Input should be a finite number"):
            parse_config(apply_overrides(base, [flag]))
    with pytest.raises(ConfigError, match=r"uniform: bounds must be finite numbers"):
        parse_config(apply_overrides(base, ["tune.param_space.training.learning_rate={uniform: [0.001, .inf]}"]))
    with pytest.raises(ValidationError, match="finite number"):
        LlamaConfig(rope_theta=float("inf"))


def test_yaml_merge_keys_are_read_and_keys_given_twice_still_refused(tmp_path):
    """`<<: *anchor` was refused as "not valid YAML" (the duplicate-key check built the merge key itself; a review)."""
    from ray_jax_train.run_config import ConfigError, read_file

    path = tmp_path / "c.yaml"
    path.write_text("model: &m\n  hidden_size: 32\n  intermediate_size: 64\n"
                    "x: {<<: *m, hidden_size: 64, num_hidden_layers: 2}\n")
    data = read_file(str(path))
    # Keys the merge brings and the mapping sets again are the mapping's (YAML's rule), not "given twice".
    assert data["x"] == {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2}
    path.write_text("base: &b {total_steps: 3}\ntraining:\n  <<: *b\n  batch_size: 2\n  batch_size: 4\n")
    with pytest.raises(ConfigError, match=r"key 'batch_size' \(line 5\) is given twice"):
        read_file(str(path))


def test_a_config_of_an_empty_mapping_is_refused_as_an_empty_file_is(tmp_path):
    """`{}` built Llama's default 4096-wide, 32-layer model, which an empty file was refused for (a review)."""
    from ray_jax_train.run_config import ConfigError, read_file

    for name in ("c.yaml", "c.json"):
        (tmp_path / name).write_text("{}\n")
        with pytest.raises(ConfigError, match=r"the file sets nothing; start from examples/tiny_llama.yaml"):
            read_file(str(tmp_path / name))


def test_search_ranges_whose_ends_pass_but_inside_values_fail_are_refused():
    """Only the ends of randint and quniform were checked: hidden_size randint [32, 37) passed validate and its trials
    given 33 or 35 (not divisible by 2 heads) failed; batch_size quniform q=0.5 sampled 3.5 (a review)."""
    from ray_jax_train.run_config import ConfigError, apply_overrides, parse_config

    base = _example("tune_tiny_llama.yaml")

    def check(flag):
        return parse_config(apply_overrides(base, [f"tune.param_space.{flag}"]))

    with pytest.raises(ConfigError, match=r"(?s)model\.hidden_size: trials given 33 would fail: .*hidden_size=33 "
                                          r"is not divisible by num_attention_heads=2"):
        check("model.hidden_size={randint: [32, 37]}")
    with pytest.raises(ConfigError, match=r"(?s)training\.batch_size: trials given 2\.5 would fail: .*fractional part.*"
                                          r"for whole numbers use \{\"randint\": \[2, 9\]\}"):
        check("training.batch_size={quniform: [2, 8, 0.5]}")
    # A large range is checked near its ends and in its middle, both parities: 41 is odd.
    with pytest.raises(ConfigError, match=r"model\.hidden_size: trials given \d*[13579] would fail"):
        check("model.hidden_size={randint: [40, 201]}")
    check("training.batch_size={quniform: [2, 8, 2]}")  # whole multiples: valid
    check("training.learning_rate={quniform: [0.001, 0.01, 0.001]}")
    check("training.batch_size={randint: [2, 9]}")


def test_data_settings_the_run_would_ignore_are_refused(tmp_path):
    """eval_fraction beside eval_source held nothing out, and kind: source beside files read the files as they are;
    both were accepted without a word (a review)."""
    from ray_jax_train.run_config import ConfigError, apply_overrides, parse_config

    data = tmp_path / "t.jsonl"
    data.write_text('{"text": "hello world"}\n')
    base = _example("tiny_llama.yaml")  # eval_fraction: 0.1
    with pytest.raises(ConfigError, match=r"data\.eval_fraction=0\.1 and data\.eval_source are both set"):
        parse_config(apply_overrides(base, [f"data.eval_source={data}"]))
    with pytest.raises(ConfigError, match=r"data\.kind='source' chooses what the built-in stdlib corpus yields.*"
                                          r"remove data\.kind"):
        parse_config(apply_overrides(base, [f"data.source={data}", "data.kind=source"]))
    parse_config(apply_overrides(base, [f"data.eval_source={data}", "data.eval_fraction=0"]))
    parse_config(apply_overrides(base, ["data.kind=source"]))
    config = parse_config(apply_overrides(base, [f"data.source={data}"]))
    parse_config(config.model_dump(mode="json"))  # a full dump (a resumed search's) names the default kind


def test_special_token_ids_outside_the_vocabulary_are_refused():
    """eos_token_id=5000 and pad_token_id=-1 with 300 tokens trained and were written into the exported config.json
    (a review)."""
    from ray_jax_train.run_config import ConfigError, apply_overrides, parse_config

    base = _example("tiny_llama.yaml")  # tokenizer.vocab_size: 300
    with pytest.raises(ConfigError, match=r"model: eos_token_id=5000, pad_token_id=-1 outside the vocabulary "
                                          r"\(vocab_size=300: ids 0 to 299\)"):
        parse_config(apply_overrides(base, ["model.eos_token_id=5000", "model.pad_token_id=-1"]))
    with pytest.raises(ConfigError, match=r"eos_token_id=300 outside the vocabulary"):
        parse_config(apply_overrides(base, ["model.eos_token_id=[1, 300]"]))
    with pytest.raises(ValidationError, match=r"bos_token_id=-2 outside the vocabulary"):
        LlamaConfig(vocab_size=10, bos_token_id=-2)
    assert LlamaConfig(vocab_size=10, bos_token_id=0, eos_token_id=[8, 9], pad_token_id=9).eos_token_id == [8, 9]
    # A Hugging Face config.json's -1 means "no such token" (early Llama configs' pad): read as none, not refused.
    hf = LlamaConfig(vocab_size=10).to_hf_dict()
    loaded = LlamaConfig.from_hf({**hf, "pad_token_id": -1, "eos_token_id": [9, -1]})
    assert loaded.pad_token_id is None and loaded.eos_token_id == [9]

    class Tokenizer:  # a tokenizer larger than the model is said as that, not as its ids outside the model
        pad_token_id, eos_token_id = 399, 1

        def __len__(self):
            return 400

    with pytest.raises(ConfigError, match=r"model\.vocab_size: The tokenizer gives ids up to 399"):
        parse_config(apply_overrides(base, ["model.vocab_size=300"])).llama_config(Tokenizer())


def test_a_rope_scaling_that_would_be_ignored_is_refused():
    """rope_scaling {factor: 8.0} without rope_type was read as default rope and trained without scaling (a review)."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    cases = [({"factor": 8.0}, r"names no rope_type, so its factor would be ignored; add rope_type: 'llama3' "
                               r"\(supported: 'default', 'llama3'\)"),
             ({"rope_type": "default", "factor": 8.0}, r"is rope_type 'default', which takes no settings, so factor "
                                                       r"would be ignored"),
             ({**llama3, "factor": float("inf")}, r"lacks numeric factor \(positive, finite\)"),
             ({**llama3, "high_freq_factor": 1.0}, r"high_freq_factor must be above low_freq_factor")]
    for rope_scaling, message in cases:
        with pytest.raises(ValidationError, match=message):
            LlamaConfig(hidden_size=64, num_attention_heads=4, rope_scaling=rope_scaling)
    old_spelling = {"type": "llama3", **{k: v for k, v in llama3.items() if k != "rope_type"}}
    for fine in ({"rope_type": "default"}, {}, old_spelling):
        LlamaConfig(hidden_size=64, num_attention_heads=4, rope_scaling=fine)


def test_yaml_text_stays_text_and_base_60_numbers_are_refused(tmp_path):
    """A quoted run.name "1e3" became 1000.0 (every string like a number was converted, quoted or not); 1:30 was read
    as the base-60 number 90; run.name 2024, yes or a date said "should be a valid string" without the fix (a
    review)."""
    from ray_jax_train.run_config import ConfigError, apply_overrides, parse_config, read_file

    path = tmp_path / "c.yaml"
    path.write_text('run:\n  name: "1e3"\ntraining:\n  learning_rate: 1e-3\n  warmup_steps: 1_0\n')
    assert read_file(str(path)) == {"run": {"name": "1e3"}, "training": {"learning_rate": 1e-3, "warmup_steps": 10}}
    assert apply_overrides({}, ["run.name='2e5'", "training.learning_rate=2e-5"]) == {
        "run": {"name": "2e5"}, "training": {"learning_rate": 2e-5}}
    path.write_text("training:\n  total_steps: 1:30\n")
    with pytest.raises(ConfigError, match=r"1:30 \(line 2\) reads as the base-60 number 90 in YAML; write the number "
                                          r"itself \(or quoted, '1:30', for text\)"):
        read_file(str(path))
    with pytest.raises(ConfigError, match=r"'training.learning_rate=1:30.5': 1:30.5 reads as the base-60 number 90.5"):
        apply_overrides({}, ["training.learning_rate=1:30.5"])
    for flag, read in [("run.name=2024", "the number 2024"), ("run.name=yes", "a boolean"),
                       ("run.name=2026-11-27", "the date 2026-11-27")]:
        with pytest.raises(ConfigError, match=rf"run\.name: wrong type: .*YAML read {read}.*quote it to keep it"):
            parse_config(apply_overrides({}, [flag]))


def test_mistakes_are_named_where_the_file_makes_them(tmp_path):
    """Refusals that named another key or the wrong fix, or none (a review): scaling.mesh was said as training.mesh;
    a directory as a missing file; stdlib listed with files as a missing file called stdlib, with the advice to use
    stdlib; a nested tune.param_space as 'training' not tunable; a negative resource not at all (dropped); a CPU count
    given twice silently took resources_per_worker's."""
    from ray_jax_train.run_config import ConfigError, apply_overrides, parse_config, read_file

    base = _example("tiny_llama.yaml")
    data = tmp_path / "t.jsonl"
    data.write_text('{"text": "hello world"}\n')
    cases = {("scaling.mesh={dq: -1}",): r"^invalid config:\n  scaling\.mesh: mesh=\{'dq': -1\} has no batch axis",
             (f"data.source=[stdlib, {data}]",): r"data\.source: 'stdlib' \(the built-in corpus\) cannot be listed "
                                                 r"with files",
             ("tune.param_space={training: {learning_rate: {choice: [0.1]}}}",):
                 r"'training' is a section; name each searched setting by its dotted key \(training\.learning_rate",
             ("scaling.resources_per_worker={CPU: -1}",): r"scaling\.resources_per_worker: CPU=-1: a resource amount "
                                                          r"cannot be negative",
             ("scaling.cpus_per_worker=1", "scaling.resources_per_worker={CPU: 2}"):
                 r"cpus_per_worker=1 and resources_per_worker \{CPU: 2\} both set a worker's CPUs"}
    for flags, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            parse_config(apply_overrides(base, list(flags)))
    with pytest.raises(ConfigError, match=r"is a directory; give the YAML or JSON file in it"):
        read_file(str(tmp_path))
    parse_config(apply_overrides(base, ["scaling.resources_per_worker={CPU: 2, memory: 1000}"]))
