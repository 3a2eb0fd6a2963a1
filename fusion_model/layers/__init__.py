"""The shared layers every block and model is built from, beneath them all: norms, RoPE, attention (its layer, its
backends and masks), the SwiGLU MLP and the KV cache; and the rules those layers carry (parameter roles, the
next-token loss, randomness keyed by the data). Nothing here reads a FusionConfig: layers take their sizes."""
