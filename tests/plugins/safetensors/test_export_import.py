"""checkpointables export / import, and save_pytree: files that safetensors' own loader reads."""

from __future__ import annotations

import json
import os
import re

import checkpointables as cp
import jax
import numpy as np
import pytest
from checkpointables import cli
from checkpointables_safetensors import export_checkpoint, import_safetensors, save_pytree
from safetensors import safe_open
from safetensors.numpy import load_file

from ...python_subprocess import run_on_terminal, run_python
from .files import BF16, model_tensors, random_bits, same_bits, write_sharded


def train_state() -> dict:
    """A checkpointed training state: params with transformers-style names, and more."""
    layers = [
        {
            "self_attn": {"q_proj": {"weight": random_bits((32, 32), BF16, i)}},
            "mlp": {"up_proj": {"weight": random_bits((32, 64), np.float32, 10 + i)}},
        }
        for i in range(3)
    ]
    return {
        "params": {
            "model": {
                "embed_tokens": {"weight": random_bits((128, 32), BF16, 9)},
                "layers": layers,
            },
            "lm_head": {"weight": jax.device_put(random_bits((32, 128), BF16, 8))},
        },
        "step": 1200,
        "note": "not a tensor",
    }


HF_NAMES = {
    "model.embed_tokens.weight",
    "lm_head.weight",
    *(f"model.layers.{i}.self_attn.q_proj.weight" for i in range(3)),
    *(f"model.layers.{i}.mlp.up_proj.weight" for i in range(3)),
}


def test_export_is_read_by_safetensors_with_transformers_names(tmp_path, capsys) -> None:
    state = train_state()
    cp.save_pytree(tmp_path / "ckpt", state)
    out = tmp_path / "hf" / "model.safetensors"
    assert cli.main(["export", str(tmp_path / "ckpt"), str(out), "--subtree", "params"]) == 0
    assert "wrote 8 tensors" in capsys.readouterr().out
    tensors = load_file(out)
    assert set(tensors) == HF_NAMES
    assert same_bits(tensors["lm_head.weight"], state["params"]["lm_head"]["weight"])
    up_proj = state["params"]["model"]["layers"][2]["mlp"]["up_proj"]["weight"]
    assert same_bits(tensors["model.layers.2.mlp.up_proj.weight"], up_proj)
    with safe_open(out, "numpy") as f:
        assert f.metadata() == {"format": "pt"}  # What transformers requires.


def test_whole_tree_export_skips_what_safetensors_cannot_hold(tmp_path, capsys) -> None:
    cp.save_pytree(tmp_path / "ckpt", train_state())
    assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "skipped 1 leaves safetensors cannot hold (not arrays, or PRNG keys" in out
    assert "[\"['note']\"]" in out
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert tensors["step"].shape == () and tensors["step"] == 1200
    assert "params.model.layers.0.self_attn.q_proj.weight" in tensors


def test_large_exports_are_sharded_with_an_index_like_the_hubs(tmp_path) -> None:
    state = train_state()
    cp.save_pytree(tmp_path / "ckpt", state)
    out = tmp_path / "hf"
    argv = ["export", str(tmp_path / "ckpt"), str(out), "--subtree", "params"]
    assert cli.main([*argv, "--max-shard-size", "20KB"]) == 0
    files = sorted(os.listdir(out))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert files == [*shards, "model.safetensors.index.json"]
    assert all(re.fullmatch(r"model-0000\d-of-0000\d\.safetensors", f) for f in shards)
    count = len(shards)
    assert count >= 3 and shards[-1] == f"model-{count:05d}-of-{count:05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == HF_NAMES
    merged = {}
    for shard in shards:
        tensors = load_file(out / shard)
        assert sum(t.nbytes for t in tensors.values()) <= 20_000 or len(tensors) == 1
        assert all(index["weight_map"][n] == shard for n in tensors)
        merged.update(tensors)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in merged.values())
    # The set loads back through the index, bit for bit.
    loaded = cp.load_pytree(out)
    assert same_bits(loaded["model"]["embed_tokens"]["weight"], merged["model.embed_tokens.weight"])


def test_round_trips_are_bit_for_bit(tmp_path) -> None:
    tensors = model_tensors()
    index = write_sharded(tmp_path / "hub", tensors)
    assert cli.main(["import", index, str(tmp_path / "ckpt")]) == 0
    state = cp.load_pytree(tmp_path / "ckpt")
    assert same_bits(
        state["model"]["layers"]["1"]["self_attn"]["q_proj"]["weight"],
        tensors["model.layers.1.self_attn.q_proj.weight"],
    )
    assert cp.pytree_metadata(tmp_path / "ckpt").custom_metadata["safetensors_metadata"] == {
        "format": "pt"
    }
    assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "again.safetensors")]) == 0
    again = load_file(tmp_path / "again.safetensors")
    assert sorted(again) == sorted(tensors)
    assert all(same_bits(again[n], t) for n, t in tensors.items())


