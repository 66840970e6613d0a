"""The hybrid stack and its LM head: `HybridLM`, whose state_dict keys are HF's `Qwen3_5ForCausalLM` keys (and
`Qwen3_5MoeForCausalLM`'s, with the experts fused as HF keeps them in memory)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from deltaspec.shared.model import fused
from deltaspec.shared.model.captured import MAX_CAPTURED_TOKENS, CapturedPasses
from deltaspec.shared.model.compiled import CompiledPasses
from deltaspec.shared.model.config import ModelConfig
from deltaspec.shared.model.layers import HybridStack
from deltaspec.shared.model.mixers.gdn import GatedDeltaNet
from deltaspec.shared.model.rotary import rotary_cos_sin, rotary_signed
from deltaspec.shared.state.access import SequenceAccess
from deltaspec.shared.state.rollback import ModelState
from deltaspec.shared.state.spec import LOG_CAPACITY

if TYPE_CHECKING:
    from deltaspec.shared.state.pool import StatePool
    from deltaspec.shared.state.prefix_cache import PrefixCache


class HybridLM(nn.Module):
    """Qwen3.5 text model. `forward` stages tokens into a `ModelState`; the caller commits or reverts."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = HybridStack(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp: dict[str, Tensor] = {}  # the checkpoint's mtp.* tensors, kept for the MTP drafter
        # set by `parallel.shard` (a `parallel.Sharding`: how this tensor-parallel shard was cut; parallel.py imports
        # this module, so it is not named here)
        self.sharding: Any = None
        self.fused: fused.FusedStack | None = None  # set by `fuse()`: forward takes the fused path
        self.rope_table: tuple[Tensor, Tensor, Tensor] | None = None  # cos, sin, signed sin by position (`rope`)
        self.compiled: CompiledPasses | None = None  # set by `compile()`: passes that fit the logs run compiled
        self.captured: CapturedPasses | None = None  # set by `capture()`: decode and verify passes replay graphs
        self.state_pool: StatePool | None = None  # set by `state.pool.attach`: sessions' states are its slots
        self.prefix_cache: PrefixCache | None = None  # set by `state.prefix_cache.attach`: sessions share prefixes
        self.leader: Any = None  # set by `lockstep.Leader`: rank 0 of a tensor-parallel group announces each pass

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def logits(self, y: Tensor) -> Tensor:
        """The LM head on final-normed hidden states `y`, divided by `logits_scaling` (Granite's) or multiplied by
        `logits_multiplier` (Falcon-H1's), then soft-capped (`logits_soft_cap`, RecurrentGemma's), in the weights'
        dtype as HF does: float32 logits. Every pass and the MTP drafter compute logits here."""
        logits = self.lm_head(y)
        cfg = self.config
        scaling, multiplier, cap = cfg.logits_scaling, cfg.logits_multiplier, cfg.logits_soft_cap
        if scaling != 1.0:
            logits = logits / scaling
        if multiplier != 1.0:
            logits = logits * multiplier
        return (logits if not cap else torch.tanh(logits / cap) * cap).float()

    def new_state(self, capacity: int = 256, log_capacity: int = LOG_CAPACITY) -> ModelState:
        """A fresh sequence state; in a slot of the model's state pool when one is attached
        (`deltaspec.shared.state.pool`), whose logs are the pool's size."""
        if self.state_pool is not None:
            return self.state_pool.new_state(capacity)
        return ModelState(self.config.state_spec, device=self.device, dtype=self.dtype, capacity=capacity,
                          log_capacity=log_capacity)

    def fuse(self, enable: bool = True) -> HybridLM:
        """Take the fused path (`deltaspec.shared.model.fused`) from now on, or go back to the layer path.

        For inference: the projections' parameters become slices of the fused weights.
        """
        if not enable:
            self.fused = self.compiled = self.captured = None
        elif self.fused is None:
            self.fused = fused.fuse_stack(self.model)
        return self

    def compile(self, enable: bool = True, warm_up: bool = False, log_capacity: int = LOG_CAPACITY) -> HybridLM:
        """Run decode and verify passes as compiled graphs (`deltaspec.shared.model.compiled`) from now on, or stop.

        On the fused path only. Each graph compiles on its first pass (seconds to a minute on a CPU, less when
        Inductor's on-disk cache has it); `warm_up` compiles them all now, for states whose logs hold `log_capacity`
        tokens (a draft's: `CHAIN_LOG_CAPACITY`)."""
        if not enable:
            self.compiled = None
        elif self.compiled is None:
            if self.fused is None:
                raise ValueError("compile() needs the fused path: call fuse() first")
            if self.config.num_experts and self.dtype != torch.bfloat16:
                raise ValueError("compiled passes of a sparse MoE model need bfloat16 weights (its experts run as "
                                 f"grouped matmuls, which take bfloat16), not {self.dtype}: run it without --compile")
            slow = sorted({type(layer.mixer).__name__ for layer in self.model.layers
                           if layer.mixer is not None and not layer.mixer.compiles})
            if slow:
                raise ValueError(f"compiled passes are not built for {', '.join(slow)} layers yet: run this "
                                 f"{self.config.family} model without --compile")
            self.compiled = CompiledPasses(self.device, self.config.num_hidden_layers)
        if warm_up and self.compiled is not None:
            self.compiled.warm_up(self, log_capacity)
        return self

    def capture(self, enable: bool = True, max_tokens: int = MAX_CAPTURED_TOKENS) -> HybridLM:
        """Replay decode and verify passes of up to `max_tokens` tokens as CUDA graphs
        (`deltaspec.shared.model.captured`) from now on, or stop. On the fused path, compiled or not; each graph is
        recorded on its first pass. On the CPU, where there are no graphs, the same static pass runs directly."""
        if not enable:
            self.captured = None
        elif self.captured is None:
            self.captured = CapturedPasses(self, max_tokens)
        return self

    def set_gdn_kernel(self, name: str) -> None:
        """Force one gated delta rule kernel (`auto`, `naive`, `chunk`, `recurrent`, `triton`)."""
        for layer in self.model.layers:
            if isinstance(layer.mixer, GatedDeltaNet):
                layer.mixer.kernel_name = name

    def rope(self, start: int, end: int, like: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`rotary_cos_sin` of positions start..end-1 and its `rotary_signed` sin, in `like`'s dtype: slices of
        a table made once per model (regrown by doubling), where computing them cost a dozen calls a forward pass."""
        table = self.rope_table
        if table is None or table[0].shape[0] < end or table[0].dtype != like.dtype or table[0].device != like.device:
            size = max(end, 2 * table[0].shape[0] if table is not None else 1024)
            cos, sin = rotary_cos_sin(self.config.rotary_dim, self.config.rope_theta,
                                      torch.arange(size, device=like.device), like.dtype)
            table = self.rope_table = (cos, sin, rotary_signed(cos, sin)[1])
        return table[0][start:end], table[1][start:end], table[2][start:end]

    @torch.inference_mode()
    def forward(self, ids: Tensor, state: ModelState) -> tuple[Tensor, Tensor]:
        """Stage `ids (T,)` after the head and what is already staged.

        Returns float32 logits `(T, vocab)` and the last layer's hidden states `(T, hidden)` before the final norm.
        """
        if ids.ndim != 1 or ids.numel() == 0:
            raise ValueError("forward takes a non-empty 1-D tensor of token ids")
        T = ids.numel()
        if self.captured is not None and self.captured.fits(state, T):
            logits, x = self.captured(self, ids, state)
            state.staged += T
            return logits, x
        start = state.length + state.staged
        x = self.model.embed(ids.to(self.device))
        cos, sin, signed_sin = self.rope(start, start + T, x)
        if self.fused is None:  # the reference layers: the naive twin of the one pass
            embeds = x
            for layer, st in zip(self.model.layers, state.layer_views()):
                x = layer(x, st, start, (cos, sin), embeds)
            logits = self.logits(self.model.norm(x))
        elif self.compiled is not None and self.compiled.fits(state, T):
            logits, x = self.compiled(self, x, state, (cos, signed_sin))
        else:
            logits, x = fused.forward(self, x, (cos, signed_sin), SequenceAccess(state))
        state.staged += T
        return logits, x
