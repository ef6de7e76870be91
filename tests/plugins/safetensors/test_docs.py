"""docs/safetensors.md: its Python examples run as written (on the 8 CPU devices of the tests)."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[3] / "docs" / "safetensors.md"


def test_examples_run(monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) >= 7
    for block in blocks:
        exec(compile(block, str(PAGE), "exec"), namespace)
    assert len(namespace["params"]["model"]["embed_tokens"]["weight"].addressable_shards) == 8
