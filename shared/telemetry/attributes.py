"""Span names and attribute keys, in one place (GenAI semantic conventions for the generation span)."""
from __future__ import annotations

# The generation: one root span per generation, as the GenAI conventions name it.
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
OPERATION = "text_completion"
PROVIDER = "deltaspec"

# A round: spans "round" (parent), "propose", "verify", "commit" (or "revert" on the service).
SESSION_ID = "deltaspec.session.id"
ROUND_ID = "deltaspec.round.id"
BASE_VERSION = "deltaspec.round.base_version"
NEW_VERSION = "deltaspec.round.new_version"
DRAFT_TOKENS = "deltaspec.round.draft_tokens"
ACCEPTED_TOKENS = "deltaspec.round.accepted_tokens"
STAGED_BYTES = "deltaspec.round.staged_bytes"
DRAFT_LENGTH_K = "deltaspec.draft_length.k"  # the cost model's k for a round, why, and what it expected at each k
DRAFT_LENGTH_REASON = "deltaspec.draft_length.reason"
DRAFT_LENGTH_ACCEPTANCE = "deltaspec.draft_length.acceptance"
DRAFT_LENGTH_TOKENS_PER_S = "deltaspec.draft_length.expected_tokens_per_s"  # per k = 0, 1, ...
TP_COLLECTIVE_S = "deltaspec.tp.collective_s"  # a round's time in a tensor-parallel group's collectives (rank 0)
LOOP = "deltaspec.loop"  # where the loop ran: in_process | server | client

# The prefix cache, on CreateSession and Generate spans: prompt positions served from it, and those prefilled.
CACHED_TOKENS = "deltaspec.prefix_cache.cached_tokens"
PREFILLED_TOKENS = "deltaspec.prefix_cache.prefilled_tokens"
