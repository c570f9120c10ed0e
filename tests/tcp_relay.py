"""A TCP relay for tests: `python -m tests.tcp_relay HOST PORT TARGET_HOST TARGET_PORT`.

PostgreSQL listens on 127.0.0.1 only, which a network namespace's processes cannot reach; the
partition test runs this on the namespaces' bridge address, so they reach the database through
it (tests/test_partition.py). One thread pair per connection: a test opens a handful.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading


def pipe(source: socket.socket, sink: socket.socket) -> None:
    """Copy `source` to `sink` until either end closes, then close both."""
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    for end in (source, sink):
        with contextlib.suppress(OSError):
            end.shutdown(socket.SHUT_RDWR)
        end.close()


def relay(client: socket.socket, target: tuple[str, int]) -> None:
    try:
        upstream = socket.create_connection(target, timeout=10)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
    threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()


def serve(listen: tuple[str, int], target: tuple[str, int]) -> None:
    with socket.create_server(listen, reuse_port=False) as server:
        while True:
            client, _ = server.accept()
            relay(client, target)


if __name__ == "__main__":
    host, port, target_host, target_port = sys.argv[1:5]
    serve((host, int(port)), (target_host, int(target_port)))
