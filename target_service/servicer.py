"""TargetService: convert messages, call the engine (`TargetSession`, `decode`), convert back.

Engine calls are CPU/accelerator-bound, so they run in worker threads; a session's own lock
makes each call atomic. Errors are raised as `deltaspec.shared.errors` classes and become statuses in
`deltaspec.shared.rpc.status`. The target never dials an address or opens a path taken from a request:
its draft peer and its model come from the command line.
"""
from __future__ import annotations

import asyncio
import contextvars
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import grpc
from opentelemetry import trace

from deltaspec.v1 import draft_service_pb2_grpc, sampling_pb2, target_service_pb2_grpc
from deltaspec.v1 import target_service_pb2 as pb
from deltaspec.shared.decoding.batcher import BatchConfig, serving
from deltaspec.shared.decoding.draft_length import COST_MODEL_K_MAX, CostModelLength, PassCosts, Tally, drafting_cost
from deltaspec.shared.decoding.drafters import attach, make_drafter
from deltaspec.shared.decoding.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from deltaspec.shared.decoding.pipelined import decode_adaptive, decode_pipelined
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.decoding.session_table import Limits, SessionTable
from deltaspec.shared.decoding.speculative import Stats, decode
from deltaspec.shared.decoding.target import MAX_DRAFT_TOKENS, Round, TargetSession, check_num_draft_tokens
from deltaspec.shared.decoding.text_stream import TextStream
from deltaspec.shared.errors import InvalidArgument
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.model.tokenizer import Tokenizer, encode_chat
from deltaspec.shared.rpc.convert import probs_from_proto, sampling_from_proto, stats_to_proto
from deltaspec.shared.rpc.remote_drafter import RemoteDrafter
from deltaspec.shared.rpc.security import ClientSecurity, Redialing, caller
from deltaspec.shared.rpc.server import Service, answered_call
from deltaspec.shared.telemetry import Telemetry
from deltaspec.shared.telemetry import attributes as attr

NAME = pb.DESCRIPTOR.services_by_name["TargetService"].full_name
MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS = 16, 256


@dataclass
class DraftPeer:
    """The configured draft service, how long one Propose may take before a round goes on without it, and how
    to dial it (TLS, token)."""

    address: str
    timeout_s: float = 1.0
    security: ClientSecurity = ClientSecurity()


