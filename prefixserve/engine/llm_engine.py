"""The step-driven engine: requests in, one batched forward per step, outputs out.

`LLMEngine` joins the tokenizer, the scheduler (with its KV bookkeeping) and
the model runner. The offline `LLM` and the server's background loop both
drive it through add_request / step / abort_request.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch

from prefixserve.engine.cached_contents import CachedContent, CachedContentStore
from prefixserve.engine.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from prefixserve.engine.kv_store_bridge import KVStoreBridge
from prefixserve.engine.outputs import (CachePin, CompletionOutput, EngineInfo, EngineStats, PinInfo,
                                       PinResult, RequestMetrics, RequestOutput)
from prefixserve.engine.weights_memory import weights_bytes
from prefixserve.errors import (CachedContentLimitError, ConflictError, DuplicateRequestError, InvalidRequestError,
                                NotFoundError, PinLimitError)
from prefixserve.kv import KVCacheConfig, KVCacheManager
from prefixserve.kv.events import KVEventBatch, KVEventLog
from prefixserve.model.config import dtype_name
from prefixserve.model.loader import load_model
from prefixserve.model.platform import platform_for
from prefixserve.sampling_params import SamplingParams
from prefixserve.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig, child_request_id
from prefixserve.structured.constraint import Constraint
from prefixserve.structured.grammar import GrammarCompiler
from prefixserve.tokenizer import IncrementalDetokenizer, load_tokenizer
from prefixserve.worker.device import resolve_device
from prefixserve.worker.model_runner import ModelRunner, num_blocks_for_memory
from prefixserve.worker.sampler import SamplingRow

PromptInput = Union[str, list[int], dict[str, Any]]
MAX_DEFAULT_MODEL_LEN = 32768
logger = logging.getLogger(__name__)
# A request in this many failed steps in a row is ended even if never alone in one. A bisection
# puts a request in at most log2(step size) + 1 of them, far fewer for any batch that fits;
# this bounds the case where its retry group could not be scheduled and the search restarted.
_MAX_FAILED_STEPS = 32
# Sampled in place of a request whose own row could not be built: the forward still computes
# its tokens (others may read its K/V in the same step) and the token drawn is thrown away.
_STAND_IN = SamplingRow(params=SamplingParams(temperature=0.0, max_tokens=1),
                        prompt_token_ids=(), output_token_ids=())


@dataclass
class _Sample:
    """Output state of one of a request's n samples."""
    index: int
    detokenizer: IncrementalDetokenizer
    generator: Optional[torch.Generator]
    constraint: Optional[Constraint] = None  # the grammar its output must match
    text: str = ""
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None


@dataclass
class _Group:
    """A user request: one prompt, n samples (forked after the prompt is computed)."""
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: Optional[str]
    arrival_time: float
    samples: dict[str, _Sample] = field(default_factory=dict)  # scheduler request id -> sample
    cache_pins: tuple[CachePin, ...] = ()
    pin_results: list[PinResult] = field(default_factory=list)
    error: Optional[str] = None  # why the engine ended it when a step failed on it
    # Compiled once and never advanced: each sample's matcher is a fork of it.
    grammar: Optional[Constraint] = None


