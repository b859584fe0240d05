"""The engine: a Scheduler (host) and a Runner (device) in one pipelined loop.

    engine = Engine.from_checkpoint("artifacts/demo")
    results = engine.generate(["def fib(n):"], SamplingParams(temperature=0.7), max_new_tokens=32)
    for event in engine.stream(Request(prompt_ids, max_new_tokens=64)): ...

Each `step()` plans step N+1 and builds its metadata while step N is still on the device, launches
N+1 behind N (a decode row whose token N samples reads it on the device, from the cache's
`sampled`; its Engram ids are finished there from the tables' device copy), and only then waits
for N's outputs (copied to the host asynchronously as soon as N was launched) and applies them:
tokens, finishes, the stale-state verdict, and returns their events. So the device always has the
next step queued and host work overlaps it. When the Engram tables are too large for the device
(the released model), N+1's decode tokens and Engram rows are filled in on the host from N's
output before N+1 is launched: the device then waits for that short hand-off.

A speculative request (DSpark, docs/CACHE.md §4.1) is pipelined the same way: its next verify
span is pending (the step takes its position, token and drafts from the slot, whatever the step in
flight accepts; `Scheduler` counts drafts in flight as accepted until read). Without device
feedback its verify spans are built on the host from the drafts read, so while one waits for the
step in flight `step()` reads that step's results before it plans the next (the device idles for
the host's planning; plain requests in the same loop wait with it).

Servers use `add` / `abort` / `step`; `generate` and `stream` are loops over `step`.
"""

from __future__ import annotations

import os
from collections import Counter
import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from kernels_pallas.backend import on_gpu
from v41_jax.cache.geometry import CacheGeometry, EngineSettings, row_formats
from v41_jax.config import CheckpointError, ModelConfig
from v41_jax.model.layer_runs import stack_runs
from v41_jax.model.numerics import Numerics
from v41_jax.runtime import compile_cache
from v41_jax.runtime.mesh import MeshRunner, expert_sharding
from v41_jax.runtime.metadata import DEFAULT_MAX_BATCH, DEFAULT_NUMERICS, Bucket, BucketSet, Span
from v41_jax.runtime.request import Request, Result
from v41_jax.runtime.runner import InFlight, Ran, Runner
from v41_jax.runtime.sampling import SamplingParams
from v41_jax.runtime.scheduler import Event, FinishEvent, Scheduler, SpecStats, StepPlan, TokenEvent

NUMERICS = {"reference": Numerics.reference, "fast": Numerics.fast, "fp32": Numerics.fp32}


def default_buckets(max_requests: int, chunk: int, width: int = 1,
                    decode_sizes: Sequence[int] | None = None) -> BucketSet:
    """Decode buckets and one prefill bucket at the full request width. decode_sizes: the request
    counts that get a decode bucket of their own (`n * width` token and logits rows; width: 1 +
    the draft block when speculating); a decode step runs in the smallest that holds it (padding
    rows cost little next to a recompile, but at batch 1 a step padded to 32 requests is several
    times the work). None: `max_requests` alone. (): the prefill bucket alone, decode steps padded
    to it: one compile, for a run whose compiling outweighs its decoding (a first short run on a CPU)."""
    sizes = (max_requests,) if decode_sizes is None else check_decode_sizes(decode_sizes, max_requests)
    rows = max_requests * width
    prefill = Bucket(chunk + rows, max_requests, rows)
    return BucketSet(tuple(Bucket(n * width, n, n * width) for n in sizes) + (prefill,))


def auto_decode_sizes(max_requests: int, gpu: bool) -> tuple[int, ...]:
    """The decode buckets an engine compiles unless told: on a GPU the powers of two below
    `max_requests` and `max_requests` (as vLLM's CUDA-graph batch sizes: a step of b requests pads
    to fewer than 2b); on a CPU `max_requests` alone, since there a compile (tens of seconds) costs
    more than the padding of a short run saves."""
    if not gpu:
        return (max_requests,)
    return tuple(sorted({1 << i for i in range(max_requests.bit_length()) if 1 << i < max_requests} | {max_requests}))


def check_decode_sizes(sizes: Sequence[int], max_requests: int) -> tuple[int, ...]:
    sizes = tuple(sizes)
    bad = [n for n in sizes if not 1 <= n <= max_requests]
    if bad:
        raise ValueError(f"decode sizes: {bad} not in 1..{max_requests} (the requests per step)")
    return sizes


