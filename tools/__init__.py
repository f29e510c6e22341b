"""Long-running checks of a live coordinator: socket fuzzing and chaos runs.

    python -m tools.fuzz --seconds 300
    python -m tools.chaos --seconds 600

The bounded CI versions of both live in tests/fuzz and tests/chaos and share
the generators and harnesses defined here.
"""
