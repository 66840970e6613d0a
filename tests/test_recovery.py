"""A target that stays in its loading state longer than the old retry budget: the generation waits it out, exactly.

A restarted target listens at once and answers UNAVAILABLE ("not serving (loading or draining)") until its model is
loaded: tens of seconds to minutes for a real checkpoint. Clients used to give up after 8 tries backing off from
50 ms to 1 s, about 3.5 s, so a client-driven generation in flight when its target restarted was lost. Now every loop
waits, watching the target's grpc.health.v1 status, until the generation's deadline or the recovery window
(`deltaspec.shared.rpc.recovery`). Here the target is a server in this process that is crashed (stopped at once, no
drain: what a SIGKILL looks like to its clients) and started again on its port, loading for `LOAD_S` seconds first
(longer than the old budget) or for ever; the measured waits are printed (docs/reliability.md quotes them).
"""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from deltaspec.shared.cli import main
from deltaspec.shared.client import Client, UnavailableError
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.rpc.generation import generate_client_driven, generate_on_server
from deltaspec.shared.rpc.recovery import check_window
from deltaspec.shared.rpc.server import BackgroundServer, Service
from support import reference  # noqa: F401 - a fixture
from test_rpc_support import PROMPT, draft_service, one_torch_thread, pair, start, target_service  # noqa: F401

N = 24
LOAD_S = 5.0  # longer than the old budget: 8 tries, 50 ms doubling to 1 s between them, ~3.5 s in all
WINDOW_S = 2.0


def loading(service: Service, hold: float | threading.Event) -> Service:
    """`service`, listening (and answering UNAVAILABLE) for `hold` seconds, or until the event is set, before it
    loads."""
    def load() -> None:
        if isinstance(hold, threading.Event):
            hold.wait()
        else:
            time.sleep(hold)
        service.load()
    return Service(service.name, service.register, load)


