"""Incremental saves on the S3 test server: nothing is linked; the save says so once."""

from __future__ import annotations

import logging

import checkpointables as cp
import pytest

from .helpers import assert_equal, keys, tree


# With the fast path off, reuse stops earlier (and says that instead): kept on here.
@pytest.mark.fast_path
def test_reuse_from_on_s3_writes_everything_and_says_so_once(s3, bucket, caplog) -> None:
    caplog.set_level(logging.INFO, logger="checkpointables.reuse")
    cp.save_pytree(f"{bucket}/1", tree(1))
    for step in (2, 3):
        cp.save_pytree(f"{bucket}/{step}", tree(1), reuse_from=f"{bucket}/{step - 1}")
        assert_equal(cp.load_pytree(f"{bucket}/{step}"), tree(1))
    said = [r.getMessage() for r in caplog.records if r.name == "checkpointables.reuse"]
    assert len(said) == 1 and "no server-side copy" in said[0], said
    # Every step holds its own data: the same objects as a plain save's.
    assert len(keys(s3, f"{bucket}/3")) == len(keys(s3, f"{bucket}/1"))


def test_a_checkpointer_on_s3_does_not_reuse_by_default(bucket) -> None:
    with cp.training.Checkpointer(f"{bucket}/run") as ckptr:
        ckptr.save_pytree(0, tree(1), force=True)
        ckptr.save_pytree(1, tree(1), force=True)
        assert ckptr.last_save_stats.bytes_reused == 0
