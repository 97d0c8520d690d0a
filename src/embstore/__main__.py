"""Command line of embstore: ``python -m embstore <command> [flags]``.

Commands are looked up in :data:`COMMANDS`; each one receives the remaining arguments and
returns an exit status. Add a command by adding an entry.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import NamedTuple


class Command(NamedTuple):
    """A subcommand: one help line and the function that runs it."""

    help: str
    run: Callable[[Sequence[str]], int]


def _bench(argv: Sequence[str]) -> int:
    from embstore import bench  # imported here: ``--help`` must not load the core

    return bench.main(argv)


def _demo(argv: Sequence[str]) -> int:
    from embstore import demo  # imported here: ``--help`` must not load the core

    return demo.main(argv)


#: name -> Command.
COMMANDS: dict[str, Command] = {
    "bench": Command(
        "run W1 for embstore and its peers (numpy, torch, FBGEMM, pandas), verified "
        "against numpy, and print a markdown table (quick by default, --full for W1 size)",
        _bench,
    ),
    "demo": Command(
        "train a CTR model (factorization machine, or DeepFM with torch) whose sparse "
        "features go through embstore tables, on synthetic data or a Criteo/libFM file; "
        "logs AUC, logloss, examples/s and lookup/apply latency, then the test AUC",
        _demo,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: a command name followed by that command's own flags."""
    width = max(len(name) for name in COMMANDS)
    listing = "\n".join(
        textwrap.fill(
            cmd.help,
            width=88,
            initial_indent=f"  {name:<{width}}  ",
            subsequent_indent=" " * (width + 4),
        )
        for name, cmd in COMMANDS.items()
    )
    parser = argparse.ArgumentParser(
        prog="python -m embstore",
        description="embstore command line.",
        epilog=f"commands:\n{listing}\n\n'python -m embstore COMMAND --help' shows a "
        "command's flags.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "command",
        choices=sorted(COMMANDS),
        metavar="COMMAND",
        help="one of: " + ", ".join(sorted(COMMANDS)),
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to a command; return its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] in COMMANDS:  # the command parses its own flags (and --help)
        return COMMANDS[argv[0]].run(argv[1:])
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    parser.parse_args(argv[:1])  # --help exits 0; an unknown command exits 2 with a message
    return 2


if __name__ == "__main__":
    sys.exit(main())
