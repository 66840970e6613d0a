"""Train the embedded default pair: a byte-level Qwen3.5 hybrid target (with an MTP head) and a cheap draft.

    .venv/bin/python scripts/train_default_pair.py --state /tmp/pair.pt   # trains, writes, measures
    .venv/bin/python scripts/train_default_pair.py --state /tmp/pair.pt --chunk-steps 500   # in chunks
    .venv/bin/python scripts/train_default_pair.py --eval-only  # re-measures the shipped pair
    .venv/bin/python scripts/train_default_pair.py --refine-draft --kl-weight 0.8  # the draft further
    .venv/bin/python scripts/train_default_pair.py --onpolicy-draft --kl-weight 0.8  # then on the target's output

Budget. 6000 steps took 72 minutes on one CPU thread of a busy 2-core machine (a tqdm bar shows the rate and
the time left), then under a minute of measuring. The shipped pair is such a run; the one before it (3000
steps, 38 minutes) had greedy acceptance 0.69 at k = 4 against 0.79, held-out loss 1.22 against 1.13.
`--refine-draft` then trains the written draft alone against the written target (3000 + 600 steps, about 20
minutes): the draft trained online alongside the target learnt from a moving teacher, and more steps against
the final one, weighted towards it (`--kl-weight 0.8`), lift its top-1 agreement with the target on held-out
text from 0.79 to 0.82. `--onpolicy-draft` then trains it on what it meets when serving: the target's own
continuations (greedy, and sampled at the demo's settings) of 1280 training windows, 192 and 448 bytes long,
make 80 % of 3000 batches, 1280-byte corpus windows 10 %, 384-byte ones the rest (22 minutes here; the run
reproduced the shipped weights bit for bit). A pipelined round is kept only when all its drafts and the
guessed next token hold, so what counts is the draft's agreement along the target's own output, not on corpus
text: on held-out prompts (8 x 96 and 6 x 256 tokens) 76.6 % of greedy rounds could be kept against 67.4 %,
greedy acceptance at k = 4 rose from 0.81 to 0.86, while top-1 agreement on held-out corpus text moved from
0.817 to 0.824. The shipped draft is the 6000 + 600-step run's, refined once, then trained on-policy once.
With `--state FILE` a snapshot (models, optimisers, data sampler, loss history) is written every
`--save-every` steps and at the end; the same command resumes from it, after an interruption or after
`--chunk-steps N` stopped it on purpose, and a run resumed in chunks sees the same batches and learning-rate
schedule as one run straight through. A snapshot at the last step goes straight to measuring. Delete the file
to start from zero.

Corpus. The Python standard library's own sources, which every machine with Python has and which the
PSF licence lets us redistribute derived weights of: every `*.py` file under the directory of `os.__file__`,
leaving out `site-packages`, the test suites (`test`, `tests`, `idle_test`), `pydoc_data` (one big
string of prose) and `encodings` (mostly generated code-page tables). A file is held out when sha1 of its
path relative to that directory, read as an integer, is 0 mod 50 (about 2%, the same files on every
machine and Python version that has them); the list goes
to `benchmarks/heldout_files.txt`, so benchmarks can take held-out text from it. Files are UTF-8 bytes (ids
0..255) joined by EOS (id 256), like `deltaspec.shared.model.tokenizer.ByteTokenizer` and
`deltaspec.shared.model.checkpoint.hf_config`'s `eos_token_id`.

Models (both `Qwen3_5ForCausalLM`, trained batched with autograd, float32, tied embeddings):
  target  12 layers, (3 Gated DeltaNet + 1 full attention) x 3, hidden 160;
  draft    2 layers, 1 Gated DeltaNet + 1 full attention, hidden 128: a sixth of the layers, and the
           engine's per-token cost on the CPU is set by the layer count at these sizes.
The GDN layers are narrow (2 key and 2 value heads of 32): HF's PyTorch fallback for the chunked delta
rule costs in proportion to heads x head size, and these layers train 1.5x faster than 4 value heads of
40, which buys more tokens in the same time. Training is data-limited at this budget (about 4.6M bytes
seen of 9.8M), so small batches (2 x 384 bytes) and many updates beat large batches at equal bytes.
The draft learns from the data (cross-entropy) and from the target (KL(target || draft) on every
position, target detached), trained online alongside the target. With `--compare-ce-draft`, a second
draft with the same initialisation learns from cross-entropy alone; after training both are measured
with the project's engine on held-out prompts and the one with the higher greedy acceptance at k = 4
ships. With the loss (1 - a) CE + a KL, a = 0.5, distillation won every full run that compared them
(e.g. 0.80 against 0.63), hence off by default; a = 0.8 lost to CE alone, the teacher being too weak
early on.

Measuring (`benchmarks.pair_quality`, through the engine, on prompts from the held-out files): the
target's held-out loss, and for greedy decoding and for the demo's default sampling (`deltaspec.shared.demo`)
the acceptance at k = 4 and the share of distinct 4-grams in 256-token generations (a loop scores
near 0), plus load checks against HF and the time per token of each model.

MTP head (Qwen3.5 / Qwen3-Next checkpoint layout, `mtp_num_hidden_layers: 1` in config.json):
  mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.norm : zero-centred RMSNorm, applied as (1 + w)
  mtp.fc                 : Linear(2*hidden -> hidden), weight (hidden, 2*hidden), no bias
  mtp.layers.0.*         : one full-attention decoder layer, same parameter names as the target's
                           full-attention layers (self_attn.{q,k,v,o}_proj, q_norm, k_norm, mlp.*,
                           input_layernorm, post_attention_layernorm), with its own KV cache
  shares the target's embed_tokens and (tied) lm_head.
Wiring, as found in the public references:
  * vLLM `vllm/model_executor/models/qwen3_next_mtp.py` (Qwen3NextMultiTokenPredictor.forward):
        e = pre_fc_norm_embedding(embed(input_ids)); h = pre_fc_norm_hidden(hidden_states)
        x = fc(cat([e, h], -1)); x = layers[0](positions, x); out = norm(x); logits = lm_head(out)
  * SGLang `python/sglang/srt/models/qwen3_next_mtp.py` (Qwen3NextForCausalLMMTP.forward): the same,
        `self.fc(torch.cat((input_embeds, hidden_states), dim=-1))`.
  * Megatron-LM's MultiTokenPredictionLayer: `torch.cat((decoder_input, hidden_states), -1)` after
        enorm/hnorm, i.e. the same order (embedding first) for the DeepSeek-V3 style MTP it came from.
  So the concat ORDER is [normed embedding, normed hidden]: fc.weight[:, :hidden] reads the embedding,
  fc.weight[:, hidden:] reads the hidden state.
  The hidden state is taken AFTER the target's final norm (`model.norm`): in vLLM, Qwen3NextModel.forward
  ends with `hidden_states, _ = self.norm(hidden_states, residual)` and Qwen3NextForCausalLM.compute_logits
  applies lm_head to exactly that tensor, which is also what the spec-decode proposer hands to the MTP
  model; in SGLang, spec_info.hidden_states is the tensor the logits processor received, again post-norm.
  (HF's `Qwen3_5TextModel.forward` likewise returns `last_hidden_state = self.norm(...)`. This project's
  `HybridLM.forward` returns the hidden state BEFORE the final norm, so its MTP drafter must apply
  `target.model.norm` first.)
  Positions: with committed tokens x_0..x_p the target's hidden h_p (post-norm; it gave the logits for
  x_{p+1}) is paired with embed(x_{p+1}), and the head predicts x_{p+2}. In the issue's terms: the hidden
  of position p-1 with the embedding of token p predicts token p+1. vLLM keeps the row at the hidden's
  position (positions are not shifted when input_ids are rolled left by one); since RoPE only sees
  relative positions inside the head's own KV cache, either convention gives the same result. Here, in
  training, row i = (embed(x_{i+1}), h_i) sits at position i and its label is x_{i+2}.
The head is trained on the detached target (hidden states, embedding and lm_head are not updated by its
loss), with CE on x_{i+2} plus KL to the target's own distribution for that token (the target's logits at
position i+1), so the shipped target is exactly the one trained without it.

Outputs: shared/assets/models/{target,draft}/ (config.json + model.safetensors, MTP tensors inside the
target's), docs/figures/training_loss.png, benchmarks/heldout_files.txt; a JSON summary on stdout.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.report import FIGURES, HELDOUT_LIST  # noqa: E402
from benchmarks.speedup import heldout_prompts  # noqa: E402
from deltaspec.shared.model.checkpoint import hf_config  # noqa: E402

EOS, VOCAB = 256, 257
L, A = "linear_attention", "full_attention"
TARGET = hf_config(
    hidden_size=160, intermediate_size=448, layer_types=[L, L, L, A] * 3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=40,
    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
    mtp_num_hidden_layers=1,
)
DRAFT = hf_config(
    hidden_size=128, intermediate_size=384, layer_types=[L, A],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
)
HELDOUT_MOD = 50
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "pydoc_data", "encodings", "__pycache__"}
OUT_TARGET = REPO / "shared" / "assets" / "models" / "target"
OUT_DRAFT = REPO / "shared" / "assets" / "models" / "draft"


# ----------------------------------------------------------------------------------------------- data
def stdlib_files() -> tuple[Path, list[str]]:
    root = Path(os.path.dirname(os.__file__))
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not EXCLUDED_DIRS.intersection(rel.parts[:-1]) and path.is_file():
            files.append(rel.as_posix())
    return root, sorted(files)


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % HELDOUT_MOD == 0


def load_corpus() -> tuple[Tensor, Tensor, list[str], Path]:
    root, files = stdlib_files()
    train, held, held_names = [], [], []
    for rel in files:
        data = (root / rel).read_bytes()
        if not data.strip():
            continue
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.int16)
        (held if is_heldout(rel) else train).append(np.append(ids, np.int16(EOS)))
        if is_heldout(rel):
            held_names.append(rel)
    return (torch.from_numpy(np.concatenate(train)).long(), torch.from_numpy(np.concatenate(held)).long(),
            held_names, root)


def write_heldout_list(names: list[str], root: Path) -> None:
    head = [
        "# Held-out validation files of scripts/train_default_pair.py (never trained on).",
        f"# Paths relative to the standard library directory, os.path.dirname(os.__file__) ({root.name} here,",
        f"# Python {sys.version.split()[0]}); held out when int(sha1(path), 16) % {HELDOUT_MOD} == 0.",
    ]
    HELDOUT_LIST.write_text("\n".join(head + names) + "\n")


def batch(stream: Tensor, batch_size: int, seq: int, gen: torch.Generator) -> Tensor:
    starts = torch.randint(0, stream.numel() - seq - 1, (batch_size,), generator=gen)
    return torch.stack([stream[s:s + seq + 1] for s in starts.tolist()])


# --------------------------------------------------------------------------------------------- models
def hf_model(cfg: dict, seed: int):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(seed)
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**kwargs, attn_implementation="sdpa"))


class MTPHead(nn.Module):
    """The Qwen3.5 MTP module; state_dict keys are the checkpoint's `mtp.*` keys without the prefix."""

    def __init__(self, target) -> None:
        from transformers import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        super().__init__()
        cfg = target.config
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        layer_cfg = Qwen3_5TextConfig(**{**cfg.to_dict(), "layer_types": [A], "num_hidden_layers": 1})
        layer_cfg._attn_implementation = "sdpa"
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_cfg, 0)])
        self.norm = Qwen3_5RMSNorm(hidden, eps)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=cfg.initializer_range)

    def forward(self, emb: Tensor, hidden: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """emb = embed(x_{i+1}), hidden = post-norm h_i, both (B, T, H): the normed state for x_{i+2}."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x = self.layers[0](x, position_embeddings=rope, attention_mask=None)  # sdpa: causal when mask is None
        return self.norm(x)


def rope_for(target, x: Tensor) -> tuple[Tensor, Tensor]:
    positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    return target.model.rotary_emb(x, positions[None])


def kl(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """KL(teacher || student) per token, averaged."""
    s = F.log_softmax(student_logits.float().flatten(0, -2), -1)
    t = F.log_softmax(teacher_logits.float().flatten(0, -2), -1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def ce(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten())


def mtp_logits(target, mtp: MTPHead, x: Tensor, hidden: Tensor) -> Tensor:
    """Rows i = 0..T-2: (embed(x_{i+1}), h_i) -> logits for x_{i+2}. Target weights enter detached."""
    emb = F.embedding(x[:, 1:], target.model.embed_tokens.weight.detach())
    h = hidden[:, :-1].detach()
    out = mtp(emb, h, rope_for(target, h))
    return F.linear(out, target.lm_head.weight.detach())


def optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def lr_factor(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def params(model: nn.Module) -> int:
    """Parameters counted once (tied embeddings share one tensor)."""
    return sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())


# ------------------------------------------------------------------------------------------- training
def train(args, train_ids: Tensor, val_ids: Tensor) -> tuple | None:
    """Train (or resume from `args.state`); None when `--chunk-steps` stopped it before `--steps`."""
    target = hf_model(TARGET, args.seed).train()
    mtp = MTPHead(target).train()
    drafts = {"distilled": hf_model(DRAFT, args.seed + 1).train()}
    if args.compare_ce_draft:
        drafts["ce_only"] = hf_model(DRAFT, args.seed + 1).train()  # same initialisation
    models = {"target": target, "mtp": mtp, **{f"draft_{k}": m for k, m in drafts.items()}}
    lrs = {"target": args.lr, "mtp": args.lr_small, **{f"draft_{k}": args.lr_small for k in drafts}}
    opts = {name: optimizer(m, lrs[name]) for name, m in models.items()}
    gen = torch.Generator().manual_seed(args.seed)
    val_gen = torch.Generator().manual_seed(args.seed + 100)
    val_batch = batch(val_ids, args.val_batch, args.seq, val_gen)
    history: dict[str, list] = {"step": [], "target": [], "mtp": [], **{f"draft_{k}": [] for k in drafts}}
    val_history: dict[str, list] = {k: [] for k in history}
    first = 0
    if args.state and args.state.exists():  # resume an interrupted run where its last snapshot left it
        snap = torch.load(args.state, weights_only=False)
        for name in models:
            models[name].load_state_dict(snap["models"][name])
            opts[name].load_state_dict(snap["opts"][name])
        gen.set_state(snap["gen"])
        history, val_history, first = snap["history"], snap["val_history"], snap["step"]

    total = args.steps + args.long_steps
    last = min(total, first + args.chunk_steps) if args.chunk_steps else total
    bar = tqdm(range(first, last), desc="training", unit="step", dynamic_ncols=True, initial=first, total=total)
    for step in bar:
        if step < args.steps:
            losses = main_step(args, target, mtp, drafts, models, opts, lrs, step,
                               batch(train_ids, args.batch, args.seq, gen))
        else:
            losses = long_step(args, target, drafts, opts, lrs, batch(train_ids, args.batch, args.long_seq, gen))
        history["step"].append(step)
        for k in history.keys() - {"step"}:
            history[k].append(losses.get(k, float("nan")))  # the second stage trains the drafts alone
        if step < args.steps and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            vals = evaluate(target, mtp, drafts, val_batch)
            val_history["step"].append(step + 1)
            for k, v in vals.items():
                val_history[k].append(v)
        bar.set_postfix({k.replace("draft_", "d_"): f"{v:.3f}" for k, v in losses.items()})
        if args.state and ((step + 1) % args.save_every == 0 or step + 1 == last):
            save_snapshot(args.state, models, opts, gen, history, val_history, step + 1)
    if last < total:
        return None
    for m in models.values():
        m.eval()
    return target, mtp, drafts, history, val_history


def main_step(args, target, mtp, drafts: dict, models: dict, opts: dict, lrs: dict, step: int,
              xb: Tensor) -> dict[str, float]:
    """One step of the main stage: target, MTP head and drafts together on `--seq` windows (cosine schedule)."""
    f = lr_factor(step, args.steps, args.warmup)
    for name, opt in opts.items():
        for group in opt.param_groups:
            group["lr"] = lrs[name] * f
    x, y = xb[:, :-1], xb[:, 1:]
    alpha = args.kl_weight
    # target: CE on the next byte
    hidden = target.model(input_ids=x, use_cache=False).last_hidden_state  # post final norm
    logits = target.lm_head(hidden)
    loss_t = ce(logits, y)
    loss_t.backward()
    teacher = logits.detach()
    hidden = hidden.detach()
    # MTP head: CE on x_{i+2} + KL to the target's distribution for that token (its logits at i+1)
    m_logits = mtp_logits(target, mtp, x, hidden)
    ce_m = ce(m_logits, y[:, 1:])
    ((1 - alpha) * ce_m + alpha * kl(m_logits, teacher[:, 1:])).backward()
    losses = {"target": loss_t.item(), "mtp": ce_m.item()}
    for key, draft in drafts.items():
        losses[f"draft_{key}"] = draft_backward(args, key, draft, x, y, teacher)
    for name, opt in opts.items():
        torch.nn.utils.clip_grad_norm_(models[name].parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def long_step(args, target, drafts: dict, opts: dict, lrs: dict, xb: Tensor) -> dict[str, float]:
    """One step of the second stage: the drafts alone, on `--long-seq` windows, against the frozen target, at the
    main stage's final learning rate. The main stage's 384-byte windows leave the 2-layer draft lost past about 512
    positions (held-out CE 1.19 in the first 256 positions, 1.77 at 512-767), where the 12-layer target holds up
    (1.07, 1.13); long generations then accept half as many drafts."""
    x, y = xb[:, :-1], xb[:, 1:]
    with torch.no_grad():
        teacher = target.lm_head(target.model(input_ids=x, use_cache=False).last_hidden_state)
    losses = {}
    for key, draft in drafts.items():
        opt = opts[f"draft_{key}"]
        for group in opt.param_groups:
            group["lr"] = lrs[f"draft_{key}"] * lr_factor(args.steps, args.steps, args.warmup)
        losses[f"draft_{key}"] = draft_step(args, key, draft, opt, x, y, teacher)
    return losses


def refine_draft(args, train_ids: Tensor, target: nn.Module) -> nn.Module:
    """The written draft, trained further alone against `target` (frozen): `--refine-steps` on `--seq` windows
    (cosine from `--refine-lr`), then `--long-steps` on `--long-seq` windows at the schedule's final rate."""
    from transformers import Qwen3_5ForCausalLM

    gen = torch.Generator().manual_seed(args.seed + 400)
    return distill_draft(
        args, Qwen3_5ForCausalLM.from_pretrained(args.out_draft), target, args.refine_steps + args.long_steps,
        lambda step: args.refine_lr * lr_factor(min(step, args.refine_steps), args.refine_steps, args.warmup),
        lambda step: batch(train_ids, args.batch, args.seq if step < args.refine_steps else args.long_seq, gen),
        "refining the draft")


# (seed, batches of 32 windows, new tokens) of the target's continuations `--onpolicy-draft` trains on
ONPOLICY_PARTS = ((11, 12, 192), (12, 12, 192), (21, 16, 448), (22, 16, 448))


def onpolicy_draft(args, train_ids: Tensor, target: nn.Module) -> nn.Module:
    """The written draft, trained further on what it meets when serving: the target's own continuations of
    training windows (`ONPOLICY_PARTS`, greedy and the demo's sampling), a share `--onpolicy-share` of the
    batches; `--long-share` are `--long-seq` corpus windows (long range held), the rest `--seq` ones."""
    from transformers import Qwen3_5ForCausalLM

    sets = [target_continuations(target, train_ids, seed, batches, new)
            for seed, batches, new in tqdm(ONPOLICY_PARTS, desc="target continuations", unit="part")]
    gen = torch.Generator().manual_seed(7)

    def next_batch(step: int) -> Tensor:
        pick = torch.rand((), generator=gen).item()
        if pick < args.onpolicy_share:
            rows = sets[int(torch.randint(0, len(sets), (), generator=gen))]
            return rows[torch.randint(0, rows.shape[0], (args.batch,), generator=gen)]
        return batch(train_ids, args.batch, args.long_seq if pick < args.onpolicy_share + args.long_share
                     else args.seq, gen)

    return distill_draft(args, Qwen3_5ForCausalLM.from_pretrained(args.out_draft), target, args.onpolicy_steps,
                         lambda step: args.onpolicy_lr * lr_factor(step, args.onpolicy_steps, args.warmup),
                         next_batch, "on-policy draft")


def target_continuations(target: nn.Module, train_ids: Tensor, seed: int, batches: int, new_tokens: int,
                         batch_size: int = 32, prompt_len: int = 64) -> Tensor:
    """`(batches * batch_size, prompt_len + new_tokens)`: training windows and the target's continuations, greedy
    and sampled at the demo's settings by turns (EOS held back, so every row is full length)."""
    from deltaspec.shared import demo

    gen, rows = torch.Generator().manual_seed(seed), []
    for i in range(batches):
        prompts, sample = batch(train_ids, batch_size, prompt_len - 1, gen), i % 2 == 1
        torch.manual_seed(seed * 1000 + i)
        with torch.no_grad():
            rows.append(target.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                        do_sample=sample, temperature=demo.TEMPERATURE if sample else None,
                                        top_p=demo.TOP_P if sample else None, top_k=0, pad_token_id=EOS))
    return torch.cat(rows)


