"""The step on a mesh of 2, 4 and 8 CPU devices (docs/PARALLEL.md §3): data-parallel attention and
expert-parallel MoE give the one-device tokens; the cache stays split and donated; each device's
experts are read from the checkpoint alone; two processes on localhost run the multi-host path.

The checks run in one child process (`tests/mesh_child.py`) with 8 host devices: jax fixes its
device count at start-up, and the rest of the suite runs on one device. Two more processes of 4
devices each (`tests/mesh_hosts_child.py`) run the multi-host path over localhost when
V41_MESH_HOSTS=1: jax's gloo CPU collectives passed there four times on this 2-core machine, and
hung once, with no CPU used, while a second run of this test ran at the same time (so it is not in
the default suite; it is killed after 5 minutes). Not reproduced since: 2026-12-05, under two busy
loops, 8 of 8 runs passed with the pool `v41_jax.xla_env` sizes and 6 of 6 with the old one
(PJRT_NPROC=4), so whether that hang was the pool's is not known.

Tolerances: tokens are compared exactly (greedy). fp32 logits within 1e-4, as the cache-vs-forward
suite (tests/step_equivalence_suite.py): the sharded step computes the same values and differs only
in fp32 summation order (each rank's GEMMs see its own rows, the MoE's pair outputs are reduced
across devices before the same in-order sum), observed 2.3e-6 to 3.0e-6. The MoE alone: bit-equal
wherever its pair outputs are rounded to the activation dtype before the sum (bf16 numerics, and
the Pallas path in fp32). Not compared alone: the XLA path in fp32, whose GEMMs XLA:CPU sums in an
order that depends on the program around them (one device, jitted vs eager: 3.6e-7 apart).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.engine_common import ROOT

ATOL = 1e-4
HOSTS = os.environ.get("V41_MESH_HOSTS") == "1"


# XLA:CPU ends a process whose devices do not all reach a collective within 40 s; on a loaded
# machine (the suite shares 2 cores) a device's thread can wait that long: 10 minutes, below the
# children's own timeout
XLA_FLAGS = ("--xla_cpu_collective_call_terminate_timeout_seconds=600 "
             "--xla_cpu_collective_timeout_seconds=600 --xla_force_host_platform_device_count=")


def _env(devices: int) -> dict:
    return {**os.environ, "XLA_FLAGS": f"{XLA_FLAGS}{devices}", "PYTHONPATH": str(ROOT)}


def _story(stderr: str) -> str:
    """What a failed child said, in order of use: the sections it finished, its Python stacks if it
    hung long enough to dump them (`mesh_child.HANG_DUMP_S`), then the first distinct other lines.
    Not the tail: a hung collective's tail is one XLA abort line per device thread, repeated."""
    lines = stderr.splitlines()
    laps = [ln for ln in lines if ln.startswith("mesh_child:")]
    start = next((i for i, ln in enumerate(lines) if ln.startswith("Timeout (")), None)
    stacks = lines[start: start + 80] if start is not None else []
    seen, rest = set(laps) | set(stacks), []
    for ln in lines:
        if ln not in seen and len(rest) < 40:
            seen.add(ln)
            rest.append(ln)
    return "\n".join(laps + stacks + rest)


def _last_json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, _story(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("mesh")


@pytest.fixture(scope="module")
def report(out):
    return _last_json(subprocess.run([sys.executable, "-m", "tests.mesh_child", str(out)], cwd=ROOT, env=_env(8),
                                     capture_output=True, text=True, timeout=900))


@pytest.fixture(scope="module")
def hosts(report, out):
    """Two processes of 4 devices on localhost, one 8-device mesh (the child wrote the checkpoint)."""
    from tests.mesh_child import free_port
    port = str(free_port())
    logs = [(open(out / f"host{i}.out", "w+"), open(out / f"host{i}.err", "w+")) for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.mesh_hosts_child", str(i), port, str(out / "tiny")],
                              cwd=ROOT, env=_env(4), stdout=o, stderr=e, text=True)   # files: no pipe fills up
             for i, (o, e) in enumerate(logs)]
    done = []
    try:
        for p, (o, e) in zip(procs, logs):
            p.wait(timeout=300)
            o.seek(0), e.seek(0)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, o.read(), e.read()))
    finally:
        for p in procs:                       # a host stuck in a collective must not outlive the test
            p.kill()
    return [_last_json(d) for d in done]


