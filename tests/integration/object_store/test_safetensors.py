"""The safetensors plugin on s3:// paths: imports write checkpoints there; exports, which
stream local files, refuse a URL output with one line saying what to do."""

from __future__ import annotations

import os

import checkpointables as cp
import numpy as np
import pytest
from checkpointables import cli
from checkpointables_safetensors import export_checkpoint, import_safetensors, save_pytree
from safetensors.numpy import save_file

from .helpers import keys, plant_unfinished


def _source(tmp_path) -> tuple[str, dict[str, np.ndarray]]:
    tensors = {
        "model.layers.0.w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "model.norm": np.linspace(0, 1, 5, dtype=np.float16),
    }
    path = os.fspath(tmp_path / "m.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    return path, tensors


def test_import_writes_a_checkpoint_on_s3(tmp_path, bucket) -> None:
    source, tensors = _source(tmp_path)
    target = f"{bucket}/imported"
    result = import_safetensors(source, target, batch_bytes=16)  # Several partial saves.
    assert result.checkpoint == target and result.tensors == 2
    loaded = cp.load_pytree(target)
    np.testing.assert_array_equal(loaded["model"]["layers"]["0"]["w"], tensors["model.layers.0.w"])
    np.testing.assert_array_equal(loaded["model"]["norm"], tensors["model.norm"])
    meta = cp.pytree_metadata(target).custom_metadata
    assert meta["safetensors_metadata"] == {"format": "pt"}


def test_the_import_command_writes_to_s3(tmp_path, bucket, capsys) -> None:
    source, _ = _source(tmp_path)
    assert cli.main(["import", source, f"{bucket}/cli"]) == 0
    assert f"to the checkpoint {bucket}/cli" in capsys.readouterr().out
    assert cp.is_checkpoint(f"{bucket}/cli")


def test_import_refuses_a_taken_s3_path_saying_why(s3, tmp_path, bucket, capsys) -> None:
    source, _ = _source(tmp_path)
    cp.save_pytree(f"{bucket}/done", {"a": np.arange(3)})
    with pytest.raises(cp.errors.CheckpointExistsError, match="exists; import into a new path"):
        import_safetensors(source, f"{bucket}/done")
    assert cli.main(["import", source, f"{bucket}/done/pytree/sub"]) == 2
    err = capsys.readouterr().err
    assert f"is inside the finished checkpoint {bucket}/done" in err
    # Objects of an unfinished save: named, with what to do (no finalize of someone's data).
    plant_unfinished(s3, f"{bucket}/half", pid=None)
    before = keys(s3, f"{bucket}/half")
    assert cli.main(["import", source, f"{bucket}/half"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert f"{bucket}/half holds objects but no finished checkpoint" in err
    assert "cp.partial.finalize" in err
    assert keys(s3, f"{bucket}/half") == before


@pytest.mark.parametrize("out", ["s3://ckpts/out.safetensors", "gs://b/hf/", "foo://x/y"])
def test_export_to_a_url_is_refused_before_any_work(tmp_path, capsys, monkeypatch, out) -> None:
    cp.save_pytree(tmp_path / "ckpt", {"w": np.ones(4, np.float32)})
    monkeypatch.chdir(tmp_path)
    assert cli.main(["export", str(tmp_path / "ckpt"), out]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: {out}: safetensors files are written to local disk")
    assert "Export to a local path, then upload" in captured.err
    assert captured.err.count("\n") == 1
    with pytest.raises(cp.errors.UnsupportedPathError, match="written to local disk"):
        export_checkpoint(tmp_path / "ckpt", out)
    with pytest.raises(cp.errors.UnsupportedPathError, match="written to local disk"):
        save_pytree(out, {"w": np.ones(4, np.float32)})
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # No folder named "s3:" or "gs:".


def test_export_of_an_s3_checkpoint_to_s3_is_refused(bucket, tmp_path, monkeypatch, capsys) -> None:
    cp.save_pytree(f"{bucket}/run-8/3", {"w": np.ones(4, np.float32)})
    monkeypatch.chdir(tmp_path)
    out = f"{bucket}/out.safetensors"
    assert cli.main(["export", f"{bucket}/run-8/3", out]) == 2
    assert f"error: {out}: safetensors files are written to local disk" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
    # A local output is the way: the source may stay on S3.
    assert cli.main(["export", f"{bucket}/run-8/3", "out.safetensors"]) == 0
    assert os.listdir(tmp_path) == ["out.safetensors"]
