"""Reading what we did not write: bytes, JSON and YAML with bounds, and staying inside a tree."""
