"""Runnable examples of triaccel (`python -m examples.cifar.train`)."""
