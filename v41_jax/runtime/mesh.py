"""The step on a `jax.sharding.Mesh`: data-parallel attention, expert-parallel MoE (docs/PARALLEL.md §3).

One mesh axis, `AXIS`, of N devices; device r is data-parallel rank r:

* params: the routed experts of every MoE whose expert count N divides are split in N contiguous
  blocks along their leading axis (`NamedSharding(mesh, P(AXIS))`; the MoE marks itself with a
  static `ExpertAxis`, so the model runs `model/expert_parallel.py` for it); every other leaf is
  replicated (`P()`);
* the cache: the engine's geometry of S slots and P pages, every array split along its leading
  (slot or page) axis, so rank r holds slots [r S/N, (r+1) S/N) and pages [r P/N, (r+1) P/N),
  the first of which is its null page: each device's share is a whole cache of geometry
  (S/N, P/N) (`local_geometry`), and the scheduler gives a request a slot and pages of one rank
  (`cache.bookkeeping.RankedSlots` / `RankedPages`);
* a step: the plan's spans go to their slot's rank, each rank's batch is built in its own ids
  (`build_step` on the local geometry) and all N are stacked on a leading axis `P(AXIS)`; the
  step is `shard_map` of the one-device step over that axis, jitted with explicit in / out
  shardings, the cache donated. Every rank's batch has the same bucket (the smallest that holds
  the busiest rank), so one executable serves every step of that bucket.

DSpark speculation runs as on one device, each rank verifying and drafting for its own requests
(the draft stages' MoE expert-parallel too where their experts split). Not yet under a mesh
(refused): recording intermediates, teacher forcing.

Multi-host: `initialize_distributed` wraps `jax.distributed.initialize`; after it `jax.devices()`
lists every host's devices and `make_mesh` spans them (docs/PARALLEL.md §4).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, NamedTuple, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from v41_jax.cache.buffer import allocate
from v41_jax.cache.geometry import CacheGeometry
from v41_jax.config import ModelConfig
from v41_jax.model.expert_parallel import ExpertAxis
from v41_jax.model.numerics import Numerics
from v41_jax.runtime import compile_cache
from v41_jax.runtime.metadata import Bucket, BucketSet, BuiltStep, Span, build_step
from v41_jax.runtime.packed import BatchLayout, PackedBatch
from v41_jax.runtime.runner import InFlight, Prepared, Ran, Runner
from v41_jax.runtime.scheduler import StepPlan, StepResult
from v41_jax.runtime.step import StepOutput, check_row_formats, check_speculative, step

AXIS = "dp"


def make_mesh(devices: Sequence[jax.Device] | int | None = None) -> Mesh:
    """A one-axis mesh over `devices` (a count: the first that many of `jax.devices()`; None: all)."""
    if devices is None or isinstance(devices, int):
        every = jax.devices()
        n = len(every) if devices is None else devices
        if not 1 <= n <= len(every):
            raise ValueError(f"devices: {n} asked, {len(every)} present")
        devices = every[:n]
    return Mesh(np.asarray(devices), (AXIS,))


def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int,
                           local_device_ids: Sequence[int] | None = None) -> None:
    """Join a multi-host run (before any other jax call): every host runs the same program with its
    own `process_id`; process 0's address is the coordinator. Then `make_mesh()` spans all hosts."""
    jax.distributed.initialize(coordinator_address, num_processes, process_id, local_device_ids)


def splits(n_experts: int, n: int) -> bool:
    """Whether a stack of routed experts is split over n devices (else replicated): n > 1 divides it."""
    return n > 1 and n_experts % n == 0


def expert_sharding(mesh: Mesh):
    """For `load_params(expert_sharding=)`: n_experts -> the sharding its stack is loaded into, or None."""
    return lambda n_experts: NamedSharding(mesh, P(AXIS)) if splits(n_experts, mesh.size) else None


def expert_blocks(params: dict, n: int) -> dict:
    """params with `ffn.expert_axis` set on every MoE whose experts are split over n devices."""
    def mark(block: dict) -> dict:
        ffn = block["ffn"]
        if not splits(ffn["experts"]["w1"].shape[0], n):
            return block
        return {**block, "ffn": {**ffn, "expert_axis": ExpertAxis(AXIS, n)}}
    return {**params, "layers": [mark(b) for b in params["layers"]],
            **({"mtp": [mark(b) for b in params["mtp"]]} if "mtp" in params else {})}


