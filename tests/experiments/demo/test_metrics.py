"""The demo's distribution scores: Fréchet distance, per-caption diversity, and the classifier features they use."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from experiments.demo.classifier import DigitClassifier
from experiments.demo.evaluate import _balanced_split
from experiments.demo.metrics import frechet_distance, mean_pairwise_distance, per_group_diversity


def samples_with_moments(mean: np.ndarray, cov: np.ndarray, n: int, seed: int) -> np.ndarray:
    """n points whose sample mean and (n - 1)-normalised covariance are exactly `mean` and `cov`."""
    z = np.random.default_rng(seed).standard_normal((n, len(mean)))
    z -= z.mean(axis=0)
    z = z @ np.linalg.inv(np.linalg.cholesky(np.cov(z, rowvar=False))).T  # whitened: sample covariance = I
    return z @ np.linalg.cholesky(cov).T + mean


def random_cov(dim: int, seed: int) -> np.ndarray:
    a = np.random.default_rng(seed).standard_normal((dim, dim))
    return a @ a.T / dim + 0.1 * np.eye(dim)


def test_frechet_distance_is_zero_for_identical_sets():
    x = np.random.default_rng(0).standard_normal((200, 16)) * 3 + 1
    assert frechet_distance(x, x) == pytest.approx(0.0, abs=1e-8)
    assert frechet_distance(torch.as_tensor(x, dtype=torch.float32), x) == pytest.approx(0.0, abs=1e-4)


def test_frechet_distance_matches_the_closed_form_for_diagonal_gaussians():
    # commuting covariances: ||mu1 - mu2||^2 + sum_i (sqrt(s1_i) - sqrt(s2_i))^2
    mu1, mu2 = np.array([0.0, 1.0, -2.0, 0.5]), np.array([1.0, 1.0, 0.0, -0.5])
    var1, var2 = np.array([1.0, 4.0, 0.25, 9.0]), np.array([2.0, 1.0, 1.0, 9.0])
    a = samples_with_moments(mu1, np.diag(var1), 300, seed=1)
    b = samples_with_moments(mu2, np.diag(var2), 500, seed=2)
    expected = ((mu1 - mu2) ** 2).sum() + ((np.sqrt(var1) - np.sqrt(var2)) ** 2).sum()
    assert frechet_distance(a, b) == pytest.approx(expected, rel=1e-9)


def test_frechet_distance_matches_the_closed_form_for_correlated_gaussians():
    scipy_linalg = pytest.importorskip("scipy.linalg")
    dim = 6
    mu1, mu2 = np.zeros(dim), np.linspace(-1, 1, dim)
    cov1, cov2 = random_cov(dim, 3), random_cov(dim, 4)
    a, b = samples_with_moments(mu1, cov1, 400, seed=5), samples_with_moments(mu2, cov2, 250, seed=6)
    cross = scipy_linalg.sqrtm(cov1 @ cov2).real  # the reference: a general (Schur) matrix square root
    expected = ((mu1 - mu2) ** 2).sum() + np.trace(cov1 + cov2 - 2 * cross)
    assert frechet_distance(a, b) == pytest.approx(expected, rel=1e-8)


def test_frechet_distance_of_a_shift_is_its_squared_length():
    x = np.random.default_rng(7).standard_normal((100, 8))
    shift = np.arange(8, dtype=float) / 4
    assert frechet_distance(x, x + shift) == pytest.approx((shift ** 2).sum(), rel=1e-8)


def test_frechet_distance_is_symmetric_and_positive():
    rng = np.random.default_rng(8)
    a = rng.exponential(size=(150, 12))  # non-Gaussian, different spreads
    b = rng.standard_normal((90, 12)) @ rng.standard_normal((12, 12))
    assert frechet_distance(a, b) == pytest.approx(frechet_distance(b, a), rel=1e-9)
    assert frechet_distance(a, b) > 1.0


def test_frechet_distance_stays_real_with_fewer_samples_than_dimensions():
    # 50 samples of 128 features: both covariances are singular, as in the demo's smoke run
    rng = np.random.default_rng(9)
    a, b = np.maximum(rng.standard_normal((50, 128)), 0), np.maximum(rng.standard_normal((60, 128)) + 0.3, 0)
    distance = frechet_distance(a, b)
    assert np.isfinite(distance) and distance > 0
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-6)
    assert frechet_distance(a, b) == pytest.approx(frechet_distance(b, a), rel=1e-7)


def test_frechet_distance_rejects_mismatched_features():
    with pytest.raises(ValueError, match="dimensions differ"):
        frechet_distance(np.zeros((5, 3)), np.zeros((5, 4)))
    with pytest.raises(ValueError, match="N >= 2"):
        frechet_distance(np.zeros((1, 3)), np.zeros((5, 3)))


def test_diversity_is_the_mean_pairwise_distance_within_groups():
    features = np.array([[0.0, 0.0], [3.0, 4.0],  # group 0: one pair, distance 5
                         [0.0, 0.0], [1.0, 0.0], [2.0, 0.0],  # group 1: distances 1, 2, 1
                         [9.0, 9.0]])  # group 2: a single image has no pair and is skipped
    groups = np.array([0, 0, 1, 1, 1, 2])
    assert mean_pairwise_distance(features[:2]) == pytest.approx(5.0)
    assert per_group_diversity(features, groups) == pytest.approx((5.0 + 4.0 / 3.0) / 2)
    assert per_group_diversity(2 * features, groups) == pytest.approx(2 * per_group_diversity(features, groups))


def test_diversity_is_zero_for_copies_and_lower_for_a_collapsed_generator():
    rng = np.random.default_rng(10)
    groups = np.repeat(np.arange(10), 8)
    centres = rng.standard_normal((10, 32)) * 5
    copies = centres[groups]
    assert per_group_diversity(copies, groups) == 0.0
    varied = copies + rng.standard_normal(copies.shape)
    collapsed = copies + 0.05 * rng.standard_normal(copies.shape)
    assert per_group_diversity(collapsed, groups) < 0.1 * per_group_diversity(varied, groups)
    with pytest.raises(ValueError, match="no group"):
        per_group_diversity(np.zeros((3, 2)), np.array([0, 1, 2]))


def test_penultimate_features_feed_the_logits_and_keep_the_saved_keys():
    torch.manual_seed(0)
    classifier = DigitClassifier().train()
    keys = list(classifier.state_dict())
    assert keys == list(DigitClassifier().state_dict()) and all(k.startswith(("features.", "head.")) for k in keys)
    images = torch.rand(6, 3, 64, 64) * 2 - 1
    features = classifier.penultimate_features(images, batch_size=4)
    assert features.shape == (6, 128) and (features >= 0).all()  # after the ReLU
    assert classifier.training  # mode restored
    torch.testing.assert_close(classifier.predict(images), classifier.head[-1](features).argmax(-1))


def test_real_reference_subset_is_class_balanced_and_disjoint():
    labels = np.repeat(np.arange(10), 7)
    subset, rest = _balanced_split(labels, 3, np.random.default_rng(0))
    assert np.bincount(labels[subset], minlength=10).tolist() == [3] * 10
    assert len(np.intersect1d(subset, rest)) == 0 and len(subset) + len(rest) == len(labels)
