"""Codec and RPC tests over real ZMQ sockets."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import torch
import zmq

from yatt.transport import (
    AuthenticationError,
    MalformedMessage,
    RemoteError,
    RpcClient,
    RpcServer,
    TransportError,
    codec,
    decode,
    encode,
    new_secret,
)
from yatt.transport.curve import derive_keys, secure_client

SECRET = new_secret()


def test_roundtrip_nested_tensors() -> None:
    msg = {
        "a": 1,
        "s": "text",
        "none": None,
        "f": 2.5,
        "nested": {"list": [torch.arange(6, dtype=torch.int64).reshape(2, 3), {"x": torch.tensor(3.5)}]},
        "tuple": (torch.randn(4, 5, dtype=torch.float32), torch.randn(3, dtype=torch.bfloat16)),
        "empty": torch.empty(0, 7),
        "bools": torch.tensor([True, False]),
        "strided": torch.arange(20.0).reshape(4, 5).t(),  # non-contiguous input
    }
    out = decode(encode(msg, SECRET), SECRET)
    assert out["a"] == 1 and out["s"] == "text" and out["none"] is None and out["f"] == 2.5
    assert torch.equal(out["nested"]["list"][0], msg["nested"]["list"][0])
    zero_dim = out["nested"]["list"][1]["x"]
    assert zero_dim.shape == () and zero_dim.item() == 3.5
    assert isinstance(out["tuple"], list)
    for got, want in zip(out["tuple"], msg["tuple"]):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert out["empty"].shape == (0, 7) and out["empty"].dtype == torch.float32
    assert torch.equal(out["bools"], msg["bools"])
    assert torch.equal(out["strided"], msg["strided"])
    out["tuple"][0].add_(1.0)  # decoded tensors own writable memory


def test_tampering_and_wrong_secret_are_rejected() -> None:
    frames = [bytes(f) for f in encode({"w": torch.ones(4), "k": "v"}, SECRET)]
    for i in range(3):  # mac, header, buffer
        bad = list(frames)
        bad[i] = bytes([bad[i][0] ^ 1]) + bad[i][1:]
        with pytest.raises(AuthenticationError):
            decode(bad, SECRET)
    with pytest.raises(AuthenticationError):
        decode(frames, new_secret())
    with pytest.raises(AuthenticationError):
        decode(frames[1:], SECRET)  # mac frame missing
    with pytest.raises(AuthenticationError):
        decode(frames[:2], SECRET)  # buffer dropped: the mac covers the frame count


@pytest.mark.parametrize("frames", [[], [b""], [b"garbage"], [b"x" * 32, b"\xc1\xc1"], [b"\x00" * 32, b"hdr", b"buf"]])
def test_garbage_raises_transport_error(frames: list[bytes]) -> None:
    with pytest.raises(TransportError):
        decode(frames, SECRET)


def _signed(header: bytes, *buffers: bytes) -> list[bytes]:
    """Frames with a valid MAC around an arbitrary header: exercises checks after authentication."""
    from yatt.transport.codec import _mac

    return [_mac(SECRET, [header, *buffers]), header, *buffers]


def test_authentic_but_malformed() -> None:
    import msgpack

    ph = lambda **kw: msgpack.packb({"t": {"__tensor__": 0, "dtype": "float32", "shape": [2], **kw}})  # noqa: E731
    cases = [
        _signed(b"\xc1"),  # invalid msgpack
        _signed(msgpack.packb([1, 2])),  # not a map
        _signed(ph(), b"\x00" * 7),  # byte length mismatch
        _signed(ph(dtype="complex32"), b"\x00" * 8),  # unknown dtype
        _signed(ph(__tensor__=5), b"\x00" * 8),  # index out of range
        _signed(ph(shape=[-2]), b"\x00" * 8),  # negative dimension
        _signed(ph(), b"\x00" * 8, b"extra"),  # unreferenced buffer
    ]
    for frames in cases:
        with pytest.raises(MalformedMessage):
            decode(frames, SECRET)


class Handler:
    RPC_METHODS = {"add", "echo", "sleepy", "boom"}

    def add(self, a: int, b: int) -> int:
        return a + b

    def echo(self, **kw: object) -> object:
        return kw

    def sleepy(self, s: float) -> float:
        time.sleep(s)
        return s

    def boom(self) -> None:
        raise ValueError("nope")

    def secret_method(self) -> str:
        return "should never run"


@pytest.fixture()
def server():
    srv = RpcServer(Handler(), SECRET)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.stop()
    thread.join(5)
    srv.close()


def test_rpc_calls_errors_and_allow_list(server: RpcServer) -> None:
    with RpcClient(server.endpoint, SECRET, timeout_s=10) as client:
        assert server.endpoint.startswith("tcp://127.0.0.1:")
        assert client.call("add", a=2, b=3) == 5
        t = torch.randn(3, 4, dtype=torch.bfloat16)
        assert torch.equal(client.call("echo", x=[t])["x"][0], t)
        with pytest.raises(RemoteError, match="ValueError: nope"):
            client.call("boom")
        with pytest.raises(RemoteError, match="PermissionError"):
            client.call("secret_method")
        with pytest.raises(RemoteError, match="PermissionError"):
            client.call("__init__")
        with pytest.raises(RemoteError, match="TypeError"):
            client.call("add", a=1)
        assert client.call("rpc_stats") == {
            "rejected": 0,
            "replayed": 0,
            "refused_handshakes": 0,
            "denied": 2,
            "served": 6,
        }


def _raw(ctx: zmq.Context, endpoint: str, secret: bytes | None) -> zmq.Socket:
    """A bare DEALER: without keys (secret None), or completing the CURVE handshake with `secret`'s keys."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        secure_client(sock, derive_keys(secret))
    sock.connect(endpoint)
    return sock


