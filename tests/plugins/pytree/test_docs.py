"""docs/pytree.md: every Python example runs as written, in order."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[3] / "docs" / "pytree.md"


def test_examples_run(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)  # The examples write to relative paths.
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) >= 10
    namespace: dict = {"__name__": "docs_pytree"}
    for block in blocks:
        exec(compile(block, str(PAGE), "exec", dont_inherit=True), namespace)
    out = capsys.readouterr().out
    assert "(8, 4) float32" in out
    assert (
        "in the checkpoint but not in the abstract tree (6): ['lr'], ['name'], ['params']['b']"
        in out
    )
