"""End to end: the trainer, evaluate, export, ablate and the launch scripts as processes, the
notebook and the real model. Every test here is marked `e2e` (conftest.py beside this file)."""
