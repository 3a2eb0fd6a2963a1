"""`python train.py experiment <name>`: the experiments that reuse a finished demo's outputs, by name."""

from __future__ import annotations

import importlib
import sys

# name -> (module with `main(argv)`, what it compares); each main takes the argv that starts with its name
EXPERIMENTS: dict[str, tuple[str, str]] = {
    "fusion": ("experiments.fusion", "early fusion vs LLaVA / BLIP-2 / Flamingo connectors"),
    "mot": ("experiments.mot", "dense vs Mixture-of-Transformers decoders at three sizes"),
    "transfusion": ("experiments.transfusion", "Chameleon (VQ codes) vs Transfusion (latents) FD/FLOPs"),
    "video": ("experiments.video", "Emu3-style video tokens: clips from captions, checked, offline"),
    "compositional": ("experiments.compositional", "Chameleon vs MoT vs Transfusion at equal FLOPs on the scene world, scored by the scenes suite"),
    "sft": ("experiments.sft", "chat SFT of the demo's decoder: answer-only vs every-token loss, unbalanced mix, LoRA and head-only"),
}


def main(argv: list[str] | None = None) -> int:
    """Run the experiment named by argv[0]; without a known name, list them and exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in EXPERIMENTS:
        listed = "; ".join(f"{name}: {what}" for name, (_, what) in EXPERIMENTS.items())
        print(f"usage: python train.py experiment {{{','.join(EXPERIMENTS)}}} [options]  ({listed})", file=sys.stderr)
        return 2
    return int(importlib.import_module(EXPERIMENTS[argv[0]][0]).main(argv) or 0)
