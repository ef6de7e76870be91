"""The ``checkpointables demo`` command: train, checkpoint, stop, resume, verify.

A small MLP learns a synthetic regression with plain ``jax.grad`` and a
hand-written Adam (no Flax or Optax). The training state is checkpointed
asynchronously every N steps with ``cp.training.Checkpointer``, together
with a JSON piece (progress counters) and the loss as a metric. The loop
runs twice: the first run stops halfway, as a preempted job would; the
second resumes from the latest checkpoint. Then the demo checks, bit for
bit, that the restored state equals the trained one and that the resumed
run equals one that was never interrupted.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

__all__ = ["main"]

_FEATURES, _HIDDEN, _BATCH = 4, 64, 128
_LEARNING_RATE, _BETA1, _BETA2, _EPS = 1e-2, 0.9, 0.999, 1e-8


def _model(jax: Any, jnp: Any) -> tuple[Callable[[Any], Any], Callable[[Any, Any], Any], Any]:
    """Returns ``(init_state, train_step, batch)`` for the demo's MLP regression."""

    def init_state(seed: int) -> dict[str, Any]:
        k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)

        def dense(key: Any, n_in: int, n_out: int) -> dict[str, Any]:
            scale = jnp.sqrt(2.0 / n_in)
            w = jax.random.normal(key, (n_in, n_out), jnp.float32) * scale
            return {"w": w, "b": jnp.zeros((n_out,), jnp.float32)}

        params = {
            "hidden1": dense(k1, _FEATURES, _HIDDEN),
            "hidden2": dense(k2, _HIDDEN, _HIDDEN),
            "out": dense(k3, _HIDDEN, 1),
        }
        zeros = jax.tree.map(jnp.zeros_like, params)
        return {"params": params, "adam": {"m": zeros, "v": zeros}, "t": jnp.zeros((), jnp.int32)}

    def batch(step: int) -> tuple[Any, Any]:
        # The data of a step depends only on the step, so a resumed run sees
        # exactly what an uninterrupted one would.
        key = jax.random.fold_in(jax.random.key(1234), step)
        x = jax.random.uniform(key, (_BATCH, _FEATURES), jnp.float32, -2.0, 2.0)
        y = jnp.sin(3.0 * x[:, :1]) + 0.5 * x[:, 1:2] ** 2 - 0.3 * x[:, 2:3] * x[:, 3:4]
        return x, y

    def loss_fn(params: Any, x: Any, y: Any) -> Any:
        h = jax.nn.gelu(x @ params["hidden1"]["w"] + params["hidden1"]["b"])
        h = jax.nn.gelu(h @ params["hidden2"]["w"] + params["hidden2"]["b"])
        prediction = h @ params["out"]["w"] + params["out"]["b"]
        return jnp.mean((prediction - y) ** 2)

    @jax.jit
    def train_step(state: Any, data: Any) -> tuple[Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], *data)
        t = state["t"] + 1
        m = jax.tree.map(lambda m, g: _BETA1 * m + (1 - _BETA1) * g, state["adam"]["m"], grads)
        v = jax.tree.map(lambda v, g: _BETA2 * v + (1 - _BETA2) * g * g, state["adam"]["v"], grads)
        correction1 = 1 - _BETA1 ** t.astype(jnp.float32)
        correction2 = 1 - _BETA2 ** t.astype(jnp.float32)
        params = jax.tree.map(
            lambda p, m, v: (
                p - _LEARNING_RATE * (m / correction1) / (jnp.sqrt(v / correction2) + _EPS)
            ),
            state["params"],
            m,
            v,
        )
        return {"params": params, "adam": {"m": m, "v": v}, "t": t}, loss

    return init_state, train_step, batch


def _identical(a: Any, b: Any) -> bool:
    """Whether two pytrees have the same structure, dtypes and bits."""
    import jax

    flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
    flat_b = jax.tree_util.tree_flatten_with_path(b)[0]
    if [path for path, _ in flat_a] != [path for path, _ in flat_b]:
        return False
    return all(_same_leaf(x, y) for (_, x), (_, y) in zip(flat_a, flat_b, strict=True))


def _same_leaf(x: Any, y: Any) -> bool:
    import numpy as np

    x, y = np.asarray(x), np.asarray(y)
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


