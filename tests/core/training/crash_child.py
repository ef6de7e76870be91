"""A training loop for the crash-safety test, which kills it with SIGKILL at random moments.

Usage: python crash_child.py ROOT {json,pytree}

It resumes from the latest step of ROOT and saves every step asynchronously
(a stateful blob of several files, a JSON piece, optionally a pytree, and
metrics), keeps the latest 3 steps, and now and then overwrites the previous
step with identical content. Every saved value is a pure function of the
step, so the test can check each listed step bit for bit. It prints "ready"
once running, and "committed N" after each commit it has observed.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import checkpointables as cp

FILES = 40


def blob_part(step: int, i: int) -> bytes:
    """File ``i`` of the blob of ``step`` (4 KiB)."""
    return hashlib.sha256(f"{step}/{i}".encode()).digest() * 128


def tree(step: int) -> dict[str, Any]:
    """The pytree of ``step``."""
    import numpy as np

    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal((64, 32)).astype(np.float32),
        "b": rng.integers(0, 2**31, size=(7,), dtype=np.int64),
    }


def metrics(step: int) -> dict[str, float]:
    """The metrics of ``step``."""
    return {"loss": 1.0 / (step + 1)}


class Blob:
    """A stateful checkpointable written as ``FILES`` files."""

    def __init__(self, step: int = -1) -> None:
        self.step = step
        self.parts: list[bytes] = []

    async def save(self, directory: Any) -> Any:
        step = self.step

        async def write() -> None:
            path = await directory.await_creation()
            for i in range(FILES):
                (path / f"part{i}").write_bytes(blob_part(step, i))

        return write()

    async def load(self, directory: Any) -> Any:
        async def read() -> None:
            self.parts = [(directory / f"part{i}").read_bytes() for i in range(FILES)]

        return read()


def items(step: int, with_pytree: bool) -> dict[str, Any]:
    """Everything saved at ``step``."""
    result: dict[str, Any] = {"blob": Blob(step), "meta": {"step": step}}
    if with_pytree:
        result["pytree"] = tree(step)
    return result


def main() -> None:
    root, mode = sys.argv[1], sys.argv[2]
    with_pytree = mode == "pytree"
    ckptr = cp.training.Checkpointer(
        root,
        save_decision_policy=cp.training.save_decision_policies.EveryNStepsPolicy(1),
        preservation_policy=cp.training.preservation_policies.LatestN(3),
    )
    latest = ckptr.latest_step()
    step = latest.step + 1 if latest else 0
    cp.handlers.registered_handlers()  # Load the plugins now, so kills land in the loop.
    print("ready", flush=True)
    previous: tuple[int, Any] | None = None
    while True:
        response = ckptr.save_checkpointables_async(
            step, items(step, with_pytree), metrics=metrics(step)
        )
        if previous is not None:
            assert previous[1].result()
            print(f"committed {previous[0]}", flush=True)
        previous = (step, response)
        if step % 4 == 3:
            # Replace the step before (kept by LatestN(3)) with identical content.
            ckptr.save_checkpointables(
                step - 1, items(step - 1, with_pytree), overwrite=True, metrics=metrics(step - 1)
            )
            print(f"committed {step}", flush=True)  # The overwrite waited for it.
            previous = None
        step += 1


if __name__ == "__main__":
    main()
