"""The loopback-only rendezvous store of a one-node run, hosted by the launcher process.

torch's TCPStore server listens on `::` (every interface) whatever host it is given, and a
torchrun agent that hosts the c10d rendezvous opens two of them (the rendezvous store and, with
the agent store shared, a second one for the ranks). A TCPStore built on a socket we bound
ourselves (`master_listen_fd`) listens where that socket does, so for one node the launcher
binds 127.0.0.1, hosts the store there and hands its address to everyone:

* the torchrun agent joins it as a client (`--rdzv-conf is_host=false`);
* `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` stops the agent opening its second store;
* the ranks connect to it (`STORE_ENV`, read by `dflash.train.rank.parallel.init_process_group`) and
  keep their keys under a per-attempt prefix;
* gloo (and NCCL's bootstrap) bind the loopback interface (`GLOO_SOCKET_IFNAME`,
  `NCCL_SOCKET_IFNAME`).

The launcher never creates a CUDA context, so hosting the store there costs nothing on the GPUs.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import TCPStore

LOOPBACK_HOST = "127.0.0.1"
STORE_ENV = "DFLASH_RDZV_STORE"            # host:port of the launcher's store, for the ranks
STORE_TIMEOUT_S = 600.0


def loopback_interface() -> str:
    """The name of the interface that holds 127.0.0.1 ("lo" on Linux)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(address.address == LOOPBACK_HOST for address in addresses):
            return name
    return "lo"


def single_node_env(store_endpoint: str) -> dict[str, str]:
    """What torchrun and its ranks need to stay on loopback (docs/train.md, "Rendezvous: loopback only")."""
    interface = loopback_interface()
    return {STORE_ENV: store_endpoint, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface}


class LoopbackStore:
    """`with LoopbackStore() as endpoint:` a TCPStore server listening on 127.0.0.1:PORT only.

    The store gets its own duplicate of the bound socket's descriptor and closes it itself, so
    the Python socket is closed as soon as the store holds the listener (a store whose listening
    descriptor is closed under it aborts the process)."""

    def __init__(self, timeout_s: float = STORE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._store: TCPStore | None = None
        self.endpoint = ""

    def __enter__(self) -> str:
        from torch.distributed import TCPStore

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind((LOOPBACK_HOST, 0))
            listener.listen(128)
            port = listener.getsockname()[1]
            descriptor = os.dup(listener.fileno())
            try:
                self._store = TCPStore(LOOPBACK_HOST, port, is_master=True, master_listen_fd=descriptor,
                                       use_libuv=False, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=self.timeout_s))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(descriptor)
                raise
        self.endpoint = f"{LOOPBACK_HOST}:{port}"
        return self.endpoint

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._store = None                   # the last reference: the server stops, its socket closes
