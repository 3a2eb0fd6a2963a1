"""The demo's scoring helpers (experiments/demo/evaluate.py); the figures themselves are tested in tests/evaluation."""

from __future__ import annotations

import numpy as np

from experiments.demo.evaluate import _balanced_split


def test_real_reference_subset_is_class_balanced_and_disjoint():
    labels = np.repeat(np.arange(10), 7)
    subset, rest = _balanced_split(labels, 3, np.random.default_rng(0))
    assert np.bincount(labels[subset], minlength=10).tolist() == [3] * 10
    assert len(np.intersect1d(subset, rest)) == 0 and len(subset) + len(rest) == len(labels)
