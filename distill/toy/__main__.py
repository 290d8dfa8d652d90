"""``python -m distill.toy``: build (or load) the default toy target and print its build record."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

import torch

from distill.toy.build import load_or_build_toy_target, toy_cache_path
from distill.toy.cache import BUILD_INFO
from distill.toy.config import DEFAULT_TOY_CFG


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build (or load) the default toy target.")
    parser.add_argument("--cache-dir", default=None, help="default: $SPECDRAFT_CACHE, else ~/.cache/specdraft")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_or_build_toy_target(DEFAULT_TOY_CFG, args.cache_dir)
    path = toy_cache_path(DEFAULT_TOY_CFG, args.cache_dir)
    # The CLI's output is the build record itself, for humans and scripts alike.
    print((path / BUILD_INFO).read_text(), end="")


if __name__ == "__main__":
    main()
