"""Redis past one node, as real processes on loopback: a Cluster of 3 masters, with or
without replicas (built with `redis-cli --cluster create`), and a master + replica watched
by 3 sentinels."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
from redis.cluster import ClusterNode, RedisCluster

from tests.redis_server import _free_loopback_port, start_redis_server, stop_redis_server


def _port_with_bus() -> int:
    """A free port whose cluster bus port (+10000) is a valid port too."""
    while True:
        port = _free_loopback_port()
        if port < 55000:
            return port


def _wait(check: object, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except (redis.RedisError, redis.exceptions.RedisClusterException):
            pass  # not there yet (a cluster client's discovery raises the latter)
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not happen within {timeout_s} s")


def _in_sync(primary: redis.Redis) -> int:
    """How many replicas of `primary` finished their initial sync (state online)."""
    info = primary.info("replication")
    return sum(1 for i in range(info["connected_slaves"]) if info[f"slave{i}"]["state"] == "online")


def _agreed(ports: list[int]) -> bool:
    """Every node answers, says cluster_state:ok, knows all the others and serves the same
    slot map: checked here rather than assumed from `--cluster create` having returned."""
    maps = []
    for port in ports:
        client = redis.Redis(port=port, socket_connect_timeout=1, socket_timeout=1)
        try:
            info = client.cluster("info")
            if info["cluster_state"] != "ok" or int(info["cluster_known_nodes"]) != len(ports):
                return False
            maps.append(sorted(str(entry) for entry in client.cluster("slots")))
        finally:
            client.close()
    return all(m == maps[0] for m in maps)


def _answering(ports: list[int]) -> bool:
    """A cluster client, discovering the nodes as the store does, reaches every one of them
    (the first store test once timed out connecting to a node that had just started)."""
    client = RedisCluster(  # its discovery connects to every node it is told of
        startup_nodes=[ClusterNode("127.0.0.1", p) for p in ports],
        socket_connect_timeout=1,
        socket_timeout=1,
    )
    try:
        return client.ping(target_nodes=RedisCluster.ALL_NODES) is True  # one answer for all
    finally:
        client.close()


class Cluster:
    """The nodes of a running Redis Cluster: `processes` by port, and how each was started."""

    def __init__(self) -> None:
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self._started: dict[int, tuple[Path, list[str]]] = {}

    def start(self, port: int, node_dir: Path, args: list[str]) -> None:
        self.processes[port], _ = start_redis_server(node_dir, port=port, args=args)
        self._started[port] = (node_dir, args)

    def restart(self, port: int) -> None:
        """Start a killed node again from its nodes.conf: it rejoins as a replica of the
        node that took its slots."""
        self.start(port, *self._started[port])

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.processes)

    def primary_of(self, key: str) -> int:
        """The port of the primary serving `key`'s slot now."""
        return self.serving(key)[0]

    def serving(self, key: str) -> list[int]:
        """The ports serving `key`'s slot now: its primary, then the replicas in sync with it
        (asked of the primary: other nodes learn of replicas by gossip, later)."""
        port = next(p for p, proc in self.processes.items() if proc.poll() is None)
        client = redis.Redis(port=port)
        try:
            slot = client.cluster("keyslot", key)
            primary = next(
                int(node[1]) for start, end, node, *_ in client.cluster("slots")
                if start <= slot <= end
            )  # fmt: skip
        finally:
            client.close()
        client = redis.Redis(port=primary)
        try:
            info = client.info("replication")
        finally:
            client.close()
        replicas = (info[f"slave{i}"] for i in range(info["connected_slaves"]))
        return [primary, *(int(r["port"]) for r in replicas if r["state"] == "online")]

    def kill(self, port: int) -> None:
        self.processes[port].kill()
        self.processes[port].wait()


