"""`python -m sft` is the `sft` command."""

from sft.cli.main import main

raise SystemExit(main())
