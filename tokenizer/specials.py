"""The unified vocabulary's named special tokens and default sizes (no torch: `train.py vocab --help` reads them)."""

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
BOI, EOI = "<racm3:break>", "<eoss>"  # Chameleon's begin-image / end-image names
SEP = "<sep>"  # separator / end-of-turn (Chameleon calls its own `<reserved08706>`)
IMAGE_PLACEHOLDER = "<image>"  # what transformers' ChameleonProcessor expands into image tokens
NAMED_SPECIALS = (PAD, BOS, EOS, BOI, EOI, SEP, IMAGE_PLACEHOLDER)
DEFAULT_VOCAB_SIZE, DEFAULT_IMAGE_CODES, DEFAULT_NUM_SPECIALS = 65_536, 8_192, 16
