"""A worker of a parameter-server job (``lta ps``): push gradients, pull parameters, over UDP.

``PsClient(server, job_id, worker_id, config=PsClientConfig(...))``, then::

    params = client.initialize(my_initial_params)   # the server keeps the first worker's
    for batch in data:
        grad = compute(params, batch)
        params = client.step(grad, lr=0.05)         # push (compressed), then pull

Each push is one batch of PUSH packets (the gradient encoded by the job's compression, cut as
``hostlib.ps.wire`` says, every packet stamped with the parameter version it was computed on and the
push's number), sent in one system call; nothing is resent: a lost packet is a lost part of the
gradient, which the server's renormalization or rule absorbs. The PULL that follows is the reliable
part: it is resent, with the chunks still missing, until every parameter chunk arrived, for at most
``timeout_s`` (then :class:`PsTimeout`). While the server is silent it may be holding the PULL, so the
resend waits ``retry_s``, doubling up to ``max_retry_s``; once part of an answer came, the rest left in
the same batch, so a gap of ``answer_gap_s`` means loss and the missing chunks are asked for at once
(then every ``4 x answer_gap_s``: the server answers re-PULLs at once). In sync mode
the server holds the PULL until the step is applied; in async mode it answers at once, and flags a push
it refused as too stale: the worker goes on from the fresh parameters instead of blocking.

The top-k compressor's residual (error feedback) stays here, on the worker. numpy and stdlib only.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import asdict, dataclass

import numpy as np

from hostlib.batchio import BatchSocket, RxBatch, addr_key
from hostlib.errors import LtaError
from hostlib.protocol import HEADER_BYTES, HEADER_DTYPE, VERSION, PsCodec, PsFlag, PsOp, packet_bytes
from hostlib.ps.compress import Compressor, make_compressor, wire_bytes
from hostlib.ps.wire import (
    MAX_PUSH_PACKETS,
    build_packets,
    chunk_bitmap,
    codec_of,
    encode_push,
    float_rows,
    lr_bits,
    param_chunks,
    rows_to_floats,
    values_per_packet,
)

log = logging.getLogger(__name__)

_PARAM = int(PsOp.PARAM)
_REJECTED = int(PsFlag.REJECTED)


class PsTimeout(LtaError, TimeoutError):
    """The parameter server did not answer a PULL in time."""


@dataclass(frozen=True)
class PsClientConfig:
    """``elems_per_packet`` (K) and ``compression`` must match the server's job; ``topk_ratio`` is the
    share of values a top-k push sends; ``seed`` seeds int8's stochastic rounding."""

    elems_per_packet: int = 64
    compression: str = "none"
    topk_ratio: float = 0.01
    seed: int = 0
    retry_s: float = 0.05  # PULL resend while the server is silent (it may hold a sync PULL); doubles
    max_retry_s: float = 0.5
    answer_gap_s: float = 0.003  # an answer's packets leave in one batch: a gap this long means loss
    timeout_s: float = 30.0


