#!/usr/bin/env python3
"""A gRPC client of another implementation (Python's grpcio) against tollgate's gRPC answers.

Starts each example binary given on the command line (a tonic health service limited to 10
calls a minute per peer, through the layer or the interceptor) on a free loopback port, calls
grpc.health.v1.Health/Check until it is refused, and checks what grpcio reads: the code
RESOURCE_EXHAUSTED, a google.rpc.Status of that code whose details unpack to one
google.rpc.RetryInfo, and grpc-retry-pushback-ms in the trailers with the same delay (rounded
up to a millisecond). Exits non-zero, saying why, on any difference.

    python3 scripts/grpc_interop.py target/debug/examples/tonic_server \
        target/debug/examples/grpc_interceptor
"""

import os
import socket
import subprocess
import sys
import time

import grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check(binary):
    port = free_port()
    addr = f"127.0.0.1:{port}"
    env = dict(os.environ, TOLLGATE_GRPC_ADDR=addr)
    server = subprocess.Popen([binary], env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.time() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline:
                    sys.exit(f"{binary} did not start on {addr}")
                time.sleep(0.05)
        with grpc.insecure_channel(addr) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for n in range(1, 12):
                try:
                    stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                except grpc.RpcError as error:
                    if n != 11:
                        sys.exit(f"{binary}: call {n} refused: {error}")
                    return refused(binary, error)
            sys.exit(f"{binary}: 11 calls admitted, the limit is 10")
    finally:
        server.kill()
        server.wait()


def refused(binary, error):
    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        sys.exit(f"{binary}: refused with {error.code()}, not RESOURCE_EXHAUSTED")
    status = rpc_status.from_call(error)
    if status is None:
        sys.exit(f"{binary}: no google.rpc.Status in grpc-status-details-bin")
    if status.code != grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
        sys.exit(f"{binary}: the google.rpc.Status says code {status.code}")
    infos = []
    for detail in status.details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            infos.append(info)
    if len(infos) != 1:
        sys.exit(f"{binary}: {len(infos)} RetryInfo in the details, not 1")
    delay = infos[0].retry_delay.seconds + infos[0].retry_delay.nanos / 1e9
    trailers = dict(error.trailing_metadata() or ())
    pushback = trailers.get("grpc-retry-pushback-ms")
    if pushback is None:
        sys.exit(f"{binary}: no grpc-retry-pushback-ms in the trailers: {trailers}")
    pushback = int(pushback) / 1000
    if not (0 < delay <= 60 and delay <= pushback < delay + 0.001):
        sys.exit(f"{binary}: RetryInfo {delay} s and pushback {pushback} s disagree")
    print(f"{os.path.basename(binary)}: RESOURCE_EXHAUSTED, RetryInfo {delay:.3f} s, pushback {pushback:.3f} s")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for binary in sys.argv[1:]:
        check(binary)
