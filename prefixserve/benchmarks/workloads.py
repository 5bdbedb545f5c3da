"""The benchmark workloads: fixed-seed request sets in token ids, the same for every engine.

Prompts are token ids drawn from a seeded generator, so no tokenizer can make
two engines see different prompts. A workload is a list of rounds: every
request of a round arrives at the round's start, and a round starts when the
previous one has finished (multi-turn needs the previous turn's history).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Optional

# Token ids are drawn from this range: ordinary tokens of the shipped tokenizer, below its specials.
TOKEN_LOW, TOKEN_HIGH = 64, 8000
LONG_DOC_ORDERS = ("random", "tile", "interleave")


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    cache_salt: Optional[str] = None
    # How many leading tokens a careful user knows are shared with other requests (the system
    # prompt, the document, the conversation so far); the hand-written-reuse baseline caches these.
    shared_prefix_len: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: prompt_token_ids is empty")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.shared_prefix_len < len(self.prompt_token_ids):
            raise ValueError(f"request {self.request_id}: shared_prefix_len {self.shared_prefix_len} must be "
                             f"in [0, {len(self.prompt_token_ids)})")


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    seed: int
    rounds: tuple[tuple[BenchRequest, ...], ...]
    # KV pool for prefixserve in blocks of 16 tokens (None: the engine's default). The long-doc-qa
    # orders only differ when the cache cannot hold every document at once.
    kv_blocks: Optional[int] = None
    # Engines for which the workload says nothing new (e.g. request order cannot matter to them).
    skip_engines: tuple[str, ...] = ()
    notes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.rounds or any(not r for r in self.rounds):
            raise ValueError(f"workload {self.name}: every round needs at least one request")
        ids = [r.request_id for r in self.requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"workload {self.name}: request ids are not unique")

    @property
    def requests(self) -> list[BenchRequest]:
        return [r for rnd in self.rounds for r in rnd]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def computed_spans(self) -> list[tuple[BenchRequest, int]]:
        """(request, first position it must compute) for an engine with an unbounded, exact prefix cache.

        Each request computes what no earlier request with the same salt already
        computed (its tokens past the longest common prefix with any of them), and
        at least its last token, whose logits it needs.
        """
        tries: dict[Optional[str], dict] = {}
        spans = []
        for req in self.requests:
            node = tries.setdefault(req.cache_salt, {})
            common = 0
            for tok in req.prompt_token_ids:
                if tok not in node:
                    break
                node = node[tok]
                common += 1
            for tok in req.prompt_token_ids[common:]:
                node = node.setdefault(tok, {})
            spans.append((req, min(common, len(req.prompt_token_ids) - 1)))
        return spans

    def ideal_computed_tokens(self) -> int:
        return sum(len(req.prompt_token_ids) - start for req, start in self.computed_spans())


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n))


def _one_shared_prefix(name: str, id_prefix: str, label: str, prefix_len: int, n: int, lo: int, hi: int,
                       out: int, seed: int) -> Workload:
    """One prefix of `prefix_len` tokens, then `n` requests each adding lo..hi tokens of its own."""
    rng = random.Random(seed)
    prefix = _tokens(rng, prefix_len)
    reqs = tuple(BenchRequest(f"{id_prefix}-{i}", prefix + _tokens(rng, rng.randint(lo, hi)), out,
                              shared_prefix_len=prefix_len) for i in range(n))
    return Workload(name, f"{label}, {n} questions of {lo}-{hi} tokens, {out} output tokens each", seed, (reqs,))


def system_prompt(quick: bool, seed: int = 1) -> Workload:
    sys_len, n, out = (128, 4, 4) if quick else (320, 12, 16)
    return _one_shared_prefix("system-prompt", "sys", f"one {sys_len}-token system prompt", sys_len, n, 16, 48,
                              out, seed)


def long_doc_qa(quick: bool, seed: int = 2) -> Workload:
    doc_len, n, out = (256, 4, 4) if quick else (1024, 16, 16)
    return _one_shared_prefix("long-doc-qa", "doc", f"one {doc_len}-token document", doc_len, n, 24, 40, out, seed)


def long_doc_qa_order(order: str, quick: bool, seed: int = 3) -> Workload:
    """vLLM's long-document QA orders: several documents, each asked several times.

    tile (d1 d2 d3 d1 d2 d3 ...) reuses least under a small cache, interleave
    (d1 d1 d1 d2 ...) most; random is in between. The KV pool holds two
    documents, so with three the order decides what is still cached.
    """
    if order not in LONG_DOC_ORDERS:
        raise ValueError(f"order must be one of {LONG_DOC_ORDERS}, got {order!r}")
    rng = random.Random(seed)
    docs_n, doc_len, repeats, out = (3, 128, 2, 4) if quick else (3, 512, 3, 8)
    docs = [_tokens(rng, doc_len) for _ in range(docs_n)]
    questions = [[_tokens(rng, 16) for _ in range(repeats)] for _ in range(docs_n)]
    if order == "tile":
        pairs = [(d, k) for k in range(repeats) for d in range(docs_n)]
    elif order == "interleave":
        pairs = [(d, k) for d in range(docs_n) for k in range(repeats)]
    else:
        pairs = [(d, k) for d in range(docs_n) for k in range(repeats)]
        random.Random(seed + 1).shuffle(pairs)
    reqs = tuple(BenchRequest(f"{order}-d{d}-q{k}", docs[d] + questions[d][k], out, shared_prefix_len=doc_len)
                 for d, k in pairs)
    block = 16
    kv_blocks = 2 * (doc_len + 16 + out + block) // block + 2
    return Workload(f"long-doc-qa-{order}", f"{docs_n} documents of {doc_len} tokens, each asked {repeats} times "
                    f"(16-token questions, {out} output tokens) in {order} order; KV pool of {kv_blocks} blocks "
                    f"(about two documents)", seed, (reqs,), kv_blocks=kv_blocks,
                    skip_engines=("hf-padded", "hf-reuse"),
                    notes={"order": order})


def multi_turn(quick: bool, seed: int = 4) -> Workload:
    """Conversations whose history (user turn + a scripted assistant reply) grows turn by turn.

    The assistant replies in the history are scripted, not the engine's output,
    so every engine sees the same prompts.
    """
    rng = random.Random(seed)
    convs, turns, sys_len, user_len, reply_len, out = (2, 2, 48, 16, 8, 4) if quick else (3, 4, 96, 32, 16, 16)
    histories = [_tokens(rng, sys_len) for _ in range(convs)]
    previous = [0] * convs
    rounds = []
    for t in range(turns):
        rnd = []
        for c in range(convs):
            prompt = histories[c] + _tokens(rng, user_len)
            # The next turn's prompt extends this whole prompt, so a careful user keeps all but its last
            # token; the last turn shares only the previous prompt.
            shared = len(prompt) - 1 if t < turns - 1 else previous[c]
            rnd.append(BenchRequest(f"conv{c}-turn{t}", prompt, out, shared_prefix_len=shared))
            previous[c] = len(prompt)
            histories[c] = prompt + _tokens(rng, reply_len)
        rounds.append(tuple(rnd))
    return Workload("multi-turn", f"{convs} conversations x {turns} turns ({sys_len}-token opening, "
                    f"{user_len}-token user turns, {reply_len}-token scripted replies), {out} output tokens; "
                    "each turn waits for the previous one", seed, tuple(rounds))


def agent(quick: bool, seed: int = 8) -> Workload:
    """Concurrent agent loops: one system prompt and tool list shared by all, then per loop a task
    and, turn after turn, a scripted tool call and its result appended to its private history.

    Calls and results are scripted (every engine sees the same prompts); each turn's prompt extends
    the loop's previous one, as an append-only agent's does.
    """
    rng = random.Random(seed)
    loops, turns, sys_len, tools_len, task_len, call_len, result_len, out = (
        (2, 3, 96, 64, 16, 12, 24, 4) if quick else (4, 6, 256, 256, 32, 24, 64, 16))
    shared = _tokens(rng, sys_len + tools_len)
    histories = [shared + _tokens(rng, task_len) for _ in range(loops)]
    previous = [len(shared)] * loops
    rounds = []
    for t in range(turns):
        rnd = []
        for c in range(loops):
            prompt = histories[c]
            # the next turn extends this prompt; the last turn shares the previous one
            reuse = len(prompt) - 1 if t < turns - 1 else previous[c]
            rnd.append(BenchRequest(f"agent{c}-turn{t}", prompt, out, shared_prefix_len=reuse))
            previous[c] = len(prompt)
            histories[c] = prompt + _tokens(rng, call_len) + _tokens(rng, result_len)
        rounds.append(tuple(rnd))
    return Workload("agent", f"{loops} agent loops x {turns} turns on one shared {sys_len}-token system "
                    f"prompt + {tools_len}-token tool list; each turn appends a {call_len}-token tool call "
                    f"and a {result_len}-token result to the loop's history, {out} output tokens; "
                    "each turn waits for the previous one", seed, tuple(rounds),
                    notes={"loops": loops, "turns": turns})


def prefix_repetition(quick: bool, seed: int = 5) -> Workload:
    rng = random.Random(seed)
    n_prefix, m_suffix, prefix_len, suffix_len, out = (2, 2, 128, 16, 4) if quick else (3, 4, 256, 32, 16)
    prefixes = [_tokens(rng, prefix_len) for _ in range(n_prefix)]
    pairs = [(p, s) for p in range(n_prefix) for s in range(m_suffix)]
    rng.shuffle(pairs)
    reqs = tuple(BenchRequest(f"rep-p{p}-s{s}", prefixes[p] + _tokens(rng, suffix_len), out,
                              shared_prefix_len=prefix_len) for p, s in pairs)
    return Workload("prefix-repetition", f"{n_prefix} prefixes of {prefix_len} tokens x {m_suffix} suffixes of "
                    f"{suffix_len} tokens, shuffled, {out} output tokens", seed, (reqs,))


def no_sharing(quick: bool, seed: int = 6) -> Workload:
    rng = random.Random(seed)
    n, lo, hi, out = (4, 64, 128, 4) if quick else (12, 128, 320, 16)
    reqs = []
    for i in range(n):
        # A distinct first token per prompt: no two prompts share even their first block.
        first = (TOKEN_LOW + i,)
        reqs.append(BenchRequest(f"uniq-{i}", first + _tokens(rng, rng.randint(lo, hi) - 1), out))
    return Workload("no-sharing", f"{n} unique prompts of {lo}-{hi} tokens, {out} output tokens: "
                    "prefix caching can never hit", seed, (tuple(reqs),), skip_engines=("hf-reuse",))


def tenants(quick: bool, seed: int = 7) -> Workload:
    """The system-prompt shape split over tenants, each with its own cache_salt."""
    rng = random.Random(seed)
    n_tenants, per_tenant, sys_len, out = (2, 2, 128, 4) if quick else (3, 4, 320, 16)
    system = _tokens(rng, sys_len)
    reqs = tuple(BenchRequest(f"t{t}-q{i}", system + _tokens(rng, rng.randint(16, 48)), out,
                              cache_salt=f"tenant-{t}", shared_prefix_len=sys_len)
                 for i in range(per_tenant) for t in range(n_tenants))
    return Workload("tenants", f"{n_tenants} tenants (cache_salts) x {per_tenant} questions on one shared "
                    f"{sys_len}-token system prompt, {out} output tokens; compared with the same prompts unsalted",
                    seed, (reqs,), skip_engines=("hf-padded", "hf-reuse", "llama.cpp"),
                    notes={"tenants": n_tenants, "shared_prefix_len": sys_len})


def without_salts(workload: Workload) -> Workload:
    """The same requests with every cache_salt removed (what tenants would share without isolation)."""
    rounds = tuple(tuple(BenchRequest(r.request_id, r.prompt_token_ids, r.max_tokens, None, r.shared_prefix_len)
                         for r in rnd) for rnd in workload.rounds)
    return Workload(workload.name + "-unsalted", workload.description, workload.seed, rounds,
                    workload.kv_blocks, workload.skip_engines, dict(workload.notes))


BUILDERS: dict[str, Callable[[bool], Workload]] = {
    "system-prompt": system_prompt,
    "long-doc-qa": long_doc_qa,
    **{f"long-doc-qa-{o}": (lambda quick, o=o: long_doc_qa_order(o, quick)) for o in LONG_DOC_ORDERS},
    "multi-turn": multi_turn,
    "agent": agent,
    "prefix-repetition": prefix_repetition,
    "no-sharing": no_sharing,
    "tenants": tenants,
}
WORKLOAD_NAMES = tuple(BUILDERS)


def build_workload(name: str, quick: bool = False) -> Workload:
    if name not in BUILDERS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)}")
    return BUILDERS[name](quick)
