"""Check a downloaded checkpoint once, whole: everything `load_params` checks, plus the host Engram
tables, which a load maps without reading (docs/MODEL.md §2.3).

    python -m v41_jax.checkpoint.verify DIR [--experts fp4] [--quiet]

Prints `ok: ...` and exits 0, or prints the refusal as one line and exits 2.
"""

from __future__ import annotations

import argparse
import sys

from ..config import exit_2_on_refusal
from .load import EXPERT_HOLDS, load_params


@exit_2_on_refusal
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", help="checkpoint folder (config.json, index, shards)")
    ap.add_argument("--experts", choices=EXPERT_HOLDS, default="fp4",
                    help="how the routed experts are held while checking (fp4: the least memory)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    cfg, _ = load_params(args.folder, experts=args.experts, verify=True, progress=not args.quiet)
    print(f"ok: {args.folder}: {cfg.n_layers} layers + {cfg.n_mtp_layers} draft stages, every "
          "tensor finite, every file inside the folder")
    return 0


if __name__ == "__main__":
    sys.exit(main())
