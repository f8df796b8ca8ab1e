"""Method files: one proven mitigation per file, its name, front matter and key signals, a sweep's write-up, and the
files after a release."""
