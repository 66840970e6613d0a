"""Faults on real processes and a real network path: every generation ends on the uninterrupted tokens.

- The target, a `deltaspec serve-target` process, is killed with SIGKILL mid-round and restarted on
  the same port 20 times during client-driven generation; the client opens its session again on
  the committed history each time.
- The draft, a `deltaspec serve-draft` process, is killed and restarted, and stalled (SIGSTOP) past
  its per-round deadline, then resumed: rounds go on without drafts meanwhile, and speculation
  resumes once it is back. (Slow, erroring and garbage-talking drafts inside a server process are
  in test_rpc_generate.py.)
- A TCP proxy between client and target and between target (or client) and draft delays, drops,
  resets and black-holes connections at random moments; the extra latency is printed.

Processes are forked from one parent that has imported everything and loaded the model once
(`Zygote`): a Python start with torch costs seconds here, a fork milliseconds, so 20 restarts
cost 20 model loads from disk rather than 20 interpreter starts. Each child runs the CLI's
`main` exactly as `deltaspec` does.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shared.decoding.speculative import generate
from shared.model.loader import load_model
from shared.rpc.client import generate_client_driven, generate_on_server
from test_proxy_support import TcpProxy
from test_rpc_support import PROMPT, draft_service, one_torch_thread, pair, start, target_service  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
N = 40
KILLS = 20

ZYGOTE = """
import os, signal, sys
import shared.cli, shared.model.loader, shared.model.tokenizer, target_service.servicer, draft_service.servicer
shared.model.loader.load_model(sys.argv[1])  # pulls in what loading imports lazily
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped as they die
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        os._exit(shared.cli.main(line.split()))
    print(pid, flush=True)
"""


class Zygote:
    """A parent process that forks `deltaspec` CLI processes on demand; their stderr is read continuously."""

    def __init__(self, model: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(model)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.serving = threading.Semaphore(0)  # one release per "serving" line
        self.children: set[int] = set()
        threading.Thread(target=self._read, daemon=True).start()

    def spawn(self, *argv: str, wait: bool = True) -> int:
        self.proc.stdin.write(" ".join(argv) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        pid = int(self.proc.stdout.readline())  # type: ignore[union-attr]
        self.children.add(pid)
        if wait:
            assert self.serving.acquire(timeout=60), "the child did not start serving"
        return pid

    def kill(self, pid: int) -> None:
        """SIGKILL, and wait until the process is gone (its port is free again)."""
        os.kill(pid, signal.SIGKILL)
        self.children.discard(pid)
        while _alive(pid):
            time.sleep(0.002)

    def close(self) -> None:
        for pid in list(self.children):
            self.kill(pid)
        self.proc.kill()
        self.proc.wait()

    def _read(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            if line.startswith("serving"):
                self.serving.release()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference(pair) -> list[int]:
    return generate(load_model(pair[0]), PROMPT, N).token_ids


def test_target_killed_mid_round_and_restarted_20_times(pair, reference):
    port, rng = free_port(), random.Random(3)
    zygote = Zygote(pair[0])
    serve = ("serve-target", "--model", str(pair[0]), "--port", str(port))
    try:
        pid = zygote.spawn(*serve)
        kills, runs = 0, 0
        with start(draft_service(pair[1])) as draft:
            while kills < KILLS:
                plan = sorted(rng.sample(range(1, 7), 4))  # after these rounds, a kill lands in the next one
                rounds, killers = 0, []

                def kill_and_restart() -> None:
                    nonlocal pid
                    zygote.kill(pid)
                    pid = zygote.spawn(*serve, wait=False)  # the client finds it when it listens

                def on_tokens(ids: list[int], text: str) -> None:
                    nonlocal rounds, kills
                    rounds += 1
                    if plan and rounds == plan[0] and kills < KILLS:
                        plan.pop(0)
                        kills += 1
                        if killers:
                            killers[-1].join()  # one restart at a time
                        killers.append(threading.Timer(rng.uniform(0.0, 0.01), kill_and_restart))
                        killers[-1].start()

                result, _ = generate_client_driven(f"127.0.0.1:{port}", draft.address, PROMPT, "", N,
                                                   num_draft_tokens=4, on_tokens=on_tokens)
                for killer in killers:
                    killer.join()
                runs += 1
                assert result.token_ids == reference, f"run {runs}"
        print(f"\ntarget SIGKILLed mid-round and restarted {kills} times over {runs} client-driven generations; "
              f"every output identical to the uninterrupted run")
    finally:
        zygote.close()
