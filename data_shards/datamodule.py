"""FusionDataModule: the Lightning data module of `train.py fit`: packed batches from token shards, split across
ranks by the stream, resumable mid-epoch, and checked against the model and tokenizers before the first batch."""

from __future__ import annotations

import weakref
from pathlib import Path

import lightning as L

from common.compat import check_compatible
from data_shards.epoch_layout import DEFAULT_SHUFFLE_WINDOW
from data_shards.loader import make_dataloader
from data_shards.packed_stream import PackedTokenStream
from data_shards.plan import read_index
from data_shards.token_shards import LATENT_KIND


def _manifest(directory: str, role: str) -> dict:
    """The manifest's fields (but its shard list: the checks need none of it) of the `role` shards, from the dataset
    index."""
    path = Path(directory)
    if not path.is_dir() or not (path / "manifest.json").is_file():
        found = sorted(p.name for p in path.glob("*"))[:5] if path.is_dir() else []
        raise FileNotFoundError(
            f"no token shards found for {role} in {path} ({'directory missing' if not path.is_dir() else f'no manifest.json; contents: {found}'}); "
            f"run `train.py shards tokenize --out {path} ...` first or fix --data.{role}_dir"
        )
    return read_index(path).header


def check_image_kind(directory: str, manifest: dict, batch_keys: tuple[str, ...]) -> None:
    """Refuse shards whose images are of the other kind than the model reads: continuous latents for a model of
    image codes, or codes for a model of latents (Transfusion)."""
    latent = manifest.get("feature_kind") == LATENT_KIND
    if latent and "image_latents" not in batch_keys:
        raise ValueError(f"{directory} holds continuous image latents (tokenized with a continuous image tokenizer, "
                         "Transfusion's): this model reads image codes; train these shards with --model.family "
                         "transfusion, or tokenize the images with a VQ image tokenizer into a fresh directory")
    if "image_latents" in batch_keys and not latent:
        raise ValueError(f"{directory} holds {'image codes' if manifest.get('images') else 'no images'}, not "
                         "continuous latents: a transfusion model reads latents; tokenize with a continuous image "
                         "tokenizer (`train.py tokenizer fit --config configs/tokenizer/kl-demo-64.yaml`, then "
                         "`shards tokenize --image-tokenizer` its bundle) into a fresh directory")


