"""Signals from a snapshot alone: batch and routing signals, outliers, gradient info, plots."""