def _offer(sock: zmq.Socket, frames: list[bytes]) -> None:
    """Send without blocking: once the server refuses the handshake and drops the connection, a DEALER has no
    peer and a blocking send would wait forever (it did, once in CI); a message that cannot be queued is not
    delivered either."""
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        pass


def _wait_for(client: RpcClient, key: str, value: int) -> int:
    deadline = time.monotonic() + 5
    while (got := client.call("rpc_stats")[key]) < value and time.monotonic() < deadline:
        time.sleep(0.01)
    return got


def test_peers_without_the_keys_are_refused_at_the_handshake(server: RpcServer) -> None:
    ctx = zmq.Context()
    try:
        request = {"id": 1, "method": "add", "kwargs": {"a": 1, "b": 1}, "session": "s", "seq": 1}
        for secret in (None, new_secret()):  # no CURVE at all; CURVE with another run's keys
            raw = _raw(ctx, server.endpoint, secret)
            _offer(raw, encode(request, SECRET))  # even a correctly MAC'd message
            _offer(raw, [b""] * 10_000)
            assert raw.poll(300) == 0  # no reply to a peer without the keys
        with RpcClient(server.endpoint, SECRET, timeout_s=10) as client:
            assert _wait_for(client, "refused_handshakes", 2) >= 2
            stats = client.call("rpc_stats")
            assert stats["served"] == 1 and stats["rejected"] == 0  # nothing of theirs was ever read
            assert client.call("add", a=1, b=1) == 2
    finally:
        ctx.destroy(linger=0)


def test_authenticated_peers_with_bad_macs_and_garbage_are_rejected_and_server_survives(server: RpcServer) -> None:
    ctx = zmq.Context()
    raw = _raw(ctx, server.endpoint, SECRET)
    try:
        forged = encode({"id": 1, "method": "add", "kwargs": {"a": 1, "b": 1}, "session": "s", "seq": 1}, new_secret())
        raw.send_multipart(forged)
        assert raw.poll(500) == 0  # no reply to an unauthenticated message
        with RpcClient(server.endpoint, SECRET, timeout_s=10) as client:
            assert client.call("rpc_stats")["rejected"] == 1
            raw.send(b"garbage")
            raw.send_multipart([b"\x00" * 32, b"x", b"y"])
            assert _wait_for(client, "rejected", 3) == 3
            assert client.call("add", a=1, b=1) == 2
    finally:
        ctx.destroy(linger=0)


def test_too_many_frames_or_bytes_are_refused_before_the_mac() -> None:
    srv = RpcServer(Handler(), SECRET, max_frames=8, max_message_bytes=1 << 20)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    ctx = zmq.Context()
    raw = _raw(ctx, srv.endpoint, SECRET)
    try:
        with RpcClient(srv.endpoint, SECRET, timeout_s=10) as client:
            ok = client.envelope("echo", {"x": [torch.zeros(1)] * 7})  # 9 frames with MAC and header
            raw.send_multipart(encode(ok, SECRET))
            two = [torch.zeros(150_000), torch.zeros(150_000)]  # 1.2 MB in two frames
            raw.send_multipart(encode(client.envelope("echo", {"x": two}), SECRET))
            assert raw.poll(300) == 0  # refused without a reply
            assert _wait_for(client, "rejected", 2) == 2
            assert client.call("add", a=1, b=2) == 3
    finally:
        ctx.destroy(linger=0)
        srv.stop()
        thread.join(5)
        srv.close()


