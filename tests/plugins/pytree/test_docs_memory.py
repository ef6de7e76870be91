"""docs/memory.md: every Python example runs as written, in order."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[3] / "docs" / "memory.md"


def test_examples_run(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)  # The examples write to relative paths.
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) == 2
    namespace: dict = {"__name__": "docs_memory"}
    for block in blocks:
        exec(compile(block, str(PAGE), "exec", dont_inherit=True), namespace)
    assert "(4096, 4096) 3" in capsys.readouterr().out
