"""How many ranges a load from an object store keeps in flight."""

from __future__ import annotations

import checkpointables as cp
from checkpointables_pytree import io

MIB = 1 << 20


def test_small_loads_keep_few_ranges_in_flight_and_large_ones_many() -> None:
    in_flight = io.requests_in_flight
    assert in_flight(0) == in_flight(18 * MIB) == in_flight(256 * MIB) == 2
    assert in_flight(1024 * MIB) == 4
    # Large loads get the request concurrency, TensorStore's 32 by default, and no more.
    assert in_flight(8192 * MIB) == in_flight(100 * 1024 * MIB) == 32


def test_the_request_concurrency_option_caps_ranges_in_flight() -> None:
    def in_flight(concurrency: int, load_bytes: int) -> int:
        options = cp.options.StorageOptions(request_concurrency=concurrency)
        with cp.Context(storage_options=options):
            return io.requests_in_flight(load_bytes)

    assert in_flight(1, 256 * MIB) == 1
    assert in_flight(8, 100 * 1024 * MIB) == 8
    assert in_flight(64, 100 * 1024 * MIB) == 64
