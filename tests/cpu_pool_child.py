"""Queue many 8-device collective programs without waiting, as the engine's loop does on a CPU
mesh, and print "done" if they all ran (tests/test_xla_env.py; `v41_jax.xla_env` says why a pool
of too few threads hangs here instead).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.cpu_pool_child {v41_jax,plain}

"v41_jax": import v41_jax first (its process-wide settings); "plain": jax alone.
"""

import sys

if sys.argv[1] == "v41_jax":
    import v41_jax  # noqa: F401

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

CALLS = 300          # far past the 32 computations a device may have in flight


def main() -> None:
    mesh = Mesh(np.array(jax.devices()), ("x",))

    def body(a):                                          # some work, then a collective
        a = jnp.tanh(a @ a.T @ a) * 0.5
        return a + jax.lax.psum(a.sum(), "x")

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = jax.device_put(np.full((len(mesh.devices) * 256, 256), 1e-3, np.float32), NamedSharding(mesh, P("x")))
    for _ in range(CALLS):
        x = f(x)                                          # queued: no wait on the previous call
    jax.block_until_ready(x)
    print("done", flush=True)


if __name__ == "__main__":
    main()
