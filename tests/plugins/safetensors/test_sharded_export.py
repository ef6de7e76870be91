"""Sharded exports of a model mixing dtypes, as every Hugging Face model does, at every split.

The shard layout of an export changes only where the size limit crosses the
bytes of a run of consecutive tensors, so the sizes ``S`` and ``S - 1`` of
every such run ``S`` (with one below the smallest tensor and one above the
total) give every layout there is. Each is read back with the ``safetensors``
package and with ``cp.load_pytree``, bit for bit.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import checkpointables as cp
import jax
import numpy as np
import pytest
from checkpointables import cli
from checkpointables_safetensors import export_checkpoint, parse_size, save_pytree
from safetensors import safe_open
from safetensors.numpy import load_file

from .files import BF16, random_bits, same_bits

INDEX = "model.safetensors.index.json"


def _layer(seed: int) -> dict[str, Any]:
    return {
        "input_layernorm": {"weight": random_bits((16,), np.float32, seed)},
        "self_attn": {
            "q_proj": {"weight": random_bits((16, 16), BF16, seed + 1)},
            # An int8-quantized projection with its float16 scales.
            "k_proj": {
                "weight": random_bits((8, 16), np.int8, seed + 2),
                "scales": random_bits((8,), np.float16, seed + 3),
            },
        },
        "mlp": {"up_proj": {"weight": random_bits((32, 16), BF16, seed + 4)}},
        "post_attention_layernorm": {"weight": random_bits((16,), np.float32, seed + 5)},
    }


def mixed_model() -> dict[str, Any]:
    """A Llama-like tree: bfloat16 matrices, float32 norms, and int, bool and empty ones."""
    return {
        "model": {
            "embed_tokens": {"weight": random_bits((48, 16), BF16, 1)},
            "layers": [_layer(10), _layer(20)],
            "norm": {"weight": random_bits((16,), np.float32, 2)},
            "rotary_emb": {"inv_freq": random_bits((8,), np.float64, 3)},
            "causal_mask": {"bias": np.tril(np.ones((4, 4), bool))},
            "position_ids": np.arange(12, dtype=np.int64).reshape(1, 12),
            "token_type": np.arange(6, dtype=np.uint8),
            "unused": np.zeros((0, 4), np.int32),
        },
        "lm_head": {"weight": random_bits((16, 48), BF16, 5)},
        "step": np.array(1200, np.int32),
    }


def flat(tree: Any) -> dict[str, np.ndarray]:
    """Each leaf of ``tree`` under its key path joined with dots, as a NumPy array, in order."""
    flat_tree, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {
        ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): np.asarray(leaf)
        for path, leaf in flat_tree
    }


def split_sizes(sizes: list[int]) -> list[int]:
    """Limits that give every shard layout of tensors of ``sizes`` bytes, in this order."""
    runs = {sum(sizes[i:j]) for i in range(len(sizes)) for j in range(i + 1, len(sizes) + 1)}
    limits = {1, min(s for s in sizes if s) - 1, sum(sizes) + 1} | runs | {s - 1 for s in runs}
    return sorted(limit for limit in limits if limit > 0)


def _files_of(out: str) -> dict[str, bytes]:
    return {name: (Path(out) / name).read_bytes() for name in sorted(os.listdir(out))}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> dict[int, str]:
    """``save_pytree`` of the mixed model at every limit of ``split_sizes``: limit -> directory."""
    root = tmp_path_factory.mktemp("sweep")
    expected = flat(mixed_model())
    outputs = {}
    for limit in split_sizes([a.nbytes for a in expected.values()]):
        outputs[limit] = str(root / str(limit))
        save_pytree(outputs[limit], mixed_model(), max_shard_size=limit)
    return outputs


def _check_files(out: str, limit: int, expected: dict[str, np.ndarray]) -> list[list[str]]:
    """Checks one export's files with the ``safetensors`` package; returns each shard's names."""
    shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    if len(shards) == 1:
        assert shards == ["model.safetensors"] and sorted(os.listdir(out)) == shards
        assert sum(a.nbytes for a in expected.values()) <= limit
    index = json.loads((Path(out) / INDEX).read_text()) if len(shards) > 1 else None
    merged: dict[str, np.ndarray] = {}
    names = []
    for number, shard in enumerate(shards, 1):
        if index is not None:
            assert shard == f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = load_file(os.path.join(out, shard))
        with safe_open(os.path.join(out, shard), "numpy") as f:
            assert f.metadata() == {"format": "pt"}
            names.append(list(f.keys()))
        assert sum(t.nbytes for t in tensors.values()) <= limit or len(tensors) == 1
        assert not set(tensors) & set(merged), f"{shard} repeats tensors"
        merged.update(tensors)
        if index is not None:
            assert {n for n, f in index["weight_map"].items() if f == shard} == set(tensors)
    assert sorted(merged) == sorted(expected)
    assert all(same_bits(merged[n], a) for n, a in expected.items())
    if index is not None:
        assert list(index["weight_map"]) == sorted(expected)
        assert index["metadata"] == {"total_size": sum(a.nbytes for a in expected.values())}
    return names


def test_every_split_of_a_mixed_dtype_model_is_read_back_by_safetensors(sweep) -> None:
    expected = flat(mixed_model())
    order = list(expected)
    layouts = set()
    for limit, out in sweep.items():
        shards = [sorted(names, key=order.index) for names in _check_files(out, limit, expected)]
        # Shards follow the tree's order, each filled until the next tensor would not fit.
        assert [n for names in shards for n in names] == order
        for this, after in itertools.pairwise(shards):
            size = sum(expected[n].nbytes for n in this) + expected[after[0]].nbytes
            assert size > limit
        layouts.add(tuple(map(tuple, shards)))
    # From one file to one per tensor, through many splits between.
    assert (tuple(order),) in layouts and tuple((n,) for n in order) in layouts
    assert len(layouts) > 50


def test_every_split_loads_back_with_load_pytree(sweep) -> None:
    expected = flat(mixed_model())
    seen = set()
    for out in sweep.values():
        layout = tuple(_files_of(out).items())
        if layout in seen:  # One load per distinct set of files is enough.
            continue
        seen.add(layout)
        loaded = flat(cp.load_pytree(out))
        # Lists load as dicts keyed "0", "1"..., which join to the same names.
        assert sorted(loaded) == sorted(expected)
        assert all(same_bits(loaded[n], a) for n, a in expected.items()), out


def test_checkpoint_exports_write_the_files_save_pytree_writes(sweep, tmp_path) -> None:
    cp.save_pytree(tmp_path / "ckpt", mixed_model())
    done = set()
    for limit, out in sweep.items():
        files = _files_of(out)
        if tuple(files.items()) in done and limit % 7:  # Each layout once, and a few more limits.
            continue
        done.add(tuple(files.items()))
        target = tmp_path / f"out{limit}"
        # Small batches: the checkpoint is read in many pieces, in the files' order.
        export_checkpoint(tmp_path / "ckpt", target, max_shard_size=limit, batch_bytes=700)
        assert _files_of(str(target)) == files, limit


@pytest.mark.parametrize("size", ["1B", "700B", "2KB", "5KB", "6KiB", "9KB", "1GB"])
def test_cli_export_of_mixed_dtypes_then_import_round_trips(tmp_path, capsys, size) -> None:
    state = mixed_model()
    cp.save_pytree(tmp_path / "ckpt", state)
    out = tmp_path / "hf"
    assert cli.main(["export", str(tmp_path / "ckpt"), str(out), "--max-shard-size", size]) == 0
    assert f"wrote {len(flat(state))} tensors" in capsys.readouterr().out
    _check_files(str(out), parse_size(size), flat(state))
    assert cli.main(["import", str(out), str(tmp_path / "back")]) == 0
    back = flat(cp.load_pytree(tmp_path / "back"))
    assert sorted(back) == sorted(flat(state))
    assert all(same_bits(back[n], a) for n, a in flat(state).items())
    assert cp.pytree_metadata(tmp_path / "back").custom_metadata["safetensors_metadata"] == {
        "format": "pt"
    }