def test_replayed_or_reordered_requests_are_refused_and_counted(server: RpcServer) -> None:
    ctx = zmq.Context()
    first, second = _raw(ctx, server.endpoint, SECRET), _raw(ctx, server.endpoint, SECRET)
    try:
        with (
            RpcClient(server.endpoint, SECRET, timeout_s=10) as client,
            RpcClient(server.endpoint, SECRET, timeout_s=10) as victim,
        ):
            # the victim's messages, as an eavesdropper inside the run's trust boundary would capture them
            captured = encode(victim.envelope("add", {"a": 20, "b": 22}), SECRET)
            later = encode(victim.envelope("add", {"a": 1, "b": 1}), SECRET)
            first.send_multipart(captured)
            assert first.poll(5000) and decode(first.recv_multipart(), SECRET)["result"] == 42
            first.send_multipart(captured)  # the same bytes again, same connection
            second.send_multipart(captured)  # ... and from another socket
            assert first.poll(300) == 0 and second.poll(300) == 0
            assert _wait_for(client, "replayed", 2) == 2
            first.send_multipart(later)  # a newer message still goes through
            assert first.poll(5000) and decode(first.recv_multipart(), SECRET)["result"] == 2
            stale = encode(
                {**victim.envelope("add", {"a": 0, "b": 0}), "session": captured_session(captured), "seq": 1}, SECRET
            )
            first.send_multipart(stale)  # reordered: a counter below the last one seen
            assert first.poll(300) == 0
            assert _wait_for(client, "replayed", 3) == 3
            assert client.call("rpc_stats")["rejected"] == 0
    finally:
        ctx.destroy(linger=0)


def captured_session(frames: list) -> str:
    return decode(frames, SECRET)["session"]


def _forge(header: object, buffers: list[bytes] = ()) -> list[bytes]:
    """An authentic (correctly MAC'd) message with any header at all: what a buggy or hostile rank could send."""
    payload = [msgpack.packb(header, use_bin_type=True), *buffers]
    return [codec._mac(SECRET, payload), *payload]


def test_malformed_authentic_messages_are_rejected_counted_and_never_fatal(server: RpcServer) -> None:
    deep: object = 1
    for _ in range(600):
        deep = [deep]
    envelope = {"id": 7, "method": "echo", "session": "m", "seq": 1}
    bad = [
        {**envelope, "kwargs": {"x": deep}},
        {**envelope, "kwargs": {"x": {"__tensor__": 0, "dtype": "float32", "shape": [2**64 - 1, 0]}}},
        {**envelope, "kwargs": {"x": {"__tensor__": 0, "dtype": "complex64", "shape": [1]}}},
        {**envelope, "kwargs": {"x": {"__tensor__": 0, "dtype": "float32", "shape": [1] * 40}}},
        {**envelope, "kwargs": {"x": {"__tensor__": 0, "dtype": "float32", "shape": [-1]}}},
    ]
    ctx = zmq.Context()
    raw = _raw(ctx, server.endpoint, SECRET)
    try:
        for i, header in enumerate(bad):
            raw.send_multipart(_forge({**header, "session": f"m{i}"}, [b"\0" * 4]))
        with RpcClient(server.endpoint, SECRET, timeout_s=10) as client:
            assert _wait_for(client, "rejected", len(bad)) == len(bad)
            assert client.call("add", a=1, b=1) == 2
    finally:
        ctx.destroy(linger=0)


def test_timeout_recreates_socket_and_ignores_late_reply(server: RpcServer) -> None:
    with RpcClient(server.endpoint, SECRET, timeout_s=10) as client:
        with pytest.raises(TimeoutError):
            client.call("sleepy", timeout_s=0.2, s=0.6)
        # The late reply of `sleepy` goes to the dropped socket; this call must get its own answer.
        assert client.call("add", a=40, b=2) == 42
        assert client.call("sleepy", s=0.0) == 0.0


def test_shutdown_ends_serve_forever() -> None:
    srv = RpcServer(Handler(), SECRET)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    with RpcClient(srv.endpoint, SECRET, timeout_s=10) as client:
        assert client.call("shutdown") is None
    thread.join(5)
    assert not thread.is_alive()
    srv.close()


def test_a_wildcard_bind_needs_an_address_to_advertise() -> None:
    with pytest.raises(ValueError, match="advertise"):
        RpcServer(Handler(), SECRET, host="0.0.0.0")
