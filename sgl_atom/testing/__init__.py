"""Test and demo support: tiny checkpoints and server processes for CPU reference mode."""

from pathlib import Path

# The DSpark draft distilled against the tiny llama target (see its distill.json).
DSPARK_DISTILLED = Path(__file__).parent / "assets" / "dspark-llama-distilled"
