"""Triton kernels with pure-torch references (torch and triton only; see README.md)."""
