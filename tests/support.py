"""Pieces several test files share (no tests here): the greedy reference a speculative path must reproduce, and a
`deltaspec serve-*` command run as a child process.

Imported as `from support import ...`, like test_rpc_support (the tiny pair on disk and in-process servers): pytest
puts tests/ on sys.path for the files under it, in every xdist worker too, so this works under `--dist loadgroup`.
A fixture imported into a test file is that file's fixture (module-scoped ones are built once per file).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.rpc.generation import generate_client_driven, generate_on_server

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reference(pair, request) -> list[int]:
    """Target-only greedy decoding of the test file's `PROMPT`, its `N` new tokens, on the pair's target: what
    every speculative path (server loop, client loop, through faults) must give token for token."""
    return generate(load_model(pair[0]), request.module.PROMPT, request.module.N).token_ids


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude: the mixer tests' tolerance measure."""
    return ((a - b).abs().max() / b.abs().max()).item()


class Served:
    """`deltaspec <command> --model <model> --port <port> [extra]` in a child process, as an operator starts it.

    Its stderr is read on a thread (a chatty server never blocks on a full pipe) and its announcements kept:
    `address` is known as soon as it listens (so a target can be started while its draft still loads),
    `announced["metrics"]` once it says where /metrics is; `wait_serving()` waits for its models to load.
    `program`: what Python runs (the CLI's module; a script that wraps it, as tests/tp_faults.py does)."""

    def __init__(self, command: str, model: Path, *extra: str, port: int | str = 0, env: dict | None = None,
                 start_timeout_s: float = 300.0, program: tuple[str, ...] = ("-m", "deltaspec.shared.cli")) -> None:
        self.proc = subprocess.Popen([sys.executable, *program, command, "--model", str(model),
                                      "--port", str(port), *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, cwd=ROOT,
                                     env=env if env is not None else {**os.environ, "OMP_NUM_THREADS": "1"})
        self.timeout_s = start_timeout_s
        self.announced: dict[str, str] = {}  # "listening", "metrics": HOST:PORT; "serving": ""
        self.log: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.address = self._wait_for("listening")

    def wait_serving(self) -> Served:
        self._wait_for("serving")
        return self

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (a graceful drain), then its exit status."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()

    def _read(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            with self._changed:
                self.log.append(line)
                if m := re.match(r"(listening|metrics) on (\S+)|(serving)\b", line):
                    self.announced[m.group(1) or m.group(3)] = m.group(2) or ""
                self._changed.notify_all()
        with self._changed:  # stderr closed: it exited
            self.announced.setdefault("exited", "")
            self._changed.notify_all()

    def _wait_for(self, what: str) -> str:
        with self._changed:
            self._changed.wait_for(lambda: what in self.announced or "exited" in self.announced, self.timeout_s)
            if what not in self.announced:
                raise AssertionError(f"exited with {self.proc.poll()} before {what!r} (or timed out):\n"
                                     f"{''.join(self.log[-20:])}")
            return self.announced[what]


def both_loops(target: Served, draft: Served, prompt: list[int], n: int, k: int) -> tuple[list[int], list[int]]:
    """Greedy tokens through the target's own loop (`Generate`) and the client-driven one, once both serve; each
    loop drafted."""
    draft.wait_serving(), target.wait_serving()
    on_server = generate_on_server(target.address, prompt, "", n, k)[0]
    client = generate_client_driven(target.address, draft.address, prompt, "", n, k, draft_timeout_s=30.0)[0]
    assert on_server.stats.drafted > 0 and client.stats.drafted > 0
    return on_server.token_ids, client.token_ids
