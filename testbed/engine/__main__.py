"""``python -m testbed.engine --config FILE``: run one corruption engine (see docs/engine.md)."""

from __future__ import annotations

import argparse
import sys

from .shim import main


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbed.engine",
                                description="NFQUEUE bit-corruption engine for one link direction.")
    p.add_argument("--config", required=True, help="engine config JSON (written by testbed.engine.manager)")
    args = p.parse_args(argv)
    return main(args.config)


if __name__ == "__main__":
    sys.exit(cli())
