"""A local S3-compatible server for tests and benchmarks, and a proxy to put in front of it.

``S3Server`` runs moto's S3 server (``ThreadedMotoServer``) on 127.0.0.1.
``S3Proxy`` forwards HTTP requests to it and can count them (method, bytes)
and inject faults: fail a fraction of requests with S3's ``503 SlowDown`` or
a dropped connection (before or after the server saw them), and delay a
fraction. Clients reach either through the standard AWS environment
variables (``aws_environment``). Both are bounded: they serve 127.0.0.1
only, on daemon threads, until stopped.
"""

from __future__ import annotations

import collections
import http.client
import http.server
import logging
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

import attrs

__all__ = ["S3Server", "S3Proxy", "Faults", "aws_environment"]


def aws_environment(endpoint: str) -> dict[str, str]:
    """The standard AWS variables that point boto3 and checkpointables at ``endpoint``."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


class S3Server:
    """moto's S3 server on a free port of 127.0.0.1."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # One log line per request.
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    def new_bucket(self, prefix: str = "test") -> str:
        """Creates a fresh bucket; returns its name."""
        import boto3

        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        client = boto3.client("s3", **_client_args(self.endpoint))
        client.create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every key in ``bucket`` under ``prefix``, sorted."""
        import boto3

        client = boto3.client("s3", **_client_args(self.endpoint))
        found = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            found += [o["Key"] for o in page.get("Contents", [])]
        return sorted(found)

    def stop(self) -> None:
        """Stops the server."""
        self._server.stop()


def _client_args(endpoint: str) -> dict[str, str]:
    env = aws_environment(endpoint)
    return {
        "endpoint_url": endpoint,
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_DEFAULT_REGION"],
    }


@attrs.define
class Faults:
    """Which requests the proxy disturbs (fractions of all requests, decided at random)."""

    fail_before: float = 0.0  # Answered 503 SlowDown; the server never sees the request.
    drop_before: float = 0.0  # Connection closed without an answer; the server never sees it.
    drop_after: float = 0.0  # The server handled it, but the answer is lost.
    delay: float = 0.0  # Delayed by up to ``max_delay_secs`` before being forwarded.
    max_delay_secs: float = 0.2
    seed: int = 0


@attrs.define
class Counts:
    """Requests seen by the proxy: how many per method, and the bytes of bodies."""

    requests: collections.Counter[str] = attrs.field(factory=collections.Counter)
    bytes_sent: collections.Counter[str] = attrs.field(factory=collections.Counter)
    bytes_received: collections.Counter[str] = attrs.field(factory=collections.Counter)
    faults: int = 0
    # Who signed the requests: ``"<access key id> <region>"`` from each request's SigV4
    # ``Authorization`` header, or ``"anonymous"``.
    signers: collections.Counter[str] = attrs.field(factory=collections.Counter)

    @property
    def total(self) -> int:
        """All requests."""
        return sum(self.requests.values())


class S3Proxy:
    """An HTTP proxy on 127.0.0.1 in front of ``target`` that counts and disturbs requests."""

    def __init__(self, target: str, faults: Faults | None = None) -> None:
        self.faults = faults or Faults()
        # Requests answered 503 whatever the faults: ``refuse(method, path)`` is true (it sees
        # every request, in order, and may keep state).
        self.refuse: Callable[[str, str], bool] = lambda method, path: False
        self.counts = Counts()
        self._lock = threading.Lock()
        self._random = random.Random(self.faults.seed)
        self._target = target.removeprefix("http://")
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        host, port = self._server.server_address[:2]
        self.endpoint = f"http://{host}:{port}"

    @contextmanager
    def counting(self) -> Iterator[Counts]:
        """Counts the requests of the ``with`` body (fresh counts)."""
        with self._lock:
            self.counts = Counts()
        yield self.counts

    def stop(self) -> None:
        """Stops serving."""
        self._server.shutdown()
        self._server.server_close()

    def _decide(self) -> str:
        with self._lock:
            roll = self._random.random()
            delay = self._random.random() < self.faults.delay
            wait = self._random.random() * self.faults.max_delay_secs
        f = self.faults
        if delay:
            time.sleep(wait)
        for action, share in (
            ("fail_before", f.fail_before),
            ("drop_before", f.drop_before),
            ("drop_after", f.drop_after),
        ):
            if roll < share:
                return action
            roll -= share
        return "forward"

    def _record(
        self, method: str, sent: int, received: int, fault: bool, signer: str = "anonymous"
    ) -> None:
        """Counts one request (a GET with ``list-type`` in its query is a ``LIST``)."""
        with self._lock:
            self.counts.signers[signer] += 1
            self.counts.requests[method] += 1
            self.counts.bytes_sent[method] += sent
            self.counts.bytes_received[method] += received
            self.counts.faults += int(fault)

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _forward(self) -> None:
                body = self._body()
                refused = proxy.refuse(self.command, self.path)
                action = "fail_before" if refused else proxy._decide()
                kind = "LIST" if "list-type=" in self.path else self.command
                signer = _signer(self.headers.get("Authorization", ""))
                if action == "drop_before":
                    proxy._record(kind, len(body), 0, True, signer)
                    self._drop()
                    return
                if action == "fail_before":
                    proxy._record(kind, len(body), 0, True, signer)
                    self._answer(503, _SLOW_DOWN, {"Content-Type": "application/xml"})
                    return
                connection = http.client.HTTPConnection(proxy._target, timeout=120)
                try:
                    headers = {
                        k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"
                    }
                    headers["Content-Length"] = str(len(body))
                    connection.request(self.command, self.path, body=body, headers=headers)
                    response = connection.getresponse()
                    data = response.read()
                    # A HEAD's Content-Length is the object's size: kept as is.
                    dropped = ("transfer-encoding", "connection")
                    if self.command != "HEAD":
                        dropped += ("content-length",)
                    kept = {k: v for k, v in response.getheaders() if k.lower() not in dropped}
                finally:
                    connection.close()
                proxy._record(kind, len(body), len(data), action == "drop_after", signer)
                if action == "drop_after":
                    self._drop()
                    return
                self._answer(response.status, data, kept, head=self.command == "HEAD")

            def _answer(
                self, status: int, data: bytes, headers: dict[str, str], head: bool = False
            ) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                if not any(k.lower() == "content-length" for k in headers):
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            def _drop(self) -> None:
                self.close_connection = True
                with suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Handler


def _signer(authorization: str) -> str:
    """``"<access key id> <region>"`` of a SigV4 ``Authorization`` header (``Credential=
    KEY/DATE/REGION/s3/aws4_request``), or ``"anonymous"`` without one."""
    _, found, rest = authorization.partition("Credential=")
    if not found:
        return "anonymous"
    key_id, _, date_region = rest.split(",")[0].partition("/")
    return f"{key_id} {date_region.split('/')[1]}"


_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
