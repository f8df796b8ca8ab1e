"""What a snapshot, its log and the replayed model show before any cause is named: log scans, signal readings,
model evidence, ratio shapes."""