def parse_decode_sizes(spec: str) -> tuple[int, ...]:
    """"1,2,4" -> (1, 2, 4); "" -> () (the prefill bucket alone)."""
    try:
        sizes = tuple(int(x) for x in spec.split(",")) if spec.strip() else ()
    except ValueError:
        raise ValueError(f"decode sizes: {spec!r} is not a comma-separated list of request counts") from None
    if any(n < 1 for n in sizes):
        raise ValueError(f"decode sizes: {spec!r}: request counts must be positive")
    return sizes


def parse_buckets(spec: str) -> BucketSet:
    """"TxRxO,..." (tokens x requests x logits rows) -> BucketSet."""
    try:
        buckets = BucketSet(tuple(Bucket(*map(int, b.split("x"))) for b in spec.split(",")))
        if min(min(b.tokens, b.requests, b.logits) for b in buckets.buckets) < 1:
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"buckets: {spec!r} is not TxRxO[,TxRxO...] with positive integers") from None
    # the scheduler fills a step up to the most tokens, requests and logits rows of any bucket at
    # once (a prompt's chunk beside every decode), so one bucket must hold all three
    t, r, o = buckets.max_tokens, buckets.max_requests, buckets.max_logits
    if not any(b.tokens >= t and b.requests >= r and b.logits >= o for b in buckets.buckets):
        raise ValueError(f"buckets: {spec!r}: no bucket holds the largest step the scheduler plans "
                         f"({t} tokens, {r} requests, {o} logits rows); add {t}x{r}x{o}")
    return buckets