class TargetServicer(target_service_pb2_grpc.TargetServiceServicer):
    def __init__(self, load: Callable[[], tuple[HybridLM, Tokenizer]], limits: Limits = Limits(),
                 draft: DraftPeer | None = None, advertise_address: str = "", telemetry: Telemetry | None = None,
                 local_draft: str = "none", pipeline_depth: int = 1, batching: BatchConfig | None = BatchConfig(),
                 draft_length: str = "fixed", model_name: str = "deltaspec-target") -> None:
        """`draft_length`: 'fixed' (Generate drafts `num_draft_tokens` a round) or 'cost' (k per round, up to
        `num_draft_tokens`, from this server's pass costs measured at load at each batch size, the batch the
        round joins and the session's acceptance: `deltaspec.shared.decoding.draft_length`). `model_name`: what
        GetModel calls the model."""
        if draft_length not in ("fixed", "cost"):
            raise ValueError(f"draft_length is 'fixed' or 'cost', not {draft_length!r}")
        self._load, self.limits, self.draft, self.batching = load, limits, draft, batching
        self.draft_length, self.model_name = draft_length, model_name
        self.pass_costs: PassCosts | None = None  # measured at load with draft_length 'cost'
        self.tally = Tally()  # what the sessions' rounds have shown: where a new session's cost model starts
        self.pipeline_depth = pipeline_depth  # pipelined rounds staged at once per session; Generate pipelines if > 0
        self.local_draft = local_draft  # 'ngram' or 'mtp': drafted in this process when no draft peer is set
        self.advertise_address = advertise_address  # this replica's stable HOST:PORT, returned with each session
        self.sessions: SessionTable[TargetSession] = SessionTable(limits)
        self.telemetry = telemetry or Telemetry()
        self.metrics = self.telemetry.metrics
        self.metrics.watch_sessions([self.sessions])

    def load(self) -> None:
        model, self.tokenizer = self._load()
        self.model = serving(model, self.limits, self.batching, self.metrics,
                             keep_hidden=self.local_draft == "mtp" and self.draft is None)
        self.vocab_size = self.model.config.vocab_size
        self.eos = set(self.model.config.eos_token_id) | set(self.tokenizer.eos_token_ids)
        self.draft_channel = (Redialing(self.draft.security, self.draft.address, self.telemetry.channel)
                              if self.draft else None)  # made again when the client certificate is renewed
        if self.draft_length == "cost" and (self.draft or self.local_draft != "none"):  # nothing to choose without
            self.pass_costs = self._measure_costs(model)

    def _measure_costs(self, model: HybridLM) -> PassCosts:
        """The target's pass times at batch sizes 1, 2, 4, ... up to what one pass may carry (and the pool holds),
        and what drafting a round costs (a remote draft's includes the network round trip), timed on scratch
        sessions."""
        largest = min(self.batching.max_batch if self.batching else 1, model.state_pool.slots)
        batches = sorted({min(2**i, largest) for i in range(largest.bit_length())})
        costs = PassCosts.measure(model, None, COST_MODEL_K_MAX, repeats=3, batches=tuple(batches))
        for size, row in costs.batched:
            print(f"draft length cost model: target pass ms at batch {size}, T = 1..{len(row)}: "
                  + " ".join(f"{1000 * s:.1f}" for s in row), file=sys.stderr, flush=True)
        remote = self._remote_drafter(SamplingParams(), None, COST_MODEL_K_MAX)
        drafter = remote or (make_drafter(self.local_draft, self.model, SamplingParams())
                             if self.local_draft != "none" else None)
        try:
            line = drafting_cost(self.model, drafter) if drafter is not None else (0.0, 0.0)
        finally:
            if remote:
                remote.close()
        if line is None:
            print("draft length cost model: the draft did not answer at start-up: drafting taken as free",
                  file=sys.stderr, flush=True)
            line = (0.0, 0.0)
        print(f"draft length cost model: drafting a round {1000 * line[0]:.2f} ms + {1000 * line[1]:.2f} ms a draft",
              file=sys.stderr, flush=True)
        return replace(costs, draft_fixed_s=line[0], draft_s=line[1])

    def _draft_length(self, asked: int) -> int | CostModelLength:
        """What Generate's loop drafts a round: `asked`, or a cost model choosing up to it."""
        if self.pass_costs is None or not asked:
            return asked
        return CostModelLength(self.pass_costs, batch_size=getattr(self.model, "batch_size", lambda: 1), k_max=asked,
                               tally=self.tally, drafting=getattr(self.model, "drafting_calls", lambda: 0))

    async def CreateSession(self, request: pb.CreateSessionRequest, context) -> pb.CreateSessionResponse:
        prompt, sampling = self._prompt(request), sampling_from_proto(request.sampling)
        self.sessions.reserve(caller())
        session = await asyncio.to_thread(TargetSession, self.model, prompt, sampling, self.pipeline_depth,
                                          answers_sent_by_caller=True, chain_ended=self.metrics.chain_ended)
        _annotate_prefill(len(prompt), session.cached_tokens)
        return pb.CreateSessionResponse(
            session_id=self.sessions.add(session, caller()), head_version=session.version, prompt_ids=prompt,
            vocab_size=self.vocab_size, eos_token_ids=sorted(self.eos), max_draft_tokens=MAX_DRAFT_TOKENS,
            target_address=self.advertise_address, sparse_probs=True, cached_tokens=session.cached_tokens)

    async def ExtendSession(self, request: pb.ExtendSessionRequest, context) -> pb.ExtendSessionResponse:
        with self.sessions.use(request.session_id, caller()) as session:
            if request.append_ids and request.append_text:
                raise InvalidArgument("set one of append_ids and append_text, not both", "append_ids")
            field_name = "append_text" if request.append_text else "append_ids"
            ids = list(request.append_ids) or self.tokenizer.encode(request.append_text)
            if not ids:
                raise InvalidArgument("no tokens to append", field_name)
            self.limits.check_prompt(len(session.tokens) + len(ids), field_name)
            version = await asyncio.to_thread(session.extend, ids, field_name)
            return pb.ExtendSessionResponse(head_version=version, length=len(session.tokens), appended_ids=ids)

    async def Verify(self, request: pb.VerifyRequest, context) -> pb.VerifyResponse:
        with self.sessions.use(request.session_id, caller()) as session:
            probs = probs_from_proto(request, list(request.draft_tokens), self.vocab_size)
            probs = None if session.sampling.greedy else probs  # checked even so: garbage is refused, not ignored
            started = time.perf_counter()
            parent = request.parent_round_id or None
            guess = request.parent_next_token if request.HasField("parent_next_token") else None
            if guess is not None and parent is None:
                raise InvalidArgument("parent_next_token is the token assumed after parent_round_id, which is not "
                                      "set", "parent_next_token")
            rnd = await answered_call(session.answers, session.verify, request.round_id, list(request.draft_tokens),
                                      request.base_version, probs, parent, guess)
            self.metrics.verify_seconds.observe(time.perf_counter() - started)
        _annotate(request.session_id, rnd)
        return pb.VerifyResponse(accepted=rnd.verdict.accepted, next_token=rnd.verdict.next_token,
                                 round=_staged(rnd))

    async def Commit(self, request: pb.CommitRequest, context) -> pb.CommitResponse:
        with self.sessions.use(request.session_id, caller()) as session:
            started = time.perf_counter()
            version, tokens, rnd = await answered_call(session.answers, _commit, session, request.round_id,
                                                       request.accepted)
            if rnd is not None:  # a retry of a commit already made counts nothing
                self.metrics.round(len(rnd.drafts), request.accepted, rnd.staged_bytes,
                                   commit_s=time.perf_counter() - started)
        _annotate(request.session_id, session.find(request.round_id), version)
        return pb.CommitResponse(head_version=version, committed_tokens=tokens)

    async def Revert(self, request: pb.RevertRequest, context) -> pb.RevertResponse:
        with self.sessions.use(request.session_id, caller()) as session:
            rnd = session.find(request.round_id)
            pending = rnd is not None and rnd.outcome == "pending"
            version = await asyncio.to_thread(session.revert, request.round_id)
            if pending:
                self.metrics.reverts.inc()
                self.metrics.staged_bytes.inc(rnd.staged_bytes)  # type: ignore[union-attr]
        _annotate(request.session_id, session.find(request.round_id), version)
        return pb.RevertResponse(head_version=version)

    async def GetSession(self, request: pb.GetSessionRequest, context) -> pb.GetSessionResponse:
        with self.sessions.use(request.session_id, caller()) as session, session.lock:
            pending, chained = session.pending, session.chained
            return pb.GetSessionResponse(
                session_id=request.session_id, length=len(session.tokens), head_version=session.version,
                pending_round=_staged(pending) if pending else None, generated_ids=session.generated,
                text=self.tokenizer.decode(session.generated), chained_round=_staged(chained) if chained else None)

    async def CloseSession(self, request: pb.CloseSessionRequest, context) -> pb.CloseSessionResponse:
        self.sessions.remove(request.session_id, caller())
        return pb.CloseSessionResponse()

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        prompt, sampling = self._prompt(request), sampling_from_proto(request.sampling)
        check_num_draft_tokens(request.num_draft_tokens)
        stops = _stop_strings(request.stop_strings)
        top_logprobs, max_new_tokens = _top_logprobs(request), _max_new_tokens(request, len(prompt))
        eos = set() if request.ignore_eos else self.eos
        owner = caller()
        self.sessions.reserve(owner)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        cancelled, stopped = threading.Event(), threading.Event()  # the caller went away; the text reached a stop
        started = time.perf_counter()

        def run() -> None:  # in a worker thread: the loop, one queue item per round, then the stats
            k = self._draft_length(request.num_draft_tokens)
            remote = self._remote_drafter(sampling, deadline, request.num_draft_tokens,
                                          open_early=isinstance(k, int) or k.expects_drafts())
            try:
                local = self.local_draft if request.num_draft_tokens else "none"
                drafter = remote or make_drafter(local, self.model, sampling)
                drafter.start(list(prompt))  # a remote draft opens its session while the target prefills
                session = TargetSession(self.model, prompt, sampling, self.pipeline_depth,
                                        chain_ended=self.metrics.chain_ended, top_logprobs=top_logprobs)
                attach(drafter, session)
                _annotate_prefill(len(prompt), session.cached_tokens)
                stats = Stats(cached_prompt_tokens=session.cached_tokens)
                session.session_id = self.sessions.add(session, owner)  # type: ignore[attr-defined]
                try:
                    with self.sessions.use(session.session_id, owner):  # type: ignore[attr-defined]
                        # not on top of a dynamic draft length: its rounds end where the draft is unsure, so
                        # speculations rarely hold (measured: pipelined 0.88-0.92x serial at 1 ms of delay)
                        pipelined = bool(remote and self.pipeline_depth and not remote.drafts_dynamically())
                        if isinstance(k, CostModelLength):
                            k.overlapped = pipelined  # its drafting then hides behind the verifies
                        rounds = ((decode_adaptive if isinstance(k, CostModelLength) else decode_pipelined)
                                  if pipelined else decode)
                        emitted = _Emitted(session)
                        for new in rounds(session, drafter, max_new_tokens, k,
                                          eos, stats, self.telemetry.tracer, self.metrics):
                            stats.first_token_seconds = stats.first_token_seconds or time.perf_counter() - started
                            loop.call_soon_threadsafe(queue.put_nowait, emitted.ready(new))
                            if cancelled.is_set():
                                return
                            if stopped.is_set():  # a stop string: the rounds end, the stats still go out
                                break
                        else:
                            loop.call_soon_threadsafe(queue.put_nowait, emitted.ready([]))
                finally:  # the stream's session ends with it (nobody else knows its id): free its slot and state
                    self.sessions.remove(session.session_id, owner)  # type: ignore[attr-defined]
                stats.seconds = time.perf_counter() - started
                n = len(session.generated)
                self.metrics.generation(stats.first_token_seconds,
                                        (stats.seconds - stats.first_token_seconds) / (n - 1) if n > 1 else None)
                loop.call_soon_threadsafe(queue.put_nowait, stats_to_proto(stats, remote.failures if remote else 0))
                session.finish()  # after the last message: caching the history's last block delays no answer
            except Exception as e:  # noqa: BLE001 - handed to the handler, which raises it
                loop.call_soon_threadsafe(queue.put_nowait, e)
            finally:
                if remote:
                    remote.close()

        loop.run_in_executor(None, contextvars.copy_context().run, run)  # the rounds' spans join this call's trace
        text, generated = TextStream(self.tokenizer, stops), []
        try:
            yield pb.GenerateResponse(prompt_ids=prompt)
            while not isinstance(item := await queue.get(), sampling_pb2.GenerationStats):
                if isinstance(item, Exception):
                    raise item
                new, scores = item
                if text.stopped is None and new:  # rounds the loop ran before it saw the stop are dropped
                    ids, piece = text.push(new)
                    generated += ids
                    yield pb.GenerateResponse(token_ids=ids, text=piece, logprobs=self._logprobs(scores[:len(ids)]))
                    if text.stopped is not None:
                        stopped.set()
            reason = (pb.FINISH_REASON_STOP if text.stopped is not None else pb.FINISH_REASON_EOS
                      if generated and generated[-1] in eos else pb.FINISH_REASON_LENGTH)
            yield pb.GenerateResponse(text=text.push([], final=True)[1], stats=item, finish_reason=reason,
                                      stop_string=text.stopped or "")
        finally:
            cancelled.set()

    async def GetModel(self, request: pb.GetModelRequest, context) -> pb.GetModelResponse:
        return pb.GetModelResponse(
            name=self.model_name, max_model_len=self.model.config.raw.get("max_position_embeddings") or 0,
            max_prompt_tokens=self.limits.max_prompt_tokens, vocab_size=self.vocab_size,
            chat_template=self.tokenizer.chat_template is not None)

    def _logprobs(self, scores: list[TokenLogprob]) -> list[pb.TokenLogprob]:
        decode = lambda token: self.tokenizer.decode([token])  # noqa: E731
        return [pb.TokenLogprob(token_id=s.token_id, token=decode(s.token_id), logprob=s.logprob,
                                top_logprobs=[pb.TopLogprob(token_id=t, token=decode(t), logprob=v) for t, v in s.top])
                for s in scores]

    def _remote_drafter(self, sampling: SamplingParams, deadline: float | None, k: int,
                        open_early: bool = True) -> RemoteDrafter | None:
        if self.draft_channel is None or k == 0:
            return None
        return RemoteDrafter(draft_service_pb2_grpc.DraftServiceStub(self.draft_channel.channel()), sampling,
                             self.vocab_size, self.draft.timeout_s, deadline,  # type: ignore[union-attr]
                             open_early=open_early)

    def _prompt(self, request: pb.CreateSessionRequest | pb.GenerateRequest) -> list[int]:
        """The prompt's ids from whichever of prompt_ids, prompt_text and messages is set (exactly one)."""
        given = [name for name in ("prompt_ids", "prompt_text", "messages") if getattr(request, name)]
        if len(given) > 1:
            raise InvalidArgument(f"set one of prompt_ids, prompt_text and messages, not {' and '.join(given)}",
                                  given[0])
        field_name = given[0] if given else "prompt_ids"
        if request.messages:
            prompt = self._chat_prompt(request.messages)
        else:
            prompt = list(request.prompt_ids) or self.tokenizer.encode(request.prompt_text)
        if not prompt:
            raise InvalidArgument("the prompt is empty", field_name)
        self.limits.check_prompt(len(prompt), field_name)
        return prompt

    def _chat_prompt(self, messages: Sequence[pb.ChatMessage]) -> list[int]:
        for i, message in enumerate(messages):
            if not message.role:
                raise InvalidArgument(f"messages[{i}].role is empty", f"messages[{i}].role")
        return encode_chat(self.tokenizer, [{"role": m.role, "content": m.content} for m in messages])


