"""The cause families that name a stored signal or a rank (engine log-probs, stale old log-probs, the reference,
the routing payload, one rank's batch), each a pure function of the evidence, and what they share."""
