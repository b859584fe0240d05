"""One of two processes ("hosts") of 4 CPU devices each, run by tests/test_mesh.py: both join one
`jax.distributed` run, load `tiny` with each host reading only its own devices' experts, and
generate on the 8-device mesh that spans them; each prints its tokens as JSON on its last line.

    python -m tests.mesh_hosts_child PROCESS_ID PORT CHECKPOINT_DIR
"""

from __future__ import annotations

import json
import sys

import jax

from tests.mesh_child import generate, tiny_engine
from v41_jax.checkpoint.load import load_params, load_token_map
from v41_jax.runtime.mesh import expert_sharding, initialize_distributed, make_mesh


def main(process_id: int, port: int, ckpt: str) -> dict:
    initialize_distributed(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    mesh = make_mesh()
    cfg, params = load_params(ckpt, progress=False, expert_sharding=expert_sharding(mesh))
    w1 = params["layers"][0]["ffn"]["experts"]["w1"]
    eng = tiny_engine(cfg, params, load_token_map(ckpt, cfg), mesh)
    return {"process": jax.process_index(), "devices": len(jax.devices()), "local": jax.local_device_count(),
            "local_experts": sum(s.data.shape[0] for s in w1.addressable_shards), "tokens": generate(eng)}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])))
