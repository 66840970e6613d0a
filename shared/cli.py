"""`deltaspec`: the command line. Each subcommand is a thin shell over the engine."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shared.defaults import DEFAULT_DRAFT, DEFAULT_TARGET


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)


def _sampling(args: argparse.Namespace):
    from shared.decoding.sampling import SamplingParams

    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)


def cmd_models(args: argparse.Namespace) -> int:
    paths = {"target": str(DEFAULT_TARGET), "draft": str(DEFAULT_DRAFT)}
    print(json.dumps(paths) if args.json else "\n".join(f"{k}: {v}" for k, v in paths.items()))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from shared.decoding.drafters.model_drafter import ModelDrafter
    from shared.decoding.speculative import generate
    from shared.model.loader import load_model
    from shared.model.tokenizer import load_tokenizer

    target_dir = Path(args.target or DEFAULT_TARGET)
    draft = args.draft if args.draft is not None else (str(DEFAULT_DRAFT) if args.target is None else "none")
    tokenizer = load_tokenizer(target_dir)
    prompt = args.prompt_ids if args.prompt_ids is not None else tokenizer.encode(args.prompt)
    sampling = _sampling(args)
    target = load_model(target_dir)
    drafter = None if draft == "none" else ModelDrafter(load_model(draft), sampling)
    result = generate(target, prompt, args.max_new_tokens, drafter, args.num_draft_tokens, sampling)
    out = result.as_dict()
    out["text"] = tokenizer.decode(result.token_ids)
    if args.json:
        print(json.dumps(out))
    else:
        s = out["stats"]
        print(out["text"])
        print(f"[{len(result.token_ids)} tokens, {s['tokens_per_s']:.1f} tok/s, "
              f"acceptance {s['acceptance_rate']:.2f}, mean accepted length {s['mean_accepted_length']:.2f}]",
              file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from shared.bench import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltaspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text, speculatively when a draft is given")
    p.add_argument("--target", help="target checkpoint directory (default: the embedded target)")
    p.add_argument("--draft", help="draft checkpoint directory or 'none' (default: the embedded draft "
                                   "when the target is the embedded one, else none)")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt")
    prompt.add_argument("--prompt-ids", type=_ids)
    p.add_argument("--max-new-tokens", type=int, default=64)
    _add_sampling(p)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("models", help="paths of the embedded default target and draft")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("demo", help="one generation with the embedded pair and a short report")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="rollback benchmark: this project's strategy against the alternatives")
    p.add_argument("--json", action="store_true")
    p.add_argument("--rounds", type=int, default=40)
    p.set_defaults(func=cmd_bench)
    return parser


def cmd_demo(args: argparse.Namespace) -> int:
    ns = build_parser().parse_args(["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "96"])
    return cmd_generate(ns)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from shared.errors import DeltaspecError
    from shared.model.loader import CheckpointError

    try:
        return args.func(args)
    except (DeltaspecError, CheckpointError, ValueError) as e:
        print(f"deltaspec: error: {e}", file=sys.stderr)
        return 2
