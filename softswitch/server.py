"""The softswitch as a UDP aggregation server: one socket, packets in, the pipeline's replies out.

Runs in a background thread (``SoftSwitchServer.start()``, what tests and ``lta train`` use) or in the
foreground (``lta softswitch --listen HOST:PORT``). Workers are identified by their UDP source address,
which plays the role of the ingress port.
"""

from __future__ import annotations

import select
import socket
import threading

from softswitch.pipeline import SoftSwitch

_RECV_BATCH = 256  # packets drained per wake-up before replies are sent


class SoftSwitchServer:
    def __init__(
        self, switch: SoftSwitch, listen: tuple[str, int] = ("127.0.0.1", 0), buffer_bytes: int = 32 << 20
    ) -> None:
        self.switch = switch
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            self.sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
        try:
            self.sock.bind(listen)
        except OSError as exc:
            self.sock.close()
            raise OSError(f"softswitch cannot listen on {listen[0]}:{listen[1]}: {exc.strerror}") from exc
        self.address: tuple[str, int] = self.sock.getsockname()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.send_errors = 0

    def start(self) -> SoftSwitchServer:
        self._thread = threading.Thread(target=self.serve_forever, name="softswitch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.sock.close()

    def __enter__(self) -> SoftSwitchServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> None:
        sock = self.sock
        sock.setblocking(False)
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            batch = []
            for _ in range(_RECV_BATCH):
                try:
                    batch.append(sock.recvfrom(65535))
                except BlockingIOError:
                    break
                except OSError:
                    if self._stop.is_set():
                        return
                    raise
            for dest, packet in self.switch.process_many(batch):
                self._send(packet, dest)

    def _send(self, packet: bytes, dest: tuple[str, int]) -> None:
        for _ in range(100):
            try:
                self.sock.sendto(packet, dest)
                return
            except BlockingIOError:
                select.select([], [self.sock], [], 0.01)  # send buffer full: wait for room
            except OSError:
                break  # a worker that went away (ICMP unreachable): its replica is lost, as on a wire
        self.send_errors += 1
