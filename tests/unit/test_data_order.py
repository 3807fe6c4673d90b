"""The global sample order: a seeded, O(1)-addressable permutation per epoch and source."""

import numpy as np
import pytest

from data.formats.native import TokenFile
from data.mixture import MixtureSchedule, weight_quotas
from data.order import SampleOrder
from data.permutation import Permutation
from data.prep.writer import prepare_token_file
from data.token_source import TokenSource


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 65, 1000, 4097])
def test_permutation_is_a_bijection(n):
    values = Permutation(n, (1234, 0, 0))(np.arange(n))
    assert sorted(values.tolist()) == list(range(n))


def test_permutation_depends_only_on_key():
    a = Permutation(5000, (1, 0, 0))(np.arange(5000))
    assert np.array_equal(a, Permutation(5000, (1, 0, 0))(np.arange(5000)))
    assert not np.array_equal(a, Permutation(5000, (2, 0, 0))(np.arange(5000)))
    assert not np.array_equal(a, np.arange(5000))  # it does shuffle
    # Random access agrees with the full sequence: lookups are position-independent.
    idx = np.array([4999, 0, 2500, 17])
    assert np.array_equal(Permutation(5000, (1, 0, 0))(idx), a[idx])
    with pytest.raises(IndexError, match=r"\[0, 5000\)"):
        Permutation(5000, (1, 0, 0))(np.array([5000]))


def test_epoch_visits_every_window_once_and_rollover_reshuffles(pydoc_data):
    order = SampleOrder([TokenSource(pydoc_data, 64)], [1.0], seed=7)
    n = order.sources[0].num_sequences
    epoch0 = order.sequence_ids(np.arange(n))
    epoch1 = order.sequence_ids(np.arange(n, 2 * n))
    assert sorted(epoch0.tolist()) == list(range(n))  # none twice, none skipped
    assert sorted(epoch1.tolist()) == list(range(n))
    assert not np.array_equal(epoch0, epoch1)  # a new shuffle each epoch
    again = SampleOrder([TokenSource(pydoc_data, 64)], [1.0], seed=7)
    assert np.array_equal(again.sequence_ids(np.arange(2 * n)), np.concatenate([epoch0, epoch1]))
    assert not np.array_equal(SampleOrder([TokenSource(pydoc_data, 64)], [1.0], seed=8).sequence_ids(np.arange(n)),
                              epoch0)
    assert order.epochs(n - 1) == [0] and order.epochs(n) == [1] and order.epochs(5 * n + 3) == [5]


def test_rows_are_the_token_file_windows(pydoc_data):
    L = 64
    order = SampleOrder([TokenSource(pydoc_data, L)], [1.0], seed=3)
    tokens = TokenFile(pydoc_data).tokens
    g = np.array([0, 5, 999, 10 ** 9])  # a sample a billion in is as cheap as the first
    rows = order.read(g)
    for row, w in zip(rows, order.sequence_ids(g)):
        assert np.array_equal(row, tokens[w * L: w * L + L + 1])


def test_weight_quotas():
    assert weight_quotas([0.7, 0.3]) == [7, 3]
    assert weight_quotas([1, 1, 1]) == [1, 1, 1]
    assert weight_quotas([2.0]) == [1]
    assert weight_quotas([0.997, 0.001, 0.002]) == [997, 1, 2]
    tiny = weight_quotas([1.0, 1e-6, 1e-6])  # too fine for 1/1000: nearest at 1/10000, none dropped
    assert sum(tiny) == 10_000 and tiny == [9998, 1, 1]
    thirds = weight_quotas([1 / 3, 1 / 3, 1 / 3 + 1e-9])
    assert thirds == [1, 1, 1]
    assert weight_quotas([0.123457, 0.876543]) == [10, 71]  # 10/81 = 0.1234568: the nearest small ratio
    with pytest.raises(ValueError, match=r"positive numbers, got \[1.0, 0.0\]"):
        weight_quotas([1.0, 0.0])


def test_mixture_schedule_interleaves_exactly_by_weight():
    sched = MixtureSchedule([0.75, 0.25])
    source, k = sched.locate(np.arange(400))
    assert sched.block_size == 4 and np.bincount(source).tolist() == [300, 100]
    assert max(np.diff(np.flatnonzero(source == 1))) == 4  # spread out, not in runs
    for s in (0, 1):  # each source's stream is consumed in order, without gaps
        assert np.array_equal(k[source == s], np.arange((source == s).sum()))
    assert sched.drawn(400) == [300, 100] and sched.drawn(401) == [301, 100]


@pytest.fixture(scope="module")
def small_sources(tmp_path_factory, pydoc_data):
    """A second, small source (a .jsonl file) and a source made of two shards."""
    root = tmp_path_factory.mktemp("sources")
    (root / "notes.jsonl").write_text("".join(f'{{"text": "note {i}: the quick brown fox {i * i}"}}\n'
                                              for i in range(300)))
    prepare_token_file(root / "notes", [str(root / "notes.jsonl")], "byte")
    (root / "a.txt").write_text("alpha " * 500)
    (root / "b.txt").write_text("beta " * 700)
    prepare_token_file(root / "shards" / "000", [str(root / "a.txt")], "byte")
    prepare_token_file(root / "shards" / "001", [str(root / "b.txt")], "byte")
    return root


def test_sharded_source_windows_stay_inside_shards(small_sources):
    L = 32
    source = TokenSource(small_sources / "shards", L)
    sizes = [len(TokenFile(small_sources / "shards" / s)) for s in ("000", "001")]
    assert len(source.shards) == 2 and source.num_sequences == sum((n - 1) // L for n in sizes)
    rows = source.read(np.arange(source.num_sequences))
    first = (sizes[0] - 1) // L
    text = lambda r: bytes(int(t) for t in r if t < 256).decode()  # noqa: E731
    assert all("beta" not in text(r) for r in rows[:first])
    assert all("alpha" not in text(r) for r in rows[first:])


def test_mixture_order_draws_each_source_by_weight_and_covers_it(pydoc_data, small_sources):
    notes = TokenSource(small_sources / "notes", 32)
    order = SampleOrder([TokenSource(pydoc_data, 32), notes], [0.7, 0.3], seed=1)
    g = np.arange(10 * notes.num_sequences)
    source, window = order.windows(g)
    assert np.bincount(source).tolist() == [7 * len(g) // 10, 3 * len(g) // 10]
    notes_windows = window[source == 1]
    n = notes.num_sequences  # the small source repeats: every epoch of it is a full permutation
    for e in range(3):
        assert sorted(notes_windows[e * n:(e + 1) * n].tolist()) == list(range(n))
    assert order.epochs(len(g))[1] == 3
    assert order.fingerprint != SampleOrder([TokenSource(pydoc_data, 32), notes], [0.5, 0.5], 1).fingerprint
