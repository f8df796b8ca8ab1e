"""Training math shared by capture and replay: policy loss under each convention, rank step, routing replay."""