@pytest.mark.skipif(not HOSTS, reason="two gloo processes over localhost: V41_MESH_HOSTS=1")
def test_two_processes_on_localhost_give_the_one_device_tokens(report, hosts):
    """Each host holds 4 of the 8 devices and reads only their 4 experts per MoE; both run the
    same steps and read the same tokens, the one-device ones."""
    for i, h in enumerate(hosts):
        assert (h["process"], h["devices"], h["local"], h["local_experts"]) == (i, 8, 4, 4)
        assert h["tokens"] == report["tiny"]["want_tokens"]


def test_expert_parallel_moe_equals_one_device(report):
    """Bit-equal on every device count in bf16 numerics (XLA), on 8 in bf16 and fp32 (Pallas
    interpret), and with routing skewed onto two devices' experts (the busiest device computes its
    picks in two rounds)."""
    assert {"fast/xla/2", "fast/xla/4", "fast/xla/8", "fast/xla/8/skewed", "fast/pallas/8",
            "fp32/pallas/8"} <= set(report["moe"])
    for key, r in report["moe"].items():
        assert r["equal"], (key, r["max_abs"])


def test_sharded_tiny_gives_the_one_device_tokens_and_logits(report):
    r = report["tiny"]["meshes"]["8"]
    assert r["tokens"] == report["tiny"]["want_tokens"]
    assert r["logits_max_abs"] <= ATOL


def test_host_engram_hand_off_on_a_mesh(report):
    """Engram tables kept on the host (as the released model's must be), on 8 devices with two
    buckets (each rank's step takes the bucket its rows need): each step's decode tokens and their
    Engram rows are filled into every rank's batch on the host; the one-device tokens and logits
    (`test_sharded_tiny_...`). The demo on 4 gathers them on the device."""
    tiny = report["tiny"]["meshes"]["8"]
    assert tiny["device_feedback"] is False and report["demo"]["device_feedback"] is True
    assert tiny["tokens"] == report["tiny"]["want_tokens"]


@pytest.mark.parametrize("model,n", [("demo", "4"), ("tiny", "8")])
def test_cache_and_experts_stay_split_and_the_cache_donated(report, model, n):
    r = report["tiny"]["meshes"][n] if model == "tiny" else report["demo"]
    assert r["donated"] and r["cache_split"] and r["experts_split"]


def test_packed_rows_on_a_mesh_run_the_typed_computation_bit_for_bit(report):
    """Main rows FP4 and window rows FP8 (`kv_format="packed"`) in a cache split over 2 devices,
    bf16 numerics: greedy and sampled requests give the typed mesh's tokens and log-probabilities
    bit for bit, the packed planes stay split and decode to the typed planes, which hold rows."""
    r = report["packed"]
    assert r["packed_dtypes"] == ["uint8"] and r["cache_split"]
    assert r["tokens_equal"] and r["logprobs_equal"] and r["planes_equal"]
    assert r["rows_written"] > 0


def test_each_device_reads_only_its_experts(report):
    """tiny over 8 devices: the 8 experts of a backbone MoE are read one at a time (the draft
    stages' 4 do not split over 8 and are read whole, replicated); the values equal a one-device
    load; each device holds exactly the plan's routed-expert bytes."""
    r = report["load"]
    assert r["stack_reads"] == [1, 4]
    assert r["values_equal"]
    assert r["expert_bytes_per_device"] == [r["plan_bytes"]]


def test_orbax_cache_saves_and_restores_sharded(report):
    assert report["load"]["restored_split"] and report["load"]["restored_equal"]


def test_sharded_demo_model_speculates_to_the_one_device_tokens(report):
    """DSpark on a mesh of 4: the demo model (every attention mode, candidates, Engram on two
    layers) with its trained draft stages, three requests (each on the rank with the most free
    pages) of 8, fp32, decode tokens fed back on the device; greedy tokens equal one device's, and
    the mesh really verified and accepted drafts."""
    demo = report["demo"]
    assert demo["speculative"] and demo["spec"]["verifies"] > 0 and demo["spec"]["accepted"] > 0, demo["spec"]
    assert demo["device_feedback"] is True
    assert demo["tokens"] == demo["want"]


def test_demo_bytes_per_device_as_planned(report):
    """The demo model (two checkpoint shards) loaded onto 4 devices: every device holds the same
    bytes, within 10 % of the memory plan's params + Engram tables (the issue's bound; the plan
    leaves out the hash constants the device Engram path also holds)."""
    held, plan = report["demo"]["device_bytes"], report["demo"]["plan_bytes"]
    assert len(held) == 1 and abs(held[0] - plan) <= 0.1 * plan
