"""A TCP proxy on loopback for the tests and the bench: round robin over endpoints, faults on demand.

It stands in for a ClusterIP Service (each new connection goes to the next endpoint; an endpoint
is removed when its pod goes) and for a bad network between two processes: it can delay every
chunk it passes on (a propagation delay: each chunk leaves `delay_s` after it arrived, in order,
so chunks in flight overlap as on a real link), swallow everything (a black hole: connections look
alive, nothing arrives), close every connection (drop) or abort them with a TCP reset.

It lives in benchmarks/, not in the installed package (no server or client uses it) and not under tests/: the
pipeline bench puts it between its processes for network delay, and the tests (routing, faults, pipelined rounds)
import it from here as `benchmarks.fault_proxy`, with the checkout root on their path (pyproject's pytest
`pythonpath`). The bench must not import from tests/, so the one copy sits on the bench's side.
"""
from __future__ import annotations

import asyncio
import socket
import struct
import threading


class TcpProxy:
    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = list(endpoints)
        self.upstream_ports: set[int] = set()  # local ports of the proxy's connections to the endpoints
        self.delay_s = 0.0  # added before each chunk is passed on, both ways
        self.blackhole = False  # while set, chunks are read and thrown away
        self.connections = 0  # accepted, ever
        self._next = 0
        self._writers: dict[str, list[asyncio.StreamWriter]] = {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="tcp-proxy", daemon=True)
        self.thread.start()
        self.server = self._run(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.server.sockets[0].getsockname()[1]

    def remove(self, endpoint: str) -> None:
        """The pod is gone: no new connections go there, and the ones through the proxy close."""
        async def drop() -> None:
            self.endpoints.remove(endpoint)
            for writer in self._writers.pop(endpoint, []):
                writer.close()
        self._run(drop())

    def drop(self) -> None:
        """Close every open connection (FIN), both sides."""
        self._run(self._each(lambda writer: writer.close()))

    def reset(self) -> None:
        """Abort every open connection with a TCP reset (SO_LINGER 0), both sides."""
        def abort(writer: asyncio.StreamWriter) -> None:
            if writer.is_closing():
                return
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        self._run(self._each(abort))

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            await self._each(lambda writer: writer.close())
            pipes = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in pipes:
                task.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
        self._run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()

    async def _each(self, act) -> None:
        for writers in self._writers.values():
            for writer in writers:
                act(writer)
            writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if not self.endpoints:
            writer.close()
            return
        endpoint = self.endpoints[self._next % len(self.endpoints)]
        self._next += 1
        host, port = endpoint.rsplit(":", 1)
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:  # a connection to a dead endpoint is reset; the client reconnects
            writer.close()
            return
        self.upstream_ports.add(up_writer.get_extra_info("sockname")[1])
        self._writers.setdefault(endpoint, []).extend([writer, up_writer])
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except asyncio.CancelledError:  # `close`: end quietly (Python 3.11's streams log a cancelled connection task)
            pass

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read chunks as they come; a second task passes each one on `delay_s` after it arrived."""
        chunks: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        sender = asyncio.ensure_future(self._send(chunks, writer))
        try:
            while data := await reader.read(65536):
                chunks.put_nowait((self.loop.time() + self.delay_s, data))
            chunks.put_nowait(None)
            await sender
        except (ConnectionError, OSError):
            pass
        finally:
            sender.cancel()
            writer.close()

    async def _send(self, chunks: asyncio.Queue, writer: asyncio.StreamWriter) -> None:
        while (chunk := await chunks.get()) is not None:
            due, data = chunk
            if due > self.loop.time():
                await asyncio.sleep(due - self.loop.time())
            if not self.blackhole:
                writer.write(data)
                await writer.drain()

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)
