"""Test and demo support: tiny checkpoints and server processes for CPU reference mode."""

from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
# The DSpark draft distilled against the llama-chain target (tiny kind "llama-chain").
DSPARK_CHAIN = ASSETS / "dspark-llama-chain"
# The DSpark draft distilled against the m3-chain target (tiny kind "m3-chain").
DSPARK_M3_CHAIN = ASSETS / "dspark-m3-chain"
