"""A bucket name TensorStore refuses is ``cp.errors.InvalidArgumentError`` on every path.

``cp.storage`` and ``cp.path.as_path`` check names before any request
(``test_bucket_names.py``); the pytree plugin's own backend and kvstore specs,
used by code that reaches the object store without them, check too, instead
of letting TensorStore's bare ``ValueError`` ("Invalid S3 bucket name") out.
"""

from __future__ import annotations

import checkpointables as cp
import pytest
from checkpointables_pytree import storage

BAD = ("s3://ab/x", "s3://bad!name/x", "s3://1.2.3.4/x", "s3://xn--abc/x", "s3://a..b/x")


@pytest.mark.parametrize("url", BAD)
def test_the_backend_refuses_a_bad_bucket_name_on_every_request(s3, url) -> None:
    backend = storage.storage_for(cp.context.get_context())
    requests = {
        "GET": lambda: backend.read_bytes(f"{url}/f"),
        "bounded GET": lambda: backend.read_bytes_within(f"{url}/f", 10),
        "HEAD": lambda: backend.is_file(f"{url}/f"),
        "LIST": lambda: backend.list_dir(url),
        "spec": lambda: storage.kvstore_spec(url),
    }
    for name, request in requests.items():
        try:
            request()
        except cp.errors.InvalidArgumentError as e:
            assert "not an S3 bucket name" in str(e), (name, e)
        else:
            raise AssertionError(f"{name} of {url} raised nothing")
