"""``planner export``: a saved plan turned into a launcher's config files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from planner.cli.render import GiB
from planner.errors import PlannerError


def export_command(args: argparse.Namespace) -> bool:
    """Write the plan's launch config; False (exit 3) when it does not fit and --force is
    not given."""

    from planner import export
    from planner.solve.result import Plan

    try:
        text = sys.stdin.read() if args.plan == "-" else Path(args.plan).read_text()
    except OSError as exc:
        raise PlannerError(f"--plan={args.plan!r}: cannot read ({exc.strerror})") from None
    try:
        result = Plan.model_validate_json(text)
    except ValueError as exc:
        first = str(exc).splitlines()[0]
        raise PlannerError(f"--plan={args.plan!r}: not a plan JSON ({first})") from None
    est = result.estimate
    if est is not None and result.layout is not None and not est.fits and not args.force:
        print(
            f"planner: --plan={args.plan!r}: the plan does not fit HBM (peak "
            f"{est.peak_bytes / GiB:.2f} GiB per GPU, cap {est.cap_bytes / GiB:.2f} GiB); "
            "nothing written (--force writes it anyway)",
            file=sys.stderr,
        )
        return False
    out = export.EXPORTERS[args.target](result)
    if args.out:
        folder = Path(args.out)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for name, content in out.files.items():
                (folder / name).write_text(content)
        except OSError as exc:
            raise PlannerError(f"--out={args.out!r}: cannot write ({exc.strerror})") from None
    if args.json:
        print(out.model_dump_json(indent=1))
        return True
    for name, content in out.files.items():
        print(f"==> {name} <==\n{content}")
    print(out.summary(), file=sys.stderr)
    return True
