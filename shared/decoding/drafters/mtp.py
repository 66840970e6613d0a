"""MTP self-speculation: the target checkpoint's own `mtp.*` head proposes tokens.

Wiring (Qwen3.5 / Qwen3-Next checkpoint layout), row i predicts token i+2 from the trunk:

    e_i = pre_fc_norm_embedding(embed(x_{i+1}))        # the target's embed_tokens
    g_i = pre_fc_norm_hidden(norm(h_i))                # h_i: last trunk layer at position i, AFTER model.norm
    y_i = norm_mtp(layers(fc(cat([e_i, g_i], -1))))    # full-attention decoder layer(s), own KV cache
    logits_i = lm_head(y_i)                            # the target's (possibly tied) lm_head

In the issue's words: the hidden state of position p-1 with the embedding of token p predicts p+1.
Nemotron-H's head (vLLM `nemotron_h_mtp.py`, `NemotronHMultiTokenPredictor`) is the same computation with the
family's own blocks for `layers` (attention then MoE, `ModelConfig.mtp_layer_types`), its plain norms, and
the fusion and end norm published on its first and last block (`enorm`, `hnorm`, `eh_proj`, `final_layernorm`:
the family's `convert` names them as here); its trunk states reach the head after `norm_f`, as Qwen's do. The
Ling hybrid's (vLLM `bailing_moe_v3_mtp.py`) is one latent-attention layer with a MoE whose SwiGLUs are not clipped
(`ModelConfig.mtp_overrides`), stored as layer `num_hidden_layers` with the same fusion names.
References (read 2026-12): vLLM `vllm/model_executor/models/qwen3_next_mtp.py`,
`Qwen3NextMultiTokenPredictor.forward`: `hidden_states = torch.cat([inputs_embeds, hidden_states],
dim=-1)` after the two pre-fc norms, i.e. embedding first; the hidden states it receives are the
target's output, and `Qwen3NextModel.forward` ends with `hidden_states, _ = self.norm(hidden_states,
residual)` (its `compute_logits` applies lm_head to that same tensor), so h is taken after the
final norm. SGLang `python/sglang/srt/models/qwen3_next_mtp.py`: `self.fc(torch.cat((input_embeds,
hidden_states), dim=-1))`, with `spec_info.hidden_states` the post-norm states the logits
processor saw. `HybridLM.forward` returns h before the norm, so this drafter applies `model.norm`.
Row i sits at position i (the hidden state's position, as vLLM keeps it); RoPE only sees offsets
inside the head's own cache, so the convention only has to be consistent. Chained steps feed the
head's own output y (post `mtp.norm`) as the next row's hidden state, as vLLM and SGLang do.

State. The head's KV cache holds one row per committed trunk position and rolls back by
position: rows staged while chaining drafts sit past `length` and are overwritten, never read.
Trunk hidden states come from the target's verify pass (`Round.hidden`, and the prompt's from
`TargetSession.prefill_hidden`): the drafter is handed the session through the optional
`attach_session` hook (see `deltaspec.shared.decoding.drafters.attach`), so the decoding loop stays the same
for every drafter. The head runs where the target runs: it needs the trunk's hidden states.

The head module is `deltaspec.shared.model.mtp_head.MTPHead`; on a tensor-parallel target it is rank 0's shard of
the head, and each of its passes runs on every rank (the followers are sent its ids and hidden states).
"""
from __future__ import annotations

import torch
from torch import Tensor

from deltaspec.shared.decoding.drafters import Proposal
from deltaspec.shared.decoding.sampling import SamplingParams, draw, probabilities
from deltaspec.shared.model.config import ModelConfig
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.model.mtp_head import MTPHead, head_layers


