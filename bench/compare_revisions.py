"""This checkout against another (e.g. a `git worktree` of the commit before a refactor), side by side: the
training step through the Lightning module's loss path (forward + backward + AdamW) and the eager decode step
(text tokens/s, guided image codes/s) on the small preset, each timed in fresh processes that alternate between the two trees.

    git worktree add /tmp/before <commit>
    python -m bench.compare_revisions --before /tmp/before            # writes bench/results/revision.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# One training step through whichever loss entry point the tree under test has: the family objective
# (`objective`) now, `_losses` before the family seam. Shared by the scripts that run inside other trees.
TRAIN_STEP = r"""
def optimizer_step(module, optimizer, batch):
    if hasattr(module, "objective"):
        objective = module.objective(batch)
        loss = objective.loss(objective.counts())
    else:
        loss = module._losses(batch)["loss"]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
"""

# Runs inside the tree under test.
MEASURE = TRAIN_STEP + r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[1]))
steps, new_tokens, preset, side = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
from fusion_model.config import FusionConfig
from fusion_model.sampling import SamplingConfig, generate_ids
from fusion_model.training.lightning_module import FusionLightningModule
from tokenizer.vocab import train_unified_vocab

corpus = ["In the beginning God created the heaven and the earth.", "And the earth was without form."] * 20
vocab_size = max(FusionConfig.from_preset(preset).vocab_size, 512)  # byte-level BPE needs 256 text ids
vocab = train_unified_vocab(corpus, vocab_size=vocab_size, image_codes=vocab_size // 4)
torch.manual_seed(0)
config = FusionConfig.from_preset(preset, vocab_size=vocab_size, image_offset=vocab.image_offset,
                                  image_codes=vocab.image_codes)
length = min(256, config.max_seq_len)
module = FusionLightningModule(config)
ids = torch.randint(vocab.image_offset, vocab.vocab_size, (4, length), generator=torch.Generator().manual_seed(0))
documents = (torch.arange(length) >= length * 5 // 8).long().repeat(4, 1)
batch = {"input_ids": ids, "document_ids": documents}
optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True)

def train_step():
    optimizer_step(module, optimizer, batch)

for _ in range(2):
    train_step()
start = time.perf_counter()
for _ in range(steps):
    train_step()
train = (time.perf_counter() - start) / steps

model = module.model.eval()
prompt = [vocab.bos_id, *vocab.encode_text("In the beginning")]
def decode(config, count):
    generate_ids(model, vocab, [prompt], config)  # warm
    start = time.perf_counter()
    generate_ids(model, vocab, [prompt], config)
    return count / (time.perf_counter() - start)

text = decode(SamplingConfig(mode="text", max_new_tokens=new_tokens, text_temperature=0, stop_at_eos=False),
              new_tokens)
image = decode(SamplingConfig(mode="image", image_grid=(side, side), cfg_scale=3.0, seed=0), side * side)
print(json.dumps({"train_step_s": train, "text_tokens_per_s": text, "image_codes_per_s": image}))
"""


def measure(tree: Path, threads: int, steps: int, new_tokens: int, smoke: bool = False) -> dict[str, float]:
    """One fresh process in `tree`: its train-step seconds and decode rates (smoke: the tiny preset, 2x2 images)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    sizes = ["tiny", "2"] if smoke else ["small", "8"]
    result = subprocess.run([sys.executable, "-c", MEASURE, str(threads), str(steps), str(new_tokens), *sizes],
                            cwd=tree,
                            env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"measuring {tree} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Alternate before/after rounds; print medians and after/before ratios; write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the other checkout (a git worktree of the earlier commit)")
    parser.add_argument("--rounds", type=int, default=5, help="processes per tree, alternating")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    parser.add_argument("--steps", type=int, default=8, help="timed training steps per process")
    parser.add_argument("--new-tokens", type=int, default=64, help="text tokens decoded per timing")
    parser.add_argument("--out", default=str(REPO / "bench/results/revision.json"), help="results file")
    parser.add_argument("--smoke", action="store_true", help="the tiny preset and 2x2 images: proves the script runs")
    args = parser.parse_args(argv)
    trees = {"before": Path(args.before).resolve(), "after": REPO}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for round_ in range(args.rounds):
        for name, tree in trees.items():
            runs[name].append(measure(tree, args.threads, args.steps, args.new_tokens, args.smoke))
        print(f"round {round_ + 1}/{args.rounds}: " + "; ".join(
            f"{name} {json.dumps({k: round(v, 4) for k, v in runs[name][-1].items()})}" for name in trees),
            file=sys.stderr, flush=True)
    medians = {name: {key: statistics.median(run[key] for run in runs[name]) for key in runs[name][0]}
               for name in trees}
    # > 1 means the new tree is faster (a rate up, a step time down)
    ratios = {"train_step_speed": medians["before"]["train_step_s"] / medians["after"]["train_step_s"],
              "text_decode_speed": medians["after"]["text_tokens_per_s"] / medians["before"]["text_tokens_per_s"],
              "image_decode_speed": medians["after"]["image_codes_per_s"] / medians["before"]["image_codes_per_s"]}
    result = {"before": str(trees["before"]), "rounds": args.rounds, "threads": args.threads, "smoke": args.smoke,
              "preset": "tiny" if args.smoke else "small", "medians": medians,
              "after_over_before_speed": ratios, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for name, ratio in ratios.items():
        print(f"{name}: after / before = {ratio:.3f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
