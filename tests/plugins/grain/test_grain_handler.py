"""The Grain plugin: conformance suite, exact resumption, files, and errors."""

from __future__ import annotations

import json
import os
import shutil
import threading

import checkpointables as cp
import grain
import pytest
from checkpointables._asyncio import run_sync
from checkpointables.testing import HandlerConformance
from checkpointables_grain import (
    GrainIteratorMetadata,
    IteratorStateError,
    ProcessCountMismatchError,
)

from ...metadata_edits import with_metadata_checksums_recomputed, without_metadata_checksums
from .pipelines import PIPELINES, batched_pipeline, data_loader, map_pipeline, take


class _StatefulPoint:
    """Has save/load methods like a Grain iterator, but is not one."""

    async def save(self, directory):
        return None

    async def load(self, directory):
        return None


class TestGrainConformance(HandlerConformance):
    handler_name = "grain"
    checkpointable_name = "dataset"

    def make_checkpointables(self):
        self._pipelines = {}
        iterators = []
        for steps, (name, make) in enumerate(PIPELINES.items(), start=1):
            iterator = iter(make())
            take(iterator, steps)
            self._pipelines[id(iterator)] = name
            iterators.append(iterator)
        return iterators

    def make_unhandleable(self):
        return [map_pipeline(), iter([1, 2, 3]), _StatefulPoint(), {"next_index": 3}]

    def abstract_for(self, checkpointable):
        return iter(PIPELINES[self._pipelines[id(checkpointable)]]())

    def assert_loaded_equal(self, loaded, original):
        assert loaded is not original
        assert take(loaded, 6) == take(original, 6)

    def assert_metadata_matches(self, metadata, original):
        kind = (
            "DataLoaderIterator"
            if isinstance(original, grain.DataLoaderIterator)
            else ("DatasetIterator")
        )
        assert metadata == GrainIteratorMetadata(kind, 1, grain.__version__)


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_resumes_exactly_beside_other_checkpointables(tmp_path, pipeline) -> None:
    make = PIPELINES[pipeline]
    it = iter(make())
    take(it, 5)
    cp.save_checkpointables(tmp_path / "c", {"train_state": {"step": 5}, "dataset": it})
    expected = take(it, 8)  # Into the second epoch of the map pipeline and the data loader.
    fresh = iter(make())
    loaded = cp.load_checkpointables(tmp_path / "c", {"train_state": None, "dataset": fresh})
    assert loaded["train_state"] == {"step": 5}
    assert loaded["dataset"] is fresh
    assert take(fresh, 8) == expected


