"""`python train.py fit --config configs/fusion/<preset>.yaml`: the token-shard data module, start-up checks, LightningCLI."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI

from fusion_model.config import FusionConfig
from fusion_model.training.lightning_module import FusionLightningModule, NonFiniteLossError


class StartupError(ValueError):
    """The configuration cannot train on these shards; the message says what to change."""


def check_startup(
    config: FusionConfig,
    seq_len: int,
    train_manifest: dict,
    train_dir: str,
    val_manifest: dict | None = None,
    vocab=None,
    image_tokenizer_fingerprint: str | None = None,
) -> None:
    """Raise StartupError when the model, the tokenizers and the shards do not belong together."""
    if seq_len > config.max_seq_len:
        raise StartupError(
            f"data.seq_len={seq_len} exceeds the model's max positions (model.config.max_seq_len="
            f"{config.max_seq_len}); lower --data.seq_len or raise --model.config.max_seq_len"
        )
    if train_manifest["vocab_size"] != config.vocab_size:
        raise StartupError(
            f"the shards in {train_dir} were tokenized with a {train_manifest['vocab_size']}-entry vocabulary but "
            f"model.config.vocab_size={config.vocab_size}; set --model.config.vocab_size {train_manifest['vocab_size']}"
        )
    if vocab is not None:
        if vocab.vocab_size != config.vocab_size:
            raise StartupError(
                f"the tokenizer has {vocab.vocab_size} entries but model.config.vocab_size={config.vocab_size}; "
                f"set --model.config.vocab_size {vocab.vocab_size}"
            )
        if train_manifest["vocab_fingerprint"] != vocab.fingerprint():
            raise StartupError(
                f"the shards in {train_dir} were tokenized with another vocabulary (fingerprint "
                f"{train_manifest['vocab_fingerprint']}, data.tokenizer has {vocab.fingerprint()}); re-run "
                "`train.py shards tokenize` with this tokenizer, or point --data.tokenizer at the one used"
            )
        if config.image_offset is None:
            raise StartupError(
                f"model.config has no image block, so image targets would count as text; set --model.config.image_offset "
                f"{vocab.image_offset} --model.config.image_codes {vocab.image_codes} (the tokenizer's)"
            )
        if (config.image_offset, config.image_codes) != (vocab.image_offset, vocab.image_codes):
            raise StartupError(
                f"model.config image block (offset {config.image_offset}, {config.image_codes} codes) differs from the "
                f"tokenizer's (offset {vocab.image_offset}, {vocab.image_codes} codes); set --model.config.image_offset "
                f"{vocab.image_offset} --model.config.image_codes {vocab.image_codes}"
            )
    if image_tokenizer_fingerprint is not None and train_manifest["image_tokenizer_fingerprint"] != image_tokenizer_fingerprint:
        raise StartupError(
            f"the shards in {train_dir} were tokenized with another image tokenizer (fingerprint "
            f"{train_manifest['image_tokenizer_fingerprint']}, data.image_tokenizer has {image_tokenizer_fingerprint}); "
            "re-run `train.py shards tokenize` with this image tokenizer, or point --data.image_tokenizer at the one used"
        )
    if val_manifest is not None:
        for field in ("vocab_fingerprint", "image_tokenizer_fingerprint", "vocab_size"):
            if val_manifest[field] != train_manifest[field]:
                raise StartupError(
                    f"validation shards differ from the training shards in {field} ({val_manifest[field]} vs "
                    f"{train_manifest[field]}); tokenize both with the same vocabulary and image tokenizer"
                )


def _manifest(directory: str, role: str) -> dict:
    from data_shards.token_shards import read_manifest

    path = Path(directory)
    if not path.is_dir() or not (path / "manifest.json").is_file():
        found = sorted(p.name for p in path.glob("*"))[:5] if path.is_dir() else []
        raise StartupError(
            f"no token shards found for {role} in {path} ({'directory missing' if not path.is_dir() else f'no manifest.json; contents: {found}'}); "
            f"run `train.py shards tokenize --out {path} ...` first or fix --data.{role}_dir"
        )
    return read_manifest(path)


class FusionDataModule(L.LightningDataModule):
    """Packed batches from pre-tokenized shards, split across ranks by the stream; resumable mid-epoch."""

    def __init__(
        self,
        train_dir: str = "data/tokens/train",
        val_dir: str | None = None,
        seq_len: int = 4096,
        batch_size: int = 1,
        num_workers: int = 2,
        seed: int = 0,
        shuffle: bool = True,
        tokenizer: str | None = None,
        image_tokenizer: str | None = None,
    ) -> None:
        """train_dir/val_dir: token-shard directories; batch_size is per device (micro-batch);
        tokenizer (tokenizer.json) and image_tokenizer (a save_pretrained dir) enable the fingerprint checks."""
        super().__init__()
        self.save_hyperparameters()
        self.train_dir, self.val_dir = train_dir, val_dir
        self.seq_len, self.batch_size, self.num_workers = seq_len, batch_size, num_workers
        self.seed, self.shuffle = seed, shuffle
        self.tokenizer, self.image_tokenizer = tokenizer, image_tokenizer

    def setup(self, stage: str) -> None:
        """Start-up validation against the model (runs on every rank before the first batch)."""
        train_manifest = _manifest(self.train_dir, "train")
        val_manifest = _manifest(self.val_dir, "val") if self.val_dir else None
        vocab = fingerprint = None
        if self.tokenizer:
            from tokenizer.vocab import UnifiedVocab

            vocab = UnifiedVocab.load(self.tokenizer)
        if self.image_tokenizer:
            from tokenizer.image import ImageTokenizer

            fingerprint = ImageTokenizer.from_pretrained(self.image_tokenizer).fingerprint()
        config = self.trainer.lightning_module.model_config if self.trainer is not None else None
        if config is not None:
            check_startup(config, self.seq_len, train_manifest, self.train_dir, val_manifest, vocab, fingerprint)

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def _loader(self, directory: str, shuffle: bool, num_workers: int):
        from data_shards.stream import PackedTokenStream, make_dataloader

        rank, world = self._rank_world()
        stream = PackedTokenStream(directory, self.seq_len, self.batch_size, seed=self.seed, rank=rank,
                                   world_size=world, shuffle=shuffle)
        return make_dataloader(stream, num_workers=num_workers)

    def train_dataloader(self):
        """Training loader (its state_dict travels in Lightning checkpoints: exact mid-epoch resume)."""
        return self._loader(self.train_dir, self.shuffle, self.num_workers)

    def val_dataloader(self):
        """Held-out shards in a fixed order (limit with trainer.limit_val_batches)."""
        if not self.val_dir:
            return []
        return self._loader(self.val_dir, False, min(self.num_workers, 1))


class FusionCLI(LightningCLI):
    """LightningCLI with the project's defaults: fp32 on CPU, bf16-mixed on GPU, atomic checkpoints."""

    def add_arguments_to_parser(self, parser) -> None:
        """Every option stays settable from the command line; the YAML presets fill them in."""
        parser.set_defaults({
            "trainer.plugins": [{"class_path": "fusion_model.training.checkpointing.AtomicCheckpointIO"}],
            # the stream splits the data by rank itself; a re-built DataLoader would lose its resumable state
            "trainer.use_distributed_sampler": False,
        })

    def before_instantiate_classes(self) -> None:
        """Pick the precision from the hardware when the config leaves it unset."""
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        if config.trainer.get("precision") is None:
            config.trainer.precision = "bf16-mixed" if torch.cuda.is_available() else "32-true"


def fit_from_config(config: str | Path | None = None, overrides: list[str] | None = None, run: bool = True) -> FusionCLI:
    """Train (or, with run=False, only build) from a YAML config plus command-line style overrides.

    Returns the CLI object: `.model` (FusionLightningModule), `.datamodule`, `.trainer`. The demo uses this.
    """
    args = ([f"--config={config}"] if config is not None else []) + list(overrides or [])
    if run:
        args = ["fit", *args]
    with warnings.catch_warnings():
        # train.py passes its own argv on explicitly; LightningCLI warns when sys.argv has arguments too
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
        return FusionCLI(
            FusionLightningModule,
            FusionDataModule,
            args=args,
            run=run,
            save_config_kwargs={"overwrite": True},
            seed_everything_default=0,
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point of `train.py fit`; configuration errors print one clear line instead of a traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        fit_from_config(None, argv)
    except (StartupError, NonFiniteLossError) as err:
        print(f"train.py fit: {err}", file=sys.stderr)
        return 2 if isinstance(err, StartupError) else 1
    return 0
