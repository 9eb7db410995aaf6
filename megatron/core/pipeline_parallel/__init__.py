"""Schedules of a global batch's micro-batches (schedules.py)."""
