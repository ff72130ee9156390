"""Quick start: train a small Llama on 2 CPU workers, offline, in one to two minutes on 2 cores.

The corpus is the docstrings of the local Python standard library; a byte-level BPE tokenizer is trained on
it at run time. `RayDistributedTrainer` tokenises and packs the text with Ray Data, then 2 Ray workers (one
`jax.distributed` job) train the model data-parallel and report loss, perplexity, tokens/s and MFU.

    python examples/quickstart_llama.py
    python examples/quickstart_llama.py --num-workers 1 --steps 60     # quicker
"""
from __future__ import annotations

import argparse
import os
import time


def main(argv=None):

    import ray_jax_train as rjt
    from ray_jax_train.lm import RayDistributedTrainer, TrainingArguments, read_metrics
    from ray_jax_train.models import count_params
    from ray_jax_train.text import local_corpus, train_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16, help="global sequences per optimizer step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--docs", type=int, default=600, help="standard-library files to read docstrings from")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--output-dir", default=os.path.abspath("runs"))
    args = parser.parse_args(argv)

    started = time.time()
    work = os.path.join(args.output_dir, "quickstart")
    os.makedirs(work, exist_ok=True)
    texts = list(local_corpus(kind="docstrings", max_docs=args.docs))
    tokenizer_dir = os.path.join(work, "tokenizer")
    train_tokenizer(texts, vocab_size=args.vocab_size, save_dir=tokenizer_dir)
    n_eval = max(1, len(texts) // 20)
    train_rows = [{"text": t} for t in texts[n_eval:]]
    eval_rows = [{"text": t} for t in texts[:n_eval]]
    print(f"corpus: {len(texts)} documents ({sum(map(len, texts)) / 1e6:.1f}M chars); tokenizer in {tokenizer_dir}")

    # Logical CPUs beyond the 2 training workers let Ray Data tokenise alongside training on a small machine; under
    # `ray job submit` this joins the job's cluster instead.
    rjt.init_ray(include_dashboard=False)
    trainer = RayDistributedTrainer(
        tokenizer_dir,
        model_type="llama",
        config_scaling_variables={"hidden_size": args.hidden_size, "intermediate_size": 4 * args.hidden_size,
                                  "num_attention_heads": 2, "num_key_value_heads": 1},
        # float32 compute: bfloat16 is emulated (slow) on CPU.
        config_variables={"num_hidden_layers": args.layers, "dtype": "float32", "param_dtype": "float32",
                          "max_position_embeddings": 1024},
    )
    arguments = TrainingArguments(
        total_steps=args.steps, batch_size=args.batch_size, max_sequence_length=args.seq_len,
        learning_rate=args.learning_rate, warmup_steps=min(20, args.steps // 10), weight_decay=0.01,
        log_steps=10, eval_steps=max(args.steps // 2, 1), max_eval_steps=8,
        num_workers=args.num_workers, output_dir=args.output_dir, run_name=f"quickstart-{time.strftime('%Y%m%d-%H%M%S')}",
    )
    result = trainer.train(1, arguments, train_rows, dataset_eval=eval_rows)
    records = read_metrics(result.path)
    losses = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    if not losses:
        raise SystemExit(f"no metrics were recorded under {result.path}")
    first, last = losses[0], losses[-1]
    config = trainer.create_config(1)
    print("\n=== quick start summary ===")
    print(f"model:      Llama, {count_params(config) / 1e6:.2f}M params (hidden {config.hidden_size}, "
          f"{config.num_hidden_layers} layers, vocab {config.vocab_size}); {args.num_workers} CPU workers, "
          f"{last['step']} steps")
    print(f"train loss: {first['loss']:.3f} (step {first['step']}) -> {last['loss']:.3f} (step {last['step']})")
    if evals:
        print(f"eval loss:  {evals[0]['eval_loss']:.3f} (step {evals[0]['step']}) -> {evals[-1]['eval_loss']:.3f} "
              f"(step {evals[-1]['step']})")
    print(f"throughput: {last.get('tokens_per_s', 0):.0f} tokens/s, MFU {100 * last.get('mfu', 0):.1f}% of the measured "
          "CPU matmul peak")
    print(f"outputs:    {result.path}  (metrics.jsonl, final_model/ with tokenizer)")
    final_model = os.path.join(result.path, "final_model")
    prompt = "Return the"
    completion = rjt.generate_text(rjt.from_pretrained(final_model), rjt.load_tokenizer(final_model), prompt,
                                   max_new_tokens=16)
    print(f"sample:     {prompt!r} -> {completion!r}  (greedy; also: ray-jax-train generate {result.path} "
          f"--prompt {prompt!r})")
    print(f"wall time:  {time.time() - started:.0f}s")
    if not last["loss"] < first["loss"] - 0.5:
        raise SystemExit(f"the loss did not fall clearly ({first['loss']:.3f} -> {last['loss']:.3f})")
    return result, records


if __name__ == "__main__":
    main()
