"""docs/training.md runs as written, block after block, in a fresh directory."""

from __future__ import annotations

import re
from pathlib import Path

import checkpointables as cp
import pytest

DOC = Path(__file__).resolve().parents[3] / "docs" / "training.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_guide_has_the_issue_example() -> None:
    text = DOC.read_text()
    assert 'ckptr.save_pytree_async(step, state, metrics={"loss": loss})' in text
    assert len(python_blocks()) >= 6


def test_the_guide_runs(tmp_path, monkeypatch) -> None:
    try:
        cp.handlers.get("pytree")
    except cp.errors.CheckpointError:
        pytest.skip("needs the pytree plugin (checkpointables-pytree)")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "docs_training"}
    for block in python_blocks():
        exec(compile(block, str(DOC), "exec"), namespace)
    # After the resumed run: the latest 3, which are also the 2 lowest losses.
    assert sorted(p.name for p in (tmp_path / "runs" / "toy").iterdir()) == ["3000", "4000", "5000"]