class Target:
    """A target service in this process on a fixed port: `crash()` stops it at once, `restart(hold)` starts a new one
    (no sessions) on the same port, loading after `hold` (seconds, or an event)."""

    def __init__(self, directory) -> None:
        self.directory = directory
        self.server: BackgroundServer | None = start(target_service(directory))
        self.port = self.server.port
        self.address = self.server.address
        self.holds: list[threading.Event] = []

    def crash(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def restart(self, hold: float | threading.Event) -> None:
        self.crash()
        if isinstance(hold, threading.Event):
            self.holds.append(hold)
        self.server = BackgroundServer([loading(target_service(self.directory), hold)], port=self.port)

    def close(self) -> None:
        for hold in self.holds:
            hold.set()
        self.crash()


@pytest.fixture
def target(pair):
    t = Target(pair[0])
    yield t
    t.close()


@pytest.fixture(scope="module")
def draft(pair):
    with start(draft_service(pair[1])) as server:
        yield server


def expected_tokens(pair, reference, sampling: SamplingParams) -> list[int]:
    if sampling.greedy:
        return reference
    return generate(load_model(pair[0]), PROMPT, N, ModelDrafter(load_model(pair[1]), sampling), 4,  # same draws
                    sampling).token_ids


class Disruption:
    """An `on_tokens` that runs `act` after round `at` (on a thread, so the loop meets the outage at once) and
    measures the outage: the longest wait for tokens from the crash on (the server loop may still deliver a round
    or two it streamed before the crash at once, then wait)."""

    def __init__(self, at: int, act) -> None:
        self.at, self.act, self.rounds = at, act, 0
        self.crashed: float | None = None
        self.last: float | None = None  # when tokens last arrived after the crash (or the crash itself)
        self.waited: float | None = None
        self.thread: threading.Thread | None = None

    def __call__(self, ids: list[int], text: str) -> None:
        self.rounds += 1
        now = time.monotonic()
        if self.last is not None:
            self.waited = max(self.waited or 0.0, now - self.last)
            self.last = now
        if self.rounds == self.at:
            self.crashed = self.last = time.monotonic()
            self.thread = threading.Thread(target=self.act)
            self.thread.start()
            self.thread.join(0.5)  # the crash itself is immediate; the rest (flapping) goes on while the loop waits

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()


@pytest.mark.parametrize("loop, sampling", [
    ("client-driven", SamplingParams()), ("client-driven", SamplingParams(0.9, 0, 0.95, seed=4)),
    ("server loop", SamplingParams())], ids=["client-driven greedy", "client-driven sampled", "server loop greedy"])
def test_a_target_loading_longer_than_the_old_budget_is_waited_out(pair, reference, target, draft, loop, sampling):
    # the server loop runs ahead of the stream it sends: crash it after its first round, while most are still to come
    disruption = Disruption(3 if loop == "client-driven" else 1, lambda: target.restart(LOAD_S))
    if loop == "client-driven":
        result, _ = generate_client_driven(target.address, draft.address, PROMPT, "", N, 4, sampling,
                                           draft_timeout_s=30, on_tokens=disruption)
    else:
        result, _ = generate_on_server(target.address, PROMPT, "", N, 4, sampling, on_tokens=disruption)
    disruption.join()
    assert result.token_ids == expected_tokens(pair, reference, sampling)
    assert disruption.waited is not None and LOAD_S <= disruption.waited < LOAD_S + 5
    kind = "greedy" if sampling.greedy else "sampled"
    print(f"\n{loop}, {kind}: target crashed after round {disruption.at} and loading "
          f"{LOAD_S:g} s on restart; waited {disruption.waited:.2f} s, output identical")


def test_three_restarts_in_a_row_while_loading(pair, reference, target, draft):
    """The target crashes, and crashes twice more while it is loading again (each time 1.5 s into its load), then
    loads: one outage of ~5 s over three restarts, longer than the old budget, waited out by the client-driven loop."""
    def flap() -> None:
        for _ in range(2):
            target.restart(threading.Event())  # loading until crashed again
            time.sleep(1.5)
        target.restart(1.5)

    disruption = Disruption(3, flap)
    result, _ = generate_client_driven(target.address, draft.address, PROMPT, "", N, 4, draft_timeout_s=30,
                                       on_tokens=disruption)
    disruption.join()
    assert result.token_ids == reference
    assert disruption.waited is not None and 4.5 <= disruption.waited < 4.5 + 5
    print(f"\nclient-driven: three restarts in a row while loading; waited {disruption.waited:.2f} s, output identical")


@pytest.mark.parametrize("loop, comes_back", [("client-driven", "loading for ever"), ("client-driven", "never"),
                                              ("server loop", "loading for ever")])
def test_a_target_that_never_comes_back_fails_at_the_window(pair, target, draft, loop, comes_back):
    """Not earlier, not hanging: UNAVAILABLE once the window is over, saying how long it waited and for what."""
    def crash() -> None:
        if comes_back == "never":
            target.crash()
        else:
            target.restart(threading.Event())

    disruption = Disruption(2, crash)
    with pytest.raises(grpc.RpcError) as failed:
        if loop == "client-driven":
            generate_client_driven(target.address, draft.address, PROMPT, "", N, 4, draft_timeout_s=30,
                                   on_tokens=disruption, recovery_window_s=WINDOW_S)
        else:
            generate_on_server(target.address, PROMPT, "", N, 4, on_tokens=disruption, recovery_window_s=WINDOW_S)
    elapsed = time.monotonic() - disruption.crashed  # type: ignore[operator]
    disruption.join()
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    message = failed.value.details()
    assert "deltaspec.v1.TargetService" in message and "did not come back: waited 2." in message, message
    assert "recovery window of 2 s" in message and "loading" in message, message
    assert WINDOW_S <= elapsed < WINDOW_S + 3
    print(f"\n{loop}, target {comes_back}: UNAVAILABLE {elapsed:.2f} s after the crash (window {WINDOW_S:g} s)")


def test_the_client_library_and_the_cli_take_the_window(pair, draft, capsys):
    """`Client(recovery_window_s=)` and `--recovery-window`: a target loading for ever is refused at the window, as
    UnavailableError / one error line; a negative or NaN window is refused at once."""
    hold = threading.Event()
    with BackgroundServer([loading(target_service(pair[0]), hold)]) as loading_target:
        try:
            started = time.monotonic()
            with Client(loading_target.address, draft=draft.address, recovery_window_s=1) as client:
                with pytest.raises(UnavailableError, match="did not come back: waited 1.") as failed:
                    client.generate(PROMPT, max_new_tokens=4)
            assert failed.value.reason is None and 1 <= time.monotonic() - started < 4
            started = time.monotonic()
            assert main(["generate", "--target-addr", loading_target.address, "--prompt-ids", "1,2,3",
                         "--recovery-window", "1"]) == 2
            assert 1 <= time.monotonic() - started < 4
            err = capsys.readouterr().err
            assert err.startswith("deltaspec: error: UNAVAILABLE: deltaspec.v1.TargetService at 127.0.0.1:"), err
            assert "waited 1." in err and "recovery window of 1 s" in err, err
        finally:
            hold.set()
    for bad in (-1, float("nan"), "5"):
        with pytest.raises(ValueError, match="recovery_window_s must be a number of seconds, 0 or more"):
            Client("127.0.0.1:1", recovery_window_s=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="got -0.5"):
        check_window(-0.5)
    for bad, message in (("-1", "must be 0 or more seconds, got -1"), ("nan", "must be 0 or more seconds, got nan"),
                         ("soon", "must be a number of seconds, got 'soon'")):
        with pytest.raises(SystemExit):
            main(["generate", "--target-addr", "127.0.0.1:1", "--prompt", "x", "--recovery-window", bad])
        assert f"argument --recovery-window: {message}" in capsys.readouterr().err



def test_a_target_not_listening_for_longer_than_a_call_is_waited_out(pair):
    """A target that takes longer than a call's timeout to listen again (a pod rescheduled, an image pulled): the call
    runs out of time waiting for a connection and the health service cannot be reached either, so that is an outage
    to wait out, not a slow answer. The target is a real process started 2 s after the session's first call."""
    import socket

    from grpc_health.v1 import health_pb2_grpc

    from deltaspec.shared.rpc.options import channel
    from deltaspec.shared.rpc.remote_target import RemoteTargetSession
    from deltaspec.v1 import target_service_pb2_grpc
    from support import Served

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    started: list[Served] = []
    later = threading.Timer(2.0, lambda: started.append(Served("serve-target", pair[0], port=port)))
    with channel(address) as ch:
        begun = time.monotonic()
        later.start()
        try:  # the session opens in its constructor: its first call
            session = RemoteTargetSession(target_service_pb2_grpc.TargetServiceStub(ch), PROMPT, call_timeout_s=1.0,
                                          recovery_window_s=60, health=health_pb2_grpc.HealthStub(ch),
                                          address=address)
            waited = time.monotonic() - begun
            assert session.extend([5]) > 0 and session.outages
            session.close()
        finally:
            later.join()
            for served in started:
                served.terminate()
    assert 2.0 <= waited < 60
    print(f"\nclient-driven: target listening only after 2 s, then loading, calls of 1 s; waited {waited:.2f} s")
