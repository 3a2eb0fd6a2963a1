"""The unified vocabulary's named special tokens and default sizes (no torch: `train.py vocab --help` reads them)."""

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
BOI, EOI = "<racm3:break>", "<eoss>"  # Chameleon's begin-image / end-image names
SEP = "<sep>"  # separator / end-of-turn (Chameleon calls its own `<reserved08706>`)
IMAGE_PLACEHOLDER = "<image>"  # what transformers' ChameleonProcessor expands into image tokens
NAMED_SPECIALS = (PAD, BOS, EOS, BOI, EOI, SEP, IMAGE_PLACEHOLDER)
# Video clip markers (issue 32): a clip is `<bov>`, its t*h*w codes of the image-code block (time, then rows, then
# columns), `<eov>`. They take the first two reserved slots (`<reserved_0>`, `<reserved_1>`) of a vocabulary built
# with video (`train.py vocab --video`); a vocabulary built without them keeps its names and fingerprint.
BOV, EOV = "<bov>", "<eov>"
VIDEO_SPECIALS = (BOV, EOV)
DEFAULT_VOCAB_SIZE, DEFAULT_IMAGE_CODES, DEFAULT_NUM_SPECIALS = 65_536, 8_192, 16
