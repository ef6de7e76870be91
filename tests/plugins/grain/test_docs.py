"""docs/grain.md: its Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import checkpointables as cp
import pytest

PAGE = Path(__file__).resolve().parents[3] / "docs" / "grain.md"


def test_examples_run() -> None:
    try:
        cp.handlers.get("pytree")
    except cp.errors.MissingHandlerError:
        # The page saves the iterator beside a model pytree, as training does.
        pytest.skip("docs/grain.md needs the pytree plugin, which is not installed yet")
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S):
        exec(compile(block, str(PAGE), "exec"), namespace)
    assert namespace["restored"]["dataset"] is namespace["fresh"]
