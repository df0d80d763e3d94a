"""tokenkeep session server: token-exact multi-turn sessions in front of vLLM."""

__version__ = "0.1.0"
