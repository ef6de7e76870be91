"""Moving copies between hosts: a read-only HTTP file service per process, and its client.

Why HTTP from the standard library: it needs no new dependency, every
request is independent (a peer that died only fails the requests sent to it,
each bounded by a socket timeout), a copy moves file by file so only the
files a host needs are sent and memory stays bounded (1 MiB pieces), and it
runs on 127.0.0.1 in tests. Each process serves its tier's directory; its
address is published in the ``jax.distributed`` key-value store.

Only regular files under the directory are served (no listing, no ``..``, no
symbolic link leading out of it);
what is fetched is checked against the manifest's checksums before it is kept.
"""

from __future__ import annotations

import http.server
import os
import shutil
import stat
import threading
import urllib.error
import urllib.parse
import urllib.request

import attrs

from checkpointables.training.local_tier import _manifest
from checkpointables.training.local_tier._manifest import Manifest
from checkpointables.training.local_tier._store import Store

__all__ = ["FileServer", "fetch_copy", "FetchError"]

_CHUNK = 1 << 20
# How often the service looks for its shutdown: closing waits up to this long
# (the standard library's 0.5 s made every Checkpointer's close that slow).
_POLL_SECS = 0.05


class FetchError(OSError):
    """A copy could not be fetched from a peer (it did not answer, or sent damaged files)."""


class _Handler(http.server.BaseHTTPRequestHandler):
    directory = ""

    def do_GET(self) -> None:
        relative = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
        parts = relative.split("/")
        real = _real_path_inside(self.directory, os.path.join(self.directory, *parts))
        if any(p in ("", ".", "..") for p in parts) or real is None:
            self.send_error(404)
            return
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            self.send_error(404)
            return
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # A directory, a pipe: never read.
            os.close(fd)
            self.send_error(404)
            return
        f = os.fdopen(fd, "rb")
        with f:
            self.send_response(200)
            self.send_header("Content-Length", str(os.fstat(f.fileno()).st_size))
            self.end_headers()
            shutil.copyfileobj(f, self.wfile, _CHUNK)

    def log_message(self, format: str, *args: object) -> None:
        pass  # Quiet: a training job's logs are not the place for every request.


def _real_path_inside(directory: str, path: str) -> str | None:
    """``path`` with its symbolic links resolved, if that lies under ``directory`` (else
    ``None``): a link in the tier's directory must not serve what lies outside it."""
    real = os.path.realpath(path)
    return real if real.startswith(os.path.realpath(directory) + os.sep) else None


class FileServer:
    """Serves ``directory`` read-only over HTTP on ``host`` (any free port) from a daemon thread."""

    def __init__(self, directory: str, host: str) -> None:
        handler = type("Handler", (_Handler,), {"directory": directory})
        self._server = http.server.ThreadingHTTPServer((host, 0), handler)
        self._server.daemon_threads = True
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            args=(_POLL_SECS,),
            name="checkpointables local tier",
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        """Stops serving."""
        self._server.shutdown()
        self._server.server_close()


def _fetch_file(url: str, target: str, timeout: float, algorithm: str) -> tuple[int, int]:
    """Streams ``url`` into ``target``; returns its size and checksum, computed on the way."""
    update = _manifest.updater(algorithm)
    size, crc = 0, 0
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with urllib.request.urlopen(url, timeout=timeout) as response, open(target, "wb") as f:
        while piece := response.read(_CHUNK):
            f.write(piece)
            size, crc = size + len(piece), update(piece, crc)
    return size, crc


def fetch_copy(address: str, manifest: Manifest, store: Store, timeout: float) -> int:
    """Fetches the copy ``manifest`` describes from the peer at ``address`` into ``store``;
    returns the bytes received. The copy is kept only if every file matches its checksum.

    Raises:
      FetchError: the peer did not answer within ``timeout`` or sent something else.
    """
    # A Manifest holds only a writer named p<i>-of-<n> and file names inside the copy
    # (``_manifest``): nothing below is created or removed outside this copy's directory.
    step, writer = manifest.step, manifest.writer
    final = store.copy_dir(step, writer)
    staging = f"{final}.fetching-{os.getpid()}-{threading.get_ident()}"
    received = 0
    try:
        for relative, expected in manifest.files.items():
            quoted = f"{urllib.parse.quote(writer)}/{urllib.parse.quote(relative)}"
            target = os.path.join(staging, *relative.split("/"))
            got = _fetch_file(
                f"http://{address}/{step}/{quoted}", target, timeout, manifest.algorithm
            )
            if got != tuple(expected):  # Checked as it streamed: no second read.
                raise FetchError(
                    f"the copy of {relative} sent by {address} is damaged: (size, "
                    f"{manifest.algorithm}) {got}, expected {tuple(expected)}"
                )
            received += got[0]
        store.forget_copy(step, writer)
        os.rename(staging, final)
        # A peer of this job sent it: this run's copy, named as this host names its run.
        store.commit_copy(attrs.evolve(manifest, run=store.run))
        return received
    except (OSError, ValueError) as e:  # URLError is an OSError; ValueError: no such checksum.
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, FetchError):
            raise
        raise FetchError(f"fetching step {step} copy {writer} from {address}: {e}") from e
