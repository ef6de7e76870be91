"""docs/memory.md says what ``checkpointables inspect`` reports as a save's peak staging
memory for its first example (a ``jax.Array`` and a Python ``int``), and it is so."""

from __future__ import annotations

import re
from pathlib import Path

import checkpointables as cp
import jax.numpy as jnp
import pytest
from checkpointables import cli

PAGE = Path(__file__).resolve().parents[2] / "docs" / "memory.md"


def test_memory_doc_counts_python_scalars_as_inspect_reports(tmp_path, capsys) -> None:
    try:
        cp.handlers.get("pytree")
    except cp.errors.CheckpointError:
        pytest.skip("needs the pytree plugin (checkpointables-pytree)")
    text = " ".join(PAGE.read_text().split())
    claimed = re.search(r"with its `step`, reports `([^`]+)`", text)
    assert claimed is not None, "docs/memory.md no longer says what its example reports"
    assert "Python scalars do count" in text
    budget = cp.options.MemoryOptions(host_bytes=64 << 20)
    with cp.Context(memory_options=budget):  # As the page's example, with a smaller array.
        cp.save_pytree(tmp_path / "a", {"w": jnp.ones((64, 64)), "step": 3})
        cp.save_pytree(tmp_path / "b", {"w": jnp.ones((64, 64))})
    assert cli.main(["inspect", "-q", str(tmp_path / "a")]) == 0
    assert f"peak staging memory of the save: {claimed[1]}" in capsys.readouterr().out
    assert cli.main(["inspect", "-q", str(tmp_path / "b")]) == 0
    assert "peak staging memory of the save: 0 bytes (0.0 MiB)" in capsys.readouterr().out
