"""The safetensors commands' arguments as the command line parses them."""

from __future__ import annotations

import os

import pytest
from checkpointables import cli


@pytest.mark.parametrize(
    ("given", "option", "value"),
    [("--max-shard", "--max-shard-size", "-5GB"), ("--host-mem", "--host-memory", "-1GiB")],
)
def test_a_negative_size_after_an_abbreviated_option_is_refused_naming_it(
    tmp_path, capsys, given, option, value
) -> None:
    # argparse accepts a prefix of an option: the dashed value must still reach it, not
    # be taken for an option ("expected one argument").
    out = str(tmp_path / "o")
    with pytest.raises(SystemExit) as exited:
        cli.main(["export", str(tmp_path / "ckpt"), out, given, value])
    assert exited.value.code == 2
    assert f"error: argument {option}: a size must be positive, got '{value}'" in (
        capsys.readouterr().err
    )
    assert not os.path.exists(out)