@contextmanager
def cluster(workdir: Path, masters: int = 3, replicas: int = 0) -> Iterator[Cluster]:
    """A Redis Cluster of `masters` masters with `replicas` replicas each. With replicas,
    nodes judge a peer failed after 2 s (`cluster-node-timeout`; Redis' default is 15 s), so
    that a replica takes over a killed primary's slots within seconds."""
    nodes = Cluster()
    timeout = ["--cluster-node-timeout", "2000"] if replicas else []
    try:
        for i in range(masters * (1 + replicas)):
            node_dir = workdir / f"node{i}"
            node_dir.mkdir(parents=True)
            nodes.start(
                _port_with_bus(),
                node_dir,
                ["--save", "", "--appendonly", "no", "--cluster-enabled", "yes",
                 "--cluster-config-file", str(node_dir / "nodes.conf"), *timeout],
            )  # fmt: skip
        subprocess.run(
            [shutil.which("redis-cli") or "redis-cli", "--cluster", "create",
             *(f"127.0.0.1:{p}" for p in nodes.processes), "--cluster-replicas", str(replicas),
             "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        _wait(lambda: _agreed(list(nodes.processes)), "every node ok, knowing every node")
        _wait(lambda: _answering(list(nodes.processes)), "a cluster client reaching every node")
        for port in nodes.processes:
            client = redis.Redis(port=port)
            if replicas and client.info("replication")["role"] == "master":
                _wait(lambda c=client: _in_sync(c) >= replicas, "replicas in sync")
            client.close()
        yield nodes
    finally:
        for proc in nodes.processes.values():
            if proc.poll() is None:
                stop_redis_server(proc)


@contextmanager
def redis_cluster(workdir: Path, masters: int = 3, replicas: int = 0) -> Iterator[str]:
    """A Redis Cluster (see `cluster`); yields its redis+cluster:// URL."""
    with cluster(workdir, masters, replicas) as nodes:
        yield nodes.url


class SentinelSet:
    """A master, `replicas` replicas and three sentinels (quorum 2, down after 1 s)."""

    NAME = "tkmaster"

    def __init__(self, workdir: Path, replicas: int = 1) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []
        master_dir = workdir / "master"
        master_dir.mkdir()
        self.master, master_url = start_redis_server(master_dir)
        self.master_port = int(master_url.rsplit(":", 1)[1].split("/")[0])
        for i in range(replicas):
            replica_dir = workdir / f"replica{i}"
            replica_dir.mkdir()
            replica, _ = start_redis_server(
                replica_dir,
                args=["--save", "", "--appendonly", "no",
                      "--replicaof", "127.0.0.1", str(self.master_port)],
            )  # fmt: skip
            self.procs.append(replica)
        self.sentinel_ports = []
        for i in range(3):
            port = _free_loopback_port()
            config = workdir / f"sentinel{i}.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {workdir}\n"
                f"sentinel monitor {self.NAME} 127.0.0.1 {self.master_port} 2\n"
                f"sentinel down-after-milliseconds {self.NAME} 1000\n"
                f"sentinel failover-timeout {self.NAME} 5000\n"
            )
            binary = shutil.which("redis-server") or "redis-server"
            proc = subprocess.Popen(
                [binary, str(config), "--sentinel"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self.procs.append(proc)
            self.sentinel_ports.append(port)
        master = redis.Redis(port=self.master_port)
        _wait(lambda: master.info("replication")["connected_slaves"] >= replicas, "replication")
        master.close()
        for port in self.sentinel_ports:
            sentinel = redis.Redis(port=port)
            _wait(
                lambda s=sentinel: s.sentinel_master(self.NAME)["num-other-sentinels"] >= 2,
                "sentinels seeing each other",
            )
            sentinel.close()

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.NAME}"

    def kill_master(self) -> None:
        self.master.kill()
        self.master.wait()

    def promoted(self) -> bool:
        sentinel = redis.Redis(port=self.sentinel_ports[0])
        try:
            _host, port = sentinel.sentinel_get_master_addr_by_name(self.NAME)
            return int(port) != self.master_port
        finally:
            sentinel.close()

    def stop(self) -> None:
        for proc in [*self.procs, self.master]:
            if proc.poll() is None:
                stop_redis_server(proc)
