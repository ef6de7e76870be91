"""``python -m bench.run --tmp-dir DIR`` with a DIR that is missing (or a file) is a
one-line argument error, not a FileNotFoundError traceback after the imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_tmp_dir_that_is_no_directory_is_an_argument_error(tmp_path: Path, kind: str):
    target = tmp_path / "scratch"
    if kind == "file":
        target.write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--tmp-dir", str(target)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    what = "does not exist" if kind == "missing" else "is not a directory"
    assert f"error: --tmp-dir {target} {what}: create it" in proc.stderr
    assert not target.is_dir()
