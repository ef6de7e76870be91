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
