"""Trainers a test made, whose SuperOffload optimizers (kept after train()) the conftest
fixture ``close_trainers_optimizers`` closes when the test ends."""

OPENED_TRAINERS: list = []