def test_a_subtree_that_is_one_array_is_named_by_its_key(tmp_path) -> None:
    cp.save_pytree(tmp_path / "ckpt", train_state())
    out = tmp_path / "head.safetensors"
    export_checkpoint(tmp_path / "ckpt", out, subtree="params.lm_head.weight")
    assert list(load_file(out)) == ["weight"]


def test_export_streams_in_batches(tmp_path) -> None:
    state = {f"w{i}": random_bits((64, 64), BF16, i) for i in range(20)}
    cp.save_pytree(tmp_path / "ckpt", state)
    result = export_checkpoint(
        tmp_path / "ckpt", tmp_path / "o.safetensors", batch_bytes=10_000, max_shard_size=30_000
    )
    assert result.tensors == 20
    assert len(result.files) == 7 + 1  # 3 tensors of 8 KiB per shard, and the index.
    loaded = cp.load_pytree(tmp_path)  # The directory: through its index.
    assert all(same_bits(loaded[k], v) for k, v in state.items())


def test_import_in_batches_publishes_only_when_complete(tmp_path) -> None:
    tensors = model_tensors()
    save_pytree(tmp_path / "m.safetensors", tensors)
    result = import_safetensors(tmp_path / "m.safetensors", tmp_path / "ckpt", batch_bytes=4096)
    assert result.tensors == len(tensors)
    assert not cp.partial.session_path(tmp_path / "ckpt").exists()
    flat = cp.load_pytree(tmp_path / "ckpt")
    assert same_bits(flat["model"]["embed_tokens"]["weight"], tensors["model.embed_tokens.weight"])


def test_host_memory_on_the_command_line_bounds_both_commands(tmp_path, capsys) -> None:
    tensors = {"w": np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)}  # 4 MiB
    save_pytree(tmp_path / "m.safetensors", tensors)
    budgeted = ["import", str(tmp_path / "m.safetensors"), str(tmp_path / "b"), "--host-memory"]
    assert cli.main([*budgeted, "8MiB"]) == 0
    assert cli.main(["import", str(tmp_path / "m.safetensors"), str(tmp_path / "u")]) == 0
    # A budgeted save writes chunks of at most an eighth of the budget (docs/memory.md).
    chunks = {c: cp.pytree_metadata(tmp_path / c).metadata["w"].storage.chunk_shape for c in "bu"}
    assert chunks == {"b": (256, 1024), "u": (1024, 1024)}
    out, unbudgeted = tmp_path / "o.safetensors", tmp_path / "u.safetensors"
    assert cli.main(["export", str(tmp_path / "b"), str(out), "--host-memory", "8MiB"]) == 0
    assert cli.main(["export", str(tmp_path / "b"), str(unbudgeted)]) == 0
    assert same_bits(load_file(out)["w"], tensors["w"])
    assert out.read_bytes() == unbudgeted.read_bytes()  # The budget changes no byte.
    refused = (
        ["import", str(tmp_path / "m.safetensors"), str(tmp_path / "x")],
        ["export", str(tmp_path / "b"), str(tmp_path / "y")],
    )
    for command in refused:
        with pytest.raises(SystemExit) as exited:  # A usage error, before any work.
            cli.main([*command, "--host-memory", "1MiB"])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "argument --host-memory: '1MiB' is below the smallest workable budget, 8MiB" in err
        assert "pass at least 8MiB, or leave --host-memory out for no bound" in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_existing_outputs_are_refused_unless_overwritten(tmp_path, capsys) -> None:
    cp.save_pytree(tmp_path / "ckpt", {"w": np.ones(4, np.float32)})
    out = str(tmp_path / "o.safetensors")
    assert cli.main(["export", str(tmp_path / "ckpt"), out]) == 0
    assert cli.main(["export", str(tmp_path / "ckpt"), out]) == 2
    assert "exists; pass overwrite=True (--overwrite)" in capsys.readouterr().err
    assert cli.main(["export", str(tmp_path / "ckpt"), out, "--overwrite"]) == 0
    assert cli.main(["import", out, str(tmp_path / "ckpt")]) == 2
    assert "exists; import into a new path" in capsys.readouterr().err
    assert [n for n in os.listdir(tmp_path) if ".tmp-" in n] == []


