"""docs/local-tier.md runs as written, block after block, in a fresh directory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[4] / "docs" / "local-tier.md"


def test_the_guide_runs(tmp_path, monkeypatch, capsys) -> None:
    import checkpointables as cp

    try:
        cp.handlers.get("pytree")
    except cp.errors.CheckpointError:
        pytest.skip("needs the pytree plugin (checkpointables-pytree)")
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 3
    namespace: dict = {"__name__": "docs_local_tier"}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
    printed = capsys.readouterr().out
    assert "[0, 100, 200]\n[220, 230]\n230 local" in printed
    held = sorted(p.name for p in (tmp_path / "runs" / "local").iterdir())
    # The run it serves, and the lock of the process using it.
    assert held == [
        ".checkpointables-local-tier.json",
        ".checkpointables-local-tier.lock",
        "220",
        "230",
    ]
