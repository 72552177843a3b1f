"""Test package: lets spawned gloo ranks import test modules as ``tests.<name>``."""
