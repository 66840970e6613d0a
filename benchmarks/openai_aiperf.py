"""AIPerf, NVIDIA's OpenAI load generator, against the OpenAI front, beside the bench's own client
(`deltaspec bench --only aiperf`).

AIPerf runs in an environment of its own (its pins are not deltaspec's), found as `$DELTASPEC_AIPERF` or `aiperf` on
the PATH:

    python -m venv ~/aiperf && ~/aiperf/bin/pip install aiperf
    DELTASPEC_AIPERF=~/aiperf/bin/aiperf deltaspec bench --only aiperf

It runs offline: the embedded pair is byte-level, so its tokenizer is written as a `tokenizer.json` whose ids are the
UTF-8 bytes (what `ByteTokenizer` does), and the requests are the prompts the bench's own client just sent (the same
ones, as many times: a speculative row's speed depends on the prompts' acceptance) as a `single_turn` dataset read in
order, no warm-up of AIPerf's own (the bench's client warmed the front), greedy, `max_tokens` n with `ignore_eos`,
`num_draft_tokens` k in the body; output tokens are counted from the usage the front reports
(`--use-server-token-count`), not re-tokenised (the pair can write bytes that are not UTF-8). For each concurrency and
k, the bench's raw-SSE client (`openai_front.row`, path `http`) and then AIPerf send the same requests to the same
front; the rows give each one's output tokens/s, median time to first token and median
time per output token (ours: per token, a chunk of m tokens counting m gaps of a m-th; AIPerf's inter-token latency:
per request, (latency - TTFT) / (tokens - 1), then its median over requests), and the client's CPU milliseconds per
output token (ours: its threads; AIPerf: its processes, start-up included), which on a host with few
cores is taken from the target.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from tokenizers import Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel

from benchmarks.loopback import PROMPTS
from benchmarks.openai_front import KS, LEVELS, pair_behind_front, row

FIELDS = ("client", "k", "concurrency", "requests", "tokens_per_s", "ttft_ms_p50", "tpot_ms_p50", "client_ms_tok")


def aiperf_executable() -> str:
    found = os.environ.get("DELTASPEC_AIPERF") or shutil.which("aiperf")
    if not found:
        raise RuntimeError("AIPerf not found: install it in its own environment (python -m venv ~/aiperf && "
                           "~/aiperf/bin/pip install aiperf) and set DELTASPEC_AIPERF=~/aiperf/bin/aiperf")
    return found


def byte_tokenizer(directory: Path, eos: str = "<|endoftext|>") -> Path:
    """The embedded pair's tokenizer for HF's `AutoTokenizer`: id b is the byte b (GPT-2's byte-to-character map, no
    merges), the end of sequence 256."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    tokenizer = Tokenizer(models.BPE(vocab={char[b]: b for b in range(256)} | {eos: 256}, merges=[]))
    tokenizer.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([eos])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "model_max_length": 4096}))
    return directory


def _served_model(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/v1/models", timeout=10) as response:
        return json.load(response)["data"][0]["id"]


def aiperf_row(exe: str, address: str, tokenizer: Path, prompts: list[str], out: Path, k: int, concurrency: int,
               n: int) -> dict:
    """One AIPerf run at `concurrency` of one streamed completion per prompt, sent in order (the front is warm)."""
    out.mkdir(parents=True)
    dataset = out / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"text": p}) + "\n" for p in prompts))
    args = [exe, "profile", "--model", _served_model(address), "--url", f"http://{address}",
            "--endpoint-type", "completions", "--streaming", "--tokenizer", str(tokenizer), "--input-file",
            str(dataset), "--custom-dataset-type", "single_turn", "--dataset-sampling-strategy", "sequential",
            "--concurrency", str(concurrency), "--request-count", str(len(prompts)), "--use-server-token-count",
            "--extra-inputs", f"max_tokens:{n}", "--extra-inputs", "ignore_eos:true", "--extra-inputs",
            "temperature:0", "--extra-inputs", f"num_draft_tokens:{k}", "--output-artifact-dir", str(out),
            "--random-seed", "1", "--ui-type", "none"]
    before = _children_cpu_s()
    done = subprocess.run(args, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"aiperf exited with {done.returncode}: {done.stderr[-2000:] or done.stdout[-2000:]}")
    got = json.loads((out / "profile_export_aiperf.json").read_text())
    tokens = got["total_output_tokens"]["avg"]
    return {"requests": int(got["request_count"]["avg"]), "tokens_per_s": got["output_token_throughput"]["avg"],
            "ttft_ms_p50": got["time_to_first_token"]["p50"], "tpot_ms_p50": got["inter_token_latency"]["p50"],
            "client_ms_tok": 1000 * (_children_cpu_s() - before) / tokens}


def _children_cpu_s() -> float:
    """CPU seconds of the finished child processes (AIPerf and its workers, warm-up and start-up included)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def aiperf_rows(target_dir: Path, draft_dir: Path, quick: bool) -> list[dict]:
    exe = aiperf_executable()
    n, generations = (48, 2) if quick else (96, 4)
    rows = []
    with pair_behind_front(target_dir, draft_dir) as (_, front, _), tempfile.TemporaryDirectory() as tmp:
        tokenizer = byte_tokenizer(Path(tmp) / "tokenizer")
        for concurrency in LEVELS:
            for k in KS:
                row("http", front.address, k, 1, 8, 1)  # warm
                ours = row("http", front.address, k, concurrency, n, generations)
                rows.append({"client": "bench", "k": k, "concurrency": concurrency,
                             "requests": concurrency * generations, **{f: ours[f] for f in FIELDS[4:]}})
                # the prompts `row` sent (thread i's g-th generation), so acceptance is the same
                prompts = [PROMPTS[(i + g) % len(PROMPTS)] for i in range(concurrency) for g in range(generations)]
                theirs = aiperf_row(exe, front.address, tokenizer, prompts, Path(tmp) / f"run-{concurrency}-{k}", k,
                                    concurrency, n)
                rows.append({"client": "aiperf", "k": k, "concurrency": concurrency, **theirs})
    return rows


def print_rows(rows: list[dict]) -> None:
    print("\nAIPerf and the bench's raw-SSE client against the same OpenAI front (greedy, embedded pair, streamed; "
          "TTFT and time per output token p50; the client's CPU ms per output token)")
    print(" ".join(f"{f:>13}" for f in FIELDS))
    for r in rows:
        print(" ".join(f"{r[f]:>13.{3 if f.endswith('_tok') else 2}f}" if isinstance(r[f], float) else f"{r[f]:>13}"
                       for f in FIELDS))
    by = {(r["client"], r["k"], r["concurrency"]): r for r in rows}
    print("\nAIPerf / bench: tokens/s, TTFT, time per output token; speculative over target-only, each client")
    for c in LEVELS:
        for k in KS:
            a, b = by[("aiperf", k, c)], by[("bench", k, c)]
            print(f"  concurrency {c}, k {k}: tok/s {a['tokens_per_s'] / b['tokens_per_s']:.3f}, TTFT "
                  f"{a['ttft_ms_p50'] / b['ttft_ms_p50']:.3f}, TPOT {a['tpot_ms_p50'] / b['tpot_ms_p50']:.3f}")
        print(f"  concurrency {c}: speculative / target-only: " + ", ".join(
            f"{client} {by[(client, 4, c)]['tokens_per_s'] / by[(client, 0, c)]['tokens_per_s']:.2f}x"
            for client in ("bench", "aiperf")))
