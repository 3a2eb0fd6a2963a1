"""The digit classifier that judges generated digits: its features, and the state-dict names its saved files use."""

from __future__ import annotations

import torch

from evaluation.digit_classifier import DigitClassifier

# what `generate/classifier.pt` holds (a state dict, written by the demo's generate stage and read by the experiments
# and bench/): these names and shapes must stay, or every finished demo's classifier stops loading
SAVED_SHAPES = {"features.0.weight": (32, 1, 3, 3), "features.0.bias": (32,), "features.3.weight": (64, 32, 3, 3),
                "features.3.bias": (64,), "head.2.weight": (128, 3136), "head.2.bias": (128,),
                "head.4.weight": (10, 128), "head.4.bias": (10,)}


def test_the_saved_state_dict_keeps_its_names_and_shapes():
    assert {name: tuple(value.shape) for name, value in DigitClassifier().state_dict().items()} == SAVED_SHAPES


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


