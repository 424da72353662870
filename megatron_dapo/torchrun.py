"""`python -m megatron_dapo.torchrun [torchrun arguments]`: torchrun whose TCP stores listen on one address.

torch's TCPStore server listens on every interface, whatever host name it is given, so the two stores
torchrun's agent hosts (the c10d rendezvous store, and the store it shares with its workers) accept
connections from the whole network, and anyone who reaches them can read and write the rendezvous keys
unauthenticated. Here every store the launcher hosts gets a socket already bound to the address its host
name resolves to (torch's `master_listen_fd`): with `--standalone --local-addr=127.0.0.1` (what
launch/torchrun.sh runs) both are on loopback; across nodes the rendezvous store binds the endpoint's
address and the shared store the node's own (`--local-addr`, else its host name), the interface the
cluster uses. Everything else is torchrun's (`torch.distributed.run`): same arguments, same behaviour.
"""

from __future__ import annotations

import torch.distributed as dist

from megatron_dapo.parallel import listen_on

_TCP_STORE = dist.TCPStore
_ARGS = ("host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant",
         "master_listen_fd", "use_libuv")


class BoundTCPStore(_TCP_STORE):
    """torch.distributed.TCPStore; a server (is_master) listens only on its host name's address."""

    def __init__(self, *args, **kwargs):
        bound = {**dict(zip(_ARGS, args)), **kwargs}
        if bound.get("is_master") and bound.get("master_listen_fd") is None:
            sock = listen_on(bound["host_name"], int(bound.get("port") or 0))
            bound["port"] = sock.getsockname()[1]
            bound["master_listen_fd"] = sock.detach()  # the store owns the descriptor from here
        super().__init__(**bound)


def main() -> None:
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
    from torch.distributed.run import main as torchrun

    dist.TCPStore = BoundTCPStore  # the shared store (dynamic_rendezvous) and create_c10d_store look it up here
    c10d_rendezvous_backend.TCPStore = BoundTCPStore  # the rendezvous store imported the name
    torchrun()


if __name__ == "__main__":
    main()
