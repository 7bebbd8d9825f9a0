"""Qwen3.5 text model: config, loader, layers and the causal LM."""
