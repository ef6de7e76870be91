"""A symbolic link inside a checkpoint that leads back to itself: an ``IntegrityError``
naming the link (load, metadata) and a FAILED line (``verify``), not a raw ``OSError``."""

from __future__ import annotations

import os
import shutil

import checkpointables as cp
import numpy as np
import pytest
from checkpointables import cli, storage


def _saved(tmp_path) -> str:
    path = str(tmp_path / "ckpt")
    cp.save_checkpointables(path, {"state": {"w": np.ones(3)}, "cfg": {"a": 1}})
    return path


def _looped(path: str, relative: str) -> str:
    """Replaces ``path/relative`` by a link to itself; returns the link's path."""
    link = os.path.join(path, relative)
    if os.path.isdir(link):
        shutil.rmtree(link)
    else:
        os.remove(link)
    os.symlink(os.path.basename(link), link)
    return link


def _names_loop(message: str, link: str) -> bool:
    return message.startswith(f"{link} is a symbolic link") and "loop" in message


def test_a_checkpointable_directory_that_loops_is_named_by_load_and_metadata(tmp_path) -> None:
    path = _saved(tmp_path)
    link = _looped(path, "cfg")
    for read in (cp.load_checkpointables, cp.checkpointables_metadata):
        with pytest.raises(cp.errors.IntegrityError) as raised:
            read(path)
        assert _names_loop(str(raised.value), link)


@pytest.mark.parametrize("relative", ["cfg", os.path.join("cfg", "data.json")])
def test_verify_reports_a_link_that_loops_as_failed(tmp_path, capsys, relative) -> None:
    path = _saved(tmp_path)
    link = _looped(path, relative)
    assert cli.main(["verify", "--quiet", path]) == 1
    out, err = capsys.readouterr()
    assert err == "" and f"FAILED {link} is a symbolic link" in out


def test_a_pytree_directory_that_loops_is_named_not_a_checksum_mismatch(tmp_path, capsys) -> None:
    path = _saved(tmp_path)
    link = _looped(path, os.path.join("state", "d"))
    with pytest.raises(cp.errors.IntegrityError) as raised:
        cp.load_checkpointables(path)
    assert _names_loop(str(raised.value), link)
    assert cli.main(["verify", "--quiet", path]) == 1
    assert f"FAILED {link} is a symbolic link" in capsys.readouterr().out


def test_a_listing_counts_a_link_that_loops_as_no_directory(tmp_path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "loop").symlink_to("loop")
    assert storage.list_dir(tmp_path) == [
        storage.Entry("loop", is_dir=False),
        storage.Entry("real", is_dir=True),
    ]
    with pytest.raises(cp.errors.IntegrityError) as raised:
        storage.read_bytes(tmp_path / "loop" / "file")
    assert _names_loop(str(raised.value), str(tmp_path / "loop"))


@pytest.mark.parametrize("where", ["the path", "a parent"])
def test_a_loop_on_the_path_given_is_no_checkpoint_there_naming_the_link(
    tmp_path, capsys, where
) -> None:
    loop = tmp_path / "lp"
    os.symlink("lp", loop)
    path = loop if where == "the path" else loop / "run" / "ck"
    for read in (cp.load_checkpointables, cp.checkpointables_metadata, cp.load_pytree):
        with pytest.raises(cp.errors.CheckpointNotFoundError) as raised:
            read(path)
        assert f"{loop} is a symbolic link that leads back to itself" in str(raised.value)
    assert cli.main(["verify", "-q", str(path)]) == 1  # A load would fail: FAILED, exit 1.
    assert "checkpoint: FAILED No checkpoint at" in capsys.readouterr().out


def test_a_chain_longer_than_the_system_follows_is_not_called_only_a_loop(tmp_path) -> None:
    path = _saved(tmp_path)
    data = os.path.join(path, "cfg", "data.json")
    os.rename(data, data + ".real")
    previous = "data.json.real"
    for i in range(45):  # Linux follows 40.
        os.symlink(previous, os.path.join(path, "cfg", f"l{i}"))
        previous = f"l{i}"
    os.symlink(previous, data)
    with pytest.raises(cp.errors.IntegrityError, match="or through more links than the system"):
        cp.load_checkpointables(path)
