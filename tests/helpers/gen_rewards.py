"""Reward functions for the generator tests, loaded by import path in a subprocess."""


def boom_on_odd_length(prompt: str, completion: str, answer: str) -> float:
    """Raises for completions of odd length, so some completions of a group fail and others don't."""
    if len(completion) % 2:
        raise RuntimeError("odd length")
    return 0.5