def test_an_export_replaces_an_earlier_one_of_the_other_layout_whole(tmp_path) -> None:
    old = {k: np.ones(1000, np.float32) for k in "abc"}  # 4,000 B each: a shard each.
    new = {k: np.zeros(1000, np.float32) for k in "abc"}
    cp.save_pytree(tmp_path / "old", old)
    cp.save_pytree(tmp_path / "new", new)
    out = tmp_path / "hf"
    export_checkpoint(tmp_path / "old", out, max_shard_size=5000)  # Shards and an index.
    with pytest.raises(FileExistsError, match=r"model-00001-of-00003.safetensors exists"):
        export_checkpoint(tmp_path / "new", out)  # One file, of another name.
    export_checkpoint(tmp_path / "new", out, overwrite=True)
    assert sorted(os.listdir(out)) == ["model.safetensors"]  # Else the old index is read.
    assert same_bits(cp.load_pytree(out)["c"], new["c"])
    export_checkpoint(tmp_path / "old", out, max_shard_size=5000, overwrite=True)
    assert "model.safetensors" not in os.listdir(out)
    assert same_bits(cp.load_pytree(out)["c"], old["c"])


def test_bad_arguments_say_what_to_do(tmp_path, capsys) -> None:
    cp.save_pytree(tmp_path / "ckpt", train_state())
    with pytest.raises(SystemExit):
        cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "o"), "--max-shard-size", "5XB"])
    assert "'5XB' is not a size" in capsys.readouterr().err
    with pytest.raises(KeyError, match=r"No key 'parms' under the root; the keys there are"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "o", subtree="parms")
    with pytest.raises(ValueError, match=r"\[.c.\] \(safetensors cannot store complex128: Unknown"):
        save_pytree(tmp_path / "c.safetensors", {"c": np.ones(2, np.complex128)})


def nnx_like_state() -> dict:
    """The leaves nnx.state(model) has for a Linear and a Dropout (typed RNG key, count)."""
    return {
        "dropout": {"rngs": {"count": np.uint32(0), "key": jax.random.key(0)}},
        "linear": {"kernel": np.ones((2, 3), np.float32), "bias": np.zeros(3, np.float32)},
    }


def test_prng_keys_are_skipped_and_listed_by_export_and_save_pytree(tmp_path, capsys) -> None:
    cp.save_pytree(tmp_path / "ckpt", nnx_like_state())
    assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "PRNG keys: RNG state, not weights" in out and "['dropout']['rngs']['key']" in out
    assert set(load_file(tmp_path / "out.safetensors")) == {
        "dropout.rngs.count",
        "linear.kernel",
        "linear.bias",
    }
    result = save_pytree(tmp_path / "py.safetensors", nnx_like_state())
    assert result.skipped == ("['dropout']['rngs']['key']",) and result.tensors == 3


def test_unstorable_dtypes_are_invalid_arguments_with_advice_for_each_caller(
    tmp_path, capsys
) -> None:
    tree = {"w": np.ones(2, np.float32), "c": np.ones(2, np.complex128)}
    with pytest.raises(cp.errors.InvalidArgumentError, match=r"nnx\.state\(model, nnx\.Param\)"):
        save_pytree(tmp_path / "c.safetensors", tree)
    cp.save_pytree(tmp_path / "ckpt", tree)
    with pytest.raises(cp.errors.InvalidArgumentError, match=r"subtree='KEY' in export_checkpoint"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "c.safetensors")
    assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "c.safetensors")]) == 2
    assert "--subtree KEY on the command line" in capsys.readouterr().err
    assert not (tmp_path / "c.safetensors").exists()


@pytest.mark.parametrize("name", ["out.txt", "out.safetenors", "model.safetensors.index.json"])
def test_an_output_named_like_another_kind_of_file_is_refused(tmp_path, capsys, name) -> None:
    cp.save_pytree(tmp_path / "ckpt", {"w": np.ones(4, np.float32)})
    assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert f"ends in {os.path.splitext(name)[1]!r}, not .safetensors" in err
    assert "end the path with a slash" in err
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    # A directory by choice: a trailing slash, or one that exists.
    assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / name) + "/"]) == 0
    assert os.path.exists(tmp_path / name / "model.safetensors")
    result = save_pytree(tmp_path / name, {"w": np.ones(4, np.float32)}, overwrite=True)
    assert result.files == (str(tmp_path / name / "model.safetensors"),)
    # Dotted names that are no extension stay directories.
    assert save_pytree(tmp_path / "gemma-2.0", {"w": np.ones(1, np.float32)}).tensors == 1


@pytest.mark.parametrize("option", ["--max-shard-size", "--host-memory"])
def test_a_negative_size_is_refused_naming_the_option_with_or_without_equals(
    tmp_path, capsys, option
) -> None:
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "o")
    for form in ([f"{option}=-5GB"], [option, "-5GB"]):  # argparse takes -5GB for an option.
        with pytest.raises(SystemExit) as exited:
            cli.main(["export", ckpt, out, *form])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert f"error: argument {option}: a size must be positive, got '-5GB'" in err
    assert not os.path.exists(out)


