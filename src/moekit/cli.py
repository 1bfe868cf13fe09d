"""The `moekit` command line: parse, call the library, print.

Each subcommand lives in its own module under ``moekit.commands`` (``register(sub)``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from moekit.commands import MODULES


def _pass_through() -> tuple:
    from moekit.commands.bench import PASS_THROUGH

    return PASS_THROUGH


def build_parser() -> argparse.ArgumentParser:
    from moekit import __version__

    p = argparse.ArgumentParser(prog="moekit", description="Fast expert-parallel MoE inference tools.")
    p.add_argument("--version", action="version", version=f"moekit {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for name in MODULES:
        importlib.import_module(f"moekit.commands.{name}").register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Benchmarks with parsers of their own get the rest of argv.
    args, extra = parser.parse_known_args(argv)
    if args.func not in _pass_through() and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        code = args.func(args)
        sys.stdout.flush()  # a reader that went away (`| head`) shows here, not at exit
        return code
    except BrokenPipeError:  # the reader stopped reading: stop quietly, as other Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 141  # 128 + SIGPIPE
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        print(f"moekit: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if not _rank_failed(e):
            raise
        last = [line for line in str(e).strip().splitlines() if line.strip()][-1]  # a rank failed: its last line
        print(f"moekit: error in a rank: {last}", file=sys.stderr)
        return 2


def _rank_failed(error: BaseException) -> bool:
    """Whether ``error`` is torch's ProcessRaisedException (a spawned rank raised). torch is not imported
    here: ``moekit --help`` must not pay for it, and a rank can only have failed if torch is loaded already."""
    mp = sys.modules.get("torch.multiprocessing")
    return mp is not None and isinstance(error, mp.ProcessRaisedException)


if __name__ == "__main__":
    sys.exit(main())
