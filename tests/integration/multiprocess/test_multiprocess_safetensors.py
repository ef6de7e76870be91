"""A safetensors file loaded onto a mesh spanning two real JAX processes.

Each process must read only the byte ranges of its own shards. The test
measures it with the kernel: the file is dropped from the page cache, the
first process loads its half of a row-sharded tensor while the second
waits, and ``mincore`` then shows which of the file's pages were read.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from .launcher import run_job

pytestmark = pytest.mark.multiprocess

# 64 MiB of float32, 32 MiB per process: more than the kernel reads ahead of a mapped file.
ROWS, COLUMNS = 8192, 2048

BODY = """
import ctypes, mmap, os
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

path = sys.argv[1]
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]

def resident_pages():
    # Which pages of the file are in the page cache (mapping them reads nothing).
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        pages = -(-size // mmap.PAGESIZE)
        vector = ctypes.create_string_buffer(pages)
        assert libc.mincore(address, size, vector) == 0, ctypes.get_errno()
        libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    return np.frombuffer(vector.raw, np.uint8) & 1

mesh = Mesh(np.array(jax.devices()), ("x",))
abstract = {"w": jax.ShapeDtypeStruct((ROWS, COLUMNS), np.float32,
                                      sharding=NamedSharding(mesh, P("x")))}
expected = np.arange(ROWS * COLUMNS, dtype=np.float32).reshape(ROWS, COLUMNS)

def load_and_check():
    loaded = cp.load_pytree(path, abstract)["w"]
    assert loaded.sharding == abstract["w"].sharding
    for shard in loaded.addressable_shards:
        assert shard.device.process_index == PROCESS_ID
        assert np.array_equal(np.asarray(shard.data), expected[shard.index])
    return loaded

error = None
if PROCESS_ID == 0:
    try:
        assert resident_pages().sum() <= 2, "the file is still in the page cache"
        load_and_check()
        print("RESIDENT", *[part.mean() for part in np.array_split(resident_pages(), 4)])
    except BaseException as e:
        error = e
cp.multihost.sync_global_processes("measured", error=error)
if PROCESS_ID == 1:
    load_and_check()
print("OK")
"""


def test_each_process_reads_only_its_shards(tmp_path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"w": np.arange(ROWS * COLUMNS, dtype=np.float32).reshape(ROWS, COLUMNS)}, path)
    fd = os.open(path, os.O_RDONLY)
    try:  # Out of the page cache: written back first, then dropped.
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    body = f"ROWS, COLUMNS = {ROWS}, {COLUMNS}\n" + BODY
    results = [r.check() for r in run_job(body, devices_per_process=4, args=[str(path)])]
    assert all("OK" in r.stdout for r in results)
    words = results[0].stdout.split()
    quarters = [float(w) for w in words[words.index("RESIDENT") + 1 :][:4]]
    # Process 0 holds the first half of the rows, the first half of the data: it read those
    # pages. Past them the kernel reads ahead a little (8-12 MiB here); the last quarter of
    # the file (16 MiB beyond its shards) stays unread.
    assert quarters[0] > 0.99 and quarters[1] > 0.99, quarters
    assert quarters[3] < 0.05, quarters
