"""The speed and memory benchmark of issue 3.

Run from the repository root::

    uv run python -m bench.run            # the full run (median of 5), several minutes
    uv run python -m bench.run --quick    # 1 repeat, smaller sizes, under a minute

It times checkpointables, orbax-checkpoint, safetensors and a raw
``write`` + ``fsync`` baseline on the same trees, prints ratios against the
issue's targets and writes the numbers as JSON into ``bench/results/``.
``docs/performance.md`` explains each number.
"""
