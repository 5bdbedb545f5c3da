"""`prefixserve generate`: complete a prompt (or chat turn) from the command line."""
from __future__ import annotations

import argparse

from prefixserve.engine.llm import LLM
from prefixserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
from prefixserve.sampling_params import SamplingParams


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a completion for one or more prompts")
    add_engine_args(p, default_model="random:qwen3-tiny")
    p.add_argument("prompts", nargs="+", help="prompt texts")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sample-seed", type=int, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    llm = LLM(**vars(engine_config_from_args(args)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.sample_seed)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outs = llm.generate(args.prompts, params)
    for out in outs:
        o = out.outputs[0]
        print(f"--- {out.request_id}: {len(out.prompt_token_ids)} prompt tokens "
              f"({out.num_cached_tokens} cached), finish={o.finish_reason}")
        print(o.text)
    return 0
