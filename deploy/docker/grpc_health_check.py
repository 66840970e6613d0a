"""Exit 0 when a gRPC server reports SERVING on grpc.health.v1, else 1: the image's HEALTHCHECK.

    python grpc_health_check.py [HOST:PORT] [SERVICE]

The address defaults to 127.0.0.1:$DELTASPEC_HEALTH_PORT (the plaintext health-only port a server
opens with --health-port), else 127.0.0.1:$DELTASPEC_PORT (50051), the service to "" (the whole
server). Kubernetes does not run it (its native gRPC probes ask the same question); `docker run` does.
"""
from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    port = os.environ.get("DELTASPEC_HEALTH_PORT") or os.environ.get("DELTASPEC_PORT", "50051")
    address = argv[1] if len(argv) > 1 else f"127.0.0.1:{port}"
    service = argv[2] if len(argv) > 2 else ""
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                               timeout=3.0)
    except grpc.RpcError as e:
        print(f"{address} {service or '(server)'}: {e.code().name}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address} {service or '(server)'}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
