"""``python -m tokentrace``."""

from tokentrace.cli import main

raise SystemExit(main())
