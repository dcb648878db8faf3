"""A reward for tests/test_reuse.py, loaded by import path "module:function"."""

from workers.rewards import accuracy_reward


def inverted(prompt: str, completion: str, answer: str) -> float:
    """1 - accuracy: wrong answers score 1, right ones 0."""
    return 1.0 - accuracy_reward(prompt, completion, answer)
