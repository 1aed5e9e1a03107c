"""Loading what the applications run on: models (default SmolLM2, HF ids, directories, GGUF) and text corpora."""