def check_conversations(directory: str, manifest: dict, batch_keys: tuple[str, ...],
                        family_name: str | None = None) -> None:
    """Refuse shards holding conversations for a model whose objective reads no `target_mask` (no answer-only
    loss): trained there, a conversation's prompts would be scored like its answers."""
    count = int(manifest.get("conversations") or 0)
    if count and "target_mask" not in batch_keys:
        whose = f"the {family_name} family's objective" if family_name else "this model's objective"
        raise ValueError(f"{directory} holds {count} conversations, whose loss is on the answers only; {whose} has "
                         "no answer-only loss: train conversations with --model.family chameleon (dense or MoT)")


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
        vocab: str | None = None,
        image_tokenizer: str | None = None,
        image_features: bool | None = None,
        shuffle_window: int = DEFAULT_SHUFFLE_WINDOW,
        answer_only: bool = True,
    ) -> None:
        """train_dir/val_dir: token-shard directories; batch_size is per device (micro-batch);
        vocab (tokenizer.json) and image_tokenizer (a bundle directory) enable the fingerprint checks;
        image_features: batches carry the shards' image features (None: when the model reads them, i.e. a
        late-fusion model); shuffle_window: rows (positions) shuffled together after the seeded shard permutation;
        answer_only: for conversations (chat SFT shards), the loss is on the trained roles' turns only (the answers,
        `shards tokenize --train-roles`); False puts it on every token (an ablation; conversations are still never
        cut). Batches carry `target_mask` when the model reads it (its `batch_keys`)."""
        super().__init__()
        self.save_hyperparameters()
        self.train_dir, self.val_dir = train_dir, val_dir
        self.seq_len, self.batch_size, self.num_workers = seq_len, batch_size, num_workers
        self.seed, self.shuffle, self.shuffle_window = seed, shuffle, shuffle_window
        self.vocab, self.image_tokenizer = vocab, image_tokenizer
        self.image_features = image_features
        self.answer_only = answer_only
        self._checked = None  # the model config `check` last accepted
        # the loaders made, closed at teardown; weak, so a loader Lightning drops (reloaded each epoch) is freed
        self._loaders: weakref.WeakSet = weakref.WeakSet()

    def setup(self, stage: str) -> None:
        """Start-up validation against the model (runs on every rank before the first batch)."""
        module = self.trainer.lightning_module if self.trainer is not None else None
        config = getattr(module, "model_config", None)
        if config is not None and config is not self._checked:
            self.check(config, tuple(getattr(module, "batch_keys", ())))

    def check(self, config, batch_keys: tuple[str, ...] | None = None) -> None:
        """Refuse shards, vocabulary or image tokenizer that do not fit the model config (FusionConfig) or what the
        model reads (`batch_keys`: continuous latents or image codes); `fit` calls this before the trainer starts,
        so a refused start leaves no log or checkpoint folders."""
        train_manifest = _manifest(self.train_dir, "train")
        val_manifest = _manifest(self.val_dir, "val") if self.val_dir else None
        if batch_keys is not None:
            for directory, manifest in ((self.train_dir, train_manifest), (self.val_dir, val_manifest)):
                if manifest is not None:
                    check_image_kind(directory, manifest, batch_keys)
                    check_conversations(directory, manifest, batch_keys)
        vocab = fingerprint = None
        if self.vocab:
            from tokenizer.vocab import UnifiedVocab

            vocab = UnifiedVocab.load(self.vocab)
        if self.image_tokenizer:
            from tokenizer.bundle import load_media_tokenizer

            fingerprint = load_media_tokenizer(self.image_tokenizer).fingerprint()
        check_compatible(model=config, vocab=vocab, image_tokenizer_fingerprint=fingerprint, shards=train_manifest,
                         shards_dir=self.train_dir, val_shards=val_manifest, seq_len=self.seq_len, training=True)
        self._checked = config

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def _loader(self, directory: str, shuffle: bool, num_workers: int, training: bool = False):
        rank, world = self._rank_world()
        module = self.trainer.lightning_module if self.trainer is not None else None
        # what the model reads beyond ids (the module's `batch_keys`), and how it counts its loss terms
        # (`window_denominators`): duck-typed, since the data layer does not import the model layers
        wanted = tuple(getattr(module, "batch_keys", ()))
        features = self.image_features
        if features is None:
            features = "image_features" in wanted
        latents = "image_latents" in wanted
        window = self.trainer.accumulate_grad_batches if training and self.trainer is not None else 1
        # accumulate: an optimizer step reads the rows of one batch of batch_size x window, whatever the split
        stream = PackedTokenStream(directory, self.seq_len, self.batch_size, seed=self.seed, rank=rank,
                                   world_size=world, shuffle=shuffle, image_features=features and not latents,
                                   image_latents=latents,
                                   token_keys="token_keys" in wanted, accumulate=window,
                                   shuffle_window=self.shuffle_window, target_mask="target_mask" in wanted,
                                   answer_only=self.answer_only)
        # training: a damaged shard reaches the step as a flagged batch, which stops every rank at that step
        loader = make_dataloader(stream, num_workers=num_workers, window=window,
                                 count=getattr(module, "window_denominators", None), share_errors=training)
        self._loaders.add(loader)
        return loader

    def teardown(self, stage: str) -> None:
        """End the background shard checks of every loader made (none outlives the run that read it)."""
        for loader in list(self._loaders):
            loader.close()

    def train_dataloader(self):
        """Training loader (its state_dict travels in Lightning checkpoints: exact mid-epoch resume); with gradient
        accumulation it reads each optimizer step ahead, so every loss term is divided by its count over the step."""
        return self._loader(self.train_dir, self.shuffle, self.num_workers, training=True)

    def val_dataloader(self):
        """Held-out shards in a fixed order (limit with trainer.limit_val_batches)."""
        if not self.val_dir:
            return []
        return self._loader(self.val_dir, False, min(self.num_workers, 1))
