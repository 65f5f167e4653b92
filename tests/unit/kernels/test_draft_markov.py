"""The fused Markov head step (kernels/draft_markov) against its float64 reference."""

import pytest
import torch
from helpers import device, poisoned
from sgl_atom.kernels.draft_markov import markov_argmax, reference_markov_argmax
from sgl_atom.kernels.row_quant import reference_quant_rows_fp8

DEV = device()


def check_against_float64(
    got: torch.Tensor, logits64: torch.Tensor, gap: float | torch.Tensor
) -> None:
    """Every row's pick is a float64 maximum to float32 rounding (``gap``: a float, or one per
    row), and exactly float64's argmax wherever its top-2 gap is clear of that rounding."""
    got = got.cpu()
    logits64 = logits64.cpu()
    picked = logits64.gather(1, got[:, None]).squeeze(1)
    top2 = logits64.topk(2, dim=-1).values
    assert torch.all(picked >= top2[:, 0] - gap), (picked - top2[:, 0]).min()
    clear = (top2[:, 0] - top2[:, 1]) > gap
    assert clear.any()
    assert torch.equal(got[clear], logits64.argmax(-1)[clear])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch,vocab,rank", [(1, 1000, 48), (5, 257, 64), (17, 1031, 96)])
def test_markov_argmax_matches_float64(batch, vocab, rank, dtype):
    g = torch.Generator().manual_seed(batch * 1000 + vocab + rank)
    k, j = 3, 1  # base is one column of a [batch, k, vocab] block: strided rows
    block = torch.randn(batch, k, vocab, generator=g).to(dtype).to(DEV)
    w1, w2 = ((torch.randn(vocab, rank, generator=g) * 0.2).to(dtype).to(DEV) for _ in "12")
    prev = torch.randint(0, vocab, (batch,), generator=g, dtype=torch.int32).to(DEV)
    tokens = poisoned((batch, k), torch.int64, DEV)
    out = markov_argmax(block[:, j], prev, w1, w2, tokens[:, j])
    assert out.data_ptr() == tokens[:, j].data_ptr()
    want, logits64 = reference_markov_argmax(block[:, j].cpu(), prev.cpu(), w1.cpu(), w2.cpu())
    check_against_float64(tokens[:, j], logits64, 1e-4)
    poison = torch.iinfo(torch.int64).max
    assert torch.all(tokens[:, [0, 2]] == poison), "only column j may be written"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch,vocab,rank", [(1, 1000, 48), (17, 1031, 96)])
def test_markov_argmax_fp8_w2_matches_float64(batch, vocab, rank, dtype):
    """w2 as e4m3fn rows with a scale per vocabulary row (a draft served with fp8 weights): the
    pick is the float64 argmax over the dequantized w2, and the scales matter (row scales spread
    over 2^-6..2^6, so the unscaled rows would pick other tokens)."""
    g = torch.Generator().manual_seed(batch * 977 + vocab + rank)
    base = (torch.randn(batch, vocab, generator=g) * 0.1).to(dtype).to(DEV)
    w1 = (torch.randn(vocab, rank, generator=g) * 0.2).to(dtype)
    w2 = torch.randn(vocab, rank, generator=g) * torch.logspace(-6, 6, vocab, base=2)[:, None]
    w2 = w2[torch.randperm(vocab, generator=g)].to(dtype)
    q, scale = reference_quant_rows_fp8(w2)
    scale = scale.view(-1)
    prev = torch.randint(0, vocab, (batch,), generator=g).to(DEV)
    out = poisoned((batch,), torch.int64, DEV)
    markov_argmax(base, prev, w1.to(DEV), q.to(DEV), out, scale.to(DEV))
    want, logits64 = reference_markov_argmax(base.cpu(), prev.cpu(), w1, q, scale)
    check_against_float64(out, logits64, 1e-4 * logits64.abs().amax().item())
    _, unscaled = reference_markov_argmax(base.cpu(), prev.cpu(), w1, q)
    assert not torch.equal(unscaled.argmax(-1), want)


def test_markov_argmax_ties_go_to_the_lowest_id():
    """Equal maxima inside one tile and across tiles: the lowest token id, as torch.argmax."""
    vocab, rank = 700, 64
    base = torch.zeros(3, vocab)
    base[0, [9, 5, 600]] = 2.0  # within a tile (5 and 9) and across tiles (600)
    base[1, [650, 300]] = 2.0  # two tiles, neither the first
    base[2] = 1.0  # every id ties
    w = torch.zeros(vocab, rank, dtype=torch.bfloat16)
    out = poisoned((3,), torch.int64, DEV)
    markov_argmax(base.to(DEV), torch.tensor([1, 2, 3]).to(DEV), w.to(DEV), w.to(DEV), out)
    assert out.cpu().tolist() == [5, 300, 0]


def test_markov_argmax_bias_decides():
    """The bias w1[prev] . w2[v] moves the pick: the same base, two previous tokens, two picks."""
    vocab, rank = 300, 16
    w1 = torch.zeros(vocab, rank, dtype=torch.bfloat16)
    w2 = torch.zeros(vocab, rank, dtype=torch.bfloat16)
    w1[7, 0], w2[200, 0] = 4.0, 1.0  # prev 7 lifts token 200 by 4
    w1[8, 1], w2[20, 1] = 4.0, 1.0  # prev 8 lifts token 20 by 4
    base = torch.zeros(2, vocab)
    base[:, 100] = 3.0
    out = poisoned((2,), torch.int64, DEV)
    markov_argmax(base.to(DEV), torch.tensor([7, 8]).to(DEV), w1.to(DEV), w2.to(DEV), out)
    assert out.cpu().tolist() == [200, 20]
