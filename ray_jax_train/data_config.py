"""`JaxDataConfig`: Ray Train's DataConfig, with datasets whose every row must reach a worker (an eval set).

Ray Train splits each named dataset with `streaming_split(equal=True)`, which drops up to `workers - 1` rows so the
shards are even: right for training in lock-step, wrong for an eval whose loss should cover the whole set.
`iter_jax_batches` does not need even shards (the workers agree on the batch count, and `remainder="pad"` masks
the tail), so the datasets named in `every_row` are split with `equal=False`: each block goes to one worker, whole.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

from ray.train import DataConfig


class JaxDataConfig(DataConfig):
    """`DataConfig(datasets_to_split, execution_options, enable_shard_locality)`, plus `every_row`: names of split
    datasets that keep every row. Read them with `iter_jax_batches(..., remainder="pad")` and count the `valid`
    rows: the shards may differ by a block, and a worker can get none (it then yields padding batches only)."""

    def __init__(self, datasets_to_split: Union[str, List[str]] = "all", execution_options=None,
                 enable_shard_locality: bool = True, *, every_row: Sequence[str] = ()):
        if isinstance(every_row, str):  # "eval" would otherwise be the names "e", "v", "a", "l"
            every_row = [every_row]
        every_row = list(every_row)
        if datasets_to_split != "all":
            unsplit = [name for name in every_row if name not in datasets_to_split]
            if unsplit:
                raise ValueError(
                    f"JaxDataConfig(every_row={unsplit}) names datasets that datasets_to_split={datasets_to_split} "
                    "leaves whole on every worker: add them to datasets_to_split, or drop them from every_row.")
        super().__init__(datasets_to_split, execution_options, enable_shard_locality)
        self.every_row = every_row

    def check_names(self, datasets: Optional[Dict]) -> None:
        """A name in `every_row` that is not a dataset (a typo) would leave the eval set split evenly, its rows
        dropped again, with no error. `JaxTrainer` calls this on the driver, before any worker starts."""
        missing = [name for name in self.every_row if name not in (datasets or {})]
        if missing:
            raise ValueError(f"JaxDataConfig(every_row={missing}) names datasets the trainer was not given; its "
                             f"datasets are {sorted(datasets or {})}.")

    def configure(self, datasets: Dict, world_size: int, worker_handles: Optional[List],
                  worker_node_ids: Optional[List], **kwargs) -> List[Dict]:
        # Ray Train 2.60 configures the datasets one at a time, as the workers first ask for each: names are checked
        # on the driver (`check_names`), not here.
        even = {name: ds for name, ds in datasets.items() if name not in self.every_row}
        output = super().configure(even, world_size, worker_handles, worker_node_ids, **kwargs)
        locality = worker_node_ids if self._enable_shard_locality else None
        for name in (name for name in self.every_row if name in datasets):
            dataset = datasets[name]
            if dataset.name is None:
                dataset.set_name(name)
            dataset = dataset.copy(dataset)
            dataset.context.execution_options = self._resolve_execution_options(name)
            for shards, split in zip(output, dataset.streaming_split(world_size, equal=False,
                                                                      locality_hints=locality)):
                shards[name] = split
        return output
