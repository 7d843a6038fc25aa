"""Pretraining the bundled shapes model: the denoiser (`shapes.py`, `solrl shapes pretrain`) and its text encoder
(`shapes_text.py`, `solrl shapes pretrain-text`). They sit above the models and the evaluation they track, beside
the RL loop (docs/architecture.md)."""
