"""The causal-LM path: TrainingArguments, the built-in train loop, and RayDistributedTrainer.

    trainer = RayDistributedTrainer("path/to/tokenizer", config_variables={"num_hidden_layers": 2})
    result = trainer.train(1, TrainingArguments(total_steps=100, batch_size=16, num_workers=2),
                           [{"text": t} for t in texts])  # rows with a "text" column (strings are file paths)
"""
from ray_jax_train.lm.arguments import TrainingArguments
from ray_jax_train.lm.distributed_trainer import RayDistributedTrainer
from ray_jax_train.lm.export import export_checkpoint
from ray_jax_train.lm.loop import NoLossTokensError, NonFiniteLossError, train_loop_per_worker
from ray_jax_train.lm.metrics import PEAK_FLOPS, peak_flops_per_device, read_metrics
from ray_jax_train.lm.state import shard_state
from ray_jax_train.lm.step import loss_sums, make_optimizer, make_train_step

__all__ = [
    "NoLossTokensError",
    "NonFiniteLossError",
    "PEAK_FLOPS",
    "RayDistributedTrainer",
    "TrainingArguments",
    "export_checkpoint",
    "loss_sums",
    "make_optimizer",
    "make_train_step",
    "peak_flops_per_device",
    "read_metrics",
    "shard_state",
    "train_loop_per_worker",
]
