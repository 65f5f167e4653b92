"""Constants and checks shared by the kernel families (torch only)."""

import torch

_NUM_SMS: dict[int, int] = {}

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
FP8_SCALE_MIN = 1e-12  # floor on a per-row scale, so all-zero rows dequantize to zero


# packed 4-bit index keys (the sparse indexer's smallest cache): byte j of a row holds dim j in
# its low nibble and dim j + index_dim / 2 in its high one, each as q + 8 for q in [-7, 7], with
# a per-row fp32 scale (value = q * scale)
INT4_DTYPE = torch.uint8
INT4_MAX = 7.0
INT4_ZERO_BYTE = 0x88  # both nibbles 8: q = 0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def is_int4(dtype: torch.dtype) -> bool:
    """A packed 4-bit index-key cache (``INT4_DTYPE``, half the index dim per row)."""
    return dtype == INT4_DTYPE


def scaled_index(dtype: torch.dtype) -> bool:
    """Index keys stored with a per-token fp32 scale: fp8 or packed 4-bit."""
    return is_fp8(dtype) or is_int4(dtype)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def num_sms(device: torch.device, cpu: int = 132) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (cached); ``cpu`` for any other device,
    where launch grids are sized as for that many."""
    if device.type != "cuda":
        return cpu
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def f32_dot(q: torch.Tensor) -> bool:
    """fp32 dots (ieee) for fp32 inputs, and on CPU: the interpreter's bf16 dot is not exact."""
    return q.dtype == torch.float32 or q.device.type == "cpu"