def distill_draft(args, draft: nn.Module, target: nn.Module, steps: int, lr_at: Callable[[int], float],
                  next_batch: Callable[[int], Tensor], desc: str) -> nn.Module:
    """`draft` trained alone against `target` (frozen): `steps` updates on `next_batch(step)` at `lr_at(step)`."""
    draft.train()
    for weight in target.parameters():
        weight.requires_grad_(False)
    opt = optimizer(draft, lr_at(0))
    bar = tqdm(range(steps), desc=desc, unit="step", dynamic_ncols=True)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        xb = next_batch(step)
        x, y = xb[:, :-1], xb[:, 1:]
        with torch.no_grad():
            teacher = target(input_ids=x, use_cache=False).logits
        bar.set_postfix(ce=f"{draft_step(args, 'distilled', draft, opt, x, y, teacher):.3f}")
    return draft.eval()


def draft_step(args, key: str, draft, opt: torch.optim.Optimizer, x: Tensor, y: Tensor, teacher: Tensor) -> float:
    """One update of a draft alone against `teacher` (the target's logits); returns its CE."""
    ce_d = draft_backward(args, key, draft, x, y, teacher)
    torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return ce_d


def draft_backward(args, key: str, draft, x: Tensor, y: Tensor, teacher: Tensor) -> float:
    """Backward of a draft's loss: (1 - a) CE + a KL(target || draft), or CE alone for `ce_only`; returns its CE."""
    d_logits = draft(input_ids=x, use_cache=False).logits
    ce_d = ce(d_logits, y)
    alpha = args.kl_weight
    (ce_d if key == "ce_only" else (1 - alpha) * ce_d + alpha * kl(d_logits, teacher)).backward()
    return ce_d.item()


