"""``python -m planner.cli``: the ``planner`` command without its installed script."""

from planner.cli import main

raise SystemExit(main())
