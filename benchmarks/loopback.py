"""`serve-target` and `serve-draft` as child processes on loopback, and the checks load runs make of them.

Used by `deltaspec soak` and the load section of `deltaspec bench`. The servers are real processes
(so their resident memory is their own), started the way an operator would; every greedy output of a
load run is compared with in-process target-only decoding of the same prompt.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

CORES = os.sched_getaffinity(0)  # the cores this process may use, as it started (`unpin`)
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n    ", "# Read a file and count its lines\n", "def parse(text):\n    \"\"\"",
           "with open(path) as f:\n", "try:\n    import json\nexcept ImportError:\n"]


class Server:
    """`deltaspec serve-...` as a child process on a free loopback port; stderr read continuously."""

    def __init__(self, *argv: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "deltaspec.shared.cli", *argv, "--port", "0",
                                      "--metrics-port", "0"],
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                     cwd=Path(__file__).resolve().parents[1])
        self.address, self.metrics, self.ready, self.serving = "", "", threading.Event(), False
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.ready.wait(300)  # set when it serves, or when it exits first (its stderr closes)
        if not self.serving:
            self.stop()
            raise RuntimeError(f"{argv[0]} did not start serving (exit status {self.proc.returncode}):\n"
                               f"{''.join(self.log[-20:])}")

    def pin(self, cpus: set[int]) -> None:
        pin_threads(self.proc.pid, cpus)

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

    def cpu_s(self) -> float:
        return cpu_seconds(self.proc.pid)

    def sessions(self) -> int:
        """Open sessions, from the server's own `deltaspec_sessions` gauge."""
        return int(self.metric("deltaspec_sessions"))

    def metric(self, name: str, default: float | None = None) -> float:
        """One sample of the server's /metrics (`deltaspec_batch_size_sum`, `name{label="value"}`); `default` when
        the server has none yet (a labelled counter appears with its first count), else LookupError."""
        found = self.samples().get(name, default)
        if found is None:
            raise LookupError(f"no sample {name} in {self.metrics}/metrics")
        return found

    def samples(self) -> dict[str, float]:
        """Every sample of the server's /metrics, by name with its labels, from one scrape."""
        lines = metrics_page(self.metrics).splitlines()
        return {sample: float(value) for sample, value in (line.rsplit(" ", 1) for line in lines
                                                           if line and not line.startswith("#"))}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _read(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.log.append(line)
            if line.startswith("listening on"):
                self.address = line.split()[-1]
            elif line.startswith("metrics on"):
                self.metrics = line.split()[-1]
            elif line.startswith("serving"):
                self.serving = True
                self.ready.set()
        self.ready.set()  # stderr closed: the process ended (a start that failed says why in the log)


def metrics_page(address: str) -> str:
    """The Prometheus text page `address` serves at /metrics now."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        return reply.read().decode()


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Run every thread of process `pid` on `cpus` only; threads it starts later inherit the set from their creator."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def target_apart(targets: list[int], others: list[int], who: str = "the draft and the clients") -> str:
    """Pin the target processes `targets` to the first core and `others` (the draft, a front, this process: the
    clients) to the rest, where there are at least two: the target's own core stands for its own accelerator, and
    none of the rest takes time from its passes. Returns the placement in words (`who`: what `others` are), for a
    bench's header; `unpin` undoes it for this process."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return f"every process on the one core {cores[0]}"
    for pid in targets:
        pin_threads(pid, set(cores[:1]))
    for pid in others:
        pin_threads(pid, set(cores[1:]))
    rest = ("cores " if len(cores) > 2 else "core ") + ", ".join(map(str, cores[1:]))
    return f"the target alone on core {cores[0]}; {who} on {rest}"


def unpin() -> None:
    """This process back on the cores it was given when it started (`CORES`)."""
    pin_threads(os.getpid(), CORES)


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, all threads) process `pid` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_pair(target_dir: Path, draft_dir: Path, *extra: str) -> dict[str, Server]:
    """`serve-draft` and a `serve-target` speculating with it, both given `extra` flags; `stop_all` ends them."""
    draft = Server("serve-draft", "--model", str(draft_dir), *extra)
    try:
        return {"target": Server("serve-target", "--model", str(target_dir), "--draft-addr", draft.address, *extra),
                "draft": draft}
    except BaseException:
        draft.stop()
        raise


def stop_all(servers: dict[str, Server]) -> None:
    for server in servers.values():
        server.stop()


def target_only_outputs(target, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """What every greedy generation of these prompts must return: in-process target-only decoding (`target`: a
    loaded `HybridLM`)."""
    from deltaspec.shared.decoding.speculative import generate

    return [generate(target, p, max_new_tokens).token_ids for p in prompts]


def check_greedy(tokens: list[int], expected: list[int], what: str) -> None:
    if tokens != expected:
        raise AssertionError(f"greedy output differs from target-only decoding ({what})")


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))] if sorted_values else float("nan")
