"""The layers of a hybrid stack, with HF's parameter names: a decoder layer is a token mixer (the family's, by layer
kind: `deltaspec.shared.model.mixers`) and an MLP (`deltaspec.shared.model.mlp`), each behind its pre-norm, or, in
the layer kinds a family names `post_norm_kinds` (OLMo's attention layers), each followed by its norm; in those it
names in `normed_residual` (MiniMax's), each part adds to its normed input times an alpha rather than to its input.

Every layer works on one sequence `(T, hidden)` and stages its tokens into its slice of a `ModelState` (see
`deltaspec.shared.state.rollback`); none of them changes the committed head. This is the reference path; the fused
path (`deltaspec.shared.model.fused`) runs the same weights in fewer calls.
"""
from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from deltaspec.shared.model.config import ModelConfig
from deltaspec.shared.model.norms import RMSNorm
from deltaspec.shared.state.rollback import LayerView


class DecoderLayer(nn.Module):
    """A token mixer and a channel mixer (MLP), each behind its pre-norm (or, `norm_after`, followed by its norm)
    and added to the residual; a family's layer kind may have only one of them (Nemotron-H's blocks are a Mamba2, an
    attention or an MLP alone). `input_layernorm` is the mixer's norm, `post_attention_layernorm` the MLP's, wherever
    they sit (a post-norm family's `convert` maps its names onto these). A mixer whose `prenorm` is False norms its
    own input (Zamba2's hybrid layer norms the stream plus its shared block's output): the layer has no mixer norm."""

    def __init__(self, cfg: ModelConfig, kind: str, sparse: bool = False) -> None:
        """A layer of kind `kind` (one of the family's `layer_types`), its parts as the family builds them: the
        mixer registered under the family's name for it (`linear_attn`, `self_attn`...). `sparse`: a sparse MoE
        block in place of the dense MLP."""
        super().__init__()
        self.kind = kind
        self.norm_after = kind in cfg.post_norm_kinds
        # (mixer's alpha, MLP's alpha) where the residual is the normed input (MiniMax's), else None
        self.normed_residual = next(((m[0], p[0]) for k, m, p in cfg.normed_residual if k == kind), None)
        self.mixer_name, mixer, mlp = cfg.layer_parts(kind, sparse)
        if mixer is not None:
            self.add_module(self.mixer_name, mixer)
        self.mlp = mlp
        self.prenorm = mixer is not None and getattr(mixer, "prenorm", True)
        if self.prenorm:  # registered in HF's order: mixer, MLP, then the norms
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        if mlp is not None:
            self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)

    @property
    def mixer(self) -> nn.Module | None:
        return getattr(self, self.mixer_name) if self.mixer_name else None

    @property
    def state(self) -> str | None:
        """Which state the layer holds (`RECURRENT`, `ATTENTION`, `HYBRID`: both), None for an MLP alone."""
        mixer = self.mixer
        return None if mixer is None else mixer.state

    def forward(self, x: Tensor, st: LayerView, start: int, rope: tuple[Tensor, Tensor],
                embeds: Tensor | None = None) -> Tensor:
        """`embeds`: the pass's embeddings, which a mixer that `reads_embeds` takes too (Zamba2's shared block)."""
        mixer = self.mixer
        if mixer is not None:
            extra = {"embeds": embeds} if getattr(mixer, "reads_embeds", False) else {}

            def part(h: Tensor) -> Tensor:
                return mixer(h, st, start, rope, **extra)

            x = self._added(0, self.input_layernorm, part, x) if self.prenorm else x + part(x)
        if self.mlp is not None:
            x = self._added(1, self.post_attention_layernorm, self.mlp, x)
        return x

    def _added(self, which: int, norm: nn.Module, part: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        """x plus `part` on the normed x, or plus the normed `part` of x (`norm_after`); with `normed_residual`,
        the normed x times its alpha (of the mixer, `which` 0, or the MLP, 1) plus `part` on it."""
        if self.normed_residual is not None:
            h = norm(x)
            return self.normed_residual[which] * h + part(h)
        return x + (norm(part(x)) if self.norm_after else part(norm(x)))


class HybridStack(nn.Module):
    """The embeddings, the decoder layers and the final norm (HF's `model.*` tensors)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, kind, cfg.sparse(i)) for i, kind in enumerate(cfg.layer_types))
        cfg.share_parts(self.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.embedding_multiplier = cfg.embedding_multiplier

    def embed(self, ids: Tensor) -> Tensor:
        """The embeddings of `ids`, scaled by `embedding_multiplier` (Granite's): what every pass starts from."""
        x = self.embed_tokens(ids)
        return x if self.embedding_multiplier == 1.0 else x * self.embedding_multiplier
