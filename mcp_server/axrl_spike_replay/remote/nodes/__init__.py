"""What a node has and what a run there gives: the probe, installing this package, results of remote runs."""