def _stop_strings(stops: Sequence[str]) -> list[str]:
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"{len(stops)} stop strings, the limit is {MAX_STOP_STRINGS}", "stop_strings")
    for i, stop in enumerate(stops):
        if not 0 < len(stop) <= MAX_STOP_STRING_CHARS:
            raise InvalidArgument(f"stop_strings[{i}] has {len(stop)} characters, not 1 to {MAX_STOP_STRING_CHARS}",
                                  "stop_strings")
    return list(stops)


def _max_new_tokens(request: pb.GenerateRequest, prompt_tokens: int) -> int:
    """max_new_tokens, within max_total_tokens when that is set."""
    if not request.max_total_tokens:
        return request.max_new_tokens
    if prompt_tokens >= request.max_total_tokens:
        raise InvalidArgument(f"the prompt has {prompt_tokens} tokens: the context of {request.max_total_tokens} "
                              "leaves no room to generate", "max_total_tokens")
    return min(request.max_new_tokens, request.max_total_tokens - prompt_tokens)


def _top_logprobs(request: pb.GenerateRequest) -> int | None:
    """How many most likely tokens each generated token's log-probability comes with; None: no log-probabilities."""
    if request.top_logprobs and not request.logprobs:
        raise InvalidArgument("top_logprobs needs logprobs", "top_logprobs")
    if request.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"top_logprobs = {request.top_logprobs}, the limit is {MAX_TOP_LOGPROBS}",
                              "top_logprobs")
    return request.top_logprobs if request.logprobs else None


