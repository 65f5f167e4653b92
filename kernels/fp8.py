"""Triton helpers for float8_e4m3fn shared by the kernel families."""

import triton
import triton.language as tl


@triton.jit
def round_e4m3(x):
    # Round fp32 to the nearest e4m3fn value (ties to even) before the cast, so the cast is exact
    # and every backend (the CPU interpreter included) writes the same bytes.
    bits = x.to(tl.int32, bitcast=True)
    sign = bits & -2147483648  # the sign bit, kept by bit ops so -0.0 stays -0.0 (as torch)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep 3 mantissa bits
    normal = bits.to(tl.float32, bitcast=True)
    ax = tl.abs(x)
    sub = (ax + 16384.0) - 16384.0  # subnormals: multiples of 2**-9, ties to even
    sub = (sub.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(ax < 0.015625, sub, normal)
