"""The JSON plugin: conformance suite plus what makes it JSON."""

from __future__ import annotations

import json

import checkpointables as cp
import numpy as np
from checkpointables.testing import HandlerConformance
from checkpointables_json import is_json_like

from ...metadata_edits import with_metadata_checksums_recomputed, without_metadata_checksums
from ...traced_memory import TracedPeak


class TestJsonConformance(HandlerConformance):
    handler_name = "json"

    def make_checkpointables(self):
        return [
            {"foo": "bar"},
            {"nested": {"list": [1, 2.5, None, True, "s"]}},
            [1, 2, 3],
            "text",
            7,
        ]

    def make_unhandleable(self):
        return [
            {"a": np.arange(3)},
            {1: "int key"},
            (1, 2),
            float("nan"),
            np.float32(1.0),
            object(),
        ]


def test_plain_json_goes_to_json_and_stays_readable(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"extra": {"foo": "bar"}})
    assert json.loads((tmp_path / "c" / "extra" / "data.json").read_text()) == {"foo": "bar"}


def test_is_json_like() -> None:
    assert is_json_like({"a": [1, {"b": None}], "c": 1.5, "d": False})
    assert not is_json_like({"a": (1, 2)})
    assert not is_json_like({"a": np.int64(1)})
    assert not is_json_like({"a": float("inf")})


def test_reads_orbax_v0_metadata_file_name(tmp_path) -> None:
    # Orbax's V0 JsonCheckpointHandler wrote `<item>/metadata` and recorded its own typestr.
    root = tmp_path / "c"
    (root / "meta").mkdir(parents=True)
    (root / "meta" / "metadata").write_text('{"k": 1}')
    (root / "_CHECKPOINT_METADATA").write_text(
        json.dumps(
            {
                "item_handlers": {
                    "meta": "orbax.checkpoint._src.handlers.json_checkpoint_handler."
                    "JsonCheckpointHandler"
                }
            }
        )
    )
    assert cp.load_checkpointables(root) == {"meta": {"k": 1}}


def test_damaged_data_json_names_the_file(tmp_path) -> None:
    import pytest

    cp.save_checkpointables(tmp_path / "c", {"extra": {"foo": "bar"}})
    (tmp_path / "c" / "extra" / "data.json").write_text("{oops")
    with pytest.raises(cp.errors.IntegrityError, match="data.json"):
        cp.load_checkpointables(tmp_path / "c")
    without_metadata_checksums(tmp_path / "c")  # Then the parser names it.
    with pytest.raises(cp.errors.MetadataError, match="data.json"):
        cp.load_checkpointables(tmp_path / "c")


MAX = cp.metadata_checksums.MAX_FILE_BYTES


def test_a_data_json_larger_than_a_metadata_file_is_refused_before_writing(tmp_path) -> None:
    import pytest

    # Escaped, each character is 12 bytes of JSON: a file past the limit, cheaply.
    big = {"text": "\U0001f600" * (MAX // 12 + 1), "step": 1234}
    with pytest.raises(cp.errors.InvalidArgumentError, match="pytree checkpointable"):
        cp.save_checkpointables(tmp_path / "c", {"extra": big})
    assert not (tmp_path / "c").exists()


def test_a_huge_data_json_is_refused_unread(tmp_path) -> None:
    import pytest
    from checkpointables import cli

    # Sparse: 3 GiB on no disk. Read whole, a 2 GiB one took 24 s and 4.2 GiB.
    cp.save_checkpointables(tmp_path / "c", {"extra": {"foo": "bar"}})
    with open(tmp_path / "c" / "extra" / "data.json", "r+b") as f:
        f.truncate(3 << 30)
    with_metadata_checksums_recomputed(tmp_path / "c")  # It is now data, as core sees it.
    with TracedPeak() as traced:
        with pytest.raises(cp.errors.MetadataError, match="data.json holds more than"):
            cp.load_checkpointables(tmp_path / "c")
        assert cli.main(["verify", str(tmp_path / "c")]) == 1
    assert traced.peak < 64 << 20, traced.peak


def test_an_int_json_cannot_write_is_not_json_like(tmp_path) -> None:
    import pytest

    # Python converts ints of at most 4300 digits to text; json.dumps raised ValueError.
    assert is_json_like({"v": 10**4299}) and not is_json_like({"v": [-(10**5000)]})
    with pytest.raises(cp.errors.CheckpointError):  # The pytree handler's: "store it as a str".
        cp.save_checkpointables(tmp_path / "c", {"extra": {"v": 10**5000}})
    assert not (tmp_path / "c").exists()
