"""The step-driven engine: requests in, one batched forward per step, outputs out.

`LLMEngine` joins the tokenizer, the scheduler (with its KV bookkeeping) and
the model runner. The offline `LLM` and the server's background loop both
drive it through add_request / step / abort_request. Around the step, each in its module
beside this one: intake, sample_groups (n samples), output_processor, failure_isolation,
cache_control (pins, cached contents), kv_store_bridge, kv_event_feed and stats.
"""
from __future__ import annotations

import logging
import time
import weakref
from typing import Callable, Optional, Sequence, Union, cast

from prefixserve.engine.cache_control import CacheControl
from prefixserve.engine.cached_contents import CachedContent, CachedContentStore
from prefixserve.engine.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from prefixserve.engine.failure_isolation import FailureIsolation, note_failure, why
from prefixserve.engine.intake import Intake, PromptInput
from prefixserve.engine.kv_event_feed import KVEventFeed
from prefixserve.engine.kv_store_bridge import KVStoreBridge
from prefixserve.engine.output_processor import OutputProcessor
from prefixserve.engine.outputs import CachePin, EngineInfo, EngineStats, PinInfo, RequestOutput
from prefixserve.engine.sample_groups import Children, Group, SampleGroups
from prefixserve.engine.stats import engine_stats
from prefixserve.engine.weights_memory import weights_bytes
from prefixserve.errors import DuplicateRequestError
from prefixserve.kv import KVCacheConfig, KVCacheManager
from prefixserve.kv.events import KVEventBatch
from prefixserve.model.config import dtype_name
from prefixserve.model.loader import load_model
from prefixserve.model.platform import platform_for
from prefixserve.sampling_params import SamplingParams
from prefixserve.scheduler import RequestStatus, Scheduler, SchedulerConfig
from prefixserve.structured.constraint import Constraint
from prefixserve.structured.grammar import GrammarCompiler
from prefixserve.tokenizer import Tokenizer, load_tokenizer
from prefixserve.worker.device import resolve_device
from prefixserve.worker.model_runner import ModelRunner, PlannedStep, num_blocks_for_memory

MAX_DEFAULT_MODEL_LEN = 32768
logger = logging.getLogger(__name__)


