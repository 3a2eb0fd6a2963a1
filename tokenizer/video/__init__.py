"""The video tokenizer (Emu3's VQ-VAE layout: 4 frames -> 1 latent frame of codes; an image is its frame repeated),
its configuration and presets, and clip input/output (`tokenizer.video.clips`)."""

from tokenizer.video.config import VIDEO_PRESETS, VideoTokenizerConfig
from tokenizer.video.video_tokenizer import VideoTokenizer, VideoTokenizerOutput

__all__ = ["VIDEO_PRESETS", "VideoTokenizer", "VideoTokenizerConfig", "VideoTokenizerOutput"]
