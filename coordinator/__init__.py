"""dp-coordinator: a standalone data-parallel coordinator for LLM engines.

Wire-compatible with vLLM 0.33's DP coordinator sockets. See README.md and
docs/ for the roles, sockets and the project's own frontend protocol.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
