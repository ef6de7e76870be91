"""Saves onto a full disk: a small tmpfs mounted for the test (skipped, with the reason,
where mounting is not allowed).

Every save fails with ``cp.errors.DiskFullError`` (an ``OSError`` with errno
``ENOSPC``), leaves nothing behind, and never damages the checkpoint that was
there; once space is freed, saves work again.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import traceback

import checkpointables as cp
import numpy as np
import pytest

DISK_BYTES = 2 << 20
RNG = np.random.default_rng(0)
TOO_BIG = {
    "large arrays": lambda: {"w": RNG.random(600_000)},  # Through the zarr3 driver.
    "small arrays": lambda: {f"k{i}": RNG.random(300) for i in range(1_500)},  # Batched.
    "json": lambda: {"text": "x" * (3 << 20)},
}


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        reason = (mounted.stderr or mounted.stdout).strip() or f"exit {mounted.returncode}"
        pytest.skip(f"cannot mount a {DISK_BYTES >> 20} MiB tmpfs to fill ({reason})")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def _assert_disk_full(error: BaseException) -> None:
    assert isinstance(error, cp.errors.DiskFullError) and isinstance(error, OSError)
    assert error.errno == errno.ENOSPC
    assert "free some space" in str(error)
    assert "no running event loop" not in "".join(traceback.format_exception(error))


@pytest.mark.parametrize("kind", TOO_BIG)
def test_a_save_onto_a_full_disk_is_a_disk_full_error_and_leaves_nothing(small_disk, kind):
    cp.save_pytree(small_disk / "old", {"x": np.arange(4)})
    item = TOO_BIG[kind]()
    for save in (
        lambda: cp.save_checkpointables(small_disk / "new", {"item": item}),
        lambda: cp.save_checkpointables_async(small_disk / "new", {"item": item}).result(),
        lambda: cp.save_checkpointables(small_disk / "old", {"item": item}, overwrite=True),
    ):
        with pytest.raises(cp.errors.DiskFullError) as info:
            save()
        _assert_disk_full(info.value)
        assert sorted(os.listdir(small_disk)) == ["old"]
    np.testing.assert_array_equal(cp.load_pytree(small_disk / "old")["x"], np.arange(4))
    cp.save_pytree(small_disk / "after", {"x": np.arange(4)})  # Small: it fits.
    assert cp.is_checkpoint(small_disk / "after")


_OVER_THE_FILE_SIZE_LIMIT = """
import errno, json, os, resource, sys
import checkpointables as cp
import numpy as np

disk, kind = sys.argv[1], sys.argv[2]
cp.save_pytree(os.path.join(disk, "old"), {"x": np.arange(4)})
rng = np.random.default_rng(0)
item = {
    "large arrays": lambda: {"w": rng.random(600_000)},
    "small arrays": lambda: {f"k{i}": rng.random(300) for i in range(1_500)},
    "json": lambda: {"text": "x" * (3 << 20)},
}[kind]()
# CPython ignores SIGXFSZ: a write past the limit fails with EFBIG.
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
try:
    cp.save_checkpointables(os.path.join(disk, "new"), {"item": item})
except OSError as e:
    answer = {"class": type(e).__name__, "library": isinstance(e, cp.errors.CheckpointError),
              "errno": e.errno, "message": str(e)}
else:
    answer = {"class": None}
answer["left"] = sorted(os.listdir(disk))
answer["old"] = cp.load_pytree(os.path.join(disk, "old"))["x"].tolist()
print(json.dumps(answer))
"""


@pytest.mark.parametrize("kind", TOO_BIG)
def test_a_file_over_the_size_limit_is_a_file_too_large_error_naming_the_save(tmp_path, kind):
    # EFBIG is what a FAT32/exFAT disk answers for a file over 4 GiB, and a process's
    # file size limit for any file over it: the same contract as a full disk.
    child = subprocess.run(
        [sys.executable, "-c", _OVER_THE_FILE_SIZE_LIMIT, str(tmp_path), kind],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    answer = json.loads(child.stdout.splitlines()[-1])
    assert answer["class"] == "FileTooLargeError" and answer["library"], answer
    assert answer["errno"] == errno.EFBIG
    assert str(tmp_path / "new") in answer["message"] and "raise the limit" in answer["message"]
    assert answer["left"] == ["old"]
    assert answer["old"] == [0, 1, 2, 3]
