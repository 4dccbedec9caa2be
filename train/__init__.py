"""Drafter training: what each drafter kind predicts (drafters.py), the objectives, batches, the DeepSpeed loop and
the memory plan."""