class LLMEngine:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic,
                 grammar_compiler: Optional[GrammarCompiler] = None) -> None:
        """grammar_compiler: compiles structured outputs; None builds one from the tokenizer on
        the first structured request."""
        self.config = config
        self.clock = clock
        self.device = resolve_device(config.device)
        self.dtype_choice = platform_for(self.device).choose_dtype(config.dtype, self.device)
        self.loaded = load_model(config.model, dtype=self.dtype_choice.dtype, seed=config.seed, device=self.device,
                                 attention_backend=config.attention_backend)
        self.model_config = self.loaded.config
        # once: the weights never change after loading, and stats() runs every step
        self._weights_bytes = weights_bytes(self.loaded.model)
        self.tokenizer = load_tokenizer(config.model)
        self.max_model_len = config.max_model_len or min(
            self.model_config.max_position_embeddings, MAX_DEFAULT_MODEL_LEN)
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {self.model_config.max_position_embeddings}")
        num_blocks = config.num_kv_blocks or self._default_num_blocks()
        self.kv = KVCacheManager(KVCacheConfig(
            num_blocks=num_blocks,
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            hash_algo=config.hash_algo,
            eviction_policy=config.eviction_policy,
            model_identity=self.loaded.identity,
            max_pinned_blocks=int(num_blocks * config.max_pinned_fraction),
            max_pinned_blocks_per_tenant=(None if config.max_pinned_fraction_per_tenant is None
                                          else int(num_blocks * config.max_pinned_fraction_per_tenant)),
        ), clock=clock)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            policy=config.scheduling_policy,
            max_waiting=config.max_waiting,
        ), self.kv, clock=clock)
        self.runner = ModelRunner(self.loaded, block_size=config.block_size, num_blocks=num_blocks,
                                  vocab_limit=self.tokenizer.vocab_size, seed=config.seed,
                                  kv_layout=config.kv_layout)
        self._groups: dict[str, _Group] = {}
        self._sample_to_group: dict[str, str] = {}
        self._requests_finished = 0
        self._contents = CachedContentStore(config.max_cached_contents_per_tenant)
        self.kv.watch_pin_removals(self._contents.pin_removed)
        self._kv_stores: Optional[KVStoreBridge] = None
        if config.kv_stores:
            self._kv_stores = KVStoreBridge(
                config.kv_stores, kv=self.kv, kv_caches=self.runner.kv_caches,
                model=self.loaded.model, model_config=self.model_config,
                block_size=config.block_size, kv_layout=self.runner.kv_layout, hash_algo=config.hash_algo,
                write_through=config.kv_store_write == "through",
                max_queue_bytes=config.kv_store_queue_bytes)
            # Clean exits flush the pool to the persistent stores even without close().
            self._close_stores = weakref.finalize(self, self._kv_stores.close)
        self._kv_events: Optional[KVEventLog] = None  # started by the first kv_snapshot()
        # After a failed forward its requests re-run in groups, front group first, until the one
        # that fails alone is found; strikes count each request's failed steps since it last
        # completed one, a backstop should groups keep failing without the search converging.
        self._probes: deque[list[str]] = deque()
        self._strikes: dict[str, int] = {}
        self._step_failures: dict[str, str] = {}
        self._grammars = grammar_compiler
        self._grammars_lock = threading.Lock()  # compile_grammar runs on any thread
        self.info = EngineInfo(
            model=config.model, model_identity=self.loaded.identity,
            dtype=dtype_name(next(self.loaded.model.parameters()).dtype), dtype_reason=self.dtype_choice.reason,
            device=str(next(self.loaded.model.parameters()).device), block_size=config.block_size,
            max_model_len=self.max_model_len, num_kv_blocks=num_blocks,
            enable_prefix_caching=config.enable_prefix_caching, kernels=self.runner.kernels,
            kv_store_scope=self.kv_store_scope or "", kv_layout=self.runner.kv_layout)
        logger.info("dtype %s (%s), KV pool in %s", self.info.dtype, self.info.dtype_reason, self.info.kv_layout)

    def _default_num_blocks(self) -> int:
        budget = self.config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
        by_memory = num_blocks_for_memory(self.loaded, self.config.block_size, budget)
        # More blocks than every sequence at full length could use is wasted memory.
        useful = self.config.max_num_seqs * -(-self.max_model_len // self.config.block_size)
        num_blocks = min(by_memory, useful)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory {budget} bytes holds no KV block of this model")
        return num_blocks

    # ----------------------------------------------------------------- intake
    def tokenize_prompt(self, prompt: PromptInput) -> tuple[Optional[str], list[int], Optional[str]]:
        """Returns (prompt text, prompt token ids, cache salt) for any accepted prompt form."""
        salt = None
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown:
                raise InvalidRequestError(f"unknown prompt fields: {sorted(unknown)}")
            salt = prompt.get("cache_salt")
            if salt is not None and (not isinstance(salt, str) or not salt):
                raise InvalidRequestError("cache_salt must be a non-empty string")
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True), salt
        if isinstance(prompt, (list, tuple)):
            vocab = self.model_config.vocab_size
            for t in prompt:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise InvalidRequestError(f"prompt token id {t!r} is not in [0, {vocab})")
            return None, list(prompt), salt
        raise InvalidRequestError(f"a prompt must be a string, token ids or a dict, got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt: PromptInput,
                    params: Optional[SamplingParams] = None, *, cache_salt: Optional[str] = None,
                    priority: int = 0, arrival_time: Optional[float] = None,
                    cache_pins: Sequence[CachePin] = (), grammar: Optional[Constraint] = None) -> None:
        """Queues a request; raises InvalidRequestError (nothing queued) if it can never run.

        cache_pins: prefixes of this prompt to pin in the cache, each for its TTL, once the
        prompt has been computed (a pin that exists already is refreshed).
        grammar: compile_grammar(params), compiled by the caller off this thread (AsyncLLM does);
        None compiles params.structured here.
        """
        params = params or SamplingParams()
        if request_id in self._groups:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use", param="request_id")
        if grammar is not None and params.structured is None:
            raise ValueError("a compiled grammar was given for a request without structured output")
        # compiled before anything is queued: a grammar that cannot be compiled refuses the request
        constraint = grammar if grammar is not None else self.compile_grammar(params)
        text, token_ids, dict_salt = self.tokenize_prompt(prompt)
        salt = cache_salt if cache_salt is not None else dict_salt
        if params.max_tokens is not None:
            max_tokens = params.max_tokens
        else:
            max_tokens = self.max_model_len - len(token_ids)
        req = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            max_tokens=max(1, max_tokens),
            eos_token_ids=frozenset(self.tokenizer.eos_token_ids),
            cache_salt=salt,
            priority=priority,
            arrival_time=arrival_time if arrival_time is not None else self.clock(),
        )
        for pin in cache_pins:
            if not 0 < pin.num_tokens <= len(token_ids):
                raise InvalidRequestError(
                    f"cache pin of {pin.num_tokens} tokens outside the {len(token_ids)}-token prompt",
                    param="cache_pins")
        self.scheduler.add_request(req)
        group = _Group(request_id, text, token_ids, params, salt, req.arrival_time,
                       cache_pins=tuple(cache_pins), grammar=constraint)
        group.samples[request_id] = self._new_sample(group, 0, params.seed)
        self._groups[request_id] = group
        self._sample_to_group[request_id] = request_id

    def compile_grammar(self, params: SamplingParams) -> Optional[Constraint]:
        """The grammar of params.structured compiled for add_request(grammar=...); None without
        one. Thread-safe and touches no request, so a slow grammar can compile on any thread
        while the engine steps. Raises InvalidRequestError (param response_format) if it
        cannot be compiled."""
        if params.structured is None:
            return None
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer.backend.to_str(), self.tokenizer.vocab_size,
                                                 sorted(self.tokenizer.eos_token_ids))
        return self._grammars.constraint(params.structured)

    def _new_sample(self, group: _Group, index: int, seed: Optional[int]) -> _Sample:
        generator = None
        if seed is not None:
            # Each sample of a seeded request gets its own stream, fixed by (seed, index).
            derived = seed if index == 0 else (seed * 1_000_003 + index) % (2**63 - 1)
            generator = torch.Generator(device=self.device).manual_seed(derived)
        detok = IncrementalDetokenizer(self.tokenizer, group.prompt_token_ids,
                                       skip_special_tokens=group.params.skip_special_tokens)
        return _Sample(index=index, detokenizer=detok, generator=generator,
                       constraint=group.grammar.fork() if group.grammar is not None else None)

    def abort_request(self, request_ids: Union[str, Sequence[str]]) -> None:
        """Aborts requests (all their samples); every block they held is freed at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            group = self._groups.pop(rid, None)
            if group is None:
                continue
            for sid in group.samples:
                self.scheduler.finish_request(sid, RequestStatus.FINISHED_ABORTED)
                self.scheduler.release(sid)
                self._sample_to_group.pop(sid, None)
                self._strikes.pop(sid, None)
            self._requests_finished += 1
        self._drop_worker_rows_if_idle()

    # ------------------------------------------------------------------- step
    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def _drop_worker_rows_if_idle(self) -> None:
        # Each plan tells the worker which block tables to drop; with nothing left to schedule no
        # plan follows, so the tables of the requests that just ended are dropped now.
        if not self.scheduler.has_unfinished():
            self.runner.drop_requests(self.scheduler.take_dropped_ids())

    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step; returns the (cumulative) output of every request that moved.

        A failure in one request's part of the step (its sampling row, its sampling, applying
        its token, its text, its pins, its output) ends that request alone, with an output whose
        finish_reason is "abort" and whose error says why. A failed batched forward names no
        culprit: the step is undone and its requests re-run in smaller groups in the next
        steps, and only a request that fails alone is ended (`last_step_failures`)."""
        self._step_failures = {}
        probe = self._next_probe()
        stores = self._kv_stores
        if stores is not None and probe is None:
            stores.before_schedule(self.scheduler.waiting, self.scheduler.num_running,
                                   self.config.max_num_batched_tokens)
        plan = self.scheduler.schedule(only=probe)
        if stores is not None:
            stores.after_schedule()
        failed: dict[str, str] = {}
        children: dict[str, tuple[str, _Sample]] = {}
        rows, row_owner = self._sampling_rows(plan, failed, children)
        try:
            result = self.runner.execute(plan, rows)
        except Exception as exc:
            if stores is not None:
                stores.after_step(ok=False)
            return self._recover(plan, probe is not None, failed, exc)
        except BaseException:
            # Interrupted: undone, so the caller's aborts find every block accounted for.
            self._undo_step(plan)
            raise
        if stores is not None:
            stores.after_step(ok=True)
        self._step_passed(plan, probe is not None)

        moved: set[str] = set()
        for i, err in enumerate(result.errors):
            if err is not None:
                self._note_failure(failed, self._sample_to_group[row_owner[i][0]], "sampling", err)
        # Before its tokens are applied, so a failed request gains none.
        for gid, why in failed.items():
            self._fail_group(gid, why)
            moved.add(gid)

        sampled: dict[str, list[int]] = {}
        for (rid, _), token in zip(row_owner, result.token_ids):
            sampled.setdefault(rid, []).append(token)
        touched = self.scheduler.update_from_output(plan, sampled)
        errors = self.scheduler.take_errors()
        if children:
            for sid in [r.request_id for r in touched] + list(errors):
                if sid in children:
                    gid, sample = children.pop(sid)
                    self._groups[gid].samples[sid] = sample
                    self._sample_to_group[sid] = gid
        for sid, exc in errors.items():
            gid = self._sample_to_group[sid]
            self._fail_group(gid, self._why("applying its sampled token", exc, gid))
            moved.add(gid)

        for (rid, k), logprob, top in zip(row_owner, result.logprobs, result.top_logprobs):
            sid = rid if k == 0 else child_request_id(rid, k)
            gid = self._sample_to_group.get(sid)
            if logprob is not None and gid is not None and self._groups[gid].error is None:
                self._groups[gid].samples[sid].logprobs.append((logprob, top))
        for req in touched:
            gid = self._sample_to_group[req.request_id]
            group = self._groups[gid]
            moved.add(gid)
            if group.error is not None:
                continue
            stage = "placing its cache pins"
            try:
                if group.cache_pins and req.request_id == gid and req.num_output_tokens == 1:
                    self._apply_pins(group)
                stage = "turning its tokens into text"
                self._advance_text(group, req)
            except Exception as exc:
                self._fail_group(gid, self._why(stage, exc, gid))
        return self._finish_step(moved)

    def _finish_step(self, moved: set[str]) -> list[RequestOutput]:
        moved.update(self._step_failures)
        for sid in self.scheduler.take_failed():
            moved.add(self._sample_to_group[sid])
        self._drop_worker_rows_if_idle()
        return [self._emit_or_fail(gid)
                for gid in sorted(moved, key=lambda g: self._groups[g].arrival_time)]

    def last_step_failures(self) -> dict[str, str]:
        """Requests the latest step ended because the engine failed on them: id -> why. Each
        one's final output (finish_reason "abort", error set) was among that step's outputs."""
        return dict(self._step_failures)

    def _sampling_rows(self, plan, failed: dict[str, str],
                       children: dict[str, tuple[str, _Sample]]
                       ) -> tuple[list[SamplingRow], list[tuple[str, int]]]:
        rows: list[SamplingRow] = []
        row_owner: list[tuple[str, int]] = []
        for seq in plan.sequences:
            if not seq.sample:
                continue
            gid = self._sample_to_group[seq.request_id]
            try:
                seq_rows = self._rows_of(seq, self._groups[gid], children)
            except Exception as exc:
                self._note_failure(failed, gid, "preparing its sampling", exc)
                seq_rows = [_STAND_IN] * seq.num_samples
            rows.extend(seq_rows)
            row_owner.extend((seq.request_id, k) for k in range(seq.num_samples))
        return rows, row_owner

    def _rows_of(self, seq, group: _Group,
                 children: dict[str, tuple[str, _Sample]]) -> list[SamplingRow]:
        req = self.scheduler.get_request(seq.request_id)
        blocked = req.eos_token_ids | frozenset(group.params.stop_token_ids)
        rows = []
        for k in range(seq.num_samples):
            if k > 0:
                # Joins the group once the scheduler has forked it, so a step that fails first
                # leaves no sample without a request behind.
                sample = self._new_sample(group, k, group.params.seed)
                children[child_request_id(seq.request_id, k)] = (group.request_id, sample)
            else:
                sample = group.samples[seq.request_id]
            rows.append(SamplingRow(
                params=group.params,
                prompt_token_ids=req.prompt_token_ids,
                output_token_ids=req.output_token_ids,
                min_tokens_blocked=blocked,
                generator=sample.generator,
                constraint=sample.constraint,
            ))
        return rows

    # ------------------------------------------------------ failure isolation
    @staticmethod
    def _why(stage: str, exc: BaseException, gid: str) -> str:
        # The type only: this text reaches clients, and an exception's message may show internals.
        logger.error("engine failed on request %s while %s", gid, stage, exc_info=exc)
        return f"the engine failed on this request while {stage} ({type(exc).__name__})"

    def _note_failure(self, failed: dict[str, str], gid: str, stage: str,
                      exc: BaseException) -> None:
        if gid not in failed:
            failed[gid] = self._why(stage, exc, gid)

    def _fail_group(self, gid: str, why: str) -> None:
        """Ends every sample of a request the engine failed on; its next output carries why."""
        group = self._groups.get(gid)
        if group is None or group.error is not None:
            return
        group.error = why
        self._step_failures[gid] = why
        for sid, sample in group.samples.items():
            self.scheduler.finish_request(sid, RequestStatus.FINISHED_ABORTED)
            self._strikes.pop(sid, None)
            if sample.finish_reason is None:
                sample.finish_reason, sample.stop_reason = "abort", None

    def _emit_or_fail(self, gid: str) -> RequestOutput:
        try:
            return self._emit(gid)
        except Exception as exc:
            self._fail_group(gid, self._why("building its output", exc, gid))
        group = self._groups.pop(gid)
        outputs = []
        for sid, sample in sorted(group.samples.items(), key=lambda kv: kv[1].index):
            req = self.scheduler.release(sid)
            self._sample_to_group.pop(sid, None)
            outputs.append(CompletionOutput(
                index=sample.index, text=sample.text,
                token_ids=list(req.output_token_ids) if req is not None else [],
                finish_reason=sample.finish_reason or "abort"))
        self._requests_finished += 1
        return RequestOutput(
            request_id=gid, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
            num_cached_tokens=0, outputs=outputs, finished=True,
            metrics=RequestMetrics(arrival_time=group.arrival_time), cache_salt=group.cache_salt,
            error=group.error, pins=list(group.pin_results))

    def _is_live(self, sid: str) -> bool:
        return sid in self._sample_to_group and not self.scheduler.get_request(sid).is_finished

    def _next_probe(self) -> Optional[set[str]]:
        while self._probes:
            live = [sid for sid in self._probes[0] if self._is_live(sid)]
            if live:
                self._probes[0] = live
                return set(live)
            self._probes.popleft()
        return None

    def _step_passed(self, plan, probing: bool) -> None:
        scheduled = [seq.request_id for seq in plan.sequences]
        if self._strikes:
            for sid in scheduled:
                self._strikes.pop(sid, None)
        if probing:
            # Cleared members leave the group; a group none of which could be scheduled
            # (memory held elsewhere) is dropped, and its requests run with the others again.
            done = set(scheduled)
            rest = [sid for sid in self._probes[0] if sid not in done]
            if rest and done:
                self._probes[0] = rest
            else:
                self._probes.popleft()

    def _recover(self, plan, probing: bool, failed: dict[str, str],
                 exc: Exception) -> list[RequestOutput]:
        """After a batched forward raised: undoes the step, ends the requests known to be at
        fault, and queues the rest to re-run in halves (a bisection: a request is in at most
        log2(step size) + 1 failed steps before it has failed alone or completed a step)."""
        scheduled = [seq.request_id for seq in plan.sequences]
        logger.error("engine step of %d requests failed", len(scheduled), exc_info=exc)
        suspects = self._undo_step(plan)
        if probing:
            done = set(scheduled)
            rest = [sid for sid in self._probes[0] if sid not in done]
            if rest:
                self._probes[0] = rest
            else:
                self._probes.popleft()
        moved = set(failed)
        for gid, why in failed.items():
            self._fail_group(gid, why)
        suspects = [sid for sid in suspects if self._is_live(sid)]
        stage = "running the batched forward pass"
        if len(scheduled) == 1 and suspects:
            gid = self._sample_to_group[suspects[0]]
            self._fail_group(gid, self._why(f"{stage} with it alone", exc, gid))
            moved.add(gid)
            suspects = []
        for sid in suspects:
            self._strikes[sid] = self._strikes.get(sid, 0) + 1
            if self._strikes[sid] >= _MAX_FAILED_STEPS:
                gid = self._sample_to_group[sid]
                self._fail_group(gid, self._why(f"{stage}, in every retry", exc, gid))
                moved.add(gid)
        suspects = [sid for sid in suspects if self._is_live(sid)]
        half = (len(suspects) + 1) // 2
        for part in (suspects[half:], suspects[:half]):
            if part:
                self._probes.appendleft(part)
        return self._finish_step(moved)

    def _undo_step(self, plan) -> list[str]:
        """Puts the step's requests back as they were before it; returns their ids."""
        try:
            rolled = self.scheduler.rollback(plan)
            # The worker may not have dropped these before the forward failed.
            self.runner.drop_requests(plan.dropped_ids)
            return rolled
        except Exception as exc:
            # Which cached blocks were written is unknown after a broken undo: the step's
            # requests end and every hash goes, so no request can read K/V never computed.
            logger.error("undoing a failed step failed; ending its requests", exc_info=exc)
            why = f"the engine failed to recover from a failed step ({type(exc).__name__})"
            for seq in plan.sequences:
                gid = self._sample_to_group.get(seq.request_id)
                if gid is not None:
                    self._fail_group(gid, why)
            self.kv.reset_prefix_cache()
            return []

    def _apply_pins(self, group: _Group) -> None:
        # The prompt's blocks were registered when allocated and are held by the
        # request now, so the whole prefix is found in the cache.
        for pin in group.cache_pins:
            try:
                if pin.content is not None:
                    # refused before anything is pinned for it, so a refusal never leaves a pin
                    # (after the expired pins, and with them their contents, have gone)
                    self.kv.expire_pins()
                    self._contents.check_new(pin.content)
                info = self.kv.pin_prefix(group.prompt_token_ids, cache_salt=group.cache_salt,
                                          num_tokens=pin.num_tokens, ttl_s=pin.ttl_s, tenant=pin.tenant)
                if pin.content is not None and info.pin_id is not None:
                    pin.content.pin_id = info.pin_id
                    self._contents.add(pin.content)
            except (PinLimitError, ConflictError, CachedContentLimitError) as exc:
                group.pin_results.append(PinResult(pin.num_tokens, 0, None, str(exc), error_code=exc.code))
                continue
            group.pin_results.append(PinResult(pin.num_tokens, info.num_tokens, info.expires_at,
                                               None, info.pin_id))

    def _advance_text(self, group: _Group, req: Request) -> None:
        sample = group.samples[req.request_id]
        delta = sample.detokenizer.add(req.output_token_ids[-1])
        if not delta:
            return
        sample.text += delta
        stop = self._find_stop(sample.text, len(delta), group.params)
        if stop is None:
            return
        at, s = stop
        sample.text = sample.text[:at + (len(s) if group.params.include_stop_str_in_output else 0)]
        self.scheduler.stop_request(req.request_id, s)

    @staticmethod
    def _visible_text(text: str, params: SamplingParams, finished: bool) -> str:
        """Holds back a tail that may still grow into a stop string, so streamed text never shrinks."""
        if finished or not params.stop:
            return text
        hold = 0
        for s in params.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return text[:len(text) - hold] if hold else text

    @staticmethod
    def _find_stop(text: str, delta_len: int, params: SamplingParams) -> Optional[tuple[int, str]]:
        if not params.stop:
            return None
        best: Optional[tuple[int, str]] = None
        for s in params.stop:
            # Only the new text (plus a stop string's length of context) can hold a new match.
            start = max(0, len(text) - delta_len - len(s) + 1)
            at = text.find(s, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        return best

    def _emit(self, gid: str) -> RequestOutput:
        group = self._groups[gid]
        outputs: list[CompletionOutput] = []
        all_done = True
        num_cached = 0
        metrics = RequestMetrics(arrival_time=group.arrival_time)
        for sid, sample in sorted(group.samples.items(), key=lambda kv: kv[1].index):
            req = self.scheduler.get_request(sid)
            if req.is_finished and sample.finish_reason is None:
                sample.finish_reason = req.status.value
                sample.stop_reason = req.stop_reason
                if not isinstance(req.stop_reason, str):
                    # A generation cut mid-character still shows what decode() of all ids shows.
                    sample.text += sample.detokenizer.finish()
            all_done &= req.is_finished
            if sample.index == 0:
                num_cached = max(req.num_cached_tokens, 0)
                metrics.first_scheduled_time = req.first_scheduled_time
                metrics.first_token_time = req.first_token_time
            if req.finished_time is not None:
                metrics.finished_time = max(metrics.finished_time or 0.0, req.finished_time)
            outputs.append(CompletionOutput(
                index=sample.index,
                text=self._visible_text(sample.text, group.params, req.is_finished),
                token_ids=list(req.output_token_ids),
                finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason,
                cumulative_logprob=(sum(lp for lp, _ in sample.logprobs)
                                    if group.params.logprobs is not None else None),
                logprobs=list(sample.logprobs) if group.params.logprobs is not None else None,
            ))
        # The group is complete once every one of its n samples exists and has
        # finished, or its first sample ended before the fork could happen, or the
        # engine failed on it (possibly part-way through the fork).
        first = self.scheduler.get_request(gid)
        finished = all_done and (len(outputs) == group.params.n or group.error is not None or
                                 (first.is_finished and first.num_output_tokens == 0))
        error = group.error
        if error is None and first.status is RequestStatus.FINISHED_ABORTED and \
                isinstance(first.stop_reason, str):
            error = first.stop_reason
        out = RequestOutput(
            request_id=gid, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
            num_cached_tokens=num_cached, outputs=outputs, finished=finished, metrics=metrics,
            cache_salt=group.cache_salt, error=error, pins=list(group.pin_results))
        if finished:
            for sid in group.samples:
                self.scheduler.release(sid)
                self._sample_to_group.pop(sid, None)
            del self._groups[gid]
            self._requests_finished += 1
        return out

    # ------------------------------------------------------------- cache ops
    def now(self) -> float:
        """The engine's clock, in which pin expiries and request metrics are given."""
        return self.clock()

    def reset_prefix_cache(self) -> int:
        """Drops every pin, every cached content and every cached hash; returns the hashes dropped."""
        return self.kv.reset_prefix_cache()

    def kv_snapshot(self) -> list[bytes]:
        """Every block hash the pool holds now, and (re)starts the KV event log from this point:
        a router rebuilds its view of this engine from it, then follows kv_events()."""
        if self._kv_events is None:
            self._kv_events = KVEventLog()
            self.kv.watch(self._kv_events)
        self._kv_events.restart()
        return self.kv.cached_hashes()

    def kv_events(self) -> KVEventBatch:
        """The hashes stored, removed and pinned, and the resets, since the last call; overflowed
        (take a snapshot) before the first kv_snapshot() or when the consumer fell too far behind."""
        if self._kv_events is None:
            return KVEventBatch((), overflowed=True)
        return self._kv_events.drain()

    def pin_prefix(self, token_ids: Sequence[int], *, cache_salt: Optional[str] = None,
                   num_tokens: Optional[int] = None, ttl_s: Optional[float] = None,
                   shorten: bool = False, tenant: Optional[str] = None) -> PinInfo:
        """Pins the cached full blocks of the prompt's first num_tokens tokens for ttl_s seconds
        (refreshing a pin that holds them already; shorten lets the expiry move earlier).
        Raises PinLimitError beyond the pinned-block cap, or beyond tenant's share of it."""
        return _public_pin(self.kv.pin_prefix(token_ids, cache_salt=cache_salt, num_tokens=num_tokens,
                                              ttl_s=ttl_s, shorten=shorten, tenant=tenant))

    def unpin(self, pin_id: str) -> bool:
        """Releases a pin; False if it no longer lives. A pin a cached content holds is released
        by deleting the content instead."""
        if self._contents.holds(pin_id):
            raise ConflictError(f"pin {pin_id!r} holds a cached content; delete the content instead",
                                param="pin_id", code="pin_in_use")
        return self.kv.unpin(pin_id)

    def list_pins(self) -> list[PinInfo]:
        return [_public_pin(p) for p in self.kv.pins()]

    # ------------------------------------------------------- cached contents
    # Each call first lets expired pins go, which drops their contents, then reads the pins of
    # the contents left (none can expire in between).
    def _content_pin(self, content: CachedContent) -> PinInfo:
        return _public_pin(self.kv.pin(content.pin_id))

    def cached_contents(self, owner: Optional[str] = None) -> list[tuple[CachedContent, PinInfo]]:
        """The live contents visible to owner, each with its pin."""
        self.kv.expire_pins()
        return [(c, self._content_pin(c)) for c in self._contents.visible(owner)]

    def find_cached_content(self, key: str, owner: Optional[str] = None,
                            param: str = "cached_content") -> tuple[CachedContent, PinInfo]:
        """The live content named or identified by key in owner's scope; NotFoundError otherwise."""
        self.kv.expire_pins()
        content = self._contents.find(key, owner, param=param)
        return content, self._content_pin(content)

    def cached_content_name_taken(self, name: str, owner: Optional[str] = None) -> bool:
        self.kv.expire_pins()
        return self._contents.name_taken(name, owner)

    def repin_cached_content(self, key: str, ttl_s: float, owner: Optional[str] = None,
                             param: str = "key") -> tuple[CachedContent, PinInfo]:
        """Sets a content's expiry to ttl_s from now, shorter as well as longer."""
        content, _ = self.find_cached_content(key, owner, param=param)
        info = self.kv.pin_prefix(content.token_ids, cache_salt=content.cache_salt,
                                  num_tokens=len(content.token_ids), ttl_s=ttl_s, shorten=True,
                                  tenant=content.tenant)
        if info.pin_id != content.pin_id:
            # The content's own pin holds these blocks, so the walk finds exactly them again
            # unless that pin expired in between: then the pin just placed holds nothing's.
            if info.pin_id is not None:
                self.kv.unpin(info.pin_id)
            raise NotFoundError(f"cached content {key!r} is no longer in the cache", param=param,
                                code="cached_content_not_found")
        return content, _public_pin(info)

    def delete_cached_content(self, key: str, owner: Optional[str] = None,
                              param: str = "key") -> CachedContent:
        """Forgets a content and releases its pin unless another content shares it."""
        content, _ = self.find_cached_content(key, owner, param=param)
        if self._contents.remove(content):
            self.kv.unpin(content.pin_id)
        return content

    def stats(self) -> EngineStats:
        s = self.scheduler.stats
        kv = self.kv.stats()
        return EngineStats(
            prompt_tokens=s.prompt_tokens,
            cached_prompt_tokens=s.cached_prompt_tokens,
            computed_prompt_tokens=s.computed_prompt_tokens,
            computed_tokens=s.computed_tokens,
            generated_tokens=s.generated_tokens,
            requests_finished=self._requests_finished,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            preemptions=s.preemptions,
            steps=s.steps,
            blocks_total=kv.num_blocks,
            blocks_free=kv.num_free_blocks,
            blocks_cached=kv.num_cached_free_blocks,
            blocks_in_use=kv.num_used_blocks,
            blocks_pinned=kv.num_pinned_blocks,
            evictions=kv.evictions,
            cow_copies=kv.cow_copies,
            prefix_cache_queries=kv.query_tokens,
            prefix_cache_hits=kv.hit_tokens,
            kv_cache_bytes=self.runner.kv_cache_bytes,
            weights_bytes=self._weights_bytes,
            dtype=self.info.dtype,
            kernels_active={name: k["active"] for name, k in self.runner.kernels.items()},
            num_seats=sum(group.params.n for group in self._groups.values()),
            kv_stores=tuple(self._kv_stores.stats()) if self._kv_stores is not None else (),
        )

    @property
    def kv_store_scope(self) -> Optional[str]:
        """The key scope of this engine's stored blocks (hex; keys are "<scope>/<block hash
        hex>"), None without stores: engines with equal scopes can read each other's blocks."""
        return self._kv_stores.scope.name if self._kv_stores is not None else None

    def kv_stores_hold(self, block_hashes: Sequence[bytes]) -> list[Optional[int]]:
        """For each block hash (kv's hasher, this engine's model identity), the index in
        config.kv_stores of the first store holding it, or None: one batched call per store,
        nothing read, so a router can cost a store hit."""
        if self._kv_stores is None:
            return [None] * len(block_hashes)
        return self._kv_stores.holds(block_hashes)

    def close(self) -> None:
        """Flushes the pool's cached blocks to the persistent KV stores and closes them (also
        done when the engine is collected or the interpreter exits). Idempotent; the engine
        keeps serving from its pool afterwards, without stores."""
        if self._kv_stores is not None:
            self._close_stores()
            self._kv_stores = None


def _public_pin(info) -> PinInfo:
    return PinInfo(info.pin_id, info.num_tokens, info.expires_at)
