"""`prefixserve generate`: complete a prompt (or chat turn) from the command line."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from prefixserve.engine.llm import LLM
from prefixserve.entrypoints.engine_args import add_engine_args, engine_config_from_args, say_if_random
from prefixserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a completion for one or more prompts")
    add_engine_args(p, default_model="random:qwen3-tiny")
    p.add_argument("prompts", nargs="*", metavar="PROMPT",
                   help="prompt texts, taken literally (a file name too: read files with --input) "
                        "(default: none, then --input is needed)")
    p.add_argument("--input", type=Path, default=None, metavar="FILE",
                   help="read prompts from FILE (- for stdin), after any PROMPT: one per line, or in a "
                        ".jsonl file one JSON string or {\"prompt\": ...} per line (default: none)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass")
    p.add_argument("--sample-seed", type=int, default=None,
                   help="seed of this run's sampling (default: none, the engine's own generator)")
    p.set_defaults(func=run)


def read_prompts(path: Path) -> list[str]:
    """The prompts of an --input file: every non-empty line, or in a .jsonl file every line's
    JSON string or object's "prompt"."""
    text = sys.stdin.read() if str(path) == "-" else path.read_text()
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if path.suffix != ".jsonl":
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
        prompt = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(prompt, str):
            raise ValueError(f"{path}:{n}: expected a JSON string or an object with a string \"prompt\"")
        prompts.append(prompt)
    return prompts


def run(args: argparse.Namespace) -> int:
    prompts = list(args.prompts) + (read_prompts(args.input) if args.input is not None else [])
    if not prompts:
        raise ValueError("no prompts: give PROMPT texts or --input FILE")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for prompt in args.prompts:
        # `generate prompts.jsonl` reads as a file to a new user: say what happened to it
        if "\n" not in prompt and len(prompt) < 4096 and Path(prompt).is_file():
            logger.warning("the prompt %r is taken as text, though a file has that name; "
                           "--input %s reads prompts from it", prompt, prompt)
    config = engine_config_from_args(args)
    say_if_random(config.model, "generating from")
    llm = LLM(**vars(config))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.sample_seed)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for out in outs:
        o = out.outputs[0]
        print(f"--- {out.request_id}: {len(out.prompt_token_ids)} prompt tokens "
              f"({out.num_cached_tokens} cached), finish={o.finish_reason}")
        print(o.text)
    return 0
