"""A small network of namespaces for cache-group tests and benchmarks (root, iproute2, tc).

One namespace holds a bridge; every node gets a namespace of its own with one interface on it, and so does the
origin, whose link can be capped with ``tc tbf`` (both directions). Optionally the host joins the bridge too, so
that nodes can reach a service the host runs (the e2e tier's API server, through :class:`TcpForwarder`).
Addresses are 10.<net>.0.0/24, made here and routed nowhere else.

    with NetLab(nodes=4, origin_mbit=1000) as lab:
        lab.run("n1", ["cachefs", "agent", ...])     # a process inside node n1's namespace
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading

__all__ = ["NetLab", "TcpForwarder", "netlab_available"]


def netlab_available() -> str:
    """"" when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2)"
    return ""


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class NetLab:
    """Namespaces ``<tag>-hub`` (bridge), ``<tag>-<node>`` per node, ``<tag>-s3`` for the origin."""

    def __init__(self, nodes: int | list[str], *, origin_mbit: int = 0, tag: str = "", host: bool = False) -> None:
        self.tag = tag or f"cfl{os.getpid() % 10000}"
        self.net = 100 + os.getpid() % 100
        names = [f"n{i + 1}" for i in range(nodes)] if isinstance(nodes, int) else list(nodes)
        self.ips = {name: f"10.{self.net}.0.{11 + i}" for i, name in enumerate(names)}
        self.origin_ip, self.host_ip = f"10.{self.net}.0.2", f"10.{self.net}.0.1"
        self.origin_mbit, self.with_host = origin_mbit, host
        self._made: list[str] = []

    @property
    def nodes(self) -> list[str]:
        return list(self.ips)

    def ns(self, name: str) -> str:
        return f"{self.tag}-{name}"

    @property
    def origin_ns(self) -> str:
        return self.ns("s3")

    def __enter__(self) -> NetLab:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        hub = self.ns("hub")
        self._add_ns(hub)
        _sh("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", hub, "link", "set", "br0", "up")
        for i, (name, ip) in enumerate(self.ips.items()):
            self._attach(self.ns(name), f"p{i}", ip)
        self._attach(self.origin_ns, "ps3", self.origin_ip, mbit=self.origin_mbit)
        if self.with_host:
            # The host's end is named after the tag (host interface names must be unique).
            host_if = f"{self.tag}h"[:15]
            _sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", "ph", "netns", hub)
            self._made.append(f"link:{host_if}")
            _sh("ip", "addr", "add", f"{self.host_ip}/24", "dev", host_if)
            _sh("ip", "link", "set", host_if, "up")
            _sh("ip", "-n", hub, "link", "set", "ph", "master", "br0", "up")

    def _add_ns(self, ns: str) -> None:
        _sh("ip", "netns", "del", ns, check=False)
        _sh("ip", "netns", "add", ns)
        self._made.append(ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _attach(self, ns: str, hub_if: str, ip: str, *, mbit: int = 0) -> None:
        """A namespace with ``eth0`` at ``ip``, its peer ``hub_if`` on the bridge; capped at ``mbit`` both ways."""
        hub = self.ns("hub")
        self._add_ns(ns)
        _sh("ip", "-n", hub, "link", "add", hub_if, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _sh("ip", "-n", hub, "link", "set", hub_if, "master", "br0", "up")
        _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        if mbit:
            tbf = ["tbf", "rate", f"{mbit}mbit", "burst", "1mb", "latency", "100ms"]
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", *tbf)
            _sh("ip", "netns", "exec", hub, "tc", "qdisc", "add", "dev", hub_if, "root", *tbf)

    def delay(self, node: str, ms: float) -> None:
        """Make ``node``'s link slow: ``ms`` of queueing on everything it sends (tbf at a crawl; 0 lifts it)."""
        ns = self.ns(node)
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        if ms:
            # netem is often not built; a 1 Mbit/s token bucket delays every answer of a block by seconds.
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "1mbit",
                "burst", "16kb", "latency", f"{max(ms, 10):.0f}ms")

    def down(self) -> None:
        for made in reversed(self._made):
            if made.startswith("link:"):
                _sh("ip", "link", "del", made[5:], check=False)
            else:
                for pid in _sh("ip", "netns", "pids", made, check=False).stdout.split():
                    try:
                        os.kill(int(pid), 9)
                    except (ProcessLookupError, ValueError):
                        pass
                _sh("ip", "netns", "del", made, check=False)
        self._made.clear()

    def _enter(self, node: str) -> list[str]:
        # The network namespace only: `ip netns exec` also makes a mount namespace, a copy of every mount there
        # is at that moment, and a FUSE mount copied into a long-lived process's namespace outlives its unmount
        # (its daemon then never exits: seen with the FUSE tests running beside these).
        return ["nsenter", f"--net=/run/netns/{self.ns(node)}", "--"]

    def popen(self, node: str, cmd: list[str], **kw) -> subprocess.Popen:
        """Start ``cmd`` inside ``node``'s network namespace (``node`` may also be ``"s3"``)."""
        return subprocess.Popen([*self._enter(node), *cmd], **kw)

    def run(self, node: str, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run([*self._enter(node), *cmd], **kw)


class TcpForwarder:
    """Forwards connections to ``listen`` (an address of the host on the lab's bridge) to ``target`` (a service
    the host runs on loopback), so nodes in the lab can reach it; closed with :meth:`close`."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.listen, self.target = listen, target
        #: While set, nothing is forwarded either way (a stalled origin, for tests); bytes wait until cleared.
        self.held = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._run, name="tcp-forwarder", daemon=True)
        self._thread.start()
        if not self._ready.wait(10) or self._server is None:
            raise RuntimeError(f"cannot listen on {listen}")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(65536):
                    while self.held.is_set():
                        await asyncio.sleep(0.05)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError:
                writer.close()
                return
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

        async def start() -> None:
            try:
                self._server = await asyncio.start_server(handle, *self.listen)
            finally:
                self._ready.set()

        self._loop.run_until_complete(start())
        if self._server is not None:
            self._loop.run_forever()
        tasks = asyncio.all_tasks(self._loop)  # connections still open: ended with the forwarder
        for task in tasks:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._loop.close()

    @property
    def port(self) -> int:
        assert self._server is not None, "the forwarder is not started"
        return self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        if not self._loop.is_closed():
            if self._server is not None:
                self._loop.call_soon_threadsafe(self._server.close)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
