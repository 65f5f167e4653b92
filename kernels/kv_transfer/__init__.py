"""Head-cut gather/scatter of paged KV regions for P/D transfer (run layout: layout.py), and
byte spans copied between buffers of one device in one launch (spans.py)."""

from .layout import RunLayout
from .pack import pack_heads, pack_pages, unpack_heads, unpack_pages
from .reference import logical_view, reference_pack_heads, reference_unpack_heads
from .spans import copy_addressed, copy_spans

__all__ = [
    "RunLayout",
    "copy_addressed",
    "copy_spans",
    "logical_view",
    "pack_heads",
    "pack_pages",
    "reference_pack_heads",
    "reference_unpack_heads",
    "unpack_heads",
    "unpack_pages",
]
