"""Safetensors files for the tests, written by the ``safetensors`` package itself."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

BF16 = np.dtype(jnp.bfloat16)


def random_bits(shape: tuple[int, ...], dtype: np.dtype, seed: int = 0) -> np.ndarray:
    """Arbitrary bit patterns (NaNs with payloads, infinities, denormals) of ``dtype``."""
    dtype = np.dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, int(np.prod(shape)) * dtype.itemsize)
    return raw.astype(np.uint8).view(dtype).reshape(shape)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays hold the same dtype, shape and bytes."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def model_tensors() -> dict[str, np.ndarray]:
    """A small transformer-like state dict with Hugging Face names, in several dtypes."""
    return {
        "model.embed_tokens.weight": random_bits((64, 32), BF16, 1),
        "model.layers.0.self_attn.q_proj.weight": random_bits((32, 32), BF16, 2),
        "model.layers.0.mlp.up_proj.weight": np.arange(32 * 48, dtype=np.float32).reshape(32, 48),
        "model.layers.1.self_attn.q_proj.weight": random_bits((32, 32), BF16, 3),
        "model.layers.1.mlp.up_proj.weight": -np.arange(32 * 48, dtype=np.float32).reshape(32, 48),
        "model.norm.weight": np.linspace(0, 1, 32, dtype=np.float16),
        "model.rotary.inv_freq": np.arange(16, dtype=np.float64),
        "model.step": np.array(7, dtype=np.int64),
        "model.mask": np.array([True, False, True]),
        "model.empty": np.zeros((0, 4), np.int32),
    }


def write_sharded(directory: os.PathLike[str] | str, tensors: dict[str, np.ndarray]) -> str:
    """Writes ``tensors`` as a Hub-style set of two files plus ``model.safetensors.index.json``."""
    os.makedirs(directory, exist_ok=True)
    names = list(tensors)
    half = len(names) // 2
    files = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for file, members in files.items():
        save_file({n: tensors[n] for n in members}, os.path.join(directory, file), {"format": "pt"})
        weight_map.update(dict.fromkeys(members, file))
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    path = os.path.join(directory, "model.safetensors.index.json")
    with open(path, "w") as f:
        json.dump(index, f)
    return path
