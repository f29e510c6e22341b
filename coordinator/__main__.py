"""`python -m coordinator` runs the same CLI as the `dp-coordinator` script."""

from coordinator.cli import main

raise SystemExit(main())
