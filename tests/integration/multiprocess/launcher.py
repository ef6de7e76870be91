"""Runs real multi-process JAX jobs on 127.0.0.1 for tests.

Each process runs ``python -c <preamble + body>`` with ``jax.distributed``
initialized against a coordinator on a free local port, gloo CPU collectives,
and ``devices_per_process`` CPU devices. Every process is bounded in time and
killed if it overruns.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence

import attrs

PREAMBLE = """
import faulthandler, os, signal, sys
# A process the test stops for overrunning prints every thread's stack first.
faulthandler.register(signal.SIGUSR1, all_threads=True)
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count={devices}"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
PROCESS_ID = int(os.environ["CPT_PROCESS_ID"])
NUM_PROCESSES = int(os.environ["CPT_NUM_PROCESSES"])
jax.distributed.initialize(
    coordinator_address=os.environ["CPT_COORDINATOR"],
    num_processes=NUM_PROCESSES,
    process_id=PROCESS_ID,
    initialization_timeout=60,
)
import checkpointables as cp
"""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@attrs.frozen
class ProcessResult:
    """What one process of a job did."""

    process_id: int
    returncode: int | None
    stdout: str
    stderr: str

    def check(self) -> ProcessResult:
        """Raises with the process's output unless it exited 0."""
        assert self.returncode == 0, (
            f"process {self.process_id} exited {self.returncode}\n"
            f"--- stdout\n{self.stdout}\n--- stderr\n{self.stderr[-8000:]}"
        )
        return self


def run_job(
    body: str,
    *,
    num_processes: int = 2,
    devices_per_process: int = 2,
    args: Sequence[str] = (),
    timeout: float = 180,
    on_started: Callable[[list[subprocess.Popen[str]]], None] | None = None,
) -> list[ProcessResult]:
    """Runs ``body`` in ``num_processes`` processes; returns their results in order.

    ``on_started`` is called with the running processes (e.g. to kill one).
    """
    code = PREAMBLE.format(devices=devices_per_process) + textwrap.dedent(body)
    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(num_processes):
        env = {
            **os.environ,
            "CPT_PROCESS_ID": str(i),
            "CPT_NUM_PROCESSES": str(num_processes),
            "CPT_COORDINATOR": coordinator,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code, *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    if on_started is not None:
        on_started(procs)
    deadline = time.monotonic() + timeout
    results = []
    for i, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            out, err = _stack_dump_then_kill(proc)
            err += f"\n[killed by the test after {timeout} s]"
        results.append(ProcessResult(i, proc.returncode, out, err))
    return results


def _stack_dump_then_kill(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Asks an overrunning process for its threads' stacks, then kills it."""
    proc.send_signal(signal.SIGUSR1)
    time.sleep(2.0)
    proc.kill()
    return proc.communicate()
