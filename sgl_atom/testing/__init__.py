"""Test and demo support: tiny checkpoints and server processes for CPU reference mode."""
