"""Faults on real processes and a real network path: every generation ends on the uninterrupted tokens.

- The target, a `deltaspec serve-target` process, is killed with SIGKILL mid-round and restarted on
  the same port 20 times during client-driven generations, greedy and sampled; the client opens its
  session again on the committed history each time, and random draws keyed by position make the
  sampled tokens those of an uninterrupted run too.
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

import grpc
import pytest

from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.rpc.generation import generate_client_driven, generate_on_server
from deltaspec.shared.rpc.options import CHANNEL_OPTIONS
from benchmarks.fault_proxy import TcpProxy
from deltaspec.shared.rpc.remote_target import RemoteTargetSession
from deltaspec.v1 import target_service_pb2 as target_pb2
from deltaspec.v1 import target_service_pb2_grpc as target_pb2_grpc
from support import reference  # noqa: F401 - a fixture
from test_rpc_support import PROMPT, draft_service, one_torch_thread, pair, start, target_service  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
N = 40
KILLS = 20
RECONNECT_S = dict(CHANNEL_OPTIONS)["grpc.max_reconnect_backoff_ms"] / 1000 + 0.1

ZYGOTE = """
import os, signal, sys
import deltaspec.shared.cli, deltaspec.shared.model.loader, deltaspec.shared.model.tokenizer
import deltaspec.target_service.servicer, deltaspec.draft_service.servicer
deltaspec.shared.model.loader.load_model(sys.argv[1])  # pulls in what loading imports lazily
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped as they die
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        os._exit(deltaspec.shared.cli.main(line.split()))
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


class _Fault(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "injected"


@pytest.mark.parametrize("fault", ["session lost, then its replay unavailable", "commit cancelled"])
def test_a_commit_lands_through_a_second_fault(pair, fault):
    """Races the 20-kill run below and the replica-loss test once hit under load. The session is lost and the new
    one's replay of the round in flight fails too (the target went away again): the next attempt opens another
    session and replays the round there, instead of committing a round the new session never saw. A target stopped
    with a Commit in flight cancels it (CANCELLED): retried like UNAVAILABLE. Either way the commit lands once."""
    with start(target_service(pair[0])) as target:
        stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(target.address))
        session, clean = RemoteTargetSession(stub, PROMPT), RemoteTargetSession(stub, PROMPT)
        rnd = session.verify("r1", [7, 8])
        assert clean.verify("r1", [7, 8]).verdict == rnd.verdict
        lost = fault.startswith("session lost")
        if lost:
            stub.CloseSession(target_pb2.CloseSessionRequest(session_id=session.session_id))  # gone with its replica
        name = "Verify" if lost else "Commit"
        call, failed = getattr(stub, name), []

        def once(request, **kwargs):
            if not failed:
                failed.append(request.round_id)
                raise _Fault(grpc.StatusCode.UNAVAILABLE if lost else grpc.StatusCode.CANCELLED)
            return call(request, **kwargs)

        setattr(stub, name, once)
        assert session.commit("r1", rnd.verdict.accepted) == clean.commit("r1", rnd.verdict.accepted)
        assert session.tokens == clean.tokens and failed == ["r1"]


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

                sampling = SamplingParams(0.9, 0, 0.95, seed=runs) if runs % 2 else SamplingParams()
                expected = reference if sampling.greedy else generate(  # sampled: the same seeded draws in process
                    load_model(pair[0]), PROMPT, N, ModelDrafter(load_model(pair[1]), sampling), 4, sampling).token_ids
                result, _ = generate_client_driven(f"127.0.0.1:{port}", draft.address, PROMPT, "", N,
                                                   num_draft_tokens=4, sampling=sampling, draft_timeout_s=30,
                                                   on_tokens=on_tokens)
                for killer in killers:
                    killer.join()
                runs += 1
                assert result.token_ids == expected, f"run {runs}, {sampling}"
        print(f"\ntarget SIGKILLed mid-round and restarted {kills} times over {runs} client-driven generations "
              f"(greedy and sampled); every output identical to the uninterrupted run")
    finally:
        zygote.close()


