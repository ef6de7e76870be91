"""Small Grain pipelines for the tests: each builds the same data every time it is called."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grain
import numpy as np


def _double(x: int) -> int:
    return x * 2


def map_pipeline() -> grain.MapDataset:
    """Three epochs of ten, shuffled and mapped (iter() gives a DatasetIterator)."""
    return grain.MapDataset.range(10).repeat(3).shuffle(seed=7).map(_double)


def batched_pipeline() -> grain.IterDataset:
    """An IterDataset with batching."""
    return grain.MapDataset.range(50).shuffle(seed=3).to_iter_dataset().batch(4)


def threaded_pipeline() -> grain.IterDataset:
    """An IterDataset read ahead by background threads."""
    options = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)
    return grain.MapDataset.range(60).map(_double).to_iter_dataset(options)


def data_loader(seed: int = 1) -> grain.DataLoader:
    """A grain.DataLoader reading in the calling process (no worker processes)."""
    sampler = grain.samplers.IndexSampler(
        num_records=30,
        shard_options=grain.sharding.NoSharding(),
        shuffle=True,
        num_epochs=2,
        seed=seed,
    )
    return grain.DataLoader(
        data_source=list(range(100, 130)),
        sampler=sampler,
        operations=[grain.transforms.Batch(batch_size=3)],
        worker_count=0,
    )


PIPELINES: dict[str, Callable[[], Any]] = {
    "map": map_pipeline,
    "batched": batched_pipeline,
    "threaded": threaded_pipeline,
    "data_loader": data_loader,
}


def take(iterator: Any, n: int) -> list[Any]:
    """The next ``n`` elements, as plain lists for comparison."""
    return [np.asarray(next(iterator)).tolist() for _ in range(n)]
