"""Capture side: the spike guard, the snapshot writer and the reference trainer."""
