"""Batch-size histograms and the capture-size planner. Imports no torch."""
