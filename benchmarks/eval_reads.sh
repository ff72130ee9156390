#!/usr/bin/env bash
# An eval-heavy tiny run (200 steps, an eval of the whole eval set every 5 steps), timed whole through the CLI, for
# two checkouts interleaved (A B B A): what reading the eval set once (session 38) saves against reading it per eval.
#   git worktree add /tmp/old <rev>; bash benchmarks/eval_reads.sh /tmp/old .
set -euo pipefail
old=$(cd "$1" && pwd); new=$(cd "$2" && pwd); out=${OUT:-/tmp/eval_reads}
config="$new/examples/tiny_llama.yaml"
run() {  # checkout, run name
  PYTHONPATH="$1" python -m ray_jax_train fit "$config" --set run.storage_path="$out" --set run.name="$2" \
    --set training.total_steps=200 --set training.eval_steps=5 --set training.max_eval_steps=null \
    --set training.save_steps=null --set data.max_docs=200 --set data.eval_fraction=0.3 2>&1 \
    | grep -E "^run:|eval loss|train loss"
}
for pair in "$old a1" "$new b1" "$new b2" "$old a2"; do
  set -- $pair; echo "== $1 ($2)"; run "$1" "$2"
done
