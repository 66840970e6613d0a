"""The token mixers a family's layers are built from, each in its module beside its reference.

A mixer is an `nn.Module` with HF's parameter names and three faces, so that one forward pass serves them all:
- `compiles`: whether its fast path traces into a graph with a symbolic token count (`HybridLM.compile` refuses
  a model with a mixer that does not);
- `state`: which state it holds (`RECURRENT`, `ATTENTION`, or `HYBRID`: both, `deltaspec.shared.state.spec`), so
  the pass knows which of the layer's states to address (a HYBRID mixer gets both, and a pair of indices);
- `forward(h, st, start, rope)`: the reference, on one sequence's state slot (`RecurrentSlot` or `AttnLayerState`,
  or the pair), written plainly: the naive twin the fast path is tested against;
- optionally `prenorm = False` (it norms its own input: the layer hands it the residual stream) and
  `reads_embeds = True` (it takes the pass's embeddings too: `embeds=` in the reference, `StateAccess.embeds` in
  the fast path), both Zamba2's;
- `fuse()` and `fused(f, h, residual, rope, access, index)`: the fast path, on the fused weights `fuse()` made once,
  reaching its state through a `StateAccess` only (a recurrent mixer hands it a `Recurrence`), so the eager,
  compiled, CUDA-graph and batched passes all run it.
"""
