"""Tokenising a small corpus into packed rows, as every run's driver does before training: Ray tasks (the default
since session 39) against a 1-actor pool (`concurrency=1`, the default before), interleaved in one Ray session,
with the rows of both checked to be identical.

    python benchmarks/tokenize_start.py [--rounds 4] [--docs 200]

The first round pays for Ray's worker pool and imports; the medians leave it out.
"""
import argparse
import hashlib
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--docs", type=int, default=200)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()

    import ray
    import ray.data

    from ray_jax_train.text import local_corpus, tokenize_and_pack, train_tokenizer

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    texts = list(local_corpus(max_docs=args.docs))
    tokenizer_dir = tempfile.mkdtemp(prefix="tokenize_start_")
    train_tokenizer(texts, vocab_size=300, save_dir=tokenizer_dir)
    times = {"actor pool (concurrency=1)": [], "tasks (default)": []}
    digests = set()
    for rnd in range(args.rounds):
        ways = [("actor pool (concurrency=1)", 1), ("tasks (default)", None)]
        for name, concurrency in (ways if rnd % 2 == 0 else ways[::-1]):  # A B B A
            started = time.perf_counter()
            packed = tokenize_and_pack(ray.data.from_items([{"text": t} for t in texts]), tokenizer_dir, args.seq,
                                       concurrency=concurrency)
            packed.context.execution_options.preserve_order = True
            rows = packed.materialize().take_all()
            seconds = time.perf_counter() - started
            digests.add(hashlib.sha1(b"".join(r["input_ids"].tobytes() for r in rows)).hexdigest())
            if rnd:
                times[name].append(seconds)
            print(f"round {rnd} {name}: {seconds:.2f} s, {len(rows)} rows", flush=True)
    assert len(digests) == 1, "the two ways gave different rows"
    old, new = (statistics.median(v) for v in times.values())
    print(f"\nmedian over rounds 1-{args.rounds - 1}: actor pool {old:.2f} s, tasks {new:.2f} s; tasks / actor pool "
          f"{new / old:.2f}; rows identical")


if __name__ == "__main__":
    main()
