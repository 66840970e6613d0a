"""Channel and server settings, chosen once for both sides.

Messages: a Verify or Propose with draft probabilities carries k * vocab float32 numbers; for
Qwen3.5's 248k vocabulary and k = 16 that is ~16 MB, so both limits are 64 MiB. Keepalive:
pings every 30 s detect a dead peer on long-lived channels (the target's channel to its draft);
the server allows pings that often, also between calls. Reconnects back off from 100 ms to 2 s,
so a restarted server is found again quickly.
"""
from __future__ import annotations

import grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.so_reuseport", 0),
]

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


def channel(address: str) -> grpc.Channel:
    """A plaintext channel with no token (tests, health checks); `deltaspec.shared.rpc.security.ClientSecurity` dials
    with TLS and tokens."""
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
