"""Helpers shared by the kernel tests: fresh seeds that show up in failure messages, and the
fixture decoders (FP8 e4m3 / ue8m0, FP4 e2m1 / e4m3) the reference JSON files need."""

from __future__ import annotations

import json
import pathlib

import ml_dtypes
import numpy as np

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "dsv41_reference"
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def fresh_rng() -> tuple[np.random.Generator, int]:
    """A generator on new entropy each run (inputs are drawn fresh), plus the seed to report."""
    seed = int(np.random.SeedSequence().entropy % (1 << 63))
    return np.random.default_rng(seed), seed


def load_fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def e4m3(codes) -> np.ndarray:
    return np.asarray(codes, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def ue8m0(codes) -> np.ndarray:
    return np.exp2(np.asarray(codes, np.float32) - 127)


def fp8_rows(codes, scales, dim: int, group: int = 32) -> np.ndarray:
    """FP8 e4m3 rows with one ue8m0 scale per `group` lanes -> fp32 [rows, dim]."""
    v = e4m3(codes).reshape(-1, dim // group, group)
    return (v * ue8m0(scales).reshape(v.shape[0], -1, 1)).reshape(-1, dim)


def fp4_rows(codes, scales, dim: int, group: int, scale_fmt: str) -> np.ndarray:
    """Packed e2m1 rows (low nibble = even lane) with per-group e4m3 or ue8m0 scales -> fp32."""
    b = np.asarray(codes, np.uint8).reshape(-1, dim // 2)
    v = np.stack([E2M1[b & 15], E2M1[b >> 4]], axis=-1).reshape(-1, dim // group, group)
    s = e4m3(scales) if scale_fmt == "e4m3" else ue8m0(scales)
    return (v * s.reshape(v.shape[0], -1, 1)).reshape(-1, dim)


def assert_close(actual, expected, *, rtol: float, atol: float, seed: int | None = None, what=""):
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol,
                               err_msg=f"{what} (seed {seed})" if seed is not None else what)
