"""Process-to-process messaging: an authenticated, pickle-free codec and a small ZMQ RPC layer."""

from yatt.transport.codec import AuthenticationError, MalformedMessage, TransportError, decode, encode, new_secret
from yatt.transport.rpc import RemoteError, RpcClient, RpcServer

__all__ = [
    "AuthenticationError",
    "MalformedMessage",
    "RemoteError",
    "RpcClient",
    "RpcServer",
    "TransportError",
    "decode",
    "encode",
    "new_secret",
]
