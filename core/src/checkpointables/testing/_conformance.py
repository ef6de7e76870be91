"""The handler conformance suite (see ``checkpointables.testing``)."""

from __future__ import annotations

import os
from typing import Any

import checkpointables as cp
from checkpointables.checkpoint_metadata import read_checkpoint_metadata


class HandlerConformance:
    """Tests every checkpointable handler must pass. Subclass and fill in.

    Class attributes:
      handler_name: the registered name (or typestr) of the handler under test.
      resolves_by_default: whether ``save_checkpointables`` picks this handler
        for the sample objects without forcing it.
      checkpointable_name: the name samples are saved under.
    """

    handler_name: str = ""
    resolves_by_default: bool = True
    checkpointable_name: str = "item"

    # -- What a subclass provides ------------------------------------------

    def make_checkpointables(self) -> list[Any]:
        """Sample objects the handler saves."""
        raise NotImplementedError

    def make_unhandleable(self) -> list[Any]:
        """Objects ``is_handleable`` must reject (may be empty)."""
        return []

    def abstract_for(self, checkpointable: Any) -> Any:
        """An abstract checkpointable to load ``checkpointable`` into, or ``None``."""
        return None

    def assert_loaded_equal(self, loaded: Any, original: Any) -> None:
        """Asserts that ``loaded`` equals ``original``; override for arrays."""
        assert loaded == original, f"loaded {loaded!r}, saved {original!r}"

    def assert_metadata_matches(self, metadata: Any, original: Any) -> None:
        """Asserts that ``metadata`` describes ``original``; override as needed."""

    # -- Helpers -------------------------------------------------------------

    @property
    def handler_cls(self) -> type:
        return cp.handlers.get(self.handler_name)

    def _context(self) -> cp.Context:
        return cp.Context(
            checkpointables_options=cp.options.CheckpointablesOptions.create_with_handlers(
                **{self.checkpointable_name: self.handler_cls}
            )
        )

    def _save(self, path: Any, obj: Any, **kwargs: Any) -> None:
        with self._context():
            cp.save_checkpointables(path, {self.checkpointable_name: obj}, **kwargs)

    # -- The tests -----------------------------------------------------------

    def test_handler_is_registered(self) -> None:
        registered = [r.handler_cls for r in cp.handlers.registered_handlers()]
        assert self.handler_cls in registered

    def test_is_handleable(self) -> None:
        handler = self.handler_cls()
        for obj in self.make_checkpointables():
            assert handler.is_handleable(obj), f"{self.handler_name} rejects {obj!r}"
        for obj in self.make_unhandleable():
            assert not handler.is_handleable(obj), f"{self.handler_name} accepts {obj!r}"

    def test_round_trip(self, tmp_path: Any) -> None:
        for i, obj in enumerate(self.make_checkpointables()):
            path = tmp_path / f"ckpt{i}"
            self._save(path, obj)
            assert cp.is_checkpoint(path)
            loaded = cp.load_checkpointables(
                path, {self.checkpointable_name: self.abstract_for(obj)}
            )
            self.assert_loaded_equal(loaded[self.checkpointable_name], obj)

    def test_resolution_picks_handler(self, tmp_path: Any) -> None:
        if not self.resolves_by_default:
            return
        for i, obj in enumerate(self.make_checkpointables()):
            path = tmp_path / f"ckpt{i}"
            cp.save_checkpointables(path, {self.checkpointable_name: obj})
            recorded = read_checkpoint_metadata(path)["item_handlers"][self.checkpointable_name]
            # The handler's typestr (its class's, or the one it registered with).
            assert cp.handlers.get(recorded) is self.handler_cls

    def test_typestr_recorded_and_loaded_without_forcing(self, tmp_path: Any) -> None:
        for i, obj in enumerate(self.make_checkpointables()):
            path = tmp_path / f"ckpt{i}"
            self._save(path, obj)
            recorded = read_checkpoint_metadata(path)["item_handlers"][self.checkpointable_name]
            assert cp.handlers.get(recorded) is self.handler_cls
            # Loading needs no forcing: the recorded typestr finds the handler.
            loaded = cp.load_checkpointables(
                path, {self.checkpointable_name: self.abstract_for(obj)}
            )
            self.assert_loaded_equal(loaded[self.checkpointable_name], obj)

    def test_metadata(self, tmp_path: Any) -> None:
        for i, obj in enumerate(self.make_checkpointables()):
            path = tmp_path / f"ckpt{i}"
            self._save(path, obj, custom_metadata={"sample": i})
            meta = cp.checkpointables_metadata(path)
            assert meta.custom_metadata == {"sample": i}
            assert meta.init_timestamp_nsecs is not None and meta.commit_timestamp_nsecs is not None
            assert meta.commit_timestamp_nsecs >= meta.init_timestamp_nsecs > 0
            self.assert_metadata_matches(meta.metadata[self.checkpointable_name], obj)

    def test_async_save_and_load(self, tmp_path: Any) -> None:
        obj = self.make_checkpointables()[0]
        path = tmp_path / "ckpt"
        with self._context():
            response = cp.save_checkpointables_async(path, {self.checkpointable_name: obj})
        assert response.result(timeout=120) is None
        assert response.done()
        assert cp.is_checkpoint(path)
        loading = cp.load_checkpointables_async(
            path, {self.checkpointable_name: self.abstract_for(obj)}
        )
        self.assert_loaded_equal(loading.result(timeout=120)[self.checkpointable_name], obj)

    def test_overwrite(self, tmp_path: Any) -> None:
        objs = self.make_checkpointables()
        path = tmp_path / "ckpt"
        self._save(path, objs[0])
        try:
            self._save(path, objs[-1])
        except FileExistsError:
            pass
        else:
            raise AssertionError("saving over an existing checkpoint must raise FileExistsError")
        self._save(path, objs[-1], overwrite=True)
        loaded = cp.load_checkpointables(
            path, {self.checkpointable_name: self.abstract_for(objs[-1])}
        )
        self.assert_loaded_equal(loaded[self.checkpointable_name], objs[-1])
        assert [p for p in os.listdir(tmp_path) if p != "ckpt"] == []

    def test_bad_input_is_rejected_before_writing(self, tmp_path: Any) -> None:
        for i, obj in enumerate(self.make_unhandleable()):
            path = tmp_path / f"bad{i}"
            try:
                self._save(path, obj)
            except cp.errors.NoHandlerForObjectError as e:
                assert self.checkpointable_name in str(e)
            else:
                raise AssertionError(f"forcing {self.handler_name} on {obj!r} must fail")
            assert os.listdir(tmp_path) == [], "a rejected save must write nothing"

    def test_load_missing_path(self, tmp_path: Any) -> None:
        try:
            cp.load_checkpointables(tmp_path / "missing")
        except FileNotFoundError as e:
            assert "missing" in str(e)
        else:
            raise AssertionError("loading a missing path must raise FileNotFoundError")
