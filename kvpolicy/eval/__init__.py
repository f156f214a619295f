"""Accuracy evaluation: RULER-style synthetic long-context tasks generated locally (``tasks``)."""

from .tasks import TASKS, Sample, Task, build_chat, make_sample, make_samples, score

__all__ = ["TASKS", "Sample", "Task", "build_chat", "make_sample", "make_samples", "score"]
