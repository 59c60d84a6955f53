"""Training: data pipeline, tokenizers and training loops."""
