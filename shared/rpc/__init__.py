"""gRPC glue: error statuses, channel and server settings, message conversion, the clients.

The generated modules live in the top-level `deltaspec.v1` package (built from protos/ by
scripts/gen_protos.sh during set-up); nothing here is generated.
"""
