"""Reading what a snapshot and its logs say: batch signals, outliers, gradient info, routing, log scans, plots."""
