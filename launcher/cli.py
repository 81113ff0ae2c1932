"""`tandem` command line: one subcommand per role. Each subcommand parses its flags into a frozen
config and calls one entry function; errors a user can cause print one clear line and exit 2."""

from __future__ import annotations

import argparse
import logging
import sys

from common.errors import TandemError

SUBCOMMANDS = {
    "make-checkpoint": "launcher.cmd_checkpoint:make_checkpoint",
    "convert": "launcher.cmd_checkpoint:convert",
    "generate": "launcher.cmd_generate:generate",
    "serve": "launcher.cmd_serve:serve",
    "router": "router.main:main",
    "prefill-worker": "prefill_worker.main:main",
    "decode-worker": "decode_worker.main:main",
    "autoscaler": "autoscaler.main:main",
    "ray-launch": "launcher.ray_launch:main",
    "bench": "benchmarks.cli:main",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        p = argparse.ArgumentParser(prog="tandem", description="disaggregated gpt-oss serving")
        p.add_argument("command", choices=sorted(SUBCOMMANDS))
        if argv and argv[0] not in ("-h", "--help"):
            p.error(f"unknown command {argv[0]!r}")
        p.print_help()
        return 0 if argv else 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    module, func = SUBCOMMANDS[argv[0]].split(":")
    import importlib

    entry = getattr(importlib.import_module(module), func)
    try:
        return int(entry(argv[1:]) or 0)
    except TandemError as e:
        print(f"tandem {argv[0]}: error: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
