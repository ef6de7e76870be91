"""docs/incremental.md: its example runs as written, and links what its comments say."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from checkpointables_pytree import reuse

from .helpers import linked_names

PAGE = Path(__file__).resolve().parents[4] / "docs" / "incremental.md"

pytestmark = pytest.mark.fast_path  # Linking is the fast path's.


def test_the_example_runs_and_links_what_it_says(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)  # The example writes to relative paths.
    (block,) = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    exec(compile(block, str(PAGE), "exec", dont_inherit=True), {"__name__": "docs_incremental"})
    assert capsys.readouterr().out.split("\n")[:3] == ["0 0", "1 1048576", "2 1048576"]
    both = {"base.w", "adapter"}
    assert linked_names(tmp_path / "run" / "2", "state") == {"base.w"}
    assert linked_names(tmp_path / "ckpt" / "2") == both  # Compared with a plain save.
    assert linked_names(tmp_path / "ckpt" / "3") == both  # By fingerprints.
    assert linked_names(tmp_path / "ckpt" / "4", "state") == both  # From its only pytree.
    report = reuse.reuse_report(tmp_path / "export" / "pytree")
    assert report == dict.fromkeys(both, str(tmp_path / "run" / "2")), report
