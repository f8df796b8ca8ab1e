"""Reading training logs at disk speed: lines, columns, key=value runs, series, copies. On the ground modules alone."""
