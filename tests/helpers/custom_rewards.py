"""Custom reward functions for tests/test_rewards.py, loaded by import path "module:function"."""

NOT_CALLABLE = 3


def length_bonus(prompt: str, completion: str, answer: str) -> float:
    """0.1 per character of the completion, plus 1 if the prompt ends with '='."""
    return 0.1 * len(completion) + (1.0 if prompt.endswith("=") else 0.0)


def is_exact(prompt: str, completion: str, answer: str) -> bool:
    """A bool is a number (True -> 1.0)."""
    return completion == answer


def boom(prompt: str, completion: str, answer: str) -> float:
    raise ValueError(f"cannot score {completion!r}")


def nan(prompt: str, completion: str, answer: str) -> float:
    return float("nan")


def text(prompt: str, completion: str, answer: str):
    return "high"


def none(prompt: str, completion: str, answer: str):
    return None


def long_error(prompt: str, completion: str, answer: str) -> float:
    raise RuntimeError("x" * 1000)


def huge(prompt: str, completion: str, answer: str) -> float:
    return 1e308


def huge_too(prompt: str, completion: str, answer: str) -> float:
    return 1e308


def text_checksum(prompt: str, completion: str, answer: str) -> float:
    """Sum of the completion's character codes mod 7: spread within a group whatever the model's accuracy."""
    return float(sum(map(ord, completion)) % 7)
