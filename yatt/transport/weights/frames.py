"""``zmq``: the tensors ride inside the RPC message (`yatt.transport.codec` frames), encrypted like every message.

The default across hosts, and the reference the other transports are checked against. Each bucket costs a
cast copy here, the socket (with CurveZMQ encryption: ~0.2 GB/s measured, benchmarks/results/wire.md) and a
copy out of the received frames on the engine side.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from yatt.tensors import NamedTensors
from yatt.transport.weights.base import Cast


class FrameWeights:
    name = "zmq"

    def begin(self, buckets: list[NamedTensors]) -> None:
        pass

    def pack(self, bucket: NamedTensors, cast: Cast) -> dict[str, Any]:
        return {"named_tensors": [(n, t.detach().to("cpu", dtype=cast(t)).contiguous()) for n, t in bucket]}

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass

    @staticmethod
    @contextmanager
    def unpack(payload: dict[str, Any]) -> Iterator[NamedTensors]:
        items = payload.get("named_tensors")
        if set(payload) != {"named_tensors"} or not isinstance(items, list):
            raise TypeError("a zmq weight update carries named_tensors only")
        pairs: NamedTensors = []
        for item in items:
            if len(item) != 2 or not isinstance(item[0], str) or not isinstance(item[1], torch.Tensor):
                raise TypeError("named_tensors must be a list of [name, tensor] pairs")
            pairs.append((item[0], item[1]))
        yield pairs
