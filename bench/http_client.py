"""A lean HTTP/1.1 keep-alive client for load generators: pre-encoded requests, one socket.

The benchmarks measure the server's path, so the client should cost as little as possible:
`http.client` spends ~0.4 ms of Python per request on this machine (header objects, email-style
parsing, buffered reads) and that lands inside every measured latency, as a C client such as wrk
would not. This one sends a request built once and parses only the status line, the
Content-Length (or chunked framing) and the headers the caller asks for.
"""

from __future__ import annotations

import socket
import threading


class HttpError(OSError):
    """The server closed the connection or sent something this client does not parse."""


def encode_request(
    method: str, host: str, path: str, headers: dict[str, str], body: bytes
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class Response:
    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body


class RawConnection:
    """One keep-alive connection; `exchange` sends a request and reads its whole response."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buffer = b""

    def close(self) -> None:
        self.sock.close()

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise HttpError("connection closed by the server")
        self._buffer += chunk

    def _take_until(self, marker: bytes) -> bytes:
        while (end := self._buffer.find(marker)) < 0:
            self._fill()
        data, self._buffer = self._buffer[:end], self._buffer[end + len(marker) :]
        return data

    def _take(self, size: int) -> bytes:
        while len(self._buffer) < size:
            self._fill()
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    def exchange(self, request: bytes) -> Response:
        self.sock.sendall(request)
        head = self._take_until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        try:
            status = int(head[0].split(" ", 2)[1])
        except (IndexError, ValueError) as exc:
            raise HttpError(f"bad status line {head[0]!r}") from exc
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            body = self._take(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while size := int(self._take_until(b"\r\n").split(b";")[0], 16):
                parts.append(self._take(size))
                self._take(2)
            self._take_until(b"\r\n")  # no trailers expected: the empty line after the last chunk
            body = b"".join(parts)
        else:
            raise HttpError("response without Content-Length or chunked framing")
        return Response(status, headers, body)


class ThreadConnections:
    """One keep-alive connection per client thread (like an SDK's pool), all closed together."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[RawConnection] = []

    def get(self, fresh: bool = False) -> RawConnection:
        """This thread's connection; `fresh` replaces it (the server closed an idle one)."""
        conn: RawConnection | None = getattr(self._local, "conn", None)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            conn = RawConnection(self.host, self.port, self.timeout_s)
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    def forget(self) -> None:
        """Drop this thread's connection after an error: the next get() connects afresh."""
        self._local.conn = None

    def close(self) -> None:
        with self._lock:
            for conn in self._connections:
                conn.close()