@dataclass
class PsClientStats:
    pushes: int = 0
    rejected: int = 0  # pushes the server refused (async: too stale; sync: late for the window)
    staleness_sum: int = 0  # async: the staleness the server measured, summed over the answered pushes
    packets_sent: int = 0
    wire_bytes_sent: int = 0  # whole UDP payloads (header + K lanes) of PUSH packets
    payload_bytes_sent: int = 0  # the compressed gradient itself (hostlib.ps.compress.wire_bytes)
    pulls: int = 0
    pull_resends: int = 0
    param_packets: int = 0
    stray_packets: int = 0  # answers to an earlier PULL, or not PARAM

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class PsClient:
    """One worker of one parameter-server job (one UDP socket; use one client per thread)."""

    def __init__(
        self,
        server: tuple[str, int],
        job_id: int,
        worker_id: int,
        *,
        config: PsClientConfig | None = None,
        bind: tuple[str, int] = ("127.0.0.1", 0),
        io: str | None = None,
    ) -> None:
        self.config = config or PsClientConfig()
        self.k = self.config.elems_per_packet
        self.codec = codec_of(self.config.compression)
        values_per_packet(self.codec, self.k)  # checks K for the codec
        self.job_id = job_id
        self.worker_id = worker_id
        host = socket.gethostbyname(server[0])
        self.server = (host, int(server[1]))
        self._dest = addr_key(self.server)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind(bind)
        self.batch = BatchSocket(self.sock, io)
        self.packet_bytes = packet_bytes(self.k)
        self._rx = RxBatch.within(4 << 20, self.packet_bytes + 64)
        self.compressor: Compressor = self._make_compressor()
        self.n_params = 0
        # This process's INIT `step`: a new one tells the server the worker started again (a restart).
        self.incarnation = int.from_bytes(os.urandom(4), "big") or 1
        self._padded: np.ndarray | None = None
        self.version = 0  # the parameter version this worker holds (the server's step)
        self._seq = 0  # pushes sent
        self.last_rejected = False
        self.last_staleness = 0
        self.stats = PsClientStats()

    def _make_compressor(self) -> Compressor:
        cfg = self.config
        name = cfg.compression
        if self.codec == PsCodec.INT8:
            return make_compressor(name, chunk=values_per_packet(self.codec, self.k), rng=cfg.seed)
        if self.codec == PsCodec.TOPK:
            return make_compressor(name, ratio=cfg.topk_ratio)
        return make_compressor(name)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> PsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()

    @property
    def params(self) -> np.ndarray:
        """This worker's copy of the parameters (float32, a view: copy it to keep it)."""
        if self._padded is None:
            raise RuntimeError("call initialize() first")
        return self._padded[: self.n_params]

    # ---- the exchange -----------------------------------------------------------------------------------
    def initialize(self, params: np.ndarray) -> np.ndarray:
        """Offer ``params`` as the job's initial parameters (kept only if the job has none yet) and return
        the job's parameters: this worker's, or those of the worker that initialized it first."""
        flat = np.asarray(params, dtype=np.float32).ravel()
        if flat.size == 0:
            raise ValueError("no parameters to initialize the job with")
        self.n_params = flat.size
        chunks = param_chunks(flat.size, self.k)
        self._padded = np.zeros(chunks * self.k, dtype=np.float32)
        self._padded[: flat.size] = flat
        payload, nelem = float_rows(flat, self.k)
        init = build_packets(
            payload,
            self.k,
            version=VERSION,
            op=int(PsOp.INIT),
            job_id=self.job_id,
            worker_id=self.worker_id,
            nelem=nelem,
            seq=flat.size,
            step=self.incarnation,
            chunk=np.arange(chunks),
        )
        return self._await(0, extra=init)

    def push(self, grad: np.ndarray, *, lr: float | None = None) -> int:
        """Send one gradient (encoded by the job's compression); returns the UDP bytes sent."""
        if self._padded is None:
            raise RuntimeError("call initialize() before pushing gradients")
        flat = np.asarray(grad, dtype=np.float32).ravel()
        if flat.size != self.n_params:
            raise ValueError(f"gradient has {flat.size} values, the job has {self.n_params} parameters")
        enc = self.compressor.encode(flat)
        payload, nelem = encode_push(self.codec, enc, self.k)
        n = len(payload)
        if n > MAX_PUSH_PACKETS:
            raise ValueError(
                f"a push of {n} packets exceeds {MAX_PUSH_PACKETS}: raise elems_per_packet (K={self.k})"
            )
        self._seq += 1
        rows = build_packets(
            payload,
            self.k,
            version=VERSION,
            op=int(PsOp.PUSH),
            exp=int(self.codec),
            job_id=self.job_id,
            worker_id=self.worker_id,
            slot=n,
            nelem=nelem,
            seq=self._seq,
            step=self.version,
            chunk=np.arange(n),
            bitmap=lr_bits(lr),
        )
        self._send(rows)
        self.stats.pushes += 1
        self.stats.packets_sent += n
        self.stats.wire_bytes_sent += n * self.packet_bytes
        self.stats.payload_bytes_sent += wire_bytes(enc)
        return n * self.packet_bytes

    def pull(self) -> np.ndarray:
        """Wait for the parameters that answer the last push (sync: once its step is applied)."""
        return self._await(self._seq)

    def step(self, grad: np.ndarray, *, lr: float | None = None) -> np.ndarray:
        """:meth:`push` then :meth:`pull`: the parameters to compute the next gradient on."""
        self.push(grad, lr=lr)
        return self.pull()

    # ---- receiving --------------------------------------------------------------------------------------
    def _pull_rows(self, seq: int, missing: np.ndarray) -> np.ndarray:
        """PULL packets asking for the ``missing`` chunks (one per 32·K chunks)."""
        rows = []
        rest = missing
        while rest.size:
            first, payload, nelem = chunk_bitmap(rest, self.k)
            rows.append(
                build_packets(
                    payload[None, :],
                    self.k,
                    version=VERSION,
                    op=int(PsOp.PULL),
                    job_id=self.job_id,
                    worker_id=self.worker_id,
                    nelem=nelem,
                    seq=seq,
                    step=self.version,
                    chunk=first,
                )
            )
            rest = rest[rest >= first + 32 * self.k]
        return np.concatenate(rows)

    def _send(self, rows: np.ndarray) -> None:
        self.batch.send(rows, rows.shape[1], self._dest)

    def _await(self, seq: int, extra: np.ndarray | None = None) -> np.ndarray:
        """PULL (with ``extra`` packets before it) and collect the answer, resending as documented."""
        assert self._padded is not None
        cfg = self.config
        n_chunks = param_chunks(self.n_params, self.k)
        missing = np.ones(n_chunks, dtype=bool)
        versions = np.zeros(n_chunks, dtype=np.int64)
        rejected, staleness = False, 0
        start = time.monotonic()
        wait = cfg.retry_s
        answered_before = False
        self.stats.pulls += 1
        while True:
            out = self._pull_rows(seq, np.flatnonzero(missing))
            self._send(out if extra is None else np.concatenate([extra, out]))
            resend_at = time.monotonic() + wait
            answered = False  # some chunk of this answer arrived: the rest comes at once or was lost
            while missing.any():
                left = cfg.answer_gap_s if answered else resend_at - time.monotonic()
                if left <= 0:
                    break
                n = self.batch.recv(self._rx, left)
                if not n:
                    if answered:
                        break
                    continue
                got, rejected_now, stale_now = self._take(n, seq, missing, versions)
                answered |= got > 0
                rejected |= rejected_now
                staleness = max(staleness, stale_now)
            if not missing.any():
                break
            if time.monotonic() - start > cfg.timeout_s:
                host, port = self.server
                raise PsTimeout(
                    f"parameter server at {host}:{port} sent {int((~missing).sum())} of {n_chunks} parameter "
                    f"chunks for job {self.job_id}, worker {self.worker_id} within {cfg.timeout_s:g} s — is "
                    f"`lta ps` running with job {self.job_id} for this many workers, K={self.k} and "
                    f"compression {cfg.compression!r}?"
                )
            self.stats.pull_resends += 1
            # Before any answer the server may be holding the PULL (sync) or be gone: back off. Once it
            # has answered it answers at once, so silence or a gap means the packets were lost: ask
            # again soon (a few answer gaps: the resent PULL's round trip).
            answered_before |= answered
            wait = 4 * cfg.answer_gap_s if answered_before else min(wait * 2, cfg.max_retry_s)
        self.version = int(versions.min())
        if seq > 0:
            self.last_rejected, self.last_staleness = rejected, staleness
            self.stats.rejected += int(rejected)
            self.stats.staleness_sum += staleness
        return self.params

    def _take(self, n: int, seq: int, missing: np.ndarray, versions: np.ndarray) -> tuple[int, bool, int]:
        """Store the PARAM chunks among ``n`` received rows that answer PULL ``seq``; returns how many
        there were, whether one says the push was rejected, and the staleness the server measured."""
        assert self._padded is not None
        rows = self._rx.data[:n]
        hdr = np.ascontiguousarray(rows[:, :HEADER_BYTES]).view(HEADER_DTYPE).ravel()
        ok = (
            (self._rx.lens[:n] == self.packet_bytes)
            & (hdr["op"] == _PARAM)
            & (hdr["job_id"] == self.job_id)
            & (hdr["worker_id"] == self.worker_id)
            & (hdr["seq"] == seq)
            & (hdr["chunk"] < len(missing))
        )
        self.stats.stray_packets += int(n - ok.sum())
        if not ok.any():
            return 0, False, 0
        hdr = hdr[ok]
        chunks = hdr["chunk"].astype(np.int64)
        values = rows_to_floats(rows[ok][:, HEADER_BYTES:], self.k)
        self._padded.reshape(-1, self.k)[chunks] = values
        missing[chunks] = False
        versions[chunks] = hdr["step"]
        self.stats.param_packets += len(chunks)
        return len(chunks), bool((hdr["flags"] & _REJECTED).any()), int(hdr["weight"].max())
