"""The engine: requests in, tokens out. ``step()`` is schedule -> run -> postprocess.

Overlap schedule: a step is launched (JAX dispatches it asynchronously) and its results are
read during the *next* ``step()`` call, so the host prepares step N+1 while the device runs
step N. When step N is a plain decode step, step N+1 is even scheduled before N's tokens are
known: each request carries its unread token as a placeholder (``Req.pending``) that the
device fills in from N's sampled ids. That look-ahead is taken only when nothing in it can
depend on N's results: no request waiting (no admission), a free page in every pool for
each running request (no eviction of running state, no retraction), and room below the
context length. With speculative decoding, step N is no verify step (a verify step is not
decode-only) and step N+1 would not verify whatever its drafts (``draft_policy.wont_verify``):
a draft follows a request's last token, so a step planned ahead carries none. A request
that finishes at N (a stop token, a stop string) has then been run once more at N+1; that
extra token is discarded, so outputs are the same as without overlap.
``disable_overlap_schedule`` reads every step before scheduling the next.

A request whose own host-side work fails (packing its row of the step, its postprocessing)
fails alone: it is dropped from the batch (its pages released, nothing cached) and
finished as aborted with the error, and the step goes on with the others
(``_fail_request``). At launch nothing has touched the device yet, so the step is simply
built again without its row; a row of step N+1 planned ahead leaves step N in flight with
it, whose token for the dropped request is then skipped as an aborted request's is. Only
what cannot be laid on one request, the jitted step itself or the cache's bookkeeping,
fails the whole batch (``_step_failed``).

A batch with a grammar-constrained request does not look ahead: the request's next token
mask (``hicache_jax/grammar``) depends on the token step N samples, so step N+1 is built
once N is read. (The alternative, a forward launched ahead with the sampling split off to
wait for the mask, would double the step programs; the host's mask work is a millisecond.)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import random
import time
import uuid
from collections.abc import Callable
from typing import NoReturn

from hicache_jax import finish
from hicache_jax.config import EngineConfig
from hicache_jax.engine import compile_cache
from hicache_jax.engine.build import (
    attach_drafter,
    check_model_tp,
    context_length,
    load_model_and_tokenizer,
    make_builder,
    make_cache_side,
    make_device_pools,
    make_runner,
    prefix_rules,
    set_kv_dtype,
    verify_overhead_rows,
)
from hicache_jax.engine.failures import EngineStalled, StepFailed
from hicache_jax.engine.flush_result import FlushResult, close_tiers, flush_tiers
from hicache_jax.engine.outputs import OutputDelta, OutputStream, format_output, output_text
from hicache_jax.engine.step_results import ENGINE_COUNTERS, append_token, record_input_logprobs, stop_reason
from hicache_jax.engine.validation import (
    validate_cache_salt,
    validate_prompt,
    validate_rid,
    validate_sampling,
)
from hicache_jax.engine.warmup import WarmupReport, warmup
from hicache_jax.grammar.compiler import GrammarCompiler
from hicache_jax.grammar.constraint import Constraint, dead_end
from hicache_jax.grammar.spec import spec_of
from hicache_jax.metric_kinds import Metrics
from hicache_jax.models.causal_lm import CausalLM
from hicache_jax.models.tokenizer import Tokenizer
from hicache_jax.request import Req, Status
from hicache_jax.runtime import penalties
from hicache_jax.runtime.batch_builder import RowFailed
from hicache_jax.runtime.step_inputs import StepInputs
from hicache_jax.sampling_params import InvalidRequest, QueueFull, SamplingParams
from hicache_jax.scheduler.draft_policy import wont_verify, worth_verifying
from hicache_jax.scheduler.drafts import add_drafts
from hicache_jax.scheduler.l3_prefetch import PrefetchDecisions
from hicache_jax.scheduler.plan import StepPlan
from hicache_jax.scheduler.scheduler import OutOfMemory
from hicache_jax.speculative.drafters import MtpDrafter, make_drafter
from hicache_jax.speculative.mtp_pages import reserve_chain

log = logging.getLogger(__name__)

STALL_STEPS = 100  # steps with work queued, nothing in flight and nothing scheduled


@dataclasses.dataclass
class Launched:
    """A step on the device whose results nobody has read yet."""

    plan: StepPlan
    out: object  # SamplingOutputs of device arrays
    ids: object  # its sampled ids padded to max_seqs (the next step's feed)
    first_rows: tuple[int, ...]  # per item: its first token row (``StepInputs``)
    sample_rows: tuple[int, ...]  # per item: its first sampled row


class Engine:
    """Satisfies ``EngineAPI`` (``engine/interface.py``): the calls the server makes."""

    def __init__(
        self,
        cfg: EngineConfig,
        model: CausalLM | None = None,
        tokenizer: Tokenizer | None = None,
        *,
        check_plan: Callable[[int, object], None] | None = None,
    ):
        """``check_plan``: the runner's per-step hook (``ModelRunner``); several processes
        pass ``multihost/distributed.check_plan`` (``serve.py``)."""
        compile_cache.configure(cfg.compilation_cache_dir)  # before anything compiles
        if model is None:
            model, tokenizer = load_model_and_tokenizer(cfg)
        check_model_tp(cfg, model)
        self.cfg = cfg
        self.model = model
        self.tokenizer = tokenizer or Tokenizer(None)
        self.drafter = make_drafter(cfg, model.cfg)  # speculative decoding (None: off)
        if isinstance(self.drafter, MtpDrafter):  # its KV: one more layer in every tier
            attach_drafter(cfg, model)
        set_kv_dtype(cfg, model)  # before anything allocates pages
        self._overhead_rows = verify_overhead_rows(cfg)  # the draft policy's (draft_policy.py)
        self._verify_gate = functools.partial(worth_verifying, overhead_rows=self._overhead_rows)
        mc = model.cfg
        self.context_len = context_length(cfg, mc)
        pools = make_device_pools(cfg, mc)
        self.rules = prefix_rules(cfg, mc)
        self.runner = make_runner(cfg, model, pools, check_plan=check_plan)
        self.side = side = make_cache_side(cfg, model, self.runner, pools, self.rules)
        self.prefix_cache, self.storage = side.prefix_cache, side.storage
        self.adapter, self.scheduler = side.adapter, side.scheduler
        self.builder = make_builder(cfg, mc, self.context_len)
        self.penalty_slots = penalties.Slots(self.runner.num_penalty_slots)
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size, mc.eos_token_ids)
        self.requests: dict[str, Req] = {}
        self._keys = itertools.count()
        self._idle_steps = 0
        self._inflight: Launched | None = None
        self._failed: list[Req] = []  # requests failed alone by this step (``_fail_request``)
        self.broken: BaseException | None = None  # a failed step's cause, until recover()
        self._rng = random.Random(cfg.random_seed)
        self.stats = Metrics().counters(dict.fromkeys(ENGINE_COUNTERS, 0))
        if cfg.warmup:
            self.warmup()

    # ---- requests ---------------------------------------------------------------------------
    def compile_grammar(self, sampling_params: SamplingParams | dict | None) -> None:
        """Compile a request's grammar, if it has one, so that ``add_request`` finds it
        compiled (``GrammarCompiler`` is thread-safe: the server calls this on a worker)."""
        self.grammars.compile_params(sampling_params)

    def add_request(
        self,
        input_ids: list[int] | None = None,
        text: str | None = None,
        sampling_params: SamplingParams | dict | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        cache_salt: str | None = None,
        stream: bool = False,
        after: str | None = None,
        group: str | None = None,
        handover: dict | None = None,
    ) -> str:
        """Validate and queue a request; raises InvalidRequest naming the bad field.
        ``after``: the rid of a queued request with the same prompt (an earlier choice of
        an ``n > 1`` request); this one is admitted only once that one has computed the
        prompt, so it takes the prompt's pages from the radix tree instead of computing it.
        ``group``: the parent request of the n choices of one ``n > 1`` request (``Req.group``).
        ``handover``: a decode server's record of the prompt's handover (``Req.handover``)."""
        input_ids, sp = self.check_request(
            input_ids, text, sampling_params, rid, logprob_start_len, top_logprobs_num, cache_salt
        )
        rid = rid or uuid.uuid4().hex
        if rid in self.requests:
            raise InvalidRequest(f"rid {rid!r} is already in use")
        spec = spec_of(sp)  # compiled already when the server queued it (``GrammarCompiler``)
        grammar = Constraint(self.grammars.matcher(spec)) if spec is not None else None
        limit = self.cfg.queued_token_limit
        if self.scheduler.queued_tokens + len(input_ids) > limit:
            raise QueueFull(
                f"the queue holds {self.scheduler.queued_tokens} prompt tokens; this request's "
                f"{len(input_ids)} would pass max_queued_tokens={limit}: retry later"
            )
        req = Req(
            rid=rid,
            input_ids=input_ids,
            sampling=sp,
            return_logprob=bool(return_logprob),
            logprob_start_len=logprob_start_len if return_logprob else -1,
            top_logprobs_num=top_logprobs_num if return_logprob else 0,
            cache_salt=cache_salt,
            seed=sp.seed if sp.seed is not None else self._rng.getrandbits(31),
            stream=stream,
            prefetch_key=f"{rid}#{next(self._keys)}",
            after=None if self.cfg.disable_radix_cache else self.requests.get(after),
            grammar=grammar,
            group=group,
            handover=handover,
        )
        self.requests[rid] = req
        self.scheduler.add(req)  # and its L3 prefetch starts
        return rid

    def check_request(
        self,
        input_ids: list[int] | None = None,
        text: str | None = None,
        sampling_params: SamplingParams | dict | None = None,
        rid: str | None = None,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        cache_salt: str | None = None,
    ) -> tuple[list[int], SamplingParams]:
        """``add_request``'s checks alone: (the prompt's ids, its sampling), or InvalidRequest
        naming the bad field. Reads only what is fixed at start (the model, the tokenizer,
        the pool sizes), so any thread may call it: a decode server refuses a bad request
        before it waits for the prompt's handover (``server/disaggregation.py``)."""
        validate_rid(rid)
        validate_cache_salt(cache_salt)
        sp = SamplingParams.from_dict(sampling_params)
        mc = self.model.cfg
        validate_sampling(sp, vocab_size=mc.vocab_size, eos_token_ids=mc.eos_token_ids)
        input_ids = validate_prompt(
            input_ids,
            text,
            sp,
            self.tokenizer,
            vocab_size=mc.vocab_size,
            context_len=self.context_len,
            capacity=self.prefix_cache.sequence_capacity(),
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
        )
        return input_ids, sp

    def abort(self, rid: str) -> bool:
        req = self.scheduler.abort(rid)
        if req is None:
            return False
        self._finish(req, finish.abort("aborted"))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    # ---- the loop --------------------------------------------------------------------------
    def step(self, prefetch: PrefetchDecisions | None = None) -> list[Req]:
        """Run one batch; returns requests that finished or produced tokens this step.
        ``prefetch``: what L3 prefetching brought, decided elsewhere (by process 0 when
        several processes serve; see multihost/replicated.py); by default decided here.

        Raises ``StepFailed`` after a step failed (its running requests are failed, the
        device state rebuilt: the next step serves again) and ``EngineStalled`` when work is
        queued but nothing could be scheduled for ``STALL_STEPS`` steps."""
        if self.broken is not None:
            self.recover()
        self._failed = []
        prev, self._inflight = self._inflight, None
        touched: list[Req] = []
        if prev is not None and not self._can_run_ahead(prev):
            touched, prev = self._complete(prev), None
        if prefetch is None:
            prefetch = self.prefetch_decisions()
        try:
            plan = self.scheduler.schedule(prefetch)
        except OutOfMemory as e:  # the request cannot fit even alone: fail it, not the engine
            self.scheduler.drop(e.req)
            self._finish(e.req, finish.abort(str(e)))
            return touched + [e.req]
        except Exception as e:  # e.g. an L2 -> L1 load (it donates the device cache)
            self._step_failed(e)
        if plan is not None and self.drafter is not None:
            add_drafts(
                plan,
                self.adapter,
                self.drafter,
                width=self.cfg.spec_width,
                context_len=self.context_len,
                gate=self._verify_gate,
            )
            if isinstance(self.drafter, MtpDrafter):  # pages for the next draft's chain
                reserve_chain(plan, self.adapter, self.runner.draft_steps, self.context_len)
        if plan is not None:
            self._idle_steps = 0
            self.stats["overlapped_steps"] += prev is not None
            try:
                self._inflight = self._launch(plan, prev)
            except Exception as e:
                self._step_failed(e)
        transfer = self.prefix_cache.transfer
        if transfer is not None and transfer.pending():  # loaded, but no step took them
            transfer.flush()
        if prev is not None:
            touched = self._complete(prev)
        elif plan is None and not touched:
            self._idle(0.01)
        return touched + [r for r in self._failed if r not in touched]

    def prefetch_decisions(self) -> PrefetchDecisions:
        """What the L3 prefetch brought since the last step, and who still waits for it."""
        return self.scheduler.prefetch_decisions()

    def sync(self) -> list[Req]:
        """Read the step in flight, if any (its requests as ``step`` returns them)."""
        prev, self._inflight = self._inflight, None
        return self._complete(prev) if prev is not None else []

    def _can_run_ahead(self, prev: Launched) -> bool:
        """Whether the next step can be planned before ``prev``'s tokens are read."""
        running = self.scheduler.running
        if self.cfg.disable_overlap_schedule or self.scheduler.waiting or not prev.plan.decode_only:
            return False
        drafter = self.drafter
        if drafter is not None and not wont_verify(
            # A drafter that cannot tell (no ``may_draft_next``) may draft after any token.
            running,
            self.cfg.spec_width,
            self._overhead_rows,
            getattr(drafter, "may_draft_next", None),
        ):
            return False  # a draft follows the last token: only a step that would not verify goes ahead
        if len(prev.plan.items) != len(running) or any(i.req not in running for i in prev.plan.items):
            return False
        if any(r.seq_len + 1 >= self.context_len for r in running):
            return False
        if any(r.grammar is not None for r in running):  # its next mask needs the token in flight
            return False
        pages = 1  # per request: its next token's
        if isinstance(self.drafter, MtpDrafter):  # and its MTP chain's (``reserve_chain``)
            pages += -(-(self.runner.draft_steps - 1) // self.adapter.P)
        return self.prefix_cache.has_free_pages(pages * len(running))

    def _launch(self, plan: StepPlan, prev: Launched | None) -> Launched | None:
        """Build and dispatch ``plan``'s step; None when every row failed (``_pack``)."""
        reqs = [item.req for item in plan.items]  # each with a penalty gets a slot (runtime/penalties.py)
        self.penalty_slots.assign_all(reqs, self.runner.write_penalty_row, self.model.cfg.vocab_size)
        inputs = self._pack(plan, prev)
        if inputs is None:
            return None
        transfer = self.prefix_cache.transfer
        if transfer is not None and transfer.pending():  # L2 pages for this step's prefills
            if plan.decode_only or plan.verify:
                transfer.flush()
            else:
                inputs = inputs.with_loads(transfer.step_loads())
                self.stats["host_loads_layerwise"] += transfer.layerwise_pages
        prev_ids = None if prev is None else prev.ids
        out, ids = self.runner.launch(inputs, prev_ids)
        self.stats["steps"] += 1
        for item in plan.items:  # the state after this step, as far as the host can know it
            item.req.num_computed = item.end - len(item.draft)  # a draft counts once accepted
            if item.samples:
                item.req.pending += 1
        return Launched(plan, out, ids, inputs.first_rows, inputs.sample_rows)

    def _pack(self, plan: StepPlan, prev: Launched | None) -> StepInputs | None:
        """The step's inputs (``BatchBuilder.build``). A row that cannot be packed
        (``RowFailed``) fails its request alone, and the step is packed again without it;
        None when no row is left."""
        feed_from = {item.req: s for s, item in enumerate(prev.plan.items)} if prev is not None else None
        while plan.items:
            try:
                return self.builder.build(plan, feed_from=feed_from)
            except RowFailed as e:
                self._fail_request(e.req, str(e), plan)
        return None

    def _fail_request(self, req: Req, message: str, plan: StepPlan | None = None) -> None:
        """Fail one running request alone: out of ``plan`` (the step being built) with its
        recurrent state copies, out of the batch with its pages released and nothing cached
        (``Scheduler.drop``), finished as aborted with ``message``. A step in flight that
        runs it too skips its token, as for any aborted request."""
        log.warning("request %s failed alone: %s", req.rid, message)
        if plan is not None:
            plan.items = [item for item in plan.items if item.req is not req]
            slot = req.cache.state_slot  # a working state slot is one request's alone
            if slot is not None:
                plan.copies_before = [c for c in plan.copies_before if c[1] != slot]
                plan.copies_after = [c for c in plan.copies_after if c[0] != slot]
        self.scheduler.drop(req)
        req.pending = 0
        self._finish(req, finish.abort(message))
        self.stats["request_errors"] += 1
        self._failed.append(req)

    def _complete(self, launched: Launched) -> list[Req]:
        """Read a launched step's results and apply them."""
        try:
            out = self.runner.fetch(launched.out)
            touched = self._postprocess(launched, out)
            if self.prefix_cache.host:
                self.prefix_cache.backup_pending()  # write policy: device -> host (-> L3)
        except Exception as e:
            self._step_failed(e)
        return touched

    def _idle(self, timeout: float) -> None:
        if self.scheduler.waiting_on_storage():
            self._idle_steps = 0
            self.scheduler.wait_for_storage(timeout)  # only requests waiting on L3: sleep until one lands
            return
        self._idle_steps += 1
        if self._idle_steps >= STALL_STEPS and self.scheduler.has_work():
            self._idle_steps = 0
            raise EngineStalled(
                f"no progress in {STALL_STEPS} steps: {len(self.scheduler.running)} running "
                f"{[(r.rid, r.num_computed, len(r.fill_ids)) for r in self.scheduler.running][:8]}, "
                f"{len(self.scheduler.waiting)} waiting; {self.adapter.describe_pools()}"
            )

    def _step_failed(self, cause: Exception) -> NoReturn:
        """Fail the running requests, rebuild the device state, raise ``StepFailed``."""
        message = f"engine step failed: {type(cause).__name__}: {cause}"
        log.error(
            "%s; failing %d running requests and rebuilding device state",
            message,
            len(self.scheduler.running),
        )
        failed = []
        self._inflight = None
        self.stats["failed_steps"] += 1
        for req in self.scheduler.drop_all():  # nothing goes to the tree: pages are suspect
            self._finish(req, finish.abort(message))
            failed.append(req.rid)
        self.broken = cause
        try:
            self.recover()
        except Exception:  # stays broken: the next step (or the server loop) tries again
            log.exception("rebuilding device state failed")
        raise StepFailed(failed, message) from cause

    def recover(self) -> None:
        """Rebuild device state after a failed step: L1 emptied, tree entries that pointed
        at device pages dropped (host copies stay), fresh device arrays. Waiting requests
        are kept; they start over from whatever L2/L3 still hold."""
        if self.scheduler.running:
            raise RuntimeError(f"recover() with {len(self.scheduler.running)} requests still running")
        if any(r.num_computed or r.cache.last_node is not None for r in self.scheduler.waiting):
            raise RuntimeError("recover() while a waiting request holds cache state")
        self.prefix_cache.drop_device()
        if self.prefix_cache.transfer is not None:
            self.prefix_cache.transfer.discard()
        self.runner.reset_cache()
        self.penalty_slots.reset()
        self.broken = None
        log.info("device state rebuilt; serving again")

    def _postprocess(self, launched: Launched, out) -> list[Req]:
        touched = []
        now = time.monotonic()
        for s, item in enumerate(launched.plan.items):
            req = item.req
            if req.status is not Status.RUNNING:
                continue  # aborted, or finished a step earlier (an overlap step's extra token)
            try:
                finished = self._results(req, item, out, launched.first_rows[s], launched.sample_rows[s], now)
            except Exception as e:  # this request's results alone: the others' stand
                self._fail_request(req, f"postprocessing its step failed: {type(e).__name__}: {e}")
                touched.append(req)
                continue
            if item.samples:
                touched.append(req)
                if out.drafts is not None:  # the MTP block's next draft (``MtpDrafter``)
                    draft = out.drafts[s].tolist()
                    req.drafter_state = draft[: draft.index(-1)] if -1 in draft else draft
            if finished:
                if not item.draft:  # a step planned after this one is void
                    req.num_computed = item.end
                req.pending = 0
                self.scheduler.finish(req)
                self._finish(req, finished)
            else:
                if item.draft:
                    self.adapter.after_verify(req, req.num_computed - (item.end - len(item.draft)))
                    if req.penalty_slot is not None:  # its counts: the tokens it accepted
                        row = penalties.seed_row(req.input_ids, req.output_ids, self.model.cfg.vocab_size)
                        self.runner.write_penalty_row(req.penalty_slot, row)
                self.adapter.after_step(req, insert=item.num_tokens > 1 or item.start < req.input_len)
        return touched

    def _results(self, req: Req, item, out, row0: int, srow: int, now: float) -> dict | None:
        """Apply one request's results of a step (its logits rows from ``row0``, its sampled
        rows from ``srow``): its prompt logprobs, its new tokens; returns why it finishes, or
        None. A verify item takes the token sampled after each of its fed tokens while the
        fed draft token equals it (the draft token was then the request's next token, and its
        KV counts: ``num_computed``), then the one sampled after the last accepted token."""
        if item.wants_input_logprobs:
            record_input_logprobs(req, item, out, row0)
        if not item.samples:
            return None
        req.pending -= 1
        if item.draft:
            self.stats["spec_verifications"] += 1
            self.stats["spec_draft_tokens"] += len(item.draft)
            req.spec_verifications += 1
        for j in range(len(item.draft) + 1):
            if len(req.output_ids) >= req.sampling.max_new_tokens:
                return finish.length(req.sampling.max_new_tokens)
            if req.grammar is not None:  # no token was allowed (after draft tokens 1..j)
                dead = req.grammar.dead or (req.grammar.draft_dead.get(j) if j else None)
                if dead:
                    return dead_end(dead)
            tok = append_token(req, out, srow + j, now)
            self.stats["generated_tokens"] += 1
            finished = self._stop_reason(req, tok)
            if req.grammar is not None and not finished:
                finished = req.grammar.accept(tok)
            accepted = j < len(item.draft) and tok == item.draft[j]
            if accepted:  # the draft token fed after row j was this token: its KV counts
                req.num_computed += 1
                self.stats["spec_accepted_tokens"] += 1
                req.spec_accepted_tokens += 1
            if finished or not accepted:
                return finished
        raise AssertionError("unreachable: the last row's token is never a draft's")

    def _stop_reason(self, req: Req, tok: int) -> dict | None:
        return stop_reason(
            req,
            tok,
            eos_token_ids=self.model.cfg.eos_token_ids,
            tokenizer=self.tokenizer,
            context_len=self.context_len,
        )

    def _finish(self, req: Req, reason: dict) -> None:
        req.status = Status.FINISHED
        self.penalty_slots.release(req)
        req.finish_reason = reason
        req.finish_time = time.monotonic()
        self.stats["requests_finished"] += 1
        self.stats["prompt_tokens"] += req.input_len
        self.stats["cached_tokens"] += req.cached_tokens
        for tier, n in req.cached_details.items():
            self.stats[f"cached_tokens_{tier}"] += n

    # ---- results -------------------------------------------------------------------------------
    def output(self, rid: str) -> dict:
        return format_output(self.requests[rid], self.tokenizer)

    def pop_output(self, rid: str, stream: OutputStream | None = None) -> dict | OutputDelta:
        """A finished (or aborted) request's output, and forget the request. With the
        ``stream`` that followed it: only the last delta, O(new tokens)."""
        out = self.output(rid) if stream is None else stream.next(self.requests[rid])
        del self.requests[rid]
        return out

    def text_so_far(self, rid: str) -> str | None:
        return output_text(self.requests[rid], self.tokenizer)

    # ---- maintenance -----------------------------------------------------------------------------
    def flush_cache(self) -> FlushResult:
        """Clear L1 and L2, L3 kept (``engine/flush_result.py``); refused while requests run."""
        return flush_tiers(self.side, self.cfg.hicache_write_policy == "write_back", self.check_integrity)

    def clear_storage(self, all_namespaces: bool = False) -> bool:
        """Delete this server's L3 pages: its namespace (model, KV layout, auth key), every
        cache_salt tenant; with ``all_namespaces``, every model's pages on the store. Only
        keys this project wrote go: other files in the store survive. False when no L3 is
        configured; raises if the store could not be cleared."""
        if self.storage is None:
            return False
        self.storage.clear(all_namespaces)
        return True

    def heartbeat(self) -> None:
        """Nothing to do on one process (``LeaderEngine.heartbeat`` keeps the others in touch)."""

    def close(self) -> None:
        """Stop L3 work: queued writes get up to ``hicache_storage_timeout_s``, then are dropped."""
        close_tiers(self.side)

    def metrics(self) -> Metrics:
        """Counters and gauges for /metrics and /get_server_info (plain numbers)."""
        out = self.stats.copy().counters({"num_retractions": self.scheduler.num_retractions})
        out.counters(dict(self.grammars.stats))  # grammar_compiles, grammar_cache_hits
        out.gauges(
            {"num_running_reqs": len(self.scheduler.running), "num_waiting_reqs": len(self.scheduler.waiting)}
        )
        if self.drafter is not None:  # tokens per verification: accepted draft tokens and one more
            n = self.stats["spec_verifications"]
            out.gauges({"spec_accept_length": (self.stats["spec_accepted_tokens"] + n) / n if n else 0.0})
        out.add(self.prefix_cache.metrics())  # pool use and the cache's counters
        if self.storage is not None:
            out.add(self.scheduler.prefetch_metrics())
            out.add(self.storage.stats())
        return out

    def check_integrity(self) -> None:
        self.prefix_cache.check_integrity(self.adapter.held(self.scheduler.running))

    def warmup(self) -> WarmupReport:
        """Compile every program serving can run (see warmup.py), so no request waits for a
        compile. Nothing runs: no cache page is read or written."""
        return warmup(self.runner, self.builder, self.prefix_cache.transfer)