@dataclass
class Stats:
    requests: int = 0
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    compile_s: float = 0.0
    run_s: float = 0.0
    verifies: int = 0                  # verify spans run (one request's drafts checked by one step)
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    proposed_at: list[int] = field(default_factory=list)   # per draft position
    accepted_at: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.run_s if self.run_s > 0 else 0.0

    @property
    def tokens_per_verify(self) -> float:
        """Tokens a verify span emits on average: drafts accepted + the target's own."""
        return (self.drafts_accepted + self.verifies) / self.verifies if self.verifies else 0.0

    @property
    def acceptance_at(self) -> list[float]:
        """Acceptance rate of each draft position (of the drafts proposed there)."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    def add_spec(self, before: SpecStats, after: SpecStats) -> None:
        """Add the speculation counters that moved from `before` to `after`."""
        width = max(len(after.proposed_at), len(self.proposed_at))
        pad = lambda xs: list(xs) + [0] * (width - len(xs))
        for name, src in (("proposed_at", "proposed_at"), ("accepted_at", "accepted_at")):
            mine, now, was = pad(getattr(self, name)), pad(getattr(after, src)), pad(getattr(before, src))
            setattr(self, name, [m + n - w for m, n, w in zip(mine, now, was)])
        self.verifies += after.verifies - before.verifies
        self.drafts_proposed = sum(self.proposed_at)
        self.drafts_accepted = sum(self.accepted_at)


class Engine:
    def __init__(self, params: dict, cfg: ModelConfig, *, settings: EngineSettings, buckets: BucketSet,
                 numerics: Numerics, token_map: np.ndarray | None = None, prefill_chunk: int | None = None,
                 eos_id: int | None = None, record: bool = False, tokenizer=None,
                 device_engram: bool | None = None, speculative: bool | None = None,
                 draft_width: int | None = None, mesh=None, scan_layers: bool = False):
        """speculative: DSpark speculative decoding for the requests that do not turn it off; None =
        on when the checkpoint has draft stages and the settings reserve the draft slack.
        draft_width: drafts per verify if given, which must be the checkpoint's block.
        mesh: a `jax.sharding.Mesh` from `runtime.mesh.make_mesh`: data-parallel attention and
        expert-parallel MoE over its devices (docs/PARALLEL.md §3; slots and pages split evenly).
        scan_layers: stack each run of identical layers (`model/layer_runs.py`) and scan it: the step
        compiles once per distinct layer instead of once per layer (one device only, for now)."""
        geom = CacheGeometry.build(cfg, settings)
        self.speculative = resolve_speculative(cfg, settings, speculative, draft_width)
        if buckets.max_requests > settings.slots:
            raise ValueError(f"buckets: {buckets.max_requests} requests per step exceed {settings.slots} slots")
        self.cfg, self.numerics, self.buckets, self.tokenizer = cfg, numerics, buckets, tokenizer
        self.eos_id = cfg.eos_token_id if eos_id is None else eos_id
        self.prefill_chunk = prefill_chunk or buckets.max_tokens
        if mesh is None:
            self.runner = Runner(stack_runs(params, cfg) if scan_layers else params, cfg, geom, numerics, buckets,
                                 token_map, record, device_engram, self.speculative)
        else:
            if record:
                raise ValueError("a mesh does not record intermediates yet (record=False)")
            if scan_layers:
                raise ValueError("a mesh does not scan layer runs yet (scan_layers=False)")
            self.runner = MeshRunner(params, cfg, geom, numerics, buckets, token_map, device_engram,
                                     self.speculative, mesh=mesh)
        self.reset()

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | os.PathLike, *, numerics: str = DEFAULT_NUMERICS, experts: str = "auto",
                        dense: str = "auto",
                        max_batch: int = DEFAULT_MAX_BATCH, chunk: int = 64, buckets: str | BucketSet | None = None,
                        page_tokens: int = 16, pages: int = 0, slots: int = 0, max_context: int = 0,
                        compile_cache_dir: str | None = None, tokenizer: str | None = None,
                        progress: bool = False, speculative: bool | None = None,
                        draft_width: int | None = None, mesh=None,
                        decode_sizes: str | Sequence[int] | None = None, scan_layers: bool = False,
                        index_format: str | None = None, kv_format: str | None = None) -> "Engine":
        """An engine over a published checkpoint folder. The tokenizer (`tokenizer.json`) and the
        Engram token map (`engram_token_map.json`) are taken from the folder when they are there.
        compile_cache_dir: the persistent compilation cache (None: `compile_cache` default).
        speculative (None: on when the checkpoint has draft stages) reserves the draft slack and
        widens the default buckets to 1 + block rows per decoding request. mesh: as `Engine`; each
        device's routed experts are read from the checkpoint straight onto it. decode_sizes: the
        request counts with a decode bucket (`default_buckets`; "1,2,4" or a sequence; None:
        `auto_decode_sizes`; with `buckets` given, unused). scan_layers: as `Engine`. index_format:
        the cache's index rows (`geometry.row_formats`: None / "typed" = the activation dtype;
        "fp4" = packed FP4 under fake-quant numerics, less memory, slower scoring). kv_format: the
        main and window rows (None / "typed", or "packed": FP4 main and FP8 window rows under
        fake-quant numerics, 0.28 / 0.52 of bf16's bytes, the same values)."""
        from v41_jax.checkpoint.load import config_path, load_params, load_token_map
        from v41_jax.engram_hash import token_map_from_tokenizer

        compile_cache.enable(compile_cache_dir)
        ckpt = Path(ckpt_dir)
        tok = load_tokenizer(tokenizer, ckpt)
        # the small files first: a bad token map is refused before minutes of weights are read
        cfg = ModelConfig.from_file(config_path(str(ckpt)))         # validated as it is read
        token_map = load_token_map(ckpt, cfg)
        cfg, params = load_params(ckpt, cfg, progress=progress, experts=experts, dense=dense,
                                  expert_sharding=None if mesh is None else expert_sharding(mesh))
        if token_map is None and tok is not None and cfg.engram_layer_ids:
            token_map = token_map_from_tokenizer(tok, cfg.engram_compressed_vocab_size)
        num = NUMERICS[numerics]()
        max_context = max_context or cfg.max_seq_len
        if isinstance(buckets, str):
            buckets = parse_buckets(buckets)
        spec = bool(cfg.n_mtp_layers) if speculative is None else speculative
        width = 1 + cfg.dspark_block_size if spec and cfg.n_mtp_layers else 1
        if isinstance(decode_sizes, str):
            decode_sizes = parse_decode_sizes(decode_sizes)
        if decode_sizes is None:
            decode_sizes = auto_decode_sizes(max_batch, on_gpu())
        buckets = buckets or default_buckets(max_batch, chunk, width, decode_sizes)
        per_request = -(-max_context // page_tokens)
        ranks = 1 if mesh is None else mesh.size          # each data-parallel rank: one device's sizes
        settings = EngineSettings(page_tokens=page_tokens,
                                  num_pages=pages or ranks * (buckets.max_requests * per_request + 1),
                                  slots=ranks * max(slots, buckets.max_requests), max_context=max_context,
                                  **row_formats(num, index_format, kv_format),
                                  draft_slack=cfg.dspark_block_size if spec and cfg.n_mtp_layers else 0)
        return cls(params, cfg, settings=settings, buckets=buckets, numerics=num, token_map=token_map,
                   prefill_chunk=chunk, tokenizer=tok, speculative=speculative, draft_width=draft_width, mesh=mesh,
                   scan_layers=scan_layers)

    # ---- state ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop every request and its state: a zeroed cache, empty allocators (compiled steps stay)."""
        geom = self.geom
        self.runner.reset()
        s = geom.settings
        self.scheduler = Scheduler(num_pages=s.num_pages, slots=s.slots, max_requests=self.buckets.max_requests,
                                   max_tokens=self.buckets.max_tokens, prefill_chunk=self.prefill_chunk,
                                   page_tokens=s.page_tokens, max_context=geom.max_context,
                                   check=self.check_request, eos_id=self.eos_id,
                                   spec_block=self.cfg.dspark_block_size if self.speculative else 0,
                                   max_logits=self.buckets.max_logits,
                                   ranks=self.runner.ranks, pipelined=self.runner.device_feedback)
        self._flight: InFlight | None = None
        self._flight_plan: StepPlan | None = None
        self._parked: list[Event] = []
        self.steps = 0
        self.bucket_steps: Counter[Bucket] = Counter()

    @property
    def geom(self) -> CacheGeometry:
        return self.runner.geom

    @property
    def params(self) -> dict:
        return self.runner.params

    @property
    def cache(self):
        return self.runner.cache

    @cache.setter
    def cache(self, value) -> None:
        self.runner.cache = value

    @property
    def pages(self):
        return self.scheduler.pages

    @property
    def slots(self):
        return self.scheduler.slots

    @property
    def step_fn(self):
        return self.runner.step_fn

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @eos_id.setter
    def eos_id(self, value) -> None:
        self._eos_id = value
        if hasattr(self, "scheduler"):
            self.scheduler.eos_id = value

    def warmup(self, concurrent: bool = True) -> float:
        """Compile every bucket (concurrently) -> seconds spent compiling or loading."""
        before = compile_cache.CompileMeter.seconds
        self.runner.warmup(concurrent)
        return compile_cache.CompileMeter.seconds - before

    # ---- requests ------------------------------------------------------------------------------
    def check_request(self, req: Request) -> str | None:
        prompt = np.asarray(req.prompt)
        if prompt.size == 0:
            return "empty prompt"
        if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer) \
                or prompt.min() < 0 or prompt.max() >= self.cfg.vocab_size:
            return f"token ids must be integers in [0, {self.cfg.vocab_size})"
        if len(prompt) >= self.geom.max_context:
            return f"prompt of {len(prompt)} tokens leaves no room below max_context {self.geom.max_context}"
        if req.max_new_tokens < 1:
            return "max_new_tokens must be >= 1"
        if req.speculative and not self.speculative:
            return "speculative decoding is off in this engine (no draft stages, or turned off)"
        need, pool, page = self.scheduler.pages_needed(req), self.request_pages(), self.geom.settings.page_tokens
        if need > pool:
            room = self.new_tokens_room(len(prompt))
            fix = (f"at most {room} new tokens fit after this prompt" if room >= 1 else
                   "the prompt alone does not fit")
            return (f"the prompt's {len(prompt)} tokens and up to {self.scheduler.budget(req)} new ones need "
                    f"{need} pages of {page} tokens, the pool has {pool} ({pool * page} tokens): {fix}")
        return None

    def request_pages(self) -> int:
        """The most cache pages one request can hold: one rank's pool, its null page out."""
        return self.geom.settings.num_pages // self.runner.ranks - 1

    def new_tokens_room(self, prompt_len: int) -> int:
        """The largest max_new_tokens a prompt of prompt_len tokens can ever run with (< 1: none):
        its tokens and the new ones within one request's pages and below max_context."""
        return min(self.request_pages() * self.geom.settings.page_tokens, self.geom.max_context) - prompt_len

    def add(self, req: Request) -> Any:
        """Queue a request -> its id (a bad one ends at once with finish_reason "error")."""
        return self.scheduler.add(req)

    def abort(self, rid) -> bool:
        return self.scheduler.abort(rid)

    def forget(self, rid) -> None:
        """Drop a finished request's record (see `Scheduler.forget`)."""
        self.scheduler.forget(rid)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._flight is not None

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """One pipelined iteration: plan and launch the next step, then apply the previous one's
        results -> the events they produced. A speculative request waiting for the step in flight
        has that step's results applied first (module docstring)."""
        early = []
        if self._flight is not None and self.scheduler.awaiting:
            # a speculative request's next span starts where the step in flight's acceptance ends
            early = self.scheduler.update(self.runner.collect(self._flight))
            self._flight = self._flight_plan = None
        plan = self.scheduler.schedule()
        prepared = self.runner.prepare(plan) if plan is not None else None
        res, flight = None, None
        if self.runner.device_feedback:
            # step N+1 is queued behind N before the host waits for N's tokens
            flight = self._launch(prepared)
            res = self.runner.collect(self._flight) if self._flight is not None else None
        else:
            # the host fills in N+1's decode tokens (and their Engram rows) from N's output first
            feedback = {}
            if self._flight is not None:
                res = self.runner.collect(self._flight)
                feedback = self._flight_plan.next_tokens(res)
            flight = self._launch(prepared, feedback)
        events = early + (self.scheduler.update(res) if res is not None else self.scheduler.drain())
        self._flight, self._flight_plan = flight, plan
        if not self.scheduler.running:
            self.runner.idle()
        if flight is None and res is None and not early and self.scheduler.running:
            raise RuntimeError("running requests but nothing to schedule")
        return events

    def _launch(self, prepared, feedback=None) -> InFlight | None:
        if prepared is None:
            return None
        self.steps += 1
        self.bucket_steps[prepared.built.bucket] += 1
        return self.runner.dispatch(prepared, feedback)

    def stream(self, request: Request | Sequence[int] | str, sampling: SamplingParams | None = None,
               **kw) -> Iterator[Event]:
        """Submit one request and yield its events as they come: TokenEvents (the new token ids,
        `text` via the tokenizer if one is known), then one FinishEvent. Other requests in the
        engine progress meanwhile; their events stay queued for their own consumers."""
        rid = self.add(self._request(request, sampling, **kw))
        while True:
            for e in self._take(lambda e: e.rid == rid):
                yield e
                if isinstance(e, FinishEvent):
                    return

    def _take(self, want: Callable[[Event], bool]) -> list[Event]:
        """The wanted events parked by an earlier consumer, else those of one more step (the
        others are parked for their own consumers)."""
        mine = [e for e in self._parked if want(e)]
        if mine:
            self._parked = [e for e in self._parked if not want(e)]
            return mine
        new = self.step()
        self._parked += [e for e in new if not want(e)]
        return [e for e in new if want(e)]

    def generate(self, prompts: Sequence[Request | Sequence[int] | str], sampling: SamplingParams | None = None,
                 *, on_event: Callable[[Event], None] | None = None, stats: Stats | None = None,
                 **kw) -> list[Result]:
        """Run every prompt to completion -> results in prompt order. A prompt is a Request, a list
        of token ids, or text (with a tokenizer); `sampling` and `kw` (max_new_tokens, stop_ids,
        ignore_eos, logprobs) apply to those that are not Requests already."""
        import time

        stats = stats if stats is not None else Stats()
        t0, c0 = time.perf_counter(), compile_cache.CompileMeter.seconds
        rids = [self.add(self._request(p, sampling, **kw)) for p in prompts]
        results = {rid: self.scheduler.by_id[rid].result for rid in rids}
        stats.requests += len(rids)
        stats.prompt_tokens += sum(r.prompt_len for r in results.values() if r.finish_reason != "error")
        pending = {rid for rid in rids if not self.scheduler.by_id[rid].done}
        steps0, spec0 = self.steps, copy.deepcopy(self.scheduler.spec_stats)
        while pending:
            for e in self._take(lambda e: e.rid in pending):
                if on_event:
                    on_event(e)
                if isinstance(e, FinishEvent):
                    pending.discard(e.rid)
        while self._flight is not None and not self.scheduler.running and not self.scheduler.waiting:
            self.step()                              # settle the last (dead) step
        stats.steps += self.steps - steps0
        stats.add_spec(spec0, self.scheduler.spec_stats)
        stats.generated_tokens += sum(len(r.tokens) for r in results.values())
        compile_s = compile_cache.CompileMeter.seconds - c0
        stats.compile_s += compile_s
        stats.run_s += time.perf_counter() - t0 - compile_s
        return [results[rid] for rid in rids]

    def _request(self, prompt, sampling: SamplingParams | None, **kw) -> Request:
        if isinstance(prompt, Request):
            return prompt
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer (tokenizer.json in the checkpoint folder)")
            prompt = self.tokenizer.encode(prompt).ids
        return Request(list(prompt), sampling=sampling or SamplingParams(), **kw)

    # ---- synchronous use (tools, tests) ------------------------------------------------------
    def make_span(self, rid, slot: int, position: int, tokens: Sequence[int], pages: Sequence[int],
                  cursor_row: np.ndarray | None, all_logits: bool = False) -> Span:
        return self.runner.span(rid, slot, position, tokens, pages, cursor_row, all_logits)

    def run(self, spans: Sequence[Span], bucket: Bucket | None = None, forced: dict | None = None) -> Ran:
        return self.runner.run(spans, bucket, forced)

    def cursors(self) -> np.ndarray:
        return self.runner.cursors()

    @property
    def step_id(self) -> int:
        return self.runner.steps


def check_draft_width(cfg: ModelConfig, draft_width: int | None) -> None:
    """A draft width (None: the checkpoint's) must be the checkpoint's block size."""
    blk = cfg.dspark_block_size
    if draft_width is not None and (not cfg.n_mtp_layers or draft_width != blk):
        have = f"drafts blocks of {blk} (dspark_block_size)" if cfg.n_mtp_layers else "has no draft stages"
        raise ValueError(f"draft width {draft_width}: this checkpoint {have}; its draft head "
                         f"proposes exactly that many tokens, so no other width can be verified")


def resolve_speculative(cfg: ModelConfig, settings: EngineSettings, want: bool | None,
                        draft_width: int | None) -> bool:
    """Whether the engine speculates (see `Engine`); a width other than the block is refused."""
    blk = cfg.dspark_block_size
    check_draft_width(cfg, draft_width)
    if want is False:
        return False
    able = bool(cfg.n_mtp_layers) and settings.draft_slack >= blk
    if want and not able:
        raise ValueError("speculative decoding needs DSpark draft stages (n_mtp_layers > 0) and "
                         f"draft_slack >= {blk} (the block) in the settings; got n_mtp_layers "
                         f"{cfg.n_mtp_layers}, draft_slack {settings.draft_slack}")
    return able


TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_MAX_BYTES = 256 << 20      # a published tokenizer.json is tens of MB at most


def load_tokenizer(path: str | None, ckpt_dir: Path | None = None):
    """A `tokenizers.Tokenizer` from `path`, else from `ckpt_dir/tokenizer.json` if there, else None.
    The checkpoint's own file must be a regular file inside its folder (`inside`: a downloaded
    folder's symlink reads nothing else), either one at most TOKENIZER_MAX_BYTES."""
    from v41_jax.checkpoint.safetensors_io import inside

    if path:
        candidate = str(path)
        if not os.path.isfile(candidate):
            raise CheckpointError(candidate, "file", "no such tokenizer file (or not a regular file)")
    elif ckpt_dir is not None and os.path.lexists(where := os.path.join(ckpt_dir, TOKENIZER_NAME)):
        candidate = inside(str(ckpt_dir), TOKENIZER_NAME, where, "file")
    else:
        return None
    if os.path.getsize(candidate) > TOKENIZER_MAX_BYTES:
        raise CheckpointError(candidate, "file", f"{os.path.getsize(candidate)} bytes, more than a tokenizer's "
                                                 f"{TOKENIZER_MAX_BYTES}")
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(candidate)
    except Exception as err:                  # noqa: BLE001 - the library raises a bare Exception
        raise CheckpointError(candidate, "file", f"not a tokenizer the tokenizers library reads: {err}") from None
