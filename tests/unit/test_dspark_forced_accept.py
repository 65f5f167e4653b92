"""``--atom-dspark-forced-accept N``: its refusals, its resolution hook, and the acceptance it
forces on the worker's verify result (N + 1 target tokens committed per request)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_atom import cli_flags
from sgl_atom.speculative.dspark import forced_accept as fa


@pytest.mark.parametrize(
    "value, algorithm, k, match",
    [
        ("2", None, None, r"needs|runs --speculative-algorithm None"),
        ("2", "EAGLE3", 3, r"runs --speculative-algorithm EAGLE3: add --speculative-algorithm"),
        ("4", "ATOM_DSPARK", 4, r"block of k=4 .* so N must lie in 0..3"),
        ("-1", "ATOM_DSPARK", 4, r"N must lie in 0..3"),
        ("two", "ATOM_DSPARK", 4, r"'two': give an integer"),
    ],
    ids=["no-spec", "other-algorithm", "n-equals-k", "negative", "not-int"],
)
def test_refusals_name_the_flag(value, algorithm, k, match):
    with pytest.raises(ValueError, match=match) as err:
        fa.check_forced_accept(value, algorithm, k)
    assert fa.FLAG in str(err.value)


def test_off_unless_given_and_accepts_0_to_k_minus_1():
    assert fa.check_forced_accept(None, "ATOM_DSPARK", 4) is None
    assert fa.check_forced_accept(None, None, None) is None
    assert [fa.check_forced_accept(str(n), "atom_dspark", 4) for n in range(4)] == [0, 1, 2, 3]


def _server_args(algorithm, k, value=None):
    sa = SimpleNamespace(speculative_algorithm=algorithm, speculative_num_steps=k)
    setattr(sa, cli_flags.ATTR, {} if value is None else {fa.DEST: value})
    return sa


def test_resolution_hook_checks_after_sglangs_step(monkeypatch):
    from sglang.srt.arg_groups import overrides

    monkeypatch.setattr(overrides, "resolving_view", lambda sa: sa)
    calls = []

    def previous(sa):  # SGLang's step: ATOM_DSPARK's handle_server_args sets k
        calls.append(sa)
        sa.speculative_num_steps = 4

    sa = _server_args("ATOM_DSPARK", None, "3")
    fa.settle_forced_accept(sa, previous)
    assert calls == [sa] and fa.forced_accept(sa) == 3
    plain = _server_args("ATOM_DSPARK", None)
    fa.settle_forced_accept(plain, previous)
    assert fa.forced_accept(plain) is None  # never on by default
    with pytest.raises(ValueError, match="--speculative-algorithm NGRAM"):
        fa.settle_forced_accept(_server_args("NGRAM", 3, "1"), lambda sa: None)
    with pytest.raises(ValueError, match="0..3"):
        fa.settle_forced_accept(_server_args("ATOM_DSPARK", None, "5"), previous)


@pytest.mark.parametrize("n", [0, 2, 3])
def test_forced_acceptance_commits_n_plus_one_target_tokens(n):
    batch, k, vocab = 3, 4, 50
    window = k + 1
    gen = torch.Generator().manual_seed(n)
    logits = torch.randn(batch * window, vocab, generator=gen)
    predict, accept_lens, accept_index = fa.forced_acceptance(logits, batch, window, window, n)
    assert accept_lens.tolist() == [n + 1] * batch
    target = logits.argmax(-1).view(batch, window)
    for b in range(batch):
        row = accept_index[b].tolist()
        assert row == [b * window + j for j in range(n + 1)] + [-1] * (window - n - 1)
        # the committed tokens, as the worker takes them: predict at the accepted indices
        committed = predict[accept_index[b, : n + 1].long()]
        assert committed.tolist() == target[b, : n + 1].tolist()
    assert predict.dtype == accept_index.dtype == accept_lens.dtype == torch.int32
    # with the worker's plans the shape-only tensors are built once per batch size; the
    # argmax is the step's own
    plans: dict = {}
    first = fa.forced_acceptance(logits, batch, window, window, n, plans)
    again = fa.forced_acceptance(-logits, batch, window, window, n, plans)
    assert again[1] is first[1] and again[2] is first[2] and len(plans) == 1
    assert torch.equal(first[2], accept_index) and torch.equal(first[1], accept_lens)
    assert torch.equal(again[0], (-logits).argmax(-1).to(torch.int32))
    fewer = fa.forced_acceptance(logits[:window], 1, window, window, n, plans)
    assert fewer[2].tolist() == accept_index[:1].tolist() and len(plans) == 2


def test_forced_acceptance_skips_eagle_sample_only_where_it_leaves_the_logits_alone():
    """Plain greedy logits: forced acceptance is the step's only argmax. Penalties, logit bias
    or a grammar change the logits first: eagle_sample still runs before it."""
    plain = SimpleNamespace(
        acc_additive_penalties=None, acc_scaling_penalties=None, logit_bias=None
    )
    assert not fa.adjusts_logits(plain, None)
    assert fa.adjusts_logits(plain, object())  # a grammar mask
    for field in ("acc_additive_penalties", "acc_scaling_penalties", "logit_bias"):
        adjusted = SimpleNamespace(**{**vars(plain), field: torch.zeros(1, 8)})
        assert fa.adjusts_logits(adjusted, None), field
