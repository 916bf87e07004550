"""Bind the listening socket before anything else starts, so that a busy port is one clear line.

uvicorn binds only once its server starts, after the CLI has printed where it serves and the
collector has created its store; binding first (and handing the socket to uvicorn) fails before any
of that.
"""

from __future__ import annotations

import socket

from tokentrace.errors import ConfigError


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (SO_REUSEADDR, as uvicorn sets it); ConfigError when the
    address is taken or cannot be bound."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"--port {port}: cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock
