"""The trainer's end of a broadcast to rollout servers (`laden.rollout.servers.broadcast`): the group's ranks
per server, the buckets' contents and order, and the address the servers reach the trainer at. The broadcast
itself, received by a fake SGLang that joins the group, is in tests/rl/test_rl_servers_xccl.py."""

from __future__ import annotations

import torch

from laden.rollout.servers.broadcast import ServerChannel, buckets, trainer_address


def test_each_server_gets_its_workers_ranks_after_the_trainer():
    urls = ["http://10.0.0.5:8000", "http://10.0.0.5:8001", "http://10.0.0.6:8000"]
    channel = ServerChannel(urls, tp=2, bucket_mb=1, backend="gloo", master_addr="10.0.0.1")
    assert channel.meta.world_size == 7 and channel.rank_offsets == dict(zip(urls, [1, 3, 5]))
    bucket = channel.bucket([("a", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(4))])
    assert (bucket.names, bucket.dtypes, bucket.shapes) == (
        ("a", "b"),
        ("bfloat16", "float32"),
        ((2, 3), (4,)),
    )
    assert (bucket.master_address, bucket.rank_offset(urls[2]), bucket.backend) == ("10.0.0.1", 5, "gloo")
    other = ServerChannel(urls, tp=2, bucket_mb=1, backend="gloo", master_addr="10.0.0.1")
    assert other.meta.group_name != channel.meta.group_name  # a server may outlive a run: a new name each


def test_buckets_hold_whole_tensors_in_order_up_to_the_size():
    sizes = [10, 20, 5, 100, 1, 1]  # float32 elements
    pairs = [(f"t{i}", torch.zeros(n)) for i, n in enumerate(sizes)]
    got = [[name for name, _ in b] for b in buckets(pairs, bucket_bytes=30 * 4)]
    assert got == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]  # t3 alone: bigger than a bucket


def test_the_trainer_address_is_loopback_for_servers_on_loopback():
    assert trainer_address(["http://127.0.0.1:30000", "http://localhost:30001"]) == "127.0.0.1"


def test_the_trainer_address_toward_remote_servers_is_one_of_this_host(monkeypatch):
    import ipaddress
    import socket

    remote = ["http://192.0.2.7:30000"]  # TEST-NET-1 (RFC 5737): no packet is sent to it
    assert not ipaddress.ip_address(trainer_address(remote)).is_unspecified  # on the route toward it

    def no_route(self, address):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(socket.socket, "connect", no_route)
    assert trainer_address(remote) == socket.gethostbyname(socket.gethostname())  # without a route
