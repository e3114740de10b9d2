"""Model streaming: a trainer publishes weights; consumers are notified and hot-swap them between requests.

    # trainer
    from tierstore import stream
    stream.publish("policy", model, step=step)               # or sync=False: returns once snapshotted

    # inference server, any process of the node
    hot = stream.HotModel(model, "policy")
    with hot.serving() as m:                                  # one version for the whole request
        out = m(batch)

A version's tensors are placed once in shared memory held by the node's agent (`tierstore agent`), one
file per distinct tensor content named by its blake3; a publish writes only the tensors that differ from
the version before (compared byte for byte, then hashed; told which may have changed, `changed=`, it
compares the others at their first 64 KiB only). The agent numbers the version and pushes a notice
to every subscriber over its Unix socket: no polling. A consumer's `HotModel` keeps two copies of the model,
loads a new version into the one no request uses (only the tensors whose hash differs from what that copy
holds), and swaps between requests: no request waits for an update and none sees two versions. A version
is never visible before every tensor of it is placed: a publisher killed mid-publish leaves nothing.

`HotModel(model, name, mode="in-place")` keeps one copy and pauses requests for the length of each update
(reported). `DistributedPublisher` with `HotModel(..., group=, src=)` moves the changed tensors inside a
torch.distributed process group (NCCL GPU to GPU, gloo on CPUs), the agent still announcing every version.

Every notice leases its version to the subscriber's connection; the agent keeps the last `--stream-keep`
versions (2) and any leased one, and a consumer that dies releases its leases with its connection.
"""

from __future__ import annotations

from tierstore.stream.connection import DEFAULT_DEADLINE, StreamError
from tierstore.stream.hot import HotModel
from tierstore.stream.publisher import DistributedPublisher, Publisher, publish
from tierstore.stream.subscriber import Subscriber, streams
from tierstore.stream.version import StreamTensor, StreamVersion

__all__ = [
    "DEFAULT_DEADLINE",
    "DistributedPublisher",
    "HotModel",
    "Publisher",
    "StreamError",
    "StreamTensor",
    "StreamVersion",
    "Subscriber",
    "publish",
    "streams",
]
