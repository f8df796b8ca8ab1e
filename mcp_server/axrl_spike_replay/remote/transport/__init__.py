"""Reaching a node and running jobs there: SSH targets, host keys, sessions (SSH or local), jobs and their reaper."""
