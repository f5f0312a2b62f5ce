"""The launcher's loopback rendezvous store: where it listens, that it serves, that it closes."""
from __future__ import annotations

import datetime
import socket

import pytest

from dflash.train.supervisor.rendezvous import LoopbackStore


def listening(port: int) -> set[str]:
    import psutil

    return {c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_store_listens_on_loopback_only_serves_clients_and_closes():
    from torch.distributed import TCPStore

    with LoopbackStore(timeout_s=10) as endpoint:
        host, port = endpoint.rsplit(":", 1)
        assert host == "127.0.0.1" and listening(int(port)) == {"127.0.0.1"}      # not 0.0.0.0, not ::
        client = TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=10))
        client.set("key", "value")
        assert TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=10)).get("key") == b"value"
        del client
    assert listening(int(port)) == set()
    with pytest.raises(ConnectionRefusedError), socket.create_connection((host, int(port)), timeout=5):
        pass
