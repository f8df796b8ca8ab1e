"""Snapshot format v1 on disk: discover, preserve, release, read safely, legacy fix, field aliases."""
