"""Which transport a client uses for an engine: the configured one, or for ``auto`` the fastest that can work.

``auto`` is ``shm`` when the engine's address belongs to this host (a loopback address, or one this host can
bind: the only test that needs no list of interfaces) and ``zmq`` otherwise. A same-host engine that still
cannot map this process's segments (another container with its own /dev/shm, a /dev/shm too small) is found
by the client's probe before the first bucket (`yatt.engines.client.EngineClient`), which then falls back.
"""

from __future__ import annotations

import ipaddress
import socket

AUTO = "auto"


def endpoint_host(endpoint: str) -> str:
    """The host of ``tcp://host:port`` (``[v6]`` unbracketed)."""
    hostport = endpoint.split("://", 1)[-1]
    host = hostport.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_local_host(host: str) -> bool:
    """True when `host` is an address (or name) of this machine."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        addr = sockaddr[0]
        if ipaddress.ip_address(addr.split("%")[0]).is_loopback:
            return True
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.bind((addr, 0))  # succeeds only for an address of one of this host's interfaces
            return True
        except OSError:
            continue
    return False


def preferred(setting: str, endpoint: str) -> str:
    """The transport to try first for an engine at `endpoint`: `setting` itself, or for ``auto`` shm (same host)
    or zmq."""
    if setting != AUTO:
        return setting
    return "shm" if is_local_host(endpoint_host(endpoint)) else "zmq"