class MTPDrafter:
    """Proposes with the target's MTP head; needs the target session (`attach_session`) for hidden states."""

    def __init__(self, target: HybridLM, sampling: SamplingParams = SamplingParams(),
                 head: MTPHead | None = None) -> None:
        self.target, self.sampling = target, sampling
        self.head = head or MTPHead(target)  # read-only, so drafters of one target may share it
        self.start([])

    def start(self, prompt_ids: list[int]) -> None:
        self.session = None
        self.cache = self.head.new_cache(max(256, 2 * len(prompt_ids)))
        self.length = 0  # committed rows in the head's cache (= trunk positions paired so far)
        self.rows_h: list[Tensor] = []  # trunk hidden states (pre-norm) not yet fed to the head
        self.rows_x: list[int] = []  # the token after each of them
        self.last: Tensor | None = None  # head output of the newest committed row

    def attach_session(self, session) -> None:
        """Read hidden states from this `TargetSession`: the prompt's now, each committed round's on `advance`."""
        if not hasattr(session, "prefill_hidden"):
            raise ValueError("MTP drafting runs beside the target: it needs a local TargetSession's hidden states")
        if session.prefill_hidden is None:
            raise ValueError("the target's prefix cache served the prompt without the trunk's hidden states MTP "
                             "drafting reads: attach it with keep_hidden=True")
        self.session = session
        hidden = session.prefill_hidden  # (n-1, D) for prompt x_0..x_{n-2}, paired with x_1..x_{n-1}
        self._add_rows(hidden, session.tokens[1:len(hidden) + 1])

    def propose(self, k: int) -> Proposal:
        if self.session is None:
            raise RuntimeError("MTPDrafter needs the target session: call attach(drafter, session) after start")
        if k == 0 or (self.last is None and not self.rows_x):
            return Proposal([])
        logits = self.target.logits
        if self.rows_x:  # the trunk's rows: committed in the head's cache
            hidden = self.target.model.norm(torch.cat(self.rows_h))
            ids = torch.tensor(self.rows_x, device=hidden.device)
            with torch.inference_mode():
                out = self.head(ids, hidden, self.cache, self.length)
            self.length += len(self.rows_x)
            self.rows_h, self.rows_x, self.last = [], [], out[-1]
        y, tokens, dists = self.last, [], []
        generator = self.sampling.generator(len(self.session.tokens), stream=2)  # keyed by position, like the target's
        with torch.inference_mode():
            for j in range(k):
                q = probabilities(logits(y), self.sampling)
                token = int(q.argmax()) if self.sampling.greedy else draw(q, generator)
                tokens.append(token)
                dists.append(q)
                if j + 1 < k:  # chain on the head's own output; staged past `length`, never committed
                    y = self.head(torch.tensor([token], device=y.device), y[None], self.cache, self.length + j)[0]
        return Proposal(tokens, None if self.sampling.greedy else torch.stack(dists))

    def advance(self, accepted: int, next_token: int) -> None:
        """The round's verified positions pending, d_1..d_a become rows, paired with d_1..d_a, next_token."""
        rnd = self.session.round
        if rnd is None or rnd.committed != accepted:
            raise RuntimeError(f"advance({accepted}) does not match the session's last commit")
        self._add_rows(rnd.hidden[:accepted + 1], self.session.tokens[-(accepted + 1):])

    def _add_rows(self, hidden: Tensor, next_tokens: list[int]) -> None:
        if len(next_tokens):
            self.rows_h.append(hidden)
            self.rows_x += list(next_tokens)


def random_mtp_weights(cfg: ModelConfig, n_layers: int = 1, seed: int = 0) -> dict[str, Tensor]:
    """`mtp.*` tensors as the loader keeps them (the drafter's names; the family's layer kinds where it names them,
    `n_layers` then unused), drawn at random (norm weights around the family's identity): for tests and the
    benchmark's random models. `cfg` is the target's `ModelConfig`."""
    gen = torch.Generator().manual_seed(seed)
    D = cfg.hidden_size
    shapes = {"fc.weight": (D, 2 * D), "pre_fc_norm_embedding.weight": (D,), "pre_fc_norm_hidden.weight": (D,),
              "norm.weight": (D,)}
    for i, layer in enumerate(head_layers(cfg, n_layers)):
        shapes.update({f"layers.{i}.{k}": tuple(v.shape) for k, v in layer.state_dict().items()})
    return {f"mtp.{k}": torch.randn(s, generator=gen) * (0.3 if len(s) == 1 else s[-1] ** -0.5)
            + (1.0 - cfg.norm_offset if "norm" in k else 0.0) for k, s in shapes.items()}
