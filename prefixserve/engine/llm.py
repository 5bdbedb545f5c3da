"""The offline API, shaped like vLLM's `LLM` so scripts carry over."""
from __future__ import annotations

import itertools
from dataclasses import fields
from typing import Any, Optional, Sequence, Union

from prefixserve.engine.config import EngineConfig
from prefixserve.engine.intake import PromptInput
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.engine.outputs import EngineStats, RequestOutput
from prefixserve.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str = "random:qwen3-tiny", **kwargs: Any) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown LLM options: {sorted(unknown)}; known: {sorted(known - {'model'})}")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Union[PromptInput, Sequence[PromptInput]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 *, use_tqdm: bool = False, priority: Optional[Sequence[int]] = None) -> list[RequestOutput]:
        """Runs every prompt to completion, batched together; outputs come back in input order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        try:
            for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params)):
                self.engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Union[Conversation, Sequence[Conversation]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None, *,
             tools: Optional[list[dict]] = None, add_generation_prompt: bool = True,
             chat_template_kwargs: Optional[dict] = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Renders each conversation through the model's chat template, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.tokenizer.apply_chat_template(
            conv, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True,
            **(chat_template_kwargs or {}))} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        progress = None
        if use_tqdm:
            from rich.progress import Progress
            progress = Progress(transient=True)
            task = progress.add_task("generating", total=len(ids))
            progress.start()
        try:
            while wanted - done.keys():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        if progress is not None:
                            progress.advance(task)
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            if progress is not None:
                progress.stop()
        return [done[i] for i in ids]

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Flushes the cache to the persistent KV stores and closes them (see LLMEngine.close)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
