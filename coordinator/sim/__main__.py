"""`python -m coordinator.sim`: see `coordinator.sim.cli`."""

from coordinator.sim.cli import main

raise SystemExit(main())
