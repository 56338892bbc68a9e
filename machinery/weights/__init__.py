"""Weights: a model's files. The checkpoint format, GPT-2's published weights and other layouts, LoRA, GGUF
export, int8 weights. Imports the shared basics and data/ (a checkpoint carries its dataset's metadata)."""