class SpyIterator(grain.DatasetIterator):
    """Wraps a pipeline's iterator and records the thread of every get_state call."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner
        self.get_state_threads: list[threading.Thread] = []

    def __next__(self):
        return next(self.inner)

    def get_state(self):
        self.get_state_threads.append(threading.current_thread())
        return self.inner.get_state()

    def set_state(self, state) -> None:
        self.inner.set_state(state)


def test_async_save_captures_state_in_the_blocking_phase(tmp_path) -> None:
    it = SpyIterator(iter(map_pipeline()))
    take(it, 3)
    response = cp.save_checkpointables_async(tmp_path / "c", {"dataset": it})
    # Captured on the caller's thread before the call returned, never again later.
    assert it.get_state_threads == [threading.current_thread()]
    expected = take(it, 10)  # The loop keeps iterating while the save runs.
    response.result()
    assert len(it.get_state_threads) == 1
    fresh = iter(map_pipeline())
    cp.load_checkpointables(tmp_path / "c", {"dataset": fresh})
    assert take(fresh, 10) == expected


def test_stateful_handler_does_not_claim_grain_iterators(tmp_path) -> None:
    # Grain iterators have save/load methods; the stateful handler (priority 20)
    # would take them if the Grain handler (priority 10) did not come first.
    it = iter(map_pipeline())
    cp.save_checkpointables(tmp_path / "c", {"dataset": it})
    meta = json.loads((tmp_path / "c" / "_CHECKPOINT_METADATA").read_text())
    assert meta["item_handlers"]["dataset"] == "checkpointables_grain.GrainIteratorHandler"


def test_files_are_grains_own_json(tmp_path) -> None:
    it = iter(map_pipeline())
    take(it, 4)
    cp.save_checkpointables(tmp_path / "c", {"dataset": it})
    directory = tmp_path / "c" / "dataset"
    assert sorted(os.listdir(directory)) == ["grain_iterator.json", "process_0-of-1.json"]
    state_text = (directory / "process_0-of-1.json").read_text()
    assert state_text == json.dumps(it.get_state(), indent=4)
    # So Grain's own restore (its StatefulCheckpointable load) reads our files.
    fresh = iter(map_pipeline())
    run_sync(run_sync(fresh.load(directory)))
    assert take(fresh, 5) == take(it, 5)


def test_data_loader_state_file_is_its_json(tmp_path) -> None:
    it = iter(data_loader())
    take(it, 2)
    cp.save_checkpointables(tmp_path / "c", {"dataset": it})
    text = (tmp_path / "c" / "dataset" / "process_0-of-1.json").read_text()
    assert text == it.get_state().decode()
    assert json.loads(text)["last_seen_indices"]


def test_dataset_or_data_loader_as_abstract_makes_the_iterator(tmp_path) -> None:
    for i, make in enumerate((map_pipeline, data_loader)):
        it = iter(make())
        take(it, 3)
        cp.save_checkpointables(tmp_path / f"c{i}", {"dataset": it})
        restored = cp.load_checkpointables(tmp_path / f"c{i}", {"dataset": make()})["dataset"]
        assert take(restored, 4) == take(it, 4)


def test_loading_needs_an_iterator(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"dataset": iter(map_pipeline()), "x": {"a": 1}})
    with pytest.raises(IteratorStateError, match=r"'dataset'.*fresh iterator.*iter\(dataset\)"):
        cp.load_checkpointables(tmp_path / "c")
    with pytest.raises(IteratorStateError, match="a dict was given"):
        cp.load_checkpointables(tmp_path / "c", {"dataset": {"next_index": 0}})
    # Leaving it out loads the rest.
    assert cp.load_checkpointables(tmp_path / "c", {"x": None}) == {"x": {"a": 1}}


def test_metadata_can_be_passed_back_and_explains_itself(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"dataset": iter(data_loader())})
    meta = cp.checkpointables_metadata(tmp_path / "c")
    assert meta.metadata["dataset"].iterator_type == "DataLoaderIterator"
    with pytest.raises(IteratorStateError, match="GrainIteratorMetadata was given"):
        cp.load_checkpointables(tmp_path / "c", meta)


def test_iterator_kind_mismatch_is_refused(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"dataset": iter(data_loader())})
    with pytest.raises(IteratorStateError, match=r"saved from a grain\.DataLoader iterator"):
        cp.load_checkpointables(tmp_path / "c", {"dataset": iter(map_pipeline())})


def test_different_pipeline_is_refused_with_a_clear_error(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"dataset": iter(data_loader(seed=1))})
    with pytest.raises(
        IteratorStateError, match=r"(?s)rejected the saved state.*seed=2.*same pipeline"
    ):
        cp.load_checkpointables(tmp_path / "c", {"dataset": iter(data_loader(seed=2))})


def _as_if_saved_by_two_processes(directory, *, keep_info: bool) -> None:
    """Rewrites a one-process save into the layout a two-process save writes."""
    state = (directory / "process_0-of-1.json").read_text()
    (directory / "process_0-of-1.json").unlink()
    for i in range(2):
        (directory / f"process_{i}-of-2.json").write_text(state)
    info_file = directory / "grain_iterator.json"
    if keep_info:
        info = json.loads(info_file.read_text())
        info_file.write_text(json.dumps({**info, "process_count": 2}))
    else:  # As Grain's own handlers and Orbax write it.
        info_file.unlink()
    with_metadata_checksums_recomputed(directory.parent)  # As that save would have.


@pytest.mark.parametrize("keep_info", [True, False])
def test_restoring_with_another_process_count_fails(tmp_path, keep_info) -> None:
    cp.save_checkpointables(tmp_path / "c", {"dataset": iter(map_pipeline())})
    _as_if_saved_by_two_processes(tmp_path / "c" / "dataset", keep_info=keep_info)
    with pytest.raises(ProcessCountMismatchError, match=r"states of 2 process.*this job has 1"):
        cp.load_checkpointables(tmp_path / "c", {"dataset": iter(map_pipeline())})
    assert cp.checkpointables_metadata(tmp_path / "c").metadata["dataset"].process_count == 2


def test_missing_state_file_is_an_integrity_error(tmp_path, capsys) -> None:
    from checkpointables import cli

    cp.save_checkpointables(tmp_path / "c", {"dataset": iter(map_pipeline())})
    assert cli.main(["verify", str(tmp_path / "c")]) == 0
    assert "dataset: ok" in capsys.readouterr().out
    (tmp_path / "c" / "dataset" / "process_0-of-1.json").unlink()
    with pytest.raises(cp.errors.IntegrityError, match="no process_0-of-1.json"):
        cp.load_checkpointables(tmp_path / "c", {"dataset": iter(map_pipeline())})
    assert cli.main(["verify", str(tmp_path / "c")]) == 1
    assert "lacks process_0-of-1.json" in capsys.readouterr().out


def test_damaged_files_are_named(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"dataset": iter(map_pipeline())})
    state_file = tmp_path / "c" / "dataset" / "process_0-of-1.json"
    state_file.write_text('{"next_index": ')
    with pytest.raises(cp.errors.IntegrityError, match="process_0-of-1.json"):
        cp.load_checkpointables(tmp_path / "c", {"dataset": iter(map_pipeline())})
    (tmp_path / "c" / "dataset" / "grain_iterator.json").write_text("[1")
    with pytest.raises(cp.errors.IntegrityError, match="grain_iterator.json"):
        cp.load_checkpointables(tmp_path / "c", {"dataset": iter(map_pipeline())})
    without_metadata_checksums(tmp_path / "c")  # Then the parser names it.
    with pytest.raises(cp.errors.MetadataError, match="grain_iterator.json"):
        cp.load_checkpointables(tmp_path / "c", {"dataset": iter(map_pipeline())})


def test_untyped_checkpoint_is_recognized_by_its_files(tmp_path) -> None:
    it = iter(map_pipeline())
    take(it, 2)
    cp.save_checkpointables(tmp_path / "c", {"dataset": it})
    meta_file = tmp_path / "c" / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_file.read_text())
    del meta["item_handlers"]["dataset"]
    meta_file.write_text(json.dumps(meta))
    without_metadata_checksums(tmp_path / "c")  # As Orbax writes it.
    shutil.rmtree(tmp_path / "unused", ignore_errors=True)
    fresh = iter(map_pipeline())
    cp.load_checkpointables(tmp_path / "c", {"dataset": fresh})
    assert take(fresh, 3) == take(it, 3)


def test_a_dataset_iterator_state_does_not_record_the_seed(tmp_path) -> None:
    """As docs/grain.md says: a dataset iterator's state is a position only, so another
    seed's pipeline takes it without error and yields its own elements. If Grain starts
    recording seeds (this test fails), the plugin can check them and the page must say so."""

    def pipeline(seed):
        return grain.MapDataset.range(40).shuffle(seed=seed).to_iter_dataset().batch(4)

    it = iter(pipeline(1))
    take(it, 3)
    cp.save_checkpointables(tmp_path / "c", {"dataset": it})
    other = cp.load_checkpointables(tmp_path / "c", {"dataset": iter(pipeline(2))})["dataset"]
    same = cp.load_checkpointables(tmp_path / "c", {"dataset": iter(pipeline(1))})["dataset"]
    expected = take(it, 2)
    assert take(same, 2) == expected
    assert take(other, 2) != expected


@pytest.mark.parametrize("pipeline", [map_pipeline, batched_pipeline, data_loader])
def test_saving_a_dataset_asks_for_its_iterator(tmp_path, pipeline) -> None:
    hint = r"grain: a grain\.\w+ has no position to save; save the iterator .*iter\(d"
    with pytest.raises(cp.errors.NoHandlerForObjectError, match=hint):
        cp.save_checkpointables(tmp_path / "c", {"dataset": pipeline()})
    assert not os.path.exists(tmp_path / "c")