def save_snapshot(path: Path, models: dict, opts: dict, gen: torch.Generator, history: dict, val_history: dict,
                  step: int) -> None:
    snap = {"models": {n: m.state_dict() for n, m in models.items()},
            "opts": {n: o.state_dict() for n, o in opts.items()},
            "gen": gen.get_state(), "history": history, "val_history": val_history, "step": step}
    torch.save(snap, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)


@torch.no_grad()
def evaluate(target, mtp, drafts, xb: Tensor) -> dict[str, float]:
    for m in (target, mtp, *drafts.values()):
        m.eval()
    x, y = xb[:, :-1], xb[:, 1:]
    hidden = target.model(input_ids=x, use_cache=False).last_hidden_state
    logits = target.lm_head(hidden)
    out = {"target": ce(logits, y).item(), "mtp": ce(mtp_logits(target, mtp, x, hidden), y[:, 1:]).item()}
    for key, draft in drafts.items():
        out[f"draft_{key}"] = ce(draft(input_ids=x, use_cache=False).logits, y).item()
    for m in (target, mtp, *drafts.values()):
        m.train()
    return out


@torch.no_grad()
def ce_by_position(target, drafts: dict, xb: Tensor, bucket: int = 256) -> dict[str, list[float]]:
    """Held-out cross-entropy per `bucket` positions of long windows: how each model holds up with context."""
    x, y = xb[:, :-1], xb[:, 1:]
    out = {}
    for name, model in {"target": target, **{f"draft_{k}": d for k, d in drafts.items()}}.items():
        per = torch.nn.functional.cross_entropy(model(input_ids=x, use_cache=False).logits.transpose(1, 2), y,
                                                reduction="none").mean(0)
        out[name] = [round(per[i:i + bucket].mean().item(), 3) for i in range(0, per.numel(), bucket)]
    return out


