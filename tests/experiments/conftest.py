"""What the experiment tests share: one torch thread, and a smoke demo cut down to the stages the experiments reuse."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

# The smoke demo, smaller still: the experiments read the tokenizer, vocabulary and token shards (stages 1-3) and the
# classifier, never the demo's own decoder, so the fixture runs those stages and trains the classifier alone.
DEMO_SETTINGS = ["tokenizer.max_steps=4", "data.train_limit=200", "data.held_out=80", "data.captions_per_image=1",
                 "data.arithmetic_documents=20", "vocab.english_lines=200", "generate.images_per_caption=1"]


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's runs: on a shared 2-core machine two threads wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def finished_demo(tmp_path_factory):
    """A demo folder with what the experiments reuse, and the settings it was made with (built once; the
    experiments write only into their own output folders)."""
    from common.files import atomic_torch_save
    from evaluation.digit_classifier import train_classifier
    from experiments.demo import pipeline
    from experiments.demo.datasets import to_model_images
    from experiments.demo.settings import load_config
    from experiments.demo.stages import digits_for

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path_factory.mktemp("demo")
        demo = replace(load_config("smoke", None, DEMO_SETTINGS), out_dir=str(out), threads=1)
        pipeline.run(demo, stages=["tokenizer", "vocab", "shards"], progress=False, log=lambda message: None)
        digits = digits_for(demo)
        classifier = train_classifier(to_model_images(digits.train_images, 64), digits.train_labels, epochs=1,
                                      progress=False)
        atomic_torch_save(classifier.state_dict(), out / "generate" / "classifier.pt")
    finally:
        torch.set_num_threads(threads)
    return demo, out
