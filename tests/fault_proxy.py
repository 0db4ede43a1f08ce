"""A fault-injecting HTTP proxy for the object-store tests: loopback only, threads, bounded.

It sits between a job and the local S3 server (:mod:`tests.s3_server`) and forwards each request on a fresh
upstream connection. A rule (``proxy.rules``, first match wins) can, for requests whose method and path match:
- ``drop``: forward the request, let the server act on it, then cut the client's connection without the answer
  (a lost response: the client cannot tell whether the write happened);
- ``delay``: hold the request for some seconds before forwarding it;
- ``refuse``: cut the connection without forwarding (connection reset).
:meth:`FaultProxy.partition` holds every request until :meth:`FaultProxy.heal` (a network partition; the
held requests land after it heals, as a stale writer's would). :attr:`FaultProxy.seen` records every request.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_BODY = 64 << 20
MAX_CONNECTIONS = 64


@dataclass
class Rule:
    method: str
    path: str
    """A regular expression searched in the request path (query included)."""
    action: str
    """``drop``, ``delay`` or ``refuse``."""
    times: int = 1
    """How many matching requests it applies to."""
    seconds: float = 0.0
    on_match: Callable[[], None] | None = None
    """Called when the rule fires, before the request is forwarded (e.g. to kill the job at that moment)."""
    after_forward: Callable[[], None] | None = None
    """Called after the server answered, before the answer would go back (``drop``)."""
    skip: int = 0
    """Matching requests let through untouched before the rule fires."""
    fired: int = 0
    skipped: int = 0

    def matches(self, method: str, path: str) -> bool:
        if self.fired >= self.times or method != self.method or re.search(self.path, path) is None:
            return False
        if self.skipped < self.skip:
            self.skipped += 1
            return False
        return True


@dataclass
class FaultProxy:
    upstream: tuple[str, int]
    rules: list[Rule] = field(default_factory=list)
    seen: list[tuple[str, str, str]] = field(default_factory=list)
    """(method, path, what happened) of every request."""

    def __post_init__(self) -> None:
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(MAX_CONNECTIONS)
        self.port = self._sock.getsockname()[1]
        self._open = threading.Event()
        self._open.set()  # cleared while partitioned
        self._closed = False
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def partition(self) -> None:
        self._open.clear()

    def heal(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._closed = True
        self._open.set()
        self._sock.close()

    # ----------------------------------------------------------------------------------------- serving
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if not self._slots.acquire(timeout=30):
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(120)
            f = conn.makefile("rb")
            while not self._closed:
                req = _read_message(f, request=True, conn=conn)
                if req is None:
                    return
                head, body = req
                method, path = head.split(b" ", 2)[:2]
                m, p = method.decode(), path.decode(errors="replace")
                rule = self._rule(m, p)
                if rule is not None and rule.on_match is not None:
                    rule.on_match()
                self._open.wait()
                if rule is not None and rule.action == "delay":
                    time.sleep(rule.seconds)
                if rule is not None and rule.action == "refuse":
                    self._note(m, p, "refused")
                    return
                answer = self._forward(head, body)
                if rule is not None and rule.after_forward is not None:
                    rule.after_forward()
                if rule is not None and rule.action == "drop":
                    self._note(m, p, "dropped")
                    return
                self._note(m, p, "ok")
                conn.sendall(answer)
                if b"connection: close" in answer.split(b"\r\n\r\n", 1)[0].lower():
                    return
        except OSError:
            return
        finally:
            conn.close()
            self._slots.release()

    def _rule(self, method: str, path: str) -> Rule | None:
        with self._lock:
            for r in self.rules:
                if r.matches(method, path):
                    r.fired += 1
                    return r
        return None

    def _note(self, method: str, path: str, what: str) -> None:
        with self._lock:
            self.seen.append((method, path, what))

    def _forward(self, head: bytes, body: bytes) -> bytes:
        lines = [
            ln for ln in head.split(b"\r\n") if not ln.lower().startswith((b"connection:", b"keep-alive:"))
        ]
        lines.append(b"Connection: close")
        with socket.create_connection(self.upstream, timeout=120) as up:
            up.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + body)
            f = up.makefile("rb")
            is_head = head.startswith(b"HEAD ")
            resp = _read_message(f, request=False, no_body=is_head)
        if resp is None:
            raise OSError("no answer upstream")
        rhead, rbody = resp
        if is_head:
            return rhead + b"\r\n\r\n"
        rlines = [ln for ln in rhead.split(b"\r\n") if not ln.lower().startswith((b"transfer-encoding:",
                                                                                    b"content-length:"))]  # fmt: skip
        rlines.append(b"Content-Length: " + str(len(rbody)).encode())
        return b"\r\n".join(rlines) + b"\r\n\r\n" + rbody


def _read_message(
    f, request: bool, no_body: bool = False, conn: socket.socket | None = None
) -> tuple[bytes, bytes] | None:
    """(head without the blank line, body) of one HTTP message from file `f`; None at EOF."""
    lines = []
    while True:
        line = f.readline(65536)
        if not line:
            return None
        if line in (b"\r\n", b"\n"):
            if lines:
                break
            continue
        lines.append(line.rstrip(b"\r\n"))
    head = b"\r\n".join(lines)
    if no_body:
        return head, b""
    headers = {}
    for ln in lines[1:]:
        k, _, v = ln.partition(b":")
        headers[k.strip().lower()] = v.strip()
    if request and headers.get(b"expect", b"").lower() == b"100-continue":
        if conn is not None:
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        lines = [ln for ln in lines if not ln.lower().startswith(b"expect:")]
        head = b"\r\n".join(lines)
    if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
        body = b""
        while True:
            size = int(f.readline(1024).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                f.readline(1024)
                break
            body += f.read(size)
            f.readline(1024)
            if len(body) > MAX_BODY:
                raise OSError("body too large")
        head = b"\r\n".join(ln for ln in lines if not ln.lower().startswith(b"transfer-encoding:"))
        head += b"\r\nContent-Length: " + str(len(body)).encode()
        return head, body
    if b"content-length" in headers:
        n = int(headers[b"content-length"])
        if n > MAX_BODY:
            raise OSError("body too large")
        return head, f.read(n)
    if request:
        return head, b""
    status = int(lines[0].split(b" ")[1])
    if status in (204, 304) or 100 <= status < 200:
        return head, b""
    return head, f.read(MAX_BODY)  # until the server closes (Connection: close)
