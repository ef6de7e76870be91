"""docs/pytree.md's PointLeafHandler works on S3 as on a local disk (it reads and writes
through cp.storage and cp.metadata_checksums, not epath, which needs s3fs there)."""

from __future__ import annotations

import checkpointables as cp
import numpy as np
import pytest

from ..test_docs import python_blocks


def _doc_context() -> tuple[dict, cp.Context]:
    (block,) = [b for b in python_blocks("pytree.md") if "class PointLeafHandler" in b]
    doc: dict = {"__name__": "docs_pytree_on_s3"}
    exec(compile(block, "docs/pytree.md", "exec", dont_inherit=True), doc)
    registry = cp.serialization.StandardLeafHandlerRegistry()
    registry.add(doc["Point"], doc["AbstractPoint"], doc["PointLeafHandler"])
    options = cp.options.PyTreeOptions(leaf_handler_registry=registry)
    return doc, cp.Context(pytree_options=options)


def test_the_doc_leaf_handler_round_trips_on_s3_and_refuses_damage(bucket) -> None:
    doc, context = _doc_context()
    path = f"{bucket}/points"
    with context:
        cp.save_pytree(path, {"origin": doc["Point"](0.0, 1.5), "w": np.ones(3)})
        loaded = cp.load_pytree(path)
        assert loaded["origin"] == doc["Point"](0.0, 1.5)
        np.testing.assert_array_equal(loaded["w"], np.ones(3))
        assert cp.pytree_metadata(path).metadata["origin"] == doc["AbstractPoint"]()
        cp.storage.write_text(f"{path}/pytree/origin.point.json", '{"x": 9.0, "y": 1.5}')
        with pytest.raises(cp.errors.IntegrityError, match=r"origin\.point\.json"):
            cp.load_pytree(path)