class LLMEngine:
    info: EngineInfo
    tokenizer: Tokenizer
    max_model_len: int

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
            tenant_weights=config.tenant_weights,
            tenant_cache_shares=config.tenant_cache_shares,
        ), clock=clock)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            policy=config.scheduling_policy,
            max_waiting=config.max_waiting,
            tenant_weights=config.tenant_weights,
            fair_scheduling=config.fair_scheduling,
        ), self.kv, clock=clock)
        self.runner = ModelRunner(self.loaded, block_size=config.block_size, num_blocks=num_blocks,
                                  vocab_limit=self.tokenizer.vocab_size, seed=config.seed,
                                  kv_layout=config.kv_layout, encoder_cache_bytes=config.encoder_cache_bytes,
                                  max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                                  enforce_eager=config.enforce_eager)
        self.intake = Intake(self.tokenizer, vocab_size=self.model_config.vocab_size,
                             max_model_len=self.max_model_len, clock=clock, grammar_compiler=grammar_compiler,
                             vision=self.model_config.vision,
                             max_images_per_prompt=config.limit_mm_per_prompt.get("image"))
        self.groups = SampleGroups(self.tokenizer, self.device)
        self.output_processor = OutputProcessor(self.scheduler, self.groups)
        self.isolation = FailureIsolation(self.scheduler, self.runner, self.kv, self.groups, self.output_processor)
        self.cache = CacheControl(self.kv, CachedContentStore(config.max_cached_contents_per_tenant))
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
        self.kv_feed = KVEventFeed(self.kv)
        self.info = EngineInfo(
            model=config.model, model_identity=self.loaded.identity,
            dtype=dtype_name(next(self.loaded.model.parameters()).dtype), dtype_reason=self.dtype_choice.reason,
            device=str(next(self.loaded.model.parameters()).device), block_size=config.block_size,
            max_model_len=self.max_model_len, num_kv_blocks=num_blocks,
            enable_prefix_caching=config.enable_prefix_caching, kernels=self.runner.kernels,
            kv_store_scope=self.kv_store_scope or "", kv_layout=self.runner.kv_layout,
            takes_images=self.model_config.vision is not None, vision=self.model_config.vision)
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

    # ----------------------------------------------------------------- requests
    def tokenize_prompt(self, prompt: PromptInput) -> tuple[Optional[str], list[int], Optional[str]]:
        return self.intake.tokenize_prompt(prompt)

    def compile_grammar(self, params: SamplingParams) -> Optional[Constraint]:
        return self.intake.compile_grammar(params)

    def prepare_images(self, prompt: PromptInput) -> PromptInput:
        """The prompt with its images decoded, resized, patched and hashed; any thread may call it."""
        return self.intake.prepare_images(prompt)

    def add_request(self, request_id: str, prompt: PromptInput,
                    params: Optional[SamplingParams] = None, *, cache_salt: Optional[str] = None,
                    priority: int = 0, arrival_time: Optional[float] = None,
                    cache_pins: Sequence[CachePin] = (), grammar: Optional[Constraint] = None,
                    cache_write_limit: Optional[int] = None, routing_key: Optional[str] = None,
                    tenant: Optional[str] = None) -> None:
        """Queues a request; raises InvalidRequestError (nothing queued) if it can never run.

        cache_pins: prefixes of this prompt to pin in the cache, each for its TTL, once the
        prompt has been computed (a pin that exists already is refreshed); an exact pin's
        prefix is kept to the token (its partial last block too).
        cache_write_limit: only full blocks within this many leading prompt tokens enter the
        cache (explicit cache writes); None: every block, as automatic prefix caching does.
        routing_key: the key a router of replicas sends the request by (one engine: unused).
        grammar: compile_grammar(params), compiled by the caller off this thread (AsyncLLM does);
        None compiles params.structured here.
        tenant: whose request it is (config.tenant_weights may weigh it), for fair scheduling
        and cache floors; the engine knows tenants by name only.
        """
        params = params or SamplingParams()
        if request_id in self.groups.groups:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use", param="request_id")
        text, req, constraint = self.intake.request(
            request_id, prompt, params, cache_salt=cache_salt, priority=priority,
            arrival_time=arrival_time, cache_pins=cache_pins, grammar=grammar,
            cache_write_limit=cache_write_limit, tenant=tenant)
        self.scheduler.add_request(req)
        self.groups.add(Group(request_id, text, req.prompt_token_ids, params, req.cache_salt, req.arrival_time,
                              cache_pins=tuple(cache_pins), grammar=constraint, image_spans=req.image_spans,
                              tenant=tenant))

    def abort_request(self, request_ids: Union[str, Sequence[str]]) -> None:
        """Aborts requests (all their samples); every block they held is freed at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            group = self.groups.remove(rid)
            if group is None:
                continue
            for sid in group.samples:
                self.scheduler.finish_request(sid, RequestStatus.FINISHED_ABORTED)
                self.scheduler.release(sid)
                self.isolation.forget(sid)
        self._drop_worker_rows_if_idle()

    # ------------------------------------------------------------------- step
    def has_unfinished_requests(self) -> bool:
        return bool(self.groups.groups)

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
        probe = self.isolation.begin_step()
        stores = self._kv_stores
        if stores is not None and probe is None:
            stores.before_schedule(self.scheduler.waiting, self.scheduler.num_running,
                                   self.config.max_num_batched_tokens)
        plan = self.scheduler.schedule(only=probe)
        if stores is not None:
            stores.after_schedule()
        failed: dict[str, str] = {}
        children: Children = {}
        rows, row_owner, broken = self.groups.sampling_rows(plan, self.scheduler.get_request, children)
        for gid, exc in broken:
            note_failure(failed, gid, "preparing its sampling", exc)
        try:
            # The runner reads the plan only (worker/model_runner.py's PlannedStep).
            result = self.runner.execute(cast(PlannedStep, plan), rows)
        except Exception as exc:
            if stores is not None:
                stores.after_step(ok=False)
            return self._finish_step(self.isolation.recover(plan, probe is not None, failed, exc))
        except BaseException:
            # Interrupted: undone, so the caller's aborts find every block accounted for.
            self.isolation.undo_step(plan)
            raise
        if stores is not None:
            stores.after_step(ok=True)
        self.isolation.step_passed(plan, probe is not None)

        group_of, groups = self.groups.group_of, self.groups.groups
        for i, err in enumerate(result.errors):
            if err is not None:
                note_failure(failed, group_of[row_owner[i][0]], "sampling", err)
        # Before its tokens are applied, so a failed request gains none.
        moved = self.isolation.fail_groups(failed)

        sampled: dict[str, list[int]] = {}
        for (rid, _), token in zip(row_owner, result.token_ids):
            sampled.setdefault(rid, []).append(token)
        touched = self.scheduler.update_from_output(plan, sampled)
        errors = self.scheduler.take_errors()
        if children:
            self.groups.adopt(children, [r.request_id for r in touched] + list(errors))
        for sid, error in errors.items():
            gid = group_of[sid]
            self.isolation.fail_group(gid, why("applying its sampled token", error, gid))
            moved.add(gid)

        self.groups.record_logprobs(row_owner, result.logprobs, result.top_logprobs)
        for req in touched:
            gid = group_of[req.request_id]
            group = groups[gid]
            moved.add(gid)
            if group.error is not None:
                continue
            stage = "placing its cache pins"
            try:
                if group.cache_pins and req.request_id == gid and req.num_output_tokens == 1:
                    self.cache.apply_pins(group)
                stage = "turning its tokens into text"
                self.output_processor.advance_text(group, req)
            except Exception as exc:
                self.isolation.fail_group(gid, why(stage, exc, gid))
        return self._finish_step(moved)

    def _finish_step(self, moved: set[str]) -> list[RequestOutput]:
        moved.update(self.isolation.step_failures)
        for sid in self.scheduler.take_failed():
            moved.add(self.groups.group_of[sid])
        self._drop_worker_rows_if_idle()
        return [self.isolation.emit_or_fail(gid)
                for gid in sorted(moved, key=lambda g: self.groups.groups[g].arrival_time)]

    def last_step_failures(self) -> dict[str, str]:
        """Requests the latest step ended because the engine failed on them: id -> why. Each
        one's final output (finish_reason "abort", error set) was among that step's outputs."""
        return dict(self.isolation.step_failures)

    # ------------------------------------------------- cache control and reports
    def now(self) -> float:
        """The engine's clock, in which pin expiries and request metrics are given."""
        return self.clock()

    def reset_prefix_cache(self) -> int:
        return self.cache.reset_prefix_cache()

    def kv_snapshot(self) -> list[bytes]:
        return self.kv_feed.snapshot()

    def kv_events(self) -> KVEventBatch:
        return self.kv_feed.events()

    def pin_prefix(self, token_ids: Sequence[int], *, cache_salt: Optional[str] = None,
                   num_tokens: Optional[int] = None, ttl_s: Optional[float] = None,
                   shorten: bool = False, tenant: Optional[str] = None) -> PinInfo:
        return self.cache.pin_prefix(token_ids, cache_salt=cache_salt, num_tokens=num_tokens, ttl_s=ttl_s,
                                     shorten=shorten, tenant=tenant)

    def unpin(self, pin_id: str) -> bool:
        return self.cache.unpin(pin_id)

    def list_pins(self) -> list[PinInfo]:
        return self.cache.list_pins()

    def cached_contents(self, owner: Optional[str] = None) -> list[tuple[CachedContent, PinInfo]]:
        return self.cache.cached_contents(owner)

    def find_cached_content(self, key: str, owner: Optional[str] = None,
                            param: str = "cached_content") -> tuple[CachedContent, PinInfo]:
        return self.cache.find_cached_content(key, owner, param)

    def cached_content_name_taken(self, name: str, owner: Optional[str] = None) -> bool:
        return self.cache.cached_content_name_taken(name, owner)

    def repin_cached_content(self, key: str, ttl_s: float, owner: Optional[str] = None,
                             param: str = "key") -> tuple[CachedContent, PinInfo]:
        return self.cache.repin_cached_content(key, ttl_s, owner, param)

    def delete_cached_content(self, key: str, owner: Optional[str] = None, param: str = "key") -> CachedContent:
        return self.cache.delete_cached_content(key, owner, param)

    def stats(self) -> EngineStats:
        return engine_stats(self.scheduler, self.kv, self.runner, self.groups, weights_bytes=self._weights_bytes,
                            dtype=self.info.dtype, kv_stores=self._kv_stores,
                            images_prepared=self.intake.images_prepared)

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
