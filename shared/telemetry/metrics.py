"""Prometheus metrics of one server, in a registry of its own (several servers can share a process).

Speculative-decoding counters are named as vLLM's (`vllm:spec_decode_num_drafts` ...):
- `deltaspec_spec_decode_num_drafts_total`: rounds that carried at least one draft token
- `deltaspec_spec_decode_num_draft_tokens_total`, `..._num_accepted_tokens_total`
- `deltaspec_spec_decode_num_accepted_tokens_per_pos_total{position}`: rounds whose draft token at
  `position` (0-based) was kept
Rounds: `deltaspec_round_{propose,verify,commit}_seconds` histograms, `deltaspec_commits_total`,
`deltaspec_reverts_total`, `deltaspec_staged_bytes_total`; on rank 0 of a tensor-parallel group
`deltaspec_tp_collective_seconds`, a round's time in the group's all-reduces and broadcasts (its verify and
commit). Pipelined rounds (staged on a pending round):
`deltaspec_pipelined_rounds_total{outcome}`, kept | dropped | reverted: kept over all is the pipeline's hit
rate; `deltaspec_generate_speculations_total{outcome}`, kept | missed: per round of the server-side loop,
whether the speculated next round was used (the client loop reports the same in its stats). The draft's
`deltaspec_draft_speculations_total{outcome}`, kept | dropped: the speculative rounds it
proposed and how they ended (dropped ones are draft passes spent for nothing);
`deltaspec_draft_length_rounds_total{k, reason}`: the cost model's draft length per round, and why.
`deltaspec_draft_branches_total{outcome}` and `deltaspec_draft_branch_seconds_total{outcome}`, used | unused | cut:
the next rounds it staged for likely misses (`serve-draft --branches`), and its time making them. Generations (the
server-side loop):
`deltaspec_time_to_first_token_seconds`, `deltaspec_time_per_output_token_seconds`. Sessions:
`deltaspec_sessions` (live) and `deltaspec_sessions_expired_total`. Batching (`deltaspec.shared.decoding.batcher`):
`deltaspec_batch_size` (sequences per forward pass), `deltaspec_batch_tokens`, `deltaspec_batch_wait_seconds`
(how long a pass's first call waited for others) and `deltaspec_batch_pass_seconds`. Session state
(`deltaspec.shared.state.pool`): `deltaspec_state_memory_budget_bytes`, `deltaspec_state_memory_used_bytes`
(GDN slots in use and attention K/V), `deltaspec_state_slots`, `deltaspec_state_slots_in_use` and
`deltaspec_state_memory_refusals_total` (admissions and K/V growths refused for want of memory). Prefix cache
(`deltaspec.shared.state.prefix_cache`): `deltaspec_prefix_cache_{hits,misses,tokens,prefilled_tokens,evictions}_total`,
`deltaspec_prefix_cache_{entries,bytes,block_tokens}` and `deltaspec_prefix_cache_root_tokens{root}`.
"""
from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], Counter] = {}  # `_child`
        r = self.registry
        self.num_drafts = Counter("deltaspec_spec_decode_num_drafts", "Rounds that carried draft tokens", registry=r)
        self.num_draft_tokens = Counter("deltaspec_spec_decode_num_draft_tokens", "Draft tokens proposed",
                                        registry=r)
        self.num_accepted_tokens = Counter("deltaspec_spec_decode_num_accepted_tokens", "Draft tokens kept",
                                           registry=r)
        self.accepted_per_pos = Counter("deltaspec_spec_decode_num_accepted_tokens_per_pos",
                                        "Rounds whose draft token at this position was kept", ["position"],
                                        registry=r)
        self.propose_seconds = Histogram("deltaspec_round_propose_seconds", "Draft proposal time per round",
                                         buckets=PHASE_BUCKETS, registry=r)
        self.verify_seconds = Histogram("deltaspec_round_verify_seconds", "Target verify time per round",
                                        buckets=PHASE_BUCKETS, registry=r)
        self.commit_seconds = Histogram("deltaspec_round_commit_seconds", "Target commit time per round",
                                        buckets=PHASE_BUCKETS, registry=r)
        self.collective_seconds = Histogram("deltaspec_tp_collective_seconds", "Rank 0's time in the tensor-parallel "
                                            "group's all-reduces and broadcasts per round (its verify and commit)",
                                            buckets=PHASE_BUCKETS, registry=r)
        self.commits = Counter("deltaspec_commits", "Rounds committed", registry=r)
        self.reverts = Counter("deltaspec_reverts", "Rounds reverted", registry=r)
        self.staged_bytes = Counter("deltaspec_staged_bytes", "Bytes staged for rollback", registry=r)
        self.draft_speculations = Counter("deltaspec_draft_speculations", "Speculative rounds the draft proposed, "
                                          "by how they ended: kept (they became the open round) or dropped (the "
                                          "round below missed, or a plain proposal came)", ["outcome"], registry=r)
        self.draft_branches = Counter("deltaspec_draft_branches", "Next rounds the draft staged for a likely miss "
                                      "of the open round (serve-draft --branches), by how they ended: used (the miss "
                                      "came; its proposal was answered without a forward pass), unused, or cut "
                                      "(a request came while it was made)", ["outcome"], registry=r)
        self.draft_branch_seconds = Counter("deltaspec_draft_branch_seconds", "The draft's time making branches, by "
                                            "how they ended: the cost beside the gain", ["outcome"], registry=r)
        self.pipelined_rounds = Counter("deltaspec_pipelined_rounds", "Pipelined rounds staged on a pending one, "
                                        "by how they ended: kept, dropped (their parent missed) or reverted",
                                        ["outcome"], registry=r)
        self.generate_speculations = Counter(
            "deltaspec_generate_speculations", "Rounds of the server-side loop (Generate) whose next round had been "
            "speculated, by whether it was kept or made afresh (the client loop reports its own in its stats)",
            ["outcome"], registry=r)
        self.draft_length = Counter("deltaspec_draft_length_rounds", "Rounds of the cost model's draft length "
                                    "(--draft-length cost), by the drafts it made and why: pays, doubt (the estimate "
                                    "says none pays, but the session's rounds have not shown it yet), none pays "
                                    "(k = 0), probe (one draft to see whether the acceptance came back) or capped (by "
                                    "the request)",
                                    ["k", "reason"], registry=r)
        self.ttft = Histogram("deltaspec_time_to_first_token_seconds", "Request to first generated token",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.tpot = Histogram("deltaspec_time_per_output_token_seconds", "Mean time per token after the first",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.batch_size = Histogram("deltaspec_batch_size", "Sequences in one forward pass", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.batch_tokens = Histogram("deltaspec_batch_tokens", "Tokens in one forward pass",
                                      buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), registry=r)
        self.batch_wait = Histogram("deltaspec_batch_wait_seconds", "Time a pass's first call waited for others",
                                    buckets=PHASE_BUCKETS, registry=r)
        self.batch_pass = Histogram("deltaspec_batch_pass_seconds", "Time of one batched forward pass",
                                    buckets=PHASE_BUCKETS, registry=r)

    def batch(self, size: int, tokens: int, wait_s: float, pass_s: float) -> None:
        self.batch_size.observe(size)
        self.batch_tokens.observe(tokens)
        self.batch_wait.observe(wait_s)
        self.batch_pass.observe(pass_s)

    def round(self, drafted: int, accepted: int, staged_bytes: int, propose_s: float | None = None,
              verify_s: float | None = None, commit_s: float | None = None, collective_s: float = 0.0) -> None:
        """One committed round (the loop, or a Commit call: then verify and staging were counted before);
        `collective_s`: its time in a tensor-parallel group's collectives (0: no group)."""
        if drafted:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(drafted)
        if accepted:
            self.num_accepted_tokens.inc(accepted)
            for position in range(accepted):
                self._child(self.accepted_per_pos, str(position)).inc()
        self.commits.inc()
        if staged_bytes:
            self.staged_bytes.inc(staged_bytes)
        if collective_s:
            self.collective_seconds.observe(collective_s)
        for histogram, seconds in ((self.propose_seconds, propose_s), (self.verify_seconds, verify_s),
                                   (self.commit_seconds, commit_s)):
            if seconds is not None:
                histogram.observe(seconds)

    def draft_length_chosen(self, k: int, reason: str) -> None:
        self._child(self.draft_length, str(k), reason).inc()

    def _child(self, metric: Counter, *values: str) -> Counter:
        """`metric.labels(*values)`, looked up once (prometheus_client validates and locks on every `labels` call:
        a round of 7 kept drafts made 8 of them)."""
        key = id(metric), values
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def speculation_ended(self, outcome: str, n: int = 1) -> None:
        """Draft speculations ended: kept or dropped (`ModelDrafter`'s `speculation_ended`)."""
        self.draft_speculations.labels(outcome).inc(n)

    def branch_ended(self, outcome: str, seconds: float) -> None:
        """A draft's branch ended: used, unused or cut (`ModelDrafter`'s `branch_ended`), and its drafting time."""
        self.draft_branches.labels(outcome).inc()
        self.draft_branch_seconds.labels(outcome).inc(seconds)

    def chain_ended(self, outcome: str) -> None:
        """A pipelined round ended: kept, dropped or reverted (`TargetSession`'s `chain_ended`)."""
        self.pipelined_rounds.labels(outcome).inc()

    def speculation_used(self, kept: bool) -> None:
        """A pipelined round of the server-side loop ended; its speculated successor was kept or not."""
        self.generate_speculations.labels("kept" if kept else "missed").inc()

    def generation(self, first_token_s: float | None, per_output_token_s: float | None) -> None:
        if first_token_s is not None:
            self.ttft.observe(first_token_s)
        if per_output_token_s is not None:
            self.tpot.observe(per_output_token_s)

    def watch_sessions(self, tables: Iterable) -> None:
        """Live and expired sessions, read from session tables (`len()`, `.expired`) at scrape time."""
        self.registry.register(_SessionCollector(list(tables)))

    def watch_state_pool(self, pool) -> None:
        """A `deltaspec.shared.state.pool.StatePool`'s budget, use and refusals, read at scrape time."""
        self.registry.register(_StatePoolCollector(pool))

    def watch_prefix_cache(self, cache) -> None:
        """A `deltaspec.shared.state.prefix_cache.PrefixCache`'s counters and size, read at scrape time."""
        self.registry.register(_PrefixCacheCollector(cache))

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """`/metrics` over HTTP on a daemon thread; returns the bound port (0 picks one)."""
        httpd, _ = start_http_server(port, host, registry=self.registry)
        return httpd.server_port


class _SessionCollector:
    def __init__(self, tables: list) -> None:
        self.tables = tables

    def collect(self):
        live = GaugeMetricFamily("deltaspec_sessions", "Open sessions")
        live.add_metric([], sum(len(t) for t in self.tables))
        expired = CounterMetricFamily("deltaspec_sessions_expired", "Sessions closed by the idle timeout")
        expired.add_metric([], sum(t.expired for t in self.tables))
        return [live, expired]

    def describe(self):
        return []


class _StatePoolCollector:
    def __init__(self, pool) -> None:
        self.pool = pool

    def collect(self):
        pool = self.pool
        gauges = {"deltaspec_state_memory_budget_bytes": ("Session state memory budget (GDN slots + attention K/V)",
                                                          pool.budget),
                  "deltaspec_state_memory_used_bytes": ("Session state memory in use (GDN slots in use + K/V)",
                                                        pool.in_use * pool.recurrent_bytes + pool.kv_used),
                  "deltaspec_state_slots": ("Session state slots", pool.slots),
                  "deltaspec_state_slots_in_use": ("Session state slots in use", pool.in_use)}
        refused = CounterMetricFamily("deltaspec_state_memory_refusals",
                                      "Admissions and K/V growths refused for want of state memory")
        refused.add_metric([], pool.refusals)
        return [GaugeMetricFamily(name, text, value=value) for name, (text, value) in gauges.items()] + [refused]

    def describe(self):
        return []


class _PrefixCacheCollector:
    """The prefix cache's counters, and per cached first block (`root`: its key's hex, which
    `deltaspec.shared.state.prefix_cache.block_key` computes from the ids) the most positions cached below it: what a
    cache-aware router reads to send a prompt to the replica that holds its prefix. At most `MAX_ROOTS` roots, the
    deepest first, so a scrape stays small."""

    MAX_ROOTS = 64

    def __init__(self, cache) -> None:
        self.cache = cache

    def collect(self):
        cache, stats = self.cache, self.cache.stats
        counters = {"deltaspec_prefix_cache_hits": ("Lookups that found at least one cached block", stats.hits),
                    "deltaspec_prefix_cache_misses": ("Lookups that found none", stats.lookups - stats.hits),
                    "deltaspec_prefix_cache_tokens": ("Prompt positions served from the cache", stats.cached_tokens),
                    "deltaspec_prefix_cache_prefilled_tokens": ("Prompt positions prefilled by sequences that "
                                                                "looked up", stats.prefilled_tokens),
                    "deltaspec_prefix_cache_evictions": ("Entries evicted", stats.evictions)}
        families = []
        for name, (text, value) in counters.items():
            family = CounterMetricFamily(name, text)
            family.add_metric([], value)
            families.append(family)
        families += [GaugeMetricFamily("deltaspec_prefix_cache_entries", "Cached blocks", value=len(cache.entries)),
                     GaugeMetricFamily("deltaspec_prefix_cache_bytes", "Bytes the cached blocks hold (part of the "
                                       "state memory budget)", value=cache.bytes),
                     GaugeMetricFamily("deltaspec_prefix_cache_states", "Cached blocks holding a GDN state "
                                       "(where a sequence can resume)",
                                       value=cache.states()),
                     GaugeMetricFamily("deltaspec_prefix_cache_block_tokens", "Tokens per cached block",
                                       value=cache.block)]
        roots = GaugeMetricFamily("deltaspec_prefix_cache_root_tokens", "Most positions cached below a first block",
                                  labels=["root"])
        for root, tokens in sorted(cache.roots().items(), key=lambda kv: -kv[1])[:self.MAX_ROOTS]:
            roots.add_metric([root], tokens)
        return families + [roots]

    def describe(self):
        return []
