"""Bad input to the safetensors plugin's writers raises the documented ``cp.errors`` types."""

from __future__ import annotations

import checkpointables as cp
import numpy as np
import pytest
from checkpointables import cli
from checkpointables_safetensors import export_checkpoint, parse_size, save_pytree
from checkpointables_safetensors._writer import Output, TensorEntry, write_safetensors


def test_a_second_export_without_overwrite_is_a_checkpoint_exists_error(tmp_path, capsys):
    tree = {"w": np.ones(3, np.float32)}
    save_pytree(tmp_path / "out", tree)
    message = r"out/model.safetensors exists; pass overwrite=True \(--overwrite\) to replace it"
    with pytest.raises(cp.errors.CheckpointExistsError, match=message) as raised:
        save_pytree(tmp_path / "out", tree)
    assert isinstance(raised.value, FileExistsError)  # As the builtin it was.
    cp.save_pytree(tmp_path / "ckpt", tree)
    with pytest.raises(cp.errors.CheckpointExistsError, match=message):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    assert "model.safetensors exists; pass overwrite=True" in capsys.readouterr().err


def test_a_subtree_that_selects_nothing_is_an_invalid_argument(tmp_path) -> None:
    cp.save_pytree(tmp_path / "ckpt", {"params": {"w": np.ones(3, np.float32)}, "opt": {}})
    for subtree, message in [("parms", "No key 'parms' under the root"), ("opt", "no leaf")]:
        with pytest.raises(cp.errors.InvalidArgumentError, match=message) as raised:
            export_checkpoint(tmp_path / "ckpt", tmp_path / "o", subtree=subtree)
        assert isinstance(raised.value, KeyError)  # As it always was.
        assert not str(raised.value).startswith(("'", '"'))  # Not quoted as KeyError's.


def test_bad_sizes_and_mismatched_arrays_are_documented_errors(tmp_path) -> None:
    for text in ["5XB", "-5GB", 0]:
        with pytest.raises(cp.errors.InvalidArgumentError, match="size"):
            parse_size(text)
    entry = TensorEntry("w", (2,), np.dtype(np.float32))
    with pytest.raises(cp.errors.TreeMismatchError, match="'w': expected shape"):
        write_safetensors(Output.at(tmp_path / "o"), [[entry]], [np.ones(3, np.float32)])
