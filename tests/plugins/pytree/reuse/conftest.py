"""Fixtures of the reuse tests."""

from __future__ import annotations

import os
import shutil
import uuid

import pytest


def _other_file_system(tmp_path):
    """A directory on a file system other than ``tmp_path``'s (a tmpfs), or a skip."""
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second file system (/dev/shm) on this machine")
    directory = os.path.join(shm, f"checkpointables-test-{uuid.uuid4().hex}")
    os.makedirs(directory)
    return directory


@pytest.fixture
def elsewhere(tmp_path):
    """A directory on a file system other than ``tmp_path``'s, removed after the test."""
    directory = _other_file_system(tmp_path)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)
