"""A minimal request/reply RPC over ZMQ ROUTER/DEALER sockets using the authenticated codec.

Why ROUTER/DEALER rather than REQ/REP: REQ sockets enter a broken state when a reply never
arrives, whereas a DEALER can be thrown away and recreated after a timeout, and a ROUTER server
survives clients that vanish mid-call. Security model: the server binds to loopback only, every
message carries an HMAC under a per-pair secret, and only methods the handler lists in
``RPC_METHODS`` can be called, so a foreign local process can neither run code nor crash it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from yatt.transport.codec import TransportError, decode, encode

log = logging.getLogger(__name__)

BUILTIN_METHODS = frozenset({"rpc_stats", "shutdown"})


class RemoteError(Exception):
    """The remote handler raised; the message is ``"ExceptionType: text"`` from the server."""


class RpcServer:
    """Serve ``handler_object``'s allow-listed methods on a loopback ROUTER socket.

    The handler declares ``RPC_METHODS: set[str]``; anything else is refused. ``rpc_stats`` and
    ``shutdown`` are built in; ``shutdown`` also calls ``handler.shutdown()`` when the handler
    allows it, replies, and then ends ``serve_forever``.
    """

    def __init__(self, handler_object: Any, secret: bytes, host: str = "127.0.0.1", port: int = 0) -> None:
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"RpcServer binds to loopback only, got host={host!r}")
        self.handler = handler_object
        self.allowed: frozenset[str] = frozenset(getattr(handler_object, "RPC_METHODS", ()))
        self._secret = secret
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        if port == 0:
            port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        else:
            self._sock.bind(f"tcp://127.0.0.1:{port}")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.rejected = 0  # messages that failed authentication or were malformed
        self.denied = 0  # authentic calls to methods outside the allow-list
        self.served = 0
        self._stop = threading.Event()
        self._closed = False

    def stop(self) -> None:
        """Ask ``serve_forever`` (possibly running in another thread) to return soon."""
        self._stop.set()

    def rpc_stats(self) -> dict[str, int]:
        return {"rejected": self.rejected, "denied": self.denied, "served": self.served}

    def serve_forever(self, poll_ms: int = 100) -> None:
        """Handle requests until ``shutdown`` is called or ``stop()`` is set."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(poll_ms):
                continue
            frames = self._sock.recv_multipart(copy=False)
            self._handle([f.buffer for f in frames])

    def _handle(self, frames: list[memoryview]) -> None:
        if len(frames) < 2:
            self._reject("message without a routing id or body")
            return
        ident = frames[0].tobytes()
        try:
            req = decode(frames[1:], self._secret)
        except TransportError as e:
            self._reject(f"{type(e).__name__}: {e}")
            return  # no reply: an unauthenticated peer learns nothing
        rid, method, kwargs = req.get("id"), req.get("method"), req.get("kwargs", {})
        if type(rid) is not int or not isinstance(method, str) or not isinstance(kwargs, dict):
            self._reject("request envelope must be {id: int, method: str, kwargs: dict}")
            if type(rid) is int:
                self._reply(ident, {"id": rid, "ok": False, "error": "MalformedMessage: bad envelope"})
            return
        try:
            result = self._dispatch(method, kwargs)
            reply: dict[str, Any] = {"id": rid, "ok": True, "result": result}
        except Exception as e:  # the handler's failure is the caller's problem, not the server's
            if not isinstance(e, PermissionError):
                log.exception("rpc method %s failed", method)
            reply = {"id": rid, "ok": False, "error": f"{type(e).__name__}: {e}"}
        self.served += 1
        try:
            self._reply(ident, reply)
        except Exception as e:  # e.g. an unencodable result: still answer, never die
            log.exception("cannot encode reply of %s", method)
            self._reply(ident, {"id": rid, "ok": False, "error": f"{type(e).__name__}: {e}"})
        if method == "shutdown":
            self._stop.set()

    def _dispatch(self, method: str, kwargs: dict[str, Any]) -> Any:
        if method == "rpc_stats":
            return self.rpc_stats()
        if method == "shutdown":
            return self.handler.shutdown(**kwargs) if "shutdown" in self.allowed else None
        if method not in self.allowed or method.startswith("_"):
            self.denied += 1
            log.warning("rpc: refused method %r (not in RPC_METHODS)", method)
            raise PermissionError(f"method {method!r} is not allowed")
        return getattr(self.handler, method)(**kwargs)

    def _reject(self, why: str) -> None:
        self.rejected += 1
        log.warning("rpc: rejected message (%s); %d rejected so far", why, self.rejected)

    def _reply(self, ident: bytes, msg: dict[str, Any]) -> None:
        self._sock.send_multipart([ident, *encode(msg, self._secret)], copy=False)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()
            self._ctx.term()


class RpcClient:
    """Blocking client for one RpcServer. Not thread-safe: use one client per thread.

    ``liveness`` (optional) is called about once a second while waiting for a reply and may
    raise to abort the wait, e.g. when the server's process has died: a dead peer is then
    reported within a second instead of after the full timeout.
    """

    def __init__(
        self,
        endpoint: str,
        secret: bytes,
        timeout_s: float = 600.0,
        liveness: Callable[[], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.liveness = liveness
        self._secret = secret
        self._ctx = zmq.Context()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self._connect()

    def _connect(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.endpoint)

    def call(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """Call ``method(**kwargs)`` remotely; raises RemoteError, TimeoutError or TransportError."""
        if self._sock is None:
            raise RuntimeError("RpcClient is closed")
        rid = next(self._ids)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        self._sock.send_multipart(encode({"id": rid, "method": method, "kwargs": kwargs}, self._secret), copy=False)
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                # A reply may still arrive later; a fresh socket guarantees it is never read as
                # the answer to a later call.
                self._connect()
                raise TimeoutError(f"rpc {method!r} to {self.endpoint} got no reply within {timeout:.1f}s")
            if not self._sock.poll(min(remaining_ms, 1000), zmq.POLLIN):
                if self.liveness is not None:
                    try:
                        self.liveness()
                    except BaseException:
                        self._connect()
                        raise
                continue
            frames = self._sock.recv_multipart(copy=False)
            reply = decode([f.buffer for f in frames], self._secret)
            if reply.get("id") != rid:
                log.warning("rpc: dropping stale reply id=%r (waiting for %d)", reply.get("id"), rid)
                continue
            if reply.get("ok") is True:
                return reply.get("result")
            raise RemoteError(str(reply.get("error", "unknown remote error")))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
            self._ctx.term()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
