"""Host and per-device memory of a sharded load of a multi-shard checkpoint, against the memory
plan (issue 17; docs/PARALLEL.md §3 "Loading memory").

In a fresh process with N host devices (`XLA_FLAGS=--xla_force_host_platform_device_count=N`):
the checkpoint is loaded with each MoE's experts split over the mesh (`load_params(expert_sharding=)`,
each device's block read from the memory map and converted alone), then every other leaf is
replicated onto every device as `MeshRunner` does (`mesh.place`). Measured after each phase:
the process's resident memory from /proc/self/status (anonymous and file-backed pages: the
memory-mapped checkpoint counts as file pages once read) and its peak (`ru_maxrss`), and every
device's bytes from its arrays' shards.

What the plan says:
* per device: `tools.memory_plan.param_bytes` for "dp" over N devices (params only; the Engram
  tables stay memory-mapped on the host);
* host: `tools.memory_plan.host_read_bytes`, the largest single read (one device's block of an
  expert stack, stored codes + scales, copied by `np.stack`); every other tensor is a view of
  the memory map and the conversions run in XLA. Measured: tracemalloc (every allocation of the
  Python heap, numpy's buffers among them; not XLA's buffers) around each read the loader makes
  (`load._convert`, wrapped here): the peak during the read over the bytes traced just before it,
  its transient. The largest transient, the first read's apart (it pays jax's first calls), is
what the plan predicts. Beside it, the whole load's
  peak and what stays traced after it (jax's first calls, compiled conversions, the params
  tree's Python objects: a fixed cost, the same for a checkpoint of any width). On a CPU mesh
  the devices' memory is host memory too: the resident growth (/proc/self/status) is reported
  with the devices' distinct buffers beside it.

    XLA_FLAGS="--xla_force_host_platform_device_count=2 --xla_cpu_collective_timeout_seconds=600" \\
        python -m scripts.load_memory --make v41_jax/configs/tiny.config.json --experts-per-layer 64 \\
        --expert-ffn 4096 --shards 4 --devices 2 --out benchmarks/load_memory_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
import tracemalloc
from unittest import mock

MiB = 2 ** 20


def status() -> dict:
    """Resident bytes now: VmRSS, RssAnon, RssFile (Linux), and the peak so far (ru_maxrss)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    out["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def scaled_config(config: str, experts: int, ffn: int, out_dir: str) -> str:
    """`config` with more / wider routed experts (the part a sharded load splits), written to out_dir."""
    with open(config) as f:
        raw = json.load(f)
    text = raw.get("text_config", raw)
    text["n_routed_experts"], text["moe_intermediate_size"] = experts, ffn
    path = os.path.join(out_dir, "config.json")
    with open(path, "w") as f:
        json.dump(raw, f)
    return path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", help="a checkpoint folder (else --make one)")
    ap.add_argument("--make", help="config to make a random checkpoint from (scripts.make_checkpoint)")
    ap.add_argument("--experts-per-layer", type=int, default=64)
    ap.add_argument("--expert-ffn", type=int, default=512)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--experts", default="auto", help="held expert format (load_params experts=)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="load_memory_")
    ckpt = args.ckpt
    if ckpt is None:
        if args.make is None:
            ap.error("give --ckpt or --make")
        from scripts.make_checkpoint import make_checkpoint   # in a child: its fp32 source is freed
        import multiprocessing
        ckpt = os.path.join(tmp, "ckpt")
        cfg_path = scaled_config(args.make, args.experts_per_layer, args.expert_ffn, tmp)
        child = multiprocessing.get_context("spawn").Process(target=make_checkpoint,
                                                             args=(cfg_path, ckpt, 0, args.shards))
        child.start(), child.join()
        if child.exitcode:
            raise SystemExit(f"making the checkpoint failed ({child.exitcode})")

    import jax

    from v41_jax.checkpoint import load as load_mod
    from v41_jax.checkpoint.safetensors_io import Checkpoint
    from v41_jax.runtime import mesh as mesh_mod
    from v41_jax.tools import memory_plan
    from scripts import bench_common

    if jax.device_count() < args.devices:
        raise SystemExit(f"{jax.device_count()} devices; set XLA_FLAGS=--xla_force_host_platform_device_count="
                         f"{args.devices} before the process starts")
    mesh = mesh_mod.make_mesh(args.devices)
    files = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    file_bytes = sum(os.path.getsize(os.path.join(ckpt, f)) for f in files)
    experts = load_mod.resolve_experts(args.experts)

    ck = Checkpoint(ckpt)
    reads = []          # (first tensor, its experts, host bytes read, transient, traced before it)
    peaks = [0]                          # the traced peak before each reset: the whole load's is their max
    convert = load_mod._convert

    def traced_convert(ckpt_, unit, spec, experts_):
        """`load._convert` (one read), with the peak of traced bytes during it over those before it."""
        before, peak = tracemalloc.get_traced_memory()
        peaks.append(peak)
        tracemalloc.reset_peak()
        out = convert(ckpt_, unit, spec, experts_)
        peak = tracemalloc.get_traced_memory()[1]
        peaks.append(peak)
        # what the read copies to the host: a stack's codes + scales (`np.stack`); else a view
        names = [*unit.names, *(n.removesuffix(".weight") + ".scale" for n in unit.names)] if unit.stacked else []
        copied = sum(ck.info(n).nbytes for n in names if n in ck)
        reads.append((unit.names[0], len(unit.names), copied, peak - before, before))
        return out

    start = status()
    t0 = time.perf_counter()
    tracemalloc.start()
    with mock.patch.object(load_mod, "_convert", traced_convert):
        cfg, params = load_mod.load_params(ckpt, progress=False, experts=experts,
                                           expert_sharding=mesh_mod.expert_sharding(mesh))
    loaded = status()
    host_held, host_load = tracemalloc.get_traced_memory()
    host_load = max(host_load, *peaks)
    tracemalloc.reset_peak()
    t1 = time.perf_counter()
    params = mesh_mod.expert_blocks(params, mesh.size)
    params = jax.tree.map(mesh_mod.place, params, mesh_mod.named(mesh, mesh_mod.param_specs(params)))
    jax.block_until_ready(params)
    placed = status()
    host_place = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    t2 = time.perf_counter()

    held = {d: 0 for d in mesh.devices.flat}
    buffers = {}                         # distinct device buffers (CPU devices may share one)
    for leaf in jax.tree.leaves(params):
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
            buffers[shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    largest_replicated = max(leaf.nbytes for leaf in jax.tree.leaves(params)
                             if leaf.sharding.is_fully_replicated)
    plan = memory_plan.param_bytes(memory_plan.param_leaves(cfg), experts, "dp", mesh.size)
    plan_device = sum(plan.values())
    plan_host = memory_plan.host_read_bytes(cfg, mesh.size)
    # the first read pays jax's one-time costs (its first calls): reported apart, as fixed
    largest = max(reads[1:], key=lambda r: r[3])
    copying = [r for r in reads if r[2]]
    devices_total = sum(held.values())
    report = {
        "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "backend": jax.default_backend(),
        "devices": mesh.size, "experts": experts, "checkpoint": {"path": ckpt, "files": len(files), "bytes": file_bytes,
                                                                  "config": args.make or ckpt},
        "per_device_bytes": sorted(set(held.values())), "plan_per_device_bytes": plan_device,
        "per_device_over_plan": max(held.values()) / plan_device,
        "devices_total_bytes": devices_total, "distinct_device_buffer_bytes": sum(buffers.values()),
        "largest_replicated_leaf_bytes": largest_replicated,
        # host: each read's transient (traced peak during it over traced bytes before it)
        "first_read": {"read": reads[0][0], "transient_bytes": reads[0][3], "copied": reads[0][2]},
        "plan_host_read_bytes": plan_host,
        "largest_read_copied_bytes": max(r[2] for r in reads),
        "host_transient_max": {"bytes": largest[3], "read": largest[0], "experts": largest[1], "copied": largest[2],
                               "traced_before": largest[4]},
        "host_transient_over_plan": largest[3] / plan_host,
        "reads": len(reads), "copying_reads": len(copying),
        # over the copying reads: transient / bytes copied (the first read of a shape also compiles)
        "transient_over_copied": {"min": min(r[3] / r[2] for r in copying),
                                  "median": sorted(r[3] / r[2] for r in copying)[len(copying) // 2],
                                  "max": max(r[3] / r[2] for r in copying)},
        "largest_view_read_transient_bytes": max([r[3] for r in reads[1:] if not r[2]], default=0),
        # the whole load, traced: its peak and what stays after it (the fixed cost), and `place`
        "host_traced_peak_bytes": {"load": host_load, "place": host_place},
        "host_traced_held_after_load_bytes": host_held,
        "rss": {"start": start, "loaded": loaded, "placed": placed},
        "anon_growth_bytes": placed["RssAnon"] - start["RssAnon"],
        "anon_growth_over_devices_total": (placed["RssAnon"] - start["RssAnon"]) / devices_total,
        "file_growth_bytes": placed["RssFile"] - start["RssFile"],
        "peak_growth_bytes": placed["peak"] - start["VmRSS"],
        # what the host held at its peak beyond the end state (devices' bytes + file pages)
        "peak_over_end_bytes": placed["peak"] - placed["VmRSS"],
        "seconds": {"load": round(t1 - t0, 2), "place": round(t2 - t1, 2)},
    }
    bench_common.print_and_save(report, args.out)
    return report


if __name__ == "__main__":
    main()
