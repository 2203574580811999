"""``python -m layerzero`` runs the CLI (same as the ``layerzero`` console script)."""

from layerzero.cli import main

raise SystemExit(main())
