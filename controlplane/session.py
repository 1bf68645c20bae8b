"""One P4Runtime session with one switch over gRPC: connect with a deadline, become primary through the
StreamChannel arbitration, then Set/Get the pipeline, Write and Read.

Built on grpcio and the p4runtime protos. Unlike p4runtime-shell's client, nothing here exits the
process: every failure is an exception whose message says what to do. Write errors are unpacked here
rather than with p4runtime-shell's ``P4RuntimeErrorIterator``, which never advances past an OK entry
(BMv2 reports one per successful update) and so loops forever on a partly failed batch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator

import grpc
from google.rpc import code_pb2, status_pb2

from controlplane import DEFAULT_TARGET, DEFAULT_TIMEOUT_S
from controlplane.errors import (
    ControlPlaneError,
    NotPrimary,
    PipelineMismatch,
    SwitchUnreachable,
    WriteRejected,
)
from hostlib.p4.proto import p4info_pb2, p4runtime_pb2, p4runtime_pb2_grpc

__all__ = ["DEFAULT_TARGET", "DEFAULT_TIMEOUT_S", "P4RuntimeSession", "write_errors"]


class P4RuntimeSession:
    """A primary P4Runtime client for device ``device_id`` at ``target`` ("host:port").

    Use as a context manager; ``open`` raises :class:`SwitchUnreachable` when the switch does not answer
    within ``timeout_s`` and :class:`NotPrimary` when another controller holds a higher election id.
    With ``arbitrate=False`` the session only reads (Read and GetForwardingPipelineConfig need no
    arbitration), so a monitor never competes with the controller that writes.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        device_id: int = 0,
        election_id: tuple[int, int] = (0, 1),
        timeout_s: float = DEFAULT_TIMEOUT_S,
        arbitrate: bool = True,
    ) -> None:
        self.target = target
        self.arbitrate = arbitrate
        self.device_id = device_id
        self.election_id = election_id
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None
        self._requests: queue.Queue = queue.Queue()
        self._arbitration: queue.Queue = queue.Queue()
        self._stream = None
        self._reader: threading.Thread | None = None

    # ---- lifecycle ------------------------------------------------------------------------------
    def open(self) -> P4RuntimeSession:
        self._channel = grpc.insecure_channel(self.target)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=self.timeout_s)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise SwitchUnreachable(self.target, self.timeout_s) from None
        self.stub = p4runtime_pb2_grpc.P4RuntimeStub(self._channel)
        if not self.arbitrate:
            return self
        self._stream = self.stub.StreamChannel(self._request_iterator())
        self._reader = threading.Thread(target=self._read_stream, name="p4rt-stream", daemon=True)
        self._reader.start()
        self._arbitrate()
        return self

    def close(self) -> None:
        self._requests.put(None)
        if self._stream is not None:
            self._stream.cancel()
        if self._reader is not None:
            self._reader.join(timeout=self.timeout_s)
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stream = self._reader = None

    def __enter__(self) -> P4RuntimeSession:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def _request_iterator(self) -> Iterator[p4runtime_pb2.StreamMessageRequest]:
        while (request := self._requests.get()) is not None:
            yield request

    def _read_stream(self) -> None:
        try:
            for response in self._stream:
                if response.HasField("arbitration"):
                    self._arbitration.put(response.arbitration)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self._arbitration.put(exc)

    def _arbitrate(self) -> None:
        request = p4runtime_pb2.StreamMessageRequest()
        request.arbitration.device_id = self.device_id
        request.arbitration.election_id.high, request.arbitration.election_id.low = self.election_id
        self._requests.put(request)
        try:
            answer = self._arbitration.get(timeout=self.timeout_s)
        except queue.Empty:
            self.close()
            raise SwitchUnreachable(self.target, self.timeout_s, "no answer to the arbitration") from None
        if isinstance(answer, grpc.RpcError):
            self.close()
            raise ControlPlaneError(
                f"switch at {self.target} refused the session: {answer.details()} "
                f"(is device id {self.device_id} right? lta ctl --device-id ...)"
            )
        if answer.status.code != code_pb2.OK:
            self.close()
            raise NotPrimary(
                f"another controller is primary on {self.target} (device {self.device_id}); "
                f"use a higher election id (lta ctl --election-id ...) or stop the other controller"
            )

    def _election(self, message) -> None:
        message.device_id = self.device_id
        message.election_id.high, message.election_id.low = self.election_id

    # ---- RPCs -------------------------------------------------------------------------------------
    def set_pipeline(self, info: p4info_pb2.P4Info, device_config: bytes, cookie: int = 0) -> None:
        request = p4runtime_pb2.SetForwardingPipelineConfigRequest()
        self._election(request)
        request.action = p4runtime_pb2.SetForwardingPipelineConfigRequest.VERIFY_AND_COMMIT
        request.config.p4info.CopyFrom(info)
        request.config.p4_device_config = device_config
        request.config.cookie.cookie = cookie
        try:
            self.stub.SetForwardingPipelineConfig(request, timeout=max(self.timeout_s, 30))
        except grpc.RpcError as exc:
            raise PipelineMismatch(
                f"switch at {self.target} rejected the pipeline: {exc.details()} — is p4/build/lta.json "
                f"compiled for this target? (recompile p4/v1model/lta.p4, see p4/build/README.md)"
            ) from None

    def get_p4info(self) -> p4info_pb2.P4Info | None:
        """The P4Info the switch runs, or None when no pipeline is loaded."""
        request = p4runtime_pb2.GetForwardingPipelineConfigRequest(device_id=self.device_id)
        request.response_type = p4runtime_pb2.GetForwardingPipelineConfigRequest.P4INFO_AND_COOKIE
        try:
            response = self.stub.GetForwardingPipelineConfig(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                return None
            raise ControlPlaneError(
                f"switch at {self.target}: GetForwardingPipelineConfig failed: {exc.details()}"
            ) from None
        if not response.config.HasField("p4info"):
            return None
        return response.config.p4info

    def write(self, updates: Iterable[p4runtime_pb2.Update]) -> None:
        request = p4runtime_pb2.WriteRequest()
        self._election(request)
        request.atomicity = p4runtime_pb2.WriteRequest.CONTINUE_ON_ERROR
        request.updates.extend(updates)
        if not request.updates:
            return
        try:
            self.stub.Write(request, timeout=max(self.timeout_s, 10))
        except grpc.RpcError as exc:
            raise WriteRejected(self._describe_write_error(exc, request)) from None

    def _describe_write_error(self, exc: grpc.RpcError, request: p4runtime_pb2.WriteRequest) -> str:
        errors = write_errors(exc)
        if not errors:
            return f"switch at {self.target} rejected a Write ({exc.code().name}): {exc.details()}"
        lines = [f"switch at {self.target} rejected {len(errors)} of {len(request.updates)} updates:"]
        for index, error in errors:
            kind = p4runtime_pb2.Update.Type.Name(request.updates[index].type)
            entity = request.updates[index].entity.WhichOneof("entity")
            lines.append(
                f"  {kind} {entity} #{index}: {code_pb2.Code.Name(error.canonical_code)} {error.message}"
            )
        return "\n".join(lines)

    def read(self, entities: Iterable[p4runtime_pb2.Entity]) -> Iterator[p4runtime_pb2.Entity]:
        request = p4runtime_pb2.ReadRequest(device_id=self.device_id)
        request.entities.extend(entities)
        try:
            for response in self.stub.Read(request, timeout=max(self.timeout_s, 10)):
                yield from response.entities
        except grpc.RpcError as exc:
            raise ControlPlaneError(
                f"switch at {self.target}: Read failed ({exc.code().name}): {exc.details()}"
            ) from None


def write_errors(exc: grpc.RpcError) -> list[tuple[int, p4runtime_pb2.Error]]:
    """(update index, error) of each failed update of a Write, from the binary status details."""
    for key, value in exc.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            break
    else:
        return []
    errors = []
    for index, detail in enumerate(status.details):
        error = p4runtime_pb2.Error()
        if detail.Unpack(error) and error.canonical_code != code_pb2.OK:
            errors.append((index, error))
    return errors
