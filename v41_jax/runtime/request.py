"""What a user asks of the engine, and what comes back: `Request`, its events and its `Result`.

Host-only (no jax): the Scheduler, the offline generator and the servers all speak these types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from v41_jax.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class Request:
    prompt: Sequence[int]
    max_new_tokens: int = 32
    sampling: SamplingParams = SamplingParams()
    stop_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    request_id: Any = None
    logprobs: bool = False           # return each sampled token's log-probability
    speculative: bool | None = None  # DSpark drafts verified by the target; None = the engine's default
                                     # (on when the checkpoint has draft stages), False = plain decoding


FINISH_REASONS = ("eos", "stop", "length", "abort", "error")


@dataclass
class Result:
    request_id: Any
    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""          # one of FINISH_REASONS once finished
    error: str | None = None
    ttft_s: float | None = None      # submission -> first token on the host
    token_times: list[float] = field(default_factory=list)   # perf_counter of each token's arrival
    max_new_tokens: int = 0          # the budget the engine ran (capped by the context limit)
    logprobs: list[float] = field(default_factory=list)
