"""deltaspec: exact speculative decoding for hybrid Gated DeltaNet + attention models.

What an application imports::

    from deltaspec import Client, AsyncClient

    with Client("127.0.0.1:50051") as client:
        print(client.generate("def add(a, b):", max_new_tokens=32).text)

`Client` and `AsyncClient` call a running target service (`deltaspec serve-target`); every refusal is raised as a
`DeltaspecRpcError` subclass (`InvalidArgumentError`, `UnavailableError`, ...). They are defined in
`deltaspec.shared.client` and loaded on first use, so `import deltaspec.v1` (the generated gRPC messages and
stubs) does not load torch. The command line is `deltaspec.cli` (`python -m deltaspec.cli`, or `deltaspec`).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["AsyncClient", "Client", "Completion", "DeltaspecRpcError", "FailedPreconditionError",
           "InvalidArgumentError", "NotFoundError", "PermissionDeniedError", "Piece", "ResourceExhaustedError",
           "UnauthenticatedError", "UnavailableError"]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ loads them
    from deltaspec.shared.client import (AsyncClient, Client, Completion, DeltaspecRpcError,
                                         FailedPreconditionError, InvalidArgumentError, NotFoundError,
                                         PermissionDeniedError, Piece, ResourceExhaustedError, UnauthenticatedError,
                                         UnavailableError)


def __getattr__(name: str):
    if name in __all__:
        value = getattr(importlib.import_module("deltaspec.shared.client"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'deltaspec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
