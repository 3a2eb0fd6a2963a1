"""Video: clip I/O and the video tokenizer."""