def param_specs(params: dict) -> Any:
    """PartitionSpec per params leaf: the routed experts of a marked MoE split, the rest replicated."""
    def block_specs(block: dict) -> dict:
        specs = jax.tree.map(lambda _: P(), block)
        if "expert_axis" in block["ffn"]:
            specs["ffn"]["experts"] = jax.tree.map(lambda _: P(AXIS), block["ffn"]["experts"])
        return specs
    specs = jax.tree.map(lambda _: P(), params)
    specs["layers"] = [block_specs(b) for b in params["layers"]]
    if "mtp" in params:
        specs["mtp"] = [block_specs(b) for b in params["mtp"]]
    return specs


def named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def local_geometry(cfg: ModelConfig, geom: CacheGeometry, n: int) -> CacheGeometry:
    """One rank's share of the cache: S/N slots, P/N pages (its first page its null page)."""
    s = geom.settings
    if s.slots % n or s.num_pages % n:
        raise ValueError(f"slots {s.slots} / num_pages {s.num_pages}: both must split over {n} devices")
    return CacheGeometry.build(cfg, replace(s, slots=s.slots // n, num_pages=s.num_pages // n))


def make_mesh_step(cfg: ModelConfig, geom: CacheGeometry, numerics: Numerics, mesh: Mesh, specs: Any,
                   speculative: bool = False):
    """The jitted sharded step: fn(params, cache, packed [N, ...], *, layout) -> StepOutput whose
    cache is the global cache and whose other fields carry a leading rank axis [N, ...].
    geom: one rank's geometry (`local_geometry`); speculative: as `step`."""
    check_row_formats(numerics, geom.settings.kv_format, geom.settings.index_format)
    check_speculative(cfg, geom, speculative)

    def local(params, cache, packed: PackedBatch, *, layout: BatchLayout) -> StepOutput:
        out = step(params, cache, layout.unpack(PackedBatch(packed.words[0], packed.bytes[0])),
                   cfg=cfg, geom=geom, numerics=numerics, speculative=speculative)
        lead = lambda a: a[None]
        return out._replace(tokens=lead(out.tokens), logprobs=lead(out.logprobs), found=lead(out.found),
                            logits=lead(out.logits), accepted=lead(out.accepted), drafts=lead(out.drafts))

    def sharded(params, cache, packed: PackedBatch, layout: BatchLayout) -> StepOutput:
        fn = jax.shard_map(lambda p, c, b: local(p, c, b, layout=layout), mesh=mesh,
                           in_specs=(specs, P(AXIS), P(AXIS)), out_specs=P(AXIS), check_vma=False)
        return fn(params, cache, packed)

    split, whole = NamedSharding(mesh, P(AXIS)), NamedSharding(mesh, P())
    # what the host reads every step is gathered onto every device, so every process of a
    # multi-host run holds it; the cache and the (tools-only) logits stay split
    outs = StepOutput(cache=split, tokens=whole, logprobs=whole, found=whole, logits=split, inter=None,
                      accepted=whole, drafts=whole)
    # jit takes no keyword arguments beside explicit in_shardings: the layout goes in by position
    jitted = jax.jit(sharded, donate_argnums=(1,), static_argnums=(3,),
                     in_shardings=(named(mesh, specs), split, split), out_shardings=outs)

    def call(params, cache, packed: PackedBatch, *, layout: BatchLayout) -> StepOutput:
        return jitted(params, cache, packed, layout)
    call.lower = lambda params, cache, packed, *, layout: jitted.lower(params, cache, packed, layout)
    return call


def place(x, sharding: NamedSharding) -> jax.Array:
    """A params leaf onto its sharding: as loaded if it is there already (experts read per device),
    else from its host value, which every process of a multi-host run holds alike."""
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    return jax.device_put(np.asarray(x), sharding)


class RankedStep(NamedTuple):
    """A step's per-rank batches and where each span's rows went."""
    bucket: Bucket
    built: tuple[BuiltStep, ...]   # per rank, in its own slot and page ids
    rank: np.ndarray               # int [n_spans] each span's rank
    index: np.ndarray              # int [n_spans] its request row in that rank's batch
    rows: np.ndarray               # int [O, 2] (rank, logits row there) of each span's logits rows, in order


class MeshRunner(Runner):
    """The Runner (its pipelined prepare / dispatch / collect and synchronous `run`) on a mesh."""

    def __init__(self, params: dict, cfg: ModelConfig, geom: CacheGeometry, numerics: Numerics,
                 buckets: BucketSet, token_map: np.ndarray | None = None, device_engram: bool | None = None,
                 speculative: bool = False, *, mesh: Mesh):
        self.mesh, self.ranks = mesh, mesh.size
        self.local_geom = local_geometry(cfg, geom, self.ranks)
        super().__init__(expert_blocks(params, self.ranks), cfg, geom, numerics, buckets, token_map,
                         device_engram=device_engram, speculative=speculative)
        self.specs = param_specs(self.params)
        self.params = jax.tree.map(place, self.params, named(mesh, self.specs))
        self.step_fn = make_mesh_step(cfg, self.local_geom, numerics, mesh, self.specs, speculative)

    def make_step_fn(self):
        return None      # set once the params are placed (`__init__`)

    def fresh_cache(self):
        return jax.jit(lambda: allocate(self.geom), out_shardings=NamedSharding(self.mesh, P(AXIS)))()

    # ---- per-rank batches ----------------------------------------------------------------------
    def layout(self, bucket: Bucket) -> BatchLayout:
        if bucket not in self.layouts:
            self.layouts[bucket] = BatchLayout.of(build_step(self.local_geom, self.cfg, bucket, []).batch)
        return self.layouts[bucket]

    def split(self, spans: Sequence[Span], bucket: Bucket | None = None) -> RankedStep:
        """Spans in global ids -> each rank's batch in its own ids (a span's pages must be its slot's
        rank's), on the smallest bucket that holds the busiest rank (`bucket` if given)."""
        s_per, p_per = self.local_geom.settings.slots, self.local_geom.settings.num_pages
        rank = np.asarray([sp.slot // s_per for sp in spans], np.int64)
        mine: list[list[Span]] = [[] for _ in range(self.ranks)]
        index = np.zeros(len(spans), np.int64)
        for b, (sp, r) in enumerate(zip(spans, rank)):
            pages = np.asarray(sp.pages, np.int64)
            if len(pages) and (pages.min() // p_per != r or pages.max() // p_per != r):
                raise ValueError(f"span {sp.request_id!r}: slot {sp.slot} is rank {r}'s, pages {pages.tolist()} "
                                 f"are not all in its range [{r * p_per}, {(r + 1) * p_per})")
            index[b] = len(mine[r])
            mine[r].append(replace(sp, slot=sp.slot - r * s_per, pages=(pages - r * p_per).astype(np.int32)))
        if bucket is None:
            load = [(len(m), sum(len(sp.tokens) for sp in m),
                     sum(len(sp.tokens) if sp.all_logits else 1 for sp in m)) for m in mine]
            bucket = self.buckets.pick(*(max(x[i] for x in load) for i in range(3)))
        built = tuple(build_step(self.local_geom, self.cfg, bucket, m) for m in mine)
        first = {}                                  # (rank, index) -> its first logits row there
        for r, m in enumerate(mine):
            n = np.asarray([len(sp.tokens) if sp.all_logits else 1 for sp in m], np.int64)
            first.update({(r, j): int(o) for j, o in enumerate(np.cumsum(n) - n)})
        rows = [(r, first[r, j] + i) for sp, r, j in zip(spans, rank, index)
                for i in range(len(sp.tokens) if sp.all_logits else 1)]
        return RankedStep(bucket, built, rank, index, np.asarray(rows, np.int64).reshape(-1, 2))

    def send(self, bucket: Bucket, batches) -> PackedBatch:
        """Every rank's host batch packed, stacked on the rank axis and put on its device."""
        packed = [self.layout(bucket).pack(b) for b in batches]
        stacked = PackedBatch(np.stack([p.words for p in packed]), np.stack([p.bytes for p in packed]))
        return jax.device_put(stacked, NamedSharding(self.mesh, P(AXIS)))

    # ---- the pipelined step --------------------------------------------------------------------
    def prepare(self, plan: StepPlan) -> Prepared:
        """As `Runner.prepare`; a host-filled decode's token and request rows are (rank, row) pairs."""
        steady = self.steady(plan)
        if steady is not None:
            return steady
        spans, pending = self.plan_spans(plan)
        ranked = self.split(spans)
        b = np.asarray([i for i, _ in pending], np.int64)
        cursors = np.stack([c for _, c in pending]) if pending else np.zeros((0, self.geom.history + 1), np.int64)
        rank, req = ranked.rank[b], ranked.index[b]
        rows = np.asarray([ranked.built[r].batch.req_offset[j] for r, j in zip(rank, req)], np.int64)
        fresh = np.zeros(self.geom.settings.slots, bool)
        fresh[[sp.slot for sp in plan.spans if sp.position == 0]] = True
        handoff = bool(len(b)) and not self.device_feedback     # the batches are complete only in dispatch
        return self.remember(Prepared(plan, ranked, None if handoff else self.send(ranked.bucket,
                                                                                  [x.batch for x in ranked.built]),
                                      np.stack([rank, rows], 1), np.stack([rank, req], 1),
                                      tuple(plan.spans[i].rid for i in b), cursors, fresh,
                                      any(sp.seq.req.logprobs for sp in plan.spans)))

    def dispatch(self, prep: Prepared, feedback=None) -> InFlight:
        """As `Runner.dispatch`: with the host hand-off, the previous step's tokens (feedback:
        request id -> token) and their Engram rows go into each rank's batch first."""
        ranked, device_batch = prep.built, prep.device_batch
        if device_batch is None:
            toks = np.asarray([feedback[rid] for rid in prep.pending_ids], np.int32)
            codes, scales, nxt = self.fed_rows(prep.pending_cursors, toks)
            for r, built in enumerate(ranked.built):
                on = prep.pending_rows[:, 0] == r
                self.feed(built.batch, prep.pending_rows[on, 1], prep.pending_reqs[on, 1], toks[on],
                          tuple(c[on] for c in codes), tuple(s[on] for s in scales), nxt[on])
            device_batch = self.send(ranked.bucket, [x.batch for x in ranked.built])
        out = self._launch(ranked.bucket, device_batch, prep.fresh)
        for a in ((out.tokens, out.found) + ((out.logprobs,) if prep.logprobs else ())
                  + ((out.accepted, out.drafts) if self.speculative else ())):
            a.copy_to_host_async()
        return InFlight(prep.plan.step_id, out, prep.logprobs, prep.built)

    def collect(self, flight: InFlight) -> StepResult:
        out, ranked = flight.out, flight.built
        per_span = lambda a: np.asarray(a)[ranked.rank, ranked.index]      # [N, R, ...] -> span order
        return StepResult(flight.step_id, self.global_rows(ranked, np.asarray(out.tokens)), per_span(out.found),
                          self.global_rows(ranked, np.asarray(out.logprobs)) if flight.logprobs else None,
                          per_span(out.accepted) if self.speculative else None,
                          per_span(out.drafts) if self.speculative else None)

    @staticmethod
    def global_rows(ranked: RankedStep, per_rank: np.ndarray) -> np.ndarray:
        """[N, O, ...] per-rank logits rows -> the plan's rows in span order."""
        return per_rank[ranked.rows[:, 0], ranked.rows[:, 1]]

    # ---- synchronous use (tools, tests) ------------------------------------------------------
    def run(self, spans: Sequence[Span], bucket: Bucket | None = None, forced: dict | None = None) -> Ran:
        """As `Runner.run`; the output's tokens, logprobs and logits are in span order, `found` per span."""
        if forced:
            raise ValueError("teacher forcing is not sharded yet (run it on one device)")
        ranked = self.split(spans, bucket)
        fresh = np.zeros(self.geom.settings.slots, bool)
        fresh[[s.slot for s in spans if s.position == 0]] = True
        out = self._launch(ranked.bucket, self.send(ranked.bucket, [b.batch for b in ranked.built]), fresh)
        rows = lambda a: self.global_rows(ranked, np.asarray(a))
        per_span = lambda a: np.asarray(a)[ranked.rank, ranked.index]
        return Ran(out._replace(tokens=rows(out.tokens), logprobs=rows(out.logprobs), logits=rows(out.logits),
                                found=per_span(out.found), accepted=per_span(out.accepted),
                                drafts=per_span(out.drafts)), ranked)

    def warmup(self, concurrent: bool = True) -> None:
        """Compile every bucket's sharded step (concurrently: XLA compiles outside the GIL) with the
        options the one-device step gets (CUDA command buffers on a GPU); no serialized executables
        under a mesh yet."""
        def compile_one(bucket: Bucket):
            batch = self.send(bucket, [build_step(self.local_geom, self.cfg, bucket, []).batch] * self.ranks)
            lowered = self.step_fn.lower(self.params, self.cache, batch, layout=self.layout(bucket))
            return bucket, lowered.compile(compiler_options=compile_cache.compiler_options())

        buckets = self.buckets.buckets
        with ThreadPoolExecutor(max_workers=len(buckets) if concurrent else 1) as pool:
            self.compiled.update(pool.map(compile_one, buckets))
