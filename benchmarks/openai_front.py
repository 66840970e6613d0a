"""The OpenAI-compatible front's cost: the same requests through it and to the target's gRPC `Generate` directly.

`serve-draft`, `serve-target` (speculating with it) and `serve-openai` run as child processes on loopback. For each
concurrency (1, 4, 8), drafts a round (4: speculative; 0: target-only) and path (`grpc`: `deltaspec.Client.stream`;
`openai`: OpenAI's client, streamed, `num_draft_tokens` in the body; `http`: the same request read as raw SSE lines
with the standard library, so the front's cost is seen apart from the SDK's), that many client threads run greedy
generations of the same prompts back to back. Per row: aggregate output tokens/s, median time to first token, and
time per output token per token (a delivery of m tokens g seconds after the one before counts m tokens of g/m; the
embedded pair is byte-level, so a chunk's tokens are its text's UTF-8 bytes; the total is the usage's), p50; and CPU
milliseconds per output token of the front process (idle on `grpc` rows) and of the client threads (this process),
and the front's per request. On a host with few cores every CPU millisecond of the front and the client is taken
from the target, so these say what the wall-clock ratios cost, without the noise of other work on the host.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from benchmarks.loopback import PROMPTS, cpu_seconds, percentile, start_pair, stop_all

LEVELS, KS, PATHS = (1, 4, 8), (4, 0), ("grpc", "openai", "http")
FIELDS = ("path", "k", "concurrency", "tokens", "tokens_per_s", "ttft_ms_p50", "tpot_ms_p50", "front_ms_tok",
          "front_ms_req", "client_ms_tok")


class Front:
    """`deltaspec serve-openai` as a child process on a free loopback port, up once /health answers."""

    def __init__(self, target_address: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "deltaspec.shared.cli", "serve-openai", "--target-addr",
                                      target_address, "--port", "0"], stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        line = ""
        while not line.startswith("listening on"):
            line = self.proc.stderr.readline()  # type: ignore[union-attr]
            if not line:
                raise RuntimeError(f"serve-openai exited with {self.proc.wait()}")
        self.address = line.split()[-1]
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # type: ignore[union-attr]
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://{self.address}/health", timeout=5):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def cpu_s(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def _grpc_client(address: str):
    from deltaspec.shared.client import Client

    return Client(address)


def _grpc_stream(client, prompt: str, n: int, k: int):
    for piece in client.stream(prompt, max_new_tokens=n, num_draft_tokens=k):
        yield len(piece.token_ids)


def _openai_client(address: str):
    import openai

    return openai.OpenAI(base_url=f"http://{address}/v1", api_key="none", max_retries=0)


def _openai_stream(client, prompt: str, n: int, k: int):
    for chunk in client.completions.create(model="deltaspec-embedded", prompt=prompt, max_tokens=n, temperature=0,
                                           stream=True, extra_body={"num_draft_tokens": k}):
        if chunk.choices and chunk.choices[0].text:
            yield len(chunk.choices[0].text.encode())


def _http_client(address: str) -> http.client.HTTPConnection:
    host, port = address.rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port))


def _http_stream(conn: http.client.HTTPConnection, prompt: str, n: int, k: int):
    body = {"model": "deltaspec-embedded", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "num_draft_tokens": k}
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    for line in conn.getresponse():  # read to the end, so the connection is kept for the next request
        if line.startswith(b"data: {"):
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0]["text"]:
                yield len(choices[0]["text"].encode())


PATH_FNS = {"grpc": (_grpc_client, _grpc_stream), "openai": (_openai_client, _openai_stream),
            "http": (_http_client, _http_stream)}


def _own_cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def row(path: str, address: str, k: int, concurrency: int, n: int, generations: int,
        front: Front | None = None) -> dict:
    """`concurrency` threads, `generations` each, of `n` greedy tokens from the shared prompts; each thread keeps one
    client (one channel, one HTTP connection pool), as an application does, so what is timed is the requests.
    `front`: whose CPU time is counted as the front's."""
    opener, stream = PATH_FNS[path]
    first, per_token, counts = [], [], []
    lock = threading.Lock()

    def worker(i: int) -> None:
        client = opener(address)
        for g in range(generations):
            sent = last = time.perf_counter()
            mine_first, mine, total = None, [], 0
            for m in stream(client, PROMPTS[(i + g) % len(PROMPTS)], n, k):
                now = time.perf_counter()
                if mine_first is None:
                    mine_first = now - sent
                else:
                    mine += [(now - last) / m] * m
                last, total = now, total + m
            with lock:
                first.append(mine_first)
                per_token.extend(mine)
                counts.append(total)
        client.close()

    front_cpu, client_cpu = front.cpu_s() if front else 0.0, _own_cpu_s()
    started = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    front_cpu, client_cpu = (front.cpu_s() if front else 0.0) - front_cpu, _own_cpu_s() - client_cpu
    tokens = sum(counts)
    return {"k": k, "concurrency": concurrency, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "ttft_ms_p50": 1000 * statistics.median(first), "tpot_ms_p50": 1000 * percentile(sorted(per_token), 0.5),
            "front_ms_tok": 1000 * front_cpu / tokens, "front_ms_req": 1000 * front_cpu / len(counts),
            "client_ms_tok": 1000 * client_cpu / tokens}


