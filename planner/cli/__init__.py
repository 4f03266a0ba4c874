"""The ``planner`` command: a thin map from subcommand to library call, then printing.

User mistakes print one line on stderr and exit with code 2; no traceback. Here: ``main`` and the
table of commands; the parser is in ``arguments``, flags become specs in ``inputs``, shared
printing is in ``render``, and each command (or family of commands) has its own module.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from planner.cli.allocator import allocator_command
from planner.cli.arguments import parser
from planner.cli.calibrate import calibrate_command
from planner.cli.catalog import catalog_command, recipes_command
from planner.cli.evaluate import evaluate_command, simulate_command
from planner.cli.export import export_command
from planner.cli.plan import plan_command
from planner.cli.sweep import sweep_command
from planner.cli.validate import validate_command
from planner.errors import PlannerError

# Each command's function: False means it ran but what it was given does not fit (exit 3).
COMMANDS: dict[str, Callable[[argparse.Namespace], bool | None]] = {
    "models": catalog_command,
    "clusters": catalog_command,
    "recipes": recipes_command,
    "memory": evaluate_command,
    "evaluate": evaluate_command,
    "simulate": simulate_command,
    "allocator": allocator_command,
    "plan": plan_command,
    "sweep": sweep_command,
    "export": export_command,
    "validate": validate_command,
    "calibrate": calibrate_command,
}

# Exit codes: a script can tell a plan that fits from an infeasible job from bad input.
EXIT_FITS, EXIT_BAD_INPUT, EXIT_INFEASIBLE = 0, 2, 3
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as shells report it
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Exit 0: done (a plan or layout that fits); 2: bad input (one line on
    stderr); 3: infeasible (no layout fits, a stated layout does not fit, or an export of a
    plan that does not fit, refused without --force), with the explanation printed."""
    args = parser().parse_args(argv)
    try:
        fits = COMMANDS[args.command](args)
    except PlannerError as exc:
        print(f"planner: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # the reader of stdout went away (| head): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except OSError as exc:  # a file the command reads or writes (disk full, permissions)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"planner: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("planner: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_INFEASIBLE if fits is False else EXIT_FITS
