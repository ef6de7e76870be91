"""``cp.staging``: handlers report the host memory a save staged; core records the peak."""

from __future__ import annotations

import json

import checkpointables as cp
import pytest
from checkpointables import cli


class Staging:
    """Saves nothing; reports ``peak`` staged (``None``: reports nothing)."""

    def __init__(self, peak: int | None) -> None:
        self.peak = peak

    async def save(self, directory):
        staging = cp.staging.current()  # Only the blocking phase sees it.

        async def write():
            await directory.await_creation()
            if staging is not None and self.peak is not None:
                staging.report(self.peak)

        return write()

    async def load(self, directory):
        async def read():
            return None

        return read()


def _performance_metrics(path) -> dict:
    return json.loads((path / "_CHECKPOINT_METADATA").read_text())["performance_metrics"]


def test_the_handlers_peaks_are_summed_and_recorded(tmp_path, capsys) -> None:
    cp.save_checkpointables(tmp_path / "c", {"a": Staging(1000), "b": Staging(24)})
    assert _performance_metrics(tmp_path / "c") == {"peak_staging_bytes": 1024}
    assert cli.main(["inspect", str(tmp_path / "c")]) == 0
    assert "peak staging memory of the save: 1,024 bytes" in capsys.readouterr().out


def test_nothing_is_recorded_when_no_handler_reports(tmp_path, capsys) -> None:
    cp.save_checkpointables(tmp_path / "c", {"a": Staging(None)})
    assert _performance_metrics(tmp_path / "c") == {}
    cli.main(["inspect", str(tmp_path / "c")])
    assert "peak staging" not in capsys.readouterr().out


def test_the_checkpointer_reports_its_saves_peak(tmp_path) -> None:
    with cp.training.Checkpointer(tmp_path) as ckptr:
        ckptr.save_checkpointables(0, {"a": Staging(4096)})
        assert ckptr.last_save_stats.peak_staging_bytes == 4096


@pytest.mark.parametrize("recorded", [{}, {"peak_staging_bytes": -1}, {"peak_staging_bytes": 1.5}])
def test_a_missing_or_odd_record_reads_as_none(recorded) -> None:
    assert cp.staging.recorded_peak({"performance_metrics": recorded}) is None
    assert cp.staging.recorded_peak({"performance_metrics": None}) is None


def test_orbax_reads_the_metadata(tmp_path) -> None:
    serialization = pytest.importorskip(
        "orbax.checkpoint._src.metadata.step_metadata_serialization"
    )
    cp.save_checkpointables(tmp_path / "c", {"a": Staging(1000)})
    raw = json.loads((tmp_path / "c" / "_CHECKPOINT_METADATA").read_text())
    step = serialization.deserialize(raw)  # Orbax keeps only floats: the integer is ignored.
    assert step.init_timestamp_nsecs == raw["init_timestamp_nsecs"]
