"""The benchmark cases of issue 3: deterministic trees of a given shape and size.

Every tree is built from a fixed seed, so a memory-measuring subprocess
rebuilds exactly the tree the parent timed. Array data is random (like
trained weights), so compressing codecs gain nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

LeafKind = Literal["numpy", "jax"]
GIB = 1 << 30
MIB = 1 << 20
SEED = 20240603


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark case.

    Attributes:
      name: what ``--case`` selects.
      title: a one-line description for the report.
      leaves: whether arrays are NumPy arrays or ``jax.Array``s (on the default device).
      build: returns the NumPy form of the tree for a size ``scale`` (1.0 = the issue's size).
      measure_async: also time ``save_async``: the stall (until it returns) and the total.
      measure_memory: also measure peak RSS growth in fresh subprocesses.
    """

    name: str
    title: str
    leaves: LeafKind
    build: Callable[[float], Any]
    measure_async: bool = True
    measure_memory: bool = False

    def tree(self, scale: float) -> Any:
        """The tree to save, with ``jax.Array`` leaves when the case asks for them."""
        tree = self.build(scale)
        return to_jax(tree) if self.leaves == "jax" else tree


def _rng() -> np.random.Generator:
    return np.random.default_rng(SEED)


def _random(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.random(shape, dtype=np.float32)


def big_arrays(scale: float, total_bytes: int = GIB, count: int = 16) -> dict[str, np.ndarray]:
    """``count`` float32 arrays of equal size adding up to ``total_bytes * scale``."""
    floats = max(1, int(total_bytes * scale) // (4 * count))
    cols = 1024 if floats >= 1024 else floats
    rng = _rng()
    return {f"layer_{i:02d}": _random(rng, (floats // cols, cols)) for i in range(count)}


def transformer_shapes(total_bytes: int, layers: int = 25) -> dict[str, tuple[int, ...]]:
    """Shapes of a decoder-only transformer with 256 arrays, about ``total_bytes`` of float32.

    25 layers of 10 arrays (q, k, v, o, two MLP kernels, two MLP biases, two
    norm scales) plus 6 top-level arrays (token and position embeddings, final
    norm scale and bias, output kernel and bias). The model width is chosen so
    the layers hold most of the bytes; the vocabulary fills the rest.
    """
    floats = total_bytes // 4
    per_layer = lambda d: 12 * d * d + 7 * d  # noqa: E731 - a formula, named for reading.
    d = 8
    while layers * per_layer(d + 8) <= 0.85 * floats:
        d += 8
    positions = 2 * d
    rest = floats - layers * per_layer(d) - 2 * d - positions * d
    vocab = max(1, rest // (2 * d + 1))
    shapes: dict[str, tuple[int, ...]] = {
        "embed/tokens": (vocab, d),
        "embed/positions": (positions, d),
        "final_norm/scale": (d,),
        "final_norm/bias": (d,),
        "head/kernel": (d, vocab),
        "head/bias": (vocab,),
    }
    for i in range(layers):
        for name, shape in (
            ("attn/q", (d, d)),
            ("attn/k", (d, d)),
            ("attn/v", (d, d)),
            ("attn/o", (d, d)),
            ("mlp/in_kernel", (d, 4 * d)),
            ("mlp/in_bias", (4 * d,)),
            ("mlp/out_kernel", (4 * d, d)),
            ("mlp/out_bias", (d,)),
            ("norm1/scale", (d,)),
            ("norm2/scale", (d,)),
        ):
            shapes[f"layer_{i:02d}/{name}"] = shape
    return shapes


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def transformer(scale: float) -> dict[str, Any]:
    """256 float32 arrays of transformer-like shapes, about ``256 MiB * scale``."""
    rng = _rng()
    shapes = transformer_shapes(int(256 * MIB * scale))
    return {"params": _nest({k: _random(rng, s) for k, s in shapes.items()})}


def small_arrays(scale: float, count: int = 5000) -> dict[str, Any]:
    """``count * scale`` float32 arrays of 256 B to 16 KiB (log-uniform) in a 3-level dict."""
    rng = _rng()
    n = max(10, round(count * scale))
    flat = {}
    for i in range(n):
        nbytes = math.exp(rng.uniform(math.log(256), math.log(16 * 1024)))
        floats = max(64, int(nbytes) // 4)
        shape = (floats // 16, 16) if i % 2 else (floats,)
        flat[f"group_{i // 500:02d}/block_{(i // 50) % 10}/w_{i % 50:02d}"] = _random(rng, shape)
    return _nest(flat)


def medium_arrays(scale: float, total_bytes: int = 128 * MIB, nbytes: int = 128 << 10) -> Any:
    """float32 arrays of ``nbytes`` each (128 KiB) adding up to ``total_bytes * scale``.

    Between the small arrays (batched into shared chunks) and the large ones
    (one chunk each, read and written in place): issue 19's middle size.
    """
    rng = _rng()
    count = max(4, int(total_bytes * scale) // nbytes)
    floats = nbytes // 4
    flat = {
        f"block_{i // 64:02d}/w_{i % 64:02d}": _random(rng, (floats // 256, 256))
        for i in range(count)
    }
    return _nest(flat)


def tiny(scale: float) -> dict[str, Any]:
    """10 Python scalars (5 int, 5 float) and 3 float32 arrays of 100 elements; no scaling."""
    del scale
    rng = _rng()
    return {
        "step": 1000,
        "epoch": 3,
        "seed": 42,
        "batch_size": 256,
        "num_devices": 8,
        "learning_rate": 3e-4,
        "loss": 2.125,
        "grad_norm": 0.875,
        "weight_decay": 0.01,
        "ema_decay": 0.999,
        "params": {
            "w": _random(rng, (100,)),
            "b": _random(rng, (100,)),
            "scale": _random(rng, (100,)),
        },
    }


def to_jax(tree: Any) -> Any:
    """The same tree with every NumPy array moved to the default device (ready, not pending)."""
    import jax

    out = jax.tree.map(lambda x: jax.device_put(x) if isinstance(x, np.ndarray) else x, tree)
    return jax.block_until_ready(out)


def tree_nbytes(tree: Any) -> int:
    """Bytes of array data in ``tree`` (scalars count 8 bytes each)."""
    import jax

    return sum(getattr(leaf, "nbytes", 8) for leaf in jax.tree.leaves(tree))


CASES: tuple[Case, ...] = (
    Case(
        "1gib",
        "1 GiB in 16 float32 arrays (jax.Array)",
        "jax",
        big_arrays,
        measure_async=True,
        measure_memory=True,
    ),
    Case("256mib", "256 MiB in 256 transformer-like arrays (jax.Array)", "jax", transformer),
    Case(
        "128mib-128kib",
        "128 MiB in 1,024 arrays of 128 KiB (jax.Array)",
        "jax",
        medium_arrays,
    ),
    Case(
        "small-numpy",
        "5,000 arrays of 256 B-16 KiB, nested dict, NumPy",
        "numpy",
        small_arrays,
        measure_memory=True,
    ),
    Case("small-jax", "5,000 arrays of 256 B-16 KiB, nested dict, jax.Array", "jax", small_arrays),
    Case("tiny-numpy", "10 scalars + 3 arrays of 100 floats, NumPy", "numpy", tiny),
    Case("tiny-jax", "10 scalars + 3 arrays of 100 floats, jax.Array", "jax", tiny),
)


def get_case(name: str) -> Case:
    """The case called ``name``; ``KeyError`` lists the valid names."""
    for case in CASES:
        if case.name == name:
            return case
    raise KeyError(f"No benchmark case {name!r}; choose from {[c.name for c in CASES]}.")
