"""The distribution figures: Fréchet distance, per-caption diversity, and torchmetrics' Fréchet distance as a
cross-check of ours (docs/evaluation.md has the measured comparison)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from evaluation.frechet import (
    frechet_distance,
    mean_pairwise_distance,
    per_group_diversity,
    torchmetrics_frechet_distance,
)


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


# --- torchmetrics' FrechetInceptionDistance on the same features ---

def nuclear_norm_reference(a: np.ndarray, b: np.ndarray) -> float:
    """The Fréchet distance with Tr((S_a S_b)^(1/2)) as the nuclear norm of Xa Xb^T / sqrt((n_a - 1)(n_b - 1)) (Xa,
    Xb centred): the nonzero eigenvalues of S_a^(1/2) S_b S_a^(1/2) are the squared singular values of that matrix,
    so one SVD gives the trace with no square root of a near-zero eigenvalue (a third, independent route)."""
    xa, xb = a - a.mean(axis=0), b - b.mean(axis=0)
    cross = np.linalg.svd(xa @ xb.T, compute_uv=False).sum() / np.sqrt((len(a) - 1) * (len(b) - 1))
    gap = a.mean(axis=0) - b.mean(axis=0)
    return float(gap @ gap + (xa ** 2).sum() / (len(a) - 1) + (xb ** 2).sum() / (len(b) - 1) - 2 * cross)


def demo_like_features(n: int, shift: float, seed: int) -> np.ndarray:
    """(n, 128) ReLU features like the classifier's penultimate layer: 20 dead units (constant 0) and 108 live ones
    driven by 120 latent factors, so 100 rows (the demo's generated digits) give a covariance singular in the live
    features too (rank <= 99 < 108)."""
    rng = np.random.default_rng(seed)
    mixing = np.random.default_rng(0).standard_normal((120, 128)) / 10
    features = np.maximum(rng.standard_normal((n, 120)) @ mixing + shift, 0.0)
    features[:, :20] = 0.0
    return features


@pytest.fixture(scope="module")
def torchmetrics_fid():
    pytest.importorskip("torchmetrics")
    return torchmetrics_frechet_distance


def test_torchmetrics_agrees_on_well_conditioned_features(torchmetrics_fid):
    # case (a) of docs/evaluation.md: 2000 samples of 16 correlated features each, full-rank covariances
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2000, 16)) @ rng.standard_normal((16, 16)) / 4 + 1.0
    b = rng.standard_normal((2000, 16)) @ rng.standard_normal((16, 16)) / 4 + 1.2
    ours = frechet_distance(a, b)
    assert ours > 1.0
    assert torchmetrics_fid(a, b) == pytest.approx(ours, rel=1e-10)
    assert torchmetrics_fid(torch.as_tensor(a, dtype=torch.float32), b) == pytest.approx(
        frechet_distance(torch.as_tensor(a, dtype=torch.float32), b), rel=1e-10)


def test_torchmetrics_agrees_on_the_demos_singular_covariances(torchmetrics_fid):
    # case (b): 100 generated vs 400 real, 128 features with dead units, the 100's covariance of rank 99 < 108 live
    # features. On the real classifier's features (docs/evaluation.md) the two differed by 2.6e-7 relative: ours was
    # 2.6e-7 and torchmetrics' 2e-11 from the nuclear-norm route; both far inside the 1e-3 the figures are read to.
    generated, real = demo_like_features(100, 0.1, seed=1), demo_like_features(400, 0.0, seed=2)
    assert np.linalg.matrix_rank(np.cov(generated, rowvar=False)) <= 99
    reference = nuclear_norm_reference(generated, real)
    assert frechet_distance(generated, real) == pytest.approx(reference, rel=1e-5)
    assert torchmetrics_fid(generated, real) == pytest.approx(reference, rel=1e-5)
    assert torchmetrics_fid(generated, real) == pytest.approx(frechet_distance(generated, real), rel=1e-5)


def test_torchmetrics_agrees_with_constant_feature_columns(torchmetrics_fid):
    # case (c): 40 features, 8 dead in both sets, 4 constant at a different value in each (a mean gap, no spread)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((300, 40)) @ rng.standard_normal((40, 40)) / 6
    b = rng.standard_normal((250, 40)) @ rng.standard_normal((40, 40)) / 6 + 0.2
    a[:, :8], b[:, :8] = 0.0, 0.0
    a[:, 8:12], b[:, 8:12] = 1.0, 0.5
    for n in (300, 20):  # 20 rows: rank <= 19, singular in the 28 live features too
        reference = nuclear_norm_reference(a[:n], b)
        assert frechet_distance(a[:n], b) == pytest.approx(reference, rel=1e-7)
        assert torchmetrics_fid(a[:n], b) == pytest.approx(reference, rel=1e-7)


def test_torchmetrics_cross_check_refuses_mismatched_features(torchmetrics_fid):
    with pytest.raises(ValueError, match="dimensions differ"):
        torchmetrics_fid(np.zeros((5, 3)), np.zeros((5, 4)))
