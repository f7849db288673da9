"""A minimal request/reply RPC over ZMQ ROUTER/DEALER sockets using the authenticated codec.

Why ROUTER/DEALER rather than REQ/REP: REQ sockets enter a broken state when a reply never
arrives, whereas a DEALER can be thrown away and recreated after a timeout, and a ROUTER server
survives clients that vanish mid-call.

Security model, outermost first: a CurveZMQ handshake with keys derived from the pair's secret
(`yatt.transport.curve`) admits only holders of the secret, so junk from anyone else is dropped by ZMQ
before a message is read, and each connection has its own session keys; a message is then refused
without parsing when it has more than ``max_frames`` frames or ``max_message_bytes`` bytes, and
unless its HMAC (under the same secret) matches; the envelope carries the client socket's random
session id and a counter that must increase, so a replayed or reordered request is refused and
counted even from an authenticated peer; only methods the handler lists in ``RPC_METHODS`` can be
called; and no message, however malformed, ends ``serve_forever``.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import zmq

from yatt.transport.codec import TransportError, decode, encode
from yatt.transport.curve import derive_keys, secure_client, secure_server, start_authenticator

log = logging.getLogger(__name__)

MAX_FRAMES = 4096
MAX_MESSAGE_BYTES = 1 << 30
MAX_SESSIONS = 4096  # client sockets remembered for replay checks (oldest forgotten first)


class RemoteError(Exception):
    """The remote handler raised; the message is ``"ExceptionType: text"`` from the server."""


class RpcServer:
    """Serve ``handler_object``'s allow-listed methods on a ROUTER socket (loopback unless told otherwise).

    The handler declares ``RPC_METHODS: set[str]``; anything else is refused. ``rpc_stats`` and
    ``shutdown`` are built in; ``shutdown`` also calls ``handler.shutdown()`` when the handler
    allows it, replies, and then ends ``serve_forever``.
    """

    def __init__(
        self,
        handler_object: Any,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        max_frames: int = MAX_FRAMES,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        advertise: str | None = None,
    ) -> None:
        """`host` is the address to bind (loopback, 0.0.0.0 or one interface's address); `advertise` the
        address other processes reach it at (default: `host`, which must then not be a wildcard)."""
        if host in ("0.0.0.0", "::", "*") and not advertise:
            raise ValueError(f"RpcServer bound to {host!r} needs the address to advertise")
        self.handler = handler_object
        self.allowed: frozenset[str] = frozenset(getattr(handler_object, "RPC_METHODS", ()))
        self._secret = secret
        self.max_frames, self.max_message_bytes = max_frames, max_message_bytes
        self._ctx = zmq.Context()
        keys = derive_keys(secret)
        self._auth, self._key_check = start_authenticator(self._ctx, keys)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        secure_server(self._sock, keys)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # per frame: ZMQ drops the peer beyond it
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        bind_host = f"[{host}]" if ":" in host else host
        if port == 0:
            port = self._sock.bind_to_random_port(f"tcp://{bind_host}")
        else:
            self._sock.bind(f"tcp://{bind_host}:{port}")
        shown = advertise or host
        self.endpoint = f"tcp://{f'[{shown}]' if ':' in shown else shown}:{port}"
        self.rejected = 0  # messages refused: too large, failed authentication, or malformed
        self.replayed = 0  # authentic messages refused as replayed or reordered (a counter that did not increase)
        self.refused_handshakes = 0  # connections ZMQ dropped at the CURVE handshake (no key, wrong key, junk)
        self.denied = 0  # authentic calls to methods outside the allow-list
        self.served = 0
        self._sessions: OrderedDict[str, tuple[bytes, int]] = OrderedDict()  # session -> (routing id, last seq)
        self._stop = threading.Event()
        self._closed = False

    def stop(self) -> None:
        """Ask ``serve_forever`` (possibly running in another thread) to return soon."""
        self._stop.set()

    def rpc_stats(self) -> dict[str, int]:
        return {
            "rejected": self.rejected,
            "replayed": self.replayed,
            "refused_handshakes": self.refused_handshakes,
            "denied": self.denied,
            "served": self.served,
        }

    def serve_forever(self, poll_ms: int = 100) -> None:
        """Handle requests until ``shutdown`` is called or ``stop()`` is set."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(poll_ms))
            if self._monitor in ready:
                self._monitor.recv_multipart()
                self.refused_handshakes += 1
            if self._sock not in ready:
                continue
            frames = self._sock.recv_multipart(copy=False)
            try:
                self._handle([f.buffer for f in frames])
            except Exception as e:  # whatever a message does, the server keeps serving
                log.exception("rpc: message handling failed")
                self._reject(f"{type(e).__name__}: {e}")

    def _handle(self, frames: list[memoryview]) -> None:
        if len(frames) < 2:
            self._reject("message without a routing id or body")
            return
        ident = frames[0].tobytes()
        try:
            req = decode(frames[1:], self._secret, self.max_frames, self.max_message_bytes)
        except TransportError as e:
            self._reject(f"{type(e).__name__}: {e}")
            return  # no reply: an unauthenticated peer learns nothing
        rid, method, kwargs = req.get("id"), req.get("method"), req.get("kwargs", {})
        session, seq = req.get("session"), req.get("seq")
        if (
            type(rid) is not int
            or not isinstance(method, str)
            or not isinstance(kwargs, dict)
            or not isinstance(session, str)
            or type(seq) is not int
        ):
            self._reject("request envelope must be {id: int, method: str, kwargs: dict, session: str, seq: int}")
            if type(rid) is int:
                self._reply(ident, {"id": rid, "ok": False, "error": "MalformedMessage: bad envelope"})
            return
        if not self._fresh(session, seq, ident):
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

    def _fresh(self, session: str, seq: int, ident: bytes) -> bool:
        """A session belongs to the connection that first used it, and its counter only increases (one
        connection's messages arrive in order), so a copy sent again, from any socket, is refused."""
        seen = self._sessions.get(session)
        if seen is not None and (seen[0] != ident or seq <= seen[1]):
            self.replayed += 1
            log.warning(
                "rpc: refused a replayed or reordered message (session %s, seq %d); %d so far",
                session[:8],
                seq,
                self.replayed,
            )
            return False
        self._sessions[session] = (ident, seq)
        self._sessions.move_to_end(session)
        if len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return True

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
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close()
            self._auth.stop()
            self._ctx.term()


class RpcClient:
    """Blocking client for one RpcServer. Not thread-safe: use one client per thread.

    ``liveness`` (optional) is called about once a second while waiting for a reply and may
    raise to abort the wait, e.g. when the server's process has died: a dead peer is then
    reported within a second instead of after the full timeout.
    """

    def __init__(
        self, endpoint: str, secret: bytes, timeout_s: float = 600.0, liveness: Callable[[], None] | None = None
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.liveness = liveness
        self._secret = secret
        self._keys = derive_keys(secret)
        self._ctx = zmq.Context()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self.sent_bytes = 0  # all frames of all requests: what a weight transport puts through the socket
        self._connect()

    def _connect(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        secure_client(self._sock, self._keys)
        self._sock.connect(self.endpoint)
        # A new session per socket: the server ties it to this connection and wants `seq` to increase.
        self._session, self._seq = os.urandom(16).hex(), itertools.count(1)

    def envelope(self, method: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": next(self._ids),
            "method": method,
            "kwargs": kwargs,
            "session": self._session,
            "seq": next(self._seq),
        }

    def call(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """Call ``method(**kwargs)`` remotely; raises RemoteError, TimeoutError or TransportError."""
        if self._sock is None:
            raise RuntimeError("RpcClient is closed")
        request = self.envelope(method, kwargs)
        rid = request["id"]
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        frames = encode(request, self._secret)
        self.sent_bytes += sum(memoryview(f).nbytes for f in frames)
        self._sock.send_multipart(frames, copy=False)
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
