"""Custom reward functions that misbehave, for tests/test_bad_input.py ("module:function")."""

import numpy as np


def infinite(prompt: str, completion: str, answer: str) -> float:
    return float("inf")


def numpy_nan(prompt: str, completion: str, answer: str):
    return np.float32("nan")


def huge_int(prompt: str, completion: str, answer: str) -> int:
    return 10 ** 400


def near_max(prompt: str, completion: str, answer: str) -> float:
    return 1e308


def a_list(prompt: str, completion: str, answer: str):
    return [1.0]


def key_error(prompt: str, completion: str, answer: str) -> float:
    return {}["score"]


def numpy_int(prompt: str, completion: str, answer: str):
    return np.int64(2)


def wrong_arity(prompt: str) -> float:
    return 1.0