@torch.no_grad()
def agreement(target, mtp, drafts, xb: Tensor) -> dict[str, float]:
    """Teacher-forced top-1 agreement with the target's argmax on held-out text (the MTP head's unless None)."""
    x = xb[:, :-1]
    hidden = target.model(input_ids=x, use_cache=False).last_hidden_state
    t_arg = target.lm_head(hidden).argmax(-1)
    out = {} if mtp is None else {
        "mtp_top1_vs_target": (mtp_logits(target, mtp, x, hidden).argmax(-1) == t_arg[:, 1:]).float().mean().item()}
    for key, draft in drafts.items():
        out[f"draft_{key}_top1_vs_target"] = (draft(input_ids=x, use_cache=False).logits.argmax(-1) == t_arg).float().mean().item()
    return out


def plot(history: dict, val_history: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colours = {"target": "C0", "draft_distilled": "C1", "draft_ce_only": "C2", "mtp": "C3"}
    labels = {"target": "target (next byte)", "draft_distilled": "draft, distilled (CE part)",
              "draft_ce_only": "draft, CE only", "mtp": "target MTP head (byte after next)"}
    for key in colours:
        if key not in history or not history[key]:
            continue
        raw = np.array(history[key])
        ema, smooth = raw[0], []
        for v in raw:
            ema = 0.9 * ema + 0.1 * v
            smooth.append(ema)
        ax.plot(history["step"], raw, color=colours[key], alpha=0.2, linewidth=0.8)
        ax.plot(history["step"], smooth, color=colours[key], label=f"{labels[key]}, train")
        if val_history.get(key):
            ax.plot(val_history["step"], val_history[key], "o--", color=colours[key], markersize=4,
                    label=f"{labels[key]}, held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_ylim(0, min(6.0, max(max(v) for k, v in history.items() if k != "step" and v) + 0.2))
    ax.set_title("Default pair on the Python standard library (byte level)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ checkpoints
def save(model, directory: Path, extra: dict[str, Tensor] | None = None) -> None:
    from safetensors.torch import load_file, save_file

    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.iterdir():
        stale.unlink()
    model.save_pretrained(directory)
    (directory / "generation_config.json").unlink(missing_ok=True)
    if extra:
        tensors = load_file(directory / "model.safetensors")
        tensors.update({k: v.detach().contiguous() for k, v in extra.items()})
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    for written in directory.iterdir():  # readable by the non-root user of the service image
        written.chmod(0o644)


def save_pair(target, mtp, draft, target_dir: Path, draft_dir: Path) -> None:
    save(target, target_dir, {f"mtp.{k}": v for k, v in mtp.state_dict().items()})
    save(draft, draft_dir)


# ------------------------------------------------------------------------------------------ measuring
def quality(target_dir: Path, draft_dir: Path, prompts: list[list[int]], texts: list[list[int]], new_tokens: int,
            k: int, greedy_only: bool = False) -> dict:
    """`benchmarks.pair_quality` for greedy decoding and the demo's default sampling; two samples
    decoded."""
    from deltaspec.shared import demo
    from benchmarks.pair_quality import generation_quality, pair_quality
    from deltaspec.shared.decoding.sampling import SamplingParams
    from deltaspec.shared.model.loader import load_model

    target, draft = load_model(target_dir), load_model(draft_dir)
    if greedy_only:
        out = generation_quality(target, draft, prompts, SamplingParams(), new_tokens, k)
        out.pop("samples")
        return out
    settings = {"greedy": SamplingParams(),
                "demo": SamplingParams(demo.TEMPERATURE, top_p=demo.TOP_P, seed=demo.SEED)}
    out = pair_quality(target, draft, prompts, texts, settings, new_tokens, k)
    for g in out["generation"].values():
        g["samples"] = [bytes(t for t in ids if t < 256).decode(errors="replace") for ids in g["samples"][:2]]
    return out


def time_per_token(directories: list[Path], prompts: list[list[int]], new_tokens: int, repeats: int = 3) -> list[float]:
    """Seconds per generated token of target-only decoding through the engine, for each checkpoint.

    The models take turns (prompt by prompt, repeat by repeat) so that load from other processes on a shared
    machine hits them alike; the best of the repeats per prompt, then the median over prompts.
    """
    from deltaspec.shared.decoding.speculative import generate
    from deltaspec.shared.model.loader import load_model

    models = [load_model(d) for d in directories]
    for model in models:
        generate(model, prompts[0], 4)  # warm-up
    best = [[math.inf] * len(prompts) for _ in models]
    for _ in range(repeats):
        for j, prompt in enumerate(prompts):
            for i, model in enumerate(models):
                best[i][j] = min(best[i][j], generate(model, prompt, new_tokens).stats.seconds / new_tokens)
    return [float(np.median(b)) for b in best]


def check_loads(target_dir: Path, draft_dir: Path, sample: list[int]) -> dict:
    """HF loads both as they are; the engine loads both, keeps mtp.*, and agrees with HF's logits."""
    from transformers import Qwen3_5ForCausalLM

    from deltaspec.shared.model.loader import load_model

    out = {}
    for name, d in (("target", target_dir), ("draft", draft_dir)):
        ref = Qwen3_5ForCausalLM.from_pretrained(d).eval()
        ours = load_model(d)
        ids = torch.tensor(sample)
        with torch.no_grad():
            want = ref(ids[None]).logits[0]
        got, _ = ours(ids, ours.new_state())
        out[f"{name}_engine_vs_hf_rel_err"] = ((got - want).norm() / want.norm()).item()
        out[f"{name}_params"] = params(ref)
        out[f"{name}_mtp_tensors"] = len(ours.mtp)
        out[f"{name}_bytes"] = sum(p.stat().st_size for p in d.iterdir())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--long-steps", type=int, default=600,
                   help="then this many steps of the drafts alone on --long-seq windows (the target frozen)")
    p.add_argument("--long-seq", type=int, default=1280)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=384)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--lr-small", type=float, default=3e-3, help="learning rate of the draft and the MTP head")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--kl-weight", type=float, default=0.5, help="alpha in (1-alpha) CE + alpha KL(target||student)")
    p.add_argument("--compare-ce-draft", action="store_true",
                   help="also train a cross-entropy-only draft; the one with the higher acceptance ships")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--val-batch", type=int, default=8)
    p.add_argument("--prompts", type=int, default=6, help="held-out prompts for acceptance and repetition")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-target", type=Path, default=OUT_TARGET)
    p.add_argument("--out-draft", type=Path, default=OUT_DRAFT)
    p.add_argument("--plot", type=Path, default=FIGURES / "training_loss.png")
    p.add_argument("--eval-only", action="store_true", help="measure the checkpoints already written")
    p.add_argument("--refine-draft", action="store_true",
                   help="train the written draft further against the written target, then measure the pair")
    p.add_argument("--refine-steps", type=int, default=3000)
    p.add_argument("--refine-lr", type=float, default=1e-3)
    p.add_argument("--onpolicy-draft", action="store_true",
                   help="train the written draft further on the written target's own continuations, then measure")
    p.add_argument("--onpolicy-steps", type=int, default=3000)
    p.add_argument("--onpolicy-lr", type=float, default=5e-4)
    p.add_argument("--onpolicy-share", type=float, default=0.8,
                   help="share of --onpolicy-draft batches of continuations")
    p.add_argument("--long-share", type=float, default=0.1,
                   help="share of --onpolicy-draft batches of --long-seq windows")
    p.add_argument("--state", type=Path, default=None,
                   help="snapshot file: written every --save-every steps, and resumed from when it exists")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--chunk-steps", type=int, default=0,
                   help="with --state: stop after this many steps (snapshot written); rerun to go on (0: all)")
    args = p.parse_args()
    if args.chunk_steps and not args.state:
        p.error("--chunk-steps needs --state, where the next chunk resumes from")

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    train_ids, val_ids, held_names, root = load_corpus()
    summary: dict = {"corpus": {"root": str(root), "train_bytes": train_ids.numel(), "heldout_bytes": val_ids.numel(),
                                "heldout_files": len(held_names)}}
    write_heldout_list(held_names, root)  # the same list every run: heldout_prompts reads it
    prompts, texts = heldout_prompts(args.prompts, 96), heldout_prompts(8, 512)
    started = time.time()
    if args.refine_draft or args.onpolicy_draft:
        from transformers import Qwen3_5ForCausalLM

        target = Qwen3_5ForCausalLM.from_pretrained(args.out_target).eval()
        further = onpolicy_draft if args.onpolicy_draft else refine_draft
        drafts = {"before": Qwen3_5ForCausalLM.from_pretrained(args.out_draft).eval(),
                  "refined": further(args, train_ids, target)}
        summary["train_seconds"] = round(time.time() - started, 1)
        agree_batch = batch(val_ids, args.val_batch, args.seq, torch.Generator().manual_seed(args.seed + 200))
        long_batch = batch(val_ids, 6, args.long_seq, torch.Generator().manual_seed(args.seed + 300))
        summary["heldout_top1_agreement"] = agreement(target, None, drafts, agree_batch)
        summary["heldout_ce_by_256_positions"] = ce_by_position(target, drafts, long_batch)
        save(drafts["refined"], args.out_draft)
    elif not args.eval_only:
        trained = train(args, train_ids, val_ids)
        if trained is None:
            print(f"stopped after this chunk; snapshot in {args.state}: rerun the same command to go on",
                  file=sys.stderr)
            return
        target, mtp, drafts, history, val_history = trained
        summary["train_seconds"] = round(time.time() - started, 1)
        summary["final_train_loss"] = {k: float(np.mean(v[-50:])) for k, v in history.items() if k != "step"}
        summary["final_heldout_loss"] = {k: v[-1] for k, v in val_history.items() if k != "step"}
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(history, val_history, args.plot)
        agree_batch = batch(val_ids, args.val_batch, args.seq, torch.Generator().manual_seed(args.seed + 200))
        summary["heldout_top1_agreement"] = agreement(target, mtp, drafts, agree_batch)
        long_batch = batch(val_ids, 6, args.long_seq, torch.Generator().manual_seed(args.seed + 300))
        summary["heldout_ce_by_256_positions"] = ce_by_position(target, drafts, long_batch)
        # measure every candidate draft with the engine; the best greedy acceptance ships
        best = "distilled"
        if len(drafts) > 1:
            results = {}
            with tempfile.TemporaryDirectory() as tmp:
                for key, draft in drafts.items():
                    t_dir, d_dir = Path(tmp) / key / "target", Path(tmp) / key / "draft"
                    save_pair(target, mtp, draft, t_dir, d_dir)
                    results[key] = quality(t_dir, d_dir, prompts, [], args.new_tokens, args.k, greedy_only=True)
            summary["candidates"] = results
            best = max(results, key=lambda k: results[k]["acceptance_rate"])
        summary["shipped_draft"] = best
        save_pair(target, mtp, drafts[best], args.out_target, args.out_draft)
    summary["loads"] = check_loads(args.out_target, args.out_draft, prompts[0][:200])
    summary["total_bytes"] = summary["loads"]["target_bytes"] + summary["loads"]["draft_bytes"]
    summary[f"quality_k{args.k}"] = quality(args.out_target, args.out_draft, prompts, texts, args.new_tokens, args.k)
    t_target, t_draft = time_per_token([args.out_target, args.out_draft], prompts[:4], 64)
    summary["ms_per_token"] = {"target": round(t_target * 1e3, 3), "draft": round(t_draft * 1e3, 3),
                               "draft_over_target": round(t_draft / t_target, 3)}
    summary["wall_seconds"] = round(time.time() - started, 1)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
