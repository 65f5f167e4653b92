"""MiniMax-M3-style sparse attention: index-key write, block scoring + top-k selection over
128-token blocks, sparse attention over the selected blocks, and index-selection reuse.
Cache and page-table conventions: kernels/README.md."""

from .block_counts import block_counts, reference_block_counts
from .block_select import block_scores, select_blocks
from .index_reuse import TopkHolder, should_score
from .index_write import index_write
from .reference import (
    SPARSE_BLOCK,
    int4_query,
    reference_block_scores,
    reference_dense_attention,
    reference_index_write,
    reference_select_blocks,
    reference_sparse_attention,
    unpack_int4,
)
from .sparse_attn import num_splits_for, sparse_attention_fwd

__all__ = [
    "SPARSE_BLOCK",
    "TopkHolder",
    "block_counts",
    "block_scores",
    "index_write",
    "int4_query",
    "num_splits_for",
    "reference_block_counts",
    "reference_block_scores",
    "reference_dense_attention",
    "reference_index_write",
    "reference_select_blocks",
    "reference_sparse_attention",
    "select_blocks",
    "should_score",
    "sparse_attention_fwd",
    "unpack_int4",
]
