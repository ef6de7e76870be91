"""docs/proto.md: its Python examples run as written, and its file listing is true."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[3] / "docs" / "proto.md"


def test_examples_run(capsys) -> None:
    text = PAGE.read_text()
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        exec(compile(block, str(PAGE), "exec"), namespace)
    # The page shows what its print() of proto.pbtxt outputs.
    shown = re.search(r"```text\n(# proto-file.*?)```", text, flags=re.S)
    assert shown is not None
    assert shown.group(1) in capsys.readouterr().out
