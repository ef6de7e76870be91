"""docs/object-stores.md runs as written, against the test server."""

from __future__ import annotations

import checkpointables as cp
from checkpointables import demo

from ..test_docs import python_blocks


def test_object_stores_page_runs(s3, bucket) -> None:
    namespace = {"BUCKET": bucket, "SERVER": s3.endpoint}
    try:
        for block in python_blocks("object-stores.md"):
            exec(compile(block, "docs/object-stores.md", "exec"), namespace)
    finally:
        cp.configure(storage_options=cp.options.StorageOptions())
    assert cp.is_checkpoint(f"{bucket}/run-7/configured")


def test_the_demo_trains_and_resumes_on_s3(bucket, capsys) -> None:
    assert demo.main(f"{bucket}/demo", steps=8) == 0
    assert "bit for bit: yes" in capsys.readouterr().out