@contextlib.contextmanager
def pair_behind_front(target_dir: Path, draft_dir: Path) -> Iterator[tuple[dict, Front]]:
    """`serve-draft`, a `serve-target` speculating with it and `serve-openai` over the target, stopped on the way
    out."""
    servers = start_pair(target_dir, draft_dir)
    front = None
    try:
        front = Front(servers["target"].address)
        yield servers, front
    finally:
        if front is not None:
            front.stop()
        stop_all(servers)


def openai_front(target_dir: Path, draft_dir: Path, quick: bool) -> list[dict]:
    """Per concurrency and k, the three paths in turn, `repeats` times (each repeat starting from the next path):
    a row per path with the medians of its runs, and the runs themselves (`runs`, paired by repeat for the ratios)."""
    n, generations, repeats = (48, 2, 1) if quick else (96, 4, 3)
    rows = []
    with pair_behind_front(target_dir, draft_dir) as (servers, front):
        for concurrency in LEVELS:
            for k in KS:
                runs: dict[str, list[dict]] = {path: [] for path in PATHS}
                for r in range(repeats):
                    for path in PATHS[r % len(PATHS):] + PATHS[:r % len(PATHS)]:
                        address = servers["target"].address if path == "grpc" else front.address
                        if not r:
                            row(path, address, k, 1, 8, 1)  # warm: connections, the prefix cache's first blocks
                        runs[path].append(row(path, address, k, concurrency, n, generations, front))
                rows += [{"path": path, "k": k, "concurrency": concurrency, "tokens": mine[0]["tokens"],
                          **{f: statistics.median(run[f] for run in mine) for f in FIELDS[4:]}, "runs": mine}
                         for path, mine in runs.items()]
    return rows


def _spread(values: list[float], fmt: str) -> str:
    """The median of paired per-repeat values, with their range when there are several."""
    median = format(statistics.median(values), fmt)
    return median if len(values) == 1 else f"{median} [{format(min(values), fmt)} to {format(max(values), fmt)}]"


def print_rows(rows: list[dict]) -> None:
    print("\nOpenAI front vs gRPC Generate (greedy, embedded pair, streamed; medians of the alternated repeats; ttft "
          "median, tpot per token p50; CPU ms of the front per output token and per request, of the client per output "
          "token)")
    print(" ".join(f"{f:>13}" for f in FIELDS))
    for r in rows:
        print(" ".join(f"{r[f]:>13.{3 if f.endswith('_tok') else 1}f}" if isinstance(r[f], float) else f"{r[f]:>13}"
                       for f in FIELDS))
    runs = {(r["path"], r["k"], r["concurrency"]): r["runs"] for r in rows}

    def paired(path: str, k: int, c: int, than: tuple[str, int], how) -> list[float]:
        return [how(a, b) for a, b in zip(runs[(path, k, c)], runs[(than[0], than[1], c)])]

    def ratio(a: dict, b: dict) -> float:
        return a["tokens_per_s"] / b["tokens_per_s"]

    print("\nfront / gRPC, each repeat's paths paired: tokens/s ratio, median TTFT difference (ms), median [range]; "
          "speculative over target-only, each path")
    for c in LEVELS:
        for k in KS:
            print(f"  concurrency {c}, k {k}: " + "; ".join(
                f"{p} tok/s " + _spread(paired(p, k, c, ("grpc", k), ratio), ".3f") + ", TTFT "
                + _spread(paired(p, k, c, ("grpc", k), lambda a, b: a["ttft_ms_p50"] - b["ttft_ms_p50"]), "+.2f")
                + " ms" for p in PATHS[1:]))
        print(f"  concurrency {c}: speculative / target-only: " + ", ".join(
            f"{p} " + _spread(paired(p, 4, c, (p, 0), ratio), ".2f") + "x" for p in PATHS))