@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
def test_draft_killed_and_stalled_costs_speculation_not_tokens(pair, pipeline):
    """Client-driven, the draft a process: SIGKILL then a restart; SIGSTOP past the deadline then SIGCONT.

    Pipelined, the two rounds after an event may already hold their proposals: only the serial loop's
    rounds are checked one by one."""
    n = 128
    expected = generate(load_model(pair[0]), PROMPT, n).token_ids
    port = free_port()
    zygote = Zygote(pair[1])
    serve = ("serve-draft", "--model", str(pair[1]), "--port", str(port))
    events = {3: "kill", 6: "restart", 16: "stop", 19: "cont"}  # after these rounds
    chunks: list[int] = []  # tokens per round: more than one means drafts were accepted
    try:
        pid = zygote.spawn(*serve)
        with start(target_service(pair[0])) as target:
            def on_tokens(ids: list[int], text: str) -> None:
                nonlocal pid
                chunks.append(len(ids))
                event = events.get(len(chunks))
                if event == "kill":
                    zygote.kill(pid)
                elif event == "restart":
                    pid = zygote.spawn(*serve)
                    time.sleep(RECONNECT_S)  # the client's channel redials within its reconnect backoff
                elif event in ("stop", "cont"):
                    os.kill(pid, signal.SIGSTOP if event == "stop" else signal.SIGCONT)

            result, _ = generate_client_driven(target.address, f"127.0.0.1:{port}", PROMPT, "", n,
                                               num_draft_tokens=4, draft_timeout_s=0.2, on_tokens=on_tokens,
                                               pipeline=pipeline)
    finally:
        zygote.close()
    assert result.token_ids == expected
    if pipeline:
        assert max(chunks[:3]) > 1 and chunks[5] == 1 and max(chunks[19:]) > 1
        return
    assert max(chunks[:3]) > 1 and chunks[3:6] == [1, 1, 1]  # speculating, then the draft is dead
    assert max(chunks[6:16]) > 1 and max(chunks[19:]) > 1  # speculation resumed after each recovery
    assert 1 in chunks[16:19]  # the stalled draft missed its deadline


def test_proxy_delays_drops_and_resets_connections(pair, reference):
    """client -> proxy -> target -> proxy -> draft (and client -> proxy -> draft when the client drives)."""
    rng = random.Random(5)
    with start(draft_service(pair[1])) as draft:
        to_draft = TcpProxy([draft.address])
        with start(target_service(pair[0], draft_address=to_draft.address, draft_timeout_s=0.2)) as target:
            to_target = TcpProxy([target.address])
            paths = {
                "client-driven": lambda: generate_client_driven(to_target.address, to_draft.address, PROMPT, "", N,
                                                                num_draft_tokens=4, draft_timeout_s=0.2)[0],
                "server loop": lambda: generate_on_server(to_target.address, PROMPT, "", N, num_draft_tokens=4)[0]}
            faults: dict[str, int] = {}
            extra: dict[str, list[float]] = {name: [] for name in paths}
            try:
                for name, run in paths.items():
                    for _ in range(3):
                        started = time.perf_counter()
                        assert run().token_ids == reference
                        clean = time.perf_counter() - started
                        with _Chaos(rng, to_target, to_draft, faults):
                            started = time.perf_counter()
                            assert run().token_ids == reference, name
                            extra[name].append(time.perf_counter() - started - clean)
            finally:
                to_target.close()
                to_draft.close()
    assert set(faults) == set(_Chaos.KINDS)
    print(f"\nproxy faults injected: {dict(sorted(faults.items()))}; outputs identical; extra latency per "
          + "; ".join(f"{name} generation ({N} tokens): mean {sum(v) / len(v) * 1e3:.0f} ms, max {max(v) * 1e3:.0f} ms"
                      for name, v in extra.items()))


class _Chaos:
    """A thread that injects one random fault every 30-120 ms into the two proxies, until the block ends."""

    KINDS = ("target delay 20 ms", "target drop", "target reset",
             "draft delay 300 ms", "draft black hole", "draft drop", "draft reset")

    def __init__(self, rng: random.Random, to_target: TcpProxy, to_draft: TcpProxy, counts: dict[str, int]) -> None:
        self.rng, self.to_target, self.to_draft, self.counts = rng, to_target, to_draft, counts
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Chaos:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.done.wait(self.rng.uniform(0.03, 0.12)):
            kind = self.rng.choice(self.KINDS)
            self.counts[kind] = self.counts.get(kind, 0) + 1
            proxy = self.to_target if kind.startswith("target") else self.to_draft
            if kind.endswith("drop"):
                proxy.drop()
            elif kind.endswith("reset"):
                proxy.reset()
            else:  # a spell of delay or silence
                proxy.delay_s = 0.3 if kind == "draft delay 300 ms" else 0.02 if "delay" in kind else 0.0
                proxy.blackhole = kind == "draft black hole"
                self.done.wait(self.rng.uniform(0.03, 0.12))
                proxy.delay_s, proxy.blackhole = 0.0, False
