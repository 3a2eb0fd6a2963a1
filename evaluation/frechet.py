"""Distribution-level scores of generated images in a classifier's feature space: Fréchet distance to real images
and per-caption diversity. `frechet_distance` is the figure every experiment reports; `torchmetrics_frechet_distance`
is torchmetrics' on the same features, kept as a cross-check (docs/evaluation.md says where the two agree)."""

from __future__ import annotations

import numpy as np
import torch


def _as_float64(features: np.ndarray | torch.Tensor) -> np.ndarray:
    """(N, D) features as a float64 array (the covariance square root needs the precision)."""
    array = features.detach().cpu().numpy() if isinstance(features, torch.Tensor) else np.asarray(features)
    array = array.astype(np.float64, copy=False)
    if array.ndim != 2 or len(array) < 2:
        raise ValueError(f"features must be (N >= 2, D); got shape {array.shape}")
    return array


def _psd_sqrt(matrix: np.ndarray) -> np.ndarray:
    """Square root of a symmetric positive semi-definite matrix; round-off negative eigenvalues count as 0."""
    values, vectors = np.linalg.eigh((matrix + matrix.T) / 2)
    return (vectors * np.sqrt(np.clip(values, 0.0, None))) @ vectors.T


def frechet_distance(features_a: np.ndarray | torch.Tensor, features_b: np.ndarray | torch.Tensor) -> float:
    """||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 (S_a S_b)^(1/2)) between Gaussians fitted to two (N, D) feature sets.

    Tr((S_a S_b)^(1/2)) = Tr((S_a^(1/2) S_b S_a^(1/2))^(1/2)): the inner matrix is symmetric PSD, so both roots are
    eigendecompositions. Unlike a general `sqrtm` this stays real and stable when the covariances are singular, which
    they are whenever there are fewer samples than feature dimensions (100 generated digits, 128 features).
    """
    a, b = _as_float64(features_a), _as_float64(features_b)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"feature dimensions differ: {a.shape[1]} vs {b.shape[1]}")
    mean_gap = a.mean(axis=0) - b.mean(axis=0)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    root_a = _psd_sqrt(cov_a)
    middle = root_a @ cov_b @ root_a
    trace_cross = np.sqrt(np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0.0, None)).sum()
    distance = mean_gap @ mean_gap + np.trace(cov_a) + np.trace(cov_b) - 2.0 * trace_cross
    return float(max(distance, 0.0))  # a true distance; only round-off can push it below 0


def mean_pairwise_distance(features: np.ndarray | torch.Tensor) -> float:
    """Mean Euclidean distance over all distinct pairs of rows of (N, D) features; 0 when every row is the same."""
    x = _as_float64(features)
    # row by row on differences, not |x|^2 + |y|^2 - 2 x.y, which cancels to round-off noise for near-equal rows
    distances = np.concatenate([np.linalg.norm(x[i + 1:] - x[i], axis=1) for i in range(len(x) - 1)])
    return float(distances.mean())


def per_group_diversity(features: np.ndarray | torch.Tensor, groups: np.ndarray | torch.Tensor) -> float:
    """Mean pairwise distance among the rows of each group (e.g. the images of one caption), averaged over groups.

    Groups with fewer than two rows have no pairs and are skipped; raises if no group has two.
    """
    x = _as_float64(features)
    groups = np.asarray(groups)
    if len(groups) != len(x):
        raise ValueError(f"{len(groups)} group labels for {len(x)} feature rows")
    spreads = [mean_pairwise_distance(x[groups == g]) for g in np.unique(groups) if (groups == g).sum() >= 2]
    if not spreads:
        raise ValueError("no group has two rows to compare")
    return float(np.mean(spreads))


class _GivenFeatures(torch.nn.Module):
    """The identity as torchmetrics' custom feature extractor: `update` is handed the features themselves."""

    def __init__(self, num_features: int) -> None:
        super().__init__()
        self.num_features = num_features  # read by FrechetInceptionDistance instead of a dummy forward

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features


def torchmetrics_frechet_distance(features_a: np.ndarray | torch.Tensor,
                                  features_b: np.ndarray | torch.Tensor) -> float:
    """torchmetrics' `FrechetInceptionDistance` between two (N, D) feature sets, with the identity as its feature
    module and the features in float64: a cross-check of `frechet_distance`, not the reported figure.

    It sums features and outer products in float64, then takes Tr((S_a S_b)^(1/2)) as the real part of the square
    roots of the general (non-symmetric) eigenvalues of S_a S_b. Needs torchmetrics (the `dev` extra; optional).
    """
    from torchmetrics.image.fid import FrechetInceptionDistance

    a, b = _as_float64(features_a), _as_float64(features_b)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"feature dimensions differ: {a.shape[1]} vs {b.shape[1]}")
    metric = FrechetInceptionDistance(feature=_GivenFeatures(a.shape[1]))
    # float64 in: its result is cast back to the features' dtype, so float32 features would round it
    metric.update(torch.from_numpy(a), real=False)
    metric.update(torch.from_numpy(b), real=True)
    return float(metric.compute())


def frechet_or_none(features: np.ndarray, reference: np.ndarray) -> float | None:
    """`frechet_distance`, or None when fewer than two samples were made (a figure a suite reports as missing)."""
    return frechet_distance(features, reference) if len(features) >= 2 else None


def diversity_or_none(features: np.ndarray, groups: np.ndarray) -> float | None:
    """`per_group_diversity`, or None when no group has two samples."""
    try:
        return per_group_diversity(features, groups)
    except ValueError:
        return None
