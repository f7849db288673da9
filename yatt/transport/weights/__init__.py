"""How the tensors of a weight update travel from a trainer's engine client to an engine process.

Read `base.py` first (the interface, and how CUDA IPC and an NCCL group would plug in), then one transport:

- ``zmq`` (`frames.py`): the tensors' bytes ride in the RPC message itself (encrypted and authenticated like
  every message). Works between any two hosts; costs a copy through the socket and the encryption.
- ``shm`` (`shm.py`): the client writes each bucket into a POSIX shared-memory segment (a file under /dev/shm,
  owner-only) and the RPC message carries only a descriptor (segment name, per tensor name/dtype/shape/offset);
  the engine maps the segment and copies from it; both keep the segment mapped between syncs. One host only.

`WEIGHT_TRANSPORTS` names them (`rollout.engine.weight_transport`, where ``auto`` picks ``shm`` for an engine
whose address is on this host and ``zmq`` otherwise: `choose.py`). A transport is one file plus one line here.
"""

from yatt.registry import Registry

WEIGHT_TRANSPORTS: Registry = Registry(
    "rollout.engine.weight_transport",
    {"zmq": "yatt.transport.weights.frames:FrameWeights", "shm": "yatt.transport.weights.shm:ShmWeights"},
)
