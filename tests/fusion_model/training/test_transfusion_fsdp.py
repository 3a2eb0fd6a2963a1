"""The Transfusion family under FSDP2 (`TransfusionFamily.parallelize`): two gloo CPU ranks, one of them without
an image, take the losses, gradients and AdamW steps of one process on the whole batch."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from fusion_model.config import FusionConfig
from fusion_model.families.base import ObjectiveContext
from fusion_model.families.transfusion.family import TransfusionFamily

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_worker as fw  # noqa: E402
import test_distributed as td  # noqa: E402  (module attributes only: its tests stay collected in their own file)

# the transfusion family's tests, for their batch builders (doc, pack); loaded by path under a name of their own
_FAMILY_TESTS = Path(__file__).resolve().parents[1] / "families" / "transfusion" / "test_family.py"
_spec = importlib.util.spec_from_file_location("transfusion_family_tests", _FAMILY_TESTS)
tt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tt)

# caption dropout 0.5: some images train unconditionally (visible_from), so that path is sharded too
OPTIONS = {**tt.OPTIONS, "caption_dropout": 0.5}
# the U-Net patch encoder keeps its skip activations from `embed` to its output call (images of 4 patches, k 2)
UNET = {**OPTIONS, "patch_encoder": "unet", "latent_grid": [4, 4], "unet_channels": 8, "unet_blocks": 1}
# Adam's first step is about lr x sign(gradient): at lr 1e-3 the rounding of near-zero gradients (equal to 1e-7)
# moved weights by up to 1.3e-6; at 1e-4 the weights agree to 1e-6 while a missing update still moves one by 1e-4
LR = 1e-4


@pytest.mark.parametrize("options", [OPTIONS, UNET], ids=["linear", "unet"])
def test_fsdp2_with_an_image_free_rank_equals_one_process_on_the_whole_batch(tmp_path, one_thread, options):
    config = FusionConfig.from_preset("tiny", **tt.IMAGE, z_loss_coef=1e-3)
    family = TransfusionFamily(config, options)
    torch.manual_seed(0)
    reference = family.build()
    torch.save({name: part.state_dict() for name, part in reference.items()}, tmp_path / "weights.pt")

    one, two, three, four = tt.documents()
    text = [tt.doc(5, [60, 61, 62, 63, 64]), tt.doc(6, [70, 71], [72, 73, 74])]
    with_images, without = tt.pack([[one, four], [two], [three]], 28), tt.pack([[text[0]], [text[1], four]], 28)
    assert family.layout(without).count == 0 and family.layout(with_images).count == 4
    # rank 1 has no image at step 0, rank 0 none at step 1: its patches part still joins every collective
    steps = [[with_images, without], [without, tt.pack([[three, two], [one]], 28)]]
    torch.save({"steps": steps}, tmp_path / "batches.pt")
    fw.spawn_processes(fw.family_fsdp2_steps, (2, td._free_port(), "transfusion", config.to_dict(), options,
                                   str(tmp_path / "weights.pt"), str(tmp_path / "batches.pt"),
                                   str(tmp_path / "fsdp2.pt"), LR), processes=2, timeout=240)
    sharded = torch.load(tmp_path / "fsdp2.pt", weights_only=True)

    def whole_step(parts: dict, index: int) -> torch.Tensor:
        """One process on the step's whole batch: its loss, gradients left in `parts`."""
        step = steps[index]
        whole = {key: torch.cat([batch[key] for batch in step]) for key in step[0]}
        objective = family.objective(parts, whole, ObjectiveContext(step=index))
        loss = objective.loss(objective.counts())
        loss.backward()
        return loss.detach()

    initial = torch.load(tmp_path / "weights.pt", weights_only=True)
    for index in range(len(steps)):
        # gradients at the weights the sharded run had before this step (Adam's first step would otherwise
        # magnify rounding differences of near-zero gradients into the next step's)
        at = family.build()
        for name, part in at.items():
            before = initial[name] if index == 0 else {key.split(".", 1)[1]: value for key, value
                                                       in sharded["weights"][index - 1].items()
                                                       if key.split(".", 1)[0] == name}
            part.load_state_dict(before)
        loss = whole_step(at, index)
        torch.testing.assert_close(sharded["losses"][index], loss, rtol=1e-5, atol=1e-7)
        named = {f"{part}.{name}": p for part, module in at.items() for name, p in module.named_parameters()}
        assert set(sharded["grads"][index]) == set(named)
        for name, p in named.items():
            assert float(p.grad.abs().max()) > 0, name  # every part's weights (embedding, head, patches) train
            torch.testing.assert_close(sharded["grads"][index][name], p.grad, rtol=1e-5, atol=1e-7, msg=name)

    # and one process's own AdamW steps end at the sharded run's weights
    optimizer = torch.optim.AdamW([p for part in reference.values() for p in part.parameters()], lr=LR)
    for index in range(len(steps)):
        whole_step(reference, index)
        optimizer.step()
        optimizer.zero_grad()
    for part, module in reference.items():
        for key, value in module.state_dict().items():
            torch.testing.assert_close(sharded["weights"][-1][f"{part}.{key}"], value, rtol=0, atol=1e-6,
                                       msg=f"{part}.{key}")
