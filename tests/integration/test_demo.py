"""``checkpointables demo``: trains, checkpoints, stops halfway, resumes, verifies."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import checkpointables as cp
import pytest


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "checkpointables", "demo", *args],
        capture_output=True,
        text=True,
        timeout=300,  # Hang guard only; the demo takes seconds.
    )


@pytest.fixture
def needs_pytree() -> None:
    try:
        cp.handlers.get("pytree")
    except cp.errors.CheckpointError:
        pytest.skip("the demo needs the pytree plugin (checkpointables-pytree)")


@pytest.mark.slow
@pytest.mark.usefixtures("needs_pytree")
def test_demo_resumes_and_verifies(tmp_path) -> None:
    root = tmp_path / "demo"
    result = _demo(str(root), "--steps", "80")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"directory: {root}" in out
    assert "run 1: no checkpoint in the directory, starting from scratch" in out
    # Run 1 stops at step 39; its last save was step 32, so run 2 resumes after it.
    assert "run 1: stopped after step 39" in out
    assert "run 2: resuming after step 32" in out
    assert "restored step 79 equals the trained state bit for bit: yes" in out
    assert "the resumed run equals an uninterrupted run bit for bit: yes" in out
    assert re.search(r"blocked per save: median [\d.]+ ms, max [\d.]+ ms", out)
    kept = re.search(r"steps kept: (.*)", out).group(1)
    kept_steps = [int(s) for s in re.findall(r"(\d+) \(loss", kept)]
    # The latest 2 steps are among those kept; what is listed is what is on disk.
    assert kept_steps[-2:] == [72, 79]
    assert sorted(int(n) for n in os.listdir(root)) == kept_steps
    # Each kept step is an ordinary checkpoint the free functions load.
    loaded = cp.load_checkpointables(root / "79", {"progress": None})
    assert loaded == {"progress": {"examples_seen": 80 * 128}}
    assert cp.training.Checkpointer(root).latest_step().metrics["loss"] > 0


@pytest.mark.slow
@pytest.mark.usefixtures("needs_pytree")
def test_demo_defaults_to_a_new_temporary_directory() -> None:
    result = _demo()  # The default: 300 steps.
    assert result.returncode == 0, result.stdout + result.stderr
    root = re.search(r"directory: (\S+)", result.stdout).group(1)
    try:
        assert cp.training.Checkpointer(root).latest_step().step == 299
        assert "bit for bit: yes" in result.stdout and "bit for bit: NO" not in result.stdout
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def test_demo_refuses_bad_input(tmp_path) -> None:
    # Errors go to stderr with status 2, as argparse's do; stdout stays empty.
    result = _demo(str(tmp_path / "d"), "--steps", "2")
    assert result.returncode == 2 and result.stdout == ""
    assert "error: --steps must be at least 4" in result.stderr
    cp.save_checkpointables(tmp_path / "used" / "5", {"extra": {}})
    result = _demo(str(tmp_path / "used"), "--steps", "10")
    assert result.returncode == 2 and result.stdout == ""
    assert "already holds checkpoints" in result.stderr
