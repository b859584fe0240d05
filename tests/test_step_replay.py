"""`check_reference` through the cache and the jitted step (prefill + 16 teacher-forced decode
steps) passes on the official fixtures at the checker's own tolerances."""

from pathlib import Path

import pytest

from tests import engine_common  # noqa: F401 (the persistent compilation cache)
from v41_jax.model.numerics import Numerics
from v41_jax.tools import check_reference
from v41_jax.tools.engine_replay import engine_runner

FIXTURES = Path(__file__).resolve().parent / "fixtures/dsv41_official"


@pytest.mark.parametrize("name", ["small_a", "small_b"])
def test_engine_replay_passes_the_checker(name):
    with engine_runner():
        checks = check_reference.check_folder(str(FIXTURES / name), Numerics.reference())
    failed = [(c.key, c.stats) for c in checks if not c.passed]
    assert not failed
    keys = {c.key for c in checks}
    # the incremental path was compared, not only the prompt
    assert {"decode.logits", "decode.output_ids", "decode.block_out", "decode.engram_hash_ids"} <= keys