class _Emitted:
    """A Generate loop's rounds as the stream sends them: the tokens, with their log-probabilities when the session
    keeps them. A pipelined round's tokens come out at its verdict, before its commit records their
    log-probabilities, so with log-probabilities tokens wait for their commit (until the next round, or the end)."""

    def __init__(self, session: TargetSession) -> None:
        self.session, self.waiting, self.sent = session, [], 0

    def ready(self, new: list[int]) -> tuple[list[int], list[TokenLogprob]]:
        """What can go out after the loop yielded `new` ([] once the loop is over: everything is committed)."""
        self.waiting += new
        if self.session.top_logprobs is None:
            out, self.waiting = self.waiting, []
            return out, []
        n = min(len(self.waiting), len(self.session.logprobs) - self.sent)
        out, self.waiting = self.waiting[:n], self.waiting[n:]
        scores = self.session.logprobs[self.sent:self.sent + n]
        self.sent += n
        return out, scores


def _commit(session: TargetSession, round_id: str, accepted: int) -> tuple[int, list[int], Round | None]:
    """Commit; the tokens the round appended (also on a retry: nothing moves the head in between), and the
    round when this call committed it (None for a retry)."""
    with session.lock:
        fresh = session.pending is not None and session.pending.round_id == round_id
        version = session.commit(round_id, accepted)
        rnd = session.find(round_id)
        return version, rnd.committed_tokens, rnd if fresh else None  # type: ignore[union-attr]


