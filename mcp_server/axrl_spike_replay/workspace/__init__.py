"""The investigation record: task file, proven method files and the final report, rendered from templates/."""