def test_verify_of_an_export_says_it_is_safetensors_and_names_import(tmp_path, capsys) -> None:
    cp.save_pytree(tmp_path / "ckpt", {"w": np.ones(4, np.float32)})
    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    for path in (tmp_path / "hf", tmp_path / "hf" / "model.safetensors"):
        assert cli.main(["verify", str(path)]) == 1
        out = capsys.readouterr().out
        assert f"{path} is not a checkpoint: it is safetensors data" in out
        assert "`checkpointables import` (write safetensors data" in out
        assert "did not finish" not in out
    assert cli.main(["verify", str(tmp_path / "ckpt")]) == 0  # A checkpoint is verified.


def test_commands_are_listed_only_when_the_plugin_is_installed() -> None:
    code = "import sys; from checkpointables import cli; sys.exit(cli.main(['--help']))"
    installed = run_python(code)
    disabled = run_python(code, CHECKPOINTABLES_DISABLE_PLUGINS="safetensors")
    assert installed.returncode == disabled.returncode == 0, installed.stderr
    for command in ("export", "import"):
        assert re.search(rf"^\s+{command}\s+write ", installed.stdout, re.M)
        assert not re.search(rf"^\s+{command}\s", disabled.stdout, re.M)


def test_plugin_discovery_does_not_import_safetensors(tmp_path) -> None:
    result = run_python(
        f"""
        import sys, numpy as np, checkpointables as cp
        cp.save_pytree({str(tmp_path / "c")!r}, {{"a": np.ones(2)}})
        cp.load_pytree({str(tmp_path / "c")!r})
        assert "safetensors" in [p.name for p in cp.plugins.list_plugins() if p.status == "loaded"]
        print("MODULES", sorted(m for m in sys.modules if m.split(".")[0] == "safetensors"))
        """
    )
    assert result.returncode == 0, result.stderr
    assert "MODULES []" in result.stdout


def test_export_and_import_show_progress_on_a_terminal(tmp_path) -> None:
    cp.save_pytree(tmp_path / "ckpt", {"w": np.ones((512, 512), np.float32)})
    shown = run_on_terminal("export", str(tmp_path / "ckpt"), str(tmp_path / "o.safetensors"))
    assert "export: 100%" in shown and "1.00M/1.00M" in shown
    shown = run_on_terminal("import", str(tmp_path / "o.safetensors"), str(tmp_path / "back"))
    assert "import: 100%" in shown and "1.00M/1.00M" in shown
    out = str(tmp_path / "o2.safetensors")
    assert run_on_terminal("export", "-q", str(tmp_path / "ckpt"), out) == ""


def test_outputs_inside_a_checkpoint_are_refused(tmp_path, capsys) -> None:
    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    cp.save_pytree(ckpt, {"w": np.ones(4, np.float32)})
    cp.save_pytree(other, {"w": np.ones(4, np.float32)})
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    source = tmp_path / "in.safetensors"
    save_pytree(source, {"w": np.ones(2, np.float32)})
    os.symlink(other, tmp_path / "link")
    for out in (ckpt, ckpt / "pytree" / "x.safetensors", other, tmp_path / "link" / "o"):
        assert cli.main(["export", str(ckpt), str(out)]) == 2
        assert "the finished checkpoint" in capsys.readouterr().err
    assert cli.main(["import", str(source), str(ckpt / "pytree" / "sub")]) == 2
    assert f"is inside the finished checkpoint {ckpt}" in capsys.readouterr().err
    os.remove(tmp_path / "link")
    os.remove(source)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert cli.main(["verify", str(ckpt)]) == 0


@pytest.mark.parametrize("subtree", ["w.", ".w", "empty"])
def test_a_subtree_selecting_no_leaf_is_refused(tmp_path, capsys, subtree) -> None:
    cp.save_pytree(tmp_path / "ckpt", {"w": np.ones(4, np.float32), "empty": {}})
    out = tmp_path / "o.safetensors"
    assert cli.main(["export", str(tmp_path / "ckpt"), str(out), "--subtree", subtree]) == 2
    err = capsys.readouterr().err
    assert f"The subtree {subtree!r} holds no leaf" in err
    assert "the top-level keys are ['empty', 'w']" in err
    assert not out.exists()


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_existing_file_not_named_safetensors_is_refused_saying_why(
    tmp_path, capsys, overwrite
) -> None:
    cp.save_pytree(tmp_path / "ckpt", {"w": np.ones(4, np.float32)})
    out = tmp_path / "existing"
    out.write_text("keep")
    flags = ["--overwrite"] if overwrite else []
    assert cli.main(["export", str(tmp_path / "ckpt"), str(out), *flags]) == 2
    assert "does not end in .safetensors" in capsys.readouterr().err
    assert out.read_text() == "keep"