def _annotate(session_id: str, rnd: Round | None, new_version: int | None = None) -> None:
    """The round's figures on this call's span (a no-op when tracing is off)."""
    span = trace.get_current_span()
    if rnd is None or not span.is_recording():
        return
    span.set_attributes({attr.SESSION_ID: session_id, attr.ROUND_ID: rnd.round_id, attr.BASE_VERSION: rnd.base_version,
                         attr.DRAFT_TOKENS: len(rnd.drafts), attr.ACCEPTED_TOKENS: rnd.committed
                         if rnd.committed is not None else rnd.verdict.accepted, attr.STAGED_BYTES: rnd.staged_bytes})
    if new_version is not None:
        span.set_attribute(attr.NEW_VERSION, new_version)


def _annotate_prefill(prompt_tokens: int, cached_tokens: int) -> None:
    """How much of the prompt the prefix cache served, on this call's span (a no-op when tracing is off)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({attr.CACHED_TOKENS: cached_tokens, attr.PREFILLED_TOKENS: prompt_tokens - 1 - cached_tokens})


def _staged(rnd: Round) -> pb.StagedRound:
    return pb.StagedRound(round_id=rnd.round_id, base_version=rnd.base_version, draft_count=len(rnd.drafts),
                          staged_bytes=rnd.staged_bytes, parent_round_id=rnd.parent or "")


def service(load: Callable[[], tuple[HybridLM, Tokenizer]], limits: Limits = Limits(),
            draft: DraftPeer | None = None, advertise_address: str = "", telemetry: Telemetry | None = None,
            local_draft: str = "none", pipeline_depth: int = 1, batching: BatchConfig | None = BatchConfig(),
            draft_length: str = "fixed", model_name: str = "deltaspec-target") -> Service:
    servicer = TargetServicer(load, limits, draft, advertise_address, telemetry, local_draft, pipeline_depth, batching,
                              draft_length, model_name)
    return Service(NAME, lambda server: target_service_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server),
                   servicer.load)
