"""`deltaspec`: the command line. Each subcommand is a thin shell over the engine."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deltaspec.shared import demo
from deltaspec.shared.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, EMBEDDED_MODEL_NAME

if TYPE_CHECKING:
    from deltaspec.shared.model.nodes import Placement

FIXED_DRAFT_TOKENS = 4  # k for n-gram and MTP drafting, and the default a gRPC generation asks for


def _lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        lengths = ()
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"--lengths must be comma-separated positive integers, got {text!r}")
    return lengths


def _count(minimum: int):
    """An argparse type: an integer of at least `minimum` (argparse names the flag and the value when it refuses)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {minimum} or more, got {value}")
        return value

    parse.__name__ = "count"  # what argparse calls the type in its messages
    return parse


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds, 0 or more (inf: no limit)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text}")
    return value


_seconds.__name__ = "seconds"  # what argparse calls the type in its messages


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _device(text: str) -> str:
    """A device this machine has: cpu, or cuda[:N] where torch sees that GPU."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise argparse.ArgumentTypeError(f"{text!r}: this machine's torch sees {seen} CUDA device(s)")
    return text


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)


def _sampling(args: argparse.Namespace):
    from deltaspec.shared.decoding.sampling import SamplingParams

    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)


def cmd_models(args: argparse.Namespace) -> int:
    paths = {"target": str(DEFAULT_TARGET), "draft": str(DEFAULT_DRAFT)}
    print(json.dumps(paths) if args.json else "\n".join(f"{k}: {v}" for k, v in paths.items()))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    if args.target_addr and (args.compile or args.capture):
        raise ValueError("--compile and --capture are for generating in process; the services take them: "
                         "serve-target --compile --capture, serve-draft --compile --capture")
    _check_capture(args)
    if args.target_addr and args.device != "cpu":
        raise ValueError("--device is for generating in process; the services take it: serve-target --device, "
                         "serve-draft --device")
    if args.target_addr:
        return _generate_remote(args)
    if args.draft_addr:
        raise ValueError("--draft-addr needs --target-addr")
    from deltaspec.shared.decoding.drafters import make_drafter
    from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
    from deltaspec.shared.decoding.speculative import generate
    from deltaspec.shared.model.loader import load_model
    from deltaspec.shared.model.tokenizer import encode_chat, load_tokenizer
    from deltaspec.shared.state.spec import CHAIN_LOG_CAPACITY
    from deltaspec.shared.telemetry import CLIENT, Telemetry

    target_dir = Path(args.target or DEFAULT_TARGET)
    draft = args.draft if args.draft is not None else (str(DEFAULT_DRAFT) if args.target is None else "none")
    if args.stop:
        raise ValueError("--stop is applied by a target service's Generate: give --target-addr (without --draft-addr)")
    tokenizer = load_tokenizer(target_dir)
    if args.chat:
        prompt = encode_chat(tokenizer, _messages(args))
    else:
        prompt = args.prompt_ids if args.prompt_ids is not None else tokenizer.encode(args.prompt)
    sampling = _sampling(args)
    target = load_model(target_dir, device=args.device).compile(args.compile, warm_up=True).capture(args.capture)
    k, stop_below = draft_settings(args.num_draft_tokens, args.stop_below, draft not in ("none", "mtp", "ngram"))
    drafter = make_drafter(draft, target, sampling, stop_below)
    if isinstance(drafter, ModelDrafter):
        drafter.model.compile(args.compile, warm_up=True, log_capacity=CHAIN_LOG_CAPACITY).capture(args.capture)
    if args.draft_length == "cost" and k and draft != "none":
        from deltaspec.shared.decoding.draft_length import CostModelLength, PassCosts, drafting_cost

        fixed_s, step_s = drafting_cost(target, drafter) or (0.0, 0.0)  # as the drafter runs its rounds
        k = CostModelLength(replace(PassCosts.measure(target, None, k), draft_fixed_s=fixed_s, draft_s=step_s))
    telemetry = Telemetry.from_env(CLIENT)  # spans as OTEL_* say: a root span over the rounds
    try:
        result = generate(target, prompt, args.max_new_tokens, drafter, k, sampling, telemetry.tracer,
                          target_dir.name, tokenizer.eos_token_ids)
    finally:
        telemetry.shutdown()
    _print_generation(result, tokenizer.decode(result.token_ids), args.json)
    return 0


def _messages(args: argparse.Namespace) -> list[dict[str, str]]:
    """`--chat`: the prompt as the one user message of a conversation."""
    if args.prompt is None:
        raise ValueError("--chat sends --prompt as a user message: give --prompt, not --prompt-ids")
    return [{"role": "user", "content": args.prompt}]


def draft_settings(num_draft_tokens: int | None, stop_below: float | None, draft_model: bool) -> tuple[int, float]:
    """(k, stop_below) for an in-process generation: unless given, a draft model proposes up to `MAX_DRAFT_TOKENS`
    a round and stops after a token it gives less than `STOP_BELOW` (the fastest setting measured, at every length
    `deltaspec bench --only generations` runs); other drafters propose exactly `FIXED_DRAFT_TOKENS`."""
    from deltaspec.shared.decoding.drafters.model_drafter import STOP_BELOW
    from deltaspec.shared.decoding.target import MAX_DRAFT_TOKENS

    if num_draft_tokens is None:
        num_draft_tokens = MAX_DRAFT_TOKENS if draft_model else FIXED_DRAFT_TOKENS
    if not 0 <= num_draft_tokens <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--num-draft-tokens is 0 to {MAX_DRAFT_TOKENS} (the target's limit a round), "
                         f"not {num_draft_tokens}")
    if stop_below is None:
        stop_below = STOP_BELOW if draft_model else 0.0
    return num_draft_tokens, stop_below


def _print_generation(result, text: str, as_json: bool) -> None:
    out = result.as_dict()
    out["text"] = text
    if as_json:
        print(json.dumps(out))
    else:
        s = out["stats"]
        print(out["text"])
        print(f"[{len(result.token_ids)} tokens, {s['tokens_per_s']:.1f} tok/s, "
              f"acceptance {s['acceptance_rate']:.2f}, mean accepted length {s['mean_accepted_length']:.2f}]",
              file=sys.stderr)
        print(f"[spec_decode num_drafts {s['drafts']}, num_draft_tokens {s['drafted']}, "
              f"num_accepted_tokens {s['accepted']}, num_accepted_tokens_per_pos {s['accepted_per_position']}, "
              f"commits {s['rounds']}, staged_bytes {s['staged_bytes']}, "
              f"time_to_first_token {s['first_token_seconds'] * 1e3:.1f} ms, "
              f"time_per_output_token {s['time_per_output_token_s'] * 1e3:.1f} ms]", file=sys.stderr)


def _generate_remote(args: argparse.Namespace) -> int:
    """`--target-addr` alone: the server-side loop (Generate); with `--draft-addr`: the loop runs here."""
    import grpc

    from deltaspec.shared.rpc.generation import generate_client_driven, generate_on_server
    from deltaspec.shared.telemetry import CLIENT, Telemetry

    if args.target or args.draft:
        raise ValueError("--target/--draft name local checkpoints; with --target-addr the servers hold the models")
    if args.stop and args.draft_addr:
        raise ValueError("--stop is applied by the target's Generate: leave out --draft-addr to use it")
    security = _client_security(args, "")
    for address in filter(None, (args.target_addr, args.draft_addr)):
        security.check(address)
    messages = _messages(args) if args.chat else None
    prompt = dict(prompt_ids=args.prompt_ids, prompt_text="" if messages else args.prompt or "", messages=messages,
                  max_new_tokens=args.max_new_tokens,
                  num_draft_tokens=FIXED_DRAFT_TOKENS if args.num_draft_tokens is None else args.num_draft_tokens,
                  sampling=_sampling(args), timeout_s=args.timeout, recovery_window_s=args.recovery_window,
                  security=security, telemetry=(telemetry := Telemetry.from_env(CLIENT)))
    try:
        if args.draft_addr:
            result, text = generate_client_driven(args.target_addr, args.draft_addr, **prompt,
                                                  pipeline=not args.no_pipeline)
        else:
            result, text = generate_on_server(args.target_addr, **prompt, stop_strings=args.stop or [])
    except grpc.RpcError as e:
        print(f"deltaspec: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2
    finally:
        telemetry.shutdown()
    _print_generation(result, text, args.json)
    return 0


def _limits(args: argparse.Namespace):
    from deltaspec.shared.decoding.session_table import Limits

    if args.state_memory_mib < 0:
        raise ValueError(f"--state-memory-mib is 0 (sized for --max-sessions) or more, not {args.state_memory_mib}")
    if args.prefix_cache_block < 0:
        raise ValueError(f"--prefix-cache-block is 0 (no prefix cache) or more tokens, not {args.prefix_cache_block}")
    if args.prefix_cache_state_every < 1:
        raise ValueError(f"--prefix-cache-state-every is 1 or more blocks, not {args.prefix_cache_state_every}")
    return Limits(args.max_sessions, args.session_ttl, args.max_prompt_tokens, args.max_sessions_per_caller,
                  int(args.state_memory_mib * 2**20), args.prefix_cache_block, args.prefix_cache_state_every)


PLAINTEXT_RULE = ("Plaintext is allowed without a flag only on loopback (127.0.0.1, ::1, localhost: development); "
                  "any other address needs TLS or --insecure (DELTASPEC_INSECURE=1).")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def _listen(args: argparse.Namespace):
    """Where and how a server listens, from its flags; a placeholder or malformed token or grants file stops it
    here."""
    from deltaspec.shared.rpc.security import Grants, ServerSecurity, ServerTLS, TokenStore
    from deltaspec.shared.rpc.server import Listen

    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_client_ca and not args.tls_cert):
        raise ValueError("TLS needs both --tls-cert and --tls-key (and --tls-client-ca only with them)")
    tls = ServerTLS(Path(args.tls_cert), Path(args.tls_key),
                    Path(args.tls_client_ca) if args.tls_client_ca else None) if args.tls_cert else None
    if args.max_calls_per_second_per_caller < 0:
        raise ValueError(f"--max-calls-per-second-per-caller is 0 (no limit) or more, not "
                         f"{args.max_calls_per_second_per_caller}")
    security = ServerSecurity(tls, TokenStore(args.tokens) if args.tokens else None, args.insecure,
                              args.max_calls_per_second_per_caller, Grants(args.grants) if args.grants else None)
    security.check(args.host)
    return Listen(args.host, args.port, security, args.health_port)


def _client_security(args: argparse.Namespace, prefix: str):
    """How to dial, from the flags `_add_client_security` added under `prefix` ('' or 'draft_')."""
    from deltaspec.shared.rpc.security import ClientSecurity

    def path(name: str) -> Path | None:
        value = getattr(args, prefix + name)
        return Path(value) if value else None

    return ClientSecurity(path("tls_ca"), path("tls_cert"), path("tls_key"),
                          os.environ.get(f"DELTASPEC_{prefix.upper()}TOKEN") or None, path("token_file"),
                          getattr(args, prefix + "tls_server_name"), args.insecure)


def _batching(args: argparse.Namespace):
    from deltaspec.shared.decoding.batcher import BatchConfig

    return BatchConfig(args.max_batch, args.batch_wait_ms, args.prefill_chunk)


def _torch_threads(args: argparse.Namespace) -> None:
    """Intra-op threads for the model's ops; gRPC's worker threads and the other sessions share the same cores."""
    import torch

    if args.torch_threads < 1:
        raise ValueError(f"--torch-threads must be at least 1, got {args.torch_threads}")
    torch.set_num_threads(args.torch_threads)


def cmd_serve_target(args: argparse.Namespace) -> int:
    from deltaspec.shared.model.loader import load_model
    from deltaspec.shared.model.tokenizer import load_tokenizer
    from deltaspec.shared.rpc.server import serve
    from deltaspec.shared.telemetry import TARGET, Telemetry
    from deltaspec.target_service.servicer import DraftPeer, service

    model_dir = Path(args.model or DEFAULT_TARGET)
    placement = _placement(args, model_dir)
    if placement and placement.node_rank:
        from deltaspec.shared.model.nodes import follow_node

        return follow_node(placement, str(model_dir), args.device, args.torch_threads, args.expert_parallel)
    listen = _listen(args)
    _torch_threads(args)
    draft = DraftPeer(args.draft_addr, args.draft_timeout, _client_security(args, "draft_")) if args.draft_addr \
        else None
    if draft:
        draft.security.check(draft.address)
    telemetry = Telemetry.from_env(TARGET)
    if draft and args.draft != "none":
        raise ValueError("serve-target takes --draft-addr or --draft, not both")
    if args.pipeline_depth not in (0, 1):
        raise ValueError(f"--pipeline-depth is 0 or 1, not {args.pipeline_depth}")
    _check_capture(args)
    if placement:
        load, stop = _lead(placement, args, model_dir)
    else:
        load, stop = lambda: load_model(model_dir, device=args.device).compile(args.compile, warm_up=True) \
            .capture(args.capture), lambda: None
    svc = service(lambda: (load(), load_tokenizer(model_dir)), _limits(args),
                  draft, args.advertise_address, telemetry, args.draft, args.pipeline_depth, _batching(args),
                  args.draft_length, model_name(model_dir))
    try:
        return serve([svc], listen, args.grace, telemetry, args.metrics_port)
    finally:
        stop()


def _placement(args: argparse.Namespace, model_dir: Path) -> Placement | None:
    """Where this process's tensor-parallel ranks sit (None: one process, no group): `--tensor-parallel N` over
    `--nnodes`, or torchrun's placement when it started this process (docs/tensor-parallel.md). Checked before
    anything starts: sizes that cannot form a group or shard the checkpoint, and what a group does not mirror yet
    (--compile, --capture). One node meets on a free loopback port unless --master-port is given."""
    import socket

    from deltaspec.shared.model.config import ModelConfig
    from deltaspec.shared.model.nodes import Placement
    from deltaspec.shared.model.parallel import sharded_config

    placement = Placement.from_torchrun(os.environ, args.tensor_parallel)
    if placement and (args.nnodes != 1 or args.node_rank):
        raise ValueError("under torchrun, its own --nnodes and --node-rank place the ranks, not serve-target's")
    if placement is None:
        if args.tensor_parallel == 1 and args.nnodes == 1:
            if args.expert_parallel:
                raise ValueError("--expert-parallel spreads the experts over the ranks of --tensor-parallel N: give "
                                 "N >= 2")
            return None
        if args.nnodes == 1:
            args.master_addr = args.master_addr or "127.0.0.1"
            if not args.master_port:
                with socket.socket() as s:
                    s.bind((args.master_addr, 0))
                    args.master_port = s.getsockname()[1]
        placement = Placement(args.tensor_parallel, args.master_addr or "", args.master_port or 0, args.nnodes,
                              args.node_rank, args.rendezvous_timeout)
    for flag, on in (("--compile", args.compile), ("--capture", args.capture)):
        if on:
            raise ValueError(f"{flag} is not built for --tensor-parallel yet")
    sharded_config(ModelConfig.from_file(model_dir / "config.json"), placement.world,
                   args.expert_parallel)  # does not divide: now
    return placement


def _lead(at: Placement, args: argparse.Namespace, model_dir: Path) -> tuple[Callable[[], Any], Callable[[], None]]:
    """Node 0: its other ranks started here as child processes, and (load, stop) for global rank 0's shard, which
    leads the group (`deltaspec.shared.model.lockstep`)."""
    from deltaspec.shared.model import lockstep
    from deltaspec.shared.model.loader import load_model
    from deltaspec.shared.model.nodes import start_followers
    from deltaspec.shared.model.parallel import shard

    followers = start_followers(at, str(model_dir), args.device, args.torch_threads, args.expert_parallel)
    leaders: list[Any] = []

    def load() -> Any:
        model = load_model(model_dir, device=at.device(0, args.device))
        joined = at.join(0)
        leaders.append(lockstep.Leader(shard(model, joined, args.expert_parallel), joined))
        if followers:  # this node's; another node's rank that is gone breaks the group's next collective
            leaders[0].watch(followers)
        print(f"tensor parallel: rank 0 of {at.world} leads", file=sys.stderr, flush=True)
        return leaders[0].model

    def stop() -> None:
        if leaders:
            leaders[0].stop()
        for p in followers:
            p.join(10)
            if p.is_alive():
                p.kill()
    return load, stop


def model_name(model_dir: Path) -> str:
    """What the target calls its model (GetModel, /v1/models): the checkpoint folder's name, the embedded one's
    `EMBEDDED_MODEL_NAME` (its folder is just `target`)."""
    return EMBEDDED_MODEL_NAME if model_dir.resolve() == DEFAULT_TARGET.resolve() else model_dir.name


def cmd_serve_draft(args: argparse.Namespace) -> int:
    from deltaspec.draft_service.servicer import service
    from deltaspec.shared.model.loader import load_model
    from deltaspec.shared.rpc.server import serve
    from deltaspec.shared.state.spec import CHAIN_LOG_CAPACITY
    from deltaspec.shared.telemetry import DRAFT, Telemetry

    model_dir = Path(args.model or DEFAULT_DRAFT)
    if args.branches < 0:
        raise ValueError(f"--branches is 0 (none) or more, not {args.branches}")
    listen = _listen(args)
    _torch_threads(args)
    telemetry = Telemetry.from_env(DRAFT)
    _check_capture(args)
    svc = service(lambda: load_model(model_dir, device=args.device).compile(args.compile, warm_up=True,
                                                                             log_capacity=CHAIN_LOG_CAPACITY)
                  .capture(args.capture),
                  _limits(args), telemetry, _batching(args), args.stop_below, args.branches)
    return serve([svc], listen, args.grace, telemetry, args.metrics_port)


def cmd_serve_openai(args: argparse.Namespace) -> int:
    """The OpenAI-compatible HTTP front over a target (`--target-addr`), or over the embedded pair served here
    (`--embedded`)."""
    from deltaspec.openai_service.app import Settings, serve
    from deltaspec.shared.rpc.security import check_token, is_loopback
    from deltaspec.shared.telemetry import OPENAI, Telemetry

    if bool(args.target_addr) == args.embedded:
        raise ValueError("serve-openai takes --target-addr HOST:PORT, or --embedded to serve the embedded pair here")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("HTTPS needs both --tls-cert and --tls-key")
    if not (args.tls_cert or args.insecure or is_loopback(args.host)):
        raise ValueError(f"refusing to serve plain HTTP on {args.host}: give --tls-cert and --tls-key, or --insecure "
                         "(behind a proxy that terminates TLS)")
    from deltaspec.shared.decoding.target import MAX_DRAFT_TOKENS

    if args.num_draft_tokens > MAX_DRAFT_TOKENS:
        raise ValueError(f"--num-draft-tokens is 0 to {MAX_DRAFT_TOKENS}, not {args.num_draft_tokens}")
    if args.api_key:
        check_token(args.api_key, "--api-key")
    tls = (args.tls_cert, args.tls_key) if args.tls_cert else None

    def settings(target_addr: str, security) -> Settings:
        return Settings(target_addr, security, args.api_key or None, args.served_model_name, args.num_draft_tokens,
                        args.timeout, args.recovery_window, Telemetry.from_env(OPENAI))

    if args.embedded:
        demo.quiet_grpc()
        with demo.embedded_pair() as (_, target):
            return serve(settings(target.address, _client_security(args, "target_")), args.host, args.port, tls)
    security = _client_security(args, "target_")
    security.check(args.target_addr)
    return serve(settings(args.target_addr, security), args.host, args.port, tls)


COMPILE_HELP = ("run the model's decode and verify passes as torch.compile (Inductor) graphs, faster passes "
                "(`deltaspec bench --only compiled`), compiled at start-up (up to a minute or two per model on a "
                "CPU the first time, seconds once Inductor's cache under /tmp has them; needs a C++ compiler on a "
                "CPU)")

CAPTURE_HELP = ("replay decode and verify passes (up to 17 tokens) as CUDA graphs, each recorded on its first pass "
                "(docs/gpu.md); with --device cuda")


def _check_capture(args: argparse.Namespace) -> None:
    if args.capture and args.device == "cpu":
        raise ValueError("--capture records CUDA graphs: give --device cuda (on a CPU, --compile is what cuts a "
                         "pass's overhead)")


def _add_server(p: argparse.ArgumentParser, model: str) -> None:
    p.add_argument("--model", help=f"checkpoint directory (default: the embedded {model})")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True, help="0 picks a free port (printed on stderr)")
    p.add_argument("--device", type=_device, default="cpu",
                   help="where the model and its sessions' state live: cpu, cuda, cuda:N")
    p.add_argument("--max-sessions", type=int, default=64)
    p.add_argument("--session-ttl", type=float, default=600.0, help="seconds an idle session is kept")
    p.add_argument("--max-prompt-tokens", type=int, default=8192)
    p.add_argument("--grace", type=float, default=10.0, help="seconds in-flight calls get on SIGTERM")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (0 picks one, printed "
                                                    "on stderr; default: no metrics endpoint)")
    p.add_argument("--torch-threads", type=int, default=int(os.environ.get("DELTASPEC_TORCH_THREADS", "1")),
                   help="torch intra-op threads (default: $DELTASPEC_TORCH_THREADS, else 1: concurrent sessions "
                        "already keep the cores busy, and more threads per op only contend; see `deltaspec bench "
                        "--only load`)")
    batch = p.add_argument_group("batching", "Forward passes of concurrent sessions run as one batch on a "
                                 "scheduler thread; each session's rounds, versions and outputs are unchanged.")
    batch.add_argument("--max-batch", type=int, default=8, help="most sessions in one forward pass (1: no batching)")
    batch.add_argument("--batch-wait-ms", type=float, default=2.0,
                       help="longest a pass waits for others to join; it starts at once when every session that "
                            "called in the last 0.2 s is waiting")
    batch.add_argument("--prefill-chunk", type=int, default=64,
                       help="prompt tokens per batch: a long prompt is prefilled in pieces between other sessions' "
                            "rounds")
    p.add_argument("--max-sessions-per-caller", type=int, default=0,
                   help="sessions one caller (token name, client certificate, or 'anonymous') may hold open; "
                        "0: only --max-sessions bounds it")
    p.add_argument("--max-calls-per-second-per-caller", type=float, default=0,
                   help="calls a second one caller may make on average (bursts of one second's worth); a call over "
                        "it is refused RESOURCE_EXHAUSTED with RetryInfo. Health checks are not counted; a target's "
                        "calls to its draft count against the target there (2-3 a round a session). 0: no limit")
    p.add_argument("--state-memory-mib", type=float, default=0,
                   help="memory for session state: every session's GDN state (preallocated slots: state, spare, "
                        "mark snapshot, conv windows, round logs; constant per session) and attention K/V (grows "
                        "with context, paid at admission for the prompt plus headroom and on growth). A new session "
                        "or a growth it cannot cover is refused RESOURCE_EXHAUSTED, never an out-of-memory; 0 "
                        "(default): room for --max-sessions sessions of max(4096, 2 x --max-prompt-tokens) positions "
                        "each (`deltaspec bench --only sessions` shows MiB per session by context)")
    p.add_argument("--prefix-cache-block", type=int, default=16,
                   help="tokens per prefix cache entry: a new session resumes from the longest run of whole blocks "
                        "it shares with a sequence seen before (committed GDN states, conv windows and K/V, paid "
                        "from --state-memory-mib and evicted before a session is refused) and prefills only the "
                        "rest; 0: no prefix cache (docs/prefix-cache.md)")
    p.add_argument("--prefix-cache-state-every", type=int, default=1,
                   help="blocks between the GDN states the prefix cache keeps (K/V is kept at every block, a state "
                        "also at the end of each cached sequence and where cached sequences part): 1 (default) keeps "
                        "every block's; more saves a big model's memory (a state is the same size whatever the block: "
                        "61 MiB at the Qwen3.5-35B-A3B shape), a sequence resuming at the deepest block with a state")
    env = os.environ.get
    tls = p.add_argument_group("TLS and authentication", PLAINTEXT_RULE + " Each caller sees only its own sessions.")
    tls.add_argument("--tls-cert", default=env("DELTASPEC_TLS_CERT"),
                     help="PEM certificate chain: serve TLS (default: $DELTASPEC_TLS_CERT); the files are read "
                          "again when they change, for new connections, without a restart")
    tls.add_argument("--tls-key", default=env("DELTASPEC_TLS_KEY"), help="PEM private key (default: $DELTASPEC_TLS_KEY)")
    tls.add_argument("--tls-client-ca", default=env("DELTASPEC_TLS_CLIENT_CA"),
                     help="PEM CA bundle: mutual TLS, refusing clients without a certificate it signed "
                          "(default: $DELTASPEC_TLS_CLIENT_CA)")
    tls.add_argument("--tokens", default=env("DELTASPEC_TOKENS"),
                     help="bearer tokens callers must send (authorization: Bearer ...): a file of 'name:token' "
                          "or 'token' lines, or a directory of files named for their caller (a mounted Kubernetes "
                          "Secret); read again when it changes; health and reflection stay open "
                          "(default: $DELTASPEC_TOKENS; none: no token needed)")
    tls.add_argument("--grants", default=env("DELTASPEC_GRANTS"),
                     help="the methods each caller may call: a file of 'caller: Method, Method' lines ('*' for every "
                          "method; a '*' caller for those not listed, who otherwise may call every method); a call "
                          "outside them is refused PERMISSION_DENIED; read again when it changes "
                          "(default: $DELTASPEC_GRANTS; none: every caller may call every method)")
    tls.add_argument("--insecure", action="store_true", default=_env_flag("DELTASPEC_INSECURE"),
                     help="allow plaintext on a non-loopback address (default: $DELTASPEC_INSECURE=1)")
    p.add_argument("--health-port", type=int, default=int(env("DELTASPEC_HEALTH_PORT", "0")) or None,
                   help="also answer grpc.health.v1 (only) in plaintext on this port, for probes that cannot "
                        "speak TLS, such as Kubernetes' (default: $DELTASPEC_HEALTH_PORT; none)")


def _add_client_security(p: argparse.ArgumentParser, prefix: str, peer: str):
    """--[prefix]tls-ca, --[prefix]tls-cert, --[prefix]tls-key, --[prefix]tls-server-name, --[prefix]token-file,
    each defaulting to $DELTASPEC_[PREFIX]..., for dialling `peer`."""
    env_prefix = f"DELTASPEC_{prefix.upper().replace('-', '_')}"
    g = p.add_argument_group(f"TLS and authentication to the {peer}",
                             f"{PLAINTEXT_RULE} The token may also be given as ${env_prefix}TOKEN.")
    for name, what in (("tls-ca", "PEM CA bundle the server's certificate must chain to: dial with TLS"),
                       ("tls-cert", "PEM client certificate for mutual TLS (implies TLS with the system roots "
                                    "when no CA is given)"),
                       ("tls-key", "PEM key of the client certificate"),
                       ("tls-server-name", "the name the server's certificate must carry, when not the dialled host"),
                       ("token-file", "file holding the bearer token sent with every call (read again when it "
                                      "changes)")):
        var = env_prefix + name.upper().replace("-", "_")
        g.add_argument(f"--{prefix}{name}", default=os.environ.get(var), help=f"{what} (default: ${var})")
    return g


BENCHMARKS_FROM_A_CHECKOUT = ("`deltaspec {command}` runs from a source checkout only (the benchmarks are not "
                              "installed): git clone the deltaspec repository, then in it `make setup && "
                              ".venv/bin/deltaspec {command}` (`make bench` for the bench)")


def _checkout_benchmarks() -> Path | None:
    """The benchmarks/ folder of the source checkout this package runs from, or None (an installed wheel). The
    editable install maps `deltaspec.shared` to <checkout>/shared, so <checkout> is two folders above this file."""
    found = Path(__file__).resolve().parents[1] / "benchmarks"
    return found if (found / "__init__.py").is_file() else None


def cmd_benchmarks(args: argparse.Namespace) -> int:
    """bench, study and soak: only dispatched from here. Their code lives in the checkout's benchmarks/ package,
    imported here and nowhere else in the installed package (on sys.path only for these commands)."""
    folder = _checkout_benchmarks()
    if folder is None:
        print(f"deltaspec: error: {BENCHMARKS_FROM_A_CHECKOUT.format(command=args.command)}", file=sys.stderr)
        return 2
    if str(folder.parent) not in sys.path:
        sys.path.insert(0, str(folder.parent))
    from benchmarks.cli import COMMANDS

    return COMMANDS[args.command](args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltaspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text, speculatively when a draft is given")
    p.add_argument("--target", help="target checkpoint directory (default: the embedded target)")
    p.add_argument("--draft", help="draft checkpoint directory, 'mtp' (the target's own MTP head), 'ngram' "
                                   "(prompt lookup) or 'none' (default: the embedded draft "
                                   "when the target is the embedded one, else none)")
    p.add_argument("--num-draft-tokens", type=_count(0),
                   help="drafts a round, at most, 0 to 16 (0: no speculation; default: 16 with a draft model in process, where --stop-below "
                        f"ends a round early; {FIXED_DRAFT_TOKENS} with mtp, ngram or over gRPC)")
    p.add_argument("--stop-below", type=float,
                   help="dynamic draft length: a draft model stops proposing after a token it gives less than this "
                        "probability (exact: the decision reads only the draft; 0: always k; default 0.3 in process, "
                        "measured best with k up to 16; over gRPC the draft service's --stop-below decides)")
    p.add_argument("--draft-length", choices=["fixed", "cost"], default="fixed",
                   help="in process: 'cost' picks k per round (0 to --num-draft-tokens) from the target's pass "
                        "costs and the drafter's, measured at start-up, and the acceptance seen so far, where a round "
                        "of k would not pay, k = 0 (docs/drafters.md); 'fixed': up to --num-draft-tokens every round")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt")
    prompt.add_argument("--prompt-ids", type=_ids)
    p.add_argument("--chat", action="store_true",
                   help="send --prompt as one user message, rendered with the target checkpoint's chat template")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="with --target-addr: end where the text first contains TEXT (repeatable; the text stops "
                        "before it)")
    p.add_argument("--max-new-tokens", type=_count(1), default=64)
    _add_sampling(p)
    p.add_argument("--compile", action="store_true", help=COMPILE_HELP + " (in process: the target and a draft model)")
    p.add_argument("--capture", action="store_true", help=CAPTURE_HELP + " (in process: the target and a draft model)")
    p.add_argument("--device", type=_device, default="cpu",
                   help="in process: where both models and their state live (cpu, cuda, cuda:N)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.add_argument("--target-addr", help="HOST:PORT of a target service: generate there instead of in process")
    p.add_argument("--draft-addr", help="HOST:PORT of a draft service: drive the loop from here (with --target-addr)")
    p.add_argument("--timeout", type=float, help="deadline in seconds for the whole generation over gRPC")
    p.add_argument("--recovery-window", type=_seconds, metavar="SECONDS",
                   help="with --target-addr: how long a target that is gone, restarting or still loading its model is "
                        "waited for (its health watched between tries) before the generation fails UNAVAILABLE "
                        "(default: until --timeout, or 300 s without one)")
    p.add_argument("--no-pipeline", action="store_true",
                   help="with --draft-addr: serial rounds (default: the draft proposes round r+1 while the target "
                        "verifies round r)")
    _add_client_security(p, "", "services").add_argument(
        "--insecure", action="store_true", default=_env_flag("DELTASPEC_INSECURE"),
        help="allow plaintext to a non-loopback address (default: $DELTASPEC_INSECURE=1)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve-target", help="serve the target model (TargetService) over gRPC")
    _add_server(p, "target")
    p.add_argument("--draft-addr", help="HOST:PORT of the draft service the Generate loop speculates with")
    p.add_argument("--draft", choices=["none", "ngram", "mtp"], default="none",
                   help="draft inside this process instead: n-gram lookup, or the checkpoint's own MTP head")
    p.add_argument("--pipeline-depth", type=int, default=1,
                   help="pipelined rounds a session may stage on top of its pending round (0 or 1; 0: serial "
                        "rounds only: Generate's own loop and clients)")
    p.add_argument("--compile", action="store_true", help=COMPILE_HELP)
    p.add_argument("--capture", action="store_true", help=CAPTURE_HELP)
    p.add_argument("--draft-length", choices=["fixed", "cost"], default="fixed",
                   help="Generate's drafts a round: 'cost' picks k per round (0 to the request's num_draft_tokens, "
                        "at most 8) from this server's pass costs, measured at start-up at each batch size, the batch "
                        "the round joins and the session's acceptance (docs/drafters.md), pipelined rounds counted as "
                        "they overlap. "
                        "'fixed': num_draft_tokens every round")
    p.add_argument("--draft-timeout", type=float, default=1.0,
                   help="seconds one draft proposal may take before the round goes on without it")
    tp = p.add_argument_group("tensor parallelism", "One model sharded over N ranks (torch.distributed: gloo on "
                              "CPUs, NCCL on GPUs), on one host or over several nodes, torchrun-style: each node "
                              "runs serve-target with the same N and --nnodes and its own --node-rank; global rank "
                              "0 (node 0) serves gRPC, every other node only follows it. Started by torchrun, "
                              "each process is one rank, RANK of WORLD_SIZE on GPU LOCAL_RANK "
                              "(docs/tensor-parallel.md)")
    tp.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                    help="ranks in all; each node runs N / --nnodes of them (a node's i-th on its GPU i); each caches "
                         "its shard of the prefix cache")
    tp.add_argument("--expert-parallel", action="store_true",
                    help="spread a mixture-of-experts target's routed experts over the ranks whole (E/N each) instead "
                         "of cutting every expert's columns N ways; N must divide the experts")
    tp.add_argument("--nnodes", type=_count(1), default=1, help="nodes the N ranks run on (default 1: this host)")
    tp.add_argument("--node-rank", type=_count(0), default=0,
                    help="this node's place, 0 to --nnodes - 1 (0: rank 0, which serves)")
    tp.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"),
                    help="node 0's address, where the ranks meet (default: $MASTER_ADDR; one node: loopback)")
    tp.add_argument("--master-port", type=_count(1), default=os.environ.get("MASTER_PORT"),
                    help="a free port on node 0 where the ranks meet (default: $MASTER_PORT; one node: a free one)")
    tp.add_argument("--rendezvous-timeout", type=_seconds, metavar="SECONDS",
                    help="how long a rank waits at start for all N to meet before it fails (default: 600 over "
                         "several nodes, which start apart; 60 on one)")
    p.add_argument("--advertise-address", default=os.environ.get("DELTASPEC_ADVERTISE_ADDRESS", ""),
                   help="this replica's stable HOST:PORT, returned by CreateSession so clients send a session's "
                        "later calls to the replica that holds it (default: $DELTASPEC_ADVERTISE_ADDRESS; "
                        "empty: clients keep the address they dialled)")
    _add_client_security(p, "draft-", "draft service (--draft-addr); --insecure covers it too")
    p.set_defaults(func=cmd_serve_target)

    p = sub.add_parser("serve-draft", help="serve the draft model (DraftService) over gRPC")
    _add_server(p, "draft")
    p.add_argument("--compile", action="store_true", help=COMPILE_HELP)
    p.add_argument("--capture", action="store_true", help=CAPTURE_HELP)
    p.add_argument("--stop-below", type=float, default=0.0,
                   help="dynamic draft length: a draft model stops proposing after a token it gives less than this "
                        "probability (exact: the decision reads only the draft; 0: always k; 0.3 measured best with "
                        "k up to 16)")
    p.add_argument("--branches", type=int, default=0,
                   help="pipelined rounds: in idle time, stage the next round for up to this many likely misses of "
                        "the open round, so the proposal after such a miss needs no forward pass (default 0: none; the "
                        "session's acceptance decides how many, round(k x (1 - share of drafts kept)))")
    p.set_defaults(func=cmd_serve_draft)

    p = sub.add_parser("serve-openai", help="an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                                            "/v1/models) over a target service, or over the embedded pair")
    p.add_argument("--target-addr", help="HOST:PORT of the target service")
    p.add_argument("--embedded", action="store_true",
                   help="serve the embedded pair's draft and target here on loopback, and the API over them: an "
                        "OpenAI endpoint in one step (completions; the pair has no chat template, so chat is a 400)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0 picks a free one, printed on stderr)")
    p.add_argument("--api-key", default=os.environ.get("DELTASPEC_OPENAI_API_KEY"),
                   help="the key every /v1 request must send as Authorization: Bearer <key> (401 otherwise; "
                        "/health and /metrics stay open) (default: $DELTASPEC_OPENAI_API_KEY; none: no key)")
    p.add_argument("--served-model-name", help="the model's name on /v1/models and in requests (default: the "
                                               "target's: its checkpoint folder's name, deltaspec-embedded for the "
                                               "embedded pair)")
    p.add_argument("--num-draft-tokens", type=_count(0), default=FIXED_DRAFT_TOKENS,
                   help="drafts a round the target's loop runs with (0: target-only; a request's num_draft_tokens "
                        "field overrides it)")
    p.add_argument("--timeout", type=_seconds, help="deadline in seconds for each generation (default: none)")
    p.add_argument("--recovery-window", type=_seconds, metavar="SECONDS",
                   help="how long a target that is gone, restarting or still loading is waited for before a request "
                        "fails 503 (default: until --timeout, or 300 s without one)")
    env = os.environ.get
    p.add_argument("--tls-cert", default=env("DELTASPEC_TLS_CERT"), help="PEM certificate chain: serve HTTPS "
                   "(default: $DELTASPEC_TLS_CERT)")
    p.add_argument("--tls-key", default=env("DELTASPEC_TLS_KEY"), help="PEM private key (default: $DELTASPEC_TLS_KEY)")
    _add_client_security(p, "target-", "target service").add_argument(
        "--insecure", action="store_true", default=_env_flag("DELTASPEC_INSECURE"),
        help="allow plain HTTP on a non-loopback host (TLS terminated in front of it) and plaintext gRPC to a "
             "non-loopback target (default: $DELTASPEC_INSECURE=1)")
    p.set_defaults(func=cmd_serve_openai)

    p = sub.add_parser("models", help="paths of the embedded default target and draft")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("demo", help="serve the embedded pair on loopback and stream one generation over gRPC")
    p.add_argument("--prompt", default=demo.PROMPT)
    p.add_argument("--max-new-tokens", type=_count(1), default=demo.MAX_NEW_TOKENS)
    p.add_argument("--num-draft-tokens", "-k", type=_count(0), default=demo.NUM_DRAFT_TOKENS)
    _add_sampling(p)
    p.set_defaults(func=cmd_demo, temperature=demo.TEMPERATURE, top_p=demo.TOP_P, seed=demo.SEED)

    p = sub.add_parser("bench", help="speed-up, gRPC overhead, HF comparison, rollback strategies, memory-bound ratio")
    p.add_argument("--quick", action="store_true", help="fewer prompts, k values and rounds (a couple of minutes)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--lengths", type=_lengths, help="new tokens of the long generations (default 96,384,1024; quick 96,384)")
    p.add_argument("--prompts", type=int, help="held-out prompts per length (default 5; quick 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadiest on a shared 2-core machine)")
    p.add_argument("--only", type=lambda text: tuple(x.strip() for x in text.split(",") if x.strip()),
                   help="comma-separated sections to run: steps, acceptance, generations, grpc, tracing, rollback, "
                        "memory, pipeline, load, sessions, moe, cost_model, prefix, compiled, gpu, openai "
                        "(default: all; benchmarks/results/bench.txt and docs/figures/bench.png are written by full "
                        "runs only)")
    p.set_defaults(func=cmd_benchmarks)

    p = sub.add_parser("study", help="no-GDN-rollback study: divergence and state error, plots under docs/figures/ "
                                     "(benchmark-only strategy)")
    p.add_argument("--quick", action="store_true", help="3 prompts, k in (2, 4), 48 tokens (a few minutes)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="directory for the PNG plots and the JSON (default: the repository's docs/figures/ "
                                  "and benchmarks/results/)")
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_benchmarks)

    p = sub.add_parser("soak", help="concurrent sessions for a fixed time against serve-target and serve-draft "
                                    "processes on loopback, both loops, greedy and sampled: errors, round times, RSS")
    p.add_argument("--sessions", type=int, default=64, help="concurrent sessions (worker threads)")
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--report-every", type=float, default=30.0, help="seconds between report lines")
    p.add_argument("--target", help="target checkpoint directory (default: the embedded target)")
    p.add_argument("--draft", help="draft checkpoint directory (default: the embedded draft)")
    p.add_argument("--max-new-tokens", type=_count(1), default=32)
    p.add_argument("--num-draft-tokens", type=_count(0), default=4)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line at the end")
    p.set_defaults(func=cmd_benchmarks)
    return parser


def cmd_demo(args: argparse.Namespace) -> int:
    """Both services on free loopback ports, one streamed generation through the target's loop, a report."""
    return demo.run(args.prompt, args.max_new_tokens, _sampling(args), args.num_draft_tokens)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log = logging.getLogger("deltaspec")  # what the loader and the services log (a skipped vision tower, TLS reloads)
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("deltaspec: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    from deltaspec.shared.errors import DeltaspecError
    from deltaspec.shared.model.loader import CheckpointError

    try:
        return args.func(args)
    except (DeltaspecError, CheckpointError, ValueError, ConnectionError) as e:
        print(f"deltaspec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
