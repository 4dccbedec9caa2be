"""Drafters (draft model, Medusa, EAGLE), objectives, the DeepSpeed loop, checkpoints, export."""
