"""Shared pytest setup: keep JAX on CPU, in float32, and quiet."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
