"""`python -m sft` is the `sft` command."""

from sft.cli import main

raise SystemExit(main())
