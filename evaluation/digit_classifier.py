"""An independent digit classifier, trained on real pixels only, that judges the images the decoder generates."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class DigitClassifier(nn.Module):
    """A small CNN over 28-px grey digits; takes the tokenizer's RGB images in [-1, 1] at any size."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 14 x 14
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 7 x 7
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.25), nn.Linear(2 * width * 49, 128), nn.ReLU(),
                                  nn.Linear(128, 10))

    @staticmethod
    def prepare(images: torch.Tensor) -> torch.Tensor:
        """RGB (B, 3, H, W) in [-1, 1] -> grey (B, 1, 28, 28); area resampling matches how digits were upscaled."""
        grey = images.float().mean(dim=1, keepdim=True)
        return F.interpolate(grey, size=(28, 28), mode="area") if grey.shape[-1] != 28 else grey

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits (B, 10)."""
        return self.head(self.features(self.prepare(images)))

    @torch.no_grad()
    def predict(self, images: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
        """Predicted digit per image (B,), in eval mode."""
        was_training = self.training
        self.eval()
        out = torch.cat([self(images[i:i + batch_size]).argmax(-1) for i in range(0, len(images), batch_size)])
        self.train(was_training)
        return out

    @torch.no_grad()
    def penultimate_features(self, images: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
        """The 128 activations before the last linear layer (B, 128), in eval mode: the space Fréchet distance and
        diversity are measured in. (Not named `features`: that is the conv stack, whose state-dict keys must stay.)"""
        was_training = self.training
        self.eval()
        before_logits = self.head[:-1]  # flatten, dropout (off in eval), linear, ReLU
        out = torch.cat([before_logits(self.features(self.prepare(images[i:i + batch_size])))
                         for i in range(0, len(images), batch_size)])
        self.train(was_training)
        return out


def train_classifier(images: torch.Tensor, labels: np.ndarray | torch.Tensor, *, epochs: int = 3,
                     batch_size: int = 64, lr: float = 2e-3, seed: int = 0, progress: bool = True) -> DigitClassifier:
    """Train a `DigitClassifier` on real images (B, 3, H, W) in [-1, 1] with their labels."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = DigitClassifier()
    labels = torch.as_tensor(labels, dtype=torch.long)
    grey = DigitClassifier.prepare(images)  # resample once, not every epoch
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps = epochs * ((len(labels) + batch_size - 1) // batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps)
    bar = _progress(steps, "classifier", progress)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(labels), generator=generator)
        for i in range(0, len(labels), batch_size):
            idx = order[i:i + batch_size]
            # small random shifts make it robust to the tokenizer's slightly blurred, off-centre strokes
            x = torch.roll(grey[idx], shifts=tuple(torch.randint(-2, 3, (2,), generator=generator).tolist()),
                           dims=(2, 3))
            loss = F.cross_entropy(model.head(model.features(x)), labels[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            bar.update(1)
    bar.close()
    return model.eval()


def _progress(total: int, desc: str, enabled: bool):
    """A tqdm progress bar (tqdm ships with Lightning's dependencies)."""
    from tqdm.auto import tqdm

    # disable=None: tqdm turns itself off when stderr is not a terminal (a log file gets no carriage-return bars)
    return tqdm(total=total, desc=desc, disable=None if enabled else True, leave=False)