class _Demo:
    """The demo's run: its directory, policies and model, and what the runs measured."""

    def __init__(self, root: str, steps: int) -> None:
        import jax
        import jax.numpy as jnp

        import checkpointables as cp

        self.cp, self.jax, self.root, self.steps = cp, jax, root, steps
        self.init_state, self.train_step, self.batch = _model(jax, jnp)
        self.every = max(1, steps // 10)
        self.policy = cp.training.save_decision_policies.EveryNStepsPolicy(self.every)
        preservation = cp.training.preservation_policies
        self.keep = preservation.AnyPreservationPolicy(
            [
                preservation.LatestN(2),
                preservation.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=1),
            ]
        )
        self.abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            self.init_state(0),
        )
        self.blocked_ms: list[float] = []

    def run(self, name: str, stop: int) -> Any:
        """Trains until ``stop``, from the latest checkpoint if there is one; returns the state."""
        with self.cp.training.Checkpointer(
            self.root, save_decision_policy=self.policy, preservation_policy=self.keep
        ) as ckptr:
            latest = ckptr.latest_step()
            if latest is None:
                state, first = self.init_state(0), 0
                print(f"{name}: no checkpoint in the directory, starting from scratch")
            else:
                wanted = {"state": self.abstract, "progress": None}
                loaded = ckptr.load_checkpointables(latest, wanted)
                state, first = loaded["state"], latest.step + 1
                seen = loaded["progress"]["examples_seen"]
                print(f"{name}: resuming after step {latest.step} ({seen:,} examples seen)")
            for step in range(first, stop):
                state = self._step(ckptr, step, state)
            print(f"{name}: stopped after step {stop - 1}\n")
            return state

    def _step(self, ckptr: Any, step: int, state: Any) -> Any:
        state, loss = self.train_step(state, self.batch(step))
        t0 = time.perf_counter()
        response = ckptr.save_checkpointables_async(
            step,
            {"state": state, "progress": {"examples_seen": (step + 1) * _BATCH}},
            metrics={"loss": loss},
            force=step == self.steps - 1,  # Always keep the final state.
        )
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        if not (response.done() and response.result() is False):  # Else the policy skipped it.
            self.blocked_ms.append(elapsed_ms)
            print(f"  step {step:4d}  loss {float(loss):.5f}  blocked {elapsed_ms:6.1f} ms")
        return state

    def check(self, final: Any) -> bool:
        """Prints what was kept and whether restoring and resuming were exact; returns that."""
        with self.cp.training.Checkpointer(self.root) as ckptr:
            kept = ckptr.steps()
            latest = ckptr.latest_step()
            assert latest is not None
            restored = ckptr.load_checkpointables(latest, {"state": self.abstract})["state"]
        uninterrupted = self.init_state(0)
        for step in range(self.steps):
            uninterrupted, _ = self.train_step(uninterrupted, self.batch(step))
        blocked = self.blocked_ms
        print(
            f"saves: {len(blocked)}; the training loop was blocked per save: "
            f"median {statistics.median(blocked):.1f} ms, max {max(blocked):.1f} ms "
            f"(the first includes loading the plugins; a save first waits for the previous "
            f"one, which a slow store may still be writing); the writing itself happened in "
            f"the background"
        )
        print("steps kept: " + ", ".join(f"{s.step} (loss {s.metrics['loss']:.5f})" for s in kept))
        ok_restore = _identical(restored, final)
        ok_resume = _identical(final, uninterrupted)
        print(
            f"restored step {latest.step} equals the trained state bit for bit: {_yes(ok_restore)}"
        )
        print(f"the resumed run equals an uninterrupted run bit for bit: {_yes(ok_resume)}")
        return ok_restore and ok_resume


def main(directory: str | None = None, *, steps: int = 300) -> int:
    """Trains a small model with checkpoints, resumes it, verifies; returns the exit status."""
    if steps < 4:  # Errors go to stderr, as argparse's do, so stdout holds only the run.
        print(
            "error: --steps must be at least 4 (the demo stops halfway and resumes).",
            file=sys.stderr,
        )
        return 2
    import checkpointables as cp

    started = time.perf_counter()
    root = directory or tempfile.mkdtemp(prefix="checkpointables-demo-")
    if cp.training.Checkpointer(root).steps():
        print(
            f"error: {root} already holds checkpoints; give the demo a new or empty directory.",
            file=sys.stderr,
        )
        return 2
    demo = _Demo(root, steps)
    print("checkpointables demo: an MLP regression trained with a hand-written Adam in JAX")
    print(f"  directory: {root}")
    print(f"  {steps} steps, saved asynchronously every {demo.every} steps (and at the end);")
    print("  kept: the latest 2 steps and the one with the lowest loss\n")
    demo.run("run 1", steps // 2)
    ok = demo.check(demo.run("run 2", steps))
    print(f"done in {time.perf_counter() - started:.1f} s")
    return 0 if ok else 1


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"
