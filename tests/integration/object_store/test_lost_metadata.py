"""A committed checkpoint that lost its ``_CHECKPOINT_METADATA`` (its ``_CHECKSUMS`` and
commit marker are there): ``cp.is_checkpoint`` is False, as a load cannot return it, and
a load says it is damaged (``IntegrityError``, what to do), not that a save did not
finish (docs/integrity.md, "A checkpoint that lost its metadata").
"""

from __future__ import annotations

import checkpointables as cp
import numpy as np
import pytest


def _lose_metadata(path: str) -> None:
    cp.save_pytree(path, {"w": np.arange(4.0)})
    cp.storage.remove_file(f"{path}/_CHECKPOINT_METADATA")


def _check(path: str) -> None:
    assert not cp.is_checkpoint(path)
    with pytest.raises(cp.errors.IntegrityError) as raised:
        cp.load_pytree(path)
    message = str(raised.value)
    assert f"{path}/_CHECKPOINT_METADATA is missing, although {path}/_CHECKSUMS" in message
    assert "cp.is_checkpoint reports False" in message and "restore it from a copy" in message


def test_on_s3_a_lost_metadata_file_is_damage(bucket) -> None:
    _lose_metadata(f"{bucket}/ckpt")
    _check(f"{bucket}/ckpt")


def test_on_a_local_disk_a_lost_metadata_file_is_damage(tmp_path) -> None:
    _lose_metadata(str(tmp_path / "ckpt"))
    _check(str(tmp_path / "ckpt"))
